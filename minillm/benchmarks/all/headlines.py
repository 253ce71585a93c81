"""The headline numbers of each benchmark's report (what results.md tabulates) and the bars of
its chart."""

from __future__ import annotations

from pathlib import Path

Headline = tuple[str, float | int | None, str]  # (what was measured, its value, its unit)
Bars = tuple[str, str, dict[str, float]]  # (title, value axis label, {bar: value})


def decode_headlines(r: dict) -> list[Headline]:
    rows = [
        (f"{name} ({row['dtype']}), median of {r['repeats']}", row["tok_s"], "tok/s")
        for name, row in r["decoders"].items()
    ]
    return rows + [
        ("cached / naive", r["cached_vs_naive"], "x"),
        ("cached, of the copy bandwidth", 100 * r["decoders"]["cached"]["roof_fraction"], "%"),
        ("copy bandwidth (read + write)", r["copy_bandwidth_GBs"], "GB/s"),
    ]


def serve_headlines(r: dict) -> list[Headline]:
    cont = r["servers"]["minillm_continuous"]
    rows = [
        (
            f"{name}, {r['trace']['requests']} requests, batch {r['trace']['max_num_seqs']}",
            run["output_tok_s"],
            "tok/s",
        )
        for name, run in r["servers"].items()
    ]
    return rows + [
        ("continuous / static", r["continuous_vs_static"], "x"),
        ("continuous, TTFT mean", cont["ttft_mean_s"], "s"),
        ("continuous, TPOT mean", 1e3 * cont["tpot_mean_s"], "ms"),
        ("continuous, of the matmul roof", 100 * cont["matmul_fraction"], "%"),
        ("KV utilization, paged", 100 * cont["kv_utilization_paged"], "%"),
        ("KV utilization, contiguous max-length", 100 * cont["kv_utilization_contiguous"], "%"),
    ]


def prefix_headlines(r: dict) -> list[Headline]:
    return [
        ("TTFT after the first, cache off", 1e3 * r["without_cache"]["ttft_rest_mean_s"], "ms"),
        ("TTFT after the first, cache on", 1e3 * r["with_cache"]["ttft_rest_mean_s"], "ms"),
        ("TTFT off / on", r["ttft_speedup_after_first"], "x"),
        ("prefill tokens off / on", r["prefill_tokens_ratio"], "x"),
        ("KV saved by sharing, n=4 samples", 100 * r["parallel_sampling_n4"]["memory_saved"], "%"),
        ("KV saved by sharing, beam width 4", 100 * r["beam_search_width4"]["memory_saved"], "%"),
    ]


def attention_headlines(r: dict) -> list[Headline]:
    kernel = r["kernel"]
    batch, context = max((row["batch"], row["context"]) for row in r["rows"])
    largest = [row for row in r["rows"] if (row["batch"], row["context"]) == (batch, context)]
    return [
        (f"{name}, {row['kv_dtype']} KV, batch {batch} x context {context}", row[f"{name}_GBs"], "GB/s")
        for row in largest
        for name in ("torch_reference", kernel)
    ] + [(f"copy bandwidth ({r['device']})", r["copy_bandwidth_GBs"], "GB/s")]


def tiers_headlines(r: dict) -> list[Headline]:
    p, resume, spill = r["preemption"], r["resume"], r["prefix_spill"]
    rows = [
        (f"preemption by {name}, {p['trace']['requests']} requests", row["output_tok_s"], "tok/s")
        for name, row in p["rows"].items()
    ]
    hidden = p["rows"]["swap"]["prefetch_hidden"]
    return rows + [
        ("swap: tokens recomputed", p["rows"]["swap"]["recomputed_tokens"], "tokens"),
        ("swap: prefetch copying hidden", None if hidden is None else 100 * hidden, "%"),
        ("requests whose greedy outputs differ across the three", p["requests_differing"], "requests"),
        ("resume a parked chat: its history", resume["history_tokens"], "tokens"),
        ("resume a parked chat: TTFT resumed from its file", resume["resume"]["ttft_s"], "s"),
        ("resume a parked chat: TTFT recomputing its history", resume["recompute"]["ttft_s"], "s"),
        ("resume a parked chat: TTFT recompute / resume", resume["ttft_ratio"], "x"),
        ("prefix spill: prefill saved with / without a host tier", spill["prefill_saved_ratio"], "x"),
    ]


