"""`minillm serve`: the engine behind an OpenAI-compatible HTTP server (`minillm.serve`).

The address is taken before the weights load, so a port in use is one line and no wait. HTTP then
runs in a thread and the engine loop in the main thread, the one that loaded the model. The
limits one client may ask for are flags made from `ServeLimits`' table (`serve/limits.py`).

SIGTERM and Ctrl-C stop it in order, whatever the process inherited (`GracefulStop`): no new
request is taken (503), those in flight get --shutdown-timeout seconds to finish, the rest end
with the shutdown error (a stream's error event, then [DONE]), the socket closes and the process
exits, 130 after Ctrl-C and 0 after SIGTERM (`stop_signals.py` says why). A second signal stops
at once.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from minillm.cli.flags import (
    add_engine_args,
    add_eviction_args,
    add_kv_quantization_args,
    add_model_args,
    add_speculative_args,
    add_tier_args,
    add_trace_arg,
    engine_switches,
    non_negative_float,
    positive_float,
    positive_int,
    whole_number,
)
from minillm.config import ConfigError, EngineConfig
from minillm.report import err_console
from minillm.serve.limits import ServeLimits
from minillm.stop_signals import EXIT_STATUS, handling_stop_signals, say, signal_name

SEND_LAST_S = 2.0  # after the engine stops, the time responses get to send their last events

SERVE_EXAMPLES = """\
examples:
  minillm serve                                   # http://127.0.0.1:8000/v1, the default model
  minillm serve --kv-dtype int8 --max-num-seqs 32  # engine switches are the other commands' flags
  minillm serve --no-prefix-caching               # the prefix cache is on unless this turns it off
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 16}'
  curl http://127.0.0.1:8000/metrics              # KV blocks per state, hit rate, queue, tokens/s
  kill -TERM <pid>                                # stop: requests in flight get --shutdown-timeout

Sampling defaults are the OpenAI API's (temperature 1; 0 is greedy), set per request. Logprobs, echo,
penalties, logit_bias and structured output (response_format, guided_json, ...) are taken; what
minillm does not implement (tools, functions, best_of, suffix) gets a 400 that names it. Bodies must be
Content-Type: application/json (a web page cannot post that cross-origin without asking).
"""


SERVE_DESCRIPTION = textwrap.fill(
    "Serve the model over HTTP with the OpenAI API as vLLM serves it: POST /v1/completions and "
    '/v1/chat/completions ("stream": true sends server-sent events), GET /v1/models, /health and '
    "/metrics (Prometheus text), and the tokenizer's: POST /tokenize, /detokenize, GET "
    "/tokenizer_info. One engine loop (the main thread; HTTP runs in another) batches "
    "every request in flight; a client that disconnects aborts its request and its KV blocks go "
    "back at once. The prefix cache is on, as in vLLM's V1 server: a conversation resent with "
    "every turn is prefilled from its new turn (--no-prefix-caching turns it off). "
    "SIGTERM or Ctrl-C stops it in order: new requests get a 503, those in flight "
    "get --shutdown-timeout seconds to finish, the rest end with an error; exit status 0 after "
    "SIGTERM, 130 after Ctrl-C. "
    'Needs the serve extra: pip install -e ".[serve]".',
    100,
    break_on_hyphens=False,  # a flag stays whole
)


def add_serve(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server on the engine (vLLM's routes)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SERVE_EXAMPLES,
        description=SERVE_DESCRIPTION,
    )
    add_server_args(serve)
    add_access_args(serve)
    add_limit_args(serve)
    add_engine_args(serve)
    add_kv_quantization_args(serve)
    add_eviction_args(serve)
    add_tier_args(serve)
    add_speculative_args(serve)
    add_trace_arg(serve)
    add_model_args(serve, dtype="auto", weights="auto")
    serve.set_defaults(func=cmd_serve)


def add_server_args(serve) -> None:
    """Where it listens, the name it answers to, the engine's threads, uvicorn's log level."""
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 opens it to the network (default: 127.0.0.1)",
    )
    serve.add_argument(
        "--port", type=whole_number(0, "a port number", 65535), default=8000, help="(default: 8000)"
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help='the name clients pass as "model" (default: the model folder\'s name, e.g. '
        "SmolLM2-135M-Instruct); any other name gets a 404",
    )
    serve.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads for the engine (default: torch's, one per core; fewer are steadier "
        "on a CPU shared with other work)",
    )
    serve.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="info",
        help="uvicorn's log level; info logs every request (default: info)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long the requests in flight may run to their end; the rest "
        "then end with a 503 error (a stream's error event and [DONE]); new requests get a 503 at "
        "once; 0 ends them all at once; a second signal stops at once (default: 5)",
    )


def add_access_args(serve) -> None:
    access = serve.add_argument_group("access")
    access.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (vLLM's flag; default: none)",
    )
    access.add_argument(
        "--metrics",
        choices=["open", "keyed", "off"],
        default="open",
        help="/metrics for anyone, only with the API key, or not at all; its prefix-cache counters "
        "tell a client whether a prompt was cached before, i.e. sent by someone (default: open)",
    )
    access.add_argument(
        "--allowed-hosts",
        metavar="NAMES",
        default=None,
        help="Host names the server answers besides localhost, 127.0.0.1, [::1] and --host, "
        "comma-separated, or * for any; another Host gets a 403 (DNS rebinding). With --host 0.0.0.0 "
        "the Host is not checked unless this names some (default: none)",
    )
    access.add_argument(
        "--allowed-origins",
        metavar="ORIGINS",
        default=None,
        help="web pages (https://app.example) that may send requests, besides pages on localhost and "
        "--host; comma-separated, or * for any; a browser's request from another gets a 403 "
        "(default: none)",
    )


def add_limit_args(serve) -> None:
    """One flag per ServeLimits field, its default and help from the table."""
    limits = serve.add_argument_group("limits (what one client may ask for)")
    for name, default, help_text in ServeLimits.flags():
        kind = positive_float if isinstance(default, float) else positive_int
        flag = "--" + name.replace("_", "-")
        limits.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: {default:g})")


def limits_from(args) -> ServeLimits:
    return ServeLimits(**{name: getattr(args, name) for name, _, _ in ServeLimits.flags()})


def listening_socket(host: str, port: int):
    import socket

    try:
        return socket.create_server((host, port))
    except OSError as err:
        raise ConfigError(
            f"Cannot listen on {host}:{port} ({err.strerror or err}); choose another --port or --host."
        ) from None


class GracefulStop:
    """What SIGTERM and SIGINT (Ctrl-C) do to `minillm serve`, as a signal handler. Before the
    server runs, either exits at once: nothing is in flight. Then the first drains the engine
    loop: no new request, `grace_s` seconds for those in flight. The second ends them now (their
    error events still go out, within SEND_LAST_S); once the engine has stopped, it also tells
    uvicorn to stop waiting for connections to close."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None  # the first signal received
        self.engine_loop = self.server = None

    def serving(self, engine_loop, server) -> None:
        self.engine_loop, self.server = engine_loop, server

    def __call__(self, signum: int, frame) -> None:
        if self.engine_loop is None:
            raise SystemExit(EXIT_STATUS[signum])
        if self.signum is None:
            self.signum = signum
            say(
                f"minillm serve: {signal_name(signum)}: no new requests; those in flight get up to "
                f"{self.grace_s:g} s to finish (signal again to stop now)"
            )
            self.engine_loop.drain(self.grace_s)
        else:
            say(f"minillm serve: {signal_name(signum)} again: stopping now")
            self.engine_loop.drain(0)
            if not self.engine_loop.running:
                self.server.force_exit = True

    @property
    def exit_status(self) -> int:
        return 0 if self.signum is None else EXIT_STATUS[self.signum]


