"""Paged KV memory: fixed-size blocks, per-sequence block tables, reference counts.

The idea of PagedAttention (vLLM): instead of reserving one contiguous stretch of KV memory per
request sized for its longest possible output, cut the KV pool into blocks of `block_size` token
slots and give each sequence a *block table* — logical block i -> physical block id — that grows
one block at a time. A sequence then wastes at most the unused tail of its last block, and any
free block can serve any sequence, so free memory never fragments.

Slots are numbered `block_id * block_size + offset`; the attention layer writes token t of a
sequence into slot `table[t // block_size] * block_size + t % block_size` and reads its history by
gathering the slots of positions 0..t.

Reference counts make sharing possible: `fork` lets two tables point at the same blocks (parallel
sampling, beams), `adopt` starts a table with blocks found in the prefix cache; a block returns to
the free pool when its count drops to 0, and is never written while another table holds it.

Tiers. A table may hold blocks of the host tier or the disk too: a swapped-out sequence keeps its
table, re-pointed at host blocks. Those moves (swap out and in, spilling cached prefix blocks to
the host tier and bringing them back) are the block manager's `moves` (`tier_moves.py`), over the
same tables. Free lists, refcounts and the queue of copies decided (copy-on-write's and the
moves') are the block manager's `BlockLedger` (`block_ledger.py`); copies are performed by whoever
owns the tensors (`tiers.py`), in the order decided, before the next forward pass reads a block.

Invariants, checked by `check_invariants` and the property tests, in every tier:
  - a block is free iff its refcount is 0;
  - a block's refcount equals the number of tables that hold it;
  - when every sequence is freed, every block is free.
"""

from __future__ import annotations

from collections import Counter

