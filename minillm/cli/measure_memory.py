"""The commands that measure what the memory system's choices cost: `minillm bench tiers`
(preemption by recompute or swap, session resume, prefix spill), `minillm bench memory` (the memory
system one layer at a time) and `minillm eval ppl` (the quality a compressed or evicted cache keeps).

As in `measure.py`: each benchmark lives in `minillm.benchmarks` and returns one dict, printed as
one JSON object with --json, else as its module's tables.
"""

from __future__ import annotations

from pathlib import Path

from minillm.cli.flags import (
    add_eviction_args,
    add_kv_quantization_args,
    add_model_args,
    add_switch,
    positive_float,
    positive_int,
    seed_list,
    whole_number,
)
from minillm.evaluation import DEFAULT_TEXT
from minillm.report import console, print_json, show

# ----------------------------------------------------------------------------- bench tiers


def add_bench_tiers(benches) -> None:
    tiers = benches.add_parser(
        "tiers",
        help="KV tiers: preemption by recompute vs swap vs auto, session resume, prefix spill",
        description="What the KV tiers buy, measured side by side on one run: (1) a seeded "
        "trace arriving over time at a device pool too small for it, with "
        "preemption by recompute, swap (to a host pool, with prefetch) and "
        "auto (measured cost model): tok/s, TTFT, tokens recomputed, bytes "
        "moved, prefetch hidden behind compute, and a check that greedy outputs "
        "are identical; (2) a long conversation resumed from a session file vs "
        "recomputed; (3) more system prompts than the device pool holds, "
        "with and without a host tier to spill them to; (4) the spill rule: "
        "bench scheduling's mixed trace with every cached block spilled or only reused ones, "
        "on held-out seeds. Targets are printed beside the numbers, never asserted.",
    )
    add_preemption_args(tiers)
    add_resume_args(tiers)
    add_prefix_spill_args(tiers)
    add_spill_rule_args(tiers)
    tiers.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch threads; 1 leaves a core to the background prefetch copy, and on a CPU "
        "shared with other work more threads wait for each other (default: 1)",
    )
    tiers.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(tiers)
    tiers.set_defaults(func=cmd_bench_tiers)


def add_preemption_args(tiers) -> None:
    """bench tiers, part 1: a trace that crowds a small device pool."""
    part = tiers.add_argument_group("1. preemption")
    part.add_argument(
        "--requests",
        type=positive_int,
        default=64,
        help="requests in the trace; prompts U[16, 96], outputs U[8, 40] tokens (default: 64)",
    )
    part.add_argument(
        "--rate",
        type=positive_float,
        default=8.0,
        help="mean arrivals per second (exponential gaps); higher crowds the pool more (default: 8)",
    )
    part.add_argument(
        "--device-tokens",
        type=positive_int,
        default=512,
        help="device KV pool in tokens, small enough to force preemption; the host pool is sized "
        "to hold the whole trace (default: 512)",
    )


def add_resume_args(tiers) -> None:
    """bench tiers, part 2: a parked conversation resumed from its session file."""
    part = tiers.add_argument_group("2. resume")
    part.add_argument(
        "--history-tokens",
        type=positive_int,
        default=2000,
        help="length of the parked conversation, in tokens (default: 2000)",
    )


def add_prefix_spill_args(tiers) -> None:
    """bench tiers, part 3: more system prompts than the device pool holds."""
    part = tiers.add_argument_group("3. prefix spill")
    part.add_argument(
        "--system-prompts", type=positive_int, default=8, help="distinct system prompts (default: 8)"
    )
    part.add_argument(
        "--system-tokens", type=positive_int, default=256, help="tokens per system prompt (default: 256)"
    )
    part.add_argument(
        "--spill-requests",
        type=positive_int,
        default=24,
        help="requests, one after another, each with a random system prompt (default: 24)",
    )
    part.add_argument(
        "--spill-pool-prompts",
        type=positive_float,
        default=2.5,
        help="device KV pool, in requests it holds; the host pool holds every system prompt (default: 2.5)",
    )


def add_spill_rule_args(tiers) -> None:
    """bench tiers, part 4: which cached blocks are worth a host copy."""
    part = tiers.add_argument_group("4. spill rule")
    part.add_argument(
        "--spill-rule-seeds",
        type=seed_list,
        default=(1, 2, 3),
        help="trace seeds, comma-separated; not 0, the rule's tuning seed (default: 1,2,3)",
    )
    part.add_argument(
        "--spill-rule-requests",
        type=positive_int,
        default=60,
        help="about this many requests per trace, a chat's turns each counted (default: 60)",
    )


def cmd_bench_tiers(args) -> None:
    from minillm.benchmarks.tiers import bench_tiers, print_tiers_report

    show(
        bench_tiers(
            args.model,
            num_requests=args.requests,
            rate=args.rate,
            device_tokens=args.device_tokens,
            history_tokens=args.history_tokens,
            system_prompts=args.system_prompts,
            system_tokens=args.system_tokens,
            spill_requests=args.spill_requests,
            spill_pool_prompts=args.spill_pool_prompts,
            spill_rule_seeds=args.spill_rule_seeds,
            spill_rule_requests=args.spill_rule_requests,
            threads=args.threads,
            dtype=args.dtype,
            device=args.device,
            progress=not args.json,
        ),
        print_tiers_report,
        args.json,
    )


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