def fleet_headlines(r: dict) -> list[Headline]:
    """`bench fleet`: the store's TTFT, the step beside a slow store, the router at each load."""
    rows: list[Headline] = []
    if "store" in r:
        store, tokens = r["store"], r["store"]["prefix_tokens"]
        rows += [
            (f"TTFT, a {tokens}-token prefix on engine B: {name}", store[f"{key}_s"]["median"], "s")
            for name, key in (
                ("recomputed", "recompute"),
                ("read from the store", "store"),
                ("at home", "home"),
            )
        ]
        rows.append(
            (
                f"TTFT, a {tokens}-token prefix: recompute / store",
                store["recompute_over_store"]["median"],
                "x",
            )
        )
    if "step" in r:
        rows.append(("median decode step, store 50 ms away / no store", r["step"]["slow_over_none"], "x"))
    for load, numbers in r.get("router", {}).items():
        means = numbers["means"]
        for store in ("off", "on"):
            kv, rr = means[f"store {store}, kv"], means[f"store {store}, round-robin"]
            at = f"{load} load, store {store}"
            rows += [
                (f"{at}: prefix hit rate, router", 100 * kv["prefix_hit_rate"], "%"),
                (f"{at}: prefix hit rate, round-robin", 100 * rr["prefix_hit_rate"], "%"),
                (
                    f"{at}: prefix hit rate, router / round-robin",
                    kv["prefix_hit_rate"] / rr["prefix_hit_rate"],
                    "x",
                ),
                (f"{at}: goodput, router", 100 * kv["goodput"], "%"),
                (f"{at}: goodput, round-robin", 100 * rr["goodput"], "%"),
                (f"{at}: goodput, router / round-robin", kv["goodput"] / rr["goodput"], "x"),
            ]
    return rows


def memory_headlines(r: dict) -> list[Headline]:
    rows = r["rows"]
    tok_s = [(f"{row['label']}: output", row["output_tok_s"], "tok/s") for row in rows.values()]
    goodput = [
        (f"{rows[name]['label']}: goodput", 100 * rows[name]["goodput"], "%")
        for name in ("reserve", "paged", "memory", "lossless")
    ]
    peak = [
        (f"{rows[name]['label']}: peak sequences", rows[name]["peak_seqs"], "sequences")
        for name in ("reserve", "lossless")
    ]
    int8 = r["targets"]["int8_perplexity_ratio"]["got"]
    return (
        tok_s
        + goodput
        + peak
        + [("int8 KV: perplexity above the exact cache, worst of two texts", 100 * (int8 - 1), "%")]
    )


def staircase_headlines(r: dict) -> list[Headline]:
    rows, prefill = list(r["rows"].values()), r["prefill_attention"]
    per_row = [
        headline
        for row in rows
        for headline in (
            (f"{row['label']}: output", row["output_tok_s"], "tok/s"),
            (f"{row['label']}: TTFT p50", row["ttft_p50_s"], "s"),
            (f"{row['label']}: sequences at once", row["peak_seqs"], "sequences"),
        )
    ]
    later = [row for row in rows if row["compared_with"] is not None]
    gains = [
        (f"{row['step']}: output tok/s over the row before's", row["output_tok_s_vs_before"], "x")
        for row in later
    ]
    identical = [
        (f"{row['step']}: greedy tokens equal to the row before's", 100 * row["greedy_identical"], "%")
        for row in later
    ]
    shape = f"{prefill['chunk']} queries x {prefill['context']} entries"
    flash = [
        (f"prefill attention, {row['kv_dtype']} KV, {shape}: flash kernel / torch", row["speedup"], "x")
        for row in prefill["rows"]
    ]
    first, last = rows[0], rows[-1]
    overall = (
        f"{last['step']} / {first['step']}: output tok/s",
        last["output_tok_s"] / first["output_tok_s"],
        "x",
    )
    return per_row + gains + identical + flash + [overall]


