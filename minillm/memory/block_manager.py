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
Invariants, checked by `check_invariants` and the property tests:
  - a block is free iff its refcount is 0;
  - a block's refcount equals the number of tables that hold it;
  - when every sequence is freed, every block is free.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from minillm.memory.prefix_cache import PrefixCache


class BlockManagerError(RuntimeError):
    """Misuse of the block manager (a bug in the caller), e.g. freeing a sequence twice."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1 (got {num_blocks}, {block_size}).")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # the free pool, least recently freed first; an OrderedDict so a prefix hit can take a
        # block out of the middle
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.refcounts = [0] * num_blocks
        self.block_tables: dict[int, list[int]] = {}  # seq_id -> physical block ids
        self.prefix_cache = PrefixCache(block_size) if prefix_caching else None
        self.num_copies = 0  # copy-on-write copies made

    # ---------------------------------------------------------------- counting
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

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
        return [i for i in range(start // self.block_size, min(len(table), self.blocks_for(end)))
                if self.refcounts[table[i]] > 1]

    def can_grow(self, seq_id: int, num_tokens: int, adopting: list[int] = (), copies: int = 0) -> bool:
        """Room for `num_tokens` tokens and `copies` copy-on-write blocks, after taking over the
        cached blocks `adopting` (those waiting in the free pool stop being free)."""
        missing = self.blocks_missing(seq_id, num_tokens) - len(adopting) + copies
        reclaimed = sum(1 for block in adopting if self.refcounts[block] == 0)
        return missing <= self.num_free_blocks - reclaimed

    # ---------------------------------------------------------------- changing
    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Make the sequence's table (created if new) long enough for `num_tokens` tokens."""
        missing = self.blocks_missing(seq_id, num_tokens)
        if missing > self.num_free_blocks:
            raise BlockManagerError(f"sequence {seq_id} needs {missing} blocks, {self.num_free_blocks} are free; "
                                    "check can_grow first")
        table = self.block_tables.setdefault(seq_id, [])
        for _ in range(missing):
            table.append(self.take_free_block())

    def take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)  # least recently freed
        if self.prefix_cache:
            self.prefix_cache.evict(block)  # its old content is about to be overwritten
        self.refcounts[block] = 1
        return block

    def copy_on_write(self, seq_id: int, start: int, end: int) -> list[tuple[int, int]]:
        """Give the sequence private copies of the shared blocks positions start..end-1 will
        write. Returns (source, destination) block pairs whose KV the caller must copy."""
        table, copies = self.table(seq_id), []
        for index in self.shared_blocks(seq_id, start, end):
            shared = table[index]
            if len(self.free_blocks) == 0:
                raise BlockManagerError(f"no free block to copy block {shared} into; check can_grow first")
            self.refcounts[shared] -= 1
            table[index] = self.take_free_block()
            copies.append((shared, table[index]))
        self.num_copies += len(copies)
        return copies

    def adopt(self, seq_id: int, blocks: list[int]) -> None:
        """Start a new sequence's table with cached blocks (a prefix hit): share, don't recompute."""
        if seq_id in self.block_tables:
            raise BlockManagerError(f"sequence {seq_id} already has a block table")
        for block in blocks:
            if self.refcounts[block] == 0:
                del self.free_blocks[block]
            self.refcounts[block] += 1
        self.block_tables[seq_id] = list(blocks)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; writes must copy first (copy-on-write)."""
        if child_id in self.block_tables:
            raise BlockManagerError(f"sequence {child_id} already has a block table")
        table = self.table(parent_id)
        for block in table:
            self.refcounts[block] += 1
        self.block_tables[child_id] = list(table)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the blocks holding the first `num_tokens` entries (eviction shrank the sequence)."""
        table = self.table(seq_id)
        for block in table[self.blocks_for(num_tokens):]:
            self.refcounts[block] -= 1
            if self.refcounts[block] == 0:
                self.free_blocks[block] = None
        del table[self.blocks_for(num_tokens):]

    def free(self, seq_id: int) -> None:
        """Drop the sequence's table; blocks nobody else holds go back to the free pool."""
        for block in self.table(seq_id):
            self.refcounts[block] -= 1
            if self.refcounts[block] == 0:
                self.free_blocks[block] = None  # most recently freed; a cached block keeps its entry
        del self.block_tables[seq_id]
        if self.prefix_cache:
            self.prefix_cache.forget_sequence(seq_id)

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
        """Positions start..end-1 are about to be written: their blocks must not be shared."""
        table = self.table(seq_id)
        for index in range(start // self.block_size, self.blocks_for(end)):
            if self.refcounts[table[index]] > 1:
                raise BlockManagerError(f"sequence {seq_id} would write into block {table[index]}, "
                                        f"shared by {self.refcounts[table[index]]} tables; copy it first")

    def check_invariants(self) -> None:
        holders = Counter(block for table in self.block_tables.values() for block in table)
        free = set(self.free_blocks)
        for block in range(self.num_blocks):
            assert self.refcounts[block] == holders[block], f"block {block}: refcount != tables holding it"
            assert (self.refcounts[block] == 0) == (block in free), f"block {block}: free iff refcount 0 broken"
