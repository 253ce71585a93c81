"""The router's claim, measured: sending a request where its prefix lives beats spreading requests
evenly, on `bench scheduling`'s traffic, through HTTP, over engines in their own processes.

1. **The SLOs**, on one idle engine: `bench serve-http --workload`'s (5 x the longest prompt's
   prefill alone, 5 x a batch-1 decode step).
2. **The loads**, on the tuning seed only (never reported): one engine, first come first served,
   at arrival rates a factor RATE_STEP apart until its goodput has crossed 80% and 50%; the rates
   there, interpolated. The fleet of N engines then gets N times each rate: each engine carries,
   on average, the load at which one engine alone meets that goodput. Round-robin splits arrivals
   evenly, so at the 80% load it should come near 80% itself, and no router can more than reach
   100%: there the gain is capped near 1 / 0.8; the 50% load leaves room to show more.
3. **The runs**, on held-out seeds: round-robin and the KV-aware router alternating within a seed,
   each on fresh engines (empty caches) and, with the store on, a fresh store. Per run: goodput,
   TTFT p50/p99, the fleet's prefix hit rate (hit tokens / looked-up tokens, summed over the
   engines' /metrics) and why lookups ended where they did (`PrefixMiss`: hit, diverged,
   evicted, new), blocks read from the store, and the router's fallbacks to round-robin.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from contextlib import ExitStack

from minillm.benchmarks.fleet.processes import engines, redis_server, router
from minillm.benchmarks.http_client import Endpoint, get, model_name
from minillm.benchmarks.scheduling.trace import make_trace
from minillm.benchmarks.serve_child import metrics, wait_idle
from minillm.benchmarks.serve_http_workload import (
    idle_timings,
    limits_for,
    replay_http,
    served_summary,
    slos,
    warm_up,
)
from minillm.serve.metrics import parse_metrics
from minillm.tokenizer import Tokenizer

POLICIES = ("round-robin", "kv")
LOAD_GOODPUTS = (0.8, 0.5)  # the issue's load, and a heavier one
RATE_STEP, MAX_PROBES = 2**0.5, 6


def _engine_args(model_dir, sizes: dict, trace) -> list[str]:
    """One thread each, a small pool (memory binds, as in `bench scheduling`), room for the trace."""
    return [
        "--model",
        str(model_dir),
        "--threads",
        "1",
        "--kv-cache-mb",
        str(sizes["kv_cache_mb"]),
    ] + limits_for(trace)


def _counters(backends: list[Endpoint]) -> dict:
    """The prefix-cache and store counters, summed over the engines."""
    names = ("prefix_cache_queries_total", "prefix_cache_hits_total", "remote_kv_blocks_read_total")
    values = [metrics(backend) for backend in backends]
    summed = {name: sum(value.get(name, 0) for value in values) for name in names}
    causes = Counter()
    for value in values:
        causes.update(value["prefix_cache_lookups_total"])
    return {**summed, "lookups": causes}


def _replayed(front: Endpoint, backends: list[Endpoint], tokenizer, trace, slo: dict, progress: bool) -> dict:
    """The trace through `front`; the summary, and the fleet's counters over the replay alone."""
    model = model_name(front)
    asyncio.run(warm_up(front, model, trace))
    before = _counters(backends)
    answered, wall_s = asyncio.run(replay_http(front, model, tokenizer, trace, progress))
    for backend in backends:
        wait_idle(backend)
    after = _counters(backends)
    delta = {name: after[name] - before[name] for name in after}
    queried = delta["prefix_cache_queries_total"]
    return {
        **served_summary(answered, slo, wall_s),
        "prefix_hit_rate": delta["prefix_cache_hits_total"] / queried if queried else 0.0,
        "lookups": dict(delta["lookups"]),  # why each lookup's hit ended where it did
        "store_blocks_read": delta["remote_kv_blocks_read_total"],
    }


def measure_slos(model_dir, sizes: dict) -> dict:
    tokenizer = Tokenizer(model_dir)
    trace = make_trace(tokenizer, sizes["tuning_seed"], sizes["requests"], 1.0, sizes["scale"])
    with engines(1, _engine_args(model_dir, sizes, trace)) as (engine,):
        idle = asyncio.run(idle_timings(engine, model_name(engine), trace))
    return {"idle": idle, **slos(idle, None, None)}


def one_engine_goodput(model_dir, sizes: dict, rate: float, slo: dict) -> float:
    tokenizer = Tokenizer(model_dir)
    trace = make_trace(tokenizer, sizes["tuning_seed"], sizes["requests"], rate, sizes["scale"])
    with engines(1, _engine_args(model_dir, sizes, trace)) as backends:
        return _replayed(backends[0], backends, tokenizer, trace, slo, False)["goodput"]


