"""Lesson 07 — KV quantization: fewer bits per cached number, and what it costs in perplexity.

The KV cache is the memory that grows with every token of every sequence. Storing it in int8
instead of fp32 makes each token 3.5x cheaper (scales included), int4 6x: that many more
sequences, or that much longer contexts, in the same memory. The price is rounding error in
every attention score. We look at real keys first — why keys want one scale per *channel* — then
score Alice's Adventures in Wonderland through the cache in each format (`minillm eval ppl`'s
harness: every token is predicted by a decode step that reads the quantized cache).

    python lessons/07_kv_quantization.py [--segments 4 --segment-len 160] [--quick] [--out DIR]
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from _common import console, perplexity_setup, save_numbers, save_plot, table  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from minillm.attention.kernels import attention_backend  # noqa: E402
from minillm.attention.reference import causal_attention  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.engine import LLM  # noqa: E402
from minillm.evaluation import perplexity  # noqa: E402
from minillm.memory.quantization import FORMATS, dequantize, quantize  # noqa: E402

TARGETS = {"int8": 0.05, "int4": 0.5}  # perplexity increase we aim to stay under
# The text scored by default: every scored token is one decode step (~65 ms on the 2-core development VM), so
# 4 x 160 tokens keep a run near 10-14 s (`minillm eval ppl` scores 4 x 512: docs/memory.md's numbers).
SEGMENTS, SEGMENT_LEN = 4, 160
RUNS = [
    ("auto", "channel"),
    ("int8", "channel"),
    ("int8", "token"),
    ("fp8", "channel"),
    ("fp8", "token"),
    ("int4", "channel"),
    ("int4", "token"),
]


class RecordKeys:
    """An attention context (no cache) that keeps every layer's keys: (T, kv_heads, head_dim)."""

    def __init__(self, positions):
        self.positions, self.keys = positions, []

    def attend(self, layer_idx, q, k, v):
        self.keys.append(k.clone())
        return causal_attention(q, k, v, self.positions)


def relative_error(x, fmt, dim):
    stored, scale = quantize(x, fmt, dim)
    return ((dequantize(stored, scale, fmt) - x).pow(2).sum() / x.pow(2).sum()).sqrt().item()


