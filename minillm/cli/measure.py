"""The commands that measure: `minillm bench decode|serve|serve-http|prefix|tiers|memory|attention|chat-view`
(speed), `minillm eval ppl` (quality), and `minillm bench all` (every one of them, written to files).

Each benchmark lives in `minillm.benchmarks` and returns one dict: with --json it is printed as one
JSON object, to compare across commits; without, its module's `print_*_report` prints the tables.
Each `add_X` here declares a command's flags beside the `cmd_X` that runs it.
"""

from __future__ import annotations

from pathlib import Path

from minillm.cli.flags import (add_engine_args, add_eviction_args, add_kv_quantization_args, add_model_args,
                               add_switch, add_tier_args, engine_argv, engine_switches, positive_float,
                               positive_int)
from minillm.config import DEFAULT_MODEL_DIR, DTYPES, SWITCHES
from minillm.evaluation import DEFAULT_TEXT
from minillm.report import console, print_json, show


# the decode attention backends the CPU benchmarks compare
CPU_BACKENDS = tuple(b for b in SWITCHES["attention_backend"].choices if b != "cuda")


def add_bench(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="measure speed", description="Benchmarks that print numbers measured now.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for add_command in (add_bench_decode, add_bench_serve, add_bench_serve_http, add_bench_prefix, add_bench_tiers,
                        add_bench_memory, add_bench_attention, add_bench_chat_view, add_bench_all):
        add_command(benches)


# ----------------------------------------------------------------------------- bench decode

def add_bench_decode(benches) -> None:
    decode = benches.add_parser("decode", help="batch-1 decode tok/s: naive vs cached vs HF transformers",
                                description="Batch-1 decode speed of the naive and cached decoders and of HF "
                                            "transformers' generate on the same weights, and of the cached decoder "
                                            "in the other precision (float32 beside bfloat16), with bandwidth "
                                            "achieved against this machine's measured copy bandwidth: the median "
                                            "of interleaved runs, the best and the spread.")
    decode.add_argument("--tokens", type=positive_int, default=128, help="new tokens per run for cached and HF (default: 128)")
    decode.add_argument("--repeats", type=positive_int, default=5, help="interleaved runs of every decoder (default: 5)")
    decode.add_argument("--naive-tokens", type=positive_int, default=16, help="new tokens for the slow naive decoder (default: 16)")
    decode.add_argument("--prompt-len", type=positive_int, default=64, help="prompt length in tokens (default: 64)")
    decode.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    decode.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(decode)
    decode.set_defaults(func=cmd_bench_decode)


def cmd_bench_decode(args) -> None:
    from minillm.benchmarks.decode import bench_decode, print_decode_report
    show(bench_decode(args.model, prompt_len=args.prompt_len, new_tokens=args.tokens, naive_tokens=args.naive_tokens,
                      include_hf=not args.no_hf, dtype=args.dtype, repeats=args.repeats), print_decode_report, args.json)


# ----------------------------------------------------------------------------- bench serve

def add_bench_serve(benches) -> None:
    serve = benches.add_parser("serve", help="a 64-request trace: continuous vs static vs HF transformers",
                               description="Serve one seeded trace (prompts U[16, 320], outputs U[8, 160] tokens) "
                                           "with minillm continuous and static batching and HF transformers' "
                                           "batched generate: output tok/s, achieved GFLOP/s against a matmul "
                                           "measured in the same run, TTFT, TPOT, KV utilization of paged "
                                           "vs contiguous memory, and a block-size sweep.")
    serve.add_argument("--requests", type=positive_int, default=64, help="requests in the trace (default: 64)")
    serve.add_argument("--max-num-seqs", type=positive_int, default=16, help="batch size for every server (default: 16)")
    serve.add_argument("--block-sizes", type=positive_int, nargs="*", default=[8, 16, 32, 64, 128],
                       help="block sizes to sweep (default: 8 16 32 64 128; none to skip)")
    add_switch(serve, "attention_backend", choices=CPU_BACKENDS,
               help="minillm's decode attention: torch reference or the C++ kernel (default: %(default)s)")
    serve.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    serve.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(serve)
    serve.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> None:
    from minillm.benchmarks.serve import bench_serve, print_serve_report
    show(bench_serve(args.model, num_requests=args.requests, max_num_seqs=args.max_num_seqs,
                     block_sizes=tuple(args.block_sizes), include_hf=not args.no_hf,
                     attention_backend=args.attention_backend, dtype=args.dtype), print_serve_report, args.json)


