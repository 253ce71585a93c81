"""`minillm bench fleet`: engines in their own processes, a KV store on redis-server between them,
a KV-aware router in front (`minillm.benchmarks.fleet`). As in `measure.py`: one dict, printed as
one JSON object with --json, else as tables."""

from __future__ import annotations

from minillm.cli.flags import add_record_arg, positive_float, shown_and_recorded
from minillm.config import DEFAULT_MODEL_DIR
from minillm.report import err_console


def add_bench_fleet(benches) -> None:
    from minillm.benchmarks.fleet import PARTS

    fleet = benches.add_parser(
        "fleet",
        help="several engines: a shared KV store on redis-server, a KV-aware router",
        description="Start redis-server, minillm serve engines (one thread each) and minillm route as "
        "child processes, and measure: TTFT of a shared prefix read from the store against "
        "recomputed (store); the median step with every store reply 50 ms late against no store "
        "(step); round-robin against the KV-aware router on bench scheduling's held-out traffic, "
        "with the store off and on, at N times the load where one engine's goodput crosses 80% "
        "(router). Needs Debian's redis-server.",
    )
    fleet.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run (default: all)"
    )
    fleet.add_argument("--quick", action="store_true", help="smaller traces and fewer repeats")
    fleet.add_argument(
        "--rate",
        type=positive_float,
        default=None,
        help="the fleet's arrival rate in requests/s, instead of finding the load (default: found)",
    )
    fleet.add_argument("--model", default=DEFAULT_MODEL_DIR, help="checkpoint folder (default: %(default)s)")
    fleet.add_argument("--json", action="store_true", help="print one JSON object")
    add_record_arg(fleet)
    fleet.set_defaults(func=cmd_bench_fleet, threads=1)  # each engine's torch threads, as recorded


def cmd_bench_fleet(args) -> None:
    from minillm.benchmarks.fleet import bench_fleet, print_fleet_report

    say = None if args.json else (lambda line: err_console.print(f"[dim]{line}[/dim]"))
    size = "quick" if args.quick else "full"

    def measure() -> dict:
        return bench_fleet(args.model, size, tuple(args.parts), args.rate, progress=say)

    shown_and_recorded(args, "fleet", measure, print_fleet_report)
