"""The block ledger: each tier's free blocks, every held block's reference count, the copies due.

Block ids run on across the tiers: 0..D-1 are device blocks (the pool attention reads), the next
H ids are host blocks, and the ids after those are block files on disk, numbered as needed. Each
tier keeps its free blocks least recently freed first, the order in which a free block that still
holds a cached prefix (findable while it waits) is taken for new content; an OrderedDict, so a
prefix hit can take one out of the middle.

A block is free iff its reference count is 0: `take`, `hold` and `drop` change both together, so
that invariant is kept in one place. Every copy decided between blocks (copy-on-write, swaps,
spills, bring-backs) waits in one queue, in the order decided, for whoever owns the tensors.

The block manager owns one ledger and shares it with its tier moves (`tier_moves.py`); only they
call in.

Twins: a swap-out copies a device block to the host (or disk), and the two blocks hold the same
bytes until one of them is taken for new content or written. The ledger remembers each such pair,
so the next holder of the block to swap out shares the copy already made, and one coming back
shares the device block again while it is there: a shared block crosses between the tiers once.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from itertools import count


class BlockManagerError(RuntimeError):
    """Misuse of the block manager (a bug in the caller), e.g. freeing a sequence twice."""


def tier_of(block: int, num_device: int, num_host: int) -> str:
    if block < num_device:
        return "device"
    return "host" if block < num_device + num_host else "disk"


class BlockLedger:
    def __init__(self, num_device: int, num_host: int):
        self.num_device, self.num_host = num_device, num_host
        self._device: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_device))
        self._host: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_device, num_device + num_host))
        self._disk: list[int] = []  # block files no longer in use, to be written again
        self._new_disk_ids = count(num_device + num_host)
        self.refcounts: Counter[int] = Counter()  # held block -> tables holding it (read it, change it here)
        self._copies: list[tuple[int, int]] = []  # (source, destination) blocks to copy, in decision order
        self._twins: dict[int, int] = {}  # device block <-> its off-device copy, both ways, while it matches

    # ---------------------------------------------------------------- which tier, how many
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

    def held(self, tier: str) -> dict[int, int]:
        """The tier's held blocks -> how many tables hold each."""
        return {block: held for block, held in self.refcounts.items() if held and self.tier(block) == tier}

    # ---------------------------------------------------------------- free <-> held
    def take(self, tier: str, holders: int = 1) -> int:
        """A free block of the tier, now held by `holders` tables: the least recently freed one (on
        disk, any file no longer in use, or a new one)."""
        if tier == "disk":
            block = self._disk.pop() if self._disk else next(self._new_disk_ids)
        else:
            block, _ = (self._device if tier == "device" else self._host).popitem(last=False)
        self.forget_twin(block)  # new content: no copy stands for it
        self.refcounts[block] = holders
        return block

    def take_out(self, block: int) -> None:
        """This free block is taken by name, content and all (a prefix hit, a twin), not yet held."""
        tier = self.tier(block)
        if tier == "disk":
            self._disk.remove(block)
        else:
            del (self._device if tier == "device" else self._host)[block]

    def hold(self, block: int, holders: int = 1) -> None:
        """`holders` more tables hold the block; a free one (a cached prefix block) stops being free."""
        if self.refcounts[block] == 0:
            self.take_out(block)
        self.refcounts[block] += holders

    def drop(self, block: int, holders: int = 1) -> None:
        """`holders` tables let go of the block; at refcount 0 it is free again (a cached block
        keeps its prefix-cache entry, a copied one its twin)."""
        self.refcounts[block] -= holders
        if self.refcounts[block] == 0:
            del self.refcounts[block]
            self.give_back(block)

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

    # ---------------------------------------------------------------- twins: one block's bytes in two tiers
    def pair(self, device: int, copy: int) -> None:
        """`copy` (a host or disk block just taken) is to get `device`'s bytes."""
        self._twins[device], self._twins[copy] = copy, device

    def twin(self, block: int) -> int | None:
        """The block in another tier holding this one's bytes, if a swap made one that still matches
        (held or free: a free one is taken back by name, `take_out`)."""
        return self._twins.get(block)

    def forget_twin(self, block: int) -> None:
        """The block gets new content (taken, or about to be written): its twin no longer stands for it."""
        twin = self._twins.pop(block, None)
        if twin is not None:
            del self._twins[twin]

    # ---------------------------------------------------------------- the copy queue
    def copy(self, source: int, destination: int) -> None:
        self._copies.append((source, destination))

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies decided since the last call, in order; they are the caller's to perform."""
        copies, self._copies = self._copies, []
        return copies
