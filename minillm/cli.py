"""The `minillm` command: generate, chat, info, bench, eval.

    minillm generate "Why is the sky blue?" --chat --max-tokens 64
    minillm chat --kv-dtype int8
    minillm info --json
    minillm bench decode --json
    minillm eval ppl --eviction h2o --kv-budget 0.2

Every error a user can cause (missing weights, a bad switch, a prompt too long) ends in one line
on stderr that says what to do, and exit status 2. Every command that measures takes --json and
prints one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from minillm.config import DEFAULT_MODEL_DIR, DTYPES, EVICTION_POLICIES, KV_DTYPES, ConfigError, EngineConfig
from minillm.evaluation import DEFAULT_TEXT
from minillm.report import console, print_json, show
from minillm.runtime import Runtime

err_console = Console(stderr=True)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                        help=f"checkpoint folder written by weights_fetch.py (default: {DEFAULT_MODEL_DIR})")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="weights and KV dtype (default: float32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")


def kv_budget(text: str) -> int | float:
    """'256' is a number of tokens, '0.2' a fraction of the sequence's full length."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a token count (256) nor a fraction (0.2)") from None


def add_kv_quantization_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                        help="store the KV cache as int8, int4 or fp8 with scales (default: auto, the model dtype)")
    parser.add_argument("--kv-key-scales", choices=["channel", "token"], default="channel",
                        help="quantized keys share a scale per channel of a block, or per token (default: channel)")


def add_eviction_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eviction", choices=EVICTION_POLICIES, default="none",
                        help="drop KV entries beyond --kv-budget: h2o, sinks or window (default: none)")
    parser.add_argument("--kv-budget", type=kv_budget, default=None,
                        help="with --eviction: entries kept per sequence, as tokens (256) or a fraction (0.2)")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"new tokens at most (default: {max_tokens})")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 is off (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 is off (default: 1)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def sampling_from(args):
    from minillm.sampling import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.seed)


def runtime_from(args) -> Runtime:
    config = EngineConfig(model_dir=args.model, dtype=args.dtype, device=args.device,
                          decoder=getattr(args, "decoder", "cached"))
    return Runtime(config)


# ----------------------------------------------------------------------------- generate

def cmd_generate(args) -> None:
    runtime = runtime_from(args)
    params = sampling_from(args)
    prompt_ids = runtime.prompt_ids(args.prompt, chat=args.chat)
    if args.json:
        gen = runtime.generate(prompt_ids, params)
        print_json({
            "prompt": args.prompt, "prompt_ids": gen.prompt_ids, "generated_ids": gen.token_ids,
            "text": runtime.tokenizer.decode(gen.token_ids), "finish_reason": gen.finish_reason,
            "decoder": args.decoder,
            "kv_bytes_allocated": gen.kv_bytes,
            "timings": {"prefill_s": gen.prefill_s, "decode_s": gen.decode_s, "decode_tok_s": gen.decode_tok_s},
        })
        return
    gen = None
    for piece, gen in runtime.stream_text(prompt_ids, params):
        console.print(piece, end="", markup=False, highlight=False)
    console.print()
    decode = f"{gen.decode_tok_s:.1f} tok/s" if gen.decode_tok_s is not None else "n/a"
    err_console.print(f"[dim]{len(gen.token_ids)} tokens, {gen.finish_reason}; "
                      f"first token {gen.prefill_s * 1000:.0f} ms, decode {decode}[/dim]")


# ----------------------------------------------------------------------------- chat

CHAT_HELP = "/reset clears the conversation, /stats shows speed, KV memory and prefix reuse, /exit quits."


def cmd_chat(args) -> None:
    """Multi-turn chat on the serving engine with the prefix cache on: each turn's prompt is the
    whole conversation, and everything but the newest turn is found in the cache, not recomputed."""
    from minillm.engine import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, prefix_caching=True, kv_dtype=args.kv_dtype,
              kv_key_scales=args.kv_key_scales)
    tokenizer, cache = llm.engine.tokenizer, llm.engine.block_manager.prefix_cache
    params = sampling_from(args)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    initial = list(history)
    last = None
    console.print(f"[bold]minillm chat[/bold] — {args.model.name}, paged KV with prefix caching. {CHAT_HELP}")
    while True:
        try:
            user = console.input("[bold green]you>[/bold green] ").strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if user in ("/exit", "/quit"):
            return
        if user == "/reset":
            history, last = list(initial), None
            console.print("[dim]conversation cleared[/dim]")
            continue
        if user == "/stats":
            console.print(stats_line(llm, *last) if last else "[dim]no reply yet[/dim]")
            continue
        if not user:
            continue
        history.append({"role": "user", "content": user})
        hits_before = cache.hit_blocks
        text, out = tokenizer.stream_decoder(), None
        console.print("[bold blue]smol>[/bold blue] ", end="")
        for out in llm.stream(tokenizer.encode_chat(history), params):
            token = out.token_ids[-1] if out.token_ids else None
            if token is not None and token != tokenizer.eos_token_id:
                console.print(text.feed(token), end="", markup=False, highlight=False)
        if out.finish_reason == "error":  # e.g. the conversation outgrew the context
            history.pop()
            console.print(f"\n[red]error:[/red] {out.error} Type /reset to start over.")
            continue
        console.print(text.flush())
        history.append({"role": "assistant", "content": out.text})
        last = (out, (cache.hit_blocks - hits_before) * cache.block_size)


