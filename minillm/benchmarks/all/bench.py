"""The run of `bench all`: each benchmark in turn, a failure recorded as its own, and the files
written."""

from __future__ import annotations

import datetime
import json
import time
import traceback
from pathlib import Path
from typing import Callable

from minillm.benchmarks import machine
from minillm.benchmarks.all.results import draw, markdown, pyplot
from minillm.benchmarks.all.suite import BENCHMARKS, Benchmark
from minillm.evaluation import read_text
from minillm.progress import progress_bar
from minillm.tokenizer import Tokenizer


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
    # what every benchmark but attention reads: if missing, one line now, not six failures
    Tokenizer(model_dir)
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
