"""The tables of `minillm bench staircase`, and what its numbers mean, in sentences computed from them."""

from __future__ import annotations

from statistics import median

from minillm.benchmarks.stats import mib
from minillm.report import print_table

NOISE = 0.05  # a step that moves tok/s or TTFT p50 by less than this did not pay (nor cost)


def verdict(row: dict) -> str:
    """What a step bought against the step before: throughput, TTFT, both, or nothing beyond NOISE."""
    tok_s, ttft = row["output_tok_s_vs_before"], row["ttft_p50_s_vs_before"]
    gains = [what for what, better in (("tok/s", tok_s >= 1 + NOISE), ("TTFT", ttft <= 1 - NOISE)) if better]
    losses = [what for what, worse in (("tok/s", tok_s <= 1 - NOISE), ("TTFT", ttft >= 1 + NOISE)) if worse]
    if not gains and not losses:
        return f"did not pay (both within {NOISE:.0%})"
    said = f"paid in {' and '.join(gains)}" if gains else "did not pay"
    return said + (f", cost {' and '.join(losses)}" if losses else "")


def what_it_means(report: dict) -> list[str]:
    rows = list(report["rows"].values())
    said = _steps_said(rows) + _preemptions_said(rows, report)
    if len(rows) > 2:
        first, last = list(report["rows"])[0], list(report["rows"])[-1]
        runs = [run["rows"] for run in report["runs"]]
        said.append(
            f"From {rows[0]['step']} to {rows[-1]['step']}, on the same "
            f"{report['budget']['kv_bytes'] / 2**20:.0f} MiB of KV (medians of each seed's ratio): "
            f"x{median(r[last]['output_tok_s'] / r[first]['output_tok_s'] for r in runs):.2f} output tok/s, "
            f"x{median(r[last]['ttft_p50_s'] / r[first]['ttft_p50_s'] for r in runs):.2f} TTFT p50."
        )
    return said + _greedy_said(rows, report) + [_prefill_said(report)]


def _steps_said(rows: list[dict]) -> list[str]:
    return [
        f"{row['label']}: x{row['output_tok_s_vs_before']:.2f} output tok/s and x"
        f"{row['ttft_p50_s_vs_before']:.2f} TTFT p50 against {before['step']}, "
        f"{before['peak_seqs']:g} -> {row['peak_seqs']:g} sequences at once: {verdict(row)}."
        for before, row in zip(rows, rows[1:])
    ]


def _preemptions_said(rows: list[dict], report: dict) -> list[str]:
    return [
        f"{row['step']} ran short of blocks: {row['preemptions']:g} preemptions recomputed "
        f"{row['recomputed_tokens']:,.0f} tokens (medians over the seeds), on top of a trace's "
        f"{_median_prompt_tokens(report):,.0f} prompt tokens."
        for row in rows
        if row["preemptions"]
    ]


def _median_prompt_tokens(report: dict) -> float:
    return median(run["trace"]["prompt_tokens"] for run in report["runs"])


def _greedy_said(rows: list[dict], report: dict) -> list[str]:
    said = []
    for row in rows:
        if row["compared_with"] is not None:
            kind = "lossless" if row["lossless_step"] else "lossy"
            flipped = row["lossless_step"] and row["greedy_identical"] < 1
            said.append(
                f"{row['step']} gave {report['rows'][row['compared_with']]['step']}'s greedy "
                f"tokens for {row['requests_identical']} of {row['requests_compared']} requests "
                f"(a {kind} step"
                + (
                    "; each difference is a near-tie that another order of float sums flipped, or a bug"
                    * flipped
                )
                + ")."
            )
    return said


def _prefill_said(report: dict) -> str:
    prefill = report["prefill_attention"]
    int8 = next(r for r in prefill["rows"] if r["kv_dtype"] == "int8")
    flash = report["rows"].get("flash")
    return (
        f"Prefill attention alone, {prefill['chunk']} queries over {prefill['context']} int8 entries: the "
        f"flash kernel is x{int8['speedup']:.2f} the reference's speed"
        + (
            f"; in the engine, where the layers' matmuls are the rest of prefill, TTFT p50 moved "
            f"x{flash['ttft_p50_s_vs_before']:.2f}."
            if flash
            else "."
        )
    )