def find_loads(model_dir, sizes: dict, slo: dict, progress) -> dict:
    """The rates at which one engine's goodput crosses each of LOAD_GOODPUTS on the tuning seed,
    probing at rates RATE_STEP apart (upward while any is not yet passed)."""
    probes: dict[float, float] = {}
    rate = sizes["first_rate"]
    for _ in range(MAX_PROBES):
        probes[rate] = one_engine_goodput(model_dir, sizes, rate, slo)
        progress(f"one engine at {rate:.2f} req/s: goodput {probes[rate]:.0%}")
        rates = {goodput: _crossing(probes, goodput) for goodput in LOAD_GOODPUTS}
        if all(found is not None for found in rates.values()):
            return {"rates": rates, "probes": probes}
        above_all = min(probes.values()) >= min(LOAD_GOODPUTS)
        rate = max(probes) * RATE_STEP if above_all else min(probes) / RATE_STEP
    raise RuntimeError(f"one engine's goodput did not cross {LOAD_GOODPUTS}: {probes}")


def _crossing(probes: dict[float, float], goodput: float) -> float | None:
    """The rate where goodput crosses `goodput`, linear between the probes around it."""
    above = [rate for rate, value in probes.items() if value >= goodput]
    below = [rate for rate, value in probes.items() if value < goodput]
    if not above or not below:
        return None
    low, high = max(above), min(below)
    return low + (high - low) * (probes[low] - goodput) / (probes[low] - probes[high])


def fleet_run(
    model_dir,
    sizes: dict,
    policy: str,
    store: bool,
    seed: int,
    rate: float,
    slo: dict,
    progress: bool,
    trace_dir=None,
) -> dict:
    """One held-out trace through `sizes["engines"]` fresh engines behind a router of `policy`
    (each engine's KV events written into `trace_dir`, if given)."""
    tokenizer = Tokenizer(model_dir)
    trace = make_trace(tokenizer, seed, sizes["requests"], rate, sizes["scale"])
    with ExitStack() as stack:
        store_url = stack.enter_context(redis_server()) if store else None
        args = _engine_args(model_dir, sizes, trace) + (["--remote-kv", store_url] if store_url else [])
        backends = stack.enter_context(engines(sizes["engines"], args, trace_dir))
        front = stack.enter_context(router(backends, policy, model_dir))
        result = _replayed(front, backends, tokenizer, trace, slo, progress)
        routed = parse_metrics(get(front, "/metrics").decode())
    return {"policy": policy, "store": store, "seed": seed, **result, "router": _router_numbers(routed)}


def _router_numbers(values: dict) -> dict:
    """The router's own /metrics (`route/metrics.py`), its prefix taken off."""
    prefix = "minillm_router:"
    return {name.removeprefix(prefix): value for name, value in values.items() if name.startswith(prefix)}


def compare_policies(model_dir, sizes: dict, rate: float, slo: dict, progress, show_progress: bool) -> dict:
    """Every policy on every held-out seed, store off then on, alternating within a seed."""
    runs = []
    for store in (False, True):
        for index, seed in enumerate(sizes["seeds"]):
            order = POLICIES if index % 2 == 0 else POLICIES[::-1]
            for policy in order:
                run = fleet_run(model_dir, sizes, policy, store, seed, rate, slo, show_progress)
                progress(
                    f"store {'on' if store else 'off'}, seed {seed}, {policy}: goodput {run['goodput']:.0%}"
                )
                runs.append(run)
    return {"runs": runs, "means": _means(runs)}


def _means(runs: list[dict]) -> dict:
    """Per store setting and policy: the mean over seeds of goodput, hit rate, TTFT p50 and p99,
    store blocks read, errors; the lookups' causes summed over the seeds."""
    means = {}
    for store in (False, True):
        for policy in POLICIES:
            mine = [run for run in runs if run["store"] == store and run["policy"] == policy]
            if mine:
                means[f"store {'on' if store else 'off'}, {policy}"] = {
                    key: statistics.mean(run[key] for run in mine)
                    for key in (
                        "goodput",
                        "prefix_hit_rate",
                        "ttft_p50_s",
                        "ttft_p99_s",
                        "store_blocks_read",
                        "errors",
                    )
                }
                lookups = sum((Counter(run["lookups"]) for run in mine), Counter())
                means[f"store {'on' if store else 'off'}, {policy}"]["lookups"] = dict(lookups)
    return means