def stats_line(llm, out, reused_tokens: int) -> str:
    engine = llm.engine
    per_token = engine.bytes_per_slot
    held = len(out.prompt_token_ids) + len(out.token_ids)
    decode = f"{1 / out.tpot:.1f} tok/s" if out.tpot else "n/a"
    return (f"prompt {len(out.prompt_token_ids)} tokens ({reused_tokens} reused from the prefix cache), "
            f"reply {len(out.token_ids)} tokens | first token {out.ttft * 1000:.0f} ms | decode {decode} | "
            f"KV cache {per_token:,} B/token x {held} tokens = {per_token * held / 2**20:.1f} MiB; "
            f"{len(engine.block_manager.prefix_cache.entries)} blocks cached, "
            f"{engine.block_manager.num_free_blocks} of {engine.block_manager.num_blocks} blocks free")


# ----------------------------------------------------------------------------- info

def cmd_info(args) -> None:
    from minillm.decoding.cached import ContiguousKVCache

    runtime = runtime_from(args)
    cfg = runtime.model.config
    probe_len = 1024
    allocated = ContiguousKVCache(runtime.model, probe_len).nbytes // probe_len
    n_params = sum(p.numel() for p in runtime.model.parameters())
    info = {
        "model_dir": str(args.model), "dtype": args.dtype, "device": args.device, "parameters": n_params,
        "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "query_heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
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
        table.add_row(key, f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value))
    console.print(table)
    console.print(f"KV bytes per token = 2 (K and V) x {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x "
                  f"{cfg.head_dim} head_dim x {DTYPES[args.dtype].itemsize} bytes = {runtime.kv_bytes_per_token:,}; "
                  f"a {probe_len}-token cache allocates {allocated:,} per token.")


# ----------------------------------------------------------------------------- bench

def cmd_bench_decode(args) -> None:
    from minillm.benchmarks.decode import bench_decode, print_decode_report
    show(bench_decode(args.model, prompt_len=args.prompt_len, new_tokens=args.tokens, naive_tokens=args.naive_tokens,
                      include_hf=not args.no_hf, dtype=args.dtype), print_decode_report, args.json)


def cmd_bench_serve(args) -> None:
    from minillm.benchmarks.serve import bench_serve, print_serve_report
    show(bench_serve(args.model, num_requests=args.requests, max_num_seqs=args.max_num_seqs,
                     block_sizes=tuple(args.block_sizes), include_hf=not args.no_hf,
                     attention_backend=args.attention_backend), print_serve_report, args.json)


def cmd_bench_attention(args) -> None:
    from minillm.benchmarks.attention import bench_attention, print_attention_report
    show(bench_attention(tuple(args.batches), tuple(args.contexts), args.device, DTYPES[args.dtype]),
         print_attention_report, args.json)


def cmd_bench_prefix(args) -> None:
    from minillm.benchmarks.prefix import bench_prefix, print_prefix_report
    show(bench_prefix(args.model, args.requests, args.system_tokens, args.attention_backend),
         print_prefix_report, args.json)


# ----------------------------------------------------------------------------- eval

