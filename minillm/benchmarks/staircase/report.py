"""The tables of `minillm bench staircase`, and what its numbers mean, in sentences computed from them."""

from __future__ import annotations

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
        first, last = rows[0], rows[-1]
        said.append(
            f"From {first['step']} to {last['step']}, on the same "
            f"{report['budget']['kv_bytes'] / 2**20:.0f} MiB of KV: "
            f"x{last['output_tok_s'] / first['output_tok_s']:.2f} output tok/s, "
            f"x{last['ttft_p50_s'] / first['ttft_p50_s']:.2f} TTFT p50."
        )
    return said + _greedy_said(rows, report) + [_prefill_said(report)]


def _steps_said(rows: list[dict]) -> list[str]:
    return [
        f"{row['label']}: x{row['output_tok_s_vs_before']:.2f} output tok/s and x"
        f"{row['ttft_p50_s_vs_before']:.2f} TTFT p50 against {before['step']}, "
        f"{before['peak_seqs']} -> {row['peak_seqs']} sequences at once: {verdict(row)}."
        for before, row in zip(rows, rows[1:])
    ]


def _preemptions_said(rows: list[dict], report: dict) -> list[str]:
    return [
        f"{row['step']} ran short of blocks: {row['preemptions']} preemptions recomputed "
        f"{row['recomputed_tokens']:,} tokens, on top of the trace's "
        f"{report['trace']['prompt_tokens']:,} prompt tokens."
        for row in rows
        if row["preemptions"]
    ]


def _greedy_said(rows: list[dict], report: dict) -> list[str]:
    said = []
    for row in rows:
        if row["compared_with"] is not None:
            kind = "lossless" if row["lossless_step"] else "lossy"
            flipped = row["lossless_step"] and row["greedy_identical"] < 1
            said.append(
                f"{row['step']} gave {report['rows'][row['compared_with']]['step']}'s greedy "
                f"tokens for {row['requests_identical']} of {report['trace']['requests']} requests "
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


def megabytes(value: int) -> str:
    return f"{value / 2**20:.3g}"


def ratio(value: float | None) -> str:
    return "" if value is None else f"x{value:.2f}"


ROW_COLUMNS = [
    "row",
    "KV MiB: budget / peak",
    "seqs at once",
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
        f"{megabytes(report['budget']['kv_bytes'])} / {megabytes(row['kv_bytes_peak'])}",
        row["peak_seqs"],
        f"{row['output_tok_s']:.1f}",
        ratio(row["output_tok_s_vs_before"]),
        f"{row['ttft_p50_s']:.1f} / {row['ttft_p99_s']:.1f} s",
        ratio(row["ttft_p50_s_vs_before"]),
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
        f"tokens, all at t=0), one KV budget of {megabytes(budget['kv_bytes'])} MiB, {report['dtype']}, "
        f"{report['machine']['torch_threads']} threads",
        ROW_COLUMNS,
        [_row_cells(row, report) for row in report["rows"].values()],
    )
    console.print(
        "x before: this row's number over the row before's (tok/s: above 1 is better; TTFT: below 1)"
    )
    console.print(
        f"HF's batch: {budget['hf_batch_size']} = {budget['hf_batch_how']}; minillm's rows cut the same "
        "bytes into blocks of 16 tokens: "
        + ", ".join(
            f"{row['step']} {row['blocks']} blocks, {row['preemptions']} preemptions "
            f"({row['recomputed_tokens']:,} tokens recomputed)"
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
