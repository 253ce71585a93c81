"""The `minillm` command: generate, chat, serve, route, info, bench, eval.

    minillm generate "Why is the sky blue?" --chat --max-tokens 64
    minillm chat --kv-dtype int8
    minillm chat --admission memory --eviction h2o --kv-budget 256 --eviction-trigger pressure
    minillm serve --port 8000
    minillm route --engine http://127.0.0.1:8001 --engine http://127.0.0.1:8002
    minillm info --json
    minillm bench decode --json
    minillm bench all --quick
    minillm eval ppl --eviction h2o --kv-budget 0.2

Each command is a pair: `add_X(subparsers)` declares its flags, `cmd_X(args)` runs it. The flags
several commands share live in `flags.py`; generate in `generate.py`; serve in `serve.py`; route
in `route.py`; the commands that measure (bench, eval) in `measure.py`, `measure_serving.py` and
`measure_memory.py`. Every error a user can cause (missing weights, a bad switch, a prompt too
long) ends in one line on stderr that says what to do, and exit status 2. Every command that
measures takes --json and prints one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minillm.chat import CHAT_HELP, DEFAULT_SESSIONS_DIR, Chat, session_path
from minillm.cli.flags import (
    SERVING_DEFAULTS,
    add_chat_template_arg,
    add_eviction_args,
    add_kv_quantization_args,
    add_model_args,
    add_sampling_args,
    add_speculative_args,
    add_switch,
    add_tier_args,
    add_trace_arg,
    engine_switches,
    sampling_from,
    use_shape,
)
from minillm.cli.generate import add_generate, runtime_from
from minillm.cli.measure import add_bench
from minillm.cli.measure_memory import add_eval
from minillm.cli.route import add_route
from minillm.cli.serve import add_serve
from minillm.cli.trace import add_trace
from minillm.config import DTYPES, ConfigError, resolve_dtype
from minillm.report import console, print_json
from minillm.tracing import tracing

# ----------------------------------------------------------------------------- chat


def add_chat(subparsers) -> None:
    chat = subparsers.add_parser(
        "chat",
        help="talk to the model in the terminal",
        description=f"Multi-turn chat with streamed replies. {CHAT_HELP}",
    )
    chat.add_argument("--system", default=None, help="system prompt (default: the checkpoint's own)")
    add_chat_template_arg(chat)
    chat.add_argument(
        "--session",
        default=None,
        metavar="NAME",
        help="park the conversation's KV on disk when the chat ends, and resume it next time "
        "(only the new turn is computed)",
    )
    chat.add_argument(
        "--sessions-dir",
        type=Path,
        default=DEFAULT_SESSIONS_DIR,
        help=f"where sessions are parked (default: {DEFAULT_SESSIONS_DIR})",
    )
    chat.add_argument(
        "--no-live",
        action="store_true",
        help="no live memory panel while a reply streams, even in a terminal (plain lines instead)",
    )
    add_sampling_args(chat, max_tokens=256)
    add_chat_engine_args(chat)
    add_trace_arg(chat)
    add_model_args(chat, dtype="auto", weights="auto")
    chat.set_defaults(func=cmd_chat)


def add_chat_engine_args(chat) -> None:
    """The engine switches the chat starts with; /set changes them later (its /help lists which)."""
    engine = chat.add_argument_group("engine switches (/set SWITCH VALUE changes them in the chat)")
    add_switch(engine, "admission")
    add_kv_quantization_args(engine)
    add_eviction_args(engine)
    add_switch(engine, "eviction_trigger")  # in no group: only the chat takes it
    add_tier_args(engine)
    add_speculative_args(engine)


def cmd_chat(args) -> None:
    """The conversation runs on the serving engine with the prefix cache on, as `minillm serve`
    starts it (SERVING_DEFAULTS; see minillm.chat)."""
    from minillm.engine import LLM

    session = session_path(args.sessions_dir, args.session) if args.session is not None else None
    llm = LLM(**SERVING_DEFAULTS, **engine_switches(args))
    chat = Chat(
        llm,
        sampling_from(args),
        args.system,
        session,
        args.sessions_dir,
        live=not args.no_live,
        template_vars=args.chat_template_kwargs,
    )
    chat.run(args.model.name)


# ----------------------------------------------------------------------------- info


def add_info(subparsers) -> None:
    info = subparsers.add_parser(
        "info",
        help="model config and KV cache size per token",
        description="Model configuration and KV bytes per token, from the formula and "
        "from allocated tensors.",
    )
    info.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(info)
    info.set_defaults(func=cmd_info)


def cmd_info(args) -> None:
    from minillm.decoding.cached import ContiguousKVCache

    runtime = runtime_from(args)
    cfg = runtime.model.config
    probe_len = 1024
    allocated = ContiguousKVCache(runtime.model, probe_len).nbytes // probe_len
    n_params = sum(p.numel() for p in runtime.model.parameters())
    info = {
        "model_dir": str(args.model),
        "dtype": args.dtype,
        "device": args.device,
        "parameters": n_params,
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "query_heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "tied_embeddings": cfg.tie_word_embeddings,
        "kv_bytes_per_token_formula": runtime.kv_bytes_per_token,
        "kv_bytes_per_token_allocated": allocated,
        "weight_bytes": sum(p.nbytes for p in runtime.model.parameters()),
    }
    if args.json:
        print_json(info)
        return
    from rich.table import Table

    table = Table(title=f"minillm info — {args.model}", show_header=False)
    for key, value in info.items():
        table.add_row(
            key, f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
        )
    console.print(table)
    console.print(
        f"KV bytes per token = 2 (K and V) x {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x "
        f"{cfg.head_dim} head_dim x {DTYPES[args.dtype].itemsize} bytes = {runtime.kv_bytes_per_token:,}; "
        f"a {probe_len}-token cache allocates {allocated:,} per token."
    )


# ----------------------------------------------------------------------------- main


class OneLineParser(argparse.ArgumentParser):
    """argparse, except that a usage mistake is one line, `error: ...`, like every other error."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="minillm",
        description="A readable reference engine for LLM inference.",
        epilog="First fetch the default weights: python weights_fetch.py",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in (
        add_generate,
        add_chat,
        add_serve,
        add_route,
        add_info,
        add_bench,
        add_eval,
        add_trace,
    ):
        add_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0), or a usage mistake already printed in one line (2)
        return done.code
    if getattr(args, "dtype", None) == "auto":  # every command below sees the precision it runs in
        args.dtype = resolve_dtype("auto", getattr(args, "device", "cpu"))
    try:
        use_shape(args)
        with tracing(getattr(args, "trace_file", None)):
            return args.func(args) or 0  # a command that can partly fail returns 1 (bench all)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)  # one line, never wrapped
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
