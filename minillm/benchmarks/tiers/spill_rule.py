"""Part 4 of `bench tiers`: which cached blocks are worth a copy to the host tier (the `spill` rule).

The spill rung copies a cached prefix block to the host when the device takes its block back, so a
later prompt can copy it home instead of recomputing it. Lesson 15's trace showed what copying
every one buys: 140 of 142 spilled blocks were never read again, because most cached blocks are a
document's or an answer's, read once, and each copy of one pushes a spilled block that would have
been read out of the host's LRU. `spill="reused"` copies only blocks a prompt read again (or
computed again after they were dropped: `prefix_cache.py`).

Both rules replay `bench scheduling`'s mixed trace (short questions, requests on shared system
prompts, conversations that resend themselves turn after turn, long documents, long answers) on a
step clock (`replay`'s `step_s`: each arrival lands on the same step on any machine, so the block
moves are the run's own, not the machine's speed), through a device pool and a host tier both
smaller than the traffic, preempting by recompute so the host holds spilled blocks only. The rule
was chosen on lesson 15's trace and on seed 0; the rows are other seeds. Greedy tokens must not
change: a spill only decides what is copied, never what is read.
"""

from __future__ import annotations

from minillm.benchmarks.scheduling.replay import replay
from minillm.benchmarks.scheduling.trace import make_trace
from minillm.benchmarks.stats import spread
from minillm.benchmarks.workload import BLOCK_SIZE, pool_bytes
from minillm.engine import LLM
from minillm.progress import progress_bar

SPILL_RULES = ("all", "reused")
TUNING_SEED = 0  # the trace seed the rule was chosen on (with lesson 15's trace): never a reported one
STEP_S = 0.05  # the step clock: a trace second is 20 engine steps
# the trace's lengths scale (as `bench scheduling`'s), its arrivals per trace second, the pools in tokens
SIZES = {"scale": 0.35, "rate": 2.0, "device_tokens": 640, "host_tokens": 960}


def spill_run(model, tokenizer, trace, rule: str, sizes: dict, switches: dict) -> tuple[dict, list]:
    """One rule on one trace: what it spilled, what came back, and the prefix cache's hits."""
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        block_size=BLOCK_SIZE,
        prefix_caching=True,
        kv_cache_bytes=pool_bytes(model, sizes["device_tokens"]),
        host_cache_bytes=pool_bytes(model, sizes["host_tokens"]),
        preemption="recompute",
        spill=rule,
        **switches,
    )
    served, busy, steps = replay(llm.engine, tokenizer, trace, step_s=STEP_S)
    memory = llm.engine.snapshot()
    spilled = memory.counters["spilled"]
    return {
        "spilled_blocks": spilled,
        "spilled_bytes": spilled * BLOCK_SIZE * memory.bytes_per_token,
        "spill_hits": memory.counters["spill_hits"],
        "block_hit_rate": memory.prefix_cache["block_hit_rate"],
        "prefill_tokens_saved": memory.prefix_cache["prefill_tokens_saved"],
        "busy_s": busy,
        "steps": steps,
    }, [s.token_ids for s in served]


def bench_spill_rule(model, tokenizer, seeds: tuple[int, ...], requests: int, switches: dict, progress: bool):
    """Every rule on every seed's trace of about `requests` requests, the rules alternating within a
    seed; medians over the seeds."""
    sizes = {**SIZES, "requests": requests}
    runs: dict[str, list[dict]] = {rule: [] for rule in SPILL_RULES}
    outputs_differ = 0
    with progress_bar("spill rule: runs", len(seeds) * len(SPILL_RULES), enabled=progress) as advance:
        for seed in seeds:
            trace = make_trace(tokenizer, seed, sizes["requests"], sizes["rate"], sizes["scale"])
            tokens = {}
            for rule in SPILL_RULES:
                run, tokens[rule] = spill_run(model, tokenizer, trace, rule, sizes, switches)
                runs[rule].append({"seed": seed, **run})
                advance()
            outputs_differ += sum(a != b for a, b in zip(tokens["all"], tokens["reused"]))
    # spilled bytes, all over reused: a ratio of block counts (reused's at least 1, so never infinite)
    fewer = [a["spilled_blocks"] / max(r["spilled_blocks"], 1) for a, r in zip(runs["all"], runs["reused"])]
    hit_change = [r["block_hit_rate"] - a["block_hit_rate"] for a, r in zip(runs["all"], runs["reused"])]
    return {
        "sizes": {**sizes, "step_s": STEP_S, "seeds": list(seeds)},
        "runs": runs,
        "spilled_bytes_all_over_reused": spread(fewer),
        "hit_rate_reused_minus_all": spread(hit_change),
        "outputs_differing": outputs_differ,
    }
