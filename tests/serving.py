"""A `minillm serve` app on a free port of 127.0.0.1, uvicorn in a thread: how the server tests run one.

It runs as `minillm serve` runs it (`uvicorn_config`: the connection limit, the deadline for a
request's head), with the engine in a thread of its own (the app's lifespan starts and stops it).
Every wait here has a deadline for the whole of it, not only for each read: a stream that never
ends sends something on every read.
"""

import http.client
import json
import time
import urllib.parse
from contextlib import contextmanager
from typing import NamedTuple

import uvicorn

from minillm.serve.app import build_app
from minillm.serve.connections import serving_in_a_thread, uvicorn_config
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.limits import ServeLimits


@contextmanager
def running_server(engine_loop: EngineLoop, limits: ServeLimits = ServeLimits(), **app_options):
    """The base URL of a server for `engine_loop` (served as "tiny") until the block ends."""
    app = build_app(engine_loop, "tiny", limits=limits, **app_options)
    with running_app(uvicorn_config(app, limits, log_level="warning")) as url:
        yield url
    assert not engine_loop.thread.is_alive(), "the app's lifespan did not stop the engine thread"


def running_app(config: uvicorn.Config):
    """Any app uvicorn serves (`config`: the app and its settings) on a free port of 127.0.0.1, in a
    thread: its base URL until the block ends."""
    return serving_in_a_thread(config)


class Answer(NamedTuple):
    status_code: int
    headers: dict[str, str]  # names lower-cased
    text: str

    def json(self):
        return json.loads(self.text)


def fetch(url: str, body: bytes | str | None = None, headers: dict | None = None, timeout=30) -> Answer:
    """GET `url`, or POST `body` with exactly `headers` (urllib would add a Content-Type); the
    whole answer, whatever its status, within `timeout` seconds in all (a stream too)."""
    parts = urllib.parse.urlsplit(url)
    deadline = time.monotonic() + timeout
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        data = body.encode() if isinstance(body, str) else body
        conn.request("GET" if body is None else "POST", parts.path, body=data, headers=headers or {})
        response = conn.getresponse()
        names = {name.lower(): value for name, value in response.getheaders()}
        received = b""
        while piece := response.read1(65536):
            received += piece
            assert time.monotonic() < deadline, f"{url}'s answer went on past {timeout} s: {received[-99:]!r}"
        return Answer(response.status, names, received.decode())
    finally:
        conn.close()


def read_all(chunks, within_s: float = 60) -> list:
    """Every chunk of an `openai` stream, which must end within `within_s` (the client's timeout
    bounds each read, not the stream)."""
    deadline, received = time.monotonic() + within_s, []
    for chunk in chunks:
        received.append(chunk)
        assert time.monotonic() < deadline, f"the stream went on past {within_s} s ({len(received)} chunks)"
    return received
