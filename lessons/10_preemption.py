"""Lesson 10 — preemption: when KV blocks run out, recompute the victim or swap it out?

When a running sequence needs a block and none is free, the scheduler preempts one (the newest;
with memory-aware admission, the one with the most remaining cost) and gives its blocks back.
Two ways, two costs:
  - recompute: free the blocks; when the victim runs again, prefill its tokens anew (prompt and
    output so far). The cost is compute, and grows with the victim's length.
  - swap: copy the blocks to the host pool now and back before it runs again. The cost is two
    copies of its KV bytes, plus a fixed cost per block (a `read_block` / `write_block` call
    each way, Python included), so the same tokens in smaller blocks swap dearer.
We measure both with the real model and the engine's own parts — a prefill through the engine;
the block manager's tier moves (`swap_out` / `swap_in`), performed by `TieredKV.copy`, on a device and a host
pool built here as the engine builds them — against sequence length and block size. Then
`preemption="auto"` serves a trace on a tight KV budget, beside "recompute" and "swap", and we
read what it chose and the measured cost model behind each choice (`memory/tiers.py`, `SwapCost`).

On a CPU-only machine the device pool and the host pool are the same RAM: a swap is still real
memory traffic (every byte read and written, out and back), but it crosses no bus, while a
prefill is slow CPU math. On a GPU the copy crosses PCIe (tens of GB/s, against the HBM's TB/s)
and prefill is fast: the same comparison can come out the other way, which is why `auto`
measures both rates on the machine it runs on instead of assuming either.

    python lessons/10_preemption.py [--quick] [--out DIR]
"""

import math
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _common import console, lesson_args, require_model, save_numbers, save_plot, table  # noqa: E402

from minillm.benchmarks import copy_bandwidth  # noqa: E402
from minillm.benchmarks.stats import mib  # noqa: E402
from minillm.benchmarks.tiers.preemption import preemption_run  # noqa: E402
from minillm.benchmarks.workload import pool_bytes, uniform_trace  # noqa: E402
from minillm.engine import LLM, SamplingParams  # noqa: E402
from minillm.evaluation import read_text  # noqa: E402
from minillm.memory.block_manager import BlockManager  # noqa: E402
from minillm.memory.pool import make_pool  # noqa: E402
from minillm.memory.tiers import TieredKV  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402
from minillm.weights import load_model  # noqa: E402

BLOCK_SIZES = [4, 16, 64]
RECOMPUTE_BLOCK = 16  # prefill's math does not depend on the block size, only where K/V is written
VICTIM = 0  # the sequence id of part 1's swapped "victim", alone in its block manager
POLICIES = ["recompute", "swap", "auto"]
SETTINGS = {  # part 1: victim lengths, timing repeats; part 2: the trace and the device pool it shares
    "default": {
        "lengths": [64, 128, 256, 512, 1024],
        "prefill_repeats": 2,
        "swap_repeats": 5,
        "requests": 8,
        "prompt_lens": (24, 48),
        "max_tokens": 48,
        "device_tokens": 192,
    },
    "quick": {
        "lengths": [32, 64, 128],
        "prefill_repeats": 1,
        "swap_repeats": 3,
        "requests": 4,
        "prompt_lens": (24, 48),
        "max_tokens": 16,
        "device_tokens": 96,
    },
}


# ---------------------------------------------------------------- part 1: the two costs, measured
def recompute_seconds(llm, prompt: list[int], repeats: int) -> float:
    """A victim's recompute: its tokens prefilled again, timed as the time to first token of a
    request alone in the engine (a prefill, and one token sampled). Best of `repeats`: the
    machine is shared, and the best run is the least disturbed one."""
    params = SamplingParams(max_tokens=1)
    return min(llm.generate([prompt], params)[0].ttft for _ in range(repeats))


