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
Tiers. With a host tier (and a disk tier) block ids go on past the device pool: ids
0..num_blocks-1 are device blocks (the pool attention reads), the next `host_blocks` ids are host
blocks, and ids after those are block files on disk. A table may hold blocks of any tier, so a
swapped-out sequence keeps its table: `swap_out` re-points it at host (or disk) blocks and
`swap_in` at device blocks again. A block several tables hold moves once, for all of them, and
refcounts move with it. Moves (and copy-on-write copies) are only *decided* here; each becomes a
(source, destination) pair in `copies`, in the order decided, and whoever owns the tensors
(`tiers.py`) performs them in that order before the next forward pass reads a block.

Invariants, checked by `check_invariants` and the property tests, in every tier:
  - a block is free iff its refcount is 0;
  - a block's refcount equals the number of tables that hold it;
  - when every sequence is freed, every block is free.
"""

from __future__ import annotations

from collections import Counter

from minillm.memory import events as ev
from minillm.memory.free_blocks import FreeBlocks
from minillm.memory.prefix_cache import PrefixCache


class BlockManagerError(RuntimeError):
    """Misuse of the block manager (a bug in the caller), e.g. freeing a sequence twice."""


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        host_blocks: int = 0,
        disk: bool = False,
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
        # each tier's free blocks, and which tier an id is in
        self._free = FreeBlocks(num_blocks, host_blocks)
        self.refcounts: Counter[int] = Counter()
        self.block_tables: dict[int, list[int]] = {}  # seq_id -> block ids
        self.events = ev.KVEvents()  # every change of a block's life, told to subscribers (events.py)
        self.prefix_cache = PrefixCache(block_size, self.events) if prefix_caching else None
        self.copies: list[tuple[int, int]] = []  # (source, destination) blocks to copy, in decision order
        self.num_copies = 0  # copy-on-write copies made
        self.num_spilled = 0  # cached prefix blocks moved to the host tier instead of dropped
        self.num_spill_hits = 0  # ...and found there again by a later prompt
        self.num_reclaimed = 0  # cached device blocks nobody held, taken for new content (spilled or dropped)
        self._reclaimed_since = 0  # ...since the last `take_reclaimed`

    # ---------------------------------------------------------------- counting
    @property
    def num_free_blocks(self) -> int:
        return self._free.count("device")

    def tier(self, block: int) -> str:
        return self._free.tier(block)

    def refcount(self, block: int) -> int:
        return self.refcounts[block]

    def is_free(self, block: int) -> bool:
        return self.refcounts[block] == 0

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

    def shared_device_blocks(self) -> int:
        """Device blocks saved by sharing: a block held by k tables counts k - 1 times."""
        return sum(
            held - 1 for block, held in self.refcounts.items() if held > 1 and self.tier(block) == "device"
        )

    def blocks_in_use(self, tier: str) -> int:
        return sum(1 for block, held in self.refcounts.items() if held and self.tier(block) == tier)

    # ---------------------------------------------------------------- taking and releasing blocks
    def _take_free_block(self) -> int:
        """A device block for new content: the least recently freed one. If it still holds a cached
        prefix block, that block moves to the host tier (spill) when there is one, else is dropped."""
        block = self._free.take("device")
        if self.prefix_cache and block in self.prefix_cache.entries:
            if self.events:
                self.events.emit(ev.Reused(block))
            self.num_reclaimed += 1
            self._reclaimed_since += 1
            self._spill(block)
            self.prefix_cache.evict(block)  # no-op once spilled: its content is about to be overwritten
        self.refcounts[block] = 1
        return block

    def _spill(self, block: int) -> None:
        """Keep a cached block that leaves the device in the host tier (LRU there too), as
        SGLang's HiCache does: a later prompt that needs it copies it back instead of recomputing."""
        if not self._free.count("host"):
            return
        host = self._take_block("host")  # may drop the least recently used spilled block (and its children)
        if block in self.prefix_cache.entries:
            self.copies.append((block, host))
            self.prefix_cache.move(block, host)
            self.num_spilled += 1
            if self.events:
                self.events.emit(ev.Spilled(block, host))
        self._drop(host)  # a spilled block is held by no table: free, but findable

    def _take_block(self, tier: str) -> int:
        if tier == "device":
            return self._take_free_block()
        block = self._free.take(tier)
        if tier == "host" and self.prefix_cache:
            self.prefix_cache.evict(block)  # the least recently used spilled block (and its children)
        self.refcounts[block] = 1
        return block

    def _drop(self, block: int, holders: int = 1) -> None:
        """`holders` tables let go of the block; at refcount 0 it returns to its tier's free blocks
        (most recently freed last; a cached block keeps its prefix-cache entry)."""
        self.refcounts[block] -= holders
        if self.refcounts[block] == 0:
            del self.refcounts[block]
            self._free.give_back(block)

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
            table.append(self._take_free_block())
            if self.events:
                self.events.emit(ev.Allocated(seq_id, table[-1]))

    def copy_on_write(self, seq_id: int, start: int, end: int) -> None:
        """Give the sequence private copies of the shared blocks positions start..end-1 will
        write; each (shared, private) pair joins `copies`, to be performed before the write."""
        table = self.table(seq_id)
        for index in self.shared_blocks(seq_id, start, end):
            shared = table[index]
            if self.num_free_blocks == 0:
                raise BlockManagerError(f"no free block to copy block {shared} into; check can_grow first")
            self._drop(shared)
            table[index] = self._take_free_block()
            self.copies.append((shared, table[index]))
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
            if self.tier(block) != "device":
                self._free.take_out(block)  # in use while it is read
                continue
            if self.refcounts[block] == 0:
                self._free.take_out(block)
            self.refcounts[block] += 1
        table = [block if self.tier(block) == "device" else self._bring_back(block) for block in blocks]
        self.block_tables[seq_id] = table
        if self.events and table:
            self.events.emit(ev.Hit(seq_id, tuple(table)))

    def _bring_back(self, host: int) -> int:
        """A spilled prefix block (taken out of the host free list) returns to a device block,
        held by one table: the caller's."""
        block = self._take_free_block()
        self.copies.append((host, block))
        self.prefix_cache.move(host, block)
        if self.events:  # told now: the next take may spill into the host block it leaves
            self.events.emit(ev.BroughtBack(host, block))
        self._free.give_back(host)
        self.num_spill_hits += 1
        return block

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; writes must copy first (copy-on-write)."""
        if child_id in self.block_tables:
            raise BlockManagerError(f"sequence {child_id} already has a block table")
        table = self.table(parent_id)
        for block in table:
            self.refcounts[block] += 1
        self.block_tables[child_id] = list(table)
        if self.events:
            self.events.emit(ev.Forked(parent_id, child_id))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the blocks holding the first `num_tokens` entries (eviction shrank the
        sequence, or speculation rolled it back)."""
        table, kept = self.table(seq_id), self.blocks_for(num_tokens)
        if len(table) <= kept:
            return
        for block in table[kept:]:
            self._drop(block)
        del table[kept:]
        if self.events:
            self.events.emit(ev.Truncated(seq_id, kept))

    def free(self, seq_id: int) -> None:
        """Drop the sequence's table, in whatever tiers it lies; blocks nobody else holds are free."""
        for block in self.table(seq_id):
            self._drop(block)
        table = self.block_tables.pop(seq_id)
        if self.prefix_cache:
            self.prefix_cache.forget_sequence(seq_id)
        if self.events:
            self.events.emit(ev.Freed(seq_id, tuple(table)))

    # ---------------------------------------------------------------- moving between tiers
    def held_off_device(self, seq_ids: list[int]) -> Counter[int]:
        """Blocks of these tables outside the device pool -> how many of the tables hold each."""
        return Counter(
            block for seq_id in seq_ids for block in self.table(seq_id) if self.tier(block) != "device"
        )

    def is_swapped(self, seq_id: int) -> bool:
        """Does the sequence hold a block outside the device pool? (Asked for every sequence every step:
        without tiers the answer needs no look at its table.)"""
        if not self.num_host_blocks and not self.disk:
            return False
        return seq_id in self.block_tables and any(
            self.tier(b) != "device" for b in self.block_tables[seq_id]
        )

    def swap_out_tier(self, num_blocks: int) -> str:
        """Where `num_blocks` swapped-out blocks would go: host while it has room, else disk."""
        return "host" if num_blocks <= self._free.count("host") else "disk"

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        on_device = {
            block for seq_id in seq_ids for block in self.table(seq_id) if self.tier(block) == "device"
        }
        return self.disk or len(on_device) <= self._free.count("host")

    def swap_out(self, seq_ids: list[int]) -> None:
        """Move the device blocks of these tables to the host tier (to disk once it is full). A
        block held only by these tables moves, and its device block is freed; a block that other
        tables hold too (a shared prefix) is copied, and stays on the device for them."""
        held = Counter(
            block for seq_id in seq_ids for block in self.table(seq_id) if self.tier(block) == "device"
        )
        moved = {}
        for block, holders in held.items():
            moved[block] = self._take_block("host" if self._free.count("host") else "disk")
            self.copies.append((block, moved[block]))
            self.refcounts[moved[block]] = holders
            self._drop(block, holders)
        for seq_id in seq_ids:
            self._repoint(self.block_tables[seq_id], moved)
        if self.events:
            self.events.emit(ev.SwappedOut(tuple(seq_ids), tuple(moved.items())))

    def can_swap_in(self, seq_ids: list[int], extra: int = 0) -> bool:
        return len(self.held_off_device(seq_ids)) + extra <= self.num_free_blocks

    def swap_in(self, seq_ids: list[int]) -> None:
        """Bring every host or disk block of these tables back to a device block. Every table that
        holds such a block (a sibling still swapped out) follows it, so it stays shared."""
        moved = {}
        for block in self.held_off_device(seq_ids):
            moved[block] = self._take_free_block()
            self.copies.append((block, moved[block]))
            self.refcounts[moved[block]] = self.refcounts[block]
            self._drop(block, self.refcounts[block])
        for table in self.block_tables.values():
            self._repoint(table, moved)
        if self.events:
            self.events.emit(ev.SwappedIn(tuple(seq_ids), tuple(moved.items())))

    @staticmethod
    def _repoint(table: list[int], moved: dict[int, int]) -> None:
        table[:] = [moved.get(block, block) for block in table]

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies decided since the last call, in order; they are the caller's to perform."""
        copies, self.copies = self.copies, []
        return copies

    def take_reclaimed(self) -> int:
        """Cached blocks reclaimed since the last call (the pressure ladder's first rung)."""
        reclaimed, self._reclaimed_since = self._reclaimed_since, 0
        return reclaimed

    # ---------------------------------------------------------------- reading
    def has_table(self, seq_id: int) -> bool:
        return seq_id in self.block_tables

    def holders_of_device_blocks(self) -> set[int]:
        """The sequences whose table holds at least one device block."""
        return {
            seq_id
            for seq_id, table in self.block_tables.items()
            if any(self.tier(block) == "device" for block in table)
        }

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
        another table nor, through the prefix cache, with requests to come."""
        table = self.table(seq_id)
        for index in range(start // self.block_size, self.blocks_for(end)):
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

    def block_state(self, block: int) -> str:
        """What a block holds, for pictures of the pool: "free"; "cached" (free, but its content is
        findable in the prefix cache: the first to go under pressure); "shared" (held by several
        tables, or by one and findable by requests to come); "private" (one table's alone)."""
        cached = self.prefix_cache is not None and block in self.prefix_cache.entries
        if self.refcounts[block] == 0:
            return "cached" if cached else "free"
        return "shared" if self.refcounts[block] > 1 or cached else "private"

    def block_states(self, tier: str) -> list[str]:
        """`block_state` of every block of a tier, by id: the whole device or host pool, or the
        disk's block files in use."""
        if tier == "disk":
            ids = sorted(
                block for block, held in self.refcounts.items() if held and self.tier(block) == "disk"
            )
        else:
            ids = self._free.ids(tier)
        return [self.block_state(block) for block in ids]

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
        listed = self._free.listed()
        free = set(listed)
        assert len(free) == len(listed), "a block freed twice"
        for block in (
            set(range(self.num_blocks + self.num_host_blocks)) | set(holders) | set(self.refcounts) | free
        ):
            assert self.refcounts[block] == holders[block], f"block {block}: refcount != tables holding it"
            assert (self.refcounts[block] == 0) == (block in free), (
                f"block {block}: free iff refcount 0 broken"
            )
