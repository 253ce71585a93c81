"""The router's HTTP face: the OpenAI routes of an engine, each request sent to one of several.

    POST /v1/completions, /v1/chat/completions   tokenized here, sent where the policy says,
                                                 answered as the engine answers (a stream as it comes)
    GET  /v1/models                              a live engine's
    GET  /health                                 200 while at least one engine is live, else 503
    GET  /metrics                                the router's counters (`metrics.py`)

Every answer carries `x-minillm-engine: URL`, the engine that gave it. A request whose engine
fails before any byte of the answer went out is sent to another live engine (each engine at most
once), and the failed one is probed until it answers again (`engines.py`); one that fails midway
ends with an error event and [DONE] (`forward.py`). With no engine left, a 503 in OpenAI's body.
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import asynccontextmanager

import httpx2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from minillm.route.engines import EnginePool
from minillm.route.feeds import LAG_S, Feed
from minillm.route.forward import EngineFailed, Opened, open_answer, relay
from minillm.route.index import BlockIndex
from minillm.route.metrics import RouterMetrics
from minillm.route.policy import ActiveBlocks, Choice, cacheable, make_policy
from minillm.route.prompts import prompt_ids
from minillm.serve.errors import error_body
from minillm.tokenizer import Tokenizer

MAX_BODY_BYTES = 64 << 20  # the engines refuse far less (--max-body-kb); this only bounds the router's memory
READ_TIMEOUT_S = 300.0  # between two pieces of an answer (a body that does not stream comes whole at its end)
FORWARDED_HEADERS = ("authorization", "content-type")


class Router:
    """The engines, the index their feeds keep, the policy over them, and what was routed where."""

    def __init__(
        self,
        engines: list[str],
        tokenizer: Tokenizer,
        policy: str = "kv",
        api_key: str | None = None,
        read_timeout: float = READ_TIMEOUT_S,
        lag_s: float = LAG_S,
    ):
        self.engines, self.tokenizer, self.read_timeout = list(engines), tokenizer, read_timeout
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}  # the router's own calls
        self.index, self.active, self.metrics = BlockIndex(), ActiveBlocks(), RouterMetrics()
        self.policy = make_policy(policy, engines, self.index, self.active)
        self.client = httpx2.AsyncClient(timeout=httpx2.Timeout(read_timeout, connect=2.0))
        self.pool = EnginePool(engines, self.index, self.client, self.headers)
        self.feeds = {
            url: Feed(
                url, self.index, self.client, self.headers, lag_s, lambda url=url: self.pool.mark_dead(url)
            )
            for url in engines
        }

    async def start(self) -> None:
        for feed in self.feeds.values():
            feed.start()

    async def stop(self) -> None:
        for feed in self.feeds.values():
            await feed.stop()
        await self.pool.stop()
        await self.client.aclose()

    def lagging(self) -> set[str]:
        return {url for url, feed in self.feeds.items() if feed.lagging}

    async def answer(self, request: Request, path: str, chat: bool) -> Response:
        """Send the request where the policy says; on a failure before the answer began, elsewhere."""
        raw = await _read_body(request)
        if raw is None:
            return _error(
                413, f"This body is over {MAX_BODY_BYTES >> 20} MiB; the router does not forward it."
            )
        ids = await asyncio.to_thread(prompt_ids, raw, chat, self.tokenizer)  # a long prompt stalls no stream
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        tried: list[str] = []
        while candidates := [url for url in self.pool.live if url not in tried]:
            lagging = bool(self.lagging() & set(self.pool.live))
            choice = self.policy.choose(candidates, ids, lagging)
            if choice.reason == "fallback":
                self.metrics.fell_back()
            if tried:
                self.metrics.retried()
            tried.append(choice.engine)
            response = await self._send(choice, ids, raw, path, headers)
            if response is not None:
                return response
        self.metrics.failed_one()
        return _error(503, f"No engine could answer (tried {', '.join(tried) or 'none: none is live'}).")

    async def _send(self, choice: Choice, ids, raw: bytes, path: str, headers: dict) -> Response | None:
        """The engine's answer, or None if it failed before answering (it is then marked dead)."""
        engine, blocks = choice.engine, self._blocks(ids)
        self.metrics.sent(engine)
        self.active.start(engine, blocks)
        sent_at, expects_events = time.monotonic(), self._new_blocks(engine, ids) > 0
        try:
            opened = await open_answer(self.client, engine + path, raw, headers, self.read_timeout)
        except EngineFailed:
            self.active.finish(engine, blocks)
            self.pool.mark_dead(engine)
            return None

        def finished(complete: bool) -> None:
            self.active.finish(engine, blocks)
            if expects_events:
                self.feeds[engine].request_finished(sent_at)
            if not complete:
                self.metrics.failed_one()
            self._count_hits(choice, opened)

        headers_out = {**opened.headers, "x-minillm-engine": engine}
        if opened.response is None:
            finished(True)
            return Response(opened.first, opened.status, headers_out)
        media_type = headers_out.pop("content-type")
        return StreamingResponse(relay(opened, finished), opened.status, headers_out, media_type)

    def _blocks(self, ids: list[int] | None) -> int:
        """A request's prompt blocks, as the active load counts them."""
        size = self.index.block_size
        return math.ceil(len(ids) / size) if ids is not None and size else 0

    def _new_blocks(self, engine: str, ids: list[int] | None) -> int:
        """Full blocks the engine will compute and store for this prompt (so a KV event should follow)."""
        size = self.index.block_size
        if ids is None or not size:
            return 0
        return len(cacheable(ids)) // size - self.index.overlap(cacheable(ids)).get(engine, 0)

    def _count_hits(self, choice: Choice, opened: Opened) -> None:
        cached, size = opened.usage.cached_tokens, self.index.block_size
        if choice.reason == "kv" and cached is not None and size:
            self.metrics.hit(choice.engine, choice.predicted_hit_blocks, cached // size)

    async def models(self, request: Request) -> Response:
        headers = {name: request.headers[name] for name in ("authorization",) if name in request.headers}
        for engine in self.pool.live:
            try:
                response = await self.client.get(f"{engine}/v1/models", headers=headers, timeout=5.0)
            except httpx2.HTTPError:
                self.pool.mark_dead(engine)
                continue
            return Response(
                response.content,
                response.status_code,
                {"content-type": response.headers.get("content-type", "application/json")},
            )
        return _error(503, "No engine is live.")

    def metrics_text(self) -> str:
        return self.metrics.text(self.engines, set(self.pool.live), self.lagging())


def build_app(router: Router) -> FastAPI:
    """The app over a Router; its lifespan starts the feeds and stops everything at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(
        title="minillm route", description="A KV-aware router over minillm engines.", lifespan=lifespan
    )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.answer(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.answer(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        return await router.models(request)

    @app.get("/health")
    async def health():
        return Response(status_code=200) if router.pool.live else _error(503, "No engine is live.")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(router.metrics_text(), media_type="text/plain; version=0.0.4")

    return app


async def _read_body(request: Request) -> bytes | None:
    """The body, or None once it passes MAX_BODY_BYTES."""
    raw = b""
    async for piece in request.stream():
        raw += piece
        if len(raw) > MAX_BODY_BYTES:
            return None
    return raw


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)