# ----------------------------------------------------------------------------- bench serve-http

def add_bench_serve_http(benches) -> None:
    http = benches.add_parser("serve-http", help="minillm serve with N streaming clients vs LLM.generate",
                              description="The HTTP server's cost: N streaming clients (default 32) send bench "
                                          "serve's seeded trace at once to a `minillm serve` child process; "
                                          "aggregate output tok/s against LLM.generate on the same prompts in "
                                          "this process (target >= 80%), p50/p99 time to first token, whether "
                                          "every client got LLM.generate's text, and the KV blocks still held "
                                          "once all have finished, and again after half of them hang up "
                                          "mid-stream (must be 0). Needs the serve extra: pip install -e "
                                          "\".[serve]\".")
    http.add_argument("--clients", type=positive_int, default=32,
                      help="streaming clients, one request each (default: 32)")
    http.add_argument("--disconnect-after", type=positive_int, default=4,
                      help="in the second round, every other client hangs up after this many chunks (default: 4)")
    http.add_argument("--repeats", type=positive_int, default=1,
                      help="rounds of LLM.generate then the clients, interleaved; the best of each is reported "
                           "(default: 1)")
    http.add_argument("--threads", type=positive_int, default=1,
                      help="torch threads for LLM.generate and for the server's engine; on a CPU shared with "
                           "other work (here: the clients) more threads wait for each other (default: 1)")
    http.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(http)
    add_kv_quantization_args(http)
    add_eviction_args(http)
    add_tier_args(http)
    add_model_args(http)
    http.set_defaults(func=cmd_bench_serve_http)


def cmd_bench_serve_http(args) -> None:
    from minillm.benchmarks.serve_http import bench_serve_http, print_serve_http_report
    from minillm.config import ConfigError
    from minillm.serve import missing_server_packages

    problem = missing_server_packages()
    if problem:
        raise ConfigError(problem)
    switches = {k: v for k, v in engine_switches(args).items() if k != "model_dir"}
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    serve_args = engine_argv(args) + (["--threads", str(args.threads)] if args.threads else [])
    show(bench_serve_http(args.model, serve_args, switches, clients=args.clients,
                          disconnect_after=args.disconnect_after, repeats=args.repeats), print_serve_http_report,
         args.json)


# ----------------------------------------------------------------------------- bench prefix

def add_bench_prefix(benches) -> None:
    prefix = benches.add_parser("prefix", help="requests sharing a system prompt: prefix cache off vs on",
                                description="Requests that share a ~500-token system prompt, one after another, "
                                            "with and without the prefix cache: TTFT and prefill tokens computed.")
    prefix.add_argument("--requests", type=positive_int, default=32, help="(default: 32)")
    prefix.add_argument("--system-tokens", type=positive_int, default=500, help="system prompt length (default: 500)")
    add_switch(prefix, "attention_backend", choices=CPU_BACKENDS, help="(default: %(default)s)")
    prefix.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(prefix)
    prefix.set_defaults(func=cmd_bench_prefix)


def cmd_bench_prefix(args) -> None:
    from minillm.benchmarks.prefix import bench_prefix, print_prefix_report
    show(bench_prefix(args.model, args.requests, args.system_tokens, args.attention_backend),
         print_prefix_report, args.json)


# ----------------------------------------------------------------------------- bench chat-view

def add_bench_chat_view(benches) -> None:
    view = benches.add_parser("chat-view", help="the chat's live memory panel: decode tok/s with it vs without",
                              description="The same chat reply, again and again, with the live memory panel drawn "
                                          "into a terminal and as plain text, interleaved: decode tok/s of each "
                                          "(median, best, spread) and the slowdown (target: under 5%).")
    view.add_argument("--rounds", type=positive_int, default=5, help="replies with each view (default: 5)")
    view.add_argument("--tokens", type=positive_int, default=128, help="tokens per reply (default: 128)")
    view.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(view)
    view.set_defaults(func=cmd_bench_chat_view)


