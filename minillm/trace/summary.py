"""The numbers `minillm trace show` prints: a walked run (`run_view.py`) summed into one JSON-ready dict.

`describe_runs` lists the runs of a trace file and `busiest` picks the one to summarize;
`summarize` answers each question of the package (`__init__.py`) in a section of its own:
lifetimes, reuse, spills, swaps, reads, places. Every distribution is a `spread` (count, median,
p90, max), so a table prints it the same way whatever it measures.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

import numpy as np

from minillm.memory import events as ev
from minillm.trace.records import PLACES, Life
from minillm.trace.timeline import request_rows

if TYPE_CHECKING:
    from minillm.trace.run_view import RunView


def spread(values: list[float]) -> dict:
    """count, median, p90 (nearest rank) and max; None for each with nothing to measure."""
    if not values:
        return {"count": 0, "median": None, "p90": None, "max": None}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "median": statistics.median(ordered),
        "p90": ordered[math.ceil(0.9 * len(ordered)) - 1],
        "max": ordered[-1],
    }


def describe_runs(runs: dict[int, list[tuple[int, float, ev.Event]]]) -> list[dict]:
    """One line per run of a trace: its steps, requests and pool (the engine is not recorded)."""
    described = []
    for run, events in runs.items():
        snapshot = events[0][2]
        steps = [event for _, _, event in events if isinstance(event, ev.Step)]
        requests = {request_id for step in steps for _, request_id, _, _ in step.sequences}
        described.append(
            {
                "run": run,
                "steps": len(steps),
                "requests": len(requests),
                "device_blocks": snapshot.num_blocks,
                "host_blocks": snapshot.host_blocks,
                "block_size": snapshot.block_size,
                "events": len(events),
            }
        )
    return described


def busiest(described: list[dict]) -> int:
    """The run with the most steps (of equals, the one with most events, then the first)."""
    return max(described, key=lambda run: (run["steps"], run["events"], -run["run"]))["run"]


def summarize(view: RunView) -> dict:
    """Every number `trace show` prints, as one JSON-ready dict."""
    pool = view.pool
    return {
        "pool": {
            "device_blocks": pool.num_blocks,
            "host_blocks": pool.host_blocks,
            "disk_blocks_seen": max(0, view.top_block + 1 - pool.num_blocks - pool.host_blocks),
            "block_size": pool.block_size,
            "bytes_per_token": pool.bytes_per_token,
        },
        "steps": len(view.step_numbers),
        "events": view.num_events,
        "requests": len(view.request_reads),
        "lifetimes": lifetimes(view),
        "reuse": reuse(view),
        "spills": spills(view),
        "swaps": swaps(view),
        "reads": reads(view),
        "places": places(view),
    }


def lifetimes(view: RunView) -> dict:
    """Per tier: contents, steps held, steps waited cached (of those that waited), how they ended."""
    by_tier: dict[str, list[Life]] = {}
    for life in view.lives:
        by_tier.setdefault(life.tier, []).append(life)
    report = {}
    for tier in ("device", "host", "disk"):
        lives = by_tier.get(tier, [])
        if not lives:
            continue
        ended: dict[str, int] = {}
        for life in lives:
            ended[life.end] = ended.get(life.end, 0) + 1
        report[tier] = {
            "contents": len(lives),
            "held_steps": spread([life.held_steps for life in lives]),
            "cached_steps": spread([life.cached_steps for life in lives if life.waited]),
            "ended": ended,
        }
    return report


def reuse(view: RunView) -> dict:
    requests_per_entry = [len({view.request_of(seq) for seq in e.hit_seqs}) for e in view.entries]
    most = sorted(range(len(view.entries)), key=lambda i: -requests_per_entry[i])[:5]
    return {
        "registered": len(view.entries),
        "hit": sum(1 for n in requests_per_entry if n),
        "never_hit": sum(1 for n in requests_per_entry if not n),
        "hits": sum(len(e.hit_seqs) for e in view.entries),
        "requests_per_hit_block": spread([n for n in requests_per_entry if n]),
        "distance_steps": spread([d for e in view.entries for d in e.distances]),
        "hits_while_held": sum(e.hits_while_held for e in view.entries),
        "most_shared": [
            {
                "key": view.entries[i].key,
                "registered_step": view.entries[i].registered,
                "requests": requests_per_entry[i],
                "hits": len(view.entries[i].hit_seqs),
            }
            for i in most
            if requests_per_entry[i]
        ],
    }


def spills(view: RunView) -> dict:
    back = [s.brought_back - s.step for s in view.spills if s.brought_back is not None]
    return {
        "spilled": len(view.spills),
        "brought_back": len(back),
        "dropped_unread": sum(1 for s in view.spills if s.dropped),
        "on_host_at_end": sum(1 for s in view.spills if s.brought_back is None and not s.dropped),
        "steps_on_host_before_back": spread(back),
    }


def swaps(view: RunView) -> dict:
    per_seq: dict[int, dict] = {}
    for trip in view.trips:
        row = per_seq.setdefault(
            trip.seq_id,
            {"seq_id": trip.seq_id, "request": view.request_of(trip.seq_id), "round_trips": 0}
            | {"blocks_out": 0, "blocks_in": 0, "steps_away": 0, "max_steps_away": 0, "not_back": 0},
        )
        row["blocks_out"] += trip.blocks_out
        row["blocks_in"] += trip.blocks_in
        if trip.back_step is None:
            row["not_back"] += 1
            continue
        away = trip.back_step - trip.out_step
        row["round_trips"] += 1
        row["steps_away"] += away
        row["max_steps_away"] = max(row["max_steps_away"], away)
    returned = [t for t in view.trips if t.back_step is not None]
    return {
        "round_trips": len(returned),
        "sequences": len(per_seq),
        "blocks_out": sum(t.blocks_out for t in view.trips),
        "blocks_in": sum(t.blocks_in for t in view.trips),
        "steps_away": spread([t.back_step - t.out_step for t in returned]),
        "freed_while_away": sum(1 for t in view.trips if t.freed),
        "away_at_end": sum(1 for t in view.trips if t.back_step is None and not t.freed),
        "per_sequence": sorted(per_seq.values(), key=lambda row: (-row["steps_away"], row["seq_id"])),
    }


def reads(view: RunView) -> dict:
    per_request = [
        {
            "request": request,
            "steps": len(steps),
            "mean_bytes": sum(steps) / len(steps),
            "max_bytes": max(steps),
        }
        for request, steps in view.request_reads.items()
    ]
    step_total = view.step_reads
    return {
        "bytes_per_step": spread(step_total)
        | {"mean": sum(step_total) / len(step_total) if step_total else None},
        "total_bytes": sum(step_total),
        "per_request": sorted(per_request, key=lambda row: (-row["max_bytes"], row["request"])),
    }


def places(view: RunView) -> dict:
    """Request-steps in each place, and per request; the lanes are `request_rows`."""
    lanes, requests = request_rows(view)
    counts = np.stack([(lanes == code).sum(axis=1) for code in range(len(PLACES))], axis=1)
    per_request = [
        {"request": request} | {PLACES[code]: int(counts[row, code]) for code in range(1, len(PLACES))}
        for row, request in enumerate(requests)
    ]
    return {
        "request_steps": {PLACES[code]: int(counts[:, code].sum()) for code in range(1, len(PLACES))},
        "per_request": per_request,
    }
