"""The run of `minillm bench scheduling`: the SLOs, the loads (found on the tuning seed), every
policy on every held-out seed at every load, the sustained rates, and the scheduler's own cost."""

from __future__ import annotations

import math
import os
import random
import statistics

import torch

from minillm.benchmarks import cpu_model
from minillm.benchmarks.memory.rows import calibrate  # the SLOs: as `bench memory` sets its targets
from minillm.benchmarks.scheduling.replay import replay
from minillm.benchmarks.scheduling.trace import KINDS, describe_trace, make_trace
from minillm.benchmarks.tiers import percentile
from minillm.config import DTYPES, SWITCHES, ConfigError, resolve_dtype
from minillm.engine import LLM, SamplingParams
from minillm.progress import progress_bar
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

# every admission order the engine has; reserve (fcfs, each request holding its maximum length) is
# the pre-paging baseline `bench memory` measures, not a way of choosing who joins
POLICIES = tuple(choice for choice in SWITCHES["admission"].choices if choice != "reserve")
TUNING_SEED = 0
# the three loads: where fcfs reaches these goodputs on the tuning seed (the lightest one so that the
# rate keeping SUSTAINED goodput lies between two loads, not beyond them)
LOAD_GOODPUTS = (0.5, 0.8, 0.95)
SUSTAINED = 0.9  # the goodput a sustained rate keeps
RATE_STEP, MAX_PROBES = 2**0.5, 12  # the tuning seed's rates: each a neighbour's times or over RATE_STEP

SIZES = {
    # cost_waiting: the queue lengths the scheduler's own cost is measured at
    "full": {
        "requests": 150,
        "scale": 0.35,
        "kv_tokens": 640,
        "seeds": (1, 2, 3, 4, 5),
        "cost_waiting": (100, 10_000),
    },
    "quick": {"requests": 96, "scale": 0.25, "kv_tokens": 320, "seeds": (1, 2), "cost_waiting": (100, 2_000)},
}


# ----------------------------------------------------------------------------- one run


def llm_for(model, tokenizer, policy: str, kv_tokens: int, common: dict) -> LLM:
    """An engine with the prefix cache on and a pool of `kv_tokens` tokens of the model's dtype."""
    kv_bytes = kv_tokens * model.config.kv_bytes_per_token(model.dtype)
    switches = {"admission": policy, "prefix_caching": True, "kv_cache_bytes": kv_bytes, **common}
    return LLM(model=model, tokenizer=tokenizer, **switches)


def serve_trace(model, tokenizer, trace, policy: str, sizes: dict, slo: dict, common: dict) -> dict:
    """One policy on one trace: goodput (TTFT and TPOT both within their SLOs), latencies, and
    every request's tokens (for the greedy comparison)."""
    engine = llm_for(model, tokenizer, policy, sizes["kv_tokens"], common).engine
    served, busy, steps = replay(engine, tokenizer, trace)
    memory = engine.snapshot()
    recomputed = memory.counters["recomputed_tokens"]
    ttft = [s.ttft for s in served if s.ttft is not None]
    tpot = [s.tpot for s in served if s.tpot is not None]
    good = [
        s.error is None and s.ttft <= slo["ttft_s"] and (s.tpot is None or s.tpot <= slo["tpot_s"])
        for s in served
    ]
    kinds = sorted({s.kind for s in served})
    return {
        "goodput": sum(good) / len(served),
        "goodput_by_kind": {
            kind: statistics.mean(g for g, s in zip(good, served) if s.kind == kind) for kind in kinds
        },
        "errors": sum(s.error is not None for s in served),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "busy_s": busy,
        "steps": steps,
        "preemptions": engine.num_preemptions,
        "recomputed_tokens": recomputed,
        # busy time spent prefilling again what preemption threw away, at the idle prefill's rate
        "recompute_share": recomputed * slo["prefill_alone_s"] / slo["longest_prompt"] / busy,
        "prefix_hit_rate": memory.prefix_cache["hit_rate"],
        "tokens": [s.token_ids for s in served],
    }


# ----------------------------------------------------------------------------- the SLOs and the loads


def check_pool(trace, kv_tokens: int) -> None:
    """The pool must hold the longest prompt with its max_tokens (a chat's later turns may still
    outgrow it: they fail alone, and count as misses)."""
    longest = max(len(r.prompt_ids) + r.max_tokens for r in trace)
    if longest > kv_tokens:
        raise ConfigError(
            f"--kv-tokens {kv_tokens} cannot hold the trace's longest request ({longest} tokens); raise it."
        )


def rate_for(points: list[tuple[float, float]], goodput: float) -> float | None:
    """The rate where goodput crosses `goodput`, interpolated in log rate between the grid's points
    (goodput falls as the rate grows); None if the grid never crosses it."""
    points = sorted(points)
    for (low_rate, low_good), (high_rate, high_good) in zip(points, points[1:]):
        if low_good >= goodput >= high_good and low_good > high_good:
            share = (low_good - goodput) / (low_good - high_good)
            return math.exp(math.log(low_rate) + share * (math.log(high_rate) - math.log(low_rate)))
    return None


