"""A request's body, read within the server's limits: JSON only, at most --max-body-kb, in time.

Every refusal is an `APIError` in OpenAI's body: 415 for a body that is not declared JSON (a web
page may post text/plain or a form to any server without a CORS preflight, but not JSON), 413 past
the size limit, 408 for a body not sent within --read-timeout. A refused body is still read and
dropped, up to `DRAIN_BYTES`: closed with bytes unread, a connection is reset, and a client still
sending (any plain HTTP client posting a large body, urllib's for one) sees the reset, never the
413. nginx does the same (its lingering close).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

from minillm.serve.errors import APIError, shown
from minillm.serve.limits import ServeLimits

DRAIN_BYTES = 64 * 2**20  # a refused body is read and dropped up to this much (then the connection closes)


async def read_body(request: Request, limits: ServeLimits) -> bytes:
    """The body, if it is JSON (415 otherwise), at most max_body_kb (413: refused by its
    Content-Length, or as soon as it grows past) and sent within read_timeout (408)."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise APIError(
            415, f"Send the body as JSON, with Content-Type: application/json (not {shown(content_type)})."
        )
    too_large = APIError(
        413, f"The request body is larger than this server takes ({limits.max_body_kb} KB, --max-body-kb)."
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and (
        len(length) > 18 or int(length) > limits.max_body_bytes
    ):  # int() of 5,000 digits raises
        await _drain(request, limits)
        raise too_large

    async def read() -> bytes:
        chunks, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > limits.max_body_bytes:
                return None
            chunks.append(piece)
        return b"".join(chunks)

    try:
        body = await asyncio.wait_for(read(), limits.read_timeout)
    except asyncio.TimeoutError:
        raise APIError(
            408, f"The request body did not arrive within {limits.read_timeout:g} s (--read-timeout)."
        ) from None
    if body is None:
        await _drain(request, limits)
        raise too_large
    return body


async def _drain(request: Request, limits: ServeLimits) -> None:
    """Read and drop the rest of a refused body (up to DRAIN_BYTES, within read_timeout), so that
    the client reads the refusal (see the module's docstring)."""

    async def drop() -> None:
        dropped = 0
        async for piece in request.stream():
            dropped += len(piece)
            if dropped > DRAIN_BYTES:
                return

    try:
        await asyncio.wait_for(drop(), limits.read_timeout)
    except (asyncio.TimeoutError, ClientDisconnect):
        pass  # a client too slow or gone: it is answered as far as it listens
