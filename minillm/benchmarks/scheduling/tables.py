"""The report of `minillm bench scheduling`: the tables and sentences `print_scheduling_report`
prints from the dict `bench_scheduling` returns, each target beside the number it is about."""

from __future__ import annotations

from minillm.benchmarks.scheduling.bench import SUSTAINED
from minillm.report import print_table

# issue 56's targets, memory-aware admission against fcfs on the held-out seeds
TARGET_GOODPUT = {"50%": 1.3, "80%": 1.1, "95%": 1.0}  # goodput ratio at each load
TARGET_KIND_DROP = 0.10  # no kind's goodput more than this below its fcfs value
TARGET_RATE = 1.2  # the rate sustained at SUSTAINED goodput
TARGET_SPEARMAN = 0.5  # the learned lengths' rank correlation with the true ones
TARGET_FLAT, TARGET_VS_FCFS = 1.2, 2.0  # schedule()'s cost: most waiting / fewest; against fcfs


def print_scheduling_report(report: dict, console) -> None:
    print_setting(report, console)
    for load in report["summary"]:
        print_seeds(report, load, console)
        print_means(report, load, console)
        print_kinds(report, load, console)
    print_sustained(report, console)
    print_lengths(report, console)
    print_cost(report, console)
    console.print(what_it_means(report))


def print_setting(report: dict, console) -> None:
    sizes, slo, loads, trace = report["sizes"], report["slo"], report["loads"], report["trace"]
    kinds = ", ".join(f"{n} {kind}" for kind, n in trace["kinds"].items())
    console.print(
        f"{report['machine']['cpu_model']}, {report['machine']['torch_threads']} torch thread(s), "
        f"{report['dtype']}; KV pool {sizes['kv_tokens']} tokens, prefix cache on"
    )
    console.print(
        f"trace: ~{sizes['requests']} requests per seed ({kinds} on seed {trace['seed']}), lengths x"
        f"{sizes['scale']:g}; loads found on seeds {', '.join(map(str, sizes['tuning_seeds']))}, "
        f"reported on seeds {', '.join(map(str, sizes['seeds']))}"
    )
    console.print(
        f"SLOs: TTFT <= {slo['ttft_s']:.2f} s, TPOT <= {slo['tpot_s'] * 1e3:.0f} ms ({slo['how']}); "
        "goodput = the share of requests meeting both; memory-aware admission is told the TTFT SLO"
    )
    rates = ", ".join(f"{load} at {rate:.2f} arrivals/s" for load, rate in loads["rates"].items())
    if loads["crossings"]:
        crossed = "; ".join(
            f"{load}: " + ", ".join("-" if rate is None else f"{rate:.1f}" for rate in rates_by_seed)
            for load, rates_by_seed in loads["crossings"].items()
        )
        console.print(
            f"loads, the median over the tuning seeds of where fcfs reached each goodput ({crossed}): {rates}"
        )
    else:
        console.print(f"loads, as given: {rates}")


def print_seeds(report: dict, load: str, console) -> None:
    runs = report["runs"][load]
    seeds = [run["seed"] for run in runs["fcfs"]]
    rows = [
        [
            row,
            *(f"{run['goodput']:.0%}" for run in runs[row]),
            f"{report['summary'][load][row]['goodput_mean']:.0%}",
        ]
        for row in runs
    ]
    print_table(
        console,
        f"load {load}: goodput per held-out seed",
        ["policy", *(f"seed {seed}" for seed in seeds), "mean"],
        rows,
    )


def print_means(report: dict, load: str, console) -> None:
    summary = report["summary"][load]
    rows = [
        [
            row,
            f"{s['goodput_mean']:.0%} ({s['goodput_min']:.0%}-{s['goodput_max']:.0%})",
            "-" if s["vs_fcfs"] is None else f"x{s['vs_fcfs']:.2f}",
            f"{s['ttft_p50_mean_s']:.2f}",
            f"{s['ttft_p99_mean_s']:.2f}",
            f"{s['tpot_p50_mean_s'] * 1e3:.0f}",
            f"{s['preemptions_mean']:.1f}",
            f"{s['recomputed_tokens_mean']:,.0f} ({s['recompute_share_mean']:.0%})",
            report["outputs_differing_from_fcfs"][row],
        ]
        for row, s in summary.items()
    ]
    print_table(
        console,
        f"load {load}: means over the held-out seeds",
        [
            "policy",
            "goodput (min-max)",
            "vs fcfs",
            "TTFT p50 s",
            "TTFT p99 s",
            "TPOT p50 ms",
            "preemptions",
            "recomputed (of busy)",
            "outputs != fcfs",
        ],
        rows,
    )


