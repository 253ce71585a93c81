"""Switches that meet: the prefix cache with quantized KV, chunked prefill, parallel samples,
beams, the C++ kernel and one-token blocks; aborts in every state a request can be in; the
sequence limit when forks join; the parent chain that keeps a colliding prefix from lying."""

import builtins
import random

import pytest
from helpers import assert_drained, naive

import minillm.memory.prefix_cache as prefix_cache_module
from minillm.engine import LLM, SamplingParams
from minillm.engine.beam import reference_beam_search
from minillm.engine.sequence import Status

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32
BLOCK = 4


def shared_prefix_prompts(count, seed, vocab=97):
    """Prompts made of one of three shared prefixes (around block boundaries) and a short tail."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(n)] for n in (BLOCK * 5, BLOCK * 3 - 1, BLOCK * 4 + 1)]
    return [
        rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(0, 6))] for _ in range(count)
    ]


def one_by_one(llm, prompts, params):
    """Each request after the previous one, so later ones find earlier ones' blocks in the cache."""
    return [llm.generate([prompt], params)[0] for prompt in prompts]


@pytest.mark.parametrize(
    "switches", [{"block_size": 1}, {"attention_backend": "cpu"}, {"max_num_batched_tokens": 5}]
)
def test_prefix_hits_with_other_switches_equal_naive(tiny_dir, tiny_model, switches):
    prompts, params = shared_prefix_prompts(10, seed=1), SamplingParams(max_tokens=8, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, prefix_caching=True, **{"block_size": BLOCK, **switches})
    outputs = one_by_one(llm, prompts, params)
    assert [out.token_ids for out in outputs] == [naive(tiny_model, prompt, params) for prompt in prompts]
    assert llm.engine.snapshot().prefix_cache["hit_blocks"] > 10
    assert_drained(llm)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_prefix_hits_on_quantized_blocks_change_nothing(tiny_dir, tiny_model, kv_dtype):
    """What `minillm chat --kv-dtype` runs: adopted blocks hold quantized keys, values and
    scales; reading them must give what computing the prompt in the same format gives."""
    prompts, params = shared_prefix_prompts(10, seed=2), SamplingParams(max_tokens=8, ignore_eos=True)
    cached = LLM(tiny_dir, model=tiny_model, prefix_caching=True, kv_dtype=kv_dtype, block_size=BLOCK)
    plain = LLM(tiny_dir, model=tiny_model, kv_dtype=kv_dtype, block_size=BLOCK)
    assert [out.token_ids for out in one_by_one(cached, prompts, params)] == [
        out.token_ids for out in one_by_one(plain, prompts, params)
    ]
    assert cached.engine.snapshot().prefix_cache["hit_blocks"] > 10
    assert_drained(cached)


def test_blocks_registered_mid_prefill_are_adopted_by_another_request(tiny_dir, tiny_model):
    """A's prompt goes in chunks of 8; B arrives in A's last prefill step and adopts the six
    blocks A's earlier chunks registered, while A is still computing its prompt."""
    rng = random.Random(3)
    first = [rng.randrange(97) for _ in range(30)]
    second = first[:24] + [rng.randrange(97) for _ in range(5)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, prefix_caching=True, block_size=BLOCK, max_num_batched_tokens=8)
    engine = llm.engine
    a = engine.add_request(first, params)
    for _ in range(3):
        engine.step()
    seq_a = engine.requests[a][0]
    assert seq_a.num_computed == 24 and engine.snapshot().prefix_cache["cached_blocks"] == 6
    b = engine.add_request(second, params)
    engine.step()  # A's last 6 prompt tokens and B's first 2 uncached ones
    seq_b = engine.requests[b][0]
    assert (
        engine.snapshot().prefix_cache["hit_blocks"] == 6
        and seq_b.num_computed == 26
        and seq_a.num_computed == 30
    )
    while engine.has_unfinished_requests():
        engine.step()
    assert seq_a.output_ids == naive(tiny_model, first, params)
    assert seq_b.output_ids == naive(tiny_model, second, params)
    assert_drained(llm)


def test_parallel_samples_on_cached_prefixes_equal_independent_requests(tiny_dir, tiny_model):
    prompts = shared_prefix_prompts(5, seed=4)
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, prefix_caching=True, block_size=BLOCK)
    for prompt, out in zip(prompts, one_by_one(llm, prompts, params)):
        assert out.samples == [
            naive(
                tiny_model,
                prompt,
                SamplingParams(temperature=1.0, seed=9 + i, max_tokens=10, ignore_eos=True),
            )
            for i in range(3)
        ]
    assert llm.engine.snapshot().prefix_cache["hit_blocks"] >= 3
    assert_drained(llm)


def test_beams_on_cached_prefixes_equal_the_reference_search(tiny_dir, tiny_model):
    prompts = shared_prefix_prompts(4, seed=5)
    params = SamplingParams(beam_width=3, max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, prefix_caching=True, block_size=BLOCK)
    for prompt, out in zip(prompts, one_by_one(llm, prompts, params)):
        assert out.samples == reference_beam_search(tiny_model, prompt, 3, 6, frozenset())
    assert llm.engine.snapshot().prefix_cache["hit_blocks"] >= 2
    assert_drained(llm)


