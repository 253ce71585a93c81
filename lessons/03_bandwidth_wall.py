"""Lesson 03 — the bandwidth wall: why batching helps decode, and where it stops helping.

One decode step of one sequence reads every weight (540 MB for SmolLM2 in fp32, 270 MB in bf16)
to do about two FLOPs per weight: the processor mostly waits for memory. Decoding B sequences
together reads the weights once for all B, so throughput grows almost linearly with B — until the
step has enough arithmetic per byte that the cores, not memory, are the limit — or until the work
that batching cannot share (each sequence's own attention over its own KV) takes over. We measure
both roofs on this machine (every thread reading a large buffer; a large matmul in the engine's
precision) and where the engine's step sits between them at each batch size. The engine runs in
this machine's fastest precision (`dtype="auto"`: bf16 where the CPU has bf16 instructions).

Then the other way over the wall at batch 1: read fewer bytes. The checkpoint came from a Q4_1
GGUF file; its own blocks (4 bits a weight plus a scale and a minimum per 32) can be read in place
and dequantized in registers (`--weights q4_1`), and a layer's twenty-odd small operations fused
into two C++ calls (`--fused-decode`). The second table times those rows side by side.

Last, batch 1 as its conversation grows: every step also reads the KV cache of the whole context,
so past some length the cache, not the weights, is what a token waits for. The third table times
the engine's step after prompts of growing length (`bench decode --contexts`), the KV in the
model's dtype and in int8, with the attention's share of the step.

`--shape llama-3.2-1b` (or qwen3-0.6b, qwen2.5-1.5b) runs a 1B-class model's real config on random
weights instead (a step's time does not depend on the weights' values): there the bytes, not the
small operations, set batch 1's pace.

    python lessons/03_bandwidth_wall.py [--quick] [--out DIR] [--shape NAME]
"""

import textwrap
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from _common import console, lesson_args, lesson_model, save_numbers, save_plot, shape_option, table  # noqa: E402

from minillm.benchmarks import copy_bandwidth, read_bandwidth  # noqa: E402
from minillm.benchmarks.decode import weight_bytes_read  # noqa: E402
from minillm.benchmarks.step_profile import bench_step_profile  # noqa: E402
from minillm.config import DTYPES, ConfigError, resolve_dtype  # noqa: E402
from minillm.engine import LLM, SamplingParams  # noqa: E402
from minillm.weights import load_model  # noqa: E402

PROMPT_LEN = 64
CONTEXTS = {"quick": ([128, 1024], 8), "default": ([256, 1024, 4096], 16)}  # (contexts, new tokens)


