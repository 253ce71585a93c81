"""Tier moves: blocks that leave the device pool and come back, over the block manager's tables.

With a host tier (and a disk tier) block ids go on past the device pool (`block_ledger.py`), and a
table may hold blocks of any tier. So a preempted sequence can keep its table: `swap_out` re-points
it at host (or disk) blocks, `swap_in` at device blocks again. A block several tables hold (a
shared prefix, a parallel sample's) moves once, for all of them, and its reference count moves
with it: sharing survives the round trip. That holds across steps too: every block a swap-out
copies keeps a *twin* (the ledger's) while neither is given new content, so a holder of the shared
block that leaves later shares the copy already made, and one that comes back while the device
block is still there (held, or free in the prefix cache) shares it again: one copy out, none back.

Cached prefix blocks move as well. A free device block taken for new content may still hold a
block the prefix cache can find: it is *reclaimed* (the pressure ladder's first rung), spilled to
the host tier when there is one (as SGLang's HiCache does), else dropped. A later prompt whose
prefix hits a spilled block brings it back to a device block (`bring_back`) instead of
recomputing it. Which blocks are worth that copy is the `spill` rule: "all" of them, or only the
"reused" ones (a prompt found them, computed them again after they were dropped, or they extend
such a block: see `prefix_cache.py`). Most cached blocks are a document's or an answer's, read
once; a copy of one buys nothing and pushes a spilled block that would have been read out of the
host's LRU. But a conversation's first turn is read once too, until its next turn comes: on `bench
tiers`' mixed traffic "reused" copied 1.9x fewer bytes and lost 4 points of prefix hits, and on a
CPU a host copy costs no measurable time, so "all" is the default.

Moves are only *decided* here: each becomes a (source, destination) copy in the ledger's queue,
in the order decided, and whoever owns the tensors (`tiers.py`) performs them in that order
before the next forward pass reads a block. The block manager owns one `TierMoves` and gives it
its ledger and its tables (the same dict: a move re-points tables in place; only the block
manager adds or removes a table).
"""

from __future__ import annotations

from collections import Counter

from minillm.memory import events as ev
from minillm.memory.block_ledger import BlockLedger, BlockManagerError
from minillm.memory.prefix_cache import PrefixCache


