"""`minillm serve` in a child process, for the HTTP benchmarks to measure: started on a free port
with the engine switches given, waited for until /health answers, read through /metrics (what it
runs, waits for and holds), and stopped once the benchmark's block ends.

`serve_http.py` and `serve_http_workload.py` drive it; `serve_http_url.py` sends the same load to a
server someone else started, and reads no /metrics.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from minillm.benchmarks.http_client import Endpoint, get
from minillm.config import ConfigError


def metrics(server: Endpoint) -> dict:
    from minillm.serve.metrics import parse_metrics

    return parse_metrics(get(server, "/metrics").decode())


def wait_idle(server: Endpoint, timeout: float = 120) -> dict:
    """/metrics once nothing runs or waits (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        if (
            values["num_requests_running"] == values["num_requests_waiting"] == 0
            or time.monotonic() > deadline
        ):
            return values
        time.sleep(0.1)


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def _start_server(serve_args: list[str], port: int, log) -> subprocess.Popen:
    """`minillm serve` in a child process on 127.0.0.1:port, its stderr to the file `log` (a pipe
    nobody reads would stop the server once full); returns once /health answers."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minillm.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *serve_args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
        env={**os.environ},
    )
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            log.seek(0)
            raise ConfigError(f"minillm serve exited: {log.read().decode().strip()[-500:]}")
        try:
            get(Endpoint("127.0.0.1", port), "/health")
            return server
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise ConfigError("minillm serve did not answer /health within 300 s.") from None
            time.sleep(0.2)


@contextmanager
def minillm_serve(serve_args: list[str]) -> Iterator[Endpoint]:
    """`minillm serve` in a child process on a free port while the block runs; stopped after."""
    port = _free_port()
    with tempfile.TemporaryFile() as log:
        server = _start_server(serve_args, port, log)
        try:
            yield Endpoint("127.0.0.1", port)
        finally:
            server.terminate()  # SIGTERM: nothing is in flight, so it exits at once
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)


def blocks_held(values: dict) -> int:
    return values["kv_blocks"]["private"] + values["kv_blocks"]["shared"]
