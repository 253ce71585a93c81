"""KV memory accounting, in one place: reserved, live, utilization, fragmentation.

- reserved: slots set aside for sequences (whole blocks for paging, whole max-length stretches
  for the contiguous arena);
- live: slots holding the key/value of a token that exists now;
- utilization = live / reserved;
- internal fragmentation = reserved - live (slots reserved but empty);
- external fragmentation = free slots that the largest possible request could not use
  (always 0 for paging: any free block serves anyone);
- shared: slots that sharing saved (prefix hits, forks), counted once per extra holder;
- per tier: slots held in the host pool and on disk (swapped-out sequences), the host pool's
  size, and the bytes moved so far in each direction ("device->host", "host->device", ...).
Bytes are slots x bytes per token slot (K and V, all layers, scales included once quantized).
The device numbers above count the device pool only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

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
    host_total_slots: int = 0
    host_reserved_slots: int = 0  # held by swapped-out sequences
    disk_reserved_slots: int = 0
    bytes_moved: dict[str, int] = field(default_factory=dict)  # direction -> bytes, since the engine started

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
                "shared_bytes": self.shared_slots * self.bytes_per_slot,
                "host_reserved_bytes": self.host_reserved_slots * self.bytes_per_slot,
                "disk_reserved_bytes": self.disk_reserved_slots * self.bytes_per_slot}


def paged_stats(manager: BlockManager, live_tokens: dict[int, int], bytes_per_slot: int,
                bytes_moved: dict[str, int] | None = None) -> MemoryStats:
    """live_tokens: seq_id -> tokens whose KV is stored in the device pool now."""
    size = manager.block_size
    reserved_blocks = manager.num_blocks - manager.num_free_blocks
    return MemoryStats(total_slots=manager.num_blocks * size, reserved_slots=reserved_blocks * size,
                       live_slots=sum(live_tokens.values()), external_fragmentation_slots=0,
                       bytes_per_slot=bytes_per_slot, shared_slots=manager.shared_device_blocks() * size,
                       host_total_slots=manager.num_host_blocks * size,
                       host_reserved_slots=manager.blocks_in_use("host") * size,
                       disk_reserved_slots=manager.blocks_in_use("disk") * size, bytes_moved=dict(bytes_moved or {}))


def arena_stats(arena: ContiguousArena, live_tokens: dict[int, int], bytes_per_slot: int) -> MemoryStats:
    free = arena.num_free_slots
    return MemoryStats(total_slots=arena.num_slots, reserved_slots=arena.num_slots - free,
                       live_slots=sum(live_tokens.values()),
                       external_fragmentation_slots=free - arena.largest_hole, bytes_per_slot=bytes_per_slot)