def cmd_serve(args) -> int:
    """HTTP in a thread, the engine in the main thread, which loaded the model: torch's parallel
    regions ran ~20% slower in a thread started after another had run them (OpenMP, measured
    2026-12-01 on a 2-core AMD EPYC, docs/server.md), and the engine is where the time goes."""
    stop = GracefulStop(args.shutdown_timeout)
    with handling_stop_signals(stop):
        return _serve(args, stop)


def _serve(args, stop: GracefulStop) -> int:
    import threading

    from minillm.serve import missing_server_packages

    problem = missing_server_packages()
    if problem:
        raise ConfigError(problem)
    import uvicorn

    from minillm.engine import LLMEngine
    from minillm.serve.app import build_app, check_access
    from minillm.serve.connections import uvicorn_config
    from minillm.serve.engine_loop import EngineLoop
    from minillm.serve.origins import allowed_for

    check_access(args.api_key, args.metrics)
    sock = listening_socket(args.host, args.port)  # first: a port in use is one line before the weights load
    engine = LLMEngine(EngineConfig(**engine_switches(args)))
    model_name = args.served_model_name or Path(args.model).name
    host, port = sock.getsockname()[:2]
    engine_loop = EngineLoop(engine, args.threads)
    limits = limits_from(args)
    allowed = allowed_for(args.host, args.allowed_hosts, args.allowed_origins)
    app = build_app(engine_loop, model_name, False, limits, args.api_key, args.metrics, allowed)
    server = uvicorn.Server(
        uvicorn_config(app, limits, log_level=args.log_level, timeout_graceful_shutdown=SEND_LAST_S)
    )
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="minillm-http", daemon=True)
    page = f"; its memory drawn live at http://{host}:{port}/memory" if args.metrics != "off" else ""
    err_console.print(
        f"minillm serve: {model_name} on http://{host}:{port}/v1 ({engine.snapshot().num_blocks} KV "
        f"blocks of {engine.config.block_size} tokens){page}; Ctrl-C or SIGTERM stops",
        soft_wrap=True,
    )
    stop.serving(engine_loop, server)
    http.start()
    try:
        engine_loop.run(while_true=http.is_alive)  # until a drain ends, or the HTTP thread does
    finally:
        server.should_exit = True  # uvicorn closes the socket and lets the last events go out
        http.join()
    if engine_loop.error:  # a bug: say so, and exit with a status that says it too
        raise SystemExit(f"error: {engine_loop.error}")
    return stop.exit_status
