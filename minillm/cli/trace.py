"""`minillm trace show FILE`: a traced run's KV memory, its numbers and its timeline.

    minillm bench prefix --requests 8 --trace run.jsonl
    minillm trace show run.jsonl                 # every run listed; the busiest summarized and drawn
    minillm trace show run.jsonl --run 1 --plot run1.png
    minillm trace show run.jsonl --json --no-plot
    minillm trace serve run.jsonl                # the same run in the browser, step by step

The numbers come from `minillm/trace/` (one walk over the run's events); this module only chooses
the run, prints the tables (or one JSON object) and says where the picture went. `trace serve`
replays a run in the memory view's page (`minillm/view/`, `serve/memory_page.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from minillm import trace
from minillm.cli.trace_serve import add_trace_serve
from minillm.report import err_console, print_table, show
from minillm.tracing import read_trace

DESCRIPTION = (
    "Read a trace written with --trace FILE (on generate, chat, serve or bench) and draw the data "
    "flow of the KV memory from it: how long each block's content was held and then waited cached; "
    "how many requests hit each prefix-cache block and how many steps after its release; what "
    "spilled to the host tier and whether it was read again; each sequence's swap round trips; the "
    "KV bytes attention read per step and per request; and where each request's KV lived, step by "
    "step. Every run in the file is listed in one line (a bench writes one per engine it runs); "
    "the summary is of the busiest run (most steps) unless --run picks one. The timeline PNG shows "
    "every block x step coloured by its state (free; cached: free but findable by its content; "
    "shared: held by several tables, or by one and findable; private: one table's alone), host "
    "and disk tiers below a line, over one lane per request coloured by where its KV lives "
    "(device, host, disk, mixed, or waiting: none held between its first block and its last free). "
    "On long runs a cell aggregates steps and blocks (its most frequent state that is not free), "
    "and the panel titles say how many."
)


def add_trace(subparsers) -> None:
    trace_parser = subparsers.add_parser(
        "trace", help="read a --trace file: the KV memory's data flow", description=DESCRIPTION
    )
    commands = trace_parser.add_subparsers(dest="trace_command", required=True, metavar="COMMAND")
    trace_show = commands.add_parser(
        "show", help="summarize a run of a trace and draw its timeline", description=DESCRIPTION
    )
    add_run_args(trace_show, "summarize")
    trace_show.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="where the timeline goes (default: FILE with .png)",
    )
    trace_show.add_argument("--no-plot", action="store_true", help="no timeline, the numbers only")
    trace_show.add_argument("--json", action="store_true", help="print one JSON object")
    trace_show.set_defaults(func=cmd_trace_show)
    add_trace_serve(commands)


def add_run_args(parser, verb: str) -> None:
    """FILE and --run, which `trace show` and `trace serve` both take."""
    parser.add_argument("file", type=Path, metavar="FILE", help="a trace written with --trace FILE")
    parser.add_argument(
        "--run",
        type=int,
        default=None,
        metavar="N",
        help=f"the run to {verb}, as numbered in `trace show`'s list (default: the one with the most steps)",
    )


def chosen_run(args) -> tuple[dict, list, int]:
    """The file's runs described, and the events of the run --run names (or the busiest)."""
    runs = read_trace(args.file)  # a TraceError (a ValueError) is main's one-line error, exit 2
    described = trace.describe_runs(runs)
    run = trace.busiest(described) if args.run is None else args.run
    if run not in runs:
        raise ValueError(f"{args.file} has no run {run}; its runs are {', '.join(map(str, runs))}.")
    return described, runs[run], run


def cmd_trace_show(args) -> None:
    described, events, run = chosen_run(args)
    view = trace.walk(events)
    report = {"file": str(args.file), "run": run, "run_chosen": "busiest" if args.run is None else "--run"}
    report |= {"runs": described} | trace.summarize(view)
    report["plot"], report["plot_cells"] = None, None
    if not args.no_plot and view.step_numbers:
        path = args.plot or args.file.with_suffix(".png")
        report["plot_cells"] = draw(view, path, report)
        report["plot"] = str(path) if report["plot_cells"] else None
    show(report, print_report, args.json)


def draw(view: trace.RunView, path: Path, report: dict) -> str | None:
    pool = report["pool"]
    title = (
        f"KV memory of run {report['run']} of {Path(report['file']).name}: {pool['device_blocks']} device"
        f" + {pool['host_blocks']} host blocks of {pool['block_size']} tokens, {report['steps']} steps, "
        f"{trace.plural(report['requests'], 'request')}"
    )
    try:
        cells = trace.draw(view, path, title)
    except OSError as err:
        raise ValueError(
            f"Cannot write the timeline to {path} ({err.strerror}); pick another --plot."
        ) from None
    if cells is None:  # one line, never wrapped, and the numbers still print
        print(
            "The timeline needs matplotlib, which is not installed — run: pip install matplotlib",
            file=sys.stderr,
        )
    return cells


# ----------------------------------------------------------------------------- the tables
def human(num_bytes: float | None) -> str:
    if num_bytes is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.2f} GiB"


def num(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f}" if isinstance(value, float) and not value.is_integer() else f"{value:,.0f}"


def spread_cell(spread: dict, keys=("median", "p90", "max")) -> str:
    """'13 / 32 / 240': a distribution in one cell (its column says which: p50/p90/max)."""
    return "n/a" if not spread["count"] else " / ".join(num(spread[key]) for key in keys)