class TierMoves:
    def __init__(
        self,
        ledger: BlockLedger,
        tables: dict[int, list[int]],
        prefix_cache: PrefixCache | None,
        events: ev.KVEvents,
        disk: bool,
        spill: str = "all",
    ):
        self._ledger, self._tables = ledger, tables
        self._prefix_cache, self._events = prefix_cache, events
        self._disk = disk
        self._spill_all = spill == "all"  # else only blocks the prefix cache saw reused
        self.num_spilled = 0  # cached prefix blocks moved to the host tier instead of dropped
        self.num_spill_hits = 0  # ...and found there again by a later prompt
        self.num_reclaimed = 0  # cached device blocks nobody held, taken for new content (spilled or dropped)
        self.num_copies_saved = 0  # swap copies not made: the block's twin in the other tier was shared
        self._reclaimed_since = 0  # ...since the last `take_reclaimed`

    # ---------------------------------------------------------------- cached blocks: reclaim, spill, return
    def take_device_block(self, holders: int = 1) -> int:
        """A device block for new content, held by `holders` tables: the least recently freed one.
        If it still holds a cached prefix block, that block moves to the host tier (spill) when
        there is one and the spill rule takes it, else is dropped."""
        block = self._ledger.take("device", holders)
        cache = self._prefix_cache
        if cache and block in cache.entries:
            if self._events:
                self._events.emit(ev.Reused(block))
            self.num_reclaimed += 1
            self._reclaimed_since += 1
            self._spill(block)
            cache.evict(block)  # no-op once spilled: its content is about to be overwritten
        return block

    def _spill(self, block: int) -> None:
        """Keep a cached block that leaves the device in the host tier (LRU there too): a later
        prompt that needs it copies it back instead of recomputing."""
        if not self._ledger.count("host") or not (self._spill_all or self._prefix_cache.is_reused(block)):
            return
        host = self._take_block("host")  # may drop the least recently used spilled block (and its children)
        if block in self._prefix_cache.entries:
            self._ledger.copy(block, host)
            self._prefix_cache.move(block, host)
            self.num_spilled += 1
            if self._events:
                self._events.emit(ev.Spilled(block, host))
        self._ledger.drop(host)  # a spilled block is held by no table: free, but findable

    def _take_block(self, tier: str, holders: int = 1) -> int:
        """A free host or disk block; a host block taken may still hold a spilled prefix block."""
        block = self._ledger.take(tier, holders)
        if tier == "host" and self._prefix_cache:
            self._prefix_cache.evict(block)  # the least recently used spilled block (and its children)
        return block

    def bring_back(self, host: int) -> int:
        """A spilled prefix block (taken out of the host free list) returns to a device block,
        held by one table: the caller's."""
        block = self.take_device_block()
        self._ledger.copy(host, block)
        self._prefix_cache.move(host, block)
        if self._events:  # told now: the next take may spill into the host block it leaves
            self._events.emit(ev.BroughtBack(host, block))
        self._ledger.give_back(host)
        self.num_spill_hits += 1
        return block

    def take_reclaimed(self) -> int:
        """Cached blocks reclaimed since the last call (the pressure ladder's first rung)."""
        reclaimed, self._reclaimed_since = self._reclaimed_since, 0
        return reclaimed

    # ---------------------------------------------------------------- where tables lie
    def _table(self, seq_id: int) -> list[int]:
        if seq_id not in self._tables:
            raise BlockManagerError(f"sequence {seq_id} has no block table (never allocated, or freed twice)")
        return self._tables[seq_id]

    def _blocks_of(self, seq_ids: list[int], on_device: bool) -> Counter[int]:
        """Blocks of these tables on (or off) the device -> how many of the tables hold each."""
        tier = self._ledger.tier
        return Counter(
            block
            for seq_id in seq_ids
            for block in self._table(seq_id)
            if (tier(block) == "device") == on_device
        )

    def held_off_device(self, seq_ids: list[int]) -> Counter[int]:
        """Blocks of these tables outside the device pool -> how many of the tables hold each."""
        return self._blocks_of(seq_ids, on_device=False)

    def is_swapped(self, seq_id: int) -> bool:
        """Does the sequence hold a block outside the device pool? (Asked for every sequence every step:
        without tiers the answer needs no look at its table.)"""
        if not self._ledger.num_host and not self._disk:
            return False
        return seq_id in self._tables and any(self._ledger.tier(b) != "device" for b in self._tables[seq_id])

    def holders_of_device_blocks(self) -> set[int]:
        """The sequences whose table holds at least one device block."""
        tier = self._ledger.tier
        return {seq_id for seq_id, table in self._tables.items() if any(tier(b) == "device" for b in table)}

    # ---------------------------------------------------------------- swapping
    def device_blocks(self, seq_ids: list[int]) -> int:
        """Device blocks these tables hold (a block several of them share counts once)."""
        return len(self._blocks_of(seq_ids, on_device=True))

    def swap_out_tier(self, num_blocks: int) -> str:
        """Where `num_blocks` swapped-out blocks would go: host while it has room, else disk."""
        return "host" if num_blocks <= self._ledger.count("host") else "disk"

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self._disk or self.device_blocks(seq_ids) <= self._ledger.count("host")

    def swap_out(self, seq_ids: list[int]) -> None:
        """Move the device blocks of these tables to the host tier (to disk once it is full). A
        block held only by these tables moves, and its device block is freed; a block that other
        tables hold too (a shared prefix) is copied, and stays on the device for them, paired with
        its copy (or, copied by an earlier swap-out already, shares that copy)."""
        moved = {}
        for block, holders in self._blocks_of(seq_ids, on_device=True).items():
            moved[block] = self._copy_out(block, holders)
            self._ledger.drop(block, holders)
        for seq_id in seq_ids:
            self._repoint(self._tables[seq_id], moved)
        if self._events:
            self._events.emit(ev.SwappedOut(tuple(seq_ids), tuple(moved.items())))

    def _copy_out(self, block: int, holders: int) -> int:
        """The host or disk block that `holders` of the device `block` move to: its twin if it has
        one (an earlier holder's swap-out copied it), else a new copy, paired with the block."""
        twin = self._ledger.twin(block)
        if twin is not None:
            self._ledger.hold(twin, holders)
            self.num_copies_saved += 1
            return twin
        copy = self._take_block("host" if self._ledger.count("host") else "disk", holders)
        self._ledger.copy(block, copy)
        self._ledger.pair(block, copy)
        return copy

    def can_swap_in(self, seq_ids: list[int], extra: int = 0) -> bool:
        return len(self.held_off_device(seq_ids)) + extra <= self._ledger.count("device")

    def swap_in(self, seq_ids: list[int]) -> None:
        """Bring every host or disk block of these tables back to a device block. Every table that
        holds such a block (a sibling still swapped out) follows it, so it stays shared; a block
        whose twin is still on the device comes back to it, without a copy.
        (`can_swap_in` counts a device block for every one: a write into a block shared again
        costs a copy-on-write block.)"""
        moved = {}
        for block in self.held_off_device(seq_ids):
            holders = self._ledger.refcounts[block]
            moved[block] = self._copy_in(block, holders)
            self._ledger.drop(block, holders)
        for table in self._tables.values():
            self._repoint(table, moved)
        if self._events:
            self._events.emit(ev.SwappedIn(tuple(seq_ids), tuple(moved.items())))

    def _copy_in(self, block: int, holders: int) -> int:
        """The device block that every holder of the off-device `block` moves to: its twin if that
        is held, or free but in the prefix cache (a full block: the pool keeps the staged keys of
        no free block), else a new copy."""
        twin = self._ledger.twin(block)
        cache = self._prefix_cache
        if twin is not None and (self._ledger.refcounts[twin] or (cache and twin in cache.entries)):
            self._ledger.hold(twin, holders)
            self.num_copies_saved += 1
            return twin
        copy = self.take_device_block(holders)
        self._ledger.copy(block, copy)
        return copy

    @staticmethod
    def _repoint(table: list[int], moved: dict[int, int]) -> None:
        table[:] = [moved.get(block, block) for block in table]
