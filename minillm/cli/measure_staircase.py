"""`minillm bench staircase`: HF transformers -> paged + continuous -> + int8 KV -> + flash prefill,
on one trace of long prompts and one KV byte budget.

As in `measure.py`: the benchmark lives in `minillm.benchmarks` and returns one dict, printed as
one JSON object with --json, else as its module's tables.
"""

from __future__ import annotations

from minillm.cli.flags import add_model_args, positive_int
from minillm.report import show


def add_bench_staircase(benches) -> None:
    from minillm.benchmarks.staircase import SIZES

    full, quick = SIZES["full"], SIZES["quick"]
    staircase = benches.add_parser(
        "staircase",
        help="the serving staircase: HF -> paged + continuous -> + int8 KV -> + flash prefill",
        description="One seeded trace of long prompts (real prose) and long greedy answers "
        "(EOS ignored), all arriving at once, served on ONE KV byte budget by four "
        "rows, each adding one step: (1) HF transformers' generate on static "
        "left-padded batches, its batch the most that fits the budget at the "
        "trace's worst case (longest prompt + longest output); (2) minillm's paged KV "
        "and continuous batching (C++ decode kernel, torch prefill attention); (3) + "
        "int8 KV in the same bytes; (4) + the C++ flash prefill kernel. Per row: KV "
        "bytes (budget and peak in use), sequences at once, output tok/s, TTFT and "
        "TPOT p50/p99, the ratio to the row before, and the fraction of requests "
        "whose greedy tokens equal the row before's (reported, not asserted). Then "
        "prefill attention alone at a long context, torch reference vs flash kernel, "
        "fp32 and int8 pools; and what the numbers mean, computed from them.",
    )
    add_trace_args(staircase, full, quick)
    add_attention_args(staircase, full, quick)
    staircase.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch threads for every row; on a CPU shared with other work more threads wait for "
        "each other (default: 1)",
    )
    staircase.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(staircase)
    staircase.set_defaults(func=cmd_bench_staircase)


def add_trace_args(staircase, full: dict, quick: dict) -> None:
    """The trace and the budget every row serves it on."""
    staircase.add_argument(
        "--quick",
        action="store_true",
        help=f"{quick['requests']} requests, prompts U{list(quick['prompt_len'])}, outputs "
        f"U{list(quick['output_len'])} tokens (under 2 minutes on one thread of a 2-core CPU; the "
        "default takes under 10)",
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
        "bytes into ~3.5x the blocks) (default: twice the trace's longest prompt + longest output, "
        "so HF's static batch is 2)",
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

    show(
        bench_staircase(
            args.model,
            quick=args.quick,
            num_requests=args.requests,
            prompt_len=tuple(args.prompt_len) if args.prompt_len else None,
            output_len=tuple(args.output_len) if args.output_len else None,
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
        args.json,
    )
