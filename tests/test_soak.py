"""A seeded soak: a few hundred random requests through random engine set-ups, checked one by one.

Each set-up draws a block size, a pool from just big enough to many times that, prefix caching
on or off, static or continuous scheduling (admitting first come first served, by memory cost, or
by max-length reservation), a token budget, tiers (none, a host pool that may overflow to disk,
disk alone) with a preemption policy (`auto` flips a seeded coin per victim instead of timing the
machine, so every set-up replays exactly), and speculative decoding on or off; its requests mix
greedy ones, seeded parallel samples and beams, some sharing a prefix, and some are aborted
mid-flight.
Every greedy output must equal naive decoding, every sample the same seeded naive draw, every beam
set the reference search; no exception; every block free after each drain, and no block the
prefix cache still offers holds tokens no request had (a rejected guess). A failure names its
set-up's seed, so it reproduces alone: `pytest tests/test_soak.py -k "setup_7"`.

A second soak mixes bad requests among good streams, joining at random steps: temperatures too
small to divide by (greedy), samplers that raise or choose no token. Each bad one may end only
itself; every good stream must end with the tokens `LLM.generate` gives it alone.
"""

import os
import random

import pytest
from helpers import (
    KV_BYTES_PER_TOKEN,
    FailingSampler,
    assert_replayed,
    cached_chains,
    expected_outputs,
    free_and_intact,
    raise_fault,
)

from minillm.config import SWITCHES
from minillm.engine import LLM, SamplingParams
from minillm.memory.replay import Replayer
from minillm.memory.tiers import SwapCost

NUM_SETUPS = int(os.environ.get("SOAK_SETUPS", 200))


def random_request(rng: random.Random, shared: list[int]) -> tuple[list[int], SamplingParams]:
    prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(97) for _ in range(rng.randint(1, 30))]
    kind, max_tokens = rng.choice(["greedy", "greedy", "samples", "beams"]), rng.randint(1, 12)
    if kind == "samples":
        return prompt, SamplingParams(
            n=rng.randint(2, 3),
            temperature=1.0,
            seed=rng.randrange(1000),
            max_tokens=max_tokens,
            ignore_eos=True,
        )
    if kind == "beams":
        return prompt, SamplingParams(
            beam_width=rng.randint(2, 3), max_tokens=min(max_tokens, 6), ignore_eos=True
        )
    return prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def random_tiers(rng: random.Random, block_size: int, folder) -> dict:
    host_blocks, disk = rng.choice([(0, False), (0, False), (2, True), (200, False), (0, True)])
    tiers = {
        "host_cache_bytes": host_blocks * block_size * KV_BYTES_PER_TOKEN,
        "disk_cache_dir": str(folder) if disk else None,
    }
    return {
        **tiers,
        "preemption": rng.choice(["auto", "swap", "recompute"] if host_blocks or disk else ["auto"]),
    }


def run_with_aborts(llm, rng: random.Random, requests) -> tuple[dict, set]:
    """Run the requests, aborting some; after every step and abort, the state replayed from the
    KV events must equal the block manager's."""
    engine, final, aborted = llm.engine, {}, set()
    replayer = Replayer()
    engine.subscribe(replayer)
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        assert_replayed(replayer, engine.kv_cache)
        waiting = [request_id for request_id in ids if request_id not in final and request_id not in aborted]
        if waiting and rng.random() < 0.05:
            victim = rng.choice(waiting)
            engine.abort(victim)
            aborted.add(victim)
            assert_replayed(replayer, engine.kv_cache)
    return {request_id: final.get(request_id) for request_id in ids}, aborted


