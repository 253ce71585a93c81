"""Drawing the data flow of KV memory from the run itself: a trace of KV events, read back.

Before optimizing memory, draw its data flow: where each block's content comes from, how long it
lives, who reads it again and how soon, what a spill or a swap bought. A pool snapshot shows none
of that; the events a run wrote (`--trace FILE`, `tracing.py`) show all of it. This chapter walks
one run's events once, in order, with a `Replayer` (`memory/events.py`) rebuilding the pool
beside it, and keeps what the questions need:

    lifetimes   each content a block gets (allocated, copied on write, brought back, swapped to
                a new block): the steps some table held it, then the steps it waited cached
                (free, but findable) until a hit took it again, its block was reused, or it was
                forgotten
    reuse       each prefix-cache entry: the distinct requests that hit it, the steps from its
                last release to each hit, and how many were registered and never hit
    spills      cached blocks moved to the host tier: brought back by a hit, or never read again
    swaps       per sequence, the round trips swap-out -> swap-in: blocks moved, steps away
    reads       KV bytes attention read per step (entries read x bytes per token), per request
    places      per step, per request: where its KV lives (device, host, disk, mixed), or
                waiting with none between its first block and its last free

and draws the timeline (`draw`): every block x every step coloured by its state, and one lane
per request coloured by where its KV lives. The walk stays cheap on long runs: a step records
only the blocks and sequences its events touched, as changes, and the pictures are filled from
those changes at the end. `minillm trace show FILE` prints it (`cli/trace.py`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minillm.memory import events as ev
from minillm.memory.events import Replayer
from minillm.tracing import TraceError

BLOCK_STATES = ("free", "cached", "private", "shared")  # codes 0..3; 0 is the background
PLACES = ("none", "waiting", "device", "host", "disk", "mixed")  # codes 0..5; 0: no request yet/any more
TIER_PLACE = {"device": 2, "host": 3, "disk": 4}
MIXED = 5
MAX_GRID_CELLS = 400_000_000  # blocks x steps drawn at most (one byte each, before aggregation)


# ---------------------------------------------------------------------------- what is kept
@dataclass(slots=True)
class Life:
    """One content of one block: from the event that wrote it until it is gone."""

    tier: str
    start: int  # the step it got this content
    held_steps: int = 0  # steps some table held it (a step it was taken and let go in counts once)
    cached_steps: int = 0  # steps it waited free but findable
    waited: bool = False  # did it ever wait cached?
    held_since: int | None = None
    cached_since: int | None = None
    end: str = ""  # reused, freed, uncached, open (still there when the trace ends)


@dataclass(slots=True)
class PrefixEntry:
    """One registration in the prefix cache (the key follows the content across spills)."""

    key: int
    registered: int  # step
    hit_seqs: list[int] = field(default_factory=list)  # the sequence of every hit, in order
    distances: list[int] = field(default_factory=list)  # steps from the last release to a hit
    hits_while_held: int = 0  # hits while another table still held it (no release in between)
    released_at: int | None = None


@dataclass(slots=True)
class Spill:
    step: int
    brought_back: int | None = None  # the step a hit brought it back to the device
    dropped: bool = False  # forgotten on the host without being read again


@dataclass(slots=True)
class Trip:
    """A sequence's time away from the device, from its swap-out until all its blocks are back."""

    seq_id: int
    out_step: int
    blocks_out: int
    blocks_in: int = 0
    back_step: int | None = None
    freed: bool = False  # its table was freed while away (aborted, or recomputed later)