def ratio(value: float | None) -> str:
    return "" if value is None else f"x{value:.2f}"


def spread(row: dict, key: str, cell) -> str:
    """A median and, when the seeds differ, their min-max beside it, each shown by `cell`."""
    if row[key] is None:
        return ""
    low, high = row["spread"][key]
    return cell(row[key]) + ("" if low == high else f" ({cell(low)}-{cell(high)})")


ROW_COLUMNS = [
    "row",
    "KV MiB: budget / peak",
    "seqs at once",
    "preemptions",
    "output tok/s",
    "tok/s x before",
    "TTFT p50 / p99",
    "TTFT x before",
    "TPOT p50 / p99",
    "greedy identical",
]


def _row_cells(row: dict, report: dict) -> list:
    """One row of the staircase table, in ROW_COLUMNS' order."""
    compared = report["rows"][row["compared_with"]]["step"] if row["compared_with"] else None
    return [
        row["label"],
        f"{mib(report['budget']['kv_bytes'])} / {mib(row['kv_bytes_peak'])}",
        spread(row, "peak_seqs", lambda v: f"{v:g}"),
        spread(row, "preemptions", lambda v: f"{v:g}"),
        spread(row, "output_tok_s", lambda v: f"{v:.1f}"),
        spread(row, "output_tok_s_vs_before", ratio),
        f"{row['ttft_p50_s']:.1f} / {row['ttft_p99_s']:.1f} s",
        spread(row, "ttft_p50_s_vs_before", ratio),
        "n/a"
        if row["tpot_p50_s"] is None
        else f"{1e3 * row['tpot_p50_s']:.0f} / {1e3 * row['tpot_p99_s']:.0f} ms",
        ""
        if compared is None
        else f"{row['greedy_identical']:.0%} vs {compared}" + ("" if row["lossless_step"] else " (lossy)"),
    ]


def print_staircase_report(report: dict, console) -> None:
    trace, budget = report["trace"], report["budget"]
    print_table(
        console,
        f"{trace['requests']} requests (prompts U{trace['prompt_len']}, outputs U{trace['output_len']} "
        f"tokens, all at t=0), one KV budget of {mib(budget['kv_bytes'])} MiB, {report['dtype']}, "
        f"{report['machine']['torch_threads']} threads; median (min-max) over seeds "
        f"{', '.join(map(str, trace['seeds']))}",
        ROW_COLUMNS,
        [_row_cells(row, report) for row in report["rows"].values()],
    )
    console.print(
        "x before: this row's number over the row before's, seed by seed (tok/s: above 1 is better; "
        f"TTFT: below 1). The trace's sizes and budget were chosen on seed {trace['tuned_on_seed']}."
    )
    console.print(
        f"HF's batch: {budget['hf_batch_size']} = {budget['hf_batch_how']}; minillm's rows cut the same "
        "bytes into blocks of 16 tokens: "
        + ", ".join(
            f"{row['step']} {row['blocks']} blocks, {row['recomputed_tokens']:,.0f} tokens recomputed"
            for row in report["rows"].values()
            if "blocks" in row
        )
    )
    prefill = report["prefill_attention"]
    print_table(
        console,
        f"prefill attention alone, one layer: {prefill['chunk']} queries at the end of {prefill['context']} "
        f"entries, {prefill['dtype']}, best of {prefill['repeats']}",
        ["KV pool", "torch reference ms", "C++ flash kernel ms", "speedup", "max |diff|"],
        [
            [
                r["kv_dtype"],
                f"{r['torch_reference_ms']:.1f}",
                f"{r['cpu_kernel_ms']:.1f}",
                f"x{r['speedup']:.2f}",
                f"{r['max_abs_diff']:.1e}",
            ]
            for r in prefill["rows"]
        ],
    )
    console.print("What it means: " + " ".join(report["what_it_means"]))
