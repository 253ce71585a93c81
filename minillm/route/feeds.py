"""Each engine's KV events, followed: one asyncio task per engine keeps the index up to date.

A feed reads GET {engine}/v1/kv_events, a server-sent-event stream of one message per engine step
that changed the prefix cache (`serve/kv_events.py`), and applies each message's events to the
`BlockIndex`. The stream begins with the state at the moment it joined (`AllBlocksCleared`, then
a `BlockStored` per cached block), so a router that just started, or a feed that reconnects after
a break, is right again from its first message: no history is needed. A broken stream is opened
again after a pause that doubles up to MAX_BACKOFF_S.

What the index says is only as fresh as the feed. A feed is *lagging* when its stream is not
connected, or when a request routed to its engine finished more than `lag_s` seconds ago,
should have stored new blocks, and no message has arrived since the request was sent: the
engine has changed its cache and the router has not heard. The policy then stops trusting the
index (`policy.py`).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx2

from minillm.route.index import BlockIndex

LAG_S = 2.0  # a finished request's events may take this long to arrive before the feed is lagging
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 60.0  # an idle stream sends a comment every 15 s (`serve/kv_events.py`)


class Feed:
    """One engine's event stream, applied to `index` under the engine's URL."""

    def __init__(
        self,
        url: str,
        index: BlockIndex,
        client: httpx2.AsyncClient,
        headers: dict,
        lag_s: float = LAG_S,
        on_unreachable=lambda: None,
    ):
        """`on_unreachable()` is called when the engine refuses the connection (it is down)."""
        self.url, self.index, self.client, self.headers, self.lag_s = url, index, client, headers, lag_s
        self.on_unreachable = on_unreachable
        self.connected = False
        self.last_message_at = 0.0  # time.monotonic() of the last message applied
        self.messages = 0
        self.unheard: list[tuple[float, float]] = []  # (sent at, finished at) of requests not yet heard of
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.follow(), name=f"kv-events {self.url}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def request_finished(self, sent_at: float) -> None:
        """A request sent at `sent_at` that computed new blocks on this engine has just finished:
        a message about them should follow within lag_s."""
        self.unheard.append((sent_at, time.monotonic()))

    @property
    def lagging(self) -> bool:
        if not self.connected:
            return True
        self.unheard = [(sent, done) for sent, done in self.unheard if sent >= self.last_message_at]
        return any(time.monotonic() - done > self.lag_s for _, done in self.unheard)

    async def follow(self) -> None:
        """Read the stream for as long as the router runs, opening it again whenever it breaks."""
        backoff = FIRST_BACKOFF_S
        while True:
            try:
                await self._read_stream()
            except httpx2.ConnectError:
                self.on_unreachable()
            except (httpx2.HTTPError, ValueError, KeyError):
                pass  # a stream cut, timed out, refused or garbled: open it again
            if self.messages:  # it worked for a while: start over from a short pause
                backoff, self.messages = FIRST_BACKOFF_S, 0
            self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    async def _read_stream(self) -> None:
        timeout = httpx2.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S)
        url = f"{self.url}/v1/kv_events"
        async with self.client.stream("GET", url, headers=self.headers, timeout=timeout) as response:
            if response.status_code != 200:
                raise ValueError(f"{url} answered {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # a comment (the keep-alive), or the blank line between events
                message = json.loads(line[5:])
                if "error" in message:  # the engine cut the stream off (it fell behind)
                    return
                self.index.apply(self.url, message["events"])
                self.connected, self.last_message_at = True, time.monotonic()
                self.messages += 1
