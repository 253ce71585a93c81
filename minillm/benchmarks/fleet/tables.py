"""`bench fleet`'s report: one table per part, and the sentences its numbers say."""

from __future__ import annotations

from minillm.benchmarks.stats import mib
from minillm.report import print_table

STORE_TARGET, HIT_TARGET, GOODPUT_TARGET, STEP_TARGET = 5.0, 2.0, 1.3, 1.10  # the targets


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _spread_ms(numbers: dict) -> str:
    return f"{numbers['median'] * 1000:.0f} ({numbers['min'] * 1000:.0f}-{numbers['max'] * 1000:.0f})"


def print_store(store: dict, console) -> None:
    rows = [
        ["B recomputes it (no store)", _spread_ms(store["recompute_s"])],
        ["B reads it from the store", _spread_ms(store["store_s"])],
        ["A has it at home (a router sends it there)", _spread_ms(store["home_s"])],
    ]
    title = f"TTFT of a {store['prefix_tokens']}-token shared prefix + a question, ms (median, min-max)"
    print_table(console, title, ["where the prefix comes from", "TTFT ms"], rows)
    ratio = store["recompute_over_store"]["median"]
    console.print(
        f"Through the store B answered first {ratio:.1f}x sooner than recomputing "
        f"({'meets' if ratio >= STORE_TARGET else 'misses'} the {STORE_TARGET:g}x target), reading "
        f"{mib(store['bytes_read'])} MiB from the store; greedy fp32 answers "
        f"{'identical' if store['identical'] else 'DIFFER'}."
    )


def print_step(step: dict, console) -> None:
    rows = [[name, f"{ms:.2f}", step["steps"][name]] for name, ms in step["median_step_ms"].items()]
    print_table(console, "The step with a slow store", ["store", "median step ms", "steps"], rows)
    ratio = step["slow_over_none"]
    console.print(
        f"With every store reply {step['delay_s'] * 1000:g} ms late, the median step is x{ratio:.3f} of no "
        f"store ({'within' if ratio <= STEP_TARGET else 'outside'} the {STEP_TARGET - 1:.0%} bound)."
    )


def print_router(report: dict, console) -> None:
    engines = report["sizes"]["engines"]
    for load, numbers in report["router"].items():
        means, rate = numbers["means"], numbers["fleet_rate"]
        rows = [
            [
                name,
                f"{m['goodput']:.0%}",
                f"{m['prefix_hit_rate']:.0%}",
                _ms(m["ttft_p50_s"]),
                _ms(m["ttft_p99_s"]),
                f"{m['store_blocks_read']:.0f}",
                f"{m['errors']:.0f}",
            ]
            for name, m in means.items()
        ]
        where = f"load: one engine's goodput {load} at 1/{engines} of it" if load != "given" else "rate given"
        title = f"{engines} engines at {rate:.2f} requests/s ({where}; mean over held-out seeds)"
        columns = [
            "fleet",
            "goodput",
            "prefix hit rate",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "store blocks",
            "errors",
        ]
        print_table(console, title, columns, rows)
        _lookups(means, console)
        for store in ("off", "on"):
            kv, rr = means.get(f"store {store}, kv"), means.get(f"store {store}, round-robin")
            if kv and rr:
                console.print(
                    f"Store {store}: the KV-aware router's hit rate is x{_ratio(kv, rr, 'prefix_hit_rate')} "
                    f"round-robin's and its goodput x{_ratio(kv, rr, 'goodput')} (targets "
                    f"x{HIT_TARGET:g} and x{GOODPUT_TARGET:g} with the store off; round-robin's goodput "
                    f"caps the second at x{1 / rr['goodput']:.2f})."
                    if rr["goodput"]
                    else f"Store {store}: round-robin served no request within its SLOs."
                )


def _lookups(means: dict, console) -> None:
    """Why the prefix cache's hits ended where they did, per fleet (`PrefixMiss` causes)."""
    rows = []
    for name, m in means.items():
        causes = m["lookups"]
        total = sum(causes.values()) or 1
        rows.append(
            [name, *(f"{causes.get(c, 0) / total:.0%}" for c in ("hit", "diverged", "evicted", "new"))]
        )
    columns = ["fleet", "every block hit", "diverged", "evicted", "new"]
    print_table(console, "Why each prompt's prefix hit ended where it did (share of lookups)", columns, rows)


def _ratio(kv: dict, rr: dict, key: str) -> str:
    return f"{kv[key] / rr[key]:.2f}" if rr[key] else "inf"


def print_fleet_report(report: dict, console) -> None:
    if "store" in report:
        print_store(report["store"], console)
    if "step" in report:
        print_step(report["step"], console)
    if "router" in report:
        print_router(report, console)