def find_loads(model, tokenizer, sizes: dict, slo: dict, common: dict, progress: bool) -> dict:
    """On the tuning seed only: fcfs from half its capacity, at rates falling by RATE_STEP until its
    goodput reaches the lightest load's and rising until it falls below the heaviest load's; the
    rates where it crosses each load's goodput."""
    capacity = capacity_rate(model, tokenizer, sizes, slo, common)
    grid: list[tuple[float, float]] = []  # (rate, fcfs goodput)
    with progress_bar("loads: fcfs on the tuning seed", MAX_PROBES, enabled=progress) as advance:

        def probe(rate: float) -> None:
            trace = make_trace(tokenizer, TUNING_SEED, sizes["requests"], rate, sizes["scale"])
            grid.append((rate, serve_trace(model, tokenizer, trace, "fcfs", sizes, slo, common)["goodput"]))
            advance()

        probe(0.5 * capacity)
        while len(grid) < MAX_PROBES and min(grid)[1] < max(LOAD_GOODPUTS):
            probe(min(grid)[0] / RATE_STEP)
        while len(grid) < MAX_PROBES and max(grid)[1] >= min(LOAD_GOODPUTS):
            probe(max(grid)[0] * RATE_STEP)
    grid.sort()
    loads = {f"{goodput:.0%}": rate_for(grid, goodput) for goodput in LOAD_GOODPUTS}
    missing = [load for load, rate in loads.items() if rate is None]
    if missing:
        raise ConfigError(
            f"fcfs's goodput on the tuning seed did not cross {', '.join(missing)} on the rates tried "
            f"({', '.join(f'{r:.2f}/s: {g:.0%}' for r, g in grid)}); raise --requests or lower --kv-tokens."
        )
    return {"capacity_arrivals_s": capacity, "grid": grid, "rates": loads}


def capacity_rate(model, tokenizer, sizes: dict, slo: dict, common: dict, mix: tuple = KINDS) -> float:
    """Arrivals per second fcfs gets through on the tuning seed: its requests per busy second
    when they all arrive at once, times the arrivals per request (a chat's later turns are not
    arrivals; rates count arrivals)."""
    burst = make_trace(tokenizer, TUNING_SEED, sizes["requests"], 1e6, sizes["scale"], mix)
    busy = serve_trace(model, tokenizer, burst, "fcfs", sizes, slo, common)["busy_s"]
    return sum(r.follows is None for r in burst) / busy


# ----------------------------------------------------------------------------- held-out seeds


def held_out(model, tokenizer, sizes: dict, loads: dict, slo: dict, common: dict, progress: bool) -> dict:
    """Every policy on every held-out seed at every load, the policies alternating within a seed."""
    results = {load: {policy: [] for policy in POLICIES} for load in loads}
    greedy_differs = {policy: 0 for policy in POLICIES}
    runs = len(loads) * len(sizes["seeds"]) * len(POLICIES)
    with progress_bar("held-out seeds: runs", runs, enabled=progress) as advance:
        for load, rate in loads.items():
            for seed in sizes["seeds"]:
                trace = make_trace(tokenizer, seed, sizes["requests"], rate, sizes["scale"])
                tokens = {}
                for policy in POLICIES:
                    run = serve_trace(model, tokenizer, trace, policy, sizes, slo, common)
                    tokens[policy] = run.pop("tokens")
                    results[load][policy].append({"seed": seed, **run})
                    advance()
                for policy in POLICIES:
                    greedy_differs[policy] += sum(a != b for a, b in zip(tokens[policy], tokens["fcfs"]))
    return {"runs": results, "outputs_differing_from_fcfs": greedy_differs}


def summarize(runs: dict) -> dict:
    """Per load and policy: mean and spread (min, max) over the seeds, and the ratio to fcfs."""
    summary = {}
    for load, by_policy in runs.items():
        summary[load] = {}
        fcfs = statistics.mean(run["goodput"] for run in by_policy["fcfs"])
        for policy, seeds in by_policy.items():
            goodputs = [run["goodput"] for run in seeds]
            mean = statistics.mean(goodputs)
            summary[load][policy] = {
                "goodput_mean": mean,
                "goodput_min": min(goodputs),
                "goodput_max": max(goodputs),
                "vs_fcfs": mean / fcfs if fcfs else None,
                "ttft_p99_mean_s": statistics.mean(run["ttft_p99_s"] for run in seeds),
                "tpot_p50_mean_s": statistics.mean(run["tpot_p50_s"] for run in seeds),
                "preemptions_mean": statistics.mean(run["preemptions"] for run in seeds),
                "recomputed_tokens_mean": statistics.mean(run["recomputed_tokens"] for run in seeds),
                "recompute_share_mean": statistics.mean(run["recompute_share"] for run in seeds),
                "goodput_by_kind_mean": _by_kind_means([run["goodput_by_kind"] for run in seeds]),
            }
    return summary


