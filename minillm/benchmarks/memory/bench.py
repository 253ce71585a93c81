"""The run of `minillm bench memory`: the trace and budget, the rows (`rows.py`), quality, the load
tests (`load.py`), and the targets, printed beside what the run measured."""

from __future__ import annotations

import torch

from minillm.benchmarks import machine, torch_threads
from minillm.benchmarks.memory.load import load_tests
from minillm.benchmarks.memory.rows import (
    EVICTION,
    EVICTION_BUDGET,
    LOSSLESS,
    calibrate,
    measure_quality,
    quality_setting,
    row_switches,
    run_row,
)
from minillm.benchmarks.memory.trace import SEED, describe_trace, make_trace
from minillm.benchmarks.workload import BLOCK_SIZE, Request, blocks_for, warm_up
from minillm.config import DTYPES, ConfigError
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

SIZES = {  # the defaults; --quick quarters every length and measures less
    "full": {
        "requests": 24,
        "rate": 4.0,
        "kv_tokens": 640,
        "segment_len": 96,
        "segments": 2,
        "clients": 8,
        "load_requests": 2,
        "grid": (2, 4, 8, 16),
        "scale": 1.0,
    },
    "quick": {
        "requests": 12,
        "rate": 8.0,
        "kv_tokens": 160,
        "segment_len": 32,
        "segments": 1,
        "clients": 2,
        "load_requests": 1,
        "grid": (1, 2),
        "scale": 0.25,
    },
}


# ----------------------------------------------------------------------------- targets


def targets(rows: dict, quality: dict) -> dict:
    """What the memory system should buy, beside what it bought this run (printed, never asserted)."""

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    def target(want: str, got: float | None, beside: str, met: bool) -> dict:
        return {"want": want, "got": got, "beside": beside, "met": met}

    fcfs, memory, reserve, lossless = rows["host"], rows["memory"], rows["reserve"], rows["lossless"]
    goodput = ratio(memory["goodput"], fcfs["goodput"])
    concurrency = lossless["peak_seqs"] / reserve["peak_seqs"]
    speed = lossless["output_tok_s"] / reserve["output_tok_s"]
    int8_cost = max(quality["ratio"]["int8"].values())
    int8, prefix = rows["int8"], rows["prefix"]
    return {
        "memory_vs_fcfs_goodput": target(
            ">= 1.3, p99 TTFT no worse",
            goodput,
            f"(6) {memory['goodput']:.0%} vs (5) {fcfs['goodput']:.0%}; p99 TTFT "
            f"{memory['ttft_p99_s']:.1f} vs {fcfs['ttft_p99_s']:.1f} s",
            goodput is not None and goodput >= 1.3 and memory["ttft_p99_s"] <= fcfs["ttft_p99_s"],
        ),
        "lossless_vs_reserve_peak_seqs": target(
            ">= 4",
            concurrency,
            f"(L) {lossless['peak_seqs']} vs (1) {reserve['peak_seqs']}",
            concurrency >= 4,
        ),
        "lossless_vs_reserve_tok_s": target(
            ">= 2",
            speed,
            f"(L) {lossless['output_tok_s']:.1f} vs (1) {reserve['output_tok_s']:.1f} tok/s",
            speed >= 2,
        ),
        "int8_perplexity_ratio": target(
            "<= 1.01 (worst text)",
            int8_cost,
            f"for (4) vs (3): x{int8['device_blocks'] / prefix['device_blocks']:.1f} blocks, "
            f"x{int8['output_tok_s'] / prefix['output_tok_s']:.2f} tok/s, "
            f"goodput {prefix['goodput']:.0%} -> {int8['goodput']:.0%}",
            int8_cost <= 1.01,
        ),
    }


# ----------------------------------------------------------------------------- the whole run


def kv_budgets(model, trace: list[Request], kv_tokens: int) -> tuple[int, int]:
    """(device, host) KV bytes: --kv-tokens of float32 KV in whole blocks for the device pool, and a
    host tier that holds every request of the trace at once."""
    longest = max(len(r.prompt_ids) + r.max_tokens for r in trace)
    if blocks_for(kv_tokens) < blocks_for(longest):
        raise ConfigError(
            f"--kv-tokens {kv_tokens} cannot hold the trace's longest request ({longest} tokens); raise it."
        )
    fp32_token = model.config.kv_bytes_per_token(torch.float32)
    host_blocks = sum(blocks_for(len(r.prompt_ids) + r.output_len) for r in trace)
    return blocks_for(kv_tokens) * BLOCK_SIZE * fp32_token, host_blocks * BLOCK_SIZE * fp32_token