# ---------------------------------------------------------------------------- the walk
class RunView:
    """One run's events, walked once (`apply` each (step, event) in order, then `finish`)."""

    def __init__(self):
        self.pool = Replayer()
        self.lives_now: dict[int, Life] = {}  # block -> its current content
        self.lives: list[Life] = []  # contents that ended
        self.entries_now: dict[int, PrefixEntry] = {}  # key -> the registration cached now
        self.entries: list[PrefixEntry] = []  # every registration
        self.spills_now: dict[int, Spill] = {}  # host block -> the spill it holds
        self.spills: list[Spill] = []
        self.away: dict[int, Trip] = {}  # seq_id -> its trip in progress
        self.trips: list[Trip] = []
        self.seq_request: dict[int, str] = {}  # from Step events
        self.fork_parent: dict[int, int] = {}  # child -> parent (a fork belongs to the parent's request)
        self.request_reads: dict[str, list[int]] = {}  # request -> bytes it read in each step it ran
        self.step_reads: list[int] = []  # bytes read by the whole batch, per step
        self.step_numbers: list[int] = []  # the engine step of each Step event: the pictures' columns
        # the pictures, as changes: block -> [(column, state)], seq -> [(column, place)]
        self.block_changes: dict[int, list[tuple[int, int]]] = {}
        self.seq_changes: dict[int, list[tuple[int, int]]] = {}
        self.dirty_blocks: set[int] = set()
        self.dirty_seqs: set[int] = set()
        self.last_state: dict[int, int] = {}  # block -> its state before it was let go this step
        self.last_place: dict[int, int] = {}  # seq -> its place before its table was freed this step
        self.top_block = -1  # the highest block id seen (disk ids run on as needed)
        self.last_step = 0
        self.num_events = 0

    # ---------------------------------------------------------------- one event
    def apply(self, step: int, event: ev.Event) -> None:
        self.last_step, self.num_events = step, self.num_events + 1
        touched = getattr(self, "_" + type(event).__name__)(step, event)
        for block in touched:
            self._settle(block, step)
        self.dirty_blocks.update(touched)

    def _Snapshot(self, step: int, e: ev.Snapshot) -> list[int]:
        self.pool.apply(e)
        self.top_block = e.num_blocks + e.host_blocks - 1
        for block, key, _, _ in e.cached:
            self._register(key, step)
        held = {block for table in e.tables.values() for block in table}
        for block in held:
            self._begin(block, step)
        for block in set(self.pool.cached) - held:  # waiting cached already: since when is unknown
            self.lives_now[block] = Life(self.pool.tier(block), step, cached_since=step, waited=True)
        self.dirty_seqs.update(e.tables)
        return list(held | set(self.pool.cached))

    def _Allocated(self, step: int, e: ev.Allocated) -> list[int]:
        self.pool.apply(e)
        self._begin(e.block, step)
        self.dirty_seqs.add(e.seq_id)
        return [e.block]

    def _Reused(self, step: int, e: ev.Reused) -> list[int]:
        self.pool.apply(e)
        self._end(e.block, step, "reused")  # its cached content is overwritten (or spilled: `_Spilled`)
        return [e.block]

    def _Filled(self, step: int, e: ev.Event) -> list[int]:
        self.pool.apply(e)
        return []

    _EntriesEvicted = _Filled

    def _Registered(self, step: int, e: ev.Registered) -> list[int]:
        self.pool.apply(e)
        self._register(e.key, step)
        return [e.block]

    def _BroughtBack(self, step: int, e: ev.BroughtBack) -> list[int]:
        """A spilled content starts again in a device block of its own (the Hit that follows holds it)."""
        self.pool.apply(e)
        self._end(e.block, step, "reused")
        self.lives_now[e.block] = Life(self.pool.tier(e.block), step, cached_since=step)
        spill = self.spills_now.pop(e.host, None)
        if spill is not None:
            spill.brought_back = step
        return [e.host, e.block]

    def _Hit(self, step: int, e: ev.Hit) -> list[int]:
        was_held = {block: self.pool.refcounts[block] > 0 for block in e.blocks}
        self.pool.apply(e)
        for block in e.blocks:
            entry = self.entries_now[self.pool.cached[block]]  # every hit block is cached
            entry.hit_seqs.append(e.seq_id)
            if was_held[block]:
                entry.hits_while_held += 1
            elif entry.released_at is not None:
                entry.distances.append(step - entry.released_at)
        self.dirty_seqs.add(e.seq_id)
        return list(e.blocks)

    def _Forked(self, step: int, e: ev.Forked) -> list[int]:
        self.pool.apply(e)
        self.fork_parent[e.child_id] = e.parent_id
        self.dirty_seqs.add(e.child_id)
        return list(self.pool.tables[e.child_id])

    def _CopiedOnWrite(self, step: int, e: ev.CopiedOnWrite) -> list[int]:
        self.pool.apply(e)
        self._begin(e.block, step)
        self.dirty_seqs.add(e.seq_id)
        return [e.source, e.block]

    def _SwappedOut(self, step: int, e: ev.SwappedOut) -> list[int]:
        sources = {source for source, _ in e.moves}
        for seq_id in e.seq_ids:
            moved = sum(1 for block in self.pool.tables[seq_id] if block in sources)
            if seq_id in self.away:  # out again before all of it came back
                self.away[seq_id].blocks_out += moved
            else:
                self.away[seq_id] = Trip(seq_id, step, moved)
        self.pool.apply(e)
        for _, destination in e.moves:
            self._begin(destination, step)
        self.dirty_seqs.update(e.seq_ids)
        return [block for move in e.moves for block in move]

    def _SwappedIn(self, step: int, e: ev.SwappedIn) -> list[int]:
        sources = {source for source, _ in e.moves}
        holders = [seq_id for seq_id, table in self.pool.tables.items() if sources.intersection(table)]
        for seq_id in holders:  # every table holding a moved block follows it
            if seq_id in self.away:
                self.away[seq_id].blocks_in += sum(
                    1 for block in self.pool.tables[seq_id] if block in sources
                )
        self.pool.apply(e)
        for source, destination in e.moves:
            self._end(source, step, "freed")  # moved: (not `_settle`: a spill may already have
            self._begin(destination, step)  # been told into this host block, see `_Spilled`)
        for seq_id in holders:
            trip = self.away.get(seq_id)
            if trip is not None and all(
                self.pool.tier(block) == "device" for block in self.pool.tables[seq_id]
            ):
                trip.back_step = step
                self.trips.append(self.away.pop(seq_id))
        self.dirty_seqs.update(holders)
        return [block for move in e.moves for block in move]

    def _Spilled(self, step: int, e: ev.Spilled) -> list[int]:
        """A swap-in frees its host blocks as it decides each move, and the device blocks it takes
        may spill into them, so a Spilled into a host block the coming SwappedIn still shows held
        can come first; the spilled copy is followed here, not as that block's life."""
        self.pool.apply(e)
        spill = Spill(step)
        self.spills.append(spill)
        self.spills_now[e.host] = spill
        self.top_block = max(self.top_block, e.host)
        return [e.block, e.host]

    def _Uncached(self, step: int, e: ev.Uncached) -> list[int]:
        self.pool.apply(e)
        self.entries_now.pop(e.key, None)
        spill = self.spills_now.pop(e.block, None)
        if spill is not None:
            spill.dropped = True
        return [e.block]

    def _Truncated(self, step: int, e: ev.Truncated) -> list[int]:
        released = self.pool.tables[e.seq_id][e.num_blocks :]
        self._letting_go(released)
        self.pool.apply(e)
        self.dirty_seqs.add(e.seq_id)
        return released

    def _Freed(self, step: int, e: ev.Freed) -> list[int]:
        self._letting_go(e.blocks)
        self.last_place.setdefault(e.seq_id, self._place(e.seq_id))
        self.pool.apply(e)
        trip = self.away.pop(e.seq_id, None)
        if trip is not None:
            trip.freed = True
            self.trips.append(trip)
        self.dirty_seqs.add(e.seq_id)
        return list(e.blocks)

    def _letting_go(self, blocks) -> None:
        """Their state while held: a step shows what a block held during it, its last step included."""
        for block in blocks:
            self.last_state.setdefault(block, BLOCK_STATES.index(self.pool.state(block)))

    def _Step(self, step: int, e: ev.Step) -> list[int]:
        """The step is over: record who read what, and what its events changed in the pictures."""
        column = len(self.step_numbers)
        self.step_numbers.append(step)
        read: dict[str, int] = {}
        for seq_id, request_id, _, entries in e.sequences:
            self.seq_request[seq_id] = request_id
            read[request_id] = read.get(request_id, 0) + entries * self.pool.bytes_per_token
        for request_id, num_bytes in read.items():
            self.request_reads.setdefault(request_id, []).append(num_bytes)
        self.step_reads.append(sum(read.values()))
        for block in self.dirty_blocks:
            now = BLOCK_STATES.index(self.pool.state(block))
            during = self.last_state.get(block, now) if now <= 1 else now  # let go (free or cached) this step
            _record(self.block_changes.setdefault(block, []), column, during, now)
            self.top_block = max(self.top_block, block)
        for seq_id in self.dirty_seqs:
            now = self._place(seq_id)
            during = self.last_place.get(seq_id, now) if now == 0 else now  # freed this step
            _record(self.seq_changes.setdefault(seq_id, []), column, during, now)
        for touched in (self.dirty_blocks, self.dirty_seqs, self.last_state, self.last_place):
            touched.clear()
        return []

    # ---------------------------------------------------------------- a block's content
    def _begin(self, block: int, step: int) -> None:
        """The block gets new content, held by a table from this step on."""
        self._end(block, step, "reused")
        self.lives_now[block] = Life(self.pool.tier(block), step, held_since=step)

    def _end(self, block: int, step: int, how: str) -> None:
        life = self.lives_now.pop(block, None)
        if life is None:
            return
        if life.held_since is not None:
            life.held_steps += step - life.held_since + 1
        if life.cached_since is not None:
            life.cached_steps += step - life.cached_since
        life.end = how
        self.lives.append(life)

    def _settle(self, block: int, step: int) -> None:
        """Follow the block's content after an event touched it: taken, let go, forgotten."""
        life = self.lives_now.get(block)
        if life is None:
            return  # free (or a spilled copy on the host: `spills` follows those)
        held, cached = self.pool.refcounts[block] > 0, block in self.pool.cached
        if held and life.held_since is None:  # taken again: a prefix hit on a waiting block
            life.held_since = step
            if life.cached_since is not None:
                life.cached_steps += step - life.cached_since
                life.cached_since = None
        elif not held and life.held_since is not None:  # the last table let go
            life.held_steps += step - life.held_since + 1
            life.held_since = None
            if cached:
                life.cached_since, life.waited = step, True
                self.entries_now[self.pool.cached[block]].released_at = step  # for its reuse distance
            else:
                self._end(block, step, "freed")
        elif not held and not cached:  # forgotten while it waited
            self._end(block, step, "uncached")

    def _register(self, key: int, step: int) -> None:
        entry = PrefixEntry(key, step)
        self.entries_now[key] = entry
        self.entries.append(entry)

    def _place(self, seq_id: int) -> int:
        table = self.pool.tables.get(seq_id)
        if not table:
            return 0
        tiers = {self.pool.tier(block) for block in table}
        return TIER_PLACE[tiers.pop()] if len(tiers) == 1 else MIXED

    # ---------------------------------------------------------------- the end of the trace
    def finish(self) -> RunView:
        for block in list(self.lives_now):
            self._end(block, self.last_step, "open")
        for trip in self.away.values():
            self.trips.append(trip)
        self.away = {}
        return self

    def request_of(self, seq_id: int) -> str:
        """The request a sequence served: seen in a Step, or inherited through forks."""
        while seq_id not in self.seq_request and seq_id in self.fork_parent:
            seq_id = self.fork_parent[seq_id]
        return self.seq_request.get(seq_id, f"seq {seq_id}")

    # ---------------------------------------------------------------- the pictures
    def block_rows(self) -> tuple[np.ndarray, dict[str, range]]:
        """(blocks, steps) of state codes, rows by block id, and the rows of each tier."""
        num_device, num_host = self.pool.num_blocks, self.pool.host_blocks
        num_rows = max(self.top_block + 1, num_device + num_host)
        if num_rows * len(self.step_numbers) > MAX_GRID_CELLS:  # a file that claims a huge pool
            raise TraceError(
                f"The timeline would have {num_rows:,} blocks x {len(self.step_numbers):,} steps; "
                "too many to draw: use --no-plot for the numbers."
            )
        grid = _fill(self.block_changes, num_rows, len(self.step_numbers), lambda block: block)
        tiers = {"device": range(0, num_device), "host": range(num_device, num_device + num_host)}
        tiers["disk"] = range(num_device + num_host, num_rows)
        return grid, {name: rows for name, rows in tiers.items() if len(rows)}

    def request_rows(self) -> tuple[np.ndarray, list[str]]:
        """(requests, steps) of place codes, a request's lane from its first block to its last
        free, `waiting` where it held none in between; requests in order of their first block."""
        seqs_of: dict[str, list[int]] = {}
        for seq_id in self.seq_changes:
            seqs_of.setdefault(self.request_of(seq_id), []).append(seq_id)
        num_steps = len(self.step_numbers)
        first = {
            request: min(self.seq_changes[seq][0][0] for seq in seqs if self.seq_changes[seq])
            for request, seqs in seqs_of.items()
            if any(self.seq_changes[seq] for seq in seqs)
        }
        requests = sorted(first, key=lambda request: (first[request], request))
        lanes = np.zeros((len(requests), num_steps), dtype=np.uint8)
        for row, request in enumerate(requests):
            seqs = seqs_of[request]
            places = _fill({seq: self.seq_changes[seq] for seq in seqs}, len(seqs), num_steps, seqs.index)
            bits = np.bitwise_or.reduce(np.left_shift(1, places.astype(np.int64)) & ~1, axis=0)  # (steps,)
            lane = np.where(bits & (bits - 1), MIXED, np.log2(np.maximum(bits, 1)).astype(np.uint8))
            present = np.flatnonzero(lane)
            if len(present):
                between = lane[present[0] : present[-1] + 1]
                between[between == 0] = 1  # alive, holding no KV: waiting
            lanes[row] = lane
        return lanes, requests