def ppl_headlines(r: dict) -> list[Headline]:
    rows = r["kv_dtypes"]
    exact = rows.get("auto", {}).get("perplexity")
    return (
        [(f"{kv_dtype} KV: perplexity", row["perplexity"], "") for kv_dtype, row in rows.items()]
        + [
            (f"{kv_dtype} KV: perplexity above the model's dtype", 100 * (row["perplexity"] / exact - 1), "%")
            for kv_dtype, row in rows.items()
            if exact and kv_dtype != "auto"
        ]
        + [
            (f"{kv_dtype} KV: bytes per token", row["kv_bytes_per_token"], "B")
            for kv_dtype, row in rows.items()
        ]
    )


def decode_bars(r: dict) -> Bars:
    return (
        f"batch-1 decode, prompt {r['prompt_len']} tokens, median of {r['repeats']} runs",
        "tok/s",
        {f"{name} ({row['dtype']})": row["tok_s"] for name, row in r["decoders"].items()},
    )


def serve_bars(r: dict) -> Bars:
    return (
        f"{r['trace']['requests']} requests, batch {r['trace']['max_num_seqs']}",
        "output tok/s",
        {name: run["output_tok_s"] for name, run in r["servers"].items()},
    )


def prefix_bars(r: dict) -> Bars:
    return (
        f"{r['requests']} requests sharing a system prompt",
        "TTFT (ms)",
        {
            f"cache {state}, {which}": 1e3 * r[key][f"ttft_{field}_s"]
            for state, key in (("off", "without_cache"), ("on", "with_cache"))
            for which, field in (("first", "first"), ("after", "rest_mean"))
        },
    )


def attention_bars(r: dict) -> Bars:
    kernel = r["kernel"]
    return (
        f"decode attention, one layer, {kernel}",
        "GB/s",
        {f"{row['kv_dtype']} {row['batch']}x{row['context']}": row[f"{kernel}_GBs"] for row in r["rows"]},
    )


def tiers_bars(r: dict) -> Bars:
    return (
        "preemption under a small device pool",
        "output tok/s",
        {name: row["output_tok_s"] for name, row in r["preemption"]["rows"].items()},
    )


def memory_bars(r: dict) -> Bars:
    return (
        "one KV budget, one layer at a time",
        "output tok/s",
        {row["label"]: row["output_tok_s"] for row in r["rows"].values()},
    )


def staircase_bars(r: dict) -> Bars:
    return (
        "one KV budget, one serving step at a time",
        "output tok/s",
        {row["label"]: row["output_tok_s"] for row in r["rows"].values()},
    )


def ppl_bars(r: dict) -> Bars:
    return (
        f"perplexity through the cache, {Path(r['text']).name}",
        "perplexity",
        {kv_dtype: row["perplexity"] for kv_dtype, row in r["kv_dtypes"].items()},
    )


def scheduling_headlines(r: dict) -> list[Headline]:
    """Goodput per load and policy (mean over the held-out seeds), memory against fcfs, and the
    rate each policy sustains at 90% goodput."""
    goodput = [
        (f"goodput at {load} load: {policy}", 100 * s["goodput_mean"], "%")
        for load, by_policy in r["summary"].items()
        for policy, s in by_policy.items()
    ]
    ratios = [
        (f"goodput at {load} load: memory / fcfs", by_policy["memory"]["vs_fcfs"], "x")
        for load, by_policy in r["summary"].items()
    ]
    rates = r["sustained_rate"]
    sustained = [
        (f"sustained rate at 90% goodput: {policy}", s["rate"], "arrivals/s") for policy, s in rates.items()
    ]
    memory, fcfs = rates["memory"]["rate"], rates["fcfs"]["rate"]
    ratio = memory / fcfs if memory and fcfs else None
    return goodput + ratios + sustained + [("sustained rate at 90% goodput: memory / fcfs", ratio, "x")]
