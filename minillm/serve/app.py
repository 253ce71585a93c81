"""The HTTP face of the engine: a FastAPI app with vLLM's OpenAI-compatible routes.

    POST /v1/completions        prompt -> text; "stream": true sends server-sent events
    POST /v1/chat/completions   messages -> the assistant's reply (the checkpoint's chat template)
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs
    GET  /metrics               Prometheus text: KV blocks per state, KV usage, prefix-cache hit
                                rate, requests running and waiting, tokens/s, counters

Every route runs on the event loop; the engine runs in a thread of its own (`engine_loop.py`). A
request's body is checked first (`protocol.py`): a malformed or too long one gets a 400 with
OpenAI's error body, an unknown model a 404, and nothing reaches the engine. A client that goes
away, while its request waits or streams, aborts it: its blocks are free before the next step.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.serve.engine_loop import EngineLoop, RequestRefused, Submission
from minillm.serve.protocol import (DONE, APIError, ChoiceText, Job, chunk, delta_choice, error_body, parse_chat,
                                    parse_completion, parse_json, response_body, sse, usage)


def build_app(engine_loop: EngineLoop, model_name: str, start_engine: bool = True) -> FastAPI:
    """The app over an EngineLoop. Its lifespan starts the engine in a thread of its own (unless
    `start_engine` is False: the caller runs `engine_loop.run()` itself) and stops it at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_engine:
            engine_loop.start()
        yield
        engine_loop.stop()

    app = FastAPI(title="minillm", description="An OpenAI-compatible server on the minillm engine.",
                  lifespan=lifespan)
    engine = engine_loop.engine
    vocab_size = engine.model.config.vocab_size

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):  # unknown route (404), wrong method (405)
        return JSONResponse(error_body(err.status_code, str(err.detail)), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, err: RequestValidationError):
        return JSONResponse(error_body(400, str(err)), status_code=400)

    def job_of(parse, raw: bytes) -> Job:
        body = parse_json(raw)
        model = body.get("model", model_name)
        if model != model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{model_name}`.", "model")
        return parse(body, engine.tokenizer, model_name, engine.context_len, vocab_size)

    async def answer(request: Request, parse):
        job = job_of(parse, await request.body())
        submission = engine_loop.submit(job.prompts, job.params, job.id)
        try:
            await submission.start()
        except RequestRefused as err:
            raise APIError(400, str(err)) from None
        except RuntimeError as err:
            raise APIError(503, str(err)) from None
        answer = Answer(job, submission, engine)
        if job.stream:
            return EventStream(answer.events(request), submission)
        return await answer.whole(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, parse_chat)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(engine_loop.started_at), "owned_by": "minillm",
            "root": str(engine.config.model_dir), "parent": None, "max_model_len": engine.context_len}]}

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            return JSONResponse(error_body(503, engine_loop.error or "The engine loop is not running."), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        if not engine_loop.alive:
            return JSONResponse(error_body(503, engine_loop.error or "The engine loop is not running."), 503)
        return PlainTextResponse(prometheus(await engine_loop.call(snapshot)),
                                 media_type="text/plain; version=0.0.4")

    return app


class EventStream(StreamingResponse):
    """Server-sent events; however the response ends (finished, client gone before the first
    chunk, cancelled), what still runs of its request is aborted."""

    def __init__(self, events, submission: Submission):
        super().__init__(events, media_type="text/event-stream")
        self.submission = submission

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.close()


class Answer:
    """One request's choices (n per prompt, in prompt order) filled in as outputs arrive."""

    def __init__(self, job: Job, submission: Submission, engine):
        self.job, self.submission = job, submission
        n, context = job.params.n, engine.context_len
        self.choices = [ChoiceText(engine.tokenizer, job.stop, engine.eos_token_id,
                                   min(job.params.max_tokens, context - len(prompt)), job.params.ignore_eos)
                        for prompt in job.prompts for _ in range(n)]

    def update(self, index: int, out) -> list[tuple[int, str, bool]]:
        """Feed prompt `index`'s output to its choices; (choice, new text, just finished) for each
        that has something to send. Once all its choices have stopped, the engine request is aborted."""
        n, changed = self.job.params.n, []
        if out.finish_reason == "error":
            raise RuntimeError(out.error)
        for j in range(n):
            choice = self.choices[index * n + j]
            if choice.done:
                continue
            tokens = out.samples[j] if j < len(out.samples) else []
            text = choice.update(tokens, out.finish_reason if out.finished else None)
            if text or choice.done:
                changed.append((index * n + j, text, choice.done))
        if not out.finished and all(c.done for c in self.choices[index * n:(index + 1) * n]):
            self.submission.abort(index, "stop")
        return changed

    def usage(self) -> dict:
        return usage(sum(map(len, self.job.prompts)), sum(c.num_tokens for c in self.choices))

    async def whole(self, request: Request):
        """Run to the end, then answer in one body; a client that leaves first aborts the request."""
        watcher = asyncio.create_task(watch_disconnect(request, self.submission))
        try:
            async for index, out in self.submission.outputs():
                self.update(index, out)
        except RuntimeError as err:
            return JSONResponse(error_body(500, str(err)), status_code=500)
        finally:
            watcher.cancel()
            self.submission.close("stop")
        if any(not c.done for c in self.choices):  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(response_body(self.job, self.choices, self.usage()))

    async def events(self, request: Request):
        """The stream: one chunk per choice that changed, [DONE] last. An engine failure after the
        stream has begun arrives as an error event (vLLM's way), then [DONE]."""
        job, watcher = self.job, asyncio.create_task(watch_disconnect(request, self.submission))
        try:
            if job.kind == "chat":
                for i in range(len(self.choices)):
                    yield chunk(job, [delta_choice(job, i, "", first=True)])
            async for index, out in self.submission.outputs():
                for i, text, finished in self.update(index, out):
                    yield chunk(job, [delta_choice(job, i, text, self.choices[i] if finished else None)])
            if job.include_usage:
                yield chunk(job, [], self.usage())
            yield DONE
        except RuntimeError as err:
            yield sse(error_body(500, str(err)))
            yield DONE
        finally:
            watcher.cancel()
            self.submission.close()


async def watch_disconnect(request: Request, submission: Submission) -> None:
    """Wait for the client to go away, then abort whatever of its request still runs."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            submission.close()
            return


# ----------------------------------------------------------------------------- /metrics

def snapshot(engine_loop: EngineLoop) -> dict:
    """What /metrics shows, read on the engine thread between two steps."""
    engine = engine_loop.engine
    manager, scheduler = engine.block_manager, engine.scheduler
    states = Counter(manager.block_state(block) for block in range(manager.num_blocks))
    memory = engine.memory_stats()
    cache = manager.prefix_cache
    finished = Counter()
    for reason, count in engine_loop.finished.items():
        finished[{"eos": "stop"}.get(reason, reason)] += count
    return {
        "num_requests_running": len({seq.request_id for seq in scheduler.running}),
        "num_requests_waiting": len({seq.request_id for seq in scheduler.waiting}),
        "kv_blocks_total": manager.num_blocks,
        "kv_blocks": {state: states.get(state, 0) for state in ("free", "cached", "private", "shared")},
        "kv_cache_usage_perc": (manager.num_blocks - manager.num_free_blocks) / manager.num_blocks,
        "kv_utilization": memory.utilization,
        "kv_bytes_per_token": memory.bytes_per_slot,
        "kv_block_size": manager.block_size,
        "host_blocks_total": manager.num_host_blocks,
        "host_blocks_used": manager.blocks_in_use("host"),
        "disk_blocks_used": manager.blocks_in_use("disk"),
        "prefix_cache_queries_total": cache.queried_blocks * cache.block_size if cache else 0,
        "prefix_cache_hits_total": cache.hit_blocks * cache.block_size if cache else 0,
        "prefix_cache_hit_rate": cache.hit_rate if cache else 0.0,
        "prompt_tokens_total": engine_loop.prompt_tokens,
        "generation_tokens_total": engine.stats.tokens_generated,
        "generation_tokens_per_second": engine_loop.tokens_per_second(),
        "num_preemptions_total": engine.num_preemptions,
        "request_success_total": dict(finished),
        "requests_aborted_total": engine_loop.aborted,
        "engine_steps_total": engine.stats.steps,
    }


METRIC_HELP = {
    "num_requests_running": ("gauge", "Requests with sequences in the running batch."),
    "num_requests_waiting": ("gauge", "Requests waiting to be scheduled (the queue)."),
    "kv_blocks_total": ("gauge", "KV blocks in the device pool."),
    "kv_blocks": ("gauge", "Device KV blocks by state: free, cached (free, findable by prefix), private, shared."),
    "kv_cache_usage_perc": ("gauge", "Fraction of device KV blocks held by sequences (1 = full)."),
    "kv_utilization": ("gauge", "Live token slots / slots in held blocks (the rest is the last blocks' tails)."),
    "kv_bytes_per_token": ("gauge", "Bytes of KV per token slot, all layers, K and V, scales included."),
    "kv_block_size": ("gauge", "Token slots per KV block."),
    "host_blocks_total": ("gauge", "Blocks in the host tier (0: no host tier)."),
    "host_blocks_used": ("gauge", "Host-tier blocks in use (swapped-out sequences, spilled prefixes)."),
    "disk_blocks_used": ("gauge", "Disk-tier blocks in use."),
    "prefix_cache_queries_total": ("counter", "Prompt tokens in full blocks looked up in the prefix cache."),
    "prefix_cache_hits_total": ("counter", "Of those, tokens found (not computed again)."),
    "prefix_cache_hit_rate": ("gauge", "prefix_cache_hits_total / prefix_cache_queries_total."),
    "prompt_tokens_total": ("counter", "Prompt tokens of the requests accepted."),
    "generation_tokens_total": ("counter", "Tokens generated."),
    "generation_tokens_per_second": ("gauge", "Tokens generated per second over the last 10 s."),
    "num_preemptions_total": ("counter", "Sequences preempted when KV blocks ran out."),
    "request_success_total": ("counter", "Requests finished, by finish reason."),
    "requests_aborted_total": ("counter", "Requests aborted because their client disconnected."),
    "engine_steps_total": ("counter", "Engine steps (one batched forward pass each)."),
}
LABELS = {"kv_blocks": "state", "request_success_total": "finished_reason"}


def prometheus(values: dict) -> str:
    """The snapshot in Prometheus' text format, every name prefixed `minillm:` (vLLM's are `vllm:`)."""
    lines = []
    for name, value in values.items():
        kind, help_text = METRIC_HELP[name]
        lines += [f"# HELP minillm:{name} {help_text}", f"# TYPE minillm:{name} {kind}"]
        if isinstance(value, dict):
            lines += [f'minillm:{name}{{{LABELS[name]}="{label}"}} {number}' for label, number in value.items()]
        else:
            lines.append(f"minillm:{name} {float(value) if isinstance(value, float) else value}")
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict:
    """The other way, for tests and the benchmark: {"kv_blocks": {"free": 12, ...}, "kv_blocks_total": 16, ...}."""
    values: dict = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, number = line.rsplit(" ", 1)
        key = key.removeprefix("minillm:")
        value = float(number) if any(c in number for c in ".en") else int(number)
        if "{" in key:
            name, label = key[:-1].split("{", 1)
            values.setdefault(name, {})[label.split("=", 1)[1].strip('"')] = value
        else:
            values[key] = value
    return values

