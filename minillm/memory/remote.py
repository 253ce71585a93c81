"""A remote KV tier: full prefix blocks shared by every engine through one Redis server.

The prefix cache finds a block again inside one engine. Engines that serve the same system prompt
or document each compute it again, unless the blocks go somewhere they all reach: the shared tier
LMCache and SGLang's HiCache put behind host memory, a key-value store of full blocks named by their
content. A request whose prompt the local cache covers only in part asks the store for the blocks
that follow, and installs those that come back as cached prefix blocks (as a resumed session does),
so only the rest is prefilled.

How a block is named and checked in the store (a sha256 chain of keys; a header of namespace,
parent, checksum and token ids before the block's stored form) is `remote_values.py`. A value is
installed only if everything in it is what was asked for; anything else is refused, counted (one
warning per kind of failure) and recomputed.

The step never waits. The store is a network away and may be slow or gone, so one background
thread owns the connection: the engine thread only queues blocks to write and starts fetches, and
later takes what came back. A request whose fetch is in flight is held out of the scheduler until
its blocks arrive, or until waiting longer would cost more than recomputing them (its tokens at the
prefill rate measured so far); the others keep stepping meanwhile. A store that fails (a refused
connection, a timeout, a full store) is reported in one warning and left alone for BACKOFF_S
seconds, then tried again by itself; meanwhile the engine recomputes, and never sees an exception.

What is written: each block the prefix cache registers from a local computation, not one that
came from the store. The worker copies it from the pool some time after it was registered, when
the block may already hold other content: every block carries a generation number, bumped when its
cache entry goes or the block is taken for new content (the KV events `Uncached`, `Reused`), and a
copy whose generation moved meanwhile is dropped, never published. The write queue is bounded: a
write that finds it full is dropped and counted; the step never blocks on it.

Size. The store's bound is its operator's: Redis `maxmemory`, with `maxmemory-policy allkeys-lru`
keeping the blocks used last; every block written also expires after `remote_kv_ttl` seconds. A
full store (an OOM reply, under `noeviction`) is one more failure: reported once, recomputed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from minillm.config import ConfigError
from minillm.memory.block_manager import BlockManager
from minillm.memory.events import Registered, Reused, Uncached
from minillm.memory.remote_values import (
    REFUSALS,
    ROOT,
    Refused,
    block_digests,
    chained,
    decode_value,
    encode_value,
    namespace_of,
    store_key,
)

log = logging.getLogger("minillm")

PLACEHOLDER_SEQ = -2  # the table holding fetched blocks while they are installed (sessions use -1)
SOCKET_TIMEOUT_S = 2.0  # a command the store has not answered in this long is a failure
CONNECT_TIMEOUT_S = 0.5
BACKOFF_S = 5.0  # after a failure, nothing is tried for this long
FALLBACK_WAIT_S = 0.5  # the longest a fetch is waited for before any prefill rate is measured
WRITE_QUEUE = 256  # blocks waiting to be written, at most; a write past them is dropped
GET_CHUNK = 8  # blocks asked for in one round trip
WRITE_CHUNK = 16  # blocks written in one round trip
STORE_COUNTERS = (
    "blocks_written",
    "already_stored",
    "bytes_written",
    "blocks_read",
    "bytes_read",
    "store_errors",
)
# ...and "stale_writes" (overwritten before they were copied), "skipped_writes" (queued, then the
#   store failed: stats() counts them as dropped)
ENGINE_COUNTERS = ("fetches", "hit_blocks", "late_fetches", "dropped_writes")


@dataclass
class Fetch:
    """One prompt's blocks asked of the store, from block `first` to the last full block a hit may
    cover (`digests` names every one from block 0). The worker appends each block that came back
    and passed every check to `blocks` (its stored tensors), in order, and sets `done`; the engine
    waits for it until `deadline` (time.monotonic()), then installs what came, or drops it."""

    token_ids: list[int]
    first: int
    digests: list[bytes]
    deadline: float
    blocks: list[dict[str, torch.Tensor]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False  # given up on (late, aborted): the worker stops asking

    @property
    def ended(self) -> bool:
        """Did it come back, or is it too late to wait for?"""
        return self.done.is_set() or time.monotonic() >= self.deadline

    def wait(self, seconds: float) -> None:
        self.done.wait(max(0.0, min(seconds, self.deadline - time.monotonic())))

    def cancel(self) -> None:
        """Give it up (its request was aborted): the worker stops asking, what came is dropped."""
        self.cancelled = True


@dataclass(frozen=True)
class _Write:
    block: int
    generation: int  # the block's generation when it was registered
    digest: bytes
    parent: bytes
    tokens: tuple[int, ...]


def _connect(url: str):
    """A Redis client for `url` (it connects at its first command), and the errors it fails with."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise ConfigError("remote_kv needs the redis client: pip install redis") from None
    client = redis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),  # a failure is reported at once; the backoff is ours
    )
    return client, (redis.RedisError, OSError)


