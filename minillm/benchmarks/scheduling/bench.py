"""The run of `minillm bench scheduling`: the SLOs, the loads (found on the tuning seeds), every
row on every held-out seed at every load, the sustained rates, how well the learned lengths rank,
and the scheduler's own cost."""

from __future__ import annotations

import math
import random
import statistics

from minillm.benchmarks import machine, torch_threads
from minillm.benchmarks.memory.rows import calibrate  # the SLOs: as `bench memory` sets its targets
from minillm.benchmarks.scheduling.lengths import RecordedLengths, predictor_for, rank_quality
from minillm.benchmarks.scheduling.replay import replay
from minillm.benchmarks.scheduling.trace import KINDS, describe_trace, make_trace
from minillm.benchmarks.stats import spread, tails
from minillm.config import DTYPES, ConfigError, EngineConfig, resolve_dtype
from minillm.engine import LLMEngine, SamplingParams
from minillm.progress import progress_bar
from minillm.tokenizer import Tokenizer, end_of_sequence
from minillm.weights import load_model

# the rows: a name -> (its admission, the output lengths memory-aware admission is given, whether
# it is told the TTFT target). Every admission order that chooses who joins (reserve, each request
# holding its maximum length, is the pre-paging baseline `bench memory` measures); memory-aware
# admission with the lengths it learns and the TTFT SLO as its target, and, to say what each part
# buys, with the mean length of finished requests (what it used before it learned shapes), with the
# trace's true lengths (the ceiling; `lengths.py`), and without the target (lesson 13 runs it).
ROWS = {
    "fcfs": ("fcfs", None, False),
    "lpm": ("lpm", None, False),
    "memory": ("memory", "learned", True),
    "memory, no TTFT target": ("memory", "learned", False),
    "memory, mean length": ("memory", "mean", True),
    "memory, oracle length": ("memory", "oracle", True),
}
POLICIES = ("fcfs", "lpm", "memory")  # the rows at every load
HEAVIEST = (*POLICIES, "memory, mean length", "memory, oracle length")  # at the heaviest load
TUNING_SEED = 0  # the seed whose trace calibrates the SLOs and the capacity
# the three loads: where fcfs reaches these goodputs on the tuning seeds (the lightest one so that
# the rate keeping SUSTAINED goodput lies between two loads, not beyond them)
LOAD_GOODPUTS = (0.5, 0.8, 0.95)
SUSTAINED = 0.9  # the goodput a sustained rate keeps
RATE_STEP, MAX_PROBES = 2**0.5, 8  # the tuning rates: each a neighbour's times or over RATE_STEP

SIZES = {
    # seeds: held out (reported); tuning_seeds: where the loads are found (never reported);
    # cost_waiting: the queue lengths the scheduler's own cost is measured at
    "full": {
        "requests": 120,
        "scale": 0.35,
        "kv_tokens": 640,
        "seeds": (1, 2, 3, 4, 5),
        "tuning_seeds": (0, 6, 7, 8, 9),
        "cost_waiting": (100, 10_000),
    },
    "quick": {
        "requests": 96,
        "scale": 0.25,
        "kv_tokens": 320,
        "seeds": (1, 2),
        "tuning_seeds": (0, 6, 7),
        "cost_waiting": (100, 2_000),
    },
}


# ----------------------------------------------------------------------------- one run


def engine_for(
    model, tokenizer, row: str, kv_tokens: int, slo: dict, common: dict, lengths=None
) -> LLMEngine:
    """An engine with the prefix cache on and a pool of `kv_tokens` tokens of the model's dtype,
    admitting as `row` says: memory-aware admission with the `lengths` predictor, told the TTFT
    target (the SLO) or not."""
    admission, _, told_target = ROWS[row]
    kv_bytes = kv_tokens * model.config.kv_bytes_per_token(model.dtype)
    switches = {"admission": admission, "prefix_caching": True, "kv_cache_bytes": kv_bytes, **common}
    if told_target:
        switches["ttft_target"] = slo["ttft_s"]
    return LLMEngine(EngineConfig(**switches), model, tokenizer, output_lengths=lengths)