def cmd_bench_chat_view(args) -> None:
    from minillm.benchmarks.chat_view import bench_chat_view, print_chat_view_report
    show(bench_chat_view(args.model, args.rounds, args.tokens, args.dtype), print_chat_view_report, args.json)


# ----------------------------------------------------------------------------- bench tiers

def add_bench_tiers(benches) -> None:
    tiers = benches.add_parser("tiers", help="KV tiers: preemption by recompute vs swap vs auto, session resume, "
                                             "prefix spill",
                               description="What the KV tiers buy, measured side by side on one run: (1) a seeded "
                                           "trace arriving over time at a device pool too small for it, with "
                                           "preemption by recompute, swap (to a host pool, with prefetch) and "
                                           "auto (measured cost model): tok/s, TTFT, tokens recomputed, bytes "
                                           "moved, prefetch hidden behind compute, and a check that greedy outputs "
                                           "are identical; (2) a long conversation resumed from a session file vs "
                                           "recomputed; (3) more system prompts than the device pool holds, "
                                           "with and without a host tier to spill them to. Targets are printed "
                                           "beside the numbers, never asserted.")
    part = tiers.add_argument_group("1. preemption")
    part.add_argument("--requests", type=positive_int, default=64,
                      help="requests in the trace; prompts U[16, 96], outputs U[8, 40] tokens (default: 64)")
    part.add_argument("--rate", type=positive_float, default=8.0,
                      help="mean arrivals per second (exponential gaps); higher crowds the pool more (default: 8)")
    part.add_argument("--device-tokens", type=positive_int, default=512,
                      help="device KV pool in tokens, small enough to force preemption; the host pool is sized "
                           "to hold the whole trace (default: 512)")
    part = tiers.add_argument_group("2. resume")
    part.add_argument("--history-tokens", type=positive_int, default=2000,
                      help="length of the parked conversation, in tokens (default: 2000)")
    part = tiers.add_argument_group("3. prefix spill")
    part.add_argument("--system-prompts", type=positive_int, default=8, help="distinct system prompts (default: 8)")
    part.add_argument("--system-tokens", type=positive_int, default=256, help="tokens per system prompt (default: 256)")
    part.add_argument("--spill-requests", type=positive_int, default=24,
                      help="requests, one after another, each with a random system prompt (default: 24)")
    part.add_argument("--spill-pool-prompts", type=positive_float, default=2.5,
                      help="device KV pool, in requests it holds; the host pool holds every system prompt "
                           "(default: 2.5)")
    tiers.add_argument("--threads", type=positive_int, default=1,
                       help="torch threads; 1 leaves a core to the background prefetch copy, and on a CPU "
                            "shared with other work more threads wait for each other (default: 1)")
    tiers.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(tiers)
    tiers.set_defaults(func=cmd_bench_tiers)


def cmd_bench_tiers(args) -> None:
    from minillm.benchmarks.tiers import bench_tiers, print_tiers_report
    show(bench_tiers(args.model, num_requests=args.requests, rate=args.rate, device_tokens=args.device_tokens,
                     history_tokens=args.history_tokens, system_prompts=args.system_prompts,
                     system_tokens=args.system_tokens, spill_requests=args.spill_requests,
                     spill_pool_prompts=args.spill_pool_prompts, threads=args.threads, dtype=args.dtype,
                     device=args.device, progress=not args.json), print_tiers_report, args.json)


# ----------------------------------------------------------------------------- bench memory