def _record(changes: list[tuple[int, int]], column: int, during: int, now: int) -> None:
    """A step's column shows the code `during` it; `now` (after it) holds from the next column on."""
    if (changes[-1][1] if changes else 0) != during:
        changes.append((column, during))
    if now != during:
        changes.append((column + 1, now))


def _fill(changes: dict[int, list[tuple[int, int]]], num_rows: int, num_columns: int, row_of) -> np.ndarray:
    """A (rows, columns) grid from each row's changes [(column, code)]: a code holds until the next."""
    grid = np.zeros((num_rows, num_columns), dtype=np.uint8)
    for key, row_changes in changes.items():
        row = row_of(key)
        for (column, code), (until, _) in zip(row_changes, row_changes[1:] + [(num_columns, 0)]):
            grid[row, column:until] = code
    return grid


def walk(events: list[tuple[int, float, ev.Event]]) -> RunView:
    """One run's (step, seconds, event) list, as `read_trace` gives it, walked. Events that do not
    replay (a block released that nobody held, a hit on a block the cache does not hold) mean the
    file was not written by one run in order: a `TraceError` names the first."""
    view = RunView()
    for number, (step, _, event) in enumerate(events, 1):
        try:
            view.apply(step, event)
        except (KeyError, IndexError, AssertionError) as err:
            raise TraceError(
                f"event {number} of the run ({type(event).__name__} at step {step}) does not follow "
                f"from the ones before ({type(err).__name__}: {str(err)[:60]}); was the file edited?"
            ) from None
    return view.finish()


