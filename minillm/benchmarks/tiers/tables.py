"""Tiers, the report: one table per part, then the targets."""

from __future__ import annotations

from minillm.benchmarks import print_targets
from minillm.benchmarks.stats import mib
from minillm.report import print_table


def bytes_out(row: dict) -> int:
    return sum(n for way, n in row["bytes_moved"].items() if way.startswith("device->"))


def bytes_in(row: dict) -> int:
    return sum(n for way, n in row["bytes_moved"].items() if way.endswith("->device"))


def print_tiers_report(report: dict, console) -> None:
    print_preemption(report["preemption"], console)
    print_resume(report["resume"], console)
    print_spill(report["prefix_spill"], console)
    print_spill_rule(report["spill_rule"], console)
    print_targets(report, console)


def print_preemption(p: dict, console) -> None:
    trace = p["trace"]
    print_table(
        console,
        f"preemption: {trace['requests']} requests arriving at {trace['rate_per_s']:g}/s, device pool "
        f"{p['device_blocks']} blocks ({mib(p['device_kv_bytes'])} MiB)",
        ["preemption", "output tok/s", "CPU s", "TTFT p50", "TTFT p99", "preemptions", "tokens recomputed"],
        [
            [
                name,
                f"{row['output_tok_s']:.1f}",
                f"{row['cpu_s']:.1f}",
                f"{row['ttft_p50_s']:.2f} s",
                f"{row['ttft_p99_s']:.2f} s",
                row["preemptions"],
                f"{row['recomputed_tokens']:,}",
            ]
            for name, row in p["rows"].items()
        ],
    )
    print_table(
        console,
        f"KV traffic (host pool {mib(p['host_kv_bytes'])} MiB)",
        ["preemption", "MiB out", "MiB in", "swapped out", "copies shared", "prefetched", "prefetch hidden"],
        [
            [
                name,
                mib(bytes_out(row)),
                mib(bytes_in(row)),
                row["swapped_out"],
                row["swap_copies_saved"],
                row["prefetched"],
                "n/a" if row["prefetch_hidden"] is None else f"{row['prefetch_hidden']:.0%}",
            ]
            for name, row in p["rows"].items()
        ],
    )
    console.print(
        "greedy outputs identical across the three rows: "
        + ("yes" if p["outputs_identical"] else f"NO, {p['requests_differing']} requests differ")
    )


def print_resume(r: dict, console) -> None:
    print_table(
        console,
        f"resume a {r['history_tokens']:,}-token conversation and answer a new turn "
        f"({r['prompt_tokens']:,} tokens in all)",
        ["fresh engine", "TTFT", "prefill tokens computed"],
        [
            [name, f"{r[key]['ttft_s'] * 1e3:.0f} ms", f"{r[key]['prefill_tokens_computed']:,}"]
            for name, key in (("recomputes the history", "recompute"), ("loads the session", "resume"))
        ],
    )
    console.print(
        f"session file {mib(r['session_file_bytes'])} MiB ({r['session_tokens']:,} tokens), saved in "
        f"{r['save_s'] * 1e3:.0f} ms, loaded in {r['load_s'] * 1e3:.0f} ms; "
        f"TTFT {r['ttft_ratio']:.1f}x lower ({r['ttft_ratio_with_load']:.1f}x counting the load); "
        f"answers identical: {'yes' if r['answers_identical'] else 'NO'}"
    )


def print_spill(s: dict, console) -> None:
    print_table(
        console,
        f"prefix spill: {s['requests']} requests over {s['system_prompts']} system prompts of "
        f"{s['system_tokens']} tokens, device pool {s['device_blocks']} blocks",
        [
            "tiers",
            "block hit rate",
            "prefill tokens saved",
            "prefill tokens computed",
            "spilled",
            "spill hits",
            "TTFT mean",
        ],
        [
            [
                name,
                f"{row['prefix_cache']['block_hit_rate']:.0%}",
                f"{row['prefix_cache']['prefill_tokens_saved']:,}",
                f"{row['prefill_tokens_computed']:,}",
                row["spilled"],
                row["spill_hits"],
                f"{row['ttft_mean_s'] * 1e3:.0f} ms",
            ]
            for name, row in (("device only", s["without_host"]), ("device + host", s["with_host"]))
        ],
    )


def print_spill_rule(s: dict, console) -> None:
    sizes = s["sizes"]
    print_table(
        console,
        f"which cached blocks spill: bench scheduling's trace, ~{sizes['requests']} requests per seed, "
        f"device {sizes['device_tokens']} and host {sizes['host_tokens']} tokens, a step clock",
        ["seed", "rule", "spilled MiB", "spilled blocks read again", "block hit rate", "prefill saved"],
        [
            [
                run["seed"],
                rule,
                mib(run["spilled_bytes"]),
                f"{run['spill_hits']} of {run['spilled_blocks']}",
                f"{run['block_hit_rate']:.1%}",
                f"{run['prefill_tokens_saved']:,}",
            ]
            for runs in zip(*s["runs"].values())
            for rule, run in zip(s["runs"], runs)
        ],
    )
    fewer, hits = s["spilled_bytes_all_over_reused"], s["hit_rate_reused_minus_all"]
    console.print(
        f"all / reused, bytes spilled: x{fewer['median']:.1f} (x{fewer['min']:.1f}-x{fewer['max']:.1f}); "
        f"block hit rate, reused - all: {hits['median']:+.1%} ({hits['min']:+.1%} to {hits['max']:+.1%}); "
        f"requests whose greedy tokens differ: {s['outputs_differing']}"
    )
