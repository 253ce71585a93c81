"""`minillm bench all`: every benchmark in one command, so every number the README claims can be
reproduced by running one thing.

It runs each benchmark's own function (`bench_decode`, `bench_serve`, ... and `eval_ppl` for a
few KV formats) at a size a small CPU finishes in minutes, one after another (--quick: 306 s on
the 2-core development VM while other jobs shared it, 2026-12-01; without it, larger sizes);
a benchmark that fails is recorded as failed and the others still run. Into the output folder
(`bench_results/` by default) it writes:

  results.json   the machine (CPU model, torch version and threads), the date, and per benchmark
                 its size, seconds, status, headline numbers and its whole report;
  results.md     one markdown table of the headline numbers, exactly as results.json has them
                 (rounded to 3 significant digits), with the date and the machine above it;
  NAME.png       one bar chart per benchmark that ran.

Smaller sizes than a benchmark's own defaults measure the same things with more noise; each
row of the table names its benchmark, and `minillm bench NAME` measures it at full size.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from minillm.benchmarks import cpu_model
from minillm.benchmarks.attention import bench_attention, print_attention_report
from minillm.benchmarks.decode import bench_decode, print_decode_report
from minillm.benchmarks.memory import bench_memory, print_memory_report
from minillm.benchmarks.prefix import bench_prefix, print_prefix_report
from minillm.benchmarks.serve import bench_serve, print_serve_report
from minillm.benchmarks.tiers import bench_tiers, print_tiers_report
from minillm.config import ConfigError
from minillm.evaluation import DEFAULT_TEXT, eval_ppl, read_text
from minillm.progress import progress_bar
from minillm.report import console, print_table
from minillm.tokenizer import Tokenizer

Headline = tuple[str, float | int | None, str]  # (what was measured, its value, its unit)


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


# ----------------------------------------------------------------------------- headlines and plots


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
        (
            f"resume a {resume['history_tokens']}-token chat: TTFT recompute / resume",
            resume["ttft_ratio"],
            "x",
        ),
        ("prefix spill: prefill saved with / without a host tier", spill["prefill_saved_ratio"], "x"),
    ]


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


Bars = tuple[str, str, dict[str, float]]  # (title, value axis label, {bar: value})


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


def ppl_bars(r: dict) -> Bars:
    return (
        f"perplexity through the cache, {Path(r['text']).name}",
        "perplexity",
        {kv_dtype: row["perplexity"] for kv_dtype, row in r["kv_dtypes"].items()},
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
    Benchmark("ppl", run_ppl, print_ppl_report, ppl_headlines, ppl_bars),
)

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
        },
        "memory": {"quick": True, "load": False},
        "ppl": {"kv_dtypes": ("auto", "int8", "int4"), "segment_len": 96, "num_segments": 2},
    },
    "full": {
        "decode": {"prompt_len": 64, "new_tokens": 64, "naive_tokens": 8, "repeats": 3},
        "attention": {"batches": (1, 4, 16), "contexts": (128, 512, 2048)},
        "serve": {"num_requests": 16, "max_num_seqs": 8, "block_sizes": (8, 16, 32)},
        "prefix": {"num_requests": 8, "system_tokens": 500},
        "tiers": {"num_requests": 32, "history_tokens": 2000, "spill_requests": 16},
        "memory": {"quick": True},  # with its load tests; the full-length trace is `minillm bench memory`
        "ppl": {"kv_dtypes": ("auto", "int8", "int4", "fp8"), "segment_len": 256, "num_segments": 2},
    },
}


# ----------------------------------------------------------------------------- the run


def machine() -> dict:
    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def rounded(value):
    """3 significant digits: what the table shows, and so what results.json keeps beside the reports."""
    return float(f"{value:.3g}") if isinstance(value, float) else value


def run_one(bench: Benchmark, model_dir: Path, size: dict, progress: bool) -> dict:
    """One benchmark, its report and headlines; an exception ends only this one, recorded as failed."""
    start = time.perf_counter()
    try:
        report = bench.run(model_dir, progress, **size)
        headlines = [
            {"measurement": what, "value": rounded(value), "unit": unit}
            for what, value, unit in bench.headlines(report)
        ]
    except Exception as err:  # noqa: BLE001 -- any failure, a bug included, is this benchmark's alone
        return {
            "status": "failed",
            "size": size,
            "seconds": time.perf_counter() - start,
            "error": f"{type(err).__name__}: {err}".splitlines()[0],
            "traceback": traceback.format_exc(),
        }
    return {
        "status": "ok",
        "size": size,
        "seconds": time.perf_counter() - start,
        "headlines": headlines,
        "report": report,
    }


def bench_all(
    model_dir: Path,
    out_dir: Path,
    sizes: dict[str, dict],
    command: str = "minillm bench all",
    progress: bool = False,
    show: Callable | None = None,
) -> dict:
    """Run the benchmarks named in `sizes` (in BENCHMARKS' order) and write results.json, results.md
    and one PNG each into `out_dir`. `show(bench, result)` is called as each one finishes."""
    plt = pyplot()
    Tokenizer(
        model_dir
    )  # what every benchmark but attention reads: if missing, one line now, not six failures
    read_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    selected = [bench for bench in BENCHMARKS if bench.name in sizes]
    results = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "model_dir": str(model_dir),
        "benchmarks": {},
    }
    start = time.perf_counter()
    with progress_bar("bench all: benchmarks", len(selected), enabled=progress) as advance:
        for bench in selected:
            result = results["benchmarks"][bench.name] = run_one(
                bench, model_dir, sizes[bench.name], progress
            )
            if result["status"] == "ok":
                result["plot"] = draw(
                    plt, out_dir / f"{bench.name}.png", bench.name, *bench.bars(result["report"])
                )
            if show:
                show(bench, result)
            advance()
    results["seconds"] = time.perf_counter() - start
    results["failed"] = [
        name for name, result in results["benchmarks"].items() if result["status"] == "failed"
    ]
    (out_dir / "results.json").write_text(strict_json(results) + "\n")
    (out_dir / "results.md").write_text(markdown(results))
    return results


def strict_json(results: dict) -> str:
    try:
        return json.dumps(results, allow_nan=False, indent=1)
    except ValueError as err:  # a benchmark's bug, as in report.print_json
        raise RuntimeError(
            f"bench all's results are not strict JSON ({err}); a rate with nothing to measure must be None"
        ) from err


# ----------------------------------------------------------------------------- the table and the plots


def cell(value) -> str:
    """A headline value as the table shows it: the rounded number itself, so it reads back equal."""
    return "n/a" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"`{results['command']}` on {results['date'][:10]}: {m['cpu_model']}, {m['cpus']} CPUs, "
        f"torch {m['torch']}, {m['torch_threads']} torch thread(s); {results['seconds']:.0f} s in all.",
        "",
        "| benchmark | measurement | value | unit |",
        "|---|---|---:|---|",
    ]
    for name, result in results["benchmarks"].items():
        if result["status"] == "failed":
            lines.append(f"| {name} | FAILED: {result['error'].replace('|', '/')} | | |")
            continue
        lines += [
            f"| {name} | {h['measurement']} | {cell(h['value'])} | {h['unit']} |" for h in result["headlines"]
        ]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib's pyplot drawing to files, or one line saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "bench all draws its plots with matplotlib, which is not installed — run: "
            "pip install -e '.[lessons]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(plt, path: Path, name: str, title: str, axis: str, bars: dict[str, float]) -> str:
    """One horizontal bar per entry, its value written at its end."""
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.35 * len(bars)))
    ax.barh(list(bars), list(bars.values()), color="tab:blue")
    ax.invert_yaxis()  # the first entry on top, as in the table
    for y, value in enumerate(bars.values()):
        ax.text(value, y, f" {value:,.0f}" if abs(value) >= 100 else f" {value:.3g}", va="center", fontsize=8)
    ax.set_xlabel(axis)
    ax.set_title(f"{name}: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def print_results(results: dict, out_dir: Path) -> None:
    """The headline table and where the files are (each benchmark's own report printed as it finished)."""
    rows = [
        [name, h["measurement"], cell(h["value"]), h["unit"]]
        for name, result in results["benchmarks"].items()
        if result["status"] == "ok"
        for h in result["headlines"]
    ]
    rows += [
        [name, f"FAILED: {result['error']}", "", ""]
        for name, result in results["benchmarks"].items()
        if result["status"] == "failed"
    ]
    print_table(
        console, f"bench all, {results['seconds']:.0f} s", ["benchmark", "measurement", "value", "unit"], rows
    )
    console.print(
        f"wrote {out_dir / 'results.json'}, {out_dir / 'results.md'} and "
        f"{sum(r['status'] == 'ok' for r in results['benchmarks'].values())} plots in {out_dir}/"
    )
