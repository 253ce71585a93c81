"""`minillm bench scheduling`: admission policies on held-out traces, and the flags that size it."""

from __future__ import annotations

import argparse

from minillm.cli.flags import (
    add_model_args,
    add_record_arg,
    add_shape_arg,
    positive_int,
    seed_list,
    shown_and_recorded,
)


def rate_list(text: str) -> tuple[float, ...]:
    """--rates 2,4.5: arrivals per second above 0, comma-separated."""
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        rates = ()
    if not rates or not all(0 < rate < float("inf") for rate in rates):
        raise argparse.ArgumentTypeError(f"arrival rates above 0 separated by commas (2,4.5), not {text!r}")
    return rates


def add_bench_scheduling(benches) -> None:
    scheduling = benches.add_parser(
        "scheduling",
        help="admission policies (fcfs, lpm, memory) on held-out traces: goodput",
        description="Seeded traces of mixed traffic (Poisson arrivals; short questions; requests "
        "sharing long system prompts; multi-turn chats whose every turn resends the conversation; "
        "long documents; long answers; heavy-tailed output lengths) replayed on the wall clock "
        "through a small KV pool, once per admission policy. Goodput is the share of requests "
        "meeting both a TTFT and a TPOT SLO measured on an idle engine first (memory-aware "
        "admission is told the TTFT SLO). The three loads are the median, over the tuning seeds "
        "(0, 6, 7, 8, 9; 0, 6, 7 with --quick), of the rates where fcfs reaches 50%, 80% and 95% "
        "goodput; the policies are reported on other seeds only. At the heaviest load, memory-aware "
        "admission also runs with the mean output length of finished requests and with the trace's "
        "true lengths (the ceiling). Also: the rate each policy sustains at 90% goodput, how well "
        "the learned lengths rank requests (Spearman), greedy outputs against fcfs's, and the "
        "scheduler's own cost per step with 100 and 10,000 requests waiting (2,000 with --quick). "
        "Targets are printed beside the numbers, never asserted.",
    )
    add_scheduling_size_args(scheduling)
    scheduling.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch threads; on a CPU shared with other work more threads wait for each other (default: 1)",
    )
    scheduling.add_argument("--json", action="store_true", help="print one JSON object")
    add_record_arg(scheduling)
    add_model_args(scheduling, dtype="auto")
    add_shape_arg(scheduling)
    scheduling.set_defaults(func=cmd_bench_scheduling)


def add_scheduling_size_args(scheduling) -> None:
    """bench scheduling's --quick and the sizes it shrinks, the seeds and the loads; each default is
    printed for both sizes."""
    from minillm.benchmarks.scheduling import SIZES

    full, quick = SIZES["full"], SIZES["quick"]
    scheduling.add_argument(
        "--quick",
        action="store_true",
        help=f"{quick['requests']} requests of quarter-length, loads from 3 tuning seeds, 2 held-out "
        f"seeds, the scheduler's cost at {quick['cost_waiting'][-1]:,} waiting (about eight minutes)",
    )
    scheduling.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help=f"about this many requests per trace, a chat's turns each counted (default: "
        f"{full['requests']}; {quick['requests']} with --quick)",
    )
    scheduling.add_argument(
        "--kv-tokens",
        type=positive_int,
        default=None,
        help=f"the device KV pool, in tokens of the model's dtype (default: {full['kv_tokens']}; "
        f"{quick['kv_tokens']} with --quick)",
    )
    scheduling.add_argument(
        "--seeds",
        type=seed_list,
        default=None,
        help="the held-out trace seeds, comma-separated; not a tuning seed (0, 6, 7, 8, 9) (default: "
        f"{','.join(map(str, full['seeds']))}; {','.join(map(str, quick['seeds']))} with --quick)",
    )
    scheduling.add_argument(
        "--rates",
        type=rate_list,
        default=None,
        help="the loads as arrival rates per second, comma-separated, instead of the rates where "
        "fcfs reaches 50%%, 80%% and 95%% goodput on the tuning seeds (default: searched)",
    )


def cmd_bench_scheduling(args) -> None:
    from minillm.benchmarks.scheduling import bench_scheduling, print_scheduling_report

    shown_and_recorded(
        args,
        "scheduling",
        lambda: bench_scheduling(
            args.model,
            quick=args.quick,
            num_requests=args.requests,
            kv_tokens=args.kv_tokens,
            seeds=args.seeds,
            rates=args.rates,
            threads=args.threads,
            dtype=args.dtype,
            device=args.device,
            progress=not args.json,
        ),
        print_scheduling_report,
    )