def serve_trace(model, tokenizer, trace, row: str, sizes: dict, slo: dict, common: dict) -> dict:
    """One row on one trace: goodput (TTFT and TPOT both within their SLOs), latencies, every
    request's tokens (for the greedy comparison), and how well the learned lengths ranked."""
    script = {str(index): request.output_len for index, request in enumerate(trace)}
    eos_token_ids = end_of_sequence(model.config.eos_token_ids, tokenizer)  # close a chat's messages
    lengths = predictor_for(ROWS[row][1], eos_token_ids, script) if ROWS[row][1] else None
    engine = engine_for(model, tokenizer, row, sizes["kv_tokens"], slo, common, lengths)
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
        **tails("ttft", ttft),
        **tails("tpot", tpot),
        "busy_s": busy,
        "steps": steps,
        "preemptions": engine.num_preemptions,
        "recomputed_tokens": recomputed,
        # busy time spent prefilling again what preemption threw away, at the idle prefill's rate
        "recompute_share": recomputed * slo["prefill_alone_s"] / slo["longest_prompt"] / busy,
        "prefix_hit_rate": memory.prefix_cache["hit_rate"],
        "lengths": rank_quality(lengths.first, trace) if isinstance(lengths, RecordedLengths) else None,
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
    """On the tuning seeds only: fcfs on each, from its capacity at rates falling by RATE_STEP
    until most seeds reach the lightest load's goodput, and rising until most fall below the
    heaviest's. A load's rate is the median of the rates where each seed's goodput crosses it:
    one seed's bursts do not set the loads for all."""
    capacity = capacity_rate(model, tokenizer, sizes, slo, common)
    seeds = sizes["tuning_seeds"]
    grids: dict[int, list[tuple[float, float]]] = {seed: [] for seed in seeds}  # (rate, fcfs goodput)
    with progress_bar(
        "loads: fcfs on the tuning seeds", MAX_PROBES * len(seeds), enabled=progress
    ) as advance:

        def probe(rate: float) -> None:
            for seed in seeds:
                trace = make_trace(tokenizer, seed, sizes["requests"], rate, sizes["scale"])
                grids[seed].append(
                    (rate, serve_trace(model, tokenizer, trace, "fcfs", sizes, slo, common)["goodput"])
                )
                advance()

        def median_at(end) -> float:  # the seeds' median goodput at the lowest (min) or highest (max) rate
            return statistics.median(end(grid)[1] for grid in grids.values())

        probe(capacity)
        while len(grids[seeds[0]]) < MAX_PROBES and median_at(min) < max(LOAD_GOODPUTS):
            probe(min(grids[seeds[0]])[0] / RATE_STEP)
        while len(grids[seeds[0]]) < MAX_PROBES and median_at(max) >= min(LOAD_GOODPUTS):
            probe(max(grids[seeds[0]])[0] * RATE_STEP)
    loads, crossings = {}, {}
    for goodput in LOAD_GOODPUTS:
        crossed = [rate_for(grid, goodput) for grid in grids.values()]
        crossings[f"{goodput:.0%}"] = crossed
        found = [rate for rate in crossed if rate is not None]
        loads[f"{goodput:.0%}"] = statistics.median(found) if 2 * len(found) > len(seeds) else None
    missing = [load for load, rate in loads.items() if rate is None]
    if missing:
        grid = ", ".join(
            f"seed {seed}: " + " ".join(f"{r:.2f}/s {g:.0%}" for r, g in sorted(points))
            for seed, points in grids.items()
        )
        raise ConfigError(
            f"fcfs's goodput on most tuning seeds did not cross {', '.join(missing)} on the rates tried "
            f"({grid}); raise --requests or lower --kv-tokens."
        )
    return {
        "capacity_arrivals_s": capacity,
        "grids": {seed: sorted(grid) for seed, grid in grids.items()},
        "crossings": crossings,
        "rates": loads,
    }


def capacity_rate(model, tokenizer, sizes: dict, slo: dict, common: dict, mix: tuple = KINDS) -> float:
    """Arrivals per second fcfs gets through on the tuning seed: its requests per busy second
    when they all arrive at once, times the arrivals per request (a chat's later turns are not
    arrivals; rates count arrivals)."""
    burst = make_trace(tokenizer, TUNING_SEED, sizes["requests"], 1e6, sizes["scale"], mix)
    busy = serve_trace(model, tokenizer, burst, "fcfs", sizes, slo, common)["busy_s"]
    return sum(r.follows is None for r in burst) / busy


# ----------------------------------------------------------------------------- held-out seeds


def held_out(model, tokenizer, sizes: dict, loads: dict, slo: dict, common: dict, progress: bool) -> dict:
    """Every row on every held-out seed at every load (the two other lengths at the heaviest load
    only), the rows alternating within a seed so drift hits them alike."""
    heaviest = max(loads, key=loads.get)
    rows_at = {load: HEAVIEST if load == heaviest else POLICIES for load in loads}
    results = {load: {row: [] for row in rows} for load, rows in rows_at.items()}
    greedy_differs = {row: 0 for row in HEAVIEST}
    runs = sum(len(rows) for rows in rows_at.values()) * len(sizes["seeds"])
    with progress_bar("held-out seeds: runs", runs, enabled=progress) as advance:
        for load, rate in loads.items():
            for seed in sizes["seeds"]:
                trace = make_trace(tokenizer, seed, sizes["requests"], rate, sizes["scale"])
                tokens = {}
                for row in rows_at[load]:
                    run = serve_trace(model, tokenizer, trace, row, sizes, slo, common)
                    tokens[row] = run.pop("tokens")
                    results[load][row].append({"seed": seed, **run})
                    advance()
                for row in rows_at[load]:
                    greedy_differs[row] += sum(a != b for a, b in zip(tokens[row], tokens["fcfs"]))
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
                "ttft_p50_mean_s": statistics.mean(run["ttft_p50_s"] for run in seeds),
            }
    return summary