def swap_memory(model, block_size: int, num_tokens: int) -> tuple[BlockManager, TieredKV]:
    """A device pool and a host pool of `num_tokens` tokens each, the block manager over both, and
    the tiers that copy between them: the parts the engine builds (`KVCacheManager.build`)."""
    budget = pool_bytes(model, num_tokens, block_size)
    device = make_pool(model.config, budget, block_size, "auto", "channel", model.dtype, model.device)
    host = make_pool(
        model.config,
        budget,
        block_size,
        "auto",
        "channel",
        model.dtype,
        "cpu",
        pin=device.device.type == "cuda",
        budget_name="host_cache_bytes",
    )
    return BlockManager(device.num_blocks, block_size, host_blocks=host.num_blocks), TieredKV(device, host)


def swap_seconds(manager: BlockManager, tiers: TieredKV, num_tokens: int, repeats: int) -> float:
    """A victim's swap, out and back: the block manager decides which blocks go where, and
    `TieredKV.copy` copies them one block at a time, as the engine's step does. Best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        manager.grow(VICTIM, num_tokens)
        start = time.perf_counter()
        manager.moves.swap_out([VICTIM])
        tiers.copy(manager.take_copies())  # device -> host
        manager.moves.swap_in([VICTIM])
        tiers.copy(manager.take_copies())  # host -> device
        best = min(best, time.perf_counter() - start)
        manager.free(VICTIM)
    return best


def crossover(lengths: list[int], recompute: list[float], swap: list[float]) -> float | None:
    """The length where the two curves cross (interpolated on log-log axes), or None."""
    for i in range(len(lengths) - 1):
        before, after = swap[i] - recompute[i], swap[i + 1] - recompute[i + 1]
        if before == 0 or before * after < 0:
            a, b = math.log(swap[i] / recompute[i]), math.log(swap[i + 1] / recompute[i + 1])
            x0, x1 = math.log(lengths[i]), math.log(lengths[i + 1])
            return math.exp(x0 + (x1 - x0) * a / (a - b))
    return None


def measure_costs(model, tokenizer, text: list[int], settings: dict) -> dict:
    lengths = settings["lengths"]
    longest = max(lengths) + 1  # the prompt and the one token a prefill samples
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        block_size=RECOMPUTE_BLOCK,
        kv_cache_bytes=pool_bytes(model, longest, RECOMPUTE_BLOCK),
    )
    recompute_seconds(llm, text[:32], 1)  # warm-up: the first forward pays one-off costs
    recompute = [recompute_seconds(llm, text[:n], settings["prefill_repeats"]) for n in lengths]
    memories = {size: swap_memory(model, size, longest) for size in BLOCK_SIZES}
    swap = {
        size: [swap_seconds(*memories[size], n, settings["swap_repeats"]) for n in lengths]
        for size in BLOCK_SIZES
    }
    return {
        "lengths": lengths,
        "recompute": recompute,
        "swap": swap,
        "crossover": {size: crossover(lengths, recompute, swap[size]) for size in BLOCK_SIZES},
        "kv_bytes_per_token": model.config.kv_bytes_per_token(model.dtype),
    }


def show_costs(costs: dict, roof: float) -> None:
    lengths, recompute, swap = costs["lengths"], costs["recompute"], costs["swap"]
    rows = [
        [
            n,
            f"{recompute[i] * 1e3:.0f}",
            *[f"{swap[size][i] * 1e3:.2f}" for size in BLOCK_SIZES],
            f"{recompute[i] / max(swap[size][i] for size in BLOCK_SIZES):.0f}x",
        ]
        for i, n in enumerate(lengths)
    ]
    table(
        "one victim, ms: recompute (prefill its tokens) vs swap (its blocks out and back) by block size",
        ["tokens", "recompute", *[f"swap {size}" for size in BLOCK_SIZES], "recompute / dearest"],
        rows,
    )
    longest, per_token = lengths[-1], costs["kv_bytes_per_token"]
    moved = 2 * longest * per_token  # out and back
    rows = []
    for size in BLOCK_SIZES:
        seconds, blocks = swap[size][-1], -(-longest // size)
        cross = costs["crossover"][size]
        rows.append(
            [
                size,
                2 * blocks,
                f"{seconds / (2 * blocks) * 1e6:.1f}",
                f"{moved / seconds / 1e9:.2f}",
                f"{2 * moved / seconds / roof:.0%}",
                "none" if cross is None else f"{cross:.0f} tokens",
            ]
        )
    table(
        f"swapping {longest} tokens ({moved / 2**20:.0f} MiB out and back); the roof, the same bytes in one "
        f"tensor copy: {roof / 1e9:.1f} GB/s read + write",
        ["block size", "copies", "µs each", "GB/s", "of roof", "crossover"],
        rows,
    )


# ---------------------------------------------------------------- part 2: what auto chooses on a trace
def serve_trace(model, tokenizer, settings: dict) -> dict:
    """The same requests (all at t=0, each decoding exactly max_tokens) under each policy, on a
    device pool of `device_tokens` tokens; the host pool holds them all. Served by `bench tiers`'
    own run (`preemption_run`); what auto chose is read from the engine's snapshot."""
    lengths = (settings["max_tokens"], settings["max_tokens"])
    trace = uniform_trace(tokenizer, settings["requests"], settings["prompt_lens"], lengths)
    roomy = sum(len(r.prompt_ids) + r.output_len for r in trace)
    pools = (pool_bytes(model, settings["device_tokens"]), pool_bytes(model, roomy))
    runs = {}
    for policy in POLICIES:
        row, outputs, memory = preemption_run(model, tokenizer, trace, policy, pools, {})
        runs[policy] = {
            **row,
            "seconds": row["elapsed_s"],
            "bytes_moved": sum(row["bytes_moved"].values()),
            "token_ids": [out.token_ids for out in outputs],
            "decisions": list(memory.swap_decisions),
            "prefill_tokens_per_s": memory.prefill_rate,
            "copy_bytes_per_s": memory.copy_rates.get("host"),
        }
    return runs


