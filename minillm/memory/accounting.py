"""KV memory accounting, in one place: reserved, live, utilization, fragmentation.

- reserved: slots set aside for sequences (whole blocks for paging, whole max-length stretches
  for the contiguous arena);
- live: slots holding the key/value of a token that exists now;
- utilization = live / reserved;
- internal fragmentation = reserved - live (slots reserved but empty);
- external fragmentation = free slots that the largest possible request could not use
  (always 0 for paging: any free block serves anyone);
- shared: slots that sharing saved (prefix hits, forks), counted once per extra holder.
Bytes are slots x bytes per token slot (K and V, all layers, scales included once quantized).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from minillm.memory.block_manager import BlockManager
from minillm.memory.arena import ContiguousArena


@dataclass
class MemoryStats:
    total_slots: int
    reserved_slots: int
    live_slots: int
    external_fragmentation_slots: int
    bytes_per_slot: int
    shared_slots: int = 0  # slots that sharing saved: a block held by k tables counts (k - 1) times

    @property
    def utilization(self) -> float:
        return self.live_slots / self.reserved_slots if self.reserved_slots else 1.0

    @property
    def internal_fragmentation_slots(self) -> int:
        return self.reserved_slots - self.live_slots

    def as_dict(self) -> dict:
        return {**asdict(self), "utilization": self.utilization,
                "internal_fragmentation_slots": self.internal_fragmentation_slots,
                "reserved_bytes": self.reserved_slots * self.bytes_per_slot,
                "live_bytes": self.live_slots * self.bytes_per_slot,
                "shared_bytes": self.shared_slots * self.bytes_per_slot}


def paged_stats(manager: BlockManager, live_tokens: dict[int, int], bytes_per_slot: int) -> MemoryStats:
    """live_tokens: seq_id -> tokens whose KV is stored now."""
    reserved_blocks = manager.num_blocks - manager.num_free_blocks
    shared_blocks = sum(count - 1 for count in manager.refcounts if count > 1)
    return MemoryStats(total_slots=manager.num_blocks * manager.block_size,
                       reserved_slots=reserved_blocks * manager.block_size,
                       live_slots=sum(live_tokens.values()), external_fragmentation_slots=0,
                       bytes_per_slot=bytes_per_slot, shared_slots=shared_blocks * manager.block_size)


def arena_stats(arena: ContiguousArena, live_tokens: dict[int, int], bytes_per_slot: int) -> MemoryStats:
    free = arena.num_free_slots
    return MemoryStats(total_slots=arena.num_slots, reserved_slots=arena.num_slots - free,
                       live_slots=sum(live_tokens.values()),
                       external_fragmentation_slots=free - arena.largest_hole, bytes_per_slot=bytes_per_slot)