from minillm.memory import events as ev
from minillm.memory.block_ledger import BlockLedger, BlockManagerError
from minillm.memory.prefix_cache import PrefixCache
from minillm.memory.tier_moves import TierMoves


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        host_blocks: int = 0,
        disk: bool = False,
        spill: str = "all",
    ):
        if num_blocks < 1 or block_size < 1 or host_blocks < 0:
            raise ValueError(
                f"num_blocks and block_size must be >= 1 and host_blocks >= 0 "
                f"(got {num_blocks}, {block_size}, {host_blocks})."
            )
        self.num_blocks = num_blocks  # device blocks
        self.num_host_blocks = host_blocks
        self.block_size = block_size
        self.disk = disk
        self._ledger = BlockLedger(num_blocks, host_blocks)  # free lists, refcounts, the copy queue
        self.refcounts = self._ledger.refcounts  # held block -> tables holding it (to read)
        self.block_tables: dict[int, list[int]] = {}  # seq_id -> block ids
        self.events = ev.KVEvents()  # every change of a block's life, told to subscribers (events.py)
        self.prefix_cache = PrefixCache(block_size, self.events) if prefix_caching else None
        self.moves = TierMoves(self._ledger, self.block_tables, self.prefix_cache, self.events, disk, spill)
        self.num_copies = 0  # copy-on-write copies made
        self._full: dict[int, int] = {}  # seq_id -> leading blocks known full (told as `Filled`)

    # ---------------------------------------------------------------- counting
    @property
    def num_free_blocks(self) -> int:
        return self._ledger.count("device")

    def tier(self, block: int) -> str:
        return self._ledger.tier(block)

    def held(self, tier: str) -> dict[int, int]:
        """The tier's blocks that tables hold -> how many tables hold each."""
        return self._ledger.held(tier)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def blocks_missing(self, seq_id: int, num_tokens: int) -> int:
        """New blocks the sequence needs to hold `num_tokens` tokens in total."""
        held = len(self.block_tables.get(seq_id, ()))
        return max(0, self.blocks_for(num_tokens) - held)

    def shared_blocks(self, seq_id: int, start: int, end: int) -> list[int]:
        """Indices in the table of blocks that positions start..end-1 would write and others hold."""
        table = self.block_tables.get(seq_id, [])
        return [
            i
            for i in range(start // self.block_size, min(len(table), self.blocks_for(end)))
            if self.refcounts[table[i]] > 1
        ]

    def can_grow(self, seq_id: int, num_tokens: int, adopting: list[int] = (), copies: int = 0) -> bool:
        """Room for `num_tokens` tokens and `copies` copy-on-write blocks, after taking over the
        cached blocks `adopting` (those waiting in the free pool stop being free; those spilled to
        the host tier need a device block to come back to)."""
        missing = self.blocks_missing(seq_id, num_tokens) - len(adopting) + copies
        reclaimed = sum(
            1 for block in adopting if self.refcounts[block] == 0 and self.tier(block) == "device"
        )
        returning = sum(1 for block in adopting if self.tier(block) != "device")
        return missing + returning <= self.num_free_blocks - reclaimed

    # ---------------------------------------------------------------- changing tables
    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Make the sequence's table (created if new) long enough for `num_tokens` tokens."""
        missing = self.blocks_missing(seq_id, num_tokens)
        if missing > self.num_free_blocks:
            raise BlockManagerError(
                f"sequence {seq_id} needs {missing} blocks, {self.num_free_blocks} are free; "
                "check can_grow first"
            )
        table = self.block_tables.setdefault(seq_id, [])
        for _ in range(missing):
            table.append(self.moves.take_device_block())
            if self.events:
                self.events.emit(ev.Allocated(seq_id, table[-1]))

    def copy_on_write(self, seq_id: int, start: int, end: int) -> None:
        """Give the sequence private copies of the shared blocks positions start..end-1 will
        write; each (shared, private) pair joins the copy queue, to be performed before the write."""
        table = self.table(seq_id)
        for index in self.shared_blocks(seq_id, start, end):
            shared = table[index]
            if self.num_free_blocks == 0:
                raise BlockManagerError(f"no free block to copy block {shared} into; check can_grow first")
            self._ledger.drop(shared)
            table[index] = self.moves.take_device_block()
            self._ledger.copy(shared, table[index])
            self.num_copies += 1
            if self.events:
                self.events.emit(ev.CopiedOnWrite(seq_id, index, shared, table[index]))

    def forget_cached(self, seq_id: int, start: int, end: int) -> None:
        """Positions start..end-1 are about to be rewritten with other entries (eviction), in
        blocks this table alone holds (`copy_on_write` first): the prefix cache forgets those blocks, and
        their descendants, so it never hands their new content out as the old."""
        if self.prefix_cache is None:
            return
        table = self.table(seq_id)
        for index in range(start // self.block_size, min(len(table), self.blocks_for(end))):
            self.prefix_cache.evict(table[index])

    def adopt(self, seq_id: int, blocks: list[int]) -> None:
        """Start a new sequence's table with cached blocks (a prefix hit): share, don't recompute.
        A block spilled to the host tier comes back to a device block first. Every hit is held
        before any block is taken for that: a take may spill or reuse the free block it lands on."""
        if seq_id in self.block_tables:
            raise BlockManagerError(f"sequence {seq_id} already has a block table")
        for block in blocks:
            if self.tier(block) == "device":
                self._ledger.hold(block)
            else:
                self._ledger.take_out(block)  # in use while it is read back
        table = [block if self.tier(block) == "device" else self.moves.bring_back(block) for block in blocks]
        self.block_tables[seq_id] = table
        if self.events and table:
            self.events.emit(ev.Hit(seq_id, tuple(table)))

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; writes must copy first (copy-on-write)."""
        if child_id in self.block_tables:
            raise BlockManagerError(f"sequence {child_id} already has a block table")
        table = self.table(parent_id)
        for block in table:
            self._ledger.hold(block)
        self.block_tables[child_id] = list(table)
        if self.events:
            self.events.emit(ev.Forked(parent_id, child_id))

    def filled(self, seq_id: int, num_entries: int, quantized: bool) -> None:
        """The sequence's first `num_entries` entries are written: `Filled` for each block they
        newly fill (`quantized`: the pool is a quantized one)."""
        full, done = num_entries // self.block_size, self._full.get(seq_id, 0)
        if full <= done:
            return
        self._full[seq_id] = full
        if self.events:
            table = self.table(seq_id)
            for index in range(done, full):
                self.events.emit(ev.Filled(seq_id, table[index], quantized))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the blocks holding the first `num_tokens` entries (eviction shrank the
        sequence, or speculation rolled it back); blocks cut into are no longer full."""
        table, kept = self.table(seq_id), self.blocks_for(num_tokens)
        if self._full.get(seq_id, 0) > num_tokens // self.block_size:
            self._full[seq_id] = num_tokens // self.block_size
        if len(table) <= kept:
            return
        for block in table[kept:]:
            self._ledger.drop(block)
        del table[kept:]
        if self.events:
            self.events.emit(ev.Truncated(seq_id, kept))

    def free(self, seq_id: int) -> None:
        """Drop the sequence's table, in whatever tiers it lies; blocks nobody else holds are free."""
        for block in self.table(seq_id):
            self._ledger.drop(block)
        table = self.block_tables.pop(seq_id)
        self._full.pop(seq_id, None)
        if self.prefix_cache:
            self.prefix_cache.forget_sequence(seq_id)
        if self.events:
            self.events.emit(ev.Freed(seq_id, tuple(table)))

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies decided since the last call (copy-on-write, swaps, spills, bring-backs), in
        order; they are the caller's to perform."""
        return self._ledger.take_copies()

    # ---------------------------------------------------------------- reading
    def has_table(self, seq_id: int) -> bool:
        return seq_id in self.block_tables

    def table(self, seq_id: int) -> list[int]:
        if seq_id not in self.block_tables:
            raise BlockManagerError(f"sequence {seq_id} has no block table (never allocated, or freed twice)")
        return self.block_tables[seq_id]

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slot ids of positions start..end-1 of the sequence."""
        table, size = self.table(seq_id), self.block_size
        return [table[pos // size] * size + pos % size for pos in range(start, end)]

    def check_writable(self, seq_id: int, start: int, end: int) -> None:
        """Positions start..end-1 are about to be written: their blocks must be shared neither with
        another table nor, through the prefix cache, with requests to come; a swap's copy of one
        (its twin) no longer stands for it."""
        table = self.table(seq_id)
        for index in range(start // self.block_size, self.blocks_for(end)):
            self._ledger.forget_twin(table[index])
            if self.refcounts[table[index]] > 1:
                raise BlockManagerError(
                    f"sequence {seq_id} would write into block {table[index]}, "
                    f"shared by {self.refcounts[table[index]]} tables; copy it first"
                )
            if self.prefix_cache and self.prefix_cache.holds(table[index]):
                raise BlockManagerError(
                    f"sequence {seq_id} would write into block {table[index]}, which the "
                    "prefix cache holds for later requests; forget it first"
                )
            if self.tier(table[index]) != "device":
                raise BlockManagerError(
                    f"sequence {seq_id} would write into block {table[index]}, which is in "
                    f"the {self.tier(table[index])} tier; swap it in first"
                )

    def subscribe(self, subscriber: ev.Subscriber, bytes_per_token: int = 0) -> None:
        """Tell `subscriber` every change from now on, starting with a `Snapshot` of the state now."""
        cached = self.prefix_cache.described() if self.prefix_cache else ()
        tables = {seq_id: tuple(table) for seq_id, table in self.block_tables.items()}
        snapshot = ev.Snapshot(
            self.num_blocks, self.num_host_blocks, self.block_size, bytes_per_token, tables, cached
        )
        subscriber(self.events.step, snapshot)
        self.events.add(subscriber)

    def check_invariants(self) -> None:
        holders = Counter(block for table in self.block_tables.values() for block in table)
        listed = self._ledger.listed()
        free = set(listed)
        assert len(free) == len(listed), "a block freed twice"
        for block in (
            set(range(self.num_blocks + self.num_host_blocks)) | set(holders) | set(self.refcounts) | free
        ):
            assert self.refcounts[block] == holders[block], f"block {block}: refcount != tables holding it"
            assert (self.refcounts[block] == 0) == (block in free), (
                f"block {block}: free iff refcount 0 broken"
            )