def _by_kind_means(by_kind: list[dict]) -> dict:
    """Each kind's mean over the seeds whose trace has it (a small trace may lack one)."""
    kinds = sorted({kind for goodputs in by_kind for kind in goodputs})
    return {kind: statistics.mean(g[kind] for g in by_kind if kind in g) for kind in kinds}


def sustained_rates(runs: dict, loads: dict) -> dict:
    """Per policy, the rate whose mean goodput over the held-out seeds is SUSTAINED, interpolated
    between the two measured loads that bracket it (None where every load is on one side of it),
    and the loads' mean goodputs it was read from."""
    rates = {}
    for policy in POLICIES:
        points = sorted(
            (loads[load], statistics.mean(run["goodput"] for run in runs[load][policy])) for load in loads
        )
        rates[policy] = {"rate": rate_for(points, SUSTAINED), "points": points}
    return rates


def length_quality(runs: dict) -> dict:
    """How well the learned lengths ranked, over every held-out run of the memory row: the median
    and range of each measure over the runs."""
    measures = [run["lengths"] for by_row in runs.values() for run in by_row["memory"] if run["lengths"]]
    quality = {}
    for name in ("spearman", "spearman_first_third", "spearman_rest", "kind_ceiling"):
        values = [m[name] for m in measures if m[name] is not None]
        quality[name] = spread(values) if values else None
    return quality


# ----------------------------------------------------------------------------- the scheduler's own cost


def scheduler_cost(model, tokenizer, queue_lengths: tuple[int, ...], slo: dict, common: dict) -> dict:
    """schedule()'s time per step (median of 20 steps) with each of `queue_lengths` requests
    queued, per policy: the policy's own work as the queue grows. Short requests, half of them
    sharing a system prompt."""
    rng = random.Random(TUNING_SEED)
    system = [rng.randrange(1000, 20000) for _ in range(128)]
    costs = {}
    eos_token_ids = end_of_sequence(model.config.eos_token_ids, tokenizer)
    for policy in POLICIES:
        costs[policy] = {}
        for waiting in queue_lengths:
            lengths = predictor_for(ROWS[policy][1], eos_token_ids, {}) if ROWS[policy][1] else None
            engine = engine_for(model, tokenizer, policy, 2048, slo, common, lengths)
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
    tuned_on = sorted(set(sizes["seeds"]) & set(sizes["tuning_seeds"]))
    if tuned_on:
        tuning = ", ".join(map(str, sizes["tuning_seeds"]))
        raise ConfigError(
            f"seed {tuned_on[0]} is a tuning seed ({tuning}); report on others (--seeds 1,2,3)."
        )
    with torch_threads(threads):
        dtype = resolve_dtype(dtype, device)
        model, tokenizer = load_model(model_dir, DTYPES[dtype], device), Tokenizer(model_dir)
        measured = measure(model, tokenizer, sizes, rates, {"dtype": dtype, "device": device}, progress)
    return {
        "machine": machine(threads),
        "model_dir": str(model_dir),
        "dtype": dtype,
        "sizes": {
            **sizes,
            "seeds": list(sizes["seeds"]),
            "tuning_seeds": list(sizes["tuning_seeds"]),
            "cost_waiting": list(sizes["cost_waiting"]),
        },
        **measured,
    }


def measure(model, tokenizer, sizes: dict, rates: tuple[float, ...] | None, common: dict, progress: bool):
    """The SLOs and the loads from the tuning seeds (or the rates given), the held-out runs, the
    scheduler's cost: the report's measured part, in its order."""
    tuning = make_trace(tokenizer, TUNING_SEED, sizes["requests"], 1.0, sizes["scale"])
    check_pool(tuning, sizes["kv_tokens"])
    slo = calibrate(model, tokenizer, tuning, common)
    found = (
        {"capacity_arrivals_s": None, "grids": {}, "crossings": {}, "rates": {f"{r:g}/s": r for r in rates}}
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
        "lengths": length_quality(measured["runs"]),
        "outputs_differing_from_fcfs": measured["outputs_differing_from_fcfs"],
        "scheduler_cost_ms": scheduler_cost(model, tokenizer, sizes["cost_waiting"], slo, common),
        "runs": measured["runs"],
    }
