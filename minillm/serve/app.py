"""The HTTP face of the engine: a FastAPI app with vLLM's OpenAI-compatible routes.

    POST /v1/completions        prompt -> text; "stream": true sends server-sent events
    POST /v1/chat/completions   messages -> the assistant's reply (the checkpoint's chat template)
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs and takes requests (503 once it drains)
    GET  /metrics               Prometheus text: KV blocks per state, KV usage, prefix-cache hit
                                rate, requests running and waiting, tokens/s, counters
    GET  /v1/kv_events          the KV cache's events as server-sent events (`kv_events.py`), for
                                a KV-aware router or a dashboard; open like /metrics, or keyed
    GET  /memory                the memory system drawn live in a browser (`memory_page.py`); its
                                data open like /metrics, or keyed
    POST /tokenize, /detokenize the server's tokenizer (`tokenize.py`, vLLM's routes), keyed like
    GET  /tokenizer_info        /v1/*: what an evaluation harness tokenizes its prompts with

Every route runs on the event loop; the engine runs on one thread (`engine_loop.py`). A
request is checked before anything reaches the engine, each refusal in OpenAI's error body:
    403  a Host the server does not answer to (DNS rebinding) or an Origin it does not allow
         (another site's page), before any route (`origins.py`; --allowed-hosts, --allowed-origins)
    401  /v1/* without the server's key, when it has one (`--api-key`, vLLM's: Authorization: Bearer)
    415  a body that is not Content-Type: application/json: a web page may post text/plain to any
         server without asking (no CORS preflight), but not JSON, so a page the user visits cannot
         drive a local server
    413  a body past max_body_kb (drained first, so the client reads it);  408  a body not sent
         within read_timeout (these three: `body.py`)
    400  a body `protocol.py` refuses: malformed, too long, a value out of range (never a 500);
         it is parsed and tokenized in a worker thread, so a long prompt stalls no stream
    404  another model's name
    429  more requests waiting than max_waiting_requests, with Retry-After
and once it waits: with --ttft-target and --refuse-late, a request that can no longer meet the
target is refused, a 503 with Retry-After (a stream already begun gets the error event instead).
A server told to stop (`EngineLoop.drain`: SIGTERM or Ctrl-C under `minillm serve`) answers every
new request with a 503, lets those in flight finish until its deadline, and ends the rest with a
503: a body, or a stream's error event and then [DONE].
The limits are `ServeLimits`' (`limits.py`). A checked request is answered by `answer.py` (one
body, or a stream), in `responses.py`'s shapes; /metrics' are `metrics.py`'s. /metrics can be
keyed or turned off (its prefix-cache counters tell a client whether a prompt's blocks were
already cached: on a shared server, whether someone sent it). A client that goes away, while its
request waits or streams, aborts it: its blocks are free before the next step.
"""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.config import ConfigError
from minillm.serve.answer import Answer, EventStream
from minillm.serve.body import read_body
from minillm.serve.commands import RequestRefused
from minillm.serve.endpoints import parse_chat, parse_completion
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.errors import APIError, error_body, parse_json, shown
from minillm.serve.kv_events import FORMATS, event_stream
from minillm.serve.limits import ServeLimits
from minillm.serve.memory_page import add_live_routes
from minillm.serve.metrics import metric_values, prometheus
from minillm.serve.origins import Allowed, HostOriginCheck
from minillm.serve.protocol import Job
from minillm.serve.tokenize import detokenize, tokenize, tokenizer_info

METRICS_ACCESS = ("open", "keyed", "off")  # /metrics for anyone, for the API key's holders, or not at all


def build_app(
    engine_loop: EngineLoop,
    model_name: str,
    start_engine: bool = True,
    limits: ServeLimits = ServeLimits(),
    api_key: str | None = None,
    metrics: str = "open",
    allowed: Allowed = Allowed(),
) -> FastAPI:
    """The app over an EngineLoop. Its lifespan starts the engine in a thread of its own (unless
    `start_engine` is False: the caller runs `engine_loop.run()` itself) and stops it at shutdown.
    With `api_key`, /v1/* (and /metrics if `metrics` is "keyed") need it. Every route answers
    only the Hosts and Origins `allowed` names (by default a local server's)."""
    check_access(api_key, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_engine:
            engine_loop.start()
        yield
        engine_loop.stop()

    app = FastAPI(
        title="minillm", description="An OpenAI-compatible server on the minillm engine.", lifespan=lifespan
    )
    app.add_middleware(HostOriginCheck, allowed=allowed)
    keyed = [Depends(api_key_check(api_key))] if api_key else []
    _add_error_handlers(app)
    _add_completion_routes(app, engine_loop, model_name, limits, keyed)
    _add_tokenizer_routes(app, engine_loop, model_name, limits, keyed)
    _add_status_routes(app, engine_loop, model_name, keyed, {"open": [], "keyed": keyed}.get(metrics))
    return app


def check_access(api_key: str | None, metrics: str) -> None:
    if metrics not in METRICS_ACCESS:
        raise ConfigError(f"metrics must be one of {', '.join(METRICS_ACCESS)}, not {metrics!r}.")
    if api_key is not None and (not api_key.strip() or not api_key.isprintable()):
        # `--api-key "$KEY"` with KEY unset would otherwise serve everyone without a key
        raise ConfigError("--api-key is empty, blank or holds control characters; give the key itself.")
    if metrics == "keyed" and not api_key:
        raise ConfigError("--metrics keyed needs the key: give --api-key too.")


def api_key_check(api_key: str):
    """A dependency that refuses, with a 401, a request without `Authorization: Bearer <api_key>`."""
    expected = f"Bearer {api_key}".encode()

    def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # in constant time: no guessing it byte by byte
            raise APIError(401, "This server needs its API key: send the header Authorization: Bearer KEY.")

    return check


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's, in OpenAI's error body."""

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):  # unknown route (404), wrong method (405)
        return JSONResponse(error_body(err.status_code, str(err.detail)), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, err: RequestValidationError):
        return JSONResponse(error_body(400, str(err)), status_code=400)

    @app.exception_handler(Exception)
    async def bug(_, err: Exception):  # a bug in minillm, not the client's fault: still OpenAI's body
        message = f"minillm failed ({type(err).__name__}); the server's log has the traceback."
        return JSONResponse(error_body(500, message), status_code=500)


def _add_completion_routes(
    app: FastAPI, engine_loop: EngineLoop, model_name: str, limits: ServeLimits, keyed: list
) -> None:
    """POST /v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: Request):
        return await _answer(request, parse_completion, engine_loop, model_name, limits)

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(request: Request):
        return await _answer(request, parse_chat, engine_loop, model_name, limits)


