"""The report of `minillm bench scheduling`: the tables and sentences `print_scheduling_report`
prints from the dict `bench_scheduling` returns."""

from __future__ import annotations

from minillm.benchmarks.scheduling.run import POLICIES, SUSTAINED
from minillm.report import print_table

TARGET_GOODPUT, TARGET_RATE = 1.3, 1.2  # issue 27's: best memory-aware policy vs fcfs


def print_scheduling_report(report: dict, console) -> None:
    print_setting(report, console)
    for load in report["summary"]:
        print_seeds(report, load, console)
        print_means(report, load, console)
        print_kinds(report, load, console)
    print_sustained(report, console)
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
        f"trace: ~{sizes['requests']} requests per seed ({kinds} on the tuning seed), lengths x"
        f"{sizes['scale']:g}; tuned on seed {sizes['tuning_seed']}, reported on seeds "
        f"{', '.join(map(str, sizes['seeds']))}"
    )
    console.print(
        f"SLOs: TTFT <= {slo['ttft_s']:.2f} s, TPOT <= {slo['tpot_s'] * 1e3:.0f} ms ({slo['how']}); "
        "goodput = the share of requests meeting both"
    )
    rates = ", ".join(f"{load} at {rate:.2f} arrivals/s" for load, rate in loads["rates"].items())
    if loads["grid"]:
        grid = ", ".join(f"{rate:.2f}/s {good:.0%}" for rate, good in loads["grid"])
        console.print(f"loads, where fcfs reached these goodputs on the tuning seed ({grid}): {rates}")
    else:
        console.print(f"loads, as given: {rates}")


def print_seeds(report: dict, load: str, console) -> None:
    runs = report["runs"][load]
    seeds = [run["seed"] for run in runs["fcfs"]]
    rows = [
        [
            policy,
            *(f"{run['goodput']:.0%}" for run in runs[policy]),
            f"{report['summary'][load][policy]['goodput_mean']:.0%}",
        ]
        for policy in POLICIES
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
            policy,
            f"{s['goodput_mean']:.0%} ({s['goodput_min']:.0%}-{s['goodput_max']:.0%})",
            "-" if s["vs_fcfs"] is None else f"x{s['vs_fcfs']:.2f}",
            f"{s['ttft_p99_mean_s']:.2f}",
            f"{s['tpot_p50_mean_s'] * 1e3:.0f}",
            f"{s['preemptions_mean']:.1f}",
            f"{s['recomputed_tokens_mean']:,.0f} ({s['recompute_share_mean']:.0%})",
            report["outputs_differing_from_fcfs"][policy],
        ]
        for policy, s in summary.items()
    ]
    print_table(
        console,
        f"load {load}: means over the held-out seeds",
        [
            "policy",
            "goodput (min-max)",
            "vs fcfs",
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
        [policy, *(f"{summary[policy]['goodput_by_kind_mean'][kind]:.0%}" for kind in kinds)]
        for policy in summary
    ]
    print_table(
        console, f"load {load}: goodput by kind of request, mean over the seeds", ["policy", *kinds], rows
    )


def print_sustained(report: dict, console) -> None:
    rates = report["sustained_rate"]
    cells = ", ".join(f"{policy} {_rate(rate)}" for policy, rate in rates.items())
    console.print(
        f"sustained rate at >= {SUSTAINED:.0%} mean goodput (interpolated between the loads): {cells}"
    )


def print_cost(report: dict, console) -> None:
    cost = report["scheduler_cost_ms"]
    waiting = list(next(iter(cost.values())))
    rows = [[policy, *(f"{cost[policy][w]:.2f}" for w in waiting)] for policy in cost]
    largest = waiting[-1]
    rows.append(["x fcfs", *(f"{max(cost[p][w] for p in cost) / cost['fcfs'][w]:.2f}" for w in waiting)])
    print_table(
        console,
        f"the scheduler's own cost: schedule() ms per step (median), {largest:,} waiting at most",
        ["policy", *(f"{w:,} waiting" for w in waiting)],
        rows,
    )


def _rate(rate: float | None) -> str:
    return "outside the loads" if rate is None else f"{rate:.2f}/s"


def best_memory_policy(summary: dict) -> str:
    return max((p for p in POLICIES if p != "fcfs"), key=lambda p: summary[p]["goodput_mean"])


def what_it_means(report: dict) -> str:
    """The held-out result against the targets, said plainly either way."""
    said = []
    for load, summary in report["summary"].items():
        best = best_memory_policy(summary)
        s, fcfs = summary[best], summary["fcfs"]
        ratio = s["vs_fcfs"]
        met = (
            ratio is not None and ratio >= TARGET_GOODPUT and s["ttft_p99_mean_s"] <= fcfs["ttft_p99_mean_s"]
        )
        said.append(
            f"At load {load}, the best policy other than fcfs is {best}: goodput {s['goodput_mean']:.0%} "
            f"against {fcfs['goodput_mean']:.0%} ({'-' if ratio is None else f'x{ratio:.2f}'}; target "
            f"x{TARGET_GOODPUT} with p99 TTFT no worse: {'met' if met else 'missed'}), p99 TTFT "
            f"{s['ttft_p99_mean_s']:.2f} against {fcfs['ttft_p99_mean_s']:.2f} s."
        )
    said.append(greedy_said(report))
    return "\n".join(said)


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
