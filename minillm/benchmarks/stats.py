"""How every bench, lesson and test summarizes what it measured: one percentile, one spread, one MiB.

A latency percentile here is the *nearest rank*: the smallest measured value that at least pct% of
the values are <= to (one of the values, never interpolated; of 2 values p50 is the smaller, p99 the
larger; of 10, p90 is the 9th). A tail reported this way is a request that really waited that long.
A number measured on several seeds or rounds is reported as its median with its min and max
(`spread`), so one lucky or disturbed run is seen as such.
"""

from __future__ import annotations

import statistics


def percentile(values: list[float], pct: int) -> float:
    """Nearest rank: the smallest value that pct% of the values are <= to (never interpolated)."""
    rank = -(-pct * len(values) // 100)  # ceil(pct n / 100), in integers so no float rounding moves it
    return sorted(values)[rank - 1]


def tails(name: str, values: list[float]) -> dict:
    """`{name}_p50_s` and `{name}_p99_s` of `values` (seconds), None for both when there are none
    (a TPOT where every request made a single token)."""
    return {
        f"{name}_p50_s": percentile(values, 50) if values else None,
        f"{name}_p99_s": percentile(values, 99) if values else None,
    }


def spread(values: list[float]) -> dict:
    """A number over seeds or rounds: its median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def mib(num_bytes: int) -> str:
    """Bytes as MiB with one decimal, for a table's cell."""
    return f"{num_bytes / 2**20:.1f}"
