"""`minillm route`: a KV-aware router in front of several `minillm serve` engines (`minillm.route`).

The engines' URLs are checked and the address taken before anything else, so a typo is one line
and no wait. The router loads only the checkpoint's tokenizer (no weights). HTTP runs in a
thread; the main thread waits for it and handles SIGTERM and Ctrl-C (`stop_signals.py`): the
first stops the server in order (answers in flight end, the feeds close), a second at once;
exit status 0 after SIGTERM, 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import textwrap
import urllib.parse

from minillm.cli.flags import positive_float, whole_number
from minillm.cli.serve import listening_socket
from minillm.config import DEFAULT_MODEL_DIR, ConfigError
from minillm.report import err_console
from minillm.route.policy import POLICIES
from minillm.stop_signals import EXIT_STATUS, handling_stop_signals, say, signal_name

ROUTE_DESCRIPTION = textwrap.fill(
    "Route OpenAI requests (POST /v1/completions, /v1/chat/completions) over several `minillm serve` "
    "engines. The router follows each engine's KV events (GET /v1/kv_events) into one index of which "
    "engine caches which prompt blocks, tokenizes each request with the checkpoint's own tokenizer and "
    "chat template, and sends it where Dynamo's cost is lowest: new prefill blocks + blocks already "
    "running there. It falls back to round-robin while an engine's event feed lags, and sends a request "
    "to another engine when its engine fails before answering. GET /health, /v1/models and /metrics "
    "(what went where, predicted against reported cache hits). SIGTERM or Ctrl-C stops it.",
    100,
    break_on_hyphens=False,
)

ROUTE_EXAMPLES = """\
examples:
  minillm serve --port 8001 &  minillm serve --port 8002 &
  minillm route --engine http://127.0.0.1:8001 --engine http://127.0.0.1:8002
  curl http://127.0.0.1:8000/metrics     # requests per engine, fallbacks, predicted vs actual hits
"""


def add_route(subparsers) -> None:
    route = subparsers.add_parser(
        "route",
        help="a KV-aware router in front of several `minillm serve` engines",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=ROUTE_DESCRIPTION,
        epilog=ROUTE_EXAMPLES,
    )
    _add_engine_args(route)
    _add_listen_args(route)
    route.set_defaults(func=cmd_route)


def _add_engine_args(route) -> None:
    """What the router sits in front of, and how it routes to it."""
    route.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's base URL, http://HOST:PORT, as `minillm serve` prints it without /v1; "
        "give one --engine per engine (at least one)",
    )
    route.add_argument(
        "--model",
        default=str(DEFAULT_MODEL_DIR),
        metavar="DIR",
        help="the engines' checkpoint folder (or .gguf file): only its tokenizer and chat template are "
        "loaded, to read each prompt as the engines will (default: %(default)s)",
    )
    route.add_argument(
        "--policy",
        choices=POLICIES,
        default="kv",
        help="kv: lowest Dynamo cost, from the engines' cached blocks and running load; round-robin: "
        "each engine in turn, the baseline to compare with (default: kv)",
    )
    route.add_argument(
        "--api-key",
        default=None,
        help="the engines' API key, sent on the router's own calls to them (KV events, health); "
        "clients' requests are forwarded with their own Authorization header (default: none)",
    )
    route.add_argument(
        "--read-timeout",
        type=positive_float,
        default=300.0,
        metavar="SECONDS",
        help="the longest wait for the next piece of an engine's answer (a request that does not "
        "stream comes whole at its end) before the request fails (default: 300)",
    )


def _add_listen_args(route) -> None:
    """Where the router answers clients, and what it logs."""
    route.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    route.add_argument(
        "--port", type=whole_number(0, "a port number", 65535), default=8000, help="(default: 8000)"
    )
    route.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="info",
        help="uvicorn's log level; info logs every request (default: info)",
    )


def engine_urls(given: list[str]) -> list[str]:
    """The --engine URLs checked, each as its base (no trailing slash); a bad one is one line."""
    if not given:
        raise ConfigError("minillm route needs engines: give --engine http://HOST:PORT once per engine.")
    urls = []
    for text in given:
        if not _is_base_url(text):
            raise ConfigError(f"--engine {text!r} is not an engine's base URL; give http://HOST:PORT.")
        url = text.rstrip("/")
        if url in urls:
            raise ConfigError(f"--engine {url} is given twice; give each engine once.")
        urls.append(url)
    return urls


def _is_base_url(text: str) -> bool:
    parts = urllib.parse.urlsplit(text)
    try:
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.path in ("", "/")


class StopRouter:
    """SIGTERM and Ctrl-C: the first stops the server in order, the second at once."""

    def __init__(self):
        self.signum: int | None = None
        self.server = None

    def serving(self, server) -> None:
        self.server = server

    def __call__(self, signum: int, frame) -> None:
        if self.server is None:
            raise SystemExit(EXIT_STATUS[signum])
        if self.signum is None:
            self.signum = signum
            say(f"minillm route: {signal_name(signum)}: stopping (signal again to stop now)")
            self.server.should_exit = True
        else:
            self.server.force_exit = True

    @property
    def exit_status(self) -> int:
        return 0 if self.signum is None else EXIT_STATUS[self.signum]


def cmd_route(args) -> int:
    stop = StopRouter()
    with handling_stop_signals(stop):
        return _route(args, stop)


def _route(args, stop: StopRouter) -> int:
    import threading
    from pathlib import Path

    from minillm.serve import missing_server_packages

    problem = missing_server_packages()
    if problem:
        raise ConfigError(problem)
    import uvicorn

    from minillm.route.app import Router, build_app
    from minillm.serve.connections import uvicorn_config
    from minillm.serve.limits import ServeLimits
    from minillm.tokenizer import Tokenizer

    engines = engine_urls(args.engine)
    sock = listening_socket(args.host, args.port)
    tokenizer = Tokenizer(Path(args.model))
    router = Router(engines, tokenizer, args.policy, args.api_key, args.read_timeout)
    server = uvicorn.Server(uvicorn_config(build_app(router), ServeLimits(), log_level=args.log_level))
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="minillm-route", daemon=True)
    host, port = sock.getsockname()[:2]
    err_console.print(
        f"minillm route: http://{host}:{port}/v1 over {len(engines)} engines ({args.policy}); "
        "Ctrl-C or SIGTERM stops",
        soft_wrap=True,
    )
    stop.serving(server)
    http.start()
    while http.is_alive():
        http.join(timeout=0.5)  # the main thread stays free for the signal handler
    return stop.exit_status