class _Store:
    """The background side: one thread, the one Redis client, what waits for it (fetches first,
    then writes), the store's health, and every block's generation (bumped by the engine thread)."""

    def __init__(self, url: str, ttl: int, pool, namespace: bytes, layout: dict):
        self.url, self._ttl, self._pool, self._namespace = url, ttl, pool, namespace
        self._layout = layout  # name -> (dtype, shape) of each tensor of a block's stored form
        self._client, self._failures = _connect(url)
        self._wake = threading.Condition()
        self._fetches: deque[Fetch] = deque()
        self._writes: deque[_Write] = deque()
        self._generations: dict[int, int] = {}  # block -> generation (0 until bumped)
        self._closed = False
        self._down_until = 0.0  # time.monotonic() before which nothing is tried
        self._down = False  # a failure was reported, and no command has worked since
        self._warned: set[str] = set()  # kinds of refusal already warned of
        self.counters = Counter(dict.fromkeys((*STORE_COUNTERS, "stale_writes", "skipped_writes"), 0))
        self.refused = Counter(dict.fromkeys(REFUSALS, 0))
        self._thread = threading.Thread(target=self._run, name="minillm-remote-kv", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the engine thread
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def generation(self, block: int) -> int:
        return self._generations.get(block, 0)

    def bump(self, block: int) -> None:
        """The block's content is no longer the one cached: a pending copy of it is stale."""
        self._generations[block] = self._generations.get(block, 0) + 1

    def fetch(self, fetch: Fetch) -> None:
        with self._wake:
            self._fetches.append(fetch)
            self._wake.notify()

    def write(self, write: _Write) -> bool:
        """Queue a block to write; False when the queue is full (the write is dropped)."""
        with self._wake:
            if len(self._writes) >= WRITE_QUEUE:
                return False
            self._writes.append(write)
            self._wake.notify()
        return True

    def close(self) -> None:
        """Stop the worker, and wait for it to leave what it was doing (a copy out of the pool, a
        command): a daemon thread still inside torch when the interpreter exits aborts the process."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=SOCKET_TIMEOUT_S + 1.0)

    # ---------------------------------------------------------------- the worker thread
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._fetches or self._writes or self._closed):
                    self._wake.wait()
                if self._closed:
                    return
                fetch = self._fetches.popleft() if self._fetches else None
                taken = 0 if fetch else min(WRITE_CHUNK, len(self._writes))
                writes = [self._writes.popleft() for _ in range(taken)]
            try:
                if fetch is not None:
                    self._serve(fetch)
                elif self.available():
                    self._write(writes)
                else:
                    self.counters["skipped_writes"] += len(writes)
            except Exception as err:  # a bug, or a failure no one foresaw: the thread goes on serving
                self._failed(err)

    def _serve(self, fetch: Fetch) -> None:
        """GET the blocks in order, a chunk per round trip, until the first absent or refused one."""
        try:
            for start in range(fetch.first, len(fetch.digests), GET_CHUNK):
                if fetch.cancelled or not self.available():
                    return
                digests = fetch.digests[start : start + GET_CHUNK]
                values = self._ask(lambda pipe: [pipe.get(store_key(digest)) for digest in digests])
                if values is None:
                    return
                for index, value in enumerate(values, start):
                    blocks = None if value is None else self._checked(value, fetch, index)
                    if blocks is None:
                        return
                    fetch.blocks.append(blocks)
                    self.counters["blocks_read"] += 1
                    self.counters["bytes_read"] += len(value)
        finally:
            fetch.done.set()

    def _checked(self, value: bytes, fetch: Fetch, index: int) -> dict[str, torch.Tensor] | None:
        """Block `index` of the fetch's prompt from its value, or None (counted, warned once per
        kind) if anything in it is not what was asked for."""
        tokens = self._tokens(fetch, index)
        parent = fetch.digests[index - 1] if index else ROOT
        try:
            payload = decode_value(value, self._namespace, parent, tokens)
            try:
                tensors = load_tensors(payload)
            except Exception:  # safetensors' own error types vary with the damage
                raise Refused("malformed") from None
            if {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()} != self._layout:
                raise Refused("layout")
            return tensors
        except Refused as refusal:
            self._refuse(refusal.reason, store_key(fetch.digests[index]))
            return None

    def _tokens(self, fetch: Fetch, index: int) -> tuple[int, ...]:
        size = self._pool.block_size
        return tuple(fetch.token_ids[index * size : (index + 1) * size])

    def _refuse(self, reason: str, key: bytes) -> None:
        self.refused[reason] += 1
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning(
                "remote KV store at %s: a block under %s was refused (%s mismatch); recomputing it.",
                self.url,
                key.decode()[:40],
                reason,
            )

    def _write(self, writes: list[_Write]) -> None:
        """SET each block not already there (NX), with the TTL; a block whose generation moved
        while it was copied holds other content now and is dropped."""
        values = []
        for write in writes:
            value = self._value(write)
            if value is None:
                self.counters["stale_writes"] += 1
            else:
                values.append((store_key(write.digest), value))
        if not values:
            return
        ttl = self._ttl
        answers = self._ask(lambda pipe: [pipe.set(key, value, nx=True, ex=ttl) for key, value in values])
        for answer, (_, value) in zip(answers or (), values):
            if not answer:  # NX: another engine (or an earlier run) wrote the block already
                self.counters["already_stored"] += 1
                continue
            self.counters["blocks_written"] += 1
            self.counters["bytes_written"] += len(value)

    def _value(self, write: _Write) -> bytes | None:
        if self.generation(write.block) != write.generation:
            return None
        stored = self._pool.read_block(write.block)
        tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in stored.items()}
        if self.generation(write.block) != write.generation:  # overwritten while it was copied
            return None
        return encode_value(self._namespace, write.parent, write.tokens, save_tensors(tensors))

    def _ask(self, commands) -> list | None:
        """Run the commands `commands(pipe)` queues in one round trip; None if the store failed."""
        try:
            pipe = self._client.pipeline(transaction=False)
            commands(pipe)
            answers = pipe.execute()
        except self._failures as err:
            self._failed(err)
            return None
        self._down = False
        return answers

    def _failed(self, err: Exception) -> None:
        """One warning per outage; nothing is tried for BACKOFF_S seconds."""
        self.counters["store_errors"] += 1
        self._down_until = time.monotonic() + BACKOFF_S
        if not self._down:
            self._down = True
            reason = str(err).rpartition("caused error: ")[2]  # a pipeline's: the command's own words
            log.warning(
                "remote KV store at %s unavailable (%s: %s); recomputing instead",
                self.url,
                type(err).__name__,
                reason[:120],
            )


class RemoteKV:
    """The engine thread's side of the remote tier over one memory system (its block manager and
    tiers): it hears the prefix cache's registrations and drops (KV events), queues writes, starts
    fetches and installs what they bring. `KVCacheManager.fetch_remote` / `install_remote`."""

    def __init__(self, url: str, ttl: int, identity: dict[str, str], manager: BlockManager, tiers):
        self._manager, self._tiers = manager, tiers
        self._namespace = namespace_of(identity)
        layout = {name: (t.dtype, tuple(t.shape)) for name, t in tiers.device.read_block(0).items()}
        self._store = _Store(url, ttl, tiers.device, self._namespace, layout)
        weakref.finalize(self, self._store.close)
        self._digest_of_key: dict[int, bytes] = {}  # prefix-cache key -> the digest of its block
        self._installing = False  # blocks registered now came from the store: not written back
        self.counters = Counter(dict.fromkeys(ENGINE_COUNTERS, 0))
        manager.subscribe(self._heard)

    def _heard(self, step: int, event) -> None:
        """Registered: a block to write (unless it came from the store); Uncached, Reused: a block
        whose cached content is gone, so a pending copy of it is stale."""
        if isinstance(event, Registered):
            self._registered(event)
        elif isinstance(event, Uncached):
            self._digest_of_key.pop(event.key, None)
            self._store.bump(event.block)
        elif isinstance(event, Reused):
            self._store.bump(event.block)

    def _registered(self, event: Registered) -> None:
        if event.parent_key is not None and event.parent_key not in self._digest_of_key:
            return  # its parent was cached before we listened: no chain to name it by
        parent = ROOT if event.parent_key is None else self._digest_of_key[event.parent_key]
        digest = chained(self._namespace, parent, event.tokens)
        self._digest_of_key[event.key] = digest
        if self._installing or not self._store.available():
            return
        write = _Write(event.block, self._store.generation(event.block), digest, parent, event.tokens)
        if not self._store.write(write):
            self.counters["dropped_writes"] += 1

    def fetch(self, token_ids: list[int], prefill_rate: float | None) -> Fetch | None:
        """Ask the store for the prompt's full blocks after those the prefix cache holds (device and
        host), or None when there are none to ask for or the store is backing off. It is waited for
        no longer than prefilling those tokens would take at `prefill_rate` (tokens/s, measured;
        FALLBACK_WAIT_S before any is)."""
        size = self._manager.block_size
        wanted = (len(token_ids) - 1) // size  # full blocks a hit may cover: all but the last token's
        local = len(self._manager.prefix_cache.lookup(token_ids))
        if local >= wanted or not self._store.available():
            return None
        wait = (wanted - local) * size / prefill_rate if prefill_rate else FALLBACK_WAIT_S
        digests = block_digests(self._namespace, token_ids, size, wanted)
        fetch = Fetch(list(token_ids), local, digests, time.monotonic() + wait)
        self._store.fetch(fetch)
        self.counters["fetches"] += 1
        return fetch

    def install(self, fetch: Fetch) -> int:
        """Put the blocks a fetch brought into the device pool as cached prefix blocks, chained to
        the blocks the prefix cache holds before them (as many as fit). A fetch still in flight is
        too late: it is given up and nothing is installed. Returns the blocks installed."""
        if not fetch.done.is_set():
            fetch.cancelled = True
            self.counters["late_fetches"] += 1
            return 0
        manager, size = self._manager, self._manager.block_size
        hits = manager.prefix_cache.lookup(fetch.token_ids)
        if len(hits) < fetch.first:  # blocks the fetched ones follow left the cache meanwhile
            return 0
        arrived = fetch.blocks[len(hits) - fetch.first :]
        fits = len(arrived)
        while fits and not manager.can_grow(PLACEHOLDER_SEQ, (len(hits) + fits) * size, adopting=hits):
            fits -= 1
        if not fits:
            return 0
        manager.adopt(PLACEHOLDER_SEQ, hits)
        manager.grow(PLACEHOLDER_SEQ, (len(hits) + fits) * size)
        self._tiers.copy(manager.take_copies())  # spilled blocks leave (and hits return) first
        table = manager.table(PLACEHOLDER_SEQ)
        for index, tensors in enumerate(arrived[:fits], len(hits)):
            self._tiers.device.write_block(table[index], tensors)
        self._installing = True
        try:
            manager.prefix_cache.register(PLACEHOLDER_SEQ, table, fetch.token_ids, len(table) * size)
        finally:
            self._installing = False
        manager.free(PLACEHOLDER_SEQ)  # the blocks stay cached, findable by the request's prompt
        self.counters["hit_blocks"] += fits
        return fits

    def stats(self) -> dict:
        """The counters: blocks and bytes written and read, fetches, blocks installed (hit_blocks),
        fetches given up (late), writes dropped (queue full) or stale, store errors, refusals by kind."""
        store = dict(self._store.counters)
        dropped = self.counters["dropped_writes"] + store.pop("skipped_writes")
        return {
            **self.counters,
            **store,
            "dropped_writes": dropped,
            "refused": dict(self._store.refused),
            "available": self._store.available(),
        }