def add_bench_memory(benches) -> None:
    memory = benches.add_parser("memory", help="the memory system one layer at a time, on one trace and one KV budget",
                                description="One seeded trace (short questions, chats sharing system prompts, long "
                                            "documents, a few long answers) arriving over time at one device KV "
                                            "budget, served by rows that add one layer at a time: max-length "
                                            "reservation, paging, prefix cache, int8 KV, a host tier, memory-aware "
                                            "admission, H2O eviction under pressure; and the lossless system. "
                                            "Output tok/s, goodput against TTFT and TPOT targets calibrated now, "
                                            "TTFT, peak sequences, preemptions, bytes moved, KV utilization, ladder "
                                            "rungs, perplexity cost of the lossy rows on two texts; then closed-loop "
                                            "load tests. Targets are printed beside the numbers, never asserted.")
    from minillm.benchmarks.memory import SIZES
    full, quick = SIZES["full"], SIZES["quick"]
    memory.add_argument("--quick", action="store_true",
                        help="quarter-length requests, fewer of them, a smaller budget and a tiny load test "
                             "(well under a minute)")
    memory.add_argument("--requests", type=positive_int, default=None,
                        help=f"requests in the trace (default: {full['requests']}; {quick['requests']} with --quick)")
    memory.add_argument("--rate", type=positive_float, default=None,
                        help=f"mean arrivals per second, exponential gaps (default: {full['rate']:g}; "
                             f"{quick['rate']:g} with --quick)")
    memory.add_argument("--kv-tokens", type=positive_int, default=None,
                        help="the device KV pool of every row, in tokens of float32 KV (an int8 pool gets more "
                             f"blocks from the same bytes) (default: {full['kv_tokens']}; {quick['kv_tokens']} with "
                             "--quick)")
    memory.add_argument("--clients", type=positive_int, default=None,
                        help=f"closed-loop clients for the fixed-concurrency load test (default: {full['clients']}; "
                             f"{quick['clients']} with --quick)")
    memory.add_argument("--no-load", action="store_true", help="skip the closed-loop load tests")
    memory.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads; on a CPU shared with other work more threads wait for each other "
                             "(default: 1)")
    memory.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(memory)
    memory.set_defaults(func=cmd_bench_memory)


def cmd_bench_memory(args) -> None:
    from minillm.benchmarks.memory import bench_memory, print_memory_report
    show(bench_memory(args.model, quick=args.quick, num_requests=args.requests, rate=args.rate,
                      kv_tokens=args.kv_tokens, clients=args.clients, load=not args.no_load, threads=args.threads,
                      dtype=args.dtype, device=args.device, progress=not args.json), print_memory_report, args.json)


# ----------------------------------------------------------------------------- bench attention

def add_bench_attention(benches) -> None:
    attention = benches.add_parser("attention", help="decode attention: torch reference vs C++ / CUDA kernels",
                                   description="Time one layer of SmolLM2-shaped paged decode attention for each "
                                               "backend and KV format over batch x context, with bandwidth "
                                               "achieved (the format's real bytes, scales included) against the "
                                               "device's measured copy bandwidth.")
    attention.add_argument("--batches", type=positive_int, nargs="+", default=[1, 4, 16, 64], help="(default: 1 4 16 64)")
    attention.add_argument("--contexts", type=positive_int, nargs="+", default=[128, 512, 1024, 4096],
                           help="(default: 128 512 1024 4096)")
    attention.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    add_switch(attention, "dtype", help="(default: %(default)s)")
    kv_formats = SWITCHES["kv_dtype"].choices
    add_switch(attention, "kv_dtype", nargs="+", default=list(kv_formats),
               help="how the pool stores K and V: auto (the model's dtype), int8, int4, fp8 "
                    "(default: all four)")
    attention.add_argument("--json", action="store_true", help="print one JSON object")
    attention.set_defaults(func=cmd_bench_attention)


def cmd_bench_attention(args) -> None:
    from minillm.benchmarks.attention import bench_attention, print_attention_report
    show(bench_attention(tuple(args.batches), tuple(args.contexts), args.device, DTYPES[args.dtype],
                         tuple(dict.fromkeys(args.kv_dtype))), print_attention_report, args.json)


# ----------------------------------------------------------------------------- bench all