def matmul_flops(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def decode_step_time(model, batch: int, timed_steps: int) -> float:
    """Seconds per decode step with `batch` sequences, prefill excluded."""
    dtype = str(model.dtype).removeprefix("torch.")
    llm = LLM(model=model, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT_LEN)
    engine = llm.engine
    for i in range(batch):
        engine.add_request(
            [(7 * i + j) % 1000 + 100 for j in range(PROMPT_LEN)],
            SamplingParams(max_tokens=timed_steps + 3, ignore_eos=True),
        )
    engine.step()  # every prompt in one prefill step
    engine.step()  # one decode step untimed: the first at a new batch size may pack bf16 weights
    start = time.perf_counter()
    for _ in range(timed_steps):
        engine.step()
    return (time.perf_counter() - start) / timed_steps


def measure_batches(model, batches, timed_steps, weight_bytes, bandwidth, flops):
    """Time a decode step at each batch size; print and return tokens/s and each roof's share."""
    params = sum(p.numel() for p in model.parameters())
    kv_per_token = model.config.kv_bytes_per_token(model.dtype)
    rows, throughput, bw_fraction, flop_fraction = [], [], [], []
    for batch in batches:
        step = decode_step_time(model, batch, timed_steps)
        context = PROMPT_LEN + timed_steps / 2
        step_bytes = weight_bytes + batch * context * kv_per_token
        step_flops = 2 * params * batch
        throughput.append(batch / step)
        bw_fraction.append(step_bytes / step / bandwidth)
        flop_fraction.append(step_flops / step / flops)
        rows.append(
            [
                batch,
                f"{step * 1e3:.0f}",
                f"{batch / step:.0f}",
                f"{step_bytes / step / 1e9:.1f}",
                f"{bw_fraction[-1]:.0%}",
                f"{step_flops / step / 1e9:.1f}",
                f"{flop_fraction[-1]:.0%}",
            ]
        )
    table(
        "decode, one step = one token for every sequence",
        ["batch", "ms/step", "tok/s", "GB/s read", "of read roof", "GFLOP/s", "of matmul roof"],
        rows,
    )
    return throughput, bw_fraction, flop_fraction


# batch 1 with the weights read four ways: (label, EngineConfig.weights, fused_decode)
WEIGHT_ROWS = [
    ("dense, in the model's dtype", "model", False),
    ("Q4_1 blocks, unfused", "q4_1", False),
    ("Q4_1 blocks, fused layers", "q4_1", True),
    ("Q8_0 blocks made here, fused", "int8", True),
]


def measure_weight_formats(model_dir, dtype: str, timed_steps: int, bandwidth: float) -> dict:
    """Batch-1 decode steps with each WEIGHT_ROWS format, the bytes each step reads beside them."""
    rows, results = [], {}
    for label, weights, fused in WEIGHT_ROWS:
        try:
            model = load_model(model_dir, DTYPES[dtype], weights=weights, fused=fused)
        except ConfigError as err:  # no Q4_1 blocks fetched, or no C++ kernels here
            console.print(f"[dim]{label}: left out ({err})[/dim]")
            continue
        step = decode_step_time(model, 1, timed_steps)
        kv = (PROMPT_LEN + timed_steps / 2) * model.config.kv_bytes_per_token(model.dtype)
        step_bytes = weight_bytes_read(model) + kv
        results[label] = {
            "ms_per_step": step * 1e3,
            "mb_per_step": step_bytes / 1e6,
            "roof": step_bytes / step / bandwidth,
        }
        rows.append(
            [
                label,
                f"{step_bytes / 1e6:.0f}",
                f"{step * 1e3:.1f}",
                f"{1 / step:.0f}",
                f"{step_bytes / step / 1e9:.1f}",
                f"{results[label]['roof']:.0%}",
            ]
        )
    table(
        f"batch 1, {dtype}: what the products read",
        ["weights", "MB/step", "ms/step", "tok/s", "GB/s read", "of read roof"],
        rows,
    )
    return results


def plot_roofs(batches, throughput, bw_fraction, flop_fraction, formats: dict, out):
    fig, (left, middle, right) = plt.subplots(
        1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1, 1, 1.2]}
    )
    left.plot(batches, throughput, marker="o", label="measured")
    left.plot(batches, [throughput[0] * b for b in batches], linestyle="--", label="perfect scaling")
    left.set(
        xscale="log",
        yscale="log",
        xlabel="batch size (log)",
        ylabel="tokens/s (log)",
        title=f"Decode throughput: {throughput[-1] / throughput[0]:.1f}x at batch {batches[-1]}",
    )
    middle.plot(batches, [f * 100 for f in bw_fraction], marker="o", label="read bandwidth used")
    middle.plot(batches, [f * 100 for f in flop_fraction], marker="s", label="compute used")
    middle.set(xscale="log", xlabel="batch size (log)", ylabel="% of measured roof", title="Which roof binds")
    middle.set_ylim(0, 1.3 * 100 * max(bw_fraction + flop_fraction))  # room above the curves for the legend
    for ax in (left, middle):
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.legend(loc="upper left", fontsize=8)
    plot_formats(right, formats)
    fig.tight_layout()
    save_plot(fig, out, "03_bandwidth_wall.png")


def plot_formats(ax, formats: dict) -> None:
    """The second table: batch-1 ms per token with each weight format, its MB per step on the bar."""
    if not formats:
        ax.set_axis_off()
        ax.set_title("Batch 1 by weight format: left out here")
        return
    labels = [textwrap.fill(label, 18) for label in formats]
    bars = ax.barh(labels, [r["ms_per_step"] for r in formats.values()], color="tab:gray")
    ax.bar_label(bars, [f" {r['mb_per_step']:.0f} MB a step" for r in formats.values()], fontsize=8)
    ax.invert_yaxis()
    ax.margins(x=0.35)
    fastest = min(formats, key=lambda label: formats[label]["ms_per_step"])
    first = next(iter(formats))
    speedup = formats[first]["ms_per_step"] / formats[fastest]["ms_per_step"]
    ax.set_xlabel("ms per token, batch 1")
    ax.set_title(f"Batch 1 by weight format\nfastest: {fastest}, {speedup:.1f}x {first.split(',')[0]}")


