"""The run of `minillm bench staircase`: the trace and its budget, the rows (`rows.py`), prefill
attention alone (`prefill.py`), and what the numbers say (`report.py`)."""

from __future__ import annotations

import torch

from minillm.benchmarks.serve import make_trace
from minillm.benchmarks.staircase.prefill import prefill_attention
from minillm.benchmarks.staircase.report import what_it_means
from minillm.benchmarks.staircase.rows import kv_budget, run_rows, worst_case
from minillm.benchmarks.tiers.run import machine
from minillm.config import DTYPES, ConfigError
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

SEED = 0
# The defaults; on one thread of a 2-core CPU prefill runs at ~200 tokens/s and a decode step
# takes ~0.1 s, so the full trace takes minutes per row: under 10 minutes in all, --quick under 2.
SIZES = {
    "full": {"requests": 3, "prompt_len": (1024, 4096), "output_len": (128, 256), "attention_repeats": 5},
    "quick": {"requests": 3, "prompt_len": (512, 1024), "output_len": (32, 64), "attention_repeats": 3},
}


def check_range(name: str, bounds: tuple[int, int]) -> tuple[int, int]:
    low, high = bounds
    if not 1 <= low <= high:
        raise ConfigError(f"{name} {low} {high} is not a range of lengths; give LOW <= HIGH, both >= 1.")
    return low, high


def bench_staircase(
    model_dir,
    quick: bool = False,
    num_requests: int | None = None,
    prompt_len: tuple[int, int] | None = None,
    output_len: tuple[int, int] | None = None,
    kv_tokens: int | None = None,
    include_hf: bool = True,
    attention_context: int = 4096,
    attention_chunk: int = 512,
    attention_repeats: int | None = None,
    threads: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    progress: bool = False,
) -> dict:
    sizes = _sizes(
        quick,
        requests=num_requests,
        prompt_len=prompt_len,
        output_len=output_len,
        attention_repeats=attention_repeats,
    )
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, tokenizer = load_model(model_dir, DTYPES[dtype], device), Tokenizer(model_dir)
        trace = _trace(tokenizer, sizes)
        kv_tokens = kv_tokens or 2 * worst_case(trace)
        budget = kv_budget(trace, kv_tokens, model.config.kv_bytes_per_token(model.dtype))
        common = {"dtype": dtype, "device": device, "attention_backend": device.split(":")[0]}
        rows = run_rows(model_dir, model, tokenizer, trace, budget, common, include_hf, progress)
        prefill = prefill_attention(
            attention_context, attention_chunk, sizes["attention_repeats"], DTYPES[dtype]
        )
    finally:
        torch.set_num_threads(default_threads)
    report = {
        "machine": machine(threads),
        "model_dir": str(model_dir),
        "dtype": dtype,
        "device": device,
        "quick": quick,
        "trace": _describe(trace, sizes),
        "budget": budget,
        "rows": rows,
        "prefill_attention": prefill,
    }
    report["what_it_means"] = what_it_means(report)
    return report


def _sizes(quick: bool, **given) -> dict:
    """The run's sizes: the defaults (or --quick's), with what the caller gave instead."""
    sizes = dict(SIZES["quick" if quick else "full"])
    sizes.update({key: value for key, value in given.items() if value is not None})
    if sizes["requests"] < 1:
        raise ConfigError(f"bench staircase needs at least 1 request (--requests {sizes['requests']}).")
    return sizes


def _trace(tokenizer, sizes: dict) -> list[tuple[list[int], int]]:
    """The run's requests, (prompt ids, output length) each, drawn from SEED within the ranges."""
    prompt_len = check_range("--prompt-len", sizes["prompt_len"])
    output_len = check_range("--output-len", sizes["output_len"])
    return make_trace(tokenizer, sizes["requests"], SEED, prompt_len, output_len)


def _describe(trace, sizes: dict) -> dict:
    return {
        "requests": len(trace),
        "prompt_len": list(sizes["prompt_len"]),
        "output_len": list(sizes["output_len"]),
        "prompt_tokens": sum(len(p) for p, _ in trace),
        "output_tokens": sum(n for _, n in trace),
        "worst_case_tokens": worst_case(trace),
        "seed": SEED,
    }
