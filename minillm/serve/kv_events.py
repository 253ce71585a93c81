"""GET /v1/kv_events: the memory system's events as a server-sent-event stream.

A KV-aware router (Dynamo, llm-d) sends each prompt to the replica whose prefix cache already
holds its leading blocks; to know that, it follows each replica's KV events. vLLM publishes them
over ZMQ; this server streams them over HTTP, one message per engine step that changed something:

    data: {"step": 42, "ts": 1764650000.1, "events": [{"type": "BlockStored", ...}, ...]}

`?events=vllm` (the default) sends vLLM's shape only (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`, as `VllmEvents` below derives them); `?events=all` sends every event
of a block's life (`Allocated`, `Hit`, `SwappedOut`, ..., and `Step`), as `--trace` writes them.
A stream begins with the state at the moment it joined (`AllBlocksCleared` and a `BlockStored`
per cached block; or the `Snapshot`), so a client that rebuilds from the stream alone is right
from its first message on.

The engine thread only collects a step's events and hands the batch over at the step's end;
translating and encoding happen on the event loop. A client that reads too slowly to keep up
(more than `MAX_BATCHES` waiting) is cut off with a last error message instead of growing the
server's memory.
"""

from __future__ import annotations

import asyncio
import json
import time

from minillm.memory.block_ledger import tier_of
from minillm.memory.events import BroughtBack, Event, Registered, Snapshot, Spilled, Step, Uncached

MAX_BATCHES = 1024  # steps a stream may fall behind before it is cut off
KEEPALIVE_S = 15.0  # an idle stream sends a comment this often (a gone client is noticed)
FORMATS = ("vllm", "all")


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


class KVEventFeed:
    """One client's subscription: called on the engine thread, read on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._batches: asyncio.Queue = asyncio.Queue()
        self.pending: list[Event] = []  # this step's events so far (engine thread)
        self.queued = 0  # batches handed over and not yet read (approximate across threads)
        self.unsubscribe = lambda: None  # once subscribed, the engine's: how the feed takes itself off

    def __call__(self, step: int, event: Event) -> None:
        """On the engine thread: collect, and hand the batch over at the end of a step."""
        self.pending.append(event)
        if isinstance(event, (Step, Snapshot)):
            batch, self.pending = (step, time.time(), self.pending), []
            self.queued += 1
            if self.queued > MAX_BATCHES:
                self.unsubscribe()
                batch = None  # the reader's signal: it fell behind
            try:
                self.loop.call_soon_threadsafe(self._batches.put_nowait, batch)
            except RuntimeError:  # the client's event loop has closed
                self.unsubscribe()

    async def batches(self, alive, tick_s: float = 1.0):
        """Each step's (step, the time.time() it ended, events) as they come, and None after each
        `tick_s` of silence (the reader's chance to send what it holds, or a keepalive), while
        `alive()` (the engine loop runs). Raises FellBehind if the engine cut this feed off."""
        while True:
            try:
                batch = await asyncio.wait_for(self._batches.get(), timeout=tick_s)
            except asyncio.TimeoutError:
                if not alive():
                    return
                yield None
                continue
            self.queued -= 1
            if batch is None:
                raise FellBehind(f"This stream fell {MAX_BATCHES} steps behind and was closed.")
            yield batch

    async def messages(self, shape: str, alive):
        """Server-sent events, one per batch with something to say; a comment line when idle for
        KEEPALIVE_S."""
        vllm, idle = VllmEvents(), 0.0
        try:
            async for batch in self.batches(alive):
                if batch is None:
                    idle += 1.0
                    if idle >= KEEPALIVE_S:
                        idle = 0.0
                        yield ": idle\n\n"
                    continue
                step, _, events = batch
                if shape == "vllm":
                    items = [item for event in events for item in vllm(event)]
                else:
                    items = [event.to_json() for event in events]
                if items:
                    yield sse({"step": step, "ts": time.time(), "events": items})
        except FellBehind as err:
            yield sse({"error": str(err)})


class FellBehind(Exception):
    """A feed the engine cut off: its reader fell MAX_BATCHES steps behind."""


async def subscribed_feed(engine_loop) -> KVEventFeed:
    """A new feed, subscribed on the engine thread between two steps (so its first batch is the
    state then). Its reader must call `feed.unsubscribe()` however it ends."""
    feed, engine = KVEventFeed(asyncio.get_running_loop()), engine_loop.engine

    def subscribe(_):
        feed.unsubscribe = engine.subscribe(feed)

    await engine_loop.call(subscribe)
    return feed


async def event_stream(engine_loop, shape: str):
    """A new client's messages, unsubscribed however the stream ends (the client went away, or
    the engine stopped)."""
    feed = await subscribed_feed(engine_loop)

    async def stream():
        try:
            async for message in feed.messages(shape, lambda: engine_loop.alive):
                yield message
        finally:
            feed.unsubscribe()

    return stream()


def sse(payload: dict) -> str:
    """One server-sent event holding `payload` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
