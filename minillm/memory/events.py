"""KV events: the life of every block, told as it happens.

Before optimizing memory, draw its data flow: where each piece of data comes from, where it goes,
how long it lives, who reads it. A snapshot of the pool cannot show that; a stream of events can.
The block manager and the prefix cache tell every change of a block's life to whoever subscribed:

    Allocated      a free block joins a sequence's table, for new tokens
    Reused         ...and it had held a cached prefix block, whose content is lost (or spilled)
    Filled         a block's last slot was written (`quantized`: a compressed pool sealed it)
    Registered     a full block becomes findable by its content in the prefix cache
    BroughtBack    a spilled block a prompt hits comes back from the host tier to a device block
    Hit            a new sequence starts with cached blocks instead of computing them (shared)
    Forked         a parallel sample or beam shares every block of its parent
    CopiedOnWrite  a sequence about to write a shared block gets a private copy
    SwappedOut/In  sequences' blocks move between the device pool and the host or disk tier
    Spilled        a cached block leaving the device moves to the host tier instead of vanishing
    EntriesEvicted a sequence over its eviction budget dropped entries (H2O, sinks + window)
    Truncated      a table was cut back (speculation's rollback, eviction's shrink)
    Freed          a sequence let go of its table; blocks nobody holds wait in the cached LRU
    Uncached       a block's prefix-cache entry is gone (reused, rewritten, or an ancestor went)
    Step           the engine finished a step: who ran, how many tokens, how many entries read

A subscriber is any callable `(step, event)`. Subscribing first hands it a `Snapshot` of the state
now (pool sizes, every table, every cached block), so it can follow from any moment on. With
nobody subscribed an event costs one truth test of an empty list, before it is even built.

Two readers come with the events. `Replayer` rebuilds every block's refcount, state and table
membership from the events alone; the tests compare it with the block manager after every step,
so an event the code forgets to send fails them. `VllmEvents` derives what a KV-aware router
consumes from vLLM (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), with this engine's tier
names ("device", "host", "disk") as the medium.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from minillm.memory.free_blocks import tier_of

Subscriber = Callable[[int, "Event"], None]
log = logging.getLogger("minillm")


class Event:
    """A change of some blocks' life. `to_json` / `event_from_json` carry it through a file."""

    def to_json(self) -> dict:
        return {"type": type(self).__name__, **_plain(dataclasses.asdict(self))}


