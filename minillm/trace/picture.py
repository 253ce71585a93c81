"""The drawing: a run's timeline as one PNG, blocks by state over requests by place.

The top panel shows every block x every step coloured by its state (`BLOCK_STATES`): device
blocks, then host, then disk, a line between tiers. The bottom panel shows one lane per request
coloured by where its KV lives (`PLACES`). On a long run a cell aggregates steps and blocks
(`aggregate`: its most frequent code that is not the background), and the panel titles say how
many. The grids come from `timeline.py`; matplotlib is optional (`pyplot` says if it is there).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from minillm.trace.records import BLOCK_STATES, PLACES
from minillm.trace.timeline import block_rows, request_rows

if TYPE_CHECKING:
    from minillm.trace.run_view import RunView

BLOCK_COLOURS = ("#f2f2f2", "#9ecae1", "#2171b5", "#e6550d")  # free, cached, private, shared
PLACE_COLOURS = ("#ffffff", "#bdbdbd", "#31a354", "#fd8d3c", "#756bb1", "#de2d26")  # as PLACES
MAX_COLUMNS, MAX_BLOCK_ROWS, MAX_REQUEST_ROWS = 400, 160, 80  # cells a panel shows at most, each way
MIN_TIER_SHARE = 0.12  # of the block panel's height, for a tier far smaller than the device pool


def aggregate(grid: np.ndarray, columns_per_cell: int, rows_per_cell: int, num_codes: int) -> np.ndarray:
    """Cells of rows_per_cell x columns_per_cell entries, each the most frequent code that is not
    the background 0 (0 only where the whole cell is background)."""
    rows, columns = grid.shape
    if not rows or not columns:
        return np.zeros((1, 1), np.uint8)
    padded = np.zeros(
        (-(-rows // rows_per_cell) * rows_per_cell, -(-columns // columns_per_cell) * columns_per_cell),
        np.uint8,
    )
    padded[:rows, :columns] = grid
    cells = padded.reshape(padded.shape[0] // rows_per_cell, rows_per_cell, -1, columns_per_cell)
    counts = np.stack([(cells == code).sum(axis=(1, 3)) for code in range(1, num_codes)])  # (codes-1, R, C)
    return np.where(counts.max(axis=0) > 0, counts.argmax(axis=0) + 1, 0).astype(np.uint8)


def cell_size(num_rows: int, num_columns: int, max_rows: int) -> tuple[int, int]:
    """(rows, columns) per cell: 1 x 1 until a panel would show more than its maximum."""
    return max(1, -(-num_rows // max_rows)), max(1, -(-num_columns // MAX_COLUMNS))


def pyplot():
    """matplotlib's pyplot drawing to files, or None (the caller says how to install it)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(view: RunView, path: Path, title: str) -> str | None:
    """The timeline PNG: blocks by state over steps on top (device, then host, then disk, a line
    between tiers), one lane per request below. Returns what a cell is, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    blocks, tiers = block_rows(view)
    lanes, requests = request_rows(view)
    num_steps = len(view.step_numbers)
    # free blocks are taken least recently freed first, so a light run uses only a tier's low ids:
    # each tier is drawn up to the highest block it ever used
    drawn = {name: _used(blocks, rows) for name, rows in tiers.items()}
    blocks_per_cell, steps_per_cell = cell_size(sum(map(len, drawn.values())), num_steps, MAX_BLOCK_ROWS)
    requests_per_cell, _ = cell_size(len(requests), num_steps, MAX_REQUEST_ROWS)
    parts, labels = _tier_parts(blocks, tiers, drawn, steps_per_cell, blocks_per_cell)
    lane_cells = aggregate(
        lanes, steps_per_cell, requests_per_cell, len(PLACES)
    )  # (request groups, step bins)
    block_cell = cells(steps_per_cell, blocks_per_cell, "block")
    lane_cell = cells(steps_per_cell, requests_per_cell, "request")

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(13, 10), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    first = view.step_numbers[0] - 0.5
    steps = (first, first + parts[0].shape[1] * steps_per_cell)  # the x extent, in engine steps
    _draw_blocks(top, parts, labels, steps, f"blocks by state — {block_cell}")
    _draw_lanes(
        bottom, lane_cells, requests, requests_per_cell, steps, f"where each request's KV lives — {lane_cell}"
    )
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"{block_cell}; {lane_cell}"


def _tier_parts(
    blocks: np.ndarray,
    tiers: dict[str, range],
    drawn: dict[str, range],
    steps_per_cell: int,
    blocks_per_cell: int,
) -> tuple[list[np.ndarray], list[str]]:
    """Each tier's cells and its label; each tier grouped on its own, so the line between tiers
    falls between cells, and a small tier drawn taller, to be seen."""
    parts, labels = [], []
    for name, rows in drawn.items():
        part = aggregate(blocks[rows.start : rows.stop], steps_per_cell, blocks_per_cell, len(BLOCK_STATES))
        stretch = math.ceil(MIN_TIER_SHARE * sum(map(len, drawn.values())) / blocks_per_cell / len(part))
        parts.append(np.repeat(part, stretch, axis=0))  # (block groups, step bins)
        labels.append(f"{name}\n{len(tiers[name])} blocks")
        if len(rows) < len(tiers[name]):
            labels[-1] += f"\n(ids {rows.start}-{rows.stop - 1};\nthe rest unused)"
        if stretch > 1:
            labels[-1] += f"\n(drawn x{stretch})"
    return parts, labels


def _draw_blocks(ax, parts: list[np.ndarray], labels: list[str], steps: tuple, title: str) -> None:
    """The top panel: every tier's blocks by state, a line between tiers, each tier labelled."""
    block_cells = np.concatenate(parts)  # (block groups, step bins)
    _panel(ax, block_cells, BLOCK_STATES, BLOCK_COLOURS, steps, title, "block state")
    offset, ticks = 0, []
    for part in parts:
        ticks.append(offset + len(part) / 2)
        offset += len(part)
        if offset < len(block_cells):
            ax.axhline(offset, color="black", linewidth=1.5)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylabel("block (by id)")


