"""Free blocks of every tier, and the numbering that says which tier a block id lies in.

Block ids run on across the tiers: 0..D-1 are device blocks (the pool attention reads), the next
H ids are host blocks, and the ids after those are block files on disk, numbered as needed. Each
tier keeps its free blocks least recently freed first, the order in which a free block that still
holds a cached prefix (findable while it waits) is taken for new content; an OrderedDict, so a
prefix hit can take one out of the middle. The block manager owns one of these; only it calls in.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count


def tier_of(block: int, num_device: int, num_host: int) -> str:
    if block < num_device:
        return "device"
    return "host" if block < num_device + num_host else "disk"


class FreeBlocks:
    def __init__(self, num_device: int, num_host: int):
        self.num_device, self.num_host = num_device, num_host
        self._device: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_device))
        self._host: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_device, num_device + num_host))
        self._disk: list[int] = []  # block files no longer in use, to be written again
        self._new_disk_ids = count(num_device + num_host)

    def tier(self, block: int) -> str:
        return tier_of(block, self.num_device, self.num_host)

    def count(self, tier: str) -> int:
        """Free blocks of the device or host tier."""
        return len(self._device if tier == "device" else self._host)

    def ids(self, tier: str) -> range:
        """Every block id of the device or host tier."""
        if tier == "device":
            return range(self.num_device)
        return range(self.num_device, self.num_device + self.num_host)

    def take(self, tier: str) -> int:
        """A free block of the tier: the least recently freed one (on disk, any file, or a new one)."""
        if tier == "disk":
            return self._disk.pop() if self._disk else next(self._new_disk_ids)
        block, _ = (self._device if tier == "device" else self._host).popitem(last=False)
        return block

    def take_out(self, block: int) -> None:
        """This free device or host block is taken by name (a prefix hit)."""
        del (self._device if self.tier(block) == "device" else self._host)[block]

    def give_back(self, block: int) -> None:
        """The block is free again, the most recently freed of its tier."""
        tier = self.tier(block)
        if tier == "disk":
            self._disk.append(block)
        else:
            (self._device if tier == "device" else self._host)[block] = None

    def listed(self) -> list[int]:
        """Every free block of every tier (the invariants check that none is listed twice)."""
        return [*self._device, *self._host, *self._disk]
