"""The store's two claims, measured: a shared prefix read from the store instead of computed
again, and a step that never waits for the store.

1. **Time to first token through the store.** A long shared prefix (`prefix_tokens` of prose) and a
   question go to engine A, which computes them and writes the prefix's full blocks to the store in
   the background. The same prefix with another question then goes to engine B (which never saw
   it): B's prompt misses its own cache, asks the store, waits in the queue while the blocks come
   back, and computes only the question. Beside it, engine C, with no store, computes the whole
   prompt; and A, asked again, finds the prefix in its own cache (the request a KV-aware router
   sends home). Each a fresh prefix per repeat, fp32 and greedy: B's answer must equal C's token
   for token (the store's bytes are the pool's bytes).
2. **The step never waits on the store.** One engine in this process decodes a few streams while
   new prompts arrive, each answered with one token: each asks the store for its blocks (which it
   does not hold: a miss), waits in the queue, is prefilled, and has its blocks written. Against a
   store behind `delay_proxy`, which holds every reply `delay_s`, and against no store at all,
   alternating; compared: the median of the steps that only decoded the streams, the same work in
   both. What the store may cost such a step is what the engine thread does for it (queue a
   write) and what the store's threads take from it (the worker, the proxy in this process).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from minillm.benchmarks import torch_threads
from minillm.benchmarks.delay_proxy import delay_proxy
from minillm.benchmarks.fleet.processes import engines
from minillm.benchmarks.http_client import Endpoint, model_name
from minillm.benchmarks.serve_child import metrics
from minillm.benchmarks.serve_http_workload import send
from minillm.benchmarks.stats import spread
from minillm.benchmarks.workload import Prose
from minillm.config import ConfigError, EngineConfig
from minillm.engine import LLMEngine, SamplingParams
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model_for

ANSWER_TOKENS = 16  # each answer's greedy tokens, compared between B and C
QUESTION_TOKENS = 24
WRITTEN_S = 60.0  # the longest A's background writes may take to land in the store


def _written(endpoint: Endpoint) -> int:
    return metrics(endpoint)["remote_kv_blocks_written_total"]


def _wait_written(endpoint: Endpoint, blocks: int) -> None:
    deadline = time.monotonic() + WRITTEN_S
    while _written(endpoint) < blocks:
        if time.monotonic() > deadline:
            raise ConfigError(
                f"{endpoint.url} wrote fewer than {blocks} blocks to the store in {WRITTEN_S:g} s"
            )
        time.sleep(0.05)


def store_ttft(model_dir, store_url: str, prefix_tokens: int, repeats: int, serve_args: list[str]) -> dict:
    """TTFT of the same shared prefix on B through the store, on C recomputing it, on A at home;
    the bytes B read; whether B's and C's greedy answers agree."""
    tokenizer = Tokenizer(model_dir)
    prose, rng = Prose(tokenizer), random.Random(0)
    args = ["--model", str(model_dir), "--threads", "1", "--dtype", "float32", *serve_args]
    rows = []
    with engines(2, [*args, "--remote-kv", store_url]) as (a, b), engines(1, args) as (c,):
        model = model_name(a)
        for repeat in range(repeats + 1):  # the first is a warm-up, not reported
            prefix = prose.cut(prefix_tokens, rng)
            first, second = prose.cut(QUESTION_TOKENS, rng), prose.cut(QUESTION_TOKENS, rng)
            written = _written(a)
            asyncio.run(send(a, model, prefix + first, ANSWER_TOKENS))
            _wait_written(a, written + prefix_tokens // _block_size(a))
            read_before = metrics(b)["remote_kv_bytes_read_total"]
            store = asyncio.run(send(b, model, prefix + second, ANSWER_TOKENS))
            recompute = asyncio.run(send(c, model, prefix + second, ANSWER_TOKENS))
            home = asyncio.run(send(a, model, prefix + second, ANSWER_TOKENS))
            failed = [x.error for x in (store, recompute, home) if x.error]
            if failed:
                raise ConfigError(f"a store TTFT request failed: {failed[0]}")
            if repeat:
                rows.append(
                    {
                        "store_s": store.ttft_s,
                        "recompute_s": recompute.ttft_s,
                        "home_s": home.ttft_s,
                        "bytes_read": metrics(b)["remote_kv_bytes_read_total"] - read_before,
                        "identical": store.token_ids == recompute.token_ids == home.token_ids,
                    }
                )
    ratios = [row["recompute_s"] / row["store_s"] for row in rows]
    return {
        "prefix_tokens": prefix_tokens,
        "repeats": rows,
        "store_s": spread([row["store_s"] for row in rows]),
        "recompute_s": spread([row["recompute_s"] for row in rows]),
        "home_s": spread([row["home_s"] for row in rows]),
        "recompute_over_store": spread(ratios),
        "bytes_read": statistics.median(row["bytes_read"] for row in rows),
        "identical": all(row["identical"] for row in rows),
    }


def _block_size(endpoint: Endpoint) -> int:
    return int(metrics(endpoint)["kv_block_size"])


# ----------------------------------------------------------------------------- the step and a slow store


def _decode_steps(
    engine: LLMEngine, streams: list[list[int]], arrivals: list[list[int]], sizes: dict
) -> list[float]:
    """`streams` decode `sizes["stream_tokens"]` tokens each; while they do, a prompt of `arrivals`
    comes every `sizes["every"]` steps and is answered with one token (it asks the store for its
    blocks, waits, is prefilled, writes its blocks). The seconds of each step that only decoded the
    streams: the same work with a store and without."""
    for prompt in streams:
        engine.add_request(prompt, SamplingParams(max_tokens=sizes["stream_tokens"], ignore_eos=True))
    pending, seconds, calls = list(arrivals), [], 0
    while pending or engine.has_unfinished_requests():
        if pending and calls % sizes["every"] == 0:
            engine.add_request(pending.pop(0), SamplingParams(max_tokens=1))
        calls += 1
        steps, start = engine.stats.steps, time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        batch = engine.stats.batches[-1] if engine.stats.steps > steps else []
        if len(batch) == len(streams) and all(tokens == 1 for _, tokens in batch):
            seconds.append(took)
    return seconds


def step_with_slow_store(model_dir, store_url: str, delay_s: float, sizes: dict) -> dict:
    """Median decode step with no store, and with the store behind a proxy delaying every reply by
    `delay_s`, alternating `sizes["repeats"]` times; fresh prompts each run (the store misses, and
    every arrival's blocks are written)."""
    with torch_threads(1):  # one thread, as each engine of the fleet
        steps = _alternated(model_dir, store_url, delay_s, sizes)
    slow = next(name for name in steps if name != "no store")
    medians = {name: statistics.median(values) for name, values in steps.items()}
    return {
        "delay_s": delay_s,
        "streams": sizes["streams"],
        "steps": {name: len(values) for name, values in steps.items()},
        "median_step_ms": {name: 1000 * value for name, value in medians.items()},
        "slow_over_none": medians[slow] / medians["no store"],
    }


def _alternated(model_dir, store_url: str, delay_s: float, sizes: dict) -> dict[str, list[float]]:
    """The decode steps' seconds with no store and with the slow one, the two alternating."""
    served = {"dtype": "auto", "weights": "auto", "prefix_caching": True}  # as `minillm serve` runs
    model, tokenizer = load_model_for(EngineConfig(model_dir=model_dir, **served)), Tokenizer(model_dir)
    prose, rng = Prose(tokenizer), random.Random(1)
    host, port = store_url.removeprefix("redis://").rsplit(":", 1)
    slow = f"store +{delay_s * 1000:g} ms"
    steps: dict[str, list[float]] = {"no store": [], slow: []}
    with delay_proxy(int(port), delay_s, host) as proxy_port:
        urls = {"no store": None, slow: f"redis://127.0.0.1:{proxy_port}"}
        for _ in range(sizes["repeats"]):
            for name, url in urls.items():
                config = EngineConfig(model_dir=model_dir, remote_kv=url, **served)
                engine = LLMEngine(config, model, tokenizer)
                streams = [prose.cut(sizes["stream_prompt"], rng) for _ in range(sizes["streams"])]
                count = sizes["stream_tokens"] // sizes["every"]
                arrivals = [prose.cut(sizes["prompt_tokens"], rng) for _ in range(count)]
                steps[name] += _decode_steps(engine, streams, arrivals, sizes)
    return steps
