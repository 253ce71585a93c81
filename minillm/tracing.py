"""Tracing a run: every engine's KV events in one file of JSON lines, read back as runs.

`--trace FILE` on generate, chat, serve and bench opens the file for the whole command
(`tracing`); every engine the command builds then subscribes a `TraceWriter` to its memory
system (`attach`), so a benchmark that compares three engines writes three runs. Each line is
one event (`memory/events.py`) with the run, the engine step it belongs to and the seconds since
the run began:

    {"run": 0, "step": 12, "t": 0.8312, "type": "Allocated", "seq_id": 3, "block": 41}

A run's first line is its `Snapshot` (pool sizes, the state it started from). `read_trace`
gives the runs back as event lists; `minillm trace show` draws them (`minillm/trace/`).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

from minillm.memory.events import Event, Snapshot, Step, event_from_json


class TraceFile:
    """The open trace of one command: its runs share the file, numbered in the order they start."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.file = self.path.open("w", encoding="utf-8")
        except OSError as err:
            raise ValueError(
                f"Cannot write the trace to {self.path} ({err.strerror}); pick another --trace path."
            ) from None
        self.runs = 0

    def writer(self) -> TraceWriter:
        self.runs += 1
        return TraceWriter(self, self.runs - 1)

    def close(self) -> None:
        self.file.close()


class TraceWriter:
    """A subscriber: each event as one JSON line. The file is flushed at the end of every step,
    so a trace of a server that is still running can be read."""

    def __init__(self, trace: TraceFile, run: int):
        self.trace, self.run, self.start = trace, run, time.perf_counter()

    def __call__(self, step: int, event: Event) -> None:
        if self.trace.file.closed:  # an engine that outlived its command: nothing to write to
            return
        stamp = {"run": self.run, "step": step, "t": round(time.perf_counter() - self.start, 6)}
        self.trace.file.write(json.dumps({**stamp, **event.to_json()}, separators=(",", ":")) + "\n")
        if isinstance(event, Step):
            self.trace.file.flush()


_active: TraceFile | None = None  # the trace the running command writes, if any


@contextlib.contextmanager
def tracing(path: str | Path | None):
    """While the block runs, every engine built writes its events into `path` (None: no trace)."""
    global _active
    if path is None:
        yield None
        return
    previous, _active = _active, TraceFile(Path(path))
    try:
        yield _active
    finally:
        _active.close()
        _active = previous


def attach(kv_cache) -> None:
    """Subscribe a writer of the active trace (if any) to this engine's KV cache manager."""
    if _active is not None:
        kv_cache.subscribe(_active.writer())


# ---------------------------------------------------------------------------- reading
class TraceError(ValueError):
    """A trace file that cannot be read; the message says where and what to do."""


def read_trace(path: str | Path) -> dict[int, list[tuple[int, float, Event]]]:
    """The runs of a trace file: run -> [(step, seconds, event)], in file order. A last line cut
    short (a server stopped mid-write) and blank lines are ignored; any other bad line is an error
    naming it."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(
            f"No trace file at {path}; write one with --trace {path} on generate, chat, serve or bench."
        )
    runs: dict[int, list[tuple[int, float, Event]]] = {}
    with path.open(encoding="utf-8-sig", errors="replace") as lines:  # a BOM an editor added is no line
        previous = None
        for number, line in enumerate(lines, 1):
            if previous is not None and previous.strip():
                _read_line(previous, number - 1, path, runs)
            previous = line
        if previous is not None and previous.endswith("\n") and previous.strip():
            _read_line(previous, number, path, runs)
    if not runs:
        raise TraceError(f"{path} holds no KV events; was the command run with --trace?")
    return runs


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_line(line: str, number: int, path: Path, runs: dict) -> None:
    try:
        record = json.loads(line)
        run, step, seconds = record["run"], record["step"], record["t"]
        if not (
            _whole(run) and _whole(step) and isinstance(seconds, (int, float)) and math.isfinite(seconds)
        ):
            raise ValueError(f"run, step and t must be whole numbers and a finite one: {str(record)[:60]}")
        event = event_from_json(record)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise TraceError(
            f"{path}:{number} is not a KV event line ({type(err).__name__}: {str(err)[:60]})."
        ) from None
    if run not in runs and not isinstance(event, Snapshot):
        raise TraceError(f"{path}:{number}: run {run} does not start with its Snapshot line.")
    runs.setdefault(run, []).append((step, seconds, event))