def show_trace(runs: dict, settings: dict) -> None:
    rows = [
        [label, *[fmt(runs[p][key]) for p in POLICIES]]
        for label, key, fmt in (
            ("engine steps", "steps", str),
            ("preemptions", "preemptions", str),
            ("sequences swapped out", "swapped_out", str),
            ("sequences swapped in", "swapped_in", str),
            ("...of them prefetched", "prefetched", str),
            ("tokens recomputed", "recomputed_tokens", str),
            ("MiB moved between pools", "bytes_moved", mib),
            ("seconds", "seconds", lambda s: f"{s:.1f}"),
        )
    ]
    table(
        f"the same {settings['requests']} requests on a {settings['device_tokens']}-token device pool",
        ["preemption =", *POLICIES],
        rows,
    )
    auto, shown = runs["auto"], 8
    rows = []
    for i, d in enumerate(auto["decisions"][:shown]):
        estimate = (
            ["(none timed yet)", ""]
            if d["costs"] is None
            else [f"{d['costs'][0] * 1e3:.0f}", f"{d['costs'][1] * 1e3:.2f}"]
        )
        rows.append([i + 1, d["tokens"], d["blocks"], *estimate, "swap" if d["swap"] else "recompute"])
    if len(auto["decisions"]) > shown:
        rest = auto["decisions"][shown:]
        rows.append(["...", f"{len(rest)} more", "", "", "", f"{sum(d['swap'] for d in rest)} swap"])
    table(
        f"auto's decisions: prefill measured at {auto['prefill_tokens_per_s']:.0f} tokens/s, copies at "
        f"{(auto['copy_bytes_per_s'] or 0) / 1e9:.2f} GB/s (out and back)",
        ["#", "victim tokens", "blocks", "recompute est. ms", "swap est. ms", "chosen"],
        rows,
    )


