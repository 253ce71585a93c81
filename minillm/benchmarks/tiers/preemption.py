"""Tiers, part 1: preemption by recompute, swap or auto on a seeded trace, and the trace runner
(`run_trace`) that `bench memory` reuses."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

from minillm.benchmarks.stats import tails
from minillm.config import SWITCHES, ConfigError, EngineConfig
from minillm.engine import LLM, SamplingParams
from minillm.evaluation import read_text
from minillm.progress import progress_bar
from minillm.tokenizer import Tokenizer

BLOCK_SIZE = EngineConfig.block_size
PROMPT_LEN, OUTPUT_LEN = (16, 96), (8, 40)  # tokens, uniform; the preemption trace
SYSTEM_LEN = 2 * BLOCK_SIZE  # every prompt opens with these tokens: blocks the prefix cache shares
SEED = 0


@dataclass
class Request:
    prompt_ids: list[int]
    output_len: int
    arrival_s: float  # seconds after the trace starts


def make_trace(tokenizer: Tokenizer, num_requests: int, rate: float) -> list[Request]:
    """Prompts of the text's first SYSTEM_LEN tokens (a system prompt they all share), then a cut at
    a random offset of the same prose; exponential gaps of mean 1/rate seconds."""
    text_ids = tokenizer.encode(read_text())
    system = text_ids[:SYSTEM_LEN]
    rng = random.Random(SEED)
    trace, arrival = [], 0.0
    for _ in range(num_requests):
        prompt_len = rng.randint(*PROMPT_LEN)
        start = rng.randrange(len(text_ids) - prompt_len)
        prompt = system + text_ids[start : start + prompt_len]
        trace.append(Request(prompt, rng.randint(*OUTPUT_LEN), arrival))
        arrival += rng.expovariate(rate)
    return trace


def submit(engine, index: int, request: Request, arrival_time: float) -> None:
    """A trace request into the engine: decoded to exactly its output length, EOS ignored."""
    engine.add_request(
        request.prompt_ids,
        SamplingParams(max_tokens=request.output_len, ignore_eos=True),
        request_id=str(index),
        arrival_time=arrival_time,
    )


def run_trace(
    engine, trace: list, label: str, progress: bool, watch=None, add=submit
) -> tuple[list, float, float]:
    """Step the engine, adding each request once its arrival time has passed (with that time, so
    its TTFT counts the wait). Returns the finished outputs in trace order, the busy seconds, and
    the CPU seconds this process spent (which other work on a shared machine does not inflate).
    `watch(engine)`, if given, is called after every step (a caller's own accounting); `add` puts
    a request in (`submit` by default)."""
    pending = deque(enumerate(trace))
    finished = {}
    cpu_start = time.process_time()
    start = origin = time.perf_counter()  # origin: the perf_counter moment of trace time 0
    with progress_bar(f"{label}: requests", len(trace), enabled=progress) as advance:
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter()
            if not engine.has_unfinished_requests() and origin + pending[0][1].arrival_s > now:
                origin = now - pending[0][1].arrival_s  # idle: the clock jumps to the next arrival
            while pending and origin + pending[0][1].arrival_s <= now:
                index, request = pending.popleft()
                add(engine, index, request, origin + request.arrival_s)
            for out in engine.step():
                if out.finished:
                    finished[int(out.request_id)] = out
                    advance()
            if watch:
                watch(engine)
    return (
        [finished[index] for index in range(len(trace))],
        time.perf_counter() - start,
        time.process_time() - cpu_start,
    )


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


def bench_preemption(
    model, tokenizer, num_requests: int, rate: float, device_tokens: int, switches: dict, progress: bool
) -> dict:
    trace = make_trace(tokenizer, num_requests, rate)
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
    for preemption in SWITCHES["preemption"].choices:
        llm = LLM(
            model=model,
            tokenizer=tokenizer,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=device_bytes,
            host_cache_bytes=host_bytes,
            preemption=preemption,
            prefix_caching=True,
            **switches,
        )
        finished, elapsed, cpu_s = run_trace(llm.engine, trace, preemption, progress)
        rows[preemption] = preemption_row(llm.engine, finished, elapsed, cpu_s)
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


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def pool_bytes(model, num_tokens: int) -> int:
    """kv_cache_bytes that buys whole blocks for `num_tokens` tokens, in the model's dtype."""
    return blocks_for(num_tokens) * BLOCK_SIZE * model.config.kv_bytes_per_token(model.dtype)
