"""The commands that measure what the memory system's choices cost: `minillm bench memory` (the
memory system one layer at a time) and `minillm eval ppl` (the quality a compressed or evicted cache
keeps); `minillm bench tiers` is `measure_tiers.py`.

As in `measure.py`: each benchmark lives in `minillm.benchmarks` and returns one dict, printed as
one JSON object with --json, else as its module's tables.
"""

from __future__ import annotations

from pathlib import Path

from minillm.cli.flags import (
    add_eviction_args,
    add_kv_quantization_args,
    add_model_args,
    add_shape_arg,
    add_switch,
    positive_float,
    positive_int,
    whole_number,
)
from minillm.evaluation import DEFAULT_TEXT
from minillm.report import console, print_json, show

# ----------------------------------------------------------------------------- bench memory


def add_bench_memory(benches) -> None:
    memory = benches.add_parser(
        "memory",
        help="the memory system one layer at a time, on one trace and one KV budget",
        description="One seeded trace (short questions, chats sharing system prompts, long "
        "documents, a few long answers) arriving over time at one device KV "
        "budget, served by rows that add one layer at a time: max-length "
        "reservation, paging, prefix cache, int8 KV, a host tier, memory-aware "
        "admission, H2O eviction under pressure; and the lossless system. "
        "Output tok/s, goodput against TTFT and TPOT targets calibrated now, "
        "TTFT, peak sequences, preemptions, bytes moved, KV utilization, ladder "
        "rungs, perplexity cost of the lossy rows on two texts; then closed-loop "
        "load tests. Targets are printed beside the numbers, never asserted.",
    )
    add_memory_size_args(memory)
    memory.add_argument("--no-load", action="store_true", help="skip the closed-loop load tests")
    memory.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch threads; on a CPU shared with other work more threads wait for each other (default: 1)",
    )
    memory.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(memory)
    add_shape_arg(memory)
    memory.set_defaults(func=cmd_bench_memory)


def add_memory_size_args(memory) -> None:
    """bench memory's --quick and the sizes it shrinks; each default is printed for both."""
    from minillm.benchmarks.memory import SIZES
    from minillm.benchmarks.memory.trace import SEED, TUNING_SEED

    full, quick = SIZES["full"], SIZES["quick"]
    memory.add_argument(
        "--quick",
        action="store_true",
        help="quarter-length requests, fewer of them, a smaller budget and a tiny load test "
        "(well under a minute)",
    )
    memory.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help=f"requests in the trace (default: {full['requests']}; {quick['requests']} with --quick)",
    )
    memory.add_argument(
        "--rate",
        type=positive_float,
        default=None,
        help=f"mean arrivals per second, exponential gaps (default: {full['rate']:g}; "
        f"{quick['rate']:g} with --quick)",
    )
    memory.add_argument(
        "--kv-tokens",
        type=positive_int,
        default=None,
        help="the device KV pool of every row, in tokens of float32 KV (an int8 pool gets more "
        f"blocks from the same bytes) (default: {full['kv_tokens']}; {quick['kv_tokens']} with "
        "--quick)",
    )
    memory.add_argument(
        "--clients",
        type=positive_int,
        default=None,
        help=f"closed-loop clients for the fixed-concurrency load test (default: {full['clients']}; "
        f"{quick['clients']} with --quick)",
    )
    memory.add_argument(
        "--seed",
        type=whole_number(0, "a seed"),
        default=SEED,
        help=f"the trace's seed; the sizes were chosen on seed {TUNING_SEED}'s (default: {SEED})",
    )


def cmd_bench_memory(args) -> None:
    from minillm.benchmarks.memory import bench_memory, print_memory_report

    show(
        bench_memory(
            args.model,
            quick=args.quick,
            num_requests=args.requests,
            rate=args.rate,
            kv_tokens=args.kv_tokens,
            clients=args.clients,
            seed=args.seed,
            load=not args.no_load,
            threads=args.threads,
            dtype=args.dtype,
            device=args.device,
            progress=not args.json,
        ),
        print_memory_report,
        args.json,
    )


# ----------------------------------------------------------------------------- eval ppl


def add_eval(subparsers) -> None:
    evaluate = subparsers.add_parser(
        "eval", help="measure quality", description="Quality measured through the engine."
    )
    evals = evaluate.add_subparsers(dest="eval", required=True, metavar="EVAL")
    ppl = evals.add_parser(
        "ppl",
        help="perplexity on a public-domain text, read through the KV cache",
        description="Perplexity of the model on a public-domain text (Alice's Adventures in "
        "Wonderland by default), with every token predicted by a decode step whose "
        "attention reads the cache — quantized or evicted as the switches say. "
        "Compare a switch's perplexity with the default's to see what it costs.",
    )
    ppl.add_argument(
        "--text",
        type=Path,
        default=DEFAULT_TEXT,
        help=f"UTF-8 text to score (default: {DEFAULT_TEXT}, fetched by weights_fetch.py)",
    )
    ppl.add_argument(
        "--segments", type=positive_int, default=4, help="segments scored side by side (default: 4)"
    )
    ppl.add_argument(
        "--segment-len", type=positive_int, default=512, help="tokens per segment (default: 512)"
    )
    add_switch(
        ppl,
        "attention_backend",
        help="decode attention: the batched torch reference or a kernel reading the cache in place "
        "(default: %(default)s)",
    )
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    add_kv_quantization_args(ppl)
    add_eviction_args(ppl)
    add_model_args(ppl)
    ppl.set_defaults(func=cmd_eval_ppl)


def cmd_eval_ppl(args) -> None:
    from minillm.evaluation import eval_ppl

    report = eval_ppl(
        args.model,
        args.text,
        args.segment_len,
        args.segments,
        args.dtype,
        args.device,
        progress=not args.json,
        kv_dtype=args.kv_dtype,
        kv_key_scales=args.kv_key_scales,
        eviction=args.eviction,
        kv_budget=args.kv_budget,
        attention_backend=args.attention_backend,
    )
    if args.json:
        print_json(report)
        return
    kv_format = (
        args.dtype
        if args.kv_dtype == "auto"
        else f"{args.kv_dtype}, keys per {args.kv_key_scales}, scales included"
    )
    budget = (
        f", {args.eviction} keeping {args.kv_budget} ({report['tokens_evicted']:,} entries evicted)"
        if args.eviction != "none"
        else ""
    )
    console.print(
        f"perplexity {report['perplexity']:.4f} (NLL {report['nll']:.4f} nats) over "
        f"{report['tokens_scored']} tokens of {args.text.name}, each predicted by a decode step "
        "reading the cache | "
        f"KV {kv_format} ({report['kv_bytes_per_token']:,} B/token){budget} | "
        f"{report['tokens_scored'] / report['seconds']:.1f} tok/s"
    )
