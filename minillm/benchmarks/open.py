"""`minillm bench open`: one model in two forms on disk, the fetched folder and the GGUF file it
came from: how long each takes to open, how long to its first token, and the memory it holds.

A user's GGUF opens in place (`--model FILE.gguf`): no conversion, nothing written. The folder is
what `weights_fetch.py` made of the same file: fp32 safetensors and the blocks beside them. Both
read the same blocks at decode (`--weights auto`), so what differs is the work before the first
token: reading and checking the file, dequantizing what the dense path needs, building the model.

Each run is a fresh Python process, since a process's peak memory only grows: it imports minillm
(not timed), opens the model (`LLM(path)`: config, tokenizer, weights), then generates one token
from a 32-token prompt, and reports its own peak resident memory. The forms run in turns, after one
untimed run of each that brings the files into the page cache: these are warm opens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from minillm.benchmarks import machine
from minillm.benchmarks.stats import spread
from minillm.config import DEFAULT_MODEL_DIR, ConfigError

# where weights_fetch.py leaves the GGUF it converted (fetch/checkpoint.py's download cache)
DEFAULT_GGUF = (
    DEFAULT_MODEL_DIR.parent / ".downloads" / DEFAULT_MODEL_DIR.name / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
FORMS = ("folder (safetensors)", "GGUF file")
PROMPT_TOKENS = 32
CHILD_SECONDS = 300  # one open and one token; a 1B GGUF on a slow disk stays far below this

# the child: argv = [path]; prints {"open_s", "first_token_s", "peak_rss_bytes"}
_CHILD = """
import json, resource, sys, time
from minillm.engine import LLM, SamplingParams
start = time.perf_counter()
llm = LLM(sys.argv[1], weights="auto")
opened = time.perf_counter()
llm.generate([[100 + i for i in range({tokens})]], SamplingParams(max_tokens=1, ignore_eos=True))
done = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
print(json.dumps({{"open_s": opened - start, "first_token_s": done - opened, "peak_rss_bytes": peak}}))
"""


def bench_open(model_dir: Path, gguf: Path, repeats: int) -> dict:
    """Both forms, `repeats` timed runs each in turns: the median, min and max of each number."""
    forms = dict(zip(FORMS, (model_dir, gguf)))
    for path in forms.values():
        if not path.exists():
            raise ConfigError(
                f"{path} is not there: run python weights_fetch.py, or name the file with --gguf."
            )
    runs: dict[str, list[dict]] = {name: [] for name in forms}
    for path in forms.values():
        _open_once(path)  # untimed: the page cache, the C++ kernels' first build
    for _ in range(repeats):
        for name, path in forms.items():
            runs[name].append(_open_once(path))
    return {
        "machine": machine(),
        "repeats": repeats,
        "prompt_tokens": PROMPT_TOKENS,
        "paths": {name: str(path) for name, path in forms.items()},
        "rows": {name: _summary(samples) for name, samples in runs.items()},
    }


def _open_once(path: Path) -> dict:
    """One fresh process's open, first token and peak memory."""
    child = subprocess.run(
        [sys.executable, "-c", _CHILD.format(tokens=PROMPT_TOKENS), str(path)],
        capture_output=True,
        text=True,
        timeout=CHILD_SECONDS,
    )
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"Opening {path} failed in its process: {last}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def _summary(samples: list[dict]) -> dict:
    return {key: spread([sample[key] for sample in samples]) for key in samples[0]}


def print_open_report(report: dict, console) -> None:
    from minillm.report import print_table

    rows = [
        [
            name,
            _cell(row["open_s"], "{:.2f}"),
            _cell(row["first_token_s"], "{:.3f}"),
            _cell(row["peak_rss_bytes"], "{:.0f}", 2**20),
        ]
        for name, row in report["rows"].items()
    ]
    print_table(
        console,
        f"open and first token, {report['repeats']} fresh processes per form (median, min-max)",
        ["form", "open (s)", "first token (s)", "peak memory (MiB)"],
        rows,
    )
    folder, gguf = (report["rows"][name] for name in FORMS)
    console.print(
        f"The GGUF file opens in {_ratio(gguf, folder, 'open_s'):.2f}x the folder's time, reaches its first "
        f"token in {_ratio(gguf, folder, 'first_token_s'):.2f}x, and peaks at "
        f"{_ratio(gguf, folder, 'peak_rss_bytes'):.2f}x its memory."
    )


def _ratio(row: dict, baseline: dict, key: str) -> float:
    return row[key]["median"] / baseline[key]["median"]


def _cell(number: dict, fmt: str, unit: float = 1.0) -> str:
    low, mid, high = (number[key] / unit for key in ("min", "median", "max"))
    return f"{fmt.format(mid)} ({fmt.format(low)}-{fmt.format(high)})"