# ---------------------------------------------------------------- the story
def plot(costs: dict, runs: dict, out) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    lengths = costs["lengths"]
    left.plot(
        lengths, [s * 1e3 for s in costs["recompute"]], marker="o", color="black", label="recompute (prefill)"
    )
    for size in BLOCK_SIZES:
        left.plot(lengths, [s * 1e3 for s in costs["swap"][size]], marker="s", label=f"swap, block {size}")
        cross = costs["crossover"][size]
        if cross is not None:
            left.axvline(cross, linestyle=":", color=left.lines[-1].get_color())
    no_crossing = all(cross is None for cross in costs["crossover"].values())
    left.set(
        xscale="log",
        yscale="log",
        xlabel="victim length (tokens, log)",
        ylabel="ms (log)",
        title="1. Cost of one preemption on this machine\n"
        + (
            f"(no crossover in range: {cheaper_side(costs)})"
            if no_crossing
            else "(dotted: where the curves cross)"
        ),
    )
    left.set_xticks(lengths, [str(n) for n in lengths])
    left.minorticks_off()
    left.legend(fontsize=8)
    names = list(runs)
    right.bar(names, [runs[p]["seconds"] for p in names], color=["tab:gray", "tab:blue", "tab:green"])
    for i, p in enumerate(names):
        right.text(
            i,
            runs[p]["seconds"],
            f"{runs[p]['recomputed_tokens']} recomputed\n{runs[p]['bytes_moved'] / 2**20:.0f} MiB moved",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    recompute = runs["recompute"]
    worth = recompute["recomputed_tokens"] / runs["auto"]["prefill_tokens_per_s"]  # at auto's measured rate
    right.set(
        ylabel="wall time of the whole trace (s)",
        title="2. The same trace on a tight KV budget\n"
        f"(the {recompute['recomputed_tokens']} recomputed tokens are worth ~{worth:.1f} s of prefill)",
    )
    right.margins(y=0.25)
    fig.tight_layout()
    save_plot(fig, out, "10_preemption.png")


def cheaper_side(costs: dict) -> str:
    """Which way is cheaper where no curve crosses recompute: the first length decides each block size."""
    cheaper = [size for size in BLOCK_SIZES if costs["swap"][size][0] < costs["recompute"][0]]
    if len(cheaper) == len(BLOCK_SIZES):
        return "swap is cheaper at every length"
    if not cheaper:
        return "recompute is cheaper at every length"
    return f"swap is cheaper at every length in blocks of {', '.join(map(str, cheaper))}"


def main():
    args = lesson_args(__doc__)
    settings = SETTINGS["quick" if args.quick else "default"]
    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)
    text = tokenizer.encode(read_text())

    console.rule("1. One victim: recompute vs swap, by length and block size")
    costs = measure_costs(model, tokenizer, text, settings)
    # the same bytes, one copy
    roof = copy_bandwidth(nbytes=max(costs["lengths"]) * costs["kv_bytes_per_token"])
    show_costs(costs, roof)

    console.rule("2. A trace on a tight KV budget: what preemption='auto' chose")
    runs = serve_trace(model, tokenizer, settings)
    show_trace(runs, settings)
    identical = all(runs[p]["token_ids"] == runs["recompute"]["token_ids"] for p in POLICIES)
    console.print(f"identical outputs under all three policies: [bold]{identical}[/bold]")
    plot(costs, runs, args.out)

    lengths, auto = costs["lengths"], runs["auto"]
    auto_swaps = sum(d["swap"] for d in auto["decisions"])
    numbers = {
        "lengths": lengths,
        "identical_outputs": identical,
        "copy_roof_bytes_per_s": roof,
        "cost_recompute_seconds": costs["recompute"],
        **{f"cost_swap_seconds_block_{size}": costs["swap"][size] for size in BLOCK_SIZES},
        **{f"crossover_tokens_block_{size}": costs["crossover"][size] for size in BLOCK_SIZES},
        **{
            f"{p}_{key}": runs[p][key]
            for p in POLICIES
            for key in (
                "steps",
                "preemptions",
                "swapped_out",
                "swapped_in",
                "prefetched",
                "recomputed_tokens",
                "bytes_moved",
                "seconds",
            )
        },
        "auto_decisions": len(auto["decisions"]),
        "auto_chose_swap": auto_swaps,
        "auto_chose_recompute": len(auto["decisions"]) - auto_swaps,
        "auto_prefill_tokens_per_s": auto["prefill_tokens_per_s"],
        "auto_copy_bytes_per_s": auto["copy_bytes_per_s"],
    }
    save_numbers(args.out, "10_preemption.json", numbers)

    console.print(f"\n[bold]What it means:[/bold] {meaning(costs, runs, identical)}")


