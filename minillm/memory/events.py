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
    Preempted      sequences left the device for want of blocks: by swap (tables kept) or recompute
    Step           the engine finished a step: who ran, how many tokens, how many entries read, and
                   who waits in the queue

A subscriber is any callable `(step, event)`. Subscribing first hands it a `Snapshot` of the state
now (pool sizes, every table, every cached block), so it can follow from any moment on. With
nobody subscribed an event costs one truth test of an empty list, before it is even built.

Every event goes through a file and back (`to_json`, `event_from_json`): `--trace` writes them
(`tracing.py`). Two readers come with them: `replay.py` rebuilds the block state from
the events alone (the oracle the tests and `minillm trace show` use), and `serve/kv_events.py`
derives vLLM's shape from them for a KV-aware router.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import types
import typing
from dataclasses import dataclass
from typing import Callable

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
    """`moves`: (device block, host or disk block); other tables may still hold a device block, and a
    destination may be the source's twin (`block_ledger.py`): shared, not copied."""

    seq_ids: tuple[int, ...]
    moves: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class SwappedIn(Event):
    """`moves`: (host or disk block, device block); every table holding one follows it; a destination
    may be the source's twin: shared again, not copied."""

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
class Preempted(Event):
    """`seq_ids` left the device to make room (`how`: "swap" keeps their tables in a slower tier,
    "recompute" frees them); `for_seq`: the running sequence the room was for, or -1 when the room
    was for the queue (nothing could run)."""

    seq_ids: tuple[int, ...]
    how: str
    for_seq: int


@dataclass(frozen=True, slots=True)
class Step(Event):
    """`sequences`: (seq_id, request_id, tokens computed, KV entries attention read) of each
    sequence that ran; `seconds`: the step's time; `waiting`: (seq_id, request_id) of the queue,
    in its order (empty in traces written before it was recorded)."""

    seconds: float
    sequences: tuple[tuple[int, str, int, int], ...]
    waiting: tuple[tuple[int, str], ...] = ()


EVENT_TYPES = {
    cls.__name__: cls
    for cls in (Snapshot, Allocated, Reused, Filled, Registered, BroughtBack, Hit, Forked, CopiedOnWrite)
    + (SwappedOut, SwappedIn, Spilled, EntriesEvicted, Truncated, Freed, Uncached, Preempted, Step)
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


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _fits(value, hint) -> bool:
    """Is `value`, as JSON gives it back (lists for tuples, strings for dict keys), of type `hint`?
    Numbers must be finite: a trace file is read as a hostile one."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(value, arg) for arg in args)
    if origin is tuple:
        if not isinstance(value, list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(item, args[0]) for item in value)
        return len(value) == len(args) and all(map(_fits, value, args))
    if origin is dict:
        return isinstance(value, dict) and all(
            _is_int_text(key) and _fits(item, args[1]) for key, item in value.items()
        )
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, hint) and (hint is bool or not isinstance(value, bool))


def _is_int_text(key) -> bool:
    return isinstance(key, str) and key.removeprefix("-").isdigit()


def event_from_json(record: dict) -> Event:
    """The event a `to_json` dict (read back from JSON) describes; extra keys are ignored, a
    missing field with a default (one added since the file was written) takes it. A field of the
    wrong type or shape is a ValueError naming it."""
    cls = EVENT_TYPES.get(record.get("type")) if isinstance(record.get("type"), str) else None
    if cls is None:
        raise ValueError(f"not a KV event: {str(record)[:80]}")
    fields = {}
    for field in dataclasses.fields(cls):
        if field.name not in record and field.default is not dataclasses.MISSING:
            continue
        value = record[field.name]
        if not _fits(value, _hints(cls)[field.name]):
            raise ValueError(f"{cls.__name__}.{field.name} should be {field.type}, not {str(value)[:40]}")
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