def _draw_lanes(
    ax, lane_cells: np.ndarray, requests: list[str], requests_per_cell: int, steps: tuple, title: str
) -> None:
    """The bottom panel: one lane per request (or group of requests) by where its KV lives."""
    _panel(ax, lane_cells, PLACES, PLACE_COLOURS, steps, title, "KV lives in")
    if 0 < len(lane_cells) <= 24:  # few enough lanes to name
        names = [
            ", ".join(requests[row * requests_per_cell : (row + 1) * requests_per_cell])
            for row in range(len(lane_cells))
        ]
        ax.set_yticks([row + 0.5 for row in range(len(lane_cells))], names, fontsize=7)
    else:
        ax.set_yticks([])
    ax.set_ylabel(f"{plural(len(requests), 'request')}\n(by first block)")
    ax.set_xlabel("engine step")


def cells(columns: int, rows: int, what: str) -> str:
    """What one cell of a panel is: '1 cell = 4 steps x 8 blocks'."""
    return f"1 cell = {plural(columns, 'step')} x {plural(rows, what)}"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _used(grid: np.ndarray, rows: range) -> range:
    """The tier's rows up to the last block that was ever anything but free (one row at least)."""
    used = np.flatnonzero(grid[rows.start : rows.stop].any(axis=1))
    return range(rows.start, rows.start + (used[-1] + 1 if len(used) else 1))


def _panel(ax, grid: np.ndarray, names: tuple, colours: tuple, steps: tuple, title: str, legend: str) -> None:
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    cmap = ListedColormap(colours)
    ax.imshow(
        grid,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        vmin=0,
        vmax=len(colours) - 1,
        extent=(*steps, len(grid), 0),
    )
    ax.set_title(title, fontsize=10)
    shown = [Patch(facecolor=c, edgecolor="grey", label=n) for n, c in zip(names, colours) if n != "none"]
    ax.legend(handles=shown, loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=9, title=legend)
