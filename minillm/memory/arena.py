"""The baseline paging replaces: one contiguous reservation per request, sized for its maximum.

Before PagedAttention, a serving system reserved for each request a contiguous stretch of KV
slots long enough for prompt + max_tokens, because it could not know how long the output would
be. Two kinds of waste follow:
  - internal: slots reserved for tokens that are never generated (or not yet);
  - external: free slots scattered in holes between reservations, so a request can be refused
    while the total free memory would fit it.

`ContiguousArena` is a first-fit allocator over one arena of token slots. It stores no tensors:
it exists to measure that waste against paging on the same trace. (The cache that really stores
one contiguous stretch per sequence is the single-sequence decoder's, `decoding/cached.py`.)
"""

from __future__ import annotations


class ContiguousArena:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.reservations: dict[int, tuple[int, int]] = {}  # seq_id -> (start, length)

    def holes(self) -> list[tuple[int, int]]:
        """Free stretches as (start, length), in address order."""
        holes, cursor = [], 0
        for start, length in sorted(self.reservations.values()):
            if start > cursor:
                holes.append((cursor, start - cursor))
            cursor = start + length
        if cursor < self.num_slots:
            holes.append((cursor, self.num_slots - cursor))
        return holes

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - sum(length for _, length in self.reservations.values())

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.holes()), default=0)

    def can_allocate(self, length: int) -> bool:
        return self.largest_hole >= length

    def allocate(self, seq_id: int, length: int) -> int:
        """Reserve `length` contiguous slots at the first hole that fits; return the start."""
        for start, hole in self.holes():
            if hole >= length:
                self.reservations[seq_id] = (start, length)
                return start
        raise MemoryError(
            f"no contiguous stretch of {length} slots "
            f"({self.num_free_slots} free in total, largest hole {self.largest_hole})"
        )

    def free(self, seq_id: int) -> None:
        del self.reservations[seq_id]