@torch.inference_mode()
def look_at_keys(model, token_ids) -> dict[str, tuple[float, float]]:
    positions = torch.arange(len(token_ids))
    ctx = RecordKeys(positions)
    model(torch.tensor(token_ids), positions, ctx)
    keys = ctx.keys[len(ctx.keys) // 2][:16]  # a middle layer, one block of 16 tokens
    magnitude = keys.abs().amax(dim=0)  # (kv_heads, head_dim): the largest value of each channel
    console.print(
        f"Layer {len(ctx.keys) // 2}, KV head 0, one block of 16 tokens: the largest |key| per channel "
        f"ranges from {magnitude[0].min():.2f} to {magnitude[0].max():.2f} "
        f"(median {magnitude[0].median():.2f}). A few channels dominate every token."
    )
    rows, errors = [], {}
    for name, fmt in FORMATS.items():
        per_token = sum(relative_error(k[:16], fmt, -1) for k in ctx.keys) / len(ctx.keys)
        per_channel = sum(relative_error(k[:16], fmt, 0) for k in ctx.keys) / len(ctx.keys)
        rows.append([name, f"{per_token:.2%}", f"{per_channel:.2%}"])
        errors[name] = (per_token, per_channel)
    table(
        "Relative error of the keys after a round trip (mean over layers)",
        ["format", "one scale per token", "one scale per channel"],
        rows,
    )
    return errors


def measure_formats(
    model_dir, model, tokenizer, token_ids: list[int], segment_len: int, segments: int
) -> dict:
    """(kv_dtype, key_scales) -> the perplexity through such a cache, beside what the default pool holds."""
    results, capacity = {}, {}
    for kv_dtype, key_scales in RUNS:
        llm = LLM(model_dir, model=model, tokenizer=tokenizer, kv_dtype=kv_dtype, kv_key_scales=key_scales)
        memory = llm.engine.snapshot()
        capacity[(kv_dtype, key_scales)] = memory.num_blocks * memory.block_size
        results[(kv_dtype, key_scales)] = perplexity(llm, token_ids, segment_len, segments, progress=True)
    full = results[("auto", "channel")]
    rows = []
    for (kv_dtype, key_scales), r in results.items():
        delta = r.perplexity - full.perplexity
        target = TARGETS.get(kv_dtype) if key_scales == "channel" else None
        verdict = f"+{target} {'met' if delta <= target else 'MISSED'}" if target else ""
        rows.append(
            [
                "fp32" if kv_dtype == "auto" else kv_dtype,
                "-" if kv_dtype == "auto" else key_scales,
                f"{r.kv_bytes_per_token:,}",
                f"{capacity[(kv_dtype, key_scales)]:,}",
                f"{r.perplexity:.3f}",
                f"{delta:+.3f}",
                verdict,
                f"{r.tokens_scored / r.seconds:.1f}",
            ]
        )
    table(
        "KV formats, one run side by side (B/token includes scales; tokens = what the default 512 MiB pool "
        "holds; tok/s = the harness's batched decode)",
        ["KV", "keys", "B/token", "tokens", "ppl", "delta", "target", "tok/s"],
        rows,
    )
    return results


FLOOR = 1e-3  # where the log axis draws a perplexity change of zero or less
COLOURS = {"channel": "C0", "token": "C1"}


def plot_formats(key_errors: dict, results: dict, out) -> None:
    full = results[("auto", "channel")]
    fig, (keys_ax, ax) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1.5]})
    formats = list(FORMATS)  # int8, int4, fp8
    plot_key_errors(keys_ax, key_errors, formats)
    floored = []
    for offset, key_scales in ((-0.2, "channel"), (0.2, "token")):
        deltas = [results[(f, key_scales)].perplexity - full.perplexity for f in formats]
        bars = ax.bar(
            [i + offset for i in range(len(formats))],
            [max(d, FLOOR) for d in deltas],
            width=0.4,
            color=COLOURS[key_scales],
        )
        labels = []
        for f, delta, bar in zip(formats, deltas, bars):
            labels.append(f"{results[(f, key_scales)].kv_bytes_per_token:,} B/token")
            if delta <= FLOOR:  # no increase: drawn at the floor, hatched, its value said
                bar.set_hatch("//")
                labels[-1] = f"{delta:+.3f}\n" + labels[-1]
                floored.append(f"{f} per {key_scales}")
        for text in ax.bar_label(bars, labels, fontsize=8):
            text.set_bbox({"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    for name, target in TARGETS.items():
        i = formats.index(name)
        ax.hlines(target, i - 0.45, i + 0.45, colors="gray", linestyles=":", zorder=1)
    ax.set_xticks(range(len(formats)), formats)
    ax.set_yscale("log")
    ax.set_ylabel("perplexity - fp32 perplexity (log)")
    ax.set_title(
        f"2. Perplexity through the cache (fp32: {full.kv_bytes_per_token:,} B/token); dotted: targets"
        + (f"\nhatched: no increase ({', '.join(floored)}), drawn at {FLOOR:g}" if floored else ""),
        fontsize=9,
    )
    ax.legend(handles=[Patch(color=c, label=f"keys per {k}") for k, c in COLOURS.items()], loc="upper left")
    fig.tight_layout()
    save_plot(fig, out, "07_kv_quantization.png")


def plot_key_errors(ax, key_errors: dict, formats: list[str]) -> None:
    """Part 1: each format's round-trip error of real keys, one scale per token against per channel."""
    for offset, column, name in ((-0.2, 1, "channel"), (0.2, 0, "token")):
        errors = [key_errors[f][column] * 100 for f in formats]
        bars = ax.bar(
            [i + offset for i in range(len(formats))], errors, width=0.4, label=f"one scale per {name}"
        )
        ax.bar_label(bars, [f"{e:.2f}%" for e in errors], fontsize=8)
    ax.set_xticks(range(len(formats)), formats)
    ax.set_yscale("log")
    ax.set_ylabel("relative error of the keys (%, log)")
    worst = max(formats, key=lambda f: key_errors[f][0] / key_errors[f][1])
    ratio = key_errors[worst][0] / key_errors[worst][1]
    ax.set_title(
        f"1. Real keys after a round trip: per token up to {ratio:.1f}x the per-channel error", fontsize=9
    )
    ax.legend(loc="upper left")


def meaning(results: dict, backend: str) -> str:
    """The closing paragraph, every claim in it read off this run's numbers; `backend` is the
    attention backend the runs used (the default: this machine's kernel, else torch)."""
    full, int8 = results[("auto", "channel")], results[("int8", "channel")]
    int4, int4_token = results[("int4", "channel")], results[("int4", "token")]
    per_token_worse = int4_token.perplexity > int4.perplexity
    return (
        f"int8 stores a token in {int8.kv_bytes_per_token:,} bytes instead of "
        f"{full.kv_bytes_per_token:,} for {int8.perplexity - full.perplexity:+.3f} perplexity. "
        f"int4 goes to {int4.kv_bytes_per_token:,} bytes for {int4.perplexity - full.perplexity:+.3f} with "
        f"keys scaled per channel, {'but' if per_token_worse else 'and'} "
        f"{int4_token.perplexity - full.perplexity:+.3f} with keys scaled per token"
        + (
            ": at 4 bits the outlier channels swamp a per-token scale. "
            if per_token_worse
            else " (on this short text the outlier channels did not hurt a per-token scale). "
        )
        + "Values are scaled per token, as KIVI does. "
        + speed_verdict(full, int8, backend)
    )


def speed_verdict(full, int8, backend: str) -> str:
    """What int8 did to the decode rate here, with the backend that ran: the C++ kernel reads the
    int8 blocks in place; the torch backend dequantizes a full-precision copy before attending."""
    fp32_rate, int8_rate = full.tokens_scored / full.seconds, int8.tokens_scored / int8.seconds
    rates = f"{int8_rate:.0f} tok/s with int8 against {fp32_rate:.0f} with fp32 ({backend} attention)"
    if int8_rate >= 1.05 * fp32_rate:
        return f"Decode ran at {rates}: reading fewer bytes paid in time too."
    if int8_rate > 0.95 * fp32_rate:
        return f"Decode ran at {rates}: at this model's size the saving is memory, not time."
    return f"Decode ran at {rates}: quantizing each new token costs more here than the bytes it saves."


def main():
    args, model_dir, model, tokenizer, token_ids = perplexity_setup(
        __doc__, segments=SEGMENTS, segment_len=SEGMENT_LEN, quick={"segments": 4, "segment_len": 32}
    )

    console.rule("1. Real keys: a few channels are large for every token")
    key_errors = look_at_keys(model, token_ids[:64])

    console.rule(f"2. Perplexity through the cache: {args.segments} x {args.segment_len} tokens of Alice")
    results = measure_formats(model_dir, model, tokenizer, token_ids, args.segment_len, args.segments)
    plot_formats(key_errors, results, args.out)
    full = results[("auto", "channel")]
    save_numbers(
        args.out,
        "07_kv_quantization.json",
        {
            "tokens_scored": full.tokens_scored,
            "fp32_perplexity": full.perplexity,
            **{
                f"{'fp32' if kv_dtype == 'auto' else kv_dtype}_{key_scales}_{measure}": value
                for (kv_dtype, key_scales), r in results.items()
                if kv_dtype != "auto" or key_scales == "channel"
                for measure, value in (
                    ("perplexity_delta", r.perplexity - full.perplexity),
                    ("bytes_per_token", r.kv_bytes_per_token),
                    ("tokens_per_s", r.tokens_scored / r.seconds),
                )
            },
        },
    )
    backend = attention_backend(EngineConfig(model_dir=model_dir)).name  # the runs' default: auto
    console.print(f"\n[bold]What it means:[/bold] {meaning(results, backend)}")


if __name__ == "__main__":
    main()