def add_bench_all(benches) -> None:
    bench_all = benches.add_parser("all", help="every benchmark at a size that takes minutes: JSON, plots, a table",
                                   description="Run every benchmark (decode, attention, serve, prefix, tiers, memory, "
                                               "and perplexity per KV format) at a size a small CPU finishes in "
                                               "minutes (--quick: about 5 on a shared 2-core VM), and write "
                                               "results.json (the machine, the date, every report), results.md (a "
                                               "table of the headline numbers) and a PNG plot per benchmark. A "
                                               "benchmark that fails is recorded as failed and the others still run.")
    bench_all.add_argument("--quick", action="store_true", help="smaller sizes, noisier numbers, no HF baselines")
    bench_all.add_argument("--out", type=Path, default=Path("bench_results"),
                           help="folder for results.json, results.md and the plots (default: bench_results)")
    bench_all.add_argument("--json", action="store_true", help="print the results as one JSON object")
    bench_all.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                           help=f"checkpoint folder written by weights_fetch.py (default: {DEFAULT_MODEL_DIR}); "
                                "every benchmark runs in float32 on the CPU")
    bench_all.set_defaults(func=cmd_bench_all)


def cmd_bench_all(args) -> int:
    """Exit status 1 when a benchmark failed (its error is in the results, the others' numbers too)."""
    import sys

    from minillm.benchmarks.all import SIZES, bench_all, print_results

    def show(bench, result) -> None:
        console.rule(f"{bench.name}: {result['status']}, {result['seconds']:.0f} s")
        if result["status"] == "ok":
            bench.print_report(result["report"], console)
        else:
            console.print(result["error"], markup=False, highlight=False)

    command = "minillm bench all" + (" --quick" if args.quick else "")
    results = bench_all(args.model, args.out, SIZES["quick" if args.quick else "full"], command,
                        progress=not args.json, show=None if args.json else show)
    if args.json:
        print_json(results)
    else:
        print_results(results, args.out)
    if results["failed"]:
        print(f"error: bench all: {', '.join(results['failed'])} failed; the error and traceback of each are in "
              f"{args.out / 'results.json'}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- eval ppl

def add_eval(subparsers) -> None:
    evaluate = subparsers.add_parser("eval", help="measure quality", description="Quality measured through the engine.")
    evals = evaluate.add_subparsers(dest="eval", required=True, metavar="EVAL")
    ppl = evals.add_parser("ppl", help="perplexity on a public-domain text, read through the KV cache",
                           description="Perplexity of the model on a public-domain text (Alice's Adventures in "
                                       "Wonderland by default), with every token predicted by a decode step whose "
                                       "attention reads the cache — quantized or evicted as the switches say. "
                                       "Compare a switch's perplexity with the default's to see what it costs.")
    ppl.add_argument("--text", type=Path, default=DEFAULT_TEXT,
                     help=f"UTF-8 text to score (default: {DEFAULT_TEXT}, fetched by weights_fetch.py)")
    ppl.add_argument("--segments", type=positive_int, default=4, help="segments scored side by side (default: 4)")
    ppl.add_argument("--segment-len", type=positive_int, default=512, help="tokens per segment (default: 512)")
    add_switch(ppl, "attention_backend",
               help="decode attention: the batched torch reference or a kernel reading the cache in place "
                    "(default: %(default)s)")
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    add_kv_quantization_args(ppl)
    add_eviction_args(ppl)
    add_model_args(ppl)
    ppl.set_defaults(func=cmd_eval_ppl)


def cmd_eval_ppl(args) -> None:
    from minillm.evaluation import eval_ppl

    report = eval_ppl(args.model, args.text, args.segment_len, args.segments, args.dtype, args.device,
                      progress=not args.json, kv_dtype=args.kv_dtype, kv_key_scales=args.kv_key_scales,
                      eviction=args.eviction, kv_budget=args.kv_budget, attention_backend=args.attention_backend)
    if args.json:
        print_json(report)
        return
    kv_format = args.dtype if args.kv_dtype == "auto" else f"{args.kv_dtype}, keys per {args.kv_key_scales}, scales included"
    budget = (f", {args.eviction} keeping {args.kv_budget} ({report['tokens_evicted']:,} entries evicted)"
              if args.eviction != "none" else "")
    console.print(f"perplexity {report['perplexity']:.4f} (NLL {report['nll']:.4f} nats) over "
                  f"{report['tokens_scored']} tokens of {args.text.name}, each predicted by a decode step reading the cache | "
                  f"KV {kv_format} ({report['kv_bytes_per_token']:,} B/token){budget} | "
                  f"{report['tokens_scored'] / report['seconds']:.1f} tok/s")