def _by_kind_means(by_kind: list[dict]) -> dict:
    """Each kind's mean over the seeds whose trace has it (a small trace may lack one)."""
    kinds = sorted({kind for goodputs in by_kind for kind in goodputs})
    return {kind: statistics.mean(g[kind] for g in by_kind if kind in g) for kind in kinds}


def sustained_rates(runs: dict, loads: dict) -> dict:
    """Per policy, the rate whose mean goodput over the held-out seeds is SUSTAINED, interpolated
    between the loads measured (None where both loads are on one side of it)."""
    rates = {}
    for policy in POLICIES:
        points = [
            (loads[load], statistics.mean(run["goodput"] for run in runs[load][policy])) for load in loads
        ]
        rates[policy] = rate_for(points, SUSTAINED)
    return rates


# ----------------------------------------------------------------------------- the scheduler's own cost


def scheduler_cost(model, tokenizer, queue_lengths: tuple[int, ...], common: dict) -> dict:
    """schedule()'s time per step (median of 20 steps) with each of `queue_lengths` requests
    queued, per policy: the policy's own work as the queue grows. Short requests, half of them
    sharing a system prompt."""
    rng = random.Random(TUNING_SEED)
    system = [rng.randrange(1000, 20000) for _ in range(128)]
    costs = {}
    for policy in POLICIES:
        costs[policy] = {}
        for waiting in queue_lengths:
            engine = llm_for(model, tokenizer, policy, 2048, common).engine
            for index in range(waiting):
                prompt = (system if index % 2 else []) + [rng.randrange(1000, 20000) for _ in range(32)]
                engine.add_request(prompt, SamplingParams(max_tokens=32, ignore_eos=True))
            costs[policy][waiting] = _schedule_ms(engine)
    return costs


def _schedule_ms(engine, steps: int = 20) -> float:
    for _ in range(steps):
        engine.step()
    return 1e3 * statistics.median(list(engine.stats.schedule_s)[-steps:])


# ----------------------------------------------------------------------------- the whole run


def bench_scheduling(
    model_dir,
    quick: bool = False,
    num_requests: int | None = None,
    kv_tokens: int | None = None,
    seeds: tuple[int, ...] | None = None,
    rates: tuple[float, ...] | None = None,
    threads: int = 1,
    dtype: str = "auto",
    device: str = "cpu",
    progress: bool = False,
) -> dict:
    sizes = dict(SIZES["quick" if quick else "full"])
    given = {"requests": num_requests, "kv_tokens": kv_tokens, "seeds": seeds}
    sizes.update({key: value for key, value in given.items() if value is not None})
    if TUNING_SEED in sizes["seeds"]:
        raise ConfigError(f"seed {TUNING_SEED} is the tuning seed; report on others (--seeds 1,2,3).")
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dtype = resolve_dtype(dtype, device)
        model, tokenizer = load_model(model_dir, DTYPES[dtype], device), Tokenizer(model_dir)
        measured = measure(model, tokenizer, sizes, rates, {"dtype": dtype, "device": device}, progress)
    finally:
        torch.set_num_threads(default_threads)
    return {
        "machine": {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "torch_threads": threads},
        "model_dir": str(model_dir),
        "dtype": dtype,
        "sizes": {
            **sizes,
            "seeds": list(sizes["seeds"]),
            "cost_waiting": list(sizes["cost_waiting"]),
            "tuning_seed": TUNING_SEED,
        },
        **measured,
    }


def measure(model, tokenizer, sizes: dict, rates: tuple[float, ...] | None, common: dict, progress: bool):
    """The SLOs and the loads from the tuning seed (or the rates given), the held-out runs, the
    scheduler's cost: the report's measured part, in its order."""
    tuning = make_trace(tokenizer, TUNING_SEED, sizes["requests"], 1.0, sizes["scale"])
    check_pool(tuning, sizes["kv_tokens"])
    slo = calibrate(model, tokenizer, tuning, common)
    found = (
        {"capacity_arrivals_s": None, "grid": [], "rates": {f"{rate:g}/s": rate for rate in rates}}
        if rates
        else find_loads(model, tokenizer, sizes, slo, common, progress)
    )
    measured = held_out(model, tokenizer, sizes, found["rates"], slo, common, progress)
    return {
        "trace": describe_trace(tuning, TUNING_SEED, 1.0, sizes["scale"]),
        "slo": slo,
        "loads": found,
        "summary": summarize(measured["runs"]),
        "sustained_rate": sustained_rates(measured["runs"], found["rates"]),
        "outputs_differing_from_fcfs": measured["outputs_differing_from_fcfs"],
        "scheduler_cost_ms": scheduler_cost(model, tokenizer, sizes["cost_waiting"], common),
        "runs": measured["runs"],
    }
