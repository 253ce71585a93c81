"""`minillm bench tiers`, the flags that size its four parts: preemption by recompute or swap,
session resume, prefix spill, and the spill rule.

As in `measure.py`: the benchmark lives in `minillm.benchmarks` and returns one dict, printed as
one JSON object with --json, else as its module's tables.
"""

from __future__ import annotations

from minillm.cli.flags import (
    add_model_args,
    add_record_arg,
    positive_float,
    positive_int,
    seed_list,
    shown_and_recorded,
)


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
    add_record_arg(tiers)
    add_model_args(tiers)
    tiers.set_defaults(func=cmd_bench_tiers)


def add_preemption_args(tiers) -> None:
    """bench tiers, part 1: a trace that crowds a small device pool."""
    part = tiers.add_argument_group("1. preemption")
    part.add_argument(
        "--requests",
        type=positive_int,
        default=64,
        help="requests in the trace; prompts a shared 32-token system prompt + U[16, 96], outputs "
        "U[8, 40] tokens (default: 64)",
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

    shown_and_recorded(
        args,
        "tiers",
        lambda: bench_tiers(
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
    )
