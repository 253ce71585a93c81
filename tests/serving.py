"""A `minillm serve` app on a free port of 127.0.0.1, uvicorn in a thread: how the server tests run one.

It runs as `minillm serve` runs it (`uvicorn_config`: the connection limit, the deadline for a
request's head), with the engine in a thread of its own (the app's lifespan starts and stops it).
"""

import http.client
import json
import socket
import threading
import time
import urllib.parse
from contextlib import contextmanager
from typing import NamedTuple

import uvicorn

from minillm.serve.app import build_app
from minillm.serve.connections import uvicorn_config
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.limits import ServeLimits


@contextmanager
def running_server(engine_loop: EngineLoop, limits: ServeLimits = ServeLimits(), **app_options):
    """The base URL of a server for `engine_loop` (served as "tiny") until the block ends."""
    sock = socket.create_server(("127.0.0.1", 0))  # a free port, held from now on
    app = build_app(engine_loop, "tiny", limits=limits, **app_options)
    server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not engine_loop.thread.is_alive()  # the app's lifespan stopped the engine thread


class Answer(NamedTuple):
    status_code: int
    headers: dict[str, str]  # names lower-cased
    text: str

    def json(self):
        return json.loads(self.text)


def fetch(url: str, body: bytes | str | None = None, headers: dict | None = None, timeout=30) -> Answer:
    """GET `url`, or POST `body` with exactly `headers` (urllib would add a Content-Type); the
    whole answer, whatever its status."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        data = body.encode() if isinstance(body, str) else body
        conn.request("GET" if body is None else "POST", parts.path, body=data, headers=headers or {})
        response = conn.getresponse()
        names = {name.lower(): value for name, value in response.getheaders()}
        return Answer(response.status, names, response.read().decode())
    finally:
        conn.close()
