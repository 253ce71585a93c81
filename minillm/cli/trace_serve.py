"""`minillm trace serve FILE`: a traced run replayed in the browser, in the memory page.

    minillm bench prefix --requests 8 --trace run.jsonl
    minillm trace serve run.jsonl                # then open http://127.0.0.1:8001/memory

The run is walked into one frame per engine step (`minillm/view/replay.py`) and served by the
replay app (`serve/memory_page.py`); this module only parses the flags, shows the walk's progress
and says where the page is.
"""

from __future__ import annotations

from minillm.report import err_console

SERVE_DESCRIPTION = (
    "Replay a run of a trace in the browser: the page `minillm serve` shows live at /memory (the "
    "device pool as a grid of blocks coloured by state, the host and disk tiers, each request's block "
    "table, preemptions and their cause, counters over time), driven by the recorded events, with a "
    "scrubber to step forward and back or play. It listens on 127.0.0.1 only unless --host says "
    "otherwise; open the address it prints. Ctrl-C stops it."
)


def add_trace_serve(commands) -> None:
    from minillm.cli.serve import whole_number
    from minillm.cli.trace import add_run_args

    trace_serve = commands.add_parser(
        "serve", help="replay a run of a trace in the browser, step by step", description=SERVE_DESCRIPTION
    )
    add_run_args(trace_serve, "replay")
    trace_serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    trace_serve.add_argument(
        "--port", type=whole_number(0, "a port number", 65535), default=8001, help="(default: 8001)"
    )
    trace_serve.set_defaults(func=cmd_trace_serve)


def cmd_trace_serve(args) -> None:
    from minillm.serve import missing_server_packages

    problem = missing_server_packages()
    if problem:
        raise ValueError(problem)
    import uvicorn

    from minillm.cli.serve import listening_socket
    from minillm.cli.trace import chosen_run
    from minillm.progress import progress_bar
    from minillm.serve.memory_page import build_replay_app
    from minillm.serve.origins import allowed_for
    from minillm.view import Replay

    _, events, run = chosen_run(args)
    sock = listening_socket(args.host, args.port)
    with progress_bar("reading the run", total=len(events)) as advance:
        replay = Replay(events, progress=lambda done: advance())
    app = build_replay_app(replay, f"{args.file.name} · run {run}", allowed_for(args.host))
    host, port = sock.getsockname()[:2]
    err_console.print(
        f"minillm trace serve: run {run} of {args.file} ({len(replay)} frames) on "
        f"http://{host}:{port}/memory; Ctrl-C stops",
        soft_wrap=True,
    )
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