@pytest.mark.parametrize("seed", range(NUM_SETUPS), ids=lambda seed: f"setup_{seed}")
def test_soak(tiny_dir, tiny_model, tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    coin = random.Random(-seed)
    monkeypatch.setattr(SwapCost, "prefers_swap", lambda self, tokens, num_blocks, tier: coin.random() < 0.5)
    shared = [rng.randrange(97) for _ in range(rng.randint(4, 40))]
    requests = [random_request(rng, shared) for _ in range(rng.randint(8, 16))]
    block_size = rng.choice([1, 2, 4, 8, 16])
    longest = max(len(prompt) + params.max_tokens for prompt, params in requests)
    blocks = -(-longest // block_size) * rng.choice([1, 2, 4, 20])  # from just fits to plenty
    scheduling = rng.choice(["static", "continuous"])
    admission = rng.choice(SWITCHES["admission"].choices) if scheduling == "continuous" else "fcfs"
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        block_size=block_size,
        kv_cache_bytes=blocks * block_size * KV_BYTES_PER_TOKEN,
        prefix_caching=rng.random() < 0.5,
        scheduling=scheduling,
        admission=admission,
        max_num_batched_tokens=rng.choice([8, 32, 512]),
        max_num_seqs=rng.choice([4, 16]),
        **random_tiers(rng, block_size, tmp_path),
        speculative=rng.choice(["none", "ngram"]),
    )
    outputs, aborted = run_with_aborts(llm, rng, requests)
    for (request_id, out), (prompt, params) in zip(outputs.items(), requests):
        if request_id in aborted and (out is None or out.finish_reason == "abort"):
            continue
        assert out is not None and out.error is None, (seed, request_id, out and out.error)
        assert out.samples == expected_outputs(tiny_model, prompt, params), (seed, request_id, params)
    snapshot = llm.engine.snapshot()
    assert free_and_intact(llm.engine), seed
    assert not snapshot.stats.host_reserved_slots and not snapshot.stats.disk_reserved_slots, seed
    if snapshot.prefix_cache is not None:
        assert_no_stale_entry(cached_chains(llm.engine), requests, outputs, aborted)
    if llm.engine.proposer is not None:
        assert len(llm.engine.proposer) == 0, seed  # no sequence's n-gram index outlived it


def assert_no_stale_entry(chains, requests, outputs, aborted) -> None:
    """Every block the prefix cache still vouches for holds a prefix of tokens some request
    really had (its prompt and one of its outputs): none holds a rejected guess. The tokens of an
    aborted request's output, and of the beams a search dropped, are unknown: blocks that begin
    with such a request's prompt are not checked further."""
    finished, open_ended = [], []
    for (request_id, out), (prompt, params) in zip(outputs.items(), requests):
        if request_id in aborted or params.beam_width > 1:
            open_ended.append(prompt)
        else:
            finished += [prompt + sample for sample in out.samples]
    for chain in chains:
        assert any(tokens[: len(chain)] == chain for tokens in finished) or any(
            chain[: len(prompt)] == prompt[: len(chain)] for prompt in open_ended
        ), chain


def random_good_request(rng: random.Random) -> tuple[list[int], SamplingParams]:
    prompt, max_tokens = [rng.randrange(97) for _ in range(rng.randint(1, 20))], rng.randint(1, 12)
    if rng.random() < 0.5:
        return prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    n, seed = rng.randint(1, 2), rng.randrange(1000)
    return prompt, SamplingParams(temperature=0.8, n=n, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def random_bad_request(rng: random.Random) -> tuple[list[int], SamplingParams, FailingSampler | None]:
    """(prompt, params, sampler): a tiny temperature (greedy, fails nobody) or a sampler that fails."""
    prompt = [rng.randrange(97) for _ in range(rng.randint(1, 20))]
    kind = rng.choice(["1e-300", "5e-324", "raises", "out of vocabulary"])
    if kind in ("1e-300", "5e-324"):
        return prompt, SamplingParams(temperature=float(kind), max_tokens=12, ignore_eos=True), None
    fault = raise_fault if kind == "raises" else (lambda: 97)
    return prompt, SamplingParams(max_tokens=12, ignore_eos=True), FailingSampler(rng.randint(0, 4), fault)


@pytest.mark.parametrize("seed", range(4), ids=lambda seed: f"bad_{seed}")
def test_bad_requests_among_good_streams_change_none_of_their_tokens(tiny_dir, tiny_model, seed):
    rng = random.Random(seed)
    good = [random_good_request(rng) for _ in range(8)]
    bad = [random_bad_request(rng) for _ in range(5)]
    blocks = rng.choice([24, 64, 400])  # tight (preemption) to plenty
    speculative = "ngram" if seed % 2 else "none"  # a failing sampler may fail checking a guess
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        block_size=4,
        kv_cache_bytes=blocks * 4 * KV_BYTES_PER_TOKEN,
        speculative=speculative,
    )
    engine, final = llm.engine, {}
    arrivals = sorted(
        [(rng.randint(0, 12), "good", i) for i in range(len(good))]
        + [(rng.randint(0, 12), "bad", i) for i in range(len(bad))]
    )
    ids, step = {}, 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, kind, i = arrivals.pop(0)
            prompt, params, *sampler = good[i] if kind == "good" else bad[i]
            ids[kind, i] = engine.add_request(prompt, params, sampler=sampler[0] if sampler else None)
        final |= {out.request_id: out for out in engine.step() if out.finished}
        step += 1
    reference = LLM(tiny_dir, model=tiny_model, kv_cache_bytes=1 << 20)
    for i, (prompt, params) in enumerate(good):
        out = final[ids["good", i]]
        assert out.error is None and out.samples == reference.generate([prompt], params)[0].samples, (seed, i)
    for i, (prompt, params, sampler) in enumerate(bad):
        out = final[ids["bad", i]]
        if sampler is None:  # a tiny temperature: greedy
            greedy = SamplingParams(max_tokens=12, ignore_eos=True)
            assert out.error is None and out.token_ids == reference.generate([prompt], greedy)[0].token_ids
        else:
            assert out.finish_reason == "error" and out.error.startswith("Sampling failed"), (seed, i)
    assert free_and_intact(engine)
