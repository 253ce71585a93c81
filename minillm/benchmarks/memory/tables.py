"""The report of `minillm bench memory`: the tables and sentences `print_memory_report` prints
from the dict `bench_memory` returns."""

from __future__ import annotations

from minillm.benchmarks import print_targets
from minillm.benchmarks.memory.load import LOAD_TTFT_TIMES
from minillm.benchmarks.memory.rows import (
    EVICTION,
    EVICTION_BUDGET,
    LOSSLESS,
    ROWS_LEGEND,
    TPOT_TIMES,
    TTFT_TIMES,
)
from minillm.benchmarks.stats import mib
from minillm.report import print_table


def seconds(value: float) -> str:
    return f"{value:.2f} s"


def quality_cell(row: dict) -> str:
    if row["quality"] is None:
        return "exact"
    return "ppl " + " / ".join(f"x{r:.3f}" for r in row["quality"]["perplexity_ratio"].values())


def print_setting(report: dict, console) -> None:
    """The trace, the budget every row gets, the goodput targets, and what each row adds."""
    trace, budget, cal = report["trace"], report["budget"], report["calibration"]
    kinds = ", ".join(f"{k['requests']} {name}" for name, k in trace["kinds"].items())
    console.print(
        f"trace (seed {trace['seed']}): {trace['requests']} requests ({kinds}) arriving at "
        f"{trace['rate_per_s']:g}/s, "
        f"{trace['prompt_tokens']:,} prompt and {trace['output_tokens']:,} output tokens; "
        f"device KV pool {mib(budget['kv_bytes'])} MiB for every row "
        f"({budget['kv_tokens_fp32']:,} fp32 tokens), host tier "
        f"{mib(budget['host_kv_bytes'])} MiB for rows 5-7 and L"
    )
    console.print(
        f"goodput targets: TTFT <= {cal['ttft_s']:.2f} s ({TTFT_TIMES} x "
        f"{cal['prefill_alone_s']:.2f} s, the longest prompt, {cal['longest_prompt']} tokens, "
        f"prefilled alone), TPOT <= {cal['tpot_s'] * 1e3:.0f} ms ({TPOT_TIMES} x "
        f"{cal['decode_step_s'] * 1e3:.0f} ms, a batch-1 decode step); both measured now"
    )
    console.print(f"rows: {ROWS_LEGEND}")


def rungs_cell(row: dict) -> str:
    return ", ".join(f"{rung} {n:,}" for rung, n in row["rungs"].items()) or "-"


def outputs_cell(row: dict) -> str:
    """A row's greedy outputs beside row (2)'s: equal or not for a lossless row, how many differ otherwise."""
    if row["outputs_equal"] is None:
        return f"{row['outputs_differing_from_paged']} differ"
    return "equal: " + ("yes" if row["outputs_equal"] else "NO")


def print_rows(report: dict, console) -> None:
    """The rows' two tables, speed and latency then memory, and what their quality and outputs mean."""
    print_speed_table(report["rows"], console)
    print_memory_table(report["rows"], console)
    print_quality_and_outputs(report, console)


def print_speed_table(rows: dict, console) -> None:
    print_table(
        console,
        "one layer at a time: speed and latency",
        ["row", "output tok/s", "CPU s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50", "quality"],
        [
            [
                row["label"],
                f"{row['output_tok_s']:.1f}",
                f"{row['cpu_s']:.1f}",
                f"{row['goodput']:.0%} ({row['goodput_requests']})",
                seconds(row["ttft_p50_s"]),
                seconds(row["ttft_p99_s"]),
                f"{row['tpot_p50_s'] * 1e3:.0f} ms",
                quality_cell(row),
            ]
            for row in rows.values()
        ],
    )


def print_memory_table(rows: dict, console) -> None:
    print_table(
        console,
        "one layer at a time: memory",
        [
            "row",
            "blocks",
            "peak seqs",
            "preemptions",
            "recomputed",
            "MiB moved",
            "KV util",
            "rungs taken",
            "outputs vs (2)",
        ],
        [
            [
                row["label"],
                row["device_blocks"],
                row["peak_seqs"],
                row["preemptions"],
                f"{row['recomputed_tokens']:,}",
                mib(row["bytes_moved_total"]),
                f"{row['kv_utilization']:.0%}",
                rungs_cell(row),
                outputs_cell(row),
            ]
            for row in rows.values()
        ],
    )


def print_quality_and_outputs(report: dict, console) -> None:
    rows = report["rows"]
    q = report["quality"]
    exact = ", ".join(f"{p:.2f}" for p in q["perplexity"]["exact"].values())
    console.print(
        "quality: perplexity through the row's cache / the exact cache on "
        f"{' and '.join(q['texts'])} ({q['note']}; {q['segments_per_text']} x {q['segment_len']} "
        f"tokens each; exact {exact}); {EVICTION} keeps {EVICTION_BUDGET:.0%} every step there, "
        "the most it can cost. "
        "KV util of (1) is live tokens over its reservations; shared prefix blocks can lift the "
        "others above 100%."
    )
    equal = [
        f"{rows[name]['label'].split()[0]} {'yes' if rows[name]['outputs_equal'] else 'NO'}"
        for name in LOSSLESS
    ]
    console.print("lossless rows' greedy outputs equal to (2)'s: " + ", ".join(equal))


def print_load(load: dict, console) -> None:
    """The closed-loop load tests: latency at C clients, and the sweep to the largest C meeting the target."""
    grid = load["grid"]

    def latency_cell(run: dict) -> str:
        return f"{seconds(run['latency_p50_s'])} / {seconds(run['latency_p99_s'])}"

    def sweep_cell(row: dict, clients: int) -> str:
        return next((seconds(run["ttft_p99_s"]) for run in row["sweep"] if run["clients"] == clients), "-")

    print_table(
        console,
        f"closed loop: chat requests (~{load['prompt_tokens_mean']:.0f} prompt tokens, "
        f"{load['output_len']} out), {load['requests_per_client']} per client; "
        f"p99 TTFT target {load['ttft_target_s']:.2f} s ({LOAD_TTFT_TIMES} x "
        f"{load['prefill_alone_s']:.2f} s alone)",
        [
            "row",
            f"latency p50 / p99 at C={load['clients']}",
            *[f"TTFT p99 C={c}" for c in grid],
            "largest C meeting it",
        ],
        [
            [
                r["label"],
                latency_cell(r["fixed"]),
                *[sweep_cell(r, c) for c in grid],
                r["max_clients"] or "none",
            ]
            for r in load["rows"].values()
        ],
    )


def print_memory_report(report: dict, console) -> None:
    print_setting(report, console)
    print_rows(report, console)
    if report["load"]:
        print_load(report["load"], console)
    print_targets(report, console)
