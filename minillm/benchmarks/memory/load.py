"""The load tests of `minillm bench memory`: closed-loop clients sending chat requests, at a fixed
count and on a doubling grid up to the first count that misses the p99 TTFT target."""

from __future__ import annotations

import random
import time

from minillm.benchmarks.memory.trace import KINDS, SEED, SYSTEM_PROMPTS, chat_prompt, chat_systems
from minillm.benchmarks.stats import tails
from minillm.benchmarks.workload import BLOCK_SIZE, Prose, scaled
from minillm.engine import LLM, SamplingParams
from minillm.progress import progress_bar

LOAD_OUTPUT, LOAD_TTFT_TIMES = 16, 5  # the load tests' requests: a chat, 16 tokens out
LOAD_ROWS = ("reserve", "paged", "lossless", "memory")


def closed_loop(
    model,
    tokenizer,
    prompts: list[list[int]],
    clients: int,
    per_client: int,
    switches: dict,
    kv_bytes: int,
    common: dict,
) -> dict:
    """`clients` clients, each sending `per_client` requests one after another (the next as soon as
    the last has answered); client c takes prompts c, c + clients, ... of the list."""
    llm = LLM(
        model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common, **switches
    )
    engine, params = llm.engine, SamplingParams(max_tokens=LOAD_OUTPUT, ignore_eos=True)
    sent, arrivals, ttft, latency, errors = [0] * clients, {}, [], [], 0

    def send(client: int) -> None:
        request_id = f"{client}:{sent[client]}"
        arrivals[request_id] = time.perf_counter()
        prompt = prompts[(client + sent[client] * clients) % len(prompts)]
        engine.add_request(prompt, params, request_id=request_id, arrival_time=arrivals[request_id])
        sent[client] += 1

    start = time.perf_counter()
    for client in range(clients):
        send(client)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                latency.append(time.perf_counter() - arrivals[out.request_id])
                errors += out.error is not None
                if out.error is None:
                    ttft.append(out.ttft)
                client = int(out.request_id.split(":")[0])
                if sent[client] < per_client:
                    send(client)
    return {
        "clients": clients,
        "requests": clients * per_client,
        "errors": errors,
        "elapsed_s": time.perf_counter() - start,
        **tails("latency", latency),
        **tails("ttft", ttft),
        "peak_seqs": max(map(len, engine.stats.batches)),
        "preemptions": engine.num_preemptions,
    }


def load_prompts(tokenizer, sizes: dict) -> list[list[int]]:
    """Chat requests like the trace's (one of its system prompts and a user turn cut from prose,
    seeded), enough for the largest client count to send its share."""
    scale = sizes["scale"]
    systems, prose = chat_systems(tokenizer, scale), Prose(tokenizer)
    rng = random.Random(SEED + 1)
    user_len = [scaled(n, scale) for n in KINDS[1].prompt_len]
    prompts = []
    for index in range(max(sizes["grid"] + (sizes["clients"],)) * sizes["load_requests"]):
        user_ids = prose.cut(rng.randint(*user_len), rng)
        prompts.append(chat_prompt(tokenizer, systems[index % SYSTEM_PROMPTS], user_ids))
    return prompts


def load_tests(
    model, tokenizer, rows: dict, kv_bytes: int, common: dict, sizes: dict, progress: bool
) -> dict:
    prompts = load_prompts(tokenizer, sizes)
    alone = LLM(model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common)
    prefill_s = min(
        alone.generate([prompts[0]], SamplingParams(max_tokens=1, ignore_eos=True))[0].ttft for _ in range(2)
    )
    target = LOAD_TTFT_TIMES * prefill_s
    results = {}
    with progress_bar("load tests: rows", len(LOAD_ROWS), enabled=progress) as advance:
        for name in LOAD_ROWS:
            label, switches = rows[name]
            measured, sustained = {}, None

            def serve(clients: int) -> dict:
                return closed_loop(
                    model, tokenizer, prompts, clients, sizes["load_requests"], switches, kv_bytes, common
                )

            # doubling; the first C that misses the target ends the sweep
            for clients in sizes["grid"]:
                run = measured[clients] = serve(clients)
                if run["errors"] or run["ttft_p99_s"] > target:
                    break
                sustained = clients
            fixed = measured.get(sizes["clients"]) or serve(sizes["clients"])
            results[name] = {
                "label": label,
                "fixed": fixed,
                "max_clients": sustained,
                "sweep": list(measured.values()),
            }
            advance()
    return {
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "output_len": LOAD_OUTPUT,
        "requests_per_client": sizes["load_requests"],
        "clients": sizes["clients"],
        "grid": list(sizes["grid"]),
        "prefill_alone_s": prefill_s,
        "ttft_target_s": target,
        "how": f"p99 TTFT <= {LOAD_TTFT_TIMES} x one request prefilled alone",
        "rows": results,
    }