def _add_tokenizer_routes(
    app: FastAPI, engine_loop: EngineLoop, model_name: str, limits: ServeLimits, keyed: list
) -> None:
    """POST /tokenize and /detokenize, parsed in a worker thread like a completion; GET /tokenizer_info."""
    engine = engine_loop.engine

    @app.post("/tokenize", dependencies=keyed)
    async def tokenize_route(request: Request):
        raw = await read_body(request, limits)
        args = (engine.tokenizer, model_name, engine.context_len, limits)
        return await asyncio.to_thread(lambda: tokenize(parse_json(raw), *args))

    @app.post("/detokenize", dependencies=keyed)
    async def detokenize_route(request: Request):
        raw = await read_body(request, limits)
        return await asyncio.to_thread(
            lambda: detokenize(parse_json(raw), engine.tokenizer, model_name, limits)
        )

    @app.get("/tokenizer_info", dependencies=keyed)
    async def tokenizer_info_route():
        return tokenizer_info(engine.tokenizer, engine.context_len)


def _add_status_routes(
    app: FastAPI, engine_loop: EngineLoop, model_name: str, keyed: list, metrics_keyed: list | None
) -> None:
    """GET /v1/models, /health, /metrics and /v1/kv_events (the last two not there when
    `metrics_keyed` is None: turned off)."""
    engine = engine_loop.engine

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(engine_loop.started_at),
                    "owned_by": "minillm",
                    "root": str(engine.config.model_dir),
                    "parent": None,
                    "max_model_len": engine.context_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        if not engine_loop.accepting:  # a load balancer stops sending here as soon as a drain begins
            return _unavailable(engine_loop)
        return Response(status_code=200)

    async def metrics():
        if not engine_loop.alive:
            return _unavailable(engine_loop)
        return PlainTextResponse(
            prometheus(await engine_loop.call(metric_values)), media_type="text/plain; version=0.0.4"
        )

    async def kv_events(events: str = "vllm"):
        if events not in FORMATS:
            raise APIError(400, f"events must be one of {', '.join(FORMATS)}, not {shown(events)}.", "events")
        if not engine_loop.alive:
            return _unavailable(engine_loop)
        return StreamingResponse(await event_stream(engine_loop, events), media_type="text/event-stream")

    if metrics_keyed is not None:  # what is cached says what others asked: the same access as /metrics
        app.get("/metrics", dependencies=metrics_keyed)(metrics)
        app.get("/v1/kv_events", dependencies=metrics_keyed)(kv_events)
        add_live_routes(app, engine_loop, model_name, metrics_keyed)


def _unavailable(engine_loop: EngineLoop) -> JSONResponse:
    return JSONResponse(error_body(503, str(engine_loop.unavailable())), 503)


def _job_of(parse, raw: bytes, engine, model_name: str, limits: ServeLimits) -> Job:
    """The request body checked (`protocol.py`) into a Job; another model's name is a 404."""
    body = parse_json(raw)
    model = body.get("model", model_name)
    if model != model_name:
        raise APIError(
            404, f"The model {shown(model)} does not exist; this server serves `{model_name}`.", "model"
        )
    vocab_size = engine.model.config.vocab_size
    return parse(body, engine.tokenizer, model_name, engine.context_len, vocab_size, limits)


def check_room(engine_loop: EngineLoop, job: Job, limits: ServeLimits) -> None:
    """A 429 when the job's requests would wait beyond max_waiting_requests (counted on the event
    loop, so two requests cannot both take the last place)."""
    room = engine_loop.engine.config.max_num_seqs + limits.max_waiting_requests
    if engine_loop.open_requests + len(job.prompts) > room:
        raise APIError(
            429,
            f"The server is busy: {engine_loop.open_requests} requests are running or waiting, and "
            f"it queues at most {room}; retry later.",
            headers={"Retry-After": "1"},
        )


async def _answer(request: Request, parse, engine_loop: EngineLoop, model_name: str, limits: ServeLimits):
    """Run one request on the engine: a stream of events, or one body at the end."""
    engine = engine_loop.engine
    raw = await read_body(request, limits)
    job = await asyncio.to_thread(_job_of, parse, raw, engine, model_name, limits)
    check_room(engine_loop, job, limits)
    submission = engine_loop.submit(job.prompts, job.params, job.id, limits.max_stream_backlog)
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