def print_kinds(report: dict, load: str, console) -> None:
    """Which traffic each policy pays for: goodput by request kind, mean over the seeds."""
    summary = report["summary"][load]
    kinds = list(summary["fcfs"]["goodput_by_kind_mean"])
    rows = [
        [row, *(f"{summary[row]['goodput_by_kind_mean'][kind]:.0%}" for kind in kinds)] for row in summary
    ]
    print_table(
        console, f"load {load}: goodput by kind of request, mean over the seeds", ["policy", *kinds], rows
    )


def print_sustained(report: dict, console) -> None:
    rates = report["sustained_rate"]
    cells = ", ".join(f"{policy} {_rate(sustained['rate'])}" for policy, sustained in rates.items())
    console.print(
        f"sustained rate at >= {SUSTAINED:.0%} mean goodput (interpolated between the two loads "
        f"around it): {cells}"
    )


def print_lengths(report: dict, console) -> None:
    lengths = report["lengths"]
    if not lengths["spearman"]:
        return

    def cell(name: str) -> str:
        m = lengths[name]
        return "-" if m is None else f"{m['median']:.2f} ({m['min']:.2f} to {m['max']:.2f})"

    print_table(
        console,
        "the learned output lengths: Spearman's rank correlation with the true ones, predicted at "
        "arrival, median (range) over the held-out runs",
        [
            "all requests",
            "first third (warming up)",
            "the rest",
            "kind ceiling (a perfect guess of the kind)",
        ],
        [[cell("spearman"), cell("spearman_first_third"), cell("spearman_rest"), cell("kind_ceiling")]],
    )


def print_cost(report: dict, console) -> None:
    cost = report["scheduler_cost_ms"]
    waiting = list(next(iter(cost.values())))  # queue lengths: ints, or strings once through JSON
    rows = [[policy, *(f"{cost[policy][w]:.2f}" for w in waiting)] for policy in cost]
    largest = waiting[-1]
    rows.append(["x fcfs", *(f"{max(cost[p][w] for p in cost) / cost['fcfs'][w]:.2f}" for w in waiting)])
    print_table(
        console,
        f"the scheduler's own cost: schedule() ms per step (median), {int(largest):,} waiting at most",
        ["policy", *(f"{int(w):,} waiting" for w in waiting)],
        rows,
    )


def _rate(rate: float | None) -> str:
    return "outside the loads" if rate is None else f"{rate:.2f}/s"


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def what_it_means(report: dict) -> str:
    """The held-out result against each target, said plainly either way."""
    said = [goodput_said(load, summary) for load, summary in report["summary"].items()]
    said.append(sustained_said(report["sustained_rate"]))
    said.append(lengths_said(report["lengths"]))
    said.append(cost_said(report["scheduler_cost_ms"]))
    said.append(greedy_said(report))
    return "\n".join(s for s in said if s)


def goodput_said(load: str, summary: dict) -> str:
    memory, fcfs = summary["memory"], summary["fcfs"]
    ratio, target = memory["vs_fcfs"], TARGET_GOODPUT.get(load)
    drops = {
        kind: fcfs["goodput_by_kind_mean"][kind] - good
        for kind, good in memory["goodput_by_kind_mean"].items()
        if kind in fcfs["goodput_by_kind_mean"]
    }
    worst = max(drops, key=drops.get)
    versus = f"target x{target}: {_met(ratio is not None and ratio >= target)}" if target else "no target"
    kinds = (
        f"{worst} is served {drops[worst] * 100:.0f} points below its fcfs goodput (at most "
        f"{TARGET_KIND_DROP * 100:.0f}: {_met(drops[worst] <= TARGET_KIND_DROP)})"
        if drops[worst] > 0.005
        else f"no kind loses against fcfs (the least gain: {worst}, {abs(drops[worst]) * 100:.0f} points)"
    )
    return (
        f"At load {load}, memory-aware admission's goodput is {memory['goodput_mean']:.0%} against "
        f"fcfs's {fcfs['goodput_mean']:.0%} ({'-' if ratio is None else f'x{ratio:.2f}'}; {versus}); "
        f"{kinds}; it trades tail for count: p99 TTFT {memory['ttft_p99_mean_s']:.2f} s against "
        f"{fcfs['ttft_p99_mean_s']:.2f} s."
    )


