"""One request forwarded to one engine, and its answer passed on as it comes.

`open_answer` sends the body unchanged and waits for the start of the answer: the whole JSON body
(a request that does not stream), or the first bytes of a server-sent-event stream. Until then
nothing has reached the client, so any failure (connection refused or cut, a deadline passed, a
502/503/504) raises `EngineFailed` and the router may send the request elsewhere. After that,
`relay` passes the stream on piece by piece; if the engine fails midway (or its stream ends
without `data: [DONE]`), the client gets an error event in OpenAI's body and then `data: [DONE]`,
as an engine ends a stream it cannot finish. Every wait has a deadline: CONNECT_S to connect,
`read_timeout` between two pieces of an answer.

What the engine said about its prefix cache (usage.prompt_tokens_details.cached_tokens, in the
body or in a stream's usage chunk) is read on the way, for the router's /metrics.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx2

from minillm.serve.errors import error_body

CONNECT_S = 2.0
RETRIED_STATUSES = (502, 503, 504)  # an engine that cannot serve now: another may
PASSED_HEADERS = ("content-type", "retry-after")  # of the engine's answer, to the client
DONE = b"data: [DONE]\n\n"


class EngineFailed(Exception):
    """The engine failed before any byte of its answer went to the client."""


class UsageReader:
    """usage.prompt_tokens_details.cached_tokens from an answer: a body, or a stream's lines."""

    def __init__(self):
        self.cached_tokens: int | None = None
        self.partial = b""  # a stream's line not yet ended

    def feed_body(self, body: bytes) -> None:
        try:
            self._read(json.loads(body))
        except ValueError:
            pass

    def feed_stream(self, piece: bytes) -> None:
        *lines, self.partial = (self.partial + piece).split(b"\n")
        for line in lines:
            if line.startswith(b"data: {") and b'"usage"' in line:
                self.feed_body(line[6:])

    def _read(self, body) -> None:
        usage = body.get("usage") if isinstance(body, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]


@dataclass
class Opened:
    """An engine's answer, begun: its status and headers, and either the whole body or the first
    bytes of its stream (`response` still open then)."""

    status: int
    headers: dict[str, str]
    first: bytes
    response: httpx2.Response | None = None  # open while the stream goes on
    pieces: AsyncIterator[bytes] | None = None  # ...and the rest of its bytes
    usage: UsageReader = field(default_factory=UsageReader)


async def open_answer(
    client: httpx2.AsyncClient, url: str, raw: bytes, headers: dict, read_timeout: float
) -> Opened:
    timeout = httpx2.Timeout(read_timeout, connect=CONNECT_S)
    request = client.build_request("POST", url, content=raw, headers=headers, timeout=timeout)
    try:
        response = await client.send(request, stream=True)
    except httpx2.HTTPError as err:
        raise EngineFailed(f"{type(err).__name__}: {err}") from None
    try:
        if response.status_code in RETRIED_STATUSES:
            raise EngineFailed(f"it answered {response.status_code}")
        kept = {
            name: value for name, value in response.headers.items() if name in ("content-type", "retry-after")
        }
        opened = Opened(response.status_code, kept, b"")
        if not kept.get("content-type", "").startswith("text/event-stream"):
            opened.first = await response.aread()
            opened.usage.feed_body(opened.first)
            await response.aclose()
            return opened
        opened.response, opened.pieces = response, response.aiter_raw()
        opened.first = await anext(opened.pieces, b"")
        opened.usage.feed_stream(opened.first)
        return opened
    except httpx2.HTTPError as err:
        await response.aclose()
        raise EngineFailed(f"{type(err).__name__}: {err}") from None
    except EngineFailed:
        await response.aclose()
        raise


async def relay(opened: Opened, finished):
    """The stream's bytes, the first first; `finished(complete)` once it ends, however it ends
    (`complete`: the engine's [DONE] went out)."""
    response, tail, complete = opened.response, opened.first[-len(DONE) :], False
    try:
        yield opened.first
        async for piece in opened.pieces:
            opened.usage.feed_stream(piece)
            tail = (tail + piece)[-len(DONE) :]
            yield piece
        if tail != DONE:
            raise httpx2.RemoteProtocolError("the stream ended without [DONE]")
        complete = True
    except httpx2.HTTPError as err:
        message = f"The engine failed in the middle of this answer ({type(err).__name__}); retry the request."
        yield b"data: " + json.dumps(error_body(502, message)).encode() + b"\n\n" + DONE
    finally:
        await response.aclose()
        finished(complete)