def run_rows(
    model,
    tokenizer,
    trace: list[Request],
    switches: dict,
    kv_bytes: int,
    common: dict,
    calibration: dict,
    progress: bool,
) -> tuple[dict, dict]:
    """Every row on the trace: name -> its report (label and switches first), name -> its outputs' tokens."""
    rows, outputs = {}, {}
    for name, (label, row) in switches.items():
        measured, outputs[name] = run_row(
            model, tokenizer, trace, row, kv_bytes, common, calibration, label, progress
        )
        rows[name] = {"label": label, "switches": row, **measured}
    return rows, outputs


def compare_rows(rows: dict, outputs: dict, quality: dict) -> None:
    """Each row's greedy outputs against row (2)'s, and the perplexity ratio of the cache it reads through."""
    for name, row in rows.items():
        differing = sum(a != b for a, b in zip(outputs[name], outputs["paged"]))
        setting = quality_setting(row["switches"])
        row["outputs_differing_from_paged"] = differing
        row["outputs_equal"] = differing == 0 if name in LOSSLESS else None
        row["quality"] = (
            None
            if setting is None
            else {"setting": setting[0], "perplexity_ratio": quality["ratio"][setting[0]]}
        )


def measure(
    model, tokenizer, sizes: dict, common: dict, load: bool, progress: bool, only: tuple[str, ...] | None
) -> dict:
    """The trace and budget, the calibration, every row (or `only` those), quality and the load
    tests: the report's measured part, in its order. The targets need every row."""
    trace = make_trace(tokenizer, sizes["requests"], sizes["rate"], sizes["scale"], sizes["seed"])
    kv_bytes, host_bytes = kv_budgets(model, trace, sizes["kv_tokens"])
    warm_up(model, tokenizer, common)
    calibration = calibrate(model, tokenizer, trace, common)
    switches = row_switches(host_bytes)
    if only is not None:
        switches = {name: switches[name] for name in only}
    rows, outputs = run_rows(model, tokenizer, trace, switches, kv_bytes, common, calibration, progress)
    settings = dict(filter(None, (quality_setting(row) for _, row in switches.values())))
    quality = measure_quality(
        model, tokenizer, settings, sizes["segment_len"], sizes["segments"], common, progress
    )
    compare_rows(rows, outputs, quality)
    load_report = load_tests(model, tokenizer, switches, kv_bytes, common, sizes, progress) if load else None
    return {
        "trace": describe_trace(trace, sizes["rate"], sizes["scale"], sizes["seed"]),
        "budget": {
            "kv_tokens_fp32": sizes["kv_tokens"],
            "kv_bytes": kv_bytes,
            "host_kv_bytes": host_bytes,
            "eviction": EVICTION,
            "kv_budget": EVICTION_BUDGET,
        },
        "calibration": calibration,
        "rows": rows,
        "lossless_outputs_equal": all(rows[name]["outputs_equal"] for name in LOSSLESS if name in rows),
        "quality": quality,
        "load": load_report,
        "targets": targets(rows, quality) if only is None else None,
    }


def bench_memory(
    model_dir,
    quick: bool = False,
    num_requests: int | None = None,
    rate: float | None = None,
    kv_tokens: int | None = None,
    clients: int | None = None,
    seed: int = SEED,
    load: bool = True,
    threads: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    progress: bool = False,
    rows: tuple[str, ...] | None = None,
) -> dict:
    """`rows`: run only these rows (`rows.row_switches`' names, "paged" among them: every row's
    outputs are compared with its), for a caller that shows only them; the report then has no
    targets and no load tests."""
    if rows is not None and "paged" not in rows:
        raise ValueError(f"rows={rows}: every row is compared with 'paged', so it must be among them")
    sizes = dict(SIZES["quick" if quick else "full"])
    given = {"requests": num_requests, "rate": rate, "kv_tokens": kv_tokens, "clients": clients}
    sizes.update({key: value for key, value in given.items() if value is not None}, seed=seed)
    with torch_threads(threads):
        model, tokenizer = load_model(model_dir, DTYPES[dtype], device), Tokenizer(model_dir)
        common = {"dtype": dtype, "device": device}
        measured = measure(model, tokenizer, sizes, common, load and rows is None, progress, rows)
    return {
        "machine": machine(threads),
        "model_dir": str(model_dir),
        "dtype": dtype,
        "device": device,
        "block_size": BLOCK_SIZE,
        "quick": quick,
        **measured,
    }