def sustained_said(rates: dict) -> str:
    memory, fcfs = rates["memory"]["rate"], rates["fcfs"]["rate"]
    if memory is not None and fcfs is not None:
        ratio = memory / fcfs
        return (
            f"Sustained at {SUSTAINED:.0%} goodput: memory-aware {memory:.2f}/s, fcfs {fcfs:.2f}/s "
            f"(x{ratio:.2f}; target x{TARGET_RATE}: {_met(ratio >= TARGET_RATE)})."
        )
    fcfs_points = rates["fcfs"]["points"]
    if memory is not None and all(good < SUSTAINED for _, good in fcfs_points):
        lightest = min(rate for rate, _ in fcfs_points)
        bound = memory / lightest
        return (
            f"Sustained at {SUSTAINED:.0%} goodput: memory-aware {memory:.2f}/s; fcfs stays below "
            f"{SUSTAINED:.0%} down to the lightest load ({lightest:.2f}/s), so its rate is lower and the "
            f"ratio more than x{bound:.2f}: a bound, not a bracketed ratio (target x{TARGET_RATE}: "
            f"{'met' if bound >= TARGET_RATE else 'not shown'})."
        )
    outside = [p for p in ("fcfs", "memory") if rates[p]["rate"] is None]
    return (
        f"The rate sustained at {SUSTAINED:.0%} goodput is not bracketed by the loads for "
        f"{' and '.join(outside)}: no ratio is claimed (target x{TARGET_RATE})."
    )


def lengths_said(lengths: dict) -> str:
    if not lengths["spearman"]:
        return ""
    rho, ceiling = lengths["spearman"]["median"], lengths["kind_ceiling"]
    said = (
        f"The learned lengths rank requests with Spearman {rho:.2f} (median over the runs; target "
        f"{TARGET_SPEARMAN}: {_met(rho >= TARGET_SPEARMAN)})"
    )
    if ceiling:
        said += (
            f"; a predictor that knew each request's kind and nothing else would score "
            f"{ceiling['median']:.2f}: within a kind the trace's lengths are drawn at random, and the "
            "kind is all a request's shape can tell"
        )
    return said + "."


def cost_said(cost: dict) -> str:
    waiting = list(cost["memory"])
    flat = cost["memory"][waiting[-1]] / cost["memory"][waiting[0]]
    versus = cost["memory"][waiting[-1]] / cost["fcfs"][waiting[-1]]
    fewest, most = (int(w) for w in (waiting[0], waiting[-1]))
    return (
        f"schedule() with memory-aware admission: x{flat:.2f} from {fewest:,} to {most:,} "
        f"waiting (target <= x{TARGET_FLAT}: {_met(flat <= TARGET_FLAT)}), x{versus:.2f} fcfs's "
        f"(target <= x{TARGET_VS_FCFS}: {_met(versus <= TARGET_VS_FCFS)})."
    )


def greedy_said(report: dict) -> str:
    """Admission changes the order of work, never the tokens: exactly so in float32. In bf16 a
    token's logits depend on the batch it was computed in (the matmuls round differently), so a
    near tie can flip when the policy batches it with others."""
    differing = {p: n for p, n in report["outputs_differing_from_fcfs"].items() if n}
    if not differing:
        return "Greedy outputs: every policy gave fcfs's tokens for every request."
    if report["dtype"] != "float32":
        return (
            f"Greedy outputs differ from fcfs's for {differing} requests: in {report['dtype']} a token's "
            "logits depend on the batch it ran in, so near ties flip; --dtype float32 checks exactness."
        )
    return (
        f"Greedy outputs DIFFER from fcfs's in float32: {differing} (a bug: admission may change order only)."
    )