def meaning(costs: dict, runs: dict, identical: bool) -> str:
    """The closing paragraph, every claim in it read off this run's numbers."""
    lengths, auto, recompute = costs["lengths"], runs["auto"], runs["recompute"]
    ratios = [r / s for size in BLOCK_SIZES for r, s in zip(costs["recompute"], costs["swap"][size])]
    crossings = {size: c for size, c in costs["crossover"].items() if c is not None}
    if not crossings:
        where = (
            f"swap was the cheaper way at every length and block size measured: recompute cost "
            f"{min(ratios):.0f}x to {max(ratios):.0f}x as much"
        )
    else:
        where = "the curves cross at " + ", ".join(
            f"{c:.0f} tokens (block {size})" for size, c in crossings.items()
        )
    small, large = BLOCK_SIZES[0], BLOCK_SIZES[-1]
    penalty = costs["swap"][small][-1] / costs["swap"][large][-1]
    blocks = (
        f"swapping {lengths[-1]} tokens in blocks of {small} took {penalty:.1f}x as long as in blocks of "
        f"{large} ({-(-lengths[-1] // small)} block copies each way against {-(-lengths[-1] // large)})"
        if penalty > 1
        else f"blocks of {small} were not dearer to swap than blocks of {large} on this run "
        f"({penalty:.2f}x the time): the per-block cost stayed below the timing noise"
    )
    swaps = sum(d["swap"] for d in auto["decisions"])
    # what the recomputed tokens should have cost at the measured prefill rate: a wall-time gap between
    # the runs much larger than this is the shared machine, not the policy
    expected = recompute["recomputed_tokens"] / auto["prefill_tokens_per_s"]
    gap = recompute["seconds"] - runs["swap"]["seconds"]
    return (
        f"on this CPU {where}. Prefill ran at {auto['prefill_tokens_per_s']:.0f} tokens/s, "
        f"while swapping moves {costs['kv_bytes_per_token'] / 1e3:.0f} kB of KV per token, out and back, at "
        f"{(auto['copy_bytes_per_s'] or 0) / 1e9:.1f} GB/s: device and host pools share one RAM, "
        "so a swap is a memory copy and a recompute is the whole model's math again. "
        f"The block size changes the copy's cost: {blocks}. "
        f"On the trace, auto chose swap {swaps} of {len(auto['decisions'])} times "
        f"({auto['recomputed_tokens']} tokens recomputed, against {recompute['recomputed_tokens']} under "
        f"'recompute'; {auto['bytes_moved'] / 2**20:.1f} MiB moved instead), "
        f"{'with identical outputs' if identical else '[red]but the outputs differ: a bug[/red]'}. Those "
        f"{recompute['recomputed_tokens']} tokens are worth about {expected:.1f} s of prefill "
        "at the measured rate; "
        f"the runs took {recompute['seconds']:.1f} s (recompute) and {runs['swap']['seconds']:.1f} s (swap), "
        + (
            "a gap within a second of that."
            if abs(gap - expected) < 1
            else f"a gap of {gap:+.1f} s that the recomputed tokens do not explain "
            f"(the runs took {recompute['steps']} and {runs['swap']['steps']} steps): "
            "read it as the noise of other work on this shared machine, not as the policy's effect."
        )
        + " On a GPU the copy crosses PCIe while prefill runs at GPU speed, so the two rates, "
        "and the choice, can come out the other way: that is why auto measures them where it runs."
    )


if __name__ == "__main__":
    main()
