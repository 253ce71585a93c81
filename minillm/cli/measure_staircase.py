"""`minillm bench staircase`: HF transformers -> paged + continuous -> + int8 KV -> + flash prefill,
on decode-heavy traces (one per seed) and one KV byte budget that binds.

As in `measure.py`: the benchmark lives in `minillm.benchmarks` and returns one dict, printed as
one JSON object with --json, else as its module's tables.
"""

from __future__ import annotations

from minillm.cli.flags import add_model_args, add_record_arg, add_shape_arg, positive_int, shown_and_recorded


def add_bench_staircase(benches) -> None:
    from minillm.benchmarks.staircase import SIZES

    full, quick = SIZES["full"], SIZES["quick"]
    staircase = benches.add_parser(
        "staircase",
        help="the serving staircase: HF -> paged + continuous -> + int8 KV -> + flash prefill",
        description="Per seed, a trace of chat-like requests (prompts cut from real prose, "
        "long greedy answers, EOS ignored), all arriving at once, served on ONE KV byte "
        "budget that binds: by default it holds HF's static batch of 3 worst cases "
        "(longest prompt + longest output), while the traffic could use several times "
        "that. Four rows, each adding one step: (1) HF transformers' generate on static "
        "left-padded batches; (2) minillm's paged KV and continuous batching with "
        "memory-aware admission (C++ decode kernel, torch prefill attention); (3) + "
        "int8 KV in the same bytes; (4) + the C++ flash prefill kernel. Per row, the "
        "median over the seeds (min-max beside it): KV bytes (budget and peak in use), "
        "sequences at once, preemptions, output tok/s, TTFT and TPOT p50/p99, the ratio "
        "to the row before (seed by seed), and the requests whose greedy tokens equal "
        "the row before's (reported, not asserted; compare lossless rows in float32). "
        "Then prefill attention alone at a long context, torch reference vs flash "
        "kernel; and what the numbers mean, computed from them.",
    )
    add_trace_args(staircase, full, quick)
    add_attention_args(staircase, full, quick)
    staircase.add_argument(
        "--threads",
        type=positive_int,
        default=2,
        help="torch threads for every row; on a CPU shared with other work, fewer (default: 2)",
    )
    staircase.add_argument("--json", action="store_true", help="print one JSON object")
    add_record_arg(staircase)
    add_model_args(staircase, dtype="auto")
    add_shape_arg(staircase)
    staircase.set_defaults(func=cmd_bench_staircase)


def add_trace_args(staircase, full: dict, quick: dict) -> None:
    """The trace and the budget every row serves it on."""
    staircase.add_argument(
        "--quick",
        action="store_true",
        help=f"{quick['requests']} requests, prompts U{list(quick['prompt_len'])}, outputs "
        f"U{list(quick['output_len'])} tokens, seed {' '.join(map(str, quick['seeds']))} (under 2 "
        "minutes on a 2-core CPU; the default takes under 10)",
    )
    staircase.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        metavar="SEED",
        help=f"one trace per seed, each served by every row; the table shows medians and min-max "
        f"(default: {' '.join(map(str, full['seeds']))}; the defaults were chosen on seed 0)",
    )
    staircase.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help=f"requests in the trace (default: {full['requests']}; {quick['requests']} with --quick)",
    )
    for name, what in (("prompt_len", "prompt"), ("output_len", "output")):
        default, quick_default = (" ".join(map(str, sizes[name])) for sizes in (full, quick))
        staircase.add_argument(
            f"--{name.replace('_', '-')}",
            type=positive_int,
            nargs=2,
            metavar=("LOW", "HIGH"),
            default=None,
            help=f"{what} lengths in tokens, uniform in [LOW, HIGH] (default: {default}; "
            f"{quick_default} with --quick)",
        )
    staircase.add_argument(
        "--kv-tokens",
        type=positive_int,
        default=None,
        help="every row's KV budget, in tokens of KV in the model's dtype (an int8 pool cuts the same "
        "bytes into ~1.7x the blocks in bfloat16, ~3.5x in float32) (default: 3 x (the longest "
        "prompt + the longest output), so HF's static batch is 3)",
    )
    staircase.add_argument("--no-hf", action="store_true", help="skip row (1), HF transformers")


def add_attention_args(staircase, full: dict, quick: dict) -> None:
    """Prefill attention alone, torch reference vs flash kernel."""
    staircase.add_argument(
        "--attention-context",
        type=positive_int,
        default=4096,
        help="prefill attention alone: entries of context (default: 4096)",
    )
    staircase.add_argument(
        "--attention-chunk",
        type=positive_int,
        default=512,
        help="prefill attention alone: queries in the chunk, the context's last ones (default: 512)",
    )
    staircase.add_argument(
        "--attention-repeats",
        type=positive_int,
        default=None,
        help="prefill attention alone: timed calls, the best kept "
        f"(default: {full['attention_repeats']}; {quick['attention_repeats']} with --quick)",
    )


def cmd_bench_staircase(args) -> None:
    from minillm.benchmarks.staircase import bench_staircase, print_staircase_report

    shown_and_recorded(
        args,
        "staircase",
        lambda: bench_staircase(
            args.model,
            quick=args.quick,
            num_requests=args.requests,
            prompt_len=tuple(args.prompt_len) if args.prompt_len else None,
            output_len=tuple(args.output_len) if args.output_len else None,
            seeds=tuple(args.seeds) if args.seeds else None,
            kv_tokens=args.kv_tokens,
            include_hf=not args.no_hf,
            attention_context=args.attention_context,
            attention_chunk=args.attention_chunk,
            attention_repeats=args.attention_repeats,
            threads=args.threads,
            dtype=args.dtype,
            device=args.device,
            progress=not args.json,
        ),
        print_staircase_report,
    )
