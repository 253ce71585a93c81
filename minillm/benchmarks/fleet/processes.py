"""The fleet's processes: a `redis-server`, N `minillm serve` engines and a `minillm route` router,
each a child on a free port of 127.0.0.1, waited for with a deadline, stopped when the block ends.

Engines start all at once (each loads the model on its own core) and are waited for together; a
child that exits early, or does not answer within its deadline, ends the block with its last
words. The same three pieces are what a person starts by hand (docs/fleet.md's recipe).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from minillm.benchmarks.http_client import Endpoint, get
from minillm.config import ConfigError

START_S = 300.0  # the longest a child may take to answer (a cold kernel build included)


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def _stop(*children: subprocess.Popen) -> None:
    """SIGTERM to all at once (they shut down side by side), then SIGKILL to any still there 30 s on."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=10)


@contextmanager
def _children(argvs: list[list[str]]) -> Iterator[list[tuple[subprocess.Popen, object]]]:
    """Each argv running, its output going to a file of its own (a pipe nobody reads would stop it
    once full); all stopped together when the block ends."""
    with ExitStack() as logs:
        started = []
        try:
            for argv in argvs:
                log = logs.enter_context(tempfile.TemporaryFile())
                started.append(
                    (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ}), log)
                )
            yield started
        finally:
            _stop(*(child for child, _ in started))


def _last_words(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace").strip()[-400:]


def _wait_until(answers, child: subprocess.Popen, log, what: str, deadline: float) -> None:
    """Until `answers()` is true: the child exited, or the deadline passed, is a ConfigError."""
    while not answers():
        if child.poll() is not None:
            raise ConfigError(f"{what} exited: {_last_words(log)}")
        if time.monotonic() > deadline:
            raise ConfigError(f"{what} did not answer within {START_S:g} s: {_last_words(log)}")
        time.sleep(0.1)


def _http_answers(endpoint: Endpoint):
    def answers() -> bool:
        try:
            get(endpoint, "/health")
            return True
        except OSError:
            return False

    return answers


def redis_ping(url: str) -> bool:
    """Does a Redis server answer PING at redis://host:port? (RESP written by hand: no client needed.)"""
    host, port = url.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_server(maxmemory_mib: int = 0) -> Iterator[str]:
    """A `redis-server` of its own (no persistence) on a free port: its redis:// URL. With
    `maxmemory_mib`, it holds at most that much and forgets the least recently used keys first."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError(
            "redis-server is not installed; install Debian's package: apt-get install redis-server"
        )
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    if maxmemory_mib:
        argv += ["--maxmemory", f"{maxmemory_mib}mb", "--maxmemory-policy", "allkeys-lru"]
    url = f"redis://127.0.0.1:{port}"
    with _children([argv]) as [(child, log)]:
        _wait_until(lambda: redis_ping(url), child, log, "redis-server", time.monotonic() + START_S)
        yield url


@contextmanager
def engines(count: int, serve_args: list[str], trace_dir: Path | None = None) -> Iterator[list[Endpoint]]:
    """`count` `minillm serve` children with the same flags, started together; with `trace_dir`,
    engine i writes its KV events to engine-i.jsonl there (`--trace`)."""
    endpoints = [Endpoint("127.0.0.1", free_port()) for _ in range(count)]
    argvs = []
    for index, endpoint in enumerate(endpoints):
        argv = [sys.executable, "-m", "minillm.cli", "serve", "--port", str(endpoint.port)]
        argv += ["--log-level", "warning", *serve_args]
        if trace_dir is not None:
            argv += ["--trace", str(Path(trace_dir) / f"engine-{index}.jsonl")]
        argvs.append(argv)
    with _children(argvs) as started:
        deadline = time.monotonic() + START_S
        for endpoint, (child, log) in zip(endpoints, started):
            _wait_until(_http_answers(endpoint), child, log, "minillm serve", deadline)
        yield endpoints


@contextmanager
def router(backends: list[Endpoint], policy: str, model_dir) -> Iterator[Endpoint]:
    """`minillm route` in front of `backends`, routing by `policy` ("kv" or "round-robin")."""
    endpoint = Endpoint("127.0.0.1", free_port())
    argv = [sys.executable, "-m", "minillm.cli", "route", "--port", str(endpoint.port), "--policy", policy]
    argv += ["--model", str(model_dir)]
    for backend in backends:
        argv += ["--engine", backend.url]
    with _children([argv]) as [(child, log)]:
        _wait_until(_http_answers(endpoint), child, log, "minillm route", time.monotonic() + START_S)
        yield endpoint