def measure_contexts(model_dir, dtype: str, contexts: list[int], tokens: int) -> dict:
    """Batch 1 after a prompt of each context length, KV in the model's dtype and in int8: kv ->
    context -> ms per token, attention's share of the step, KV bytes per token and per step."""
    report = bench_step_profile(model_dir, dtype, PROMPT_LEN, tokens, 1, profile=False, contexts=contexts)
    by_kv, rows = {}, []
    for r in report["contexts"]:
        by_kv.setdefault(r["kv"], {})[r["context"]] = {
            "ms_per_token": r["ms_per_token"],
            "attention_share": r["attention_share"],
            "kv_bytes_per_token": r["kv_bytes_per_token"],
            "kv_mb_per_step": r["kv_bytes_per_step"] / 1e6,
        }
        rows.append(
            [
                r["kv"],
                r["prompt_len"],
                f"{r['kv_bytes_per_step'] / 1e6:.1f}",
                f"{r['attention_share']:.0%}",
                f"{r['ms_per_token']:.1f}",
            ]
        )
    table(
        f"batch 1 as the context grows, weights {report['contexts'][0]['weights']}, {tokens} new tokens",
        ["KV", "context", "KV MB read/step", "attention", "ms/token"],
        rows,
    )
    return by_kv


def plot_contexts(by_kv: dict, out) -> None:
    """ms per token against the context, one line a KV format, the attention's share beside it."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kv, rows in by_kv.items():
        contexts = list(rows)
        left.plot(contexts, [r["ms_per_token"] for r in rows.values()], marker="o", label=f"KV {kv}")
        right.plot(
            contexts, [100 * r["attention_share"] for r in rows.values()], marker="o", label=f"KV {kv}"
        )
    left.set(xscale="log", xlabel="context, tokens (log)", ylabel="ms per token", title="Batch 1 by context")
    right.set(xscale="log", xlabel="context, tokens (log)", ylabel="% of the step", title="Attention's share")
    right.axhline(50, color="gray", linestyle=":", linewidth=1)
    for ax in (left, right):
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    save_plot(fig, out, "03_context_wall.png")


def main():
    args = lesson_args(__doc__, shape_option)
    model_dir, name = lesson_model(args)
    batches, timed_steps = ([1, 4, 16], 4) if args.quick else ([1, 2, 4, 8, 16, 32], 12)
    dtype = resolve_dtype("auto")
    model = load_model(model_dir, DTYPES[dtype])
    weight_bytes = sum(p.nbytes for p in model.parameters())
    copy, flops = copy_bandwidth(), matmul_flops(DTYPES[dtype])
    bandwidth = read_bandwidth() or copy / 2  # no CPU kernels: half the copy roof (a copy reads and writes)
    console.print(
        f"this machine now: read bandwidth {bandwidth / 1e9:.1f} GB/s (copy {copy / 1e9:.1f}), "
        f"{dtype} matmul {flops / 1e9:.0f} GFLOP/s; {dtype} weights {weight_bytes / 1e6:.0f} MB, "
        f"so batch 1 can reach at most {bandwidth / weight_bytes:.0f} tokens/s"
    )

    throughput, bw_fraction, flop_fraction = measure_batches(
        model, batches, timed_steps, weight_bytes, bandwidth, flops
    )
    formats = measure_weight_formats(model_dir, dtype, timed_steps, bandwidth)
    plot_roofs(batches, throughput, bw_fraction, flop_fraction, formats, args.out)
    by_context = measure_contexts(model_dir, dtype, *CONTEXTS["quick" if args.quick else "default"])
    plot_contexts(by_context, args.out)
    save_numbers(
        args.out,
        "03_bandwidth_wall.json",
        {
            "largest_batch": batches[-1],
            "tokens_per_s_batch_1": throughput[0],
            "tokens_per_s_largest_batch": throughput[-1],
            "speedup_largest_batch": throughput[-1] / throughput[0],
            "dtype": dtype,
            "read_roof_tokens_per_s": bandwidth / weight_bytes,
            "read_roof_fraction_batch_1": bw_fraction[0],
            "matmul_roof_fraction_batch_1": flop_fraction[0],
            "read_roof_fraction_largest_batch": bw_fraction[-1],
            "matmul_roof_fraction_largest_batch": flop_fraction[-1],
            "batch_1_by_weights": formats,
            "batch_1_by_context": by_context,
        },
    )
    console.print(batch_meaning(name, batches, throughput, bw_fraction, flop_fraction))
    console.print(formats_meaning(formats))
    console.print(contexts_meaning(by_context))


def batch_meaning(name: str, batches, throughput, bw_fraction, flop_fraction) -> str:
    """What the batch table says, from its numbers: how close batch 1 gets to the read roof, what
    the rest of its time is, and what batching bought."""
    rest = (
        "The rest of its time is not bytes but some 800 small operations per step (norms, RoPE, "
        "residuals, attention calls; 794 in a bf16 step of SmolLM2 on dense weights, counted with "
        f"torch.profiler on 2026-12-07), each a few microseconds of dispatch: {name}'s layers are too "
        "small to hide them."
        if bw_fraction[0] < 0.5
        else f"At {name}'s size the bytes dominate: the step is up against the wall itself."
    )
    return (
        f"\n[bold]What it means:[/bold] batch 1 is a weight read with little math: the engine's step "
        f"reads at {bw_fraction[0]:.0%} of the read roof and uses {flop_fraction[0]:.0%} of the matmul "
        f"roof. {rest} Batching shares the read, {throughput[-1] / throughput[0]:.1f}x the tokens/s at "
        f"batch {batches[-1]} ({flop_fraction[-1]:.0%} of the matmul roof): the wall batch 1 hits is "
        "memory plus overhead, and batching is how a server climbs it."
    )


def formats_meaning(formats: dict) -> str:
    """What the weights table says, from its numbers, including when blocks did not pay."""
    dense, fused = formats.get(WEIGHT_ROWS[0][0]), formats.get(WEIGHT_ROWS[2][0])
    if not (dense and fused):
        return "The Q4_1 rows need the blocks weights_fetch.py writes and the C++ kernels: left out here."
    unfused = formats.get(WEIGHT_ROWS[1][0])
    speedup = dense["ms_per_step"] / fused["ms_per_step"]
    verdict = "pays" if speedup > 1.05 else "does not pay here"
    return (
        f"A single conversation is the other wall: reading the checkpoint's Q4_1 blocks "
        f"({fused['mb_per_step']:.0f} MB a step against {dense['mb_per_step']:.0f}) and fusing each layer "
        f"{verdict}: {dense['ms_per_step']:.1f} -> {fused['ms_per_step']:.1f} ms a token ({speedup:.2f}x), "
        + (f"{unfused['ms_per_step']:.1f} ms with the blocks but unfused; " if unfused else "")
        + f"the fused step reads at {fused['roof']:.0%} of the read roof. The blocks' values are the fp32 "
        "checkpoint's, so nothing is lost; what is left is unpacking 4-bit numbers, which costs the "
        "cores more instructions per byte than bf16 does."
    )


def contexts_meaning(by_context: dict) -> str:
    """What the context table says, from its numbers: where attention is most of the step, and
    what int8 KV buys at the longest context."""
    kvs = list(by_context)
    dense, int8 = by_context[kvs[0]], by_context[kvs[-1]]
    last = list(dense)[-1]
    ratio = dense[last]["kv_bytes_per_token"] / int8[last]["kv_bytes_per_token"]
    return (
        "A long conversation is the third wall: each step reads the whole context's KV, so "
        + "; ".join(attention_said(kv, rows) for kv, rows in by_context.items())
        + f". int8 KV reads {ratio:.1f}x fewer bytes a token: at {last:,} tokens its step takes "
        f"{int8[last]['ms_per_token']:.1f} ms against {dense[last]['ms_per_token']:.1f}."
    )


def attention_said(kv: str, rows: dict) -> str:
    """From which context attention is most of the step; where it never is here, its share at the
    longest context and near which context it would pass half, growing on as it grew here."""
    past_half = [context for context, r in rows.items() if r["attention_share"] >= 0.5]
    if past_half:
        return f"with {kv} KV attention is most of the step from {past_half[0]:,} tokens on"
    (first, low), (last, high) = list(rows.items())[0], list(rows.items())[-1]
    attention = [r["ms_per_token"] * r["attention_share"] for r in (low, high)]
    per_token = (attention[1] - attention[0]) / (last - first)  # the attention's ms per context token
    rest = high["ms_per_token"] - attention[1]  # the part of the step the context does not grow
    half = f"; growing as here, it would be half near {last + (rest - attention[1]) / per_token:,.0f}"
    return f"with {kv} KV attention is {high['attention_share']:.0%} of the step at {last:,} tokens" + (
        half if per_token > 0 else ""
    )


if __name__ == "__main__":
    main()