def print_report(report: dict, console) -> None:
    print_runs(report, console)
    if not report["steps"]:
        console.print(f"Run {report['run']} has no engine step: nothing ran on its memory.")
        return
    print_lifetimes(report["lifetimes"], console)
    print_reuse(report["reuse"], console)
    print_spills(report["spills"], console)
    print_swaps(report["swaps"], console)
    print_reads(report["reads"], console)
    print_places(report["places"], console)
    if report["plot"]:
        err_console.print(f"timeline: {report['plot']} ({report['plot_cells']})")


def print_runs(report: dict, console) -> None:
    rows = [
        ["*" if r["run"] == report["run"] else "", r["run"], r["steps"], r["requests"]]
        + [r["device_blocks"], r["host_blocks"], r["block_size"], f"{r['events']:,}"]
        for r in report["runs"]
    ]
    columns = ["", "run", "steps", "requests", "device blocks", "host blocks", "block size", "events"]
    print_table(console, f"{report['file']}: its runs (the engine of each is not recorded)", columns, rows)
    why = "the busiest, most steps; --run N for another" if report["run_chosen"] == "busiest" else "--run"
    console.print(f"Summary of run {report['run']} ({why}).")


def print_lifetimes(lifetimes: dict, console) -> None:
    rows = [
        [tier, f"{row['contents']:,}", spread_cell(row["held_steps"]), f"{row['cached_steps']['count']:,}"]
        + [spread_cell(row["cached_steps"])]
        for tier, row in lifetimes.items()
    ]
    columns = ["tier", "contents", "held p50/p90/max", "waited", "waited p50/p90/max"]
    print_table(console, "block contents: steps held by a table, then steps waiting cached", columns, rows)
    for tier, row in lifetimes.items():
        ended = ", ".join(
            f"{said} {row['ended'][how]:,}" for how, said in ENDINGS.items() if how in row["ended"]
        )
        console.print(f"  {tier} contents ended: {ended}")


ENDINGS = {  # trace.records.Life.end, said
    "reused": "reused for new content",
    "uncached": "forgotten while cached",
    "freed": "freed uncached",
    "open": "open at the end",
}


def print_reuse(reuse: dict, console) -> None:
    if not reuse["registered"]:
        console.print("prefix cache: no block registered (prefix caching off, or no full prompt block).")
        return
    row = [f"{reuse[key]:,}" for key in ("registered", "hit", "never_hit", "hits")]
    row += [spread_cell(reuse["requests_per_hit_block"]), spread_cell(reuse["distance_steps"])]
    columns = ["registered", "hit", "never hit", "hits", "requests per block", "steps to hit"]
    title = "prefix cache: how each block was read again (p50/p90/max)"
    print_table(console, title, columns, [row])
    console.print(f"  {reuse['hits_while_held']:,} hits found the block still held by another table.")


def print_spills(spills: dict, console) -> None:
    if not spills["spilled"]:
        console.print("spills: none (no host tier, or no cached block left the device).")
        return
    row = [f"{spills[key]:,}" for key in ("spilled", "brought_back", "dropped_unread", "on_host_at_end")]
    row += [spread_cell(spills["steps_on_host_before_back"])]
    columns = ["spilled", "brought back", "dropped unread", "on host at the end", "steps there p50/p90/max"]
    print_table(console, "cached blocks spilled to the host tier", columns, [row])


def print_swaps(swaps: dict, console, shown: int = 10) -> None:
    if not swaps["sequences"]:
        console.print("swaps: none.")
        return
    console.print(
        f"swaps: {swaps['round_trips']} round trips of {swaps['sequences']} sequences, "
        f"{swaps['blocks_out']:,} blocks out, {swaps['blocks_in']:,} in; steps away p50/p90/max "
        f"{spread_cell(swaps['steps_away'])}; {swaps['freed_while_away']} freed while away, "
        f"{swaps['away_at_end']} away at the end."
    )
    rows = [
        [row["seq_id"], row["request"], row["round_trips"], row["blocks_out"], row["blocks_in"]]
        + [row["steps_away"], row["max_steps_away"], row["not_back"]]
        for row in swaps["per_sequence"][:shown]
    ]
    more = f" (the {shown} longest away)" if swaps["sequences"] > shown else ""
    columns = ["seq", "request", "trips", "blocks out", "in", "steps away", "max", "not back"]
    print_table(console, f"swaps per sequence{more}", columns, rows)


def print_reads(reads: dict, console, shown: int = 10) -> None:
    per_step = reads["bytes_per_step"]
    console.print(
        f"KV read by attention per step: mean {human(per_step['mean'])}, p50 {human(per_step['median'])}, "
        f"p90 {human(per_step['p90'])}, max {human(per_step['max'])}; {human(reads['total_bytes'])} in all "
        "(entries read x KV bytes per token)."
    )
    rows = [
        [row["request"], row["steps"], human(row["mean_bytes"]), human(row["max_bytes"])]
        for row in reads["per_request"][:shown]
    ]
    more = f", top {shown} by max" if len(reads["per_request"]) > shown else ""
    print_table(console, f"KV read per step by request{more}", ["request", "steps", "mean", "max"], rows)


def print_places(places: dict, console, shown: int = 10) -> None:
    total = sum(places["request_steps"].values()) or 1
    rows = [[place, f"{n:,}", f"{n / total:.0%}"] for place, n in places["request_steps"].items()]
    print_table(console, "where requests' KV lived", ["place", "request-steps", "share"], rows)

    def off_device(row: dict) -> int:
        return row["waiting"] + row["host"] + row["disk"] + row["mixed"]

    away = sorted((row for row in places["per_request"] if off_device(row)), key=lambda row: -off_device(row))
    if away:
        columns = ["request", "waiting", "device", "host", "disk", "mixed"]
        rows = [[row[column] for column in columns] for row in away[:shown]]
        print_table(console, "requests with steps off the device (most first)", columns, rows)
