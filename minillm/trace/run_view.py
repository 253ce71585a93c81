"""The walk over a run: one pass through its KV events, in order, with the pool rebuilt beside it.

`walk` feeds each (step, event) to a `RunView`, whose handler for that event type replays it on a
`Replayer` (`memory/replay.py`, the pool as the events say it is) and updates what the questions
need: each block content's life, each prefix entry's hits, each spill and swap trip
(`records.py`), the KV bytes each request read. The walk stays cheap on long runs: a step records
only the blocks and sequences its events touched, as changes (`records.record_change`); the
pictures are filled from those changes at the end (`timeline.py`).
"""

from __future__ import annotations

from minillm.memory import events as ev
from minillm.memory.replay import Replayer
from minillm.trace.records import (
    BLOCK_STATES,
    MIXED,
    TIER_PLACE,
    Life,
    PrefixEntry,
    Spill,
    Trip,
    record_change,
)
from minillm.tracing import TraceError


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

    _EntriesEvicted = _Preempted = _Filled

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
        copied = self._copied_into(e.moves)
        self.pool.apply(e)
        for _, destination in e.moves:
            self._follow(destination, step, copied)
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
        copied = self._copied_into(e.moves)
        self.pool.apply(e)
        for source, destination in e.moves:
            self._end(source, step, "freed")  # moved: (not `_settle`: a spill may already have
            #   been told into this host block, see `_Spilled`)
            self._follow(destination, step, copied)
        for seq_id in holders:
            trip = self.away.get(seq_id)
            if trip is not None and all(
                self.pool.tier(block) == "device" for block in self.pool.tables[seq_id]
            ):
                trip.back_step = step
                self.trips.append(self.away.pop(seq_id))
        self.dirty_seqs.update(holders)
        return [block for move in e.moves for block in move]

    def _copied_into(self, moves) -> set[int]:
        """A swap's destinations that get new content: not a twin still held or in the prefix cache
        (`block_ledger.py`), whose content, and life, go on."""
        pool = self.pool
        return {block for _, block in moves if not pool.refcounts[block] and block not in pool.cached}

    def _follow(self, destination: int, step: int, copied: set[int]) -> None:
        if destination in copied:
            self._begin(destination, step)
        else:
            self._settle(destination, step)

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
            record_change(self.block_changes.setdefault(block, []), column, during, now)
            self.top_block = max(self.top_block, block)
        for seq_id in self.dirty_seqs:
            now = self._place(seq_id)
            during = self.last_place.get(seq_id, now) if now == 0 else now  # freed this step
            record_change(self.seq_changes.setdefault(seq_id, []), column, during, now)
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
