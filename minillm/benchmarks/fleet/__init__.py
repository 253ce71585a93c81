"""`minillm bench fleet`: the memory system across processes, measured: engines in their own
processes sharing a KV store on a real `redis-server`, behind a KV-aware router.

The run, in order (each part starts its own processes, on free ports, and stops them):
  1. the store: a shared prefix computed on engine A, then asked of engine B: TTFT through the
     store against B recomputing it and against A at home; bytes read; fp32 greedy answers equal
     (`store.py`);
  2. the step with a slow store: the median decode step with no store, and with a store whose
     every reply a proxy holds 50 ms, while prompts come and go (`store.py`, `delay_proxy.py`);
  3. the router: SLOs on one idle engine, the loads where one engine's first-come-first-served
     goodput crosses 80% and 50% (tuning seed), then round-robin against the KV-aware router over
     N engines at N times each load, the store off then on, on held-out seeds (`routing.py`).

The package, in the order a run reads it:
  processes.py  the children: redis-server, minillm serve, minillm route
  store.py      parts 1 and 2
  routing.py    part 3
  tables.py     the report: `print_fleet_report`
"""

from __future__ import annotations

from minillm.benchmarks.fleet.processes import redis_server
from minillm.benchmarks.fleet.routing import compare_policies, find_loads, measure_slos
from minillm.benchmarks.fleet.store import step_with_slow_store, store_ttft
from minillm.benchmarks.fleet.tables import print_fleet_report

SIZES = {
    "full": {
        "engines": 2,
        "requests": 80,
        "scale": 0.35,
        "kv_cache_mb": 16,
        "seeds": (1, 2),
        "tuning_seed": 0,
        "first_rate": 1.0,
        "prefix_tokens": 1000,
        "ttft_repeats": 3,
        "delay_s": 0.05,
        "step": {
            "repeats": 3,
            "streams": 4,
            "stream_prompt": 64,
            "stream_tokens": 96,
            "prompt_tokens": 256,
            "every": 4,
        },
    },
    "quick": {
        "engines": 2,
        "requests": 32,
        "scale": 0.25,
        "kv_cache_mb": 8,
        "seeds": (1,),
        "tuning_seed": 0,
        "first_rate": 1.0,
        "prefix_tokens": 512,
        "ttft_repeats": 1,
        "delay_s": 0.05,
        "step": {
            "repeats": 1,
            "streams": 2,
            "stream_prompt": 32,
            "stream_tokens": 32,
            "prompt_tokens": 128,
            "every": 4,
        },
    },
}
PARTS = ("store", "step", "router")


def bench_fleet(
    model_dir, size: str = "full", parts: tuple[str, ...] = PARTS, rate: float | None = None, progress=None
) -> dict:
    """The parts asked for; `rate`: the fleet's arrival rate (requests/s), instead of finding the load."""
    sizes, say, shown = SIZES[size], progress or (lambda _: None), progress is not None
    report: dict = {"size": size, "sizes": sizes}
    if "store" in parts or "step" in parts:
        with redis_server() as store_url:
            if "store" in parts:
                say("the store: a shared prefix on engine A, then on B")
                report["store"] = store_ttft(
                    model_dir, store_url, sizes["prefix_tokens"], sizes["ttft_repeats"], []
                )
            if "step" in parts:
                say(f"the step, with a store {sizes['delay_s'] * 1000:g} ms away and with none")
                report["step"] = step_with_slow_store(model_dir, store_url, sizes["delay_s"], sizes["step"])
    if "router" in parts:
        slo = measure_slos(model_dir, sizes)
        report["slo"] = slo
        if rate is None:
            report["loads"] = find_loads(model_dir, sizes, slo, say)
            rates = {f"{g:.0%}": r * sizes["engines"] for g, r in report["loads"]["rates"].items()}
        else:
            rates = {"given": rate}
        report["router"] = {
            load: {
                "fleet_rate": fleet_rate,
                **compare_policies(model_dir, sizes, fleet_rate, slo, say, shown),
            }
            for load, fleet_rate in rates.items()
        }
    return report


__all__ = ["PARTS", "SIZES", "bench_fleet", "print_fleet_report"]
