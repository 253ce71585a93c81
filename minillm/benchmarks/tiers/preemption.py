"""Tiers, part 1: preemption by recompute, swap or auto on a seeded trace (`workload.uniform_trace`:
prompts on a shared system prompt, Poisson arrivals), served by `workload.run_trace`."""

from __future__ import annotations

from minillm.benchmarks.stats import tails
from minillm.benchmarks.workload import BLOCK_SIZE, blocks_for, pool_bytes, run_trace, uniform_trace
from minillm.config import SWITCHES, ConfigError
from minillm.engine import LLM

PROMPT_LEN, OUTPUT_LEN = (16, 96), (8, 40)  # tokens, uniform; the preemption trace
SYSTEM_LEN = 2 * BLOCK_SIZE  # every prompt opens with these tokens: blocks the prefix cache shares
SEED = 0


def preemption_row(engine, outputs: list, elapsed: float, cpu_s: float) -> dict:
    memory = engine.snapshot()
    counters = memory.counters
    ttft = [out.ttft for out in outputs if out.ttft is not None]
    hidden = 1 - memory.prefetch_waited / memory.prefetch_seconds if memory.prefetch_seconds else None
    return {
        "output_tok_s": sum(len(out.token_ids) for out in outputs) / elapsed,
        "elapsed_s": elapsed,
        "cpu_s": cpu_s,
        "steps": engine.stats.steps,
        "errors": sum(out.error is not None for out in outputs),
        **tails("ttft", ttft),
        "preemptions": counters["preemptions"],
        "recomputed_tokens": counters["recomputed_tokens"],
        "swapped_out": counters["swapped_out"],
        "swapped_in": counters["swapped_in"],
        "swap_copies_saved": counters["swap_copies_saved"],
        "bytes_moved": memory.stats.bytes_moved,
        "prefetched": counters["prefetched"],
        "prefetch_copy_s": memory.prefetch_seconds,
        "prefetch_waited_s": memory.prefetch_waited,
        "prefetch_hidden": hidden,
    }


def preemption_run(
    model, tokenizer, trace, preemption: str, pools: tuple[int, int], switches: dict, progress: bool = False
) -> tuple[dict, list, object]:
    """`trace` served with `preemption` on `pools` (device KV bytes, and the host pool's behind it):
    the row, each request's output in trace order, and the engine's snapshot after (what `auto`
    chose, and the rates it chose by). Lessons 10 and 11 serve their traces with it."""
    device_bytes, host_bytes = pools
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=device_bytes,
        host_cache_bytes=host_bytes,
        preemption=preemption,
        **switches,
    )
    finished, elapsed, cpu_s = run_trace(llm.engine, trace, preemption, progress)
    return preemption_row(llm.engine, finished, elapsed, cpu_s), finished, llm.engine.snapshot()


def bench_preemption(
    model, tokenizer, num_requests: int, rate: float, device_tokens: int, switches: dict, progress: bool
) -> dict:
    trace = uniform_trace(tokenizer, num_requests, PROMPT_LEN, OUTPUT_LEN, SEED, rate, shared_len=SYSTEM_LEN)
    longest = max(len(r.prompt_ids) + r.output_len for r in trace)
    if blocks_for(device_tokens) < blocks_for(longest):
        raise ConfigError(
            f"--device-tokens {device_tokens} cannot hold the trace's longest request ({longest} "
            "tokens); raise it."
        )
    device_bytes = pool_bytes(model, device_tokens)
    # the host pool holds all of it
    host_bytes = pool_bytes(model, sum(len(r.prompt_ids) + r.output_len + BLOCK_SIZE for r in trace))
    rows, outputs = {}, {}
    pools, with_prefixes = (device_bytes, host_bytes), {"prefix_caching": True, **switches}
    for preemption in SWITCHES["preemption"].choices:
        run = preemption_run(model, tokenizer, trace, preemption, pools, with_prefixes, progress)
        rows[preemption], finished, _ = run
        outputs[preemption] = [out.token_ids for out in finished]
    differing = sum(any(ids != answers[0] for ids in answers) for answers in zip(*outputs.values()))
    return {
        "trace": {
            "requests": num_requests,
            "rate_per_s": rate,
            "seed": SEED,
            "prompt_len": f"{SYSTEM_LEN} shared + U{list(PROMPT_LEN)}",
            "output_len": f"U{list(OUTPUT_LEN)}",
            "prompt_tokens": sum(len(r.prompt_ids) for r in trace),
            "output_tokens": sum(r.output_len for r in trace),
            "last_arrival_s": trace[-1].arrival_s,
        },
        "device_kv_bytes": device_bytes,
        "device_blocks": blocks_for(device_tokens),
        "host_kv_bytes": host_bytes,
        "rows": rows,
        "outputs_identical": differing == 0,
        "requests_differing": differing,
    }
