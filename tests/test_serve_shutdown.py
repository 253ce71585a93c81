"""Stopping the server: SIGTERM and Ctrl-C end every request in flight cleanly, whatever the
process inherited, within a deadline; and so does the engine loop's drain, which they start.

In process (`EngineLoop.drain`): a new request gets a 503, /health turns 503, a request that
ends within the grace period ends as usual, and those still running at its end get the shutdown
error (a stream's error event, then [DONE]; a body's 503). As a user runs it (`minillm serve` in
a process of its own): SIGINT and SIGTERM, with SIGINT inherited at its default and *ignored*
(how a background job of a non-interactive shell starts), each with a stream in flight, which
ends with the error event and [DONE]; the process exits with the stated status. Every wait here
has a deadline and says what it waited for.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import tiny_with_real_tokenizer
from serving import fetch, running_server

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.serve.engine_loop import EngineLoop

LONG_STREAM = 100_000  # tokens: a stream no machine ends within any grace period used here
STOP_WITHIN_S = 30  # a stopped server's stream ends, and its process exits, within this on any CPU
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 0}
JSON = {"Content-Type": "application/json"}
POOL_BYTES = 96 << 20  # the tiny model's LONG_STREAM tokens of KV (77 MB) fit: no refusal at admission


@pytest.fixture(scope="module")
def model_dir(real_dir, tmp_path_factory):
    """The tiny random Llama with the real tokenizer, its context long enough for LONG_STREAM."""
    return tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("shutdown-model"),
        real_dir,
        max_position_embeddings=LONG_STREAM + 1024,
        tie_word_embeddings=True,
    )


def body(max_tokens: int, stream: bool) -> str:
    return json.dumps(
        {
            "model": "tiny",
            "prompt": "The capital of France is",
            "max_tokens": max_tokens,
            "stream": stream,
            "ignore_eos": True,
        }
    )


class Stream:
    """A streamed completion, read line by line, each read bounded by the caller's deadline."""

    def __init__(self, base_url: str, max_tokens: int):
        host, port = base_url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=STOP_WITHIN_S)
        self.conn.request(
            "POST", "/v1/completions", body(max_tokens, True), {"Content-Type": "application/json"}
        )
        self.response = self.conn.getresponse()
        assert self.response.status == 200, self.response.read()
        self.events: list[str] = []

    def next_event(self, deadline: float) -> str | None:
        """The next `data:` payload, or None once the stream has ended."""
        while time.monotonic() < deadline:
            try:
                line = self.response.readline()
            except TimeoutError:
                raise AssertionError(f"the stream was silent {STOP_WITHIN_S} s: {self.events[-3:]}") from None
            if not line:
                return None
            if line.startswith(b"data: "):
                self.events.append(line[6:].decode().strip())
                return self.events[-1]
        raise AssertionError(f"the stream went on past its deadline: {self.events[-3:]}")

    def read_to_end(self, within_s: float) -> list[str]:
        deadline = time.monotonic() + within_s
        while self.next_event(deadline) is not None:
            pass
        self.conn.close()
        return self.events


def ends_with_the_shutdown_error(events: list[str]) -> bool:
    error = json.loads(events[-2]).get("error", {})
    return error.get("code") == 503 and "shutting down" in error.get("message", "") and events[-1] == "[DONE]"


def wait_until(condition, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {within_s} s for {what}"
        time.sleep(0.02)


# ----------------------------------------------------------------------------- in process


def test_a_drain_refuses_new_requests_finishes_short_ones_and_cuts_the_rest(model_dir):
    engine_loop = EngineLoop(LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_bytes=POOL_BYTES)))
    with running_server(engine_loop) as url:
        assert fetch(url + "/health").status_code == 200
        long_stream = Stream(url, LONG_STREAM)
        assert long_stream.next_event(time.monotonic() + STOP_WITHIN_S).startswith("{")
        whole = {}  # a non-streamed request in flight: answered with the same error
        waiter = threading.Thread(
            target=lambda: whole.update(answer=fetch(url + "/v1/completions", body(LONG_STREAM, False), JSON))
        )
        waiter.start()
        short_stream = Stream(url, 8)
        wait_until(lambda: engine_loop.open_requests == 3, STOP_WITHIN_S, "three requests in flight")

        engine_loop.drain(2.0)
        health, late = fetch(url + "/health"), fetch(url + "/v1/completions", body(4, False), JSON)
        assert health.status_code == late.status_code == 503
        assert "shutting down" in late.json()["error"]["message"] and late.json()["error"]["code"] == 503

        short = short_stream.read_to_end(STOP_WITHIN_S)  # it ends within the grace: as usual
        assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length" and short[-1] == "[DONE]"
        assert ends_with_the_shutdown_error(long_stream.read_to_end(STOP_WITHIN_S))
        waiter.join(timeout=STOP_WITHIN_S)
        assert not waiter.is_alive(), "the non-streamed request was not answered"
        assert whole["answer"].status_code == 503 and "shutting down" in whole["answer"].text
        wait_until(lambda: not engine_loop.running, STOP_WITHIN_S, "the engine loop to return")
    assert engine_loop.error is None


def test_a_drain_with_nothing_in_flight_returns_at_once(model_dir):
    """An idle engine loop waits up to a second for a command: the drain's wakes it."""
    engine_loop = EngineLoop(LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_bytes=POOL_BYTES)))
    engine_loop.start()
    wait_until(lambda: engine_loop.running, STOP_WITHIN_S, "the engine loop to start")
    began = time.monotonic()
    engine_loop.drain(60.0)
    engine_loop.thread.join(timeout=STOP_WITHIN_S)
    assert not engine_loop.thread.is_alive() and time.monotonic() - began < 0.9