# ---------------------------------------------------------------------------- the numbers
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
    lanes, requests = view.request_rows()
    counts = np.stack([(lanes == code).sum(axis=1) for code in range(len(PLACES))], axis=1)
    per_request = [
        {"request": request} | {PLACES[code]: int(counts[row, code]) for code in range(1, len(PLACES))}
        for row, request in enumerate(requests)
    ]
    return {
        "request_steps": {PLACES[code]: int(counts[:, code].sum()) for code in range(1, len(PLACES))},
        "per_request": per_request,
    }


# ---------------------------------------------------------------------------- the picture
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
    blocks, tiers = view.block_rows()
    lanes, requests = view.request_rows()
    num_steps = len(view.step_numbers)
    # free blocks are taken least recently freed first, so a light run uses only a tier's low ids:
    # each tier is drawn up to the highest block it ever used
    drawn = {name: _used(blocks, rows) for name, rows in tiers.items()}
    block_rows, columns = cell_size(sum(map(len, drawn.values())), num_steps, MAX_BLOCK_ROWS)
    lane_rows, _ = cell_size(len(requests), num_steps, MAX_REQUEST_ROWS)
    parts, labels = [], []  # each tier grouped on its own, so the line between tiers falls between cells
    for name, rows in drawn.items():
        part = aggregate(blocks[rows.start : rows.stop], columns, block_rows, len(BLOCK_STATES))
        stretch = math.ceil(MIN_TIER_SHARE * sum(map(len, drawn.values())) / block_rows / len(part))
        parts.append(np.repeat(part, stretch, axis=0))  # a small tier drawn taller, to be seen
        labels.append(f"{name}\n{len(tiers[name])} blocks")
        if len(rows) < len(tiers[name]):
            labels[-1] += f"\n(ids {rows.start}-{rows.stop - 1};\nthe rest unused)"
        if stretch > 1:
            labels[-1] += f"\n(drawn x{stretch})"
    block_cells = np.concatenate(parts)  # (block groups, step bins)
    lane_cells = aggregate(lanes, columns, lane_rows, len(PLACES))  # (request groups, step bins)
    block_cell, lane_cell = cells(columns, block_rows, "block"), cells(columns, lane_rows, "request")

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(13, 10), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    first = view.step_numbers[0] - 0.5
    steps = (first, first + block_cells.shape[1] * columns)  # the x extent, in engine steps
    _panel(
        top, block_cells, BLOCK_STATES, BLOCK_COLOURS, steps, f"blocks by state — {block_cell}", "block state"
    )
    offset, ticks = 0, []
    for part in parts:
        ticks.append(offset + len(part) / 2)
        offset += len(part)
        if offset < len(block_cells):
            top.axhline(offset, color="black", linewidth=1.5)
    top.set_yticks(ticks, labels, fontsize=8)
    top.set_ylabel("block (by id)")

    title_lanes = f"where each request's KV lives — {lane_cell}"
    _panel(bottom, lane_cells, PLACES, PLACE_COLOURS, steps, title_lanes, "KV lives in")
    if 0 < len(lane_cells) <= 24:  # few enough lanes to name
        names = [
            ", ".join(requests[row * lane_rows : (row + 1) * lane_rows]) for row in range(len(lane_cells))
        ]
        bottom.set_yticks([row + 0.5 for row in range(len(lane_cells))], names, fontsize=7)
    else:
        bottom.set_yticks([])
    bottom.set_ylabel(f"{plural(len(requests), 'request')}\n(by first block)")
    bottom.set_xlabel("engine step")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"{block_cell}; {lane_cell}"


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