@dataclass(frozen=True, slots=True)
class Snapshot(Event):
    """The state when a subscriber joined. `cached`: (block, key, parent key, tokens) of every
    prefix-cache entry, parents first; `bytes_per_token`: KV bytes of one token, all layers."""

    num_blocks: int
    host_blocks: int
    block_size: int
    bytes_per_token: int
    tables: dict[int, tuple[int, ...]]
    cached: tuple[tuple[int, int, int | None, tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class Allocated(Event):
    seq_id: int
    block: int


@dataclass(frozen=True, slots=True)
class Reused(Event):
    block: int


@dataclass(frozen=True, slots=True)
class Filled(Event):
    seq_id: int
    block: int
    quantized: bool


@dataclass(frozen=True, slots=True)
class Registered(Event):
    block: int
    key: int
    parent_key: int | None
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BroughtBack(Event):
    """A spilled block's content, and its cache entry, back in device block `block` (held by the
    `Hit` that follows)."""

    host: int
    block: int


@dataclass(frozen=True, slots=True)
class Hit(Event):
    """`blocks`: the new table (cached device blocks, and those just brought back)."""

    seq_id: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Forked(Event):
    parent_id: int
    child_id: int


@dataclass(frozen=True, slots=True)
class CopiedOnWrite(Event):
    seq_id: int
    index: int
    source: int
    block: int


@dataclass(frozen=True, slots=True)
class SwappedOut(Event):
    """`moves`: (device block, host or disk block); other tables may still hold a device block."""

    seq_ids: tuple[int, ...]
    moves: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class SwappedIn(Event):
    """`moves`: (host or disk block, device block); every table holding one follows it."""

    seq_ids: tuple[int, ...]
    moves: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Spilled(Event):
    block: int
    host: int


@dataclass(frozen=True, slots=True)
class EntriesEvicted(Event):
    seq_id: int
    num_entries: int


@dataclass(frozen=True, slots=True)
class Truncated(Event):
    seq_id: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class Freed(Event):
    seq_id: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Uncached(Event):
    block: int
    key: int


@dataclass(frozen=True, slots=True)
class Step(Event):
    """`sequences`: (seq_id, request_id, tokens computed, KV entries attention read) of each
    sequence that ran; `seconds`: the step's time."""

    seconds: float
    sequences: tuple[tuple[int, str, int, int], ...]


EVENT_TYPES = {
    cls.__name__: cls
    for cls in (Snapshot, Allocated, Reused, Filled, Registered, BroughtBack, Hit, Forked, CopiedOnWrite)
    + (SwappedOut, SwappedIn, Spilled, EntriesEvicted, Truncated, Freed, Uncached, Step)
}


def _plain(value):
    """Tuples as lists and dict keys as strings: what JSON holds."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value


def _tuples(value):
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def event_from_json(record: dict) -> Event:
    """The event a `to_json` dict (read back from JSON) describes; extra keys are ignored."""
    cls = EVENT_TYPES.get(record.get("type"))
    if cls is None:
        raise ValueError(f"not a KV event: {str(record)[:80]}")
    fields = {}
    for field in dataclasses.fields(cls):
        value = record[field.name]
        if field.name == "tables":
            value = {int(seq_id): tuple(table) for seq_id, table in value.items()}
        fields[field.name] = _tuples(value)
    return cls(**fields)


class KVEvents:
    """The subscribers of one memory system, and the step its events belong to."""

    def __init__(self):
        self._subscribers: list[Subscriber] = []
        self.step = 0  # the engine's step number; it counts them

    def __bool__(self) -> bool:
        """Is anybody listening? (Emitters test this before building an event.)"""
        return bool(self._subscribers)

    def add(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def remove(self, subscriber: Subscriber) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)

    def emit(self, event: Event) -> None:
        """Tell every subscriber. One that raises is dropped with a warning: a broken listener
        (a full disk under a trace, a bug) must not fail the step that told it."""
        for subscriber in list(self._subscribers):
            try:
                subscriber(self.step, event)
            except Exception as err:
                log.warning("a KV event subscriber failed (%s: %s) and was dropped", type(err).__name__, err)
                self.remove(subscriber)


# ---------------------------------------------------------------------------- rebuilding the state
class Replayer:
    """Every block's refcount, table membership and prefix-cache entry, from the events alone.
    It knows nothing of the block manager: feed it a stream (`apply`), then compare (`check`)."""

    def __init__(self):
        self.num_blocks = self.host_blocks = self.block_size = 0
        self.bytes_per_token = 0
        self.tables: dict[int, list[int]] = {}
        self.refcounts: Counter[int] = Counter()
        self.cached: dict[int, int] = {}  # block -> key

    def __call__(self, step: int, event: Event) -> None:
        self.apply(event)

    def tier(self, block: int) -> str:
        return tier_of(block, self.num_blocks, self.host_blocks)

    def state(self, block: int) -> str:
        """As `BlockManager.block_state`: free, cached, shared or private."""
        if self.refcounts[block] == 0:
            return "cached" if block in self.cached else "free"
        return "shared" if self.refcounts[block] > 1 or block in self.cached else "private"

    def apply(self, event: Event) -> None:
        getattr(self, "_" + type(event).__name__)(event)

    def _hold(self, seq_id: int, block: int) -> None:
        self.tables.setdefault(seq_id, []).append(block)
        self.refcounts[block] += 1

    def _release(self, block: int, holders: int = 1) -> None:
        self.refcounts[block] -= holders
        if self.refcounts[block] == 0:
            del self.refcounts[block]

    def _Snapshot(self, e: Snapshot) -> None:
        self.num_blocks, self.host_blocks, self.block_size = e.num_blocks, e.host_blocks, e.block_size
        self.bytes_per_token = e.bytes_per_token
        self.tables = {seq_id: list(table) for seq_id, table in e.tables.items()}
        self.refcounts = Counter(block for table in e.tables.values() for block in table)
        self.cached = {block: key for block, key, _, _ in e.cached}

    def _Allocated(self, e: Allocated) -> None:
        self._hold(e.seq_id, e.block)

    def _BroughtBack(self, e: BroughtBack) -> None:
        self.cached[e.block] = self.cached.pop(e.host)

    def _Hit(self, e: Hit) -> None:
        self.tables[e.seq_id] = []
        for block in e.blocks:
            self._hold(e.seq_id, block)

    def _Forked(self, e: Forked) -> None:
        for block in self.tables[e.parent_id]:
            self._hold(e.child_id, block)
        self.tables.setdefault(e.child_id, [])

    def _CopiedOnWrite(self, e: CopiedOnWrite) -> None:
        self._release(e.source)
        self.tables[e.seq_id][e.index] = e.block
        self.refcounts[e.block] += 1

    def _SwappedOut(self, e: SwappedOut) -> None:
        held = Counter(block for seq_id in e.seq_ids for block in self.tables[seq_id])
        for source, destination in e.moves:
            self.refcounts[destination] = held[source]
            self._release(source, held[source])
        moved = dict(e.moves)
        for seq_id in e.seq_ids:
            self.tables[seq_id] = [moved.get(block, block) for block in self.tables[seq_id]]

    def _SwappedIn(self, e: SwappedIn) -> None:
        for source, destination in e.moves:
            self.refcounts[destination] = self.refcounts.pop(source)
        moved = dict(e.moves)
        for seq_id, table in self.tables.items():
            self.tables[seq_id] = [moved.get(block, block) for block in table]

    def _Spilled(self, e: Spilled) -> None:
        self.cached[e.host] = self.cached.pop(e.block)

    def _Registered(self, e: Registered) -> None:
        self.cached[e.block] = e.key

    def _Uncached(self, e: Uncached) -> None:
        del self.cached[e.block]

    def _Truncated(self, e: Truncated) -> None:
        table = self.tables[e.seq_id]
        for block in table[e.num_blocks :]:
            self._release(block)
        del table[e.num_blocks :]

    def _Freed(self, e: Freed) -> None:
        for block in self.tables.pop(e.seq_id, []):
            self._release(block)

    def _Reused(self, e: Reused) -> None:
        """The content's end is told by Spilled or Uncached; nothing held changes."""

    _Filled = _EntriesEvicted = _Step = _Reused

    def check(self, tables: dict[int, list[int]], refcounts: dict[int, int], cached: dict[int, int]) -> None:
        """Raise AssertionError at the first difference from the real state: tables (seq_id ->
        blocks; an empty one counts as none), refcounts (block -> count, zeros allowed), cached
        (block -> key)."""
        real = {block: count for block, count in refcounts.items() if count}
        for seq_id in set(tables) | set(self.tables):  # a table of no blocks is no table
            replayed, held = self.tables.get(seq_id) or [], tables.get(seq_id) or []
            assert replayed == held, f"sequence {seq_id}: replayed table {replayed} != {held}"
        for block in set(real) | set(self.refcounts):
            assert self.refcounts[block] == real.get(block, 0), (
                f"block {block}: replayed refcount {self.refcounts[block]} != {real.get(block, 0)}"
            )
        for block in set(cached) | set(self.cached):
            assert self.cached.get(block) == cached.get(block), (
                f"block {block}: replayed prefix-cache key {self.cached.get(block)} != {cached.get(block)}"
            )


# ---------------------------------------------------------------------------- vLLM's shape
class VllmEvents:
    """vLLM's KV events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) derived from ours: what
    a KV-aware router (Dynamo, llm-d) keeps to send a prompt where its prefix is cached. Call it
    with each event in order; it returns the vLLM-shaped dicts that event makes (often none)."""

    def __init__(self):
        self.num_blocks = self.host_blocks = self.block_size = 0
        self.content: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}  # block -> key, parent, tokens

    def _medium(self, block: int) -> str:
        return tier_of(block, self.num_blocks, self.host_blocks)

    def _stored(self, block: int) -> dict:
        key, parent_key, tokens = self.content[block]
        return {
            "type": "BlockStored",
            "block_hashes": [key],
            "parent_block_hash": parent_key,
            "token_ids": list(tokens),
            "block_size": self.block_size,
            "lora_id": None,
            "medium": self._medium(block),
        }

    def _removed(self, block: int) -> dict:
        key = self.content[block][0]
        return {"type": "BlockRemoved", "block_hashes": [key], "medium": self._medium(block)}

    def _moved(self, source: int, destination: int) -> list[dict]:
        removed = self._removed(source)
        self.content[destination] = self.content.pop(source)
        return [removed, self._stored(destination)]

    def __call__(self, event: Event) -> list[dict]:
        if isinstance(event, Snapshot):
            self.num_blocks, self.host_blocks, self.block_size = (
                event.num_blocks,
                event.host_blocks,
                event.block_size,
            )
            self.content = {block: (key, parent, tokens) for block, key, parent, tokens in event.cached}
            return [{"type": "AllBlocksCleared"}] + [self._stored(block) for block, *_ in event.cached]
        if isinstance(event, Registered):
            self.content[event.block] = (event.key, event.parent_key, event.tokens)
            return [self._stored(event.block)]
        if isinstance(event, Uncached):
            removed = self._removed(event.block)
            del self.content[event.block]
            return [removed]
        if isinstance(event, Spilled):
            return self._moved(event.block, event.host)
        if isinstance(event, BroughtBack):
            return self._moved(event.host, event.block)
        return []