# ----------------------------------------------------------------------------- as a user runs it


def start_server(model_dir, port: int, stderr_path, grace_s: float, sigint: object) -> subprocess.Popen:
    """`minillm serve` in a process of its own, with SIGINT at `sigint` (SIG_DFL or SIG_IGN) as
    it inherits it: the test sets it in the child, whatever the test's own process has."""
    command = [sys.executable, "-m", "minillm.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--threads", "1", "--served-model-name", "tiny", "--log-level", "warning"]
    command += ["--shutdown-timeout", str(grace_s)]
    with open(stderr_path, "w") as stderr:
        inherit = lambda: signal.signal(signal.SIGINT, sigint)  # noqa: E731  (in the child, before exec)
        return subprocess.Popen(command, stderr=stderr, stdout=subprocess.DEVNULL, preexec_fn=inherit)


def wait_for_health(url: str, proc: subprocess.Popen, stderr_path, within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            if fetch(url + "/health", timeout=5).status_code == 200:
                return
        except OSError:
            pass
        log = stderr_path.read_text()
        assert proc.poll() is None, f"minillm serve exited with {proc.returncode}: {log}"
        assert time.monotonic() < deadline, f"minillm serve did not answer /health within {within_s} s: {log}"
        time.sleep(0.1)


@pytest.mark.parametrize(
    "signum, sigint, twice",
    [
        (signal.SIGINT, signal.SIG_IGN, False),  # Ctrl-C to a background job: once was ignored
        (signal.SIGINT, signal.SIG_DFL, True),
        (signal.SIGTERM, signal.SIG_IGN, True),
        (signal.SIGTERM, signal.SIG_DFL, False),  # docker stop, systemd, Kubernetes
    ],
    ids=["SIGINT-inherited-ignored", "SIGINT-twice", "SIGTERM-sigint-ignored-twice", "SIGTERM"],
)
def test_a_signal_ends_the_stream_in_flight_and_the_process_exits(model_dir, tmp_path, signum, sigint, twice):
    """Once: the stream (longer than the grace) ends with the error event and [DONE]. Twice, with
    a grace longer than the test: after the first the stream goes on and new requests get a 503;
    the second ends it now. Either way the process exits with the status `stop_signals` states."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    url, stderr_path = f"http://127.0.0.1:{port}", tmp_path / "stderr.txt"
    proc = start_server(model_dir, port, stderr_path, 600.0 if twice else 0.5, sigint)
    try:
        wait_for_health(url, proc, stderr_path)
        stream = Stream(url, LONG_STREAM)
        assert stream.next_event(time.monotonic() + STOP_WITHIN_S).startswith("{")
        proc.send_signal(signum)
        if twice:  # the handler runs when the server's main thread next gets the CPU: wait for it
            draining = lambda: fetch(url + "/health", timeout=5).status_code == 503  # noqa: E731
            wait_until(draining, STOP_WITHIN_S, "/health to answer 503 once the drain began")
            assert fetch(url + "/v1/completions", body(4, False), JSON, timeout=5).status_code == 503
            for _ in range(3):  # still streaming: the drain lets it run
                assert stream.next_event(time.monotonic() + STOP_WITHIN_S).startswith("{")
            proc.send_signal(signum)
        events = stream.read_to_end(STOP_WITHIN_S)
        assert ends_with_the_shutdown_error(events), events[-3:]
        status = proc.wait(timeout=STOP_WITHIN_S)
    finally:
        proc.kill()
        proc.wait(timeout=STOP_WITHIN_S)
    log = stderr_path.read_text()
    assert status == EXIT_STATUS[signum], log
    assert f"{signal.Signals(signum).name}: no new requests" in log and "Traceback" not in log, log
    with pytest.raises(OSError):  # the socket is closed
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_graceful_stop_drains_on_the_first_signal_and_cuts_on_the_second():
    """Before the server runs a signal exits with its status; then the first drains with the
    grace, the second drains with none, and once the engine has stopped, uvicorn waits no more."""
    from minillm.cli.serve import GracefulStop

    class Recorder:  # stands for the engine loop and uvicorn's server: what GracefulStop asks of them
        running, force_exit = True, False

        def __init__(self):
            self.drains = []

        def drain(self, grace_s):
            self.drains.append(grace_s)

    stop = GracefulStop(7.0)
    with pytest.raises(SystemExit) as exited:
        stop(signal.SIGTERM, None)
    assert exited.value.code == 0 and stop.exit_status == 0
    loop, server = Recorder(), Recorder()
    stop.serving(loop, server)
    stop(signal.SIGINT, None)
    stop(signal.SIGTERM, None)
    assert loop.drains == [7.0, 0] and not server.force_exit and stop.exit_status == 130
    loop.running = False
    stop(signal.SIGINT, None)
    assert server.force_exit


def test_stop_signals_reach_the_handler_when_sigint_was_ignored_and_are_put_back():
    """`handling_stop_signals` takes both signals whatever they were, and puts back what was there."""
    from minillm.stop_signals import handling_stop_signals

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        seen = []
        with handling_stop_signals(lambda signum, frame: seen.append(signum)):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            wait_until(lambda: len(seen) == 2, 10, "both signals to reach the handler")
        assert seen == [signal.SIGINT, signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, before)
