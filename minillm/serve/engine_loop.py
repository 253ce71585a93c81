"""One engine, one thread, many HTTP requests: the bridge between `LLMEngine` and asyncio.

The engine is not thread-safe and need not be: only the engine thread touches it — the main
thread under `minillm serve`, the one that loaded the model (with OpenMP, torch's parallel
regions ran ~20% slower, small ones 2x, in a thread started after another had run them; the
HTTP server gets a thread instead), a thread of its own in the tests. Everything else talks to it
through one queue of commands (`commands.py`), read between steps:
    Add     queue a request (its prompt ids and SamplingParams); the answer, accepted or refused
            with the engine's reason (a KV budget it can never fit, ...), goes back to the caller;
    Abort   stop a request now (its client went away, or every choice met a stop string): its
            blocks go back to the pool at once;
    Call    run a function on the engine and hand back its result (what /metrics reads);
    Drain   take no new request, let those in flight run until a deadline, then end the rest with
            `ShuttingDown` and return from run(): how a server stops (`drain()`, from a signal);
    Stop    return from run() now.
Each request's outputs go to its `Reply`: an asyncio queue on the caller's event loop. When requests
are running the thread steps the engine and sends each output to its request's Reply, one
`call_soon_threadsafe` per event loop per step for all of them; when none are, it sleeps on the
command queue.

`Submission` is one HTTP request's side: it queues its prompts, waits until the engine has
accepted them, yields (prompt index, RequestOutput) as they arrive, and aborts whatever is still
running when it is closed — normally, or because the client disconnected. Its queue is bounded: a
reader `backlog` steps behind (a client that stopped reading its stream while the engine goes on)
is cut off, its requests aborted, rather than the server holding every output it never reads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections import Counter, deque
from typing import AsyncIterator, Callable, NamedTuple

import torch

from minillm.engine import LLMEngine, RequestOutput
from minillm.sampling import SamplingParams
from minillm.serve.commands import (
    Abort,
    Add,
    Call,
    Drain,
    Reply,
    RequestRefused,
    ShuttingDown,
    Stop,
    deliver,
)

RATE_WINDOW_S = 10.0  # generation tokens/s is measured over the steps of the last 10 s
STEPS_KEPT = 1_000  # per-step detail a served engine keeps: /metrics reads only counters, and a
#   bench's 10,000 steps (~10 MB) would be memory filling for the first hour of a slow server


class StepTime(NamedTuple):
    """One engine step, for the tokens/s of /metrics."""

    start: float
    end: float
    tokens: int  # tokens generated


class EngineLoop:
    def __init__(self, engine: LLMEngine, threads: int | None = None):
        self.engine, self.threads = engine, threads
        engine.stats.keep_last(STEPS_KEPT)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.replies: dict[str, Reply] = {}  # request id -> where its outputs go
        self.thread: threading.Thread | None = None  # set by start(); None when a caller runs run() itself
        self.running = False
        self.error: str | None = None  # set if the loop itself broke (a bug): /health reports it
        self.draining = False  # set by drain(): new requests are refused (any thread reads it)
        self.drain_deadline: float | None = None  # the engine thread's copy, from the Drain command
        # counters for /metrics, kept by the engine thread
        self.prompt_tokens = 0
        self.finished = Counter()  # finish reason -> requests
        self.aborted = 0  # requests aborted because their client went away or stopped reading
        self.open_requests = 0  # engine requests of Submissions started and not closed (event loop's)
        self.recent_steps: deque[StepTime] = deque()
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
        self.commands.put(Stop())
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def drain(self, grace_s: float) -> None:
        """Stop taking requests now; give the ones in flight `grace_s` seconds to finish, then
        end the rest with ShuttingDown, and run() returns (at once if none is running). A second
        call may only bring the deadline closer. Safe from any thread and from a signal handler:
        it sets a flag and puts a command on a SimpleQueue, whose put() is reentrant."""
        self.draining = True
        self.commands.put(Drain(time.monotonic() + grace_s))

    @property
    def alive(self) -> bool:
        """The loop runs: /metrics and the KV event streams are served, even while draining."""
        return self.running and self.error is None

    @property
    def accepting(self) -> bool:
        """The loop runs and takes new requests: what /health says."""
        return self.alive and not self.draining

    def unavailable(self) -> RuntimeError:
        """Why a new request cannot run: the loop broke, or it is shutting down, or not started."""
        if self.error is not None:
            return RuntimeError(self.error)
        if self.draining:
            return ShuttingDown()
        return RuntimeError("The engine loop is not running.")

    # ------------------------------------------------------------------ the engine thread
    def run(self, while_true: Callable[[], bool] = lambda: True) -> None:
        """Serve commands and step the engine until stop(), a drain's end (nothing left to run, or
        its deadline), or `while_true()` turning false (checked at least once a second while idle),
        in the calling thread. Whatever still runs then is ended with an error."""
        self.running = True
        if self.threads:  # OpenMP's thread count is per calling thread: set it where the engine runs
            torch.set_num_threads(self.threads)
        try:
            while while_true():
                if not self.serve_commands() or self.drained():
                    return
                if self.engine.has_unfinished_requests():
                    try:
                        self.step()
                    except Exception as err:  # the engine fails a batch itself; this is a bug past that
                        self.error = f"The engine loop broke ({type(err).__name__}: {err})."
                        return
        finally:
            self.running = False
            self.fail_all(RuntimeError(self.error) if self.error else ShuttingDown())

    def drained(self) -> bool:
        """A drain has begun and is over: nothing left to run, or the deadline has passed."""
        if self.drain_deadline is None:
            return False
        return not self.engine.has_unfinished_requests() or time.monotonic() >= self.drain_deadline

    def fail_all(self, error: RuntimeError) -> None:
        """End every request still answered, and every command still waiting, with `error`."""
        for reply in self.replies.values():
            reply.send_soon(error)
        self.replies.clear()
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Add):
                command.reply.send_soon(error)
            elif isinstance(command, Call):
                command.future.set_exception(error)

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
            match command:
                case Add():
                    self.add(command)
                case Abort():
                    self.abort(command)
                case Call():
                    self.call_now(command)
                case Drain(deadline):
                    self.drain_deadline = min(deadline, self.drain_deadline or deadline)
        return not any(isinstance(command, Stop) for command in commands)

    def add(self, command: Add) -> None:
        try:
            self.engine.add_request(
                command.prompt_ids,
                command.params,
                request_id=command.request_id,
                arrival_time=command.arrival,
            )
        except ValueError as err:
            command.reply.send_soon(RequestRefused(str(err)))
            return
        refusal = self.engine.refusal(command.request_id)
        if refusal is not None:  # refused at admission: it never runs
            self.engine.abort(command.request_id)
            command.reply.send_soon(RequestRefused(refusal))
            return
        self.prompt_tokens += len(command.prompt_ids)
        self.replies[command.request_id] = command.reply
        command.reply.send_soon(None)  # accepted

    def abort(self, command: Abort) -> None:
        self.replies.pop(command.request_id, None)
        if self.engine.has_request(command.request_id):
            self.engine.abort(command.request_id)
            if command.reason in ("disconnect", "slow"):
                self.aborted += 1
            elif command.reason == "stop":  # every choice met a stop string: a request answered
                self.finished[command.reason] += 1

    def call_now(self, command: Call) -> None:
        try:
            command.future.set_result(command.fn(self))
        except Exception as err:
            command.future.set_exception(err)

    def step(self) -> None:
        start, generated = time.perf_counter(), self.engine.stats.tokens_generated
        outputs = self.engine.step()
        end = time.perf_counter()
        self.recent_steps.append(StepTime(start, end, self.engine.stats.tokens_generated - generated))
        while self.recent_steps and self.recent_steps[0].end < end - RATE_WINDOW_S:
            self.recent_steps.popleft()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Reply, RequestOutput]]] = {}
        for out in outputs:
            replies = self.replies
            reply = replies.pop(out.request_id, None) if out.finished else replies.get(out.request_id)
            if out.finished:
                self.finished[out.finish_reason] += 1
            if reply is not None:
                by_loop.setdefault(reply.loop, []).append((reply, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # that event loop has closed: nobody is listening
                pass

    def tokens_per_second(self) -> float:
        """Tokens generated over the steps of the last RATE_WINDOW_S seconds, per second of wall time
        from the first of them to now (0 when idle that long)."""
        now = time.perf_counter()
        steps = [step for step in self.recent_steps if step.end >= now - RATE_WINDOW_S]
        return sum(step.tokens for step in steps) / (now - steps[0].start) if steps else 0.0

    # ------------------------------------------------------------------ callers (the event loop)
    async def call(self, fn: Callable[["EngineLoop"], object]):
        """fn(self), run on the engine thread between two steps."""
        if not self.alive:
            raise self.unavailable()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put(Call(fn, future))
        return await asyncio.wrap_future(future)

    def submit(
        self, prompts: list[list[int]], params: SamplingParams, request_id: str, backlog: int = 256
    ) -> "Submission":
        return Submission(self, prompts, params, request_id, backlog)


class Submission:
    """One HTTP request's engine requests, one per prompt (ids `{request_id}-{i}`), and the outputs
    its reader has yet to take: at most `backlog` steps' worth."""

    def __init__(
        self,
        loop: EngineLoop,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        backlog: int,
    ):
        self.engine_loop, self.prompts, self.params = loop, prompts, params
        self.ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.max_queued = backlog * len(prompts)  # each step sends one output per prompt running
        self.running: set[int] = set()
        self.started = self.closed = False
        self.error: str | None = None  # why it was cut off, for its reader

    async def start(self) -> None:
        """Queue every prompt and wait until the engine has taken them all. A refusal aborts the
        ones taken and raises RequestRefused; a server that takes no request raises RuntimeError
        (ShuttingDown while it drains)."""
        if not self.engine_loop.accepting:
            raise self.engine_loop.unavailable()
        self.started = True
        self.engine_loop.open_requests += len(self.ids)
        loop, arrival = asyncio.get_running_loop(), time.perf_counter()
        for index, (request_id, prompt) in enumerate(zip(self.ids, self.prompts)):
            reply = Reply(loop, self.put, index)
            self.engine_loop.commands.put(Add(request_id, prompt, self.params, arrival, reply))
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

    def put(self, item: tuple) -> None:
        """On the event loop: an answer from the engine thread. One past `max_queued` means the
        reader has stopped reading: cut it off."""
        if self.closed:
            return
        if self.queue.qsize() >= self.max_queued:
            self.error = (
                f"This stream fell {self.max_queued} outputs behind its reader and was aborted; "
                "read a stream as it comes."
            )
            self.close("slow")
            return
        self.queue.put_nowait(item)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) each time one of the requests changes, until all have finished
        or the submission is closed. One that was cut off raises RuntimeError."""
        while self.running and not self.closed:
            index, out = await self.queue.get()
            if out is None and self.closed:
                break
            if isinstance(out, Exception):
                raise out
            if out.finished:
                self.running.discard(index)
            yield index, out
        if self.error is not None:
            raise RuntimeError(self.error)

    def abort(self, index: int, reason: str = "stop") -> None:
        """Stop prompt `index`'s engine request (e.g. all its choices met a stop string)."""
        if index in self.running:
            self.running.discard(index)
            self.engine_loop.commands.put(Abort(self.ids[index], reason))

    def close(self, reason: str = "disconnect") -> None:
        """Abort every request still running; wake a reader waiting in outputs()."""
        for index in list(self.running):
            self.abort(index, reason)
        if not self.closed:
            self.closed = True
            self.queue.put_nowait((-1, None))
            if self.started:
                self.engine_loop.open_requests -= len(self.ids)
