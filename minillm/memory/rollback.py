"""Speculation's rollback: how far a sequence may guess, and cutting its cache back exactly.

A guessed token writes its K/V before anyone knows whether the model agrees. When the check
rejects it, the cache must end up holding exactly what decoding one token at a time would have
left: the entries past the accepted ones gone, the block cut into writable again, the prefix
cache no longer offering what was cut, H2O's scores of the cut entries forgotten. Two things
cannot be undone and so bound the guesses instead: an eviction between them (it would have
dropped other entries), and a block of keys scaled per block once its last slot is written (the
write quantizes it with every key in it, rejected ones included).
"""

from __future__ import annotations

from minillm.memory.block_manager import BlockManager
from minillm.memory.eviction import Evictor


def room_to_guess(
    num_cached: int, max_len: int, kept: int | None, block_size: int, fills_are_final: bool
) -> int:
    """Speculated entries a sequence with `num_cached` entries may write after its next token
    this step and still roll back exactly (`Rollback.truncate`): with eviction, only while its
    cache stays within the `kept` entries it keeps; with keys scaled per block
    (`fills_are_final`), not into a block's last slot."""
    room = max_len
    if kept is not None:
        room = kept - num_cached - 1
    if fills_are_final:
        room = min(room, block_size - 1 - (num_cached + 1) % block_size)
    return room


class Rollback:
    def __init__(self, block_manager: BlockManager, pool, evictor: Evictor | None):
        """`pool`: the device pool attention writes (`pool.py` or `quantized_pool.py`)."""
        self._blocks, self._pool, self._evictor = block_manager, pool, evictor

    def truncate(self, seq_id: int, num_entries: int) -> None:
        """Keep only the sequence's first `num_entries` KV entries. Blocks past them go back to the
        pool (their staged keys with them, at the next `apply`); the block cut into, whose later
        slots the next tokens write, stops being findable in the prefix cache if this table alone
        holds it (a shared one is copied before that write) and goes back to staging if it had
        been quantized; the prefix cache offers the sequence's blocks again from there."""
        manager, size = self._blocks, self._blocks.block_size
        manager.truncate(seq_id, num_entries)
        if num_entries % size:
            block = manager.table(seq_id)[num_entries // size]
            if manager.refcounts[block] == 1:
                manager.forget_cached(seq_id, num_entries, num_entries + 1)
                self._pool.restage_block(block)
        if manager.prefix_cache:
            manager.prefix_cache.truncate(seq_id, num_entries // size)
        if self._evictor:
            self._evictor.truncate(seq_id, num_entries)
