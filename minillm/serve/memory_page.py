"""/memory: the memory system drawn in a browser, live from the engine or replayed from a trace.

    GET /memory                 the page (`minillm/view/static/`), under a strict Content-Security-Policy
    GET /memory/static/NAME     its script and style sheet
    GET /memory/info            live or replay, whether the data needs the API key (never needs it)
    GET /memory/stream          live: frames as server-sent events, at most FRAMES_PER_S a second
    GET /memory/replay          replay: the run's frame count, steps, times and counters
    GET /memory/frames/N        replay: frame N
    GET /                       a redirect to /memory

The live stream follows the engine's KV events as `/v1/kv_events` does (`kv_events.py`: the engine
thread only hands each step's events over) and turns them into frames on the event loop
(`view/frames.py`). Frames are coalesced: however many steps ran since the last one, the page gets
the state now, at most FRAMES_PER_S times a second, so a browser never slows the engine.

Safe by default: the page answers only the Hosts and Origins the server does (`origins.py`); no
route here changes anything; the page loads no inline script or style and nothing from another
origin (its CSP says so), so even a request id crafted as HTML stays text. The data routes take the
same access as /metrics (open, keyed or off: with `--api-key` the page asks for the key and sends
it as a header on a fetch, never in a URL).
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

import minillm.view
from minillm.serve.errors import error_body
from minillm.serve.kv_events import KEEPALIVE_S, FellBehind, sse, subscribed_feed
from minillm.serve.origins import Allowed, HostOriginCheck
from minillm.view import Replay, TooLargeToDraw, ViewState

FRAMES_PER_S = 4  # the live stream's most; each frame is the state at the time it is sent
STATIC = Path(minillm.view.__file__).parent / "static"
ASSETS = {"memory.js": "text/javascript", "memory.css": "text/css"}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
DATA_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}
PAGE_HEADERS = {**DATA_HEADERS, "Content-Security-Policy": CSP, "Referrer-Policy": "no-referrer"}


def add_page_routes(app: FastAPI, info: dict) -> None:
    """The page, its two files, what it asks first (`info`: mode, needs_key, model, title) and /."""

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse("/memory")

    @app.get("/memory", include_in_schema=False)
    async def page():
        html = (STATIC / "memory.html").read_bytes()
        return Response(html, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/memory/static/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in ASSETS:
            return _error(404, "The memory page has no such file.")
        return Response((STATIC / name).read_bytes(), media_type=ASSETS[name], headers=PAGE_HEADERS)

    @app.get("/memory/info")
    async def memory_info():
        return info


def add_live_routes(app: FastAPI, engine_loop, model_name: str, keyed: list) -> None:
    """The page over a running engine: `keyed` (the dependencies /metrics takes) guard the stream."""
    shown = "" if keyed else model_name  # asked before the key: a keyed server names no model
    info = {
        "mode": "live",
        "needs_key": bool(keyed),
        "model": shown,
        "title": f"minillm · {shown or 'memory'}",
    }
    add_page_routes(app, info)

    @app.get("/memory/stream", dependencies=keyed)
    async def stream(request: Request):
        if not engine_loop.alive:
            return _error(503, str(engine_loop.unavailable()))
        feed = await subscribed_feed(engine_loop)
        frames = _frames(feed, lambda: engine_loop.alive, request.is_disconnected)
        return StreamingResponse(frames, media_type="text/event-stream", headers=DATA_HEADERS)


async def _frames(feed, alive, gone):
    """Frames as server-sent events: the events of every step applied as they come, the state sent
    when something changed and 1/FRAMES_PER_S has passed since the last frame; a comment line when
    idle for KEEPALIVE_S. Ends when the engine stops or, asked at each quiet tick, the page has
    gone (`await gone()`): an idle stream writes nothing that would tell."""
    view, started = ViewState(), None  # t counts from the end of the first step this page saw
    last_sent = quiet_since = ended = time.time()
    changed = False
    try:
        async for batch in feed.batches(alive, tick_s=1 / FRAMES_PER_S):
            now = time.time()
            if batch is None and await gone():
                return
            if batch is not None:
                step, ended, events = batch
                started = ended if started is None else started
                for event in events:
                    view.apply(step, ended - started, event)
                changed = True
            if changed and now - last_sent >= 1 / FRAMES_PER_S:
                yield sse({**view.frame(), "ts": ended})  # ts: when the step drawn ended (the page's lag)
                last_sent = quiet_since = now
                changed = False
            elif now - quiet_since >= KEEPALIVE_S:
                yield ": idle\n\n"
                quiet_since = now
    except (FellBehind, TooLargeToDraw) as err:  # the page shows the message
        yield sse({"error": str(err)})
    finally:
        feed.unsubscribe()


def build_replay_app(replay: Replay, title: str, allowed: Allowed = Allowed()) -> FastAPI:
    """A small app that serves the page over a recorded run (`minillm trace serve`)."""
    app = FastAPI(title="minillm trace", openapi_url=None)
    app.add_middleware(HostOriginCheck, allowed=allowed)
    add_page_routes(app, {"mode": "replay", "needs_key": False, "model": "", "title": title})
    summary = replay.summary()

    @app.get("/memory/replay")
    async def replay_summary():
        return JSONResponse(summary, headers=DATA_HEADERS)

    @app.get("/memory/frames/{index}")
    async def frame(index: str):
        try:
            return Response(replay.frame(int(index)), media_type="application/json", headers=DATA_HEADERS)
        except (IndexError, ValueError):
            return _error(404, f"This run has frames 0 to {len(replay) - 1}, not {index[:20]!r}.")

    return app


def _error(status: int, message: str) -> JSONResponse:
    """OpenAI's error body: the replay app has no handlers of its own for raised errors."""
    return JSONResponse(error_body(status, message), status_code=status)