def test_a_parent_chain_that_differs_is_never_a_hit(tiny_dir, tiny_model, monkeypatch):
    """Keys that ignore the parent (the worst hash) make block [B] after [C] look like the cached
    [B] after [A]; only the recorded parent block tells them apart."""
    monkeypatch.setattr(prefix_cache_module, "hash", lambda key: builtins.hash(key[1]), raising=False)
    rng = random.Random(6)
    a, b, c = ([rng.randrange(97) for _ in range(BLOCK)] for _ in range(3))
    prompts = [a + b + [1], c + [2, 3], c + b + [4]]  # the last one hits [C], must not take A's [B]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, prefix_caching=True, block_size=BLOCK)
    outputs = one_by_one(llm, prompts, params)
    assert [out.token_ids for out in outputs] == [naive(tiny_model, prompt, params) for prompt in prompts]
    assert llm.engine.snapshot().prefix_cache["hit_blocks"] == 1  # [C] only


# ---------------------------------------------------------------- aborts


def test_aborts_in_every_state_free_their_blocks_and_spare_the_others(tiny_dir, tiny_model):
    """Abort one request in each state it can be in: waiting, mid chunked prefill, preempted,
    a parallel-sampling request after its fork, a beam search between two beam steps."""
    rng = random.Random(7)
    prompt = lambda: [rng.randrange(97) for _ in range(rng.randint(12, 30))]  # noqa: E731
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        block_size=BLOCK,
        max_num_batched_tokens=10,
        max_num_seqs=4,
        kv_cache_bytes=22 * BLOCK * KV_BYTES_PER_TOKEN,
    )
    engine = llm.engine
    requests = {engine.add_request(prompt(), greedy): greedy for _ in range(6)}
    sampled = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=24, ignore_eos=True)
    beams = SamplingParams(beam_width=3, max_tokens=24, ignore_eos=True)
    requests[engine.add_request(prompt(), sampled)] = sampled
    requests[engine.add_request(prompt(), beams)] = beams
    sequences = {request_id: engine.requests[request_id] for request_id in requests}  # kept after they end
    states = {
        "waiting": lambda seqs: seqs[0].status is Status.WAITING and seqs[0].num_preemptions == 0,
        "prefilling": lambda seqs: (
            seqs[0].status is Status.RUNNING and 0 < seqs[0].num_computed < len(seqs[0].prompt_ids)
        ),
        "preempted": lambda seqs: seqs[0].status is Status.WAITING and seqs[0].num_preemptions > 0,
        "forked": lambda seqs: len(seqs) == 3 and seqs[0].params.n == 3,
        "between beam steps": lambda seqs: seqs[0].params.beam_width == 3 and len(seqs) == 3,
    }
    aborted = {}
    while engine.has_unfinished_requests():
        engine.step()
        for state, holds in states.items():
            if state in aborted:
                continue
            for request_id in requests:
                seqs = sequences[request_id]
                if (
                    request_id not in aborted.values()
                    and seqs[0].status is not Status.FINISHED
                    and holds(seqs)
                ):
                    engine.abort(request_id)
                    aborted[state] = request_id
                    engine.kv_cache.check_invariants()
                    break
    assert set(aborted) == set(states)
    for request_id, params in requests.items():
        seqs = sequences[request_id]
        if request_id in aborted.values():
            assert all(seq.finish_reason in ("abort", "pruned") for seq in seqs)
        elif params is greedy:
            assert seqs[0].output_ids == naive(tiny_model, seqs[0].prompt_ids, greedy)
    assert_drained(llm)


# ---------------------------------------------------------------- the sequence limit


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_max_num_seqs_holds_when_samples_and_beams_fork(tiny_dir, tiny_model, scheduling):
    rng = random.Random(8)
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        block_size=BLOCK,
        max_num_seqs=5,
        scheduling=scheduling,
        kv_cache_bytes=40 * BLOCK * KV_BYTES_PER_TOKEN,
    )
    engine = llm.engine
    kinds = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=12, ignore_eos=True),
        SamplingParams(beam_width=3, max_tokens=12, ignore_eos=True),
    ]
    for index in range(9):
        engine.add_request([rng.randrange(97) for _ in range(rng.randint(3, 20))], kinds[index % 3])
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
        assert len(engine.scheduler.running) <= 5
    assert most >= 4  # forks really filled the batch
    assert_drained(llm)


def test_a_request_wider_than_max_num_seqs_fails_alone(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model, max_num_seqs=2)
    wide, fine = llm.generate(
        [[1, 2, 3], [4, 5]],
        [SamplingParams(n=3, temperature=1.0, max_tokens=4), SamplingParams(max_tokens=4, ignore_eos=True)],
    )
    assert wide.finish_reason == "error" and "raise max_num_seqs" in wide.error
    assert fine.error is None and len(fine.token_ids) == 4


def test_a_block_reused_for_new_content_takes_its_cached_descendants_along(tiny_dir, tiny_model, monkeypatch):
    """With keys that ignore the parent, [B] cached after [A] would pass for [B] after [X] once
    A's block is reused for X; evicting a block must evict the entries that name it as parent."""
    monkeypatch.setattr(prefix_cache_module, "hash", lambda key: builtins.hash(key[1]), raising=False)
    rng = random.Random(9)
    a, b, x = ([rng.randrange(97) for _ in range(BLOCK)] for _ in range(3))
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        prefix_caching=True,
        block_size=BLOCK,
        kv_cache_bytes=3 * BLOCK * KV_BYTES_PER_TOKEN,  # 3 blocks: [A] is the first reused
    )
    three = SamplingParams(max_tokens=3, ignore_eos=True)
    prompts, params = [a + b + [1], x, x + b + [2]], [three, SamplingParams(max_tokens=1), three]
    outputs = [llm.generate([prompt], sp)[0] for prompt, sp in zip(prompts, params)]
    assert [out.token_ids for out in outputs] == [naive(tiny_model, p, sp) for p, sp in zip(prompts, params)]
    assert llm.engine.snapshot().prefix_cache["hit_blocks"] == 1  # [X] only, never A's [B]
