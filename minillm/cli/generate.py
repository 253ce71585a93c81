"""`minillm generate`: one prompt, streamed to the terminal, on the single-sequence decoders
(naive, cached) or, with --decoder paged, on the serving engine (where --speculative guesses
tokens from the prompt); --json prints one object with the ids, the text, the timings and (paged)
the memory per tier and the speculation's numbers.

`runtime_from` loads the one model and tokenizer that generate and info run on.
"""

from __future__ import annotations

from minillm.cli.flags import (
    add_chat_template_arg,
    add_model_args,
    add_sampling_args,
    add_speculative_args,
    add_switch,
    add_tier_args,
    add_trace_arg,
    engine_switches,
    sampling_from,
    whole_number,
)
from minillm.config import ConfigError, EngineConfig
from minillm.report import console, err_console, print_json
from minillm.runtime import Runtime
from minillm.sampling import MAX_LOGPROBS


def runtime_from(args) -> Runtime:
    weights = getattr(args, "weights", "model")  # info has no --weights
    return Runtime(EngineConfig(model_dir=args.model, dtype=args.dtype, device=args.device, weights=weights))


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
    add_chat_template_arg(gen)
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
    add_switch(
        gen,
        "prefix_caching",
        help='with --decoder paged: the prefix cache on; --json\'s "prefix_miss" says what it found',
    )
    add_sampling_args(gen, max_tokens=128)
    gen.add_argument(
        "--logprobs",
        type=whole_number(0, "a count of most likely tokens", MAX_LOGPROBS),
        default=None,
        metavar="K",
        help=f"with --decoder paged --json: each new token's log-probability and the K (0-{MAX_LOGPROBS}) "
        "most likely tokens' at its position",
    )
    add_tier_args(gen)
    add_speculative_args(gen)
    add_trace_arg(gen)
    add_model_args(gen, dtype="auto", weights="auto")
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args) -> None:
    if args.speculative != "none" and args.decoder != "paged":
        raise ConfigError("--speculative runs on the serving engine: add --decoder paged.")
    if args.logprobs is not None and (args.decoder != "paged" or not args.json):
        raise ConfigError("--logprobs is reported by the serving engine: add --decoder paged --json.")
    if args.prefix_caching and args.decoder != "paged":
        raise ConfigError("--prefix-caching runs on the serving engine: add --decoder paged.")
    if args.chat_template_kwargs and not args.chat:
        raise ConfigError("--chat-template-kwargs are the chat template's variables: add --chat.")
    runtime = runtime_from(args)
    params = sampling_from(args)
    prompt_ids = runtime.prompt_ids(args.prompt, args.chat, args.chat_template_kwargs)
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
    out, text, shown = None, runtime.tokenizer.stream_decoder(), 0
    for out in llm.stream(prompt_ids, params):  # a step may bring several tokens (speculation)
        for token in out.token_ids[shown:]:
            if not args.json and token not in runtime.eos_token_ids:
                console.print(text.feed(token), end="", markup=False, highlight=False)
        shown = len(out.token_ids)
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
            "speculation": llm.engine.stats.speculation(),
            "prefix_miss": out.prefix_miss_report(),  # why the prefix cache hit what it did (None: off)
            "logprobs": logprobs_report(out.logprobs[0], runtime.tokenizer) if out.logprobs else None,
        }
    )


def logprobs_report(logprobs, tokenizer) -> list[dict]:
    """generate --json's log-probabilities: per new token, its text, id, log-probability and the
    most likely tokens at its position."""
    return [
        {
            "token": tokenizer.decode([lp.token_id]),
            "token_id": lp.token_id,
            "logprob": lp.logprob,
            "top": [{"token": tokenizer.decode([t]), "token_id": t, "logprob": v} for t, v in lp.top],
        }
        for lp in logprobs
    ]


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
