"""The benchmarks `bench all` runs: how each is called, its report, headlines and bar chart, and
the sizes it runs at (smaller than each benchmark's own defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from minillm.benchmarks.all.headlines import (
    Bars,
    Headline,
    attention_bars,
    attention_headlines,
    decode_bars,
    decode_headlines,
    memory_bars,
    memory_headlines,
    ppl_bars,
    ppl_headlines,
    prefix_bars,
    prefix_headlines,
    serve_bars,
    serve_headlines,
    staircase_bars,
    staircase_headlines,
    tiers_bars,
    tiers_headlines,
)
from minillm.benchmarks.attention import bench_attention, print_attention_report
from minillm.benchmarks.decode import bench_decode, print_decode_report
from minillm.benchmarks.memory import bench_memory, print_memory_report
from minillm.benchmarks.prefix import bench_prefix, print_prefix_report
from minillm.benchmarks.serve import bench_serve, print_serve_report
from minillm.benchmarks.staircase import bench_staircase, print_staircase_report
from minillm.benchmarks.tiers import bench_tiers, print_tiers_report
from minillm.config import SWITCHES
from minillm.evaluation import DEFAULT_TEXT, eval_ppl
from minillm.report import print_table

# ----------------------------------------------------------------------------- the benchmarks
# Each runs as (model_dir, progress, **size): the benchmark's own function, with a progress bar
# where it has one.


def run_decode(model_dir: Path, progress: bool, **size) -> dict:
    return bench_decode(model_dir, **size)


def run_attention(model_dir: Path, progress: bool, **size) -> dict:
    """Decode attention alone: SmolLM2's shapes and random KV, no weights (`model_dir` unused)."""
    return bench_attention(**size)


def run_serve(model_dir: Path, progress: bool, **size) -> dict:
    return bench_serve(model_dir, **size)


def run_prefix(model_dir: Path, progress: bool, **size) -> dict:
    return bench_prefix(model_dir, **size)


def run_tiers(model_dir: Path, progress: bool, **size) -> dict:
    return bench_tiers(model_dir, progress=progress, **size)


def run_memory(model_dir: Path, progress: bool, **size) -> dict:
    return bench_memory(model_dir, progress=progress, **size)


def run_staircase(model_dir: Path, progress: bool, **size) -> dict:
    return bench_staircase(model_dir, progress=progress, **size)


def run_ppl(
    model_dir: Path, progress: bool, kv_dtypes: tuple[str, ...], segment_len: int, num_segments: int
) -> dict:
    """`minillm eval ppl` once per KV format, on the default text."""
    return {
        "text": str(DEFAULT_TEXT),
        "segment_len": segment_len,
        "segments": num_segments,
        "kv_dtypes": {
            kv_dtype: eval_ppl(
                model_dir, DEFAULT_TEXT, segment_len, num_segments, progress=progress, kv_dtype=kv_dtype
            )
            for kv_dtype in kv_dtypes
        },
    }


def print_ppl_report(report: dict, console) -> None:
    exact = report["kv_dtypes"].get("auto", {}).get("perplexity")
    print_table(
        console,
        f"perplexity through the cache, {report['segments']} x {report['segment_len']} tokens of "
        f"{Path(report['text']).name}",
        ["KV format", "perplexity", "vs the model's dtype", "KV bytes/token"],
        [
            [
                kv_dtype,
                f"{r['perplexity']:.3f}",
                f"x{r['perplexity'] / exact:.3f}" if exact else "n/a",
                f"{r['kv_bytes_per_token']:,}",
            ]
            for kv_dtype, r in report["kv_dtypes"].items()
        ],
    )


@dataclass(frozen=True)
class Benchmark:
    name: str  # `minillm bench NAME` runs it alone at full size (ppl: `minillm eval ppl`)
    run: Callable[..., dict]  # (model_dir, progress, **size) -> its report
    print_report: Callable  # (report, console): its own tables
    headlines: Callable[[dict], list[Headline]]
    bars: Callable[[dict], Bars]


BENCHMARKS = (
    Benchmark("decode", run_decode, print_decode_report, decode_headlines, decode_bars),
    Benchmark("attention", run_attention, print_attention_report, attention_headlines, attention_bars),
    Benchmark("serve", run_serve, print_serve_report, serve_headlines, serve_bars),
    Benchmark("prefix", run_prefix, print_prefix_report, prefix_headlines, prefix_bars),
    Benchmark("tiers", run_tiers, print_tiers_report, tiers_headlines, tiers_bars),
    Benchmark("memory", run_memory, print_memory_report, memory_headlines, memory_bars),
    Benchmark("staircase", run_staircase, print_staircase_report, staircase_headlines, staircase_bars),
    Benchmark("ppl", run_ppl, print_ppl_report, ppl_headlines, ppl_bars),
)

KV_DTYPES = SWITCHES["kv_dtype"].choices  # every KV format, the model's own ("auto") first
QUICK_KV_DTYPES = tuple(kv_dtype for kv_dtype in KV_DTYPES if kv_dtype != "fp8")  # --quick leaves fp8 out

# Each benchmark's keyword arguments, smaller than its own defaults. quick: about 5 minutes in all
# on a shared 2-core CPU (decode's sweep over thread counts is most of it there); full: more.
SIZES = {
    "quick": {
        "decode": {"prompt_len": 32, "new_tokens": 16, "naive_tokens": 4, "repeats": 2, "include_hf": False},
        "attention": {"batches": (1, 16), "contexts": (128, 1024)},
        "serve": {"num_requests": 4, "max_num_seqs": 4, "block_sizes": (16,), "include_hf": False},
        "prefix": {"num_requests": 4, "system_tokens": 250},
        "tiers": {
            "num_requests": 10,
            "device_tokens": 256,
            "history_tokens": 1000,
            "system_prompts": 4,
            "system_tokens": 128,
            "spill_requests": 8,
            "spill_rule_requests": 24,
            "spill_rule_seeds": (1,),
        },
        "memory": {"quick": True, "load": False},
        "staircase": {"quick": True, "include_hf": False},
        "ppl": {"kv_dtypes": QUICK_KV_DTYPES, "segment_len": 96, "num_segments": 2},
    },
    "full": {
        "decode": {"prompt_len": 64, "new_tokens": 64, "naive_tokens": 8, "repeats": 3},
        "attention": {"batches": (1, 4, 16), "contexts": (128, 512, 2048)},
        "serve": {"num_requests": 16, "max_num_seqs": 8, "block_sizes": (8, 16, 32)},
        "prefix": {"num_requests": 8, "system_tokens": 500},
        "tiers": {"num_requests": 32, "history_tokens": 2000, "spill_requests": 16, "spill_rule_seeds": (1,)},
        "memory": {"quick": True},  # with its load tests; the full-length trace is `minillm bench memory`
        "staircase": {"quick": True},  # with HF; the full-length trace is `minillm bench staircase`
        "ppl": {"kv_dtypes": KV_DTYPES, "segment_len": 256, "num_segments": 2},
    },
}
