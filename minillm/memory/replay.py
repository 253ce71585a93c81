"""Replaying KV events: the block state rebuilt from the events alone, an independent oracle.

A stream of events is only worth reading if it is complete: an event the code forgets to send
leaves every reader with a wrong picture, and nothing fails. `Replayer` knows nothing of the block
manager; it rebuilds every block's refcount, state (free, cached, shared, private), table
membership and prefix-cache entry from the events (`events.py`) alone. The tests compare it with
the real state after every step (`check`), so a forgotten event fails them; `minillm trace show`
(`trace/run_view.py`) walks a recorded run with one to know the pool as the events say it is.
"""

from __future__ import annotations

from collections import Counter

from minillm.memory.block_ledger import tier_of
from minillm.memory.events import (
    Allocated,
    BroughtBack,
    CopiedOnWrite,
    Event,
    Forked,
    Freed,
    Hit,
    Registered,
    Reused,
    Snapshot,
    Spilled,
    SwappedIn,
    SwappedOut,
    Truncated,
    Uncached,
)


class Replayer:
    """Every block's refcount, table membership and prefix-cache entry, from the events alone.
    It knows nothing of the block manager: feed it a stream (`apply`), then compare (`check`)."""

    def __init__(self):
        self.num_blocks = self.host_blocks = self.block_size = 0
        self.bytes_per_token = 0
        self.tables: dict[int, list[int]] = {}
        self.refcounts: Counter[int] = Counter()
        self.cached: dict[int, int] = {}  # block -> key

    def __call__(self, step: int, event: Event) -> None:
        self.apply(event)

    def tier(self, block: int) -> str:
        return tier_of(block, self.num_blocks, self.host_blocks)

    def state(self, block: int) -> str:
        """As `accounting.block_states` says it: free, cached, shared or private."""
        if self.refcounts[block] == 0:
            return "cached" if block in self.cached else "free"
        return "shared" if self.refcounts[block] > 1 or block in self.cached else "private"

    def apply(self, event: Event) -> None:
        getattr(self, "_" + type(event).__name__)(event)

    def _hold(self, seq_id: int, block: int) -> None:
        self.tables.setdefault(seq_id, []).append(block)
        self.refcounts[block] += 1

    def _release(self, block: int, holders: int = 1) -> None:
        self.refcounts[block] -= holders
        if self.refcounts[block] == 0:
            del self.refcounts[block]

    def _Snapshot(self, e: Snapshot) -> None:
        self.num_blocks, self.host_blocks, self.block_size = e.num_blocks, e.host_blocks, e.block_size
        self.bytes_per_token = e.bytes_per_token
        self.tables = {seq_id: list(table) for seq_id, table in e.tables.items()}
        self.refcounts = Counter(block for table in e.tables.values() for block in table)
        self.cached = {block: key for block, key, _, _ in e.cached}

    def _Allocated(self, e: Allocated) -> None:
        self._hold(e.seq_id, e.block)

    def _BroughtBack(self, e: BroughtBack) -> None:
        self.cached[e.block] = self.cached.pop(e.host)

    def _Hit(self, e: Hit) -> None:
        self.tables[e.seq_id] = []
        for block in e.blocks:
            self._hold(e.seq_id, block)

    def _Forked(self, e: Forked) -> None:
        for block in list(self.tables[e.parent_id]):  # a copy: a file may name the child its own parent
            self._hold(e.child_id, block)
        self.tables.setdefault(e.child_id, [])

    def _CopiedOnWrite(self, e: CopiedOnWrite) -> None:
        self._release(e.source)
        self.tables[e.seq_id][e.index] = e.block
        self.refcounts[e.block] += 1

    def _SwappedOut(self, e: SwappedOut) -> None:
        held = Counter(block for seq_id in e.seq_ids for block in self.tables[seq_id])
        for source, destination in e.moves:  # a destination may be held already: the source's twin
            self.refcounts[destination] += held[source]
            self._release(source, held[source])
        moved = dict(e.moves)
        for seq_id in e.seq_ids:
            self.tables[seq_id] = [moved.get(block, block) for block in self.tables[seq_id]]

    def _SwappedIn(self, e: SwappedIn) -> None:
        for source, destination in e.moves:
            self.refcounts[destination] += self.refcounts.pop(source)
        moved = dict(e.moves)
        for seq_id, table in self.tables.items():
            self.tables[seq_id] = [moved.get(block, block) for block in table]

    def _Spilled(self, e: Spilled) -> None:
        self.cached[e.host] = self.cached.pop(e.block)

    def _Registered(self, e: Registered) -> None:
        self.cached[e.block] = e.key

    def _Uncached(self, e: Uncached) -> None:
        del self.cached[e.block]

    def _Truncated(self, e: Truncated) -> None:
        table = self.tables[e.seq_id]
        for block in table[e.num_blocks :]:
            self._release(block)
        del table[e.num_blocks :]

    def _Freed(self, e: Freed) -> None:
        for block in self.tables.pop(e.seq_id, []):
            self._release(block)

    def _Reused(self, e: Reused) -> None:
        """The content's end is told by Spilled or Uncached; nothing held changes."""

    _Filled = _EntriesEvicted = _Preempted = _Step = _Reused

    def check(self, tables: dict[int, list[int]], refcounts: dict[int, int], cached: dict[int, int]) -> None:
        """Raise AssertionError at the first difference from the real state: tables (seq_id ->
        blocks; an empty one counts as none), refcounts (block -> count, zeros allowed), cached
        (block -> key)."""
        real = {block: count for block, count in refcounts.items() if count}
        for seq_id in set(tables) | set(self.tables):  # a table of no blocks is no table
            replayed, held = self.tables.get(seq_id) or [], tables.get(seq_id) or []
            assert replayed == held, f"sequence {seq_id}: replayed table {replayed} != {held}"
        for block in set(real) | set(self.refcounts):
            assert self.refcounts[block] == real.get(block, 0), (
                f"block {block}: replayed refcount {self.refcounts[block]} != {real.get(block, 0)}"
            )
        for block in set(cached) | set(self.cached):
            assert self.cached.get(block) == cached.get(block), (
                f"block {block}: replayed prefix-cache key {self.cached.get(block)} != {cached.get(block)}"
            )
