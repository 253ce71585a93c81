"""One engine, one thread, many HTTP requests: the bridge between `LLMEngine` and asyncio.

The engine is not thread-safe and need not be: only the engine thread touches it — the main
thread under `minillm serve`, the one that loaded the model (with OpenMP, torch's parallel
regions ran ~20% slower, small ones 2x, in a thread started after another had run them; the
HTTP server gets a thread instead), a thread of its own in the tests. Everything else talks to it
through one queue of commands, read between steps:
    add     queue a request (its prompt ids and SamplingParams); the answer, accepted or refused
            with the engine's reason (a KV budget it can never fit, ...), goes back to the caller;
    abort   stop a request now (its client went away, or every choice met a stop string): its
            blocks go back to the pool at once;
    call    run a function on the engine and hand back its result (what /metrics reads).
When requests are running the thread steps the engine and sends each output to the asyncio queue
of the request it belongs to, one `call_soon_threadsafe` per step for all of them; when none are,
it sleeps on the command queue.

`Submission` is one HTTP request's side: it queues its prompts, waits until the engine has
accepted them, yields (prompt index, RequestOutput) as they arrive, and aborts whatever is still
running when it is closed — normally, or because the client disconnected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections import Counter, deque
from typing import AsyncIterator, Callable

import torch

from minillm.engine import LLMEngine, RequestOutput
from minillm.engine.sequence import Status
from minillm.sampling import SamplingParams

RATE_WINDOW_S = 10.0  # generation tokens/s is measured over the steps of the last 10 s


class RequestRefused(Exception):
    """The engine refused a request at admission; the message says why (the client's 400)."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, threads: int | None = None):
        self.engine, self.threads = engine, threads
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self.thread: threading.Thread | None = None  # set by start(); None when a caller runs run() itself
        self.running = False
        self.error: str | None = None  # set if the loop itself broke (a bug): /health reports it
        # counters for /metrics, kept by the engine thread
        self.prompt_tokens = 0
        self.finished = Counter()  # finish reason -> requests
        self.aborted = 0  # requests aborted because their client went away
        self.recent_steps: deque[tuple[float, float, int]] = deque()  # (start, end, tokens generated)
        self.started_at = time.time()

    # ------------------------------------------------------------------ lifetime (any thread)
    def start(self) -> None:
        """Run the engine in a thread of its own (the tests do; `minillm serve` calls run() from the
        main thread instead, the one whose OpenMP threads torch already uses: faster)."""
        self.running = True
        self.thread = threading.Thread(target=self.run, name="minillm-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Make run() return after the command it is on; wait for it when it runs in our thread."""
        self.commands.put(("stop",))
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    @property
    def alive(self) -> bool:
        return self.running and self.error is None

    # ------------------------------------------------------------------ the engine thread
    def run(self, while_true: Callable[[], bool] = lambda: True) -> None:
        """Serve commands and step the engine until stop() (or until `while_true()` turns false,
        checked at least once a second while idle), in the calling thread."""
        self.running = True
        if self.threads:  # OpenMP's thread count is per calling thread: set it where the engine runs
            torch.set_num_threads(self.threads)
        try:
            while while_true():
                if not self.serve_commands():
                    return
                if self.engine.has_unfinished_requests():
                    try:
                        self.step()
                    except Exception as err:  # the engine fails a batch itself; this is a bug past that
                        self.error = f"The engine loop broke ({type(err).__name__}: {err})."
                        return
        finally:
            self.running = False
            self.fail_all(self.error or "The server is shutting down.")

    def fail_all(self, error: str) -> None:
        """End every request still answered, and every command still waiting, with `error`."""
        for loop, out_queue, index in self.sinks.values():
            deliver_soon(loop, out_queue, index, RuntimeError(error))
        self.sinks.clear()
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                loop, out_queue, index = command[5]
                deliver_soon(loop, out_queue, index, RuntimeError(error))
            elif command[0] == "call":
                command[2].set_exception(RuntimeError(error))

    def serve_commands(self) -> bool:
        """Carry out every command waiting (when idle, wait up to 1 s for one); False on stop."""
        commands = []
        if not self.engine.has_unfinished_requests():
            try:
                commands.append(self.commands.get(timeout=1.0))
            except queue.Empty:
                return True
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if command[0] != "stop":
                self.obey(command)
        return not any(command[0] == "stop" for command in commands)

    def obey(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params, arrival, sink = command
            self.add(request_id, prompt_ids, params, arrival, sink)
        elif kind == "abort":
            _, request_id, reason = command
            self.sinks.pop(request_id, None)
            if request_id in self.engine.requests:
                self.engine.abort(request_id)
                if reason == "disconnect":
                    self.aborted += 1
                elif reason == "stop":  # every choice met a stop string: a request answered
                    self.finished[reason] += 1
        elif kind == "call":
            _, fn, future = command
            try:
                future.set_result(fn(self))
            except Exception as err:
                future.set_exception(err)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float, sink) -> None:
        loop, out_queue, index = sink
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id, arrival_time=arrival)
        except ValueError as err:
            deliver_soon(loop, out_queue, index, RequestRefused(str(err)))
            return
        seq = self.engine.requests[request_id][0]
        if seq.status is Status.FINISHED:  # refused at admission (its reason is the sequence's error)
            self.engine.abort(request_id)
            deliver_soon(loop, out_queue, index, RequestRefused(seq.error))
            return
        self.prompt_tokens += len(prompt_ids)
        self.sinks[request_id] = sink
        deliver_soon(loop, out_queue, index, None)  # accepted

    def step(self) -> None:
        start, generated = time.perf_counter(), self.engine.stats.tokens_generated
        outputs = self.engine.step()
        end = time.perf_counter()
        self.recent_steps.append((start, end, self.engine.stats.tokens_generated - generated))
        while self.recent_steps and self.recent_steps[0][1] < end - RATE_WINDOW_S:
            self.recent_steps.popleft()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            sink = self.sinks.pop(out.request_id, None) if out.finished else self.sinks.get(out.request_id)
            if out.finished:
                self.finished[out.finish_reason] += 1
            if sink is not None:
                loop, out_queue, index = sink
                by_loop.setdefault(loop, []).append((out_queue, index, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # that event loop has closed: nobody is listening
                pass


    def tokens_per_second(self) -> float:
        """Tokens generated over the steps of the last RATE_WINDOW_S seconds, per second of wall time
        from the first of them to now (0 when idle that long)."""
        now = time.perf_counter()
        steps = [s for s in self.recent_steps if s[1] >= now - RATE_WINDOW_S]
        return sum(s[2] for s in steps) / (now - steps[0][0]) if steps else 0.0

    # ------------------------------------------------------------------ callers (the event loop)
    async def call(self, fn: Callable[["EngineLoop"], object]):
        """fn(self), run on the engine thread between two steps."""
        if not self.alive:
            raise RuntimeError(self.error or "The engine loop is not running.")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put(("call", fn, future))
        return await asyncio.wrap_future(future)

    def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str) -> "Submission":
        return Submission(self, prompts, params, request_id)


def deliver_soon(loop: asyncio.AbstractEventLoop, out_queue: asyncio.Queue, index: int, item) -> None:
    try:
        loop.call_soon_threadsafe(out_queue.put_nowait, (index, item))
    except RuntimeError:  # that event loop has closed already: nobody is listening
        pass


def deliver(items: list[tuple[asyncio.Queue, int, RequestOutput]]) -> None:
    for out_queue, index, out in items:
        out_queue.put_nowait((index, out))


class Submission:
    """One HTTP request's engine requests, one per prompt (ids `{request_id}-{i}`)."""

    def __init__(self, loop: EngineLoop, prompts: list[list[int]], params: SamplingParams, request_id: str):
        self.engine_loop, self.prompts, self.params = loop, prompts, params
        self.ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.running: set[int] = set()
        self.closed = False

    async def start(self) -> None:
        """Queue every prompt and wait until the engine has taken them all. A refusal aborts the
        ones taken and raises RequestRefused."""
        if not self.engine_loop.alive:
            raise RuntimeError(self.engine_loop.error or "The engine loop is not running.")
        loop, arrival = asyncio.get_running_loop(), time.perf_counter()
        for index, (request_id, prompt) in enumerate(zip(self.ids, self.prompts)):
            self.engine_loop.commands.put(("add", request_id, prompt, self.params, arrival, (loop, self.queue, index)))
        refused = None
        for _ in self.ids:
            index, answer = await self.queue.get()
            if answer is None:
                self.running.add(index)
            else:
                refused = refused or answer
        if refused is not None:
            self.close("refused")
            raise refused

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) each time one of the requests changes, until all have finished
        or the submission is closed."""
        while self.running and not self.closed:
            index, out = await self.queue.get()
            if out is None and self.closed:
                return
            if isinstance(out, Exception):
                raise out
            if out.finished:
                self.running.discard(index)
            yield index, out

    def abort(self, index: int, reason: str = "stop") -> None:
        """Stop prompt `index`'s engine request (e.g. all its choices met a stop string)."""
        if index in self.running:
            self.running.discard(index)
            self.engine_loop.commands.put(("abort", self.ids[index], reason))

    def close(self, reason: str = "disconnect") -> None:
        """Abort every request still running; wake a reader waiting in outputs()."""
        for index in list(self.running):
            self.abort(index, reason)
        if not self.closed:
            self.closed = True
            self.queue.put_nowait((-1, None))
