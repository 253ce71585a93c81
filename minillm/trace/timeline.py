"""The timeline's grids: each block's state and each request's place, step by step, from changes.

A long run has many blocks x many steps, and most cells repeat the one before. So the walk
(`run_view.py`) writes a row's value only when it changes (`records.record_change`), and the
grids are filled once, at the end, from those changes (`block_rows`, `request_rows`): one byte per
block x step coloured by its state (`BLOCK_STATES`), one lane per request coloured by where its
KV lives (`PLACES`). The drawing (`picture.py`) and the place counts (`summary.py`) read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from minillm.trace.records import MIXED
from minillm.tracing import TraceError

if TYPE_CHECKING:
    from minillm.trace.run_view import RunView

MAX_GRID_CELLS = 400_000_000  # blocks x steps drawn at most (one byte each, before aggregation)


def block_rows(view: RunView) -> tuple[np.ndarray, dict[str, range]]:
    """(blocks, steps) of state codes, rows by block id, and the rows of each tier."""
    num_device, num_host = view.pool.num_blocks, view.pool.host_blocks
    num_rows = max(view.top_block + 1, num_device + num_host)
    if num_rows * len(view.step_numbers) > MAX_GRID_CELLS:  # a file that claims a huge pool
        raise TraceError(
            f"The timeline would have {num_rows:,} blocks x {len(view.step_numbers):,} steps; "
            "too many to draw: use --no-plot for the numbers."
        )
    grid = _fill(view.block_changes, num_rows, len(view.step_numbers), lambda block: block)
    tiers = {"device": range(0, num_device), "host": range(num_device, num_device + num_host)}
    tiers["disk"] = range(num_device + num_host, num_rows)
    return grid, {name: rows for name, rows in tiers.items() if len(rows)}


def request_rows(view: RunView) -> tuple[np.ndarray, list[str]]:
    """(requests, steps) of place codes, a request's lane from its first block to its last
    free, `waiting` where it held none in between; requests in order of their first block."""
    seqs_of: dict[str, list[int]] = {}
    for seq_id in view.seq_changes:
        seqs_of.setdefault(view.request_of(seq_id), []).append(seq_id)
    num_steps = len(view.step_numbers)
    first = {
        request: min(view.seq_changes[seq][0][0] for seq in seqs if view.seq_changes[seq])
        for request, seqs in seqs_of.items()
        if any(view.seq_changes[seq] for seq in seqs)
    }
    requests = sorted(first, key=lambda request: (first[request], request))
    lanes = np.zeros((len(requests), num_steps), dtype=np.uint8)
    for row, request in enumerate(requests):
        seqs = seqs_of[request]
        places = _fill({seq: view.seq_changes[seq] for seq in seqs}, len(seqs), num_steps, seqs.index)
        bits = np.bitwise_or.reduce(np.left_shift(1, places.astype(np.int64)) & ~1, axis=0)  # (steps,)
        lane = np.where(bits & (bits - 1), MIXED, np.log2(np.maximum(bits, 1)).astype(np.uint8))
        present = np.flatnonzero(lane)
        if len(present):
            between = lane[present[0] : present[-1] + 1]
            between[between == 0] = 1  # alive, holding no KV: waiting
        lanes[row] = lane
    return lanes, requests


def _fill(changes: dict[int, list[tuple[int, int]]], num_rows: int, num_columns: int, row_of) -> np.ndarray:
    """A (rows, columns) grid from each row's changes [(column, code)]: a code holds until the next."""
    grid = np.zeros((num_rows, num_columns), dtype=np.uint8)
    for key, row_changes in changes.items():
        row = row_of(key)
        for (column, code), (until, _) in zip(row_changes, row_changes[1:] + [(num_columns, 0)]):
            grid[row, column:until] = code
    return grid
