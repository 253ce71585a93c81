"""The `minillm` command: generate, chat, serve, info, bench, eval.

    minillm generate "Why is the sky blue?" --chat --max-tokens 64
    minillm chat --kv-dtype int8
    minillm serve --prefix-caching --port 8000
    minillm info --json
    minillm bench decode --json
    minillm bench all --quick
    minillm eval ppl --eviction h2o --kv-budget 0.2

Each command is a pair: `add_X(subparsers)` declares its flags, `cmd_X(args)` runs it. The flags
several commands share live in `flags.py`; serve in `serve.py`; the commands that measure (bench,
eval) in `measure.py` and `measure_memory.py`. Every error a user can cause (missing weights, a bad
switch, a prompt too long) ends in one line on stderr that says what to do, and exit status 2.
Every command that measures takes --json and prints one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minillm.chat import CHAT_HELP, DEFAULT_SESSIONS_DIR, Chat, session_path
from minillm.cli.flags import (
    add_kv_quantization_args,
    add_model_args,
    add_sampling_args,
    add_switch,
    add_tier_args,
    engine_switches,
    sampling_from,
)
from minillm.cli.measure import add_bench
from minillm.cli.measure_memory import add_eval
from minillm.cli.serve import add_serve
from minillm.config import DTYPES, ConfigError, EngineConfig
from minillm.report import console, err_console, print_json
from minillm.runtime import Runtime


def runtime_from(args) -> Runtime:
    return Runtime(EngineConfig(model_dir=args.model, dtype=args.dtype, device=args.device))


# ----------------------------------------------------------------------------- generate


def add_generate(subparsers) -> None:
    gen = subparsers.add_parser(
        "generate",
        help="continue a prompt (or answer it with --chat)",
        description="Generate text from a prompt, streamed to the terminal.",
    )
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the chat template (as a user turn)"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object: ids, text, timings")
    gen.add_argument(
        "--decoder",
        choices=["naive", "cached", "paged"],
        default="cached",
        help="naive recomputes everything per token (the oracle); cached keeps a KV cache; paged "
        "runs the serving engine (paged KV, tiers) and --json reports its memory per tier",
    )
    add_switch(
        gen, "kv_cache_bytes", help="with --decoder paged: the device KV pool in MiB (default: %(default)s)"
    )
    add_sampling_args(gen, max_tokens=128)
    add_tier_args(gen)
    add_model_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args) -> None:
    runtime = runtime_from(args)
    params = sampling_from(args)
    prompt_ids = runtime.prompt_ids(args.prompt, chat=args.chat)
    if args.decoder == "paged":
        return generate_paged(runtime, prompt_ids, params, args)
    if args.json:
        gen = runtime.generate(prompt_ids, params, args.decoder)
        print_json(
            {
                "prompt": args.prompt,
                "prompt_ids": gen.prompt_ids,
                "generated_ids": gen.token_ids,
                "text": runtime.tokenizer.decode(gen.token_ids),
                "finish_reason": gen.finish_reason,
                "decoder": args.decoder,
                "kv_bytes_allocated": gen.kv_bytes,
                "timings": {
                    "prefill_s": gen.prefill_s,
                    "decode_s": gen.decode_s,
                    "decode_tok_s": gen.decode_tok_s,
                },
            }
        )
        return
    gen = None
    for piece, gen in runtime.stream_text(prompt_ids, params, args.decoder):
        console.print(piece, end="", markup=False, highlight=False)
    console.print()
    decode = f"{gen.decode_tok_s:.1f} tok/s" if gen.decode_tok_s is not None else "n/a"
    err_console.print(
        f"[dim]{len(gen.token_ids)} tokens, {gen.finish_reason}; "
        f"first token {gen.prefill_s * 1000:.0f} ms, decode {decode}[/dim]"
    )


def generate_paged(runtime, prompt_ids: list[int], params, args) -> None:
    """The same request on the serving engine; --json adds its memory per tier and its preemptions."""
    from minillm.engine import LLM

    llm = LLM(model=runtime.model, tokenizer=runtime.tokenizer, **engine_switches(args))
    out, text = None, runtime.tokenizer.stream_decoder()
    for out in llm.stream(prompt_ids, params):
        if not args.json and out.token_ids and out.token_ids[-1] != runtime.tokenizer.eos_token_id:
            console.print(text.feed(out.token_ids[-1]), end="", markup=False, highlight=False)
    if out.error:
        raise ValueError(out.error)
    if not args.json:
        console.print(text.flush())
        return
    print_json(
        {
            "prompt": args.prompt,
            "prompt_ids": out.prompt_token_ids,
            "generated_ids": out.token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "decoder": "paged",
            "timings": {"ttft_s": out.ttft, "tpot_s": out.tpot},
            **_engine_memory(llm.engine),
        }
    )


def _engine_memory(engine) -> dict:
    """generate --json's memory report: per tier now and at the peak, the ladder's rungs, preemptions."""
    steps, memory = [stats.as_dict() for stats in engine.stats.memory], engine.snapshot()
    counters = memory.counters
    return {
        "memory": steps[-1],
        "memory_peak": {
            "device_reserved_bytes": max(step["reserved_bytes"] for step in steps),
            "host_reserved_bytes": max(step["host_reserved_bytes"] for step in steps),
            "disk_reserved_bytes": max(step["disk_reserved_bytes"] for step in steps),
        },
        "ladder": dict(engine.stats.rungs),
        "preemption": {
            "mode": memory.preemption,
            "preemptions": counters["preemptions"],
            "swapped_out": counters["swapped_out"],
            "swapped_in": counters["swapped_in"],
            "prefetched": counters["prefetched"],
            "tokens_recomputed": counters["recomputed_tokens"],
        },
    }


# ----------------------------------------------------------------------------- chat


def add_chat(subparsers) -> None:
    chat = subparsers.add_parser(
        "chat",
        help="talk to the model in the terminal",
        description=f"Multi-turn chat with streamed replies. {CHAT_HELP}",
    )
    chat.add_argument("--system", default=None, help="system prompt (default: the checkpoint's own)")
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
    add_kv_quantization_args(chat)
    add_model_args(chat)
    chat.set_defaults(func=cmd_chat)


def cmd_chat(args) -> None:
    """The conversation runs on the serving engine with the prefix cache on (see minillm.chat)."""
    from minillm.engine import LLM

    session = session_path(args.sessions_dir, args.session) if args.session is not None else None
    llm = LLM(prefix_caching=True, **engine_switches(args))
    chat = Chat(llm, sampling_from(args), args.system, session, args.sessions_dir, live=not args.no_live)
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
    for add_command in (add_generate, add_chat, add_serve, add_info, add_bench, add_eval):
        add_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0), or a usage mistake already printed in one line (2)
        return done.code
    try:
        return args.func(args) or 0  # a command that can partly fail returns 1 (bench all)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)  # one line, never wrapped
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
