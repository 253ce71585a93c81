"""What crosses between the event loop and the engine thread: the commands, and where answers go.

The event loop puts commands on the engine loop's queue (`Add`, `Abort`, `Call`, `Drain`, `Stop`); the
engine thread sends each request's answers back to its `Reply`, which hands them to the
`Submission` that asked, on its event loop, through `call_soon_threadsafe`: the only safe way into
another thread's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Callable

from minillm.engine import RequestOutput
from minillm.sampling import SamplingParams

SHUTTING_DOWN = "The server is shutting down; send the request again once it is back, or to another server."


class RequestRefused(Exception):
    """The engine refused a request at admission; the message says why (the client's 400)."""


class ShuttingDown(RuntimeError):
    """The server is stopping: a request it no longer takes, or one it cut off (the client's 503)."""

    def __init__(self, message: str = SHUTTING_DOWN):
        super().__init__(message)


@dataclass(frozen=True)
class Reply:
    """Where one engine request's answers go: (prompt index, item) to `put`, called on the caller's
    event loop (`Submission.put`). Items: None (accepted), a RequestOutput, or an exception."""

    loop: asyncio.AbstractEventLoop
    put: Callable[[tuple], None]
    index: int  # the prompt's place in its HTTP request

    def send_soon(self, item) -> None:
        """From the engine thread: hand `item` over on the caller's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.put, (self.index, item))
        except RuntimeError:  # that event loop has closed already: nobody is listening
            pass


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float  # time.perf_counter() when the HTTP request came
    reply: Reply


@dataclass(frozen=True)
class Abort:
    request_id: str
    # "disconnect" (its client went away), "slow" (its client stopped reading), "stop" (every choice
    # met a stop string), "refused"
    reason: str


@dataclass(frozen=True)
class Call:
    fn: Callable  # fn(engine_loop), run on the engine thread; its result or exception goes to `future`
    future: concurrent.futures.Future


@dataclass(frozen=True)
class Drain:
    deadline: float  # time.monotonic() by which the requests in flight must be done or are cut off


@dataclass(frozen=True)
class Stop:
    pass


def deliver(items: list[tuple[Reply, RequestOutput]]) -> None:
    """On the caller's event loop: one step's outputs to their submissions."""
    for reply, out in items:
        reply.put((reply.index, out))