def cmd_eval_ppl(args) -> None:
    from minillm.engine import LLM
    from minillm.evaluation import perplexity, read_text

    text = read_text(args.text)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype,
              kv_key_scales=args.kv_key_scales, eviction=args.eviction, kv_budget=args.kv_budget)
    result = perplexity(llm, llm.engine.tokenizer.encode(text), args.segment_len, args.segments,
                        progress=not args.json)
    report = {"text": str(args.text), "kv_dtype": args.kv_dtype, "kv_key_scales": args.kv_key_scales,
              "eviction": args.eviction, "kv_budget": args.kv_budget, **result.as_dict()}
    if args.json:
        print_json(report)
        return
    kv_format = args.dtype if args.kv_dtype == "auto" else f"{args.kv_dtype}, keys per {args.kv_key_scales}, scales included"
    budget = (f", {args.eviction} keeping {args.kv_budget} ({result.tokens_evicted:,} entries evicted)"
              if args.eviction != "none" else "")
    console.print(f"perplexity {result.perplexity:.4f} (NLL {result.nll:.4f} nats) over {result.tokens_scored} "
                  f"tokens of {args.text.name}, each predicted by a decode step reading the cache | "
                  f"KV {kv_format} ({result.kv_bytes_per_token:,} B/token){budget} | "
                  f"{result.tokens_scored / result.seconds:.1f} tok/s")


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minillm", description="A readable reference engine for LLM inference.",
                                     epilog="First fetch the default weights: python weights_fetch.py")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="continue a prompt (or answer it with --chat)",
                         description="Generate text from a prompt, streamed to the terminal.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template (as a user turn)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: ids, text, timings")
    gen.add_argument("--decoder", choices=["naive", "cached"], default="cached",
                     help="naive recomputes everything per token (the oracle); cached keeps a KV cache")
    add_sampling_args(gen, max_tokens=128)
    add_model_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="talk to the model in the terminal",
                          description=f"Multi-turn chat with streamed replies. {CHAT_HELP}")
    chat.add_argument("--system", default=None, help="system prompt (default: the checkpoint's own)")
    add_sampling_args(chat, max_tokens=256)
    add_kv_quantization_args(chat)
    add_model_args(chat)
    chat.set_defaults(func=cmd_chat)

    info = sub.add_parser("info", help="model config and KV cache size per token",
                          description="Model configuration and KV bytes per token, from the formula and from allocated tensors.")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(info)
    info.set_defaults(func=cmd_info)

    bench = sub.add_parser("bench", help="measure speed", description="Benchmarks that print numbers measured now.")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    decode = bench_sub.add_parser("decode", help="batch-1 decode tok/s: naive vs cached vs HF transformers",
                                  description="Batch-1 decode speed of the naive and cached decoders and of HF "
                                              "transformers' generate on the same weights, with bandwidth achieved "
                                              "against this machine's measured copy bandwidth.")
    decode.add_argument("--tokens", type=int, default=64, help="new tokens per run for cached and HF (default: 64)")
    decode.add_argument("--naive-tokens", type=int, default=16, help="new tokens for the slow naive decoder (default: 16)")
    decode.add_argument("--prompt-len", type=int, default=64, help="prompt length in tokens (default: 64)")
    decode.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    decode.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(decode)
    decode.set_defaults(func=cmd_bench_decode)

    serve = bench_sub.add_parser("serve", help="a 64-request trace: continuous vs static vs HF transformers",
                                 description="Serve one seeded trace (prompts U[16, 320], outputs U[8, 160] tokens) "
                                             "with minillm continuous and static batching and HF transformers' "
                                             "batched generate: output tok/s, TTFT, TPOT, KV utilization of paged "
                                             "vs contiguous memory, and a block-size sweep.")
    serve.add_argument("--requests", type=int, default=64, help="requests in the trace (default: 64)")
    serve.add_argument("--max-num-seqs", type=int, default=16, help="batch size for every server (default: 16)")
    serve.add_argument("--block-sizes", type=int, nargs="*", default=[8, 16, 32, 64, 128],
                       help="block sizes to sweep (default: 8 16 32 64 128; none to skip)")
    serve.add_argument("--attention-backend", choices=["torch", "cpu"], default="torch",
                       help="minillm's decode attention: torch reference or the C++ kernel (default: torch)")
    serve.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    serve.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(serve)
    serve.set_defaults(func=cmd_bench_serve)

    prefix = bench_sub.add_parser("prefix", help="requests sharing a system prompt: prefix cache off vs on",
                                  description="Requests that share a ~500-token system prompt, one after another, "
                                              "with and without the prefix cache: TTFT and prefill tokens computed.")
    prefix.add_argument("--requests", type=int, default=32, help="(default: 32)")
    prefix.add_argument("--system-tokens", type=int, default=500, help="system prompt length (default: 500)")
    prefix.add_argument("--attention-backend", choices=["torch", "cpu"], default="torch", help="(default: torch)")
    prefix.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(prefix)
    prefix.set_defaults(func=cmd_bench_prefix)

    attention = bench_sub.add_parser("attention", help="decode attention: torch reference vs C++ / CUDA kernels",
                                     description="Time one layer of SmolLM2-shaped paged decode attention for each "
                                                 "backend over batch x context, with bandwidth achieved against "
                                                 "the device's measured copy bandwidth.")
    attention.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64], help="(default: 1 4 16 64)")
    attention.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 4096],
                           help="(default: 128 512 1024 4096)")
    attention.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    attention.add_argument("--dtype", choices=list(DTYPES), default="float32", help="(default: float32)")
    attention.add_argument("--json", action="store_true", help="print one JSON object")
    attention.set_defaults(func=cmd_bench_attention)

    evaluate = sub.add_parser("eval", help="measure quality", description="Quality measured through the engine.")
    eval_sub = evaluate.add_subparsers(dest="eval", required=True, metavar="EVAL")
    ppl = eval_sub.add_parser("ppl", help="perplexity on a public-domain text, read through the KV cache",
                              description="Perplexity of the model on a public-domain text (Alice's Adventures in "
                                          "Wonderland by default), with every token predicted by a decode step whose "
                                          "attention reads the cache — quantized or evicted as the switches say. "
                                          "Compare a switch's perplexity with the default's to see what it costs.")
    ppl.add_argument("--text", type=Path, default=DEFAULT_TEXT,
                     help=f"UTF-8 text to score (default: {DEFAULT_TEXT}, fetched by weights_fetch.py)")
    ppl.add_argument("--segments", type=int, default=4, help="segments scored side by side (default: 4)")
    ppl.add_argument("--segment-len", type=int, default=512, help="tokens per segment (default: 512)")
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    add_kv_quantization_args(ppl)
    add_eviction_args(ppl)
    add_model_args(ppl)
    ppl.set_defaults(func=cmd_eval_ppl)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)  # one line, never wrapped
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
