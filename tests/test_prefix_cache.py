"""Prefix caching changes nothing in the output and saves prefill; a hash collision cannot
return wrong KV; no shared block is ever written."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm.memory.prefix_cache as prefix_cache_module
from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams
from minillm.memory.block_manager import BlockManager, BlockManagerError

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32
BLOCK = 8


def shared_prefix_requests(vocab, seed=0, count=24):
    """Prompts = one of three shared prefixes (lengths around block boundaries) + a short tail."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(n)] for n in (BLOCK * 3, BLOCK * 4 - 1, BLOCK * 2 + 1)]
    prompts = [
        rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in range(count)
    ]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in prompts]
    return prompts, params


def run_one_by_one(llm, prompts, params):
    """Each request after the previous one finished, so later ones can hit the cache."""
    return [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]


def assert_naive(model, outputs, prompts, params):
    for out, prompt, sp in zip(outputs, prompts, params):
        assert out.token_ids == generate(model, prompt, sp, "naive").token_ids


def test_prefix_hits_give_identical_tokens_and_save_prefill(tiny_dir, tiny_model):
    prompts, params = shared_prefix_requests(tiny_model.config.vocab_size)
    llm = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, prefix_caching=True, kv_cache_bytes=2 << 20)
    assert_naive(tiny_model, run_one_by_one(llm, prompts, params), prompts, params)
    cache = llm.engine.snapshot().prefix_cache
    assert cache["hit_blocks"] > 20 and 0 < cache["hit_rate"] <= 1
    without = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, kv_cache_bytes=2 << 20)
    run_one_by_one(without, prompts, params)
    saved = without.engine.stats.tokens_computed - llm.engine.stats.tokens_computed
    assert saved == cache["hit_blocks"] * BLOCK == cache["prefill_tokens_saved"]


def test_concurrent_hits_share_blocks(tiny_dir, tiny_model):
    prefix = [(5 * i) % 97 for i in range(BLOCK * 4)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, prefix_caching=True, kv_cache_bytes=1 << 20)
    llm.generate([prefix + [1]], params)
    outputs = llm.generate([prefix + [2, 3], prefix + [4]], params)
    assert_naive(tiny_model, outputs, [prefix + [2, 3], prefix + [4]], [params, params])
    assert max(m.shared_slots for m in llm.engine.stats.memory) == 4 * BLOCK  # 4 blocks held twice


def test_same_prefix_in_the_same_step(tiny_dir, tiny_model):
    prompts, params = shared_prefix_requests(tiny_model.config.vocab_size, seed=1, count=12)
    llm = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, prefix_caching=True, kv_cache_bytes=2 << 20)
    assert_naive(tiny_model, llm.generate(prompts, params), prompts, params)  # all admitted together
    llm.engine.kv_cache.check_invariants()


@pytest.mark.parametrize("length", [BLOCK * 2 - 1, BLOCK * 2, BLOCK * 2 + 1])
def test_fully_cached_prompt_recomputes_only_its_last_token(tiny_dir, tiny_model, length):
    prompt = [(7 * i) % 97 for i in range(length)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, prefix_caching=True, kv_cache_bytes=1 << 20)
    first = llm.generate([prompt], params)[0]
    before = llm.engine.stats.tokens_computed
    second = llm.generate([prompt], params)[0]
    assert first.token_ids == second.token_ids == generate(tiny_model, prompt, params).token_ids
    hit_tokens = (length - 1) // BLOCK * BLOCK
    assert llm.engine.stats.tokens_computed - before == (length - hit_tokens) + 4  # prefill rest + 4 decodes


def test_evicted_blocks_are_recomputed(tiny_dir, tiny_model):
    rng = random.Random(3)
    target = [rng.randrange(97) for _ in range(BLOCK * 3 + 2)]
    others = [[rng.randrange(97) for _ in range(BLOCK * 3)] for _ in range(6)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        block_size=BLOCK,
        prefix_caching=True,
        kv_cache_bytes=6 * BLOCK * KV_BYTES_PER_TOKEN,  # 6 blocks: the others push target out
    )
    outputs = run_one_by_one(llm, [target] + others + [target], [params] * 8)
    assert_naive(tiny_model, outputs, [target] + others + [target], [params] * 8)
    assert outputs[0].token_ids == outputs[-1].token_ids


def test_preemption_then_a_cache_hit(tiny_dir, tiny_model):
    prompts, params = shared_prefix_requests(tiny_model.config.vocab_size, seed=4, count=20)
    params = [SamplingParams(max_tokens=30, ignore_eos=True) for _ in prompts]
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        block_size=BLOCK,
        prefix_caching=True,
        kv_cache_bytes=14 * BLOCK * KV_BYTES_PER_TOKEN,
    )
    assert_naive(tiny_model, llm.generate(prompts, params), prompts, params)
    assert llm.engine.num_preemptions > 0 and llm.engine.snapshot().prefix_cache["hit_blocks"] > 0


def test_hash_collisions_never_return_wrong_kv(tiny_dir, tiny_model, monkeypatch):
    monkeypatch.setattr(prefix_cache_module, "hash", lambda value: 42, raising=False)  # every key collides
    prompts, params = shared_prefix_requests(tiny_model.config.vocab_size, seed=5, count=12)
    llm = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, prefix_caching=True, kv_cache_bytes=2 << 20)
    assert_naive(tiny_model, run_one_by_one(llm, prompts, params), prompts, params)


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=12),
    actions=st.lists(st.sampled_from(["keep", "free", "fork_and_write"]), min_size=12, max_size=12),
)
def test_cached_blocks_always_hold_the_prompts_tokens(prompts, actions):
    """Random prompts over a 3-token alphabet (many shared prefixes, few blocks), with frees, forks
    and copy-on-write appends: every adopted block's recorded tokens are the prompt's, no write
    lands in a shared block, and the refcount invariants hold throughout."""
    manager = BlockManager(num_blocks=12, block_size=2, prefix_caching=True)
    cache, live, lengths = manager.prefix_cache, [], {}
    for seq_id, (prompt, action) in enumerate(zip(prompts, actions)):
        hits = cache.lookup(prompt)
        if not manager.can_grow(seq_id, len(prompt), adopting=hits):
            for old in live:
                manager.free(old)
            live = []
            hits = cache.lookup(prompt)
        for index, block in enumerate(hits):
            assert cache.entries[block].tokens == tuple(prompt[index * 2 : index * 2 + 2])
        manager.adopt(seq_id, hits)
        manager.grow(seq_id, len(prompt))
        cache.register(seq_id, manager.table(seq_id), prompt, len(prompt))
        live.append(seq_id)
        lengths[seq_id] = len(prompt)
        if action == "free":
            manager.free(live.pop())
        elif action == "fork_and_write":
            child = 1000 + seq_id
            manager.fork(seq_id, child)
            live.append(child)
            n = lengths[seq_id]
            copies = len(manager.shared_blocks(child, n, n + 1))
            if manager.can_grow(child, n + 1, copies=copies):
                manager.grow(child, n + 1)
                manager.copy_on_write(child, n, n + 1)
                manager.check_writable(child, n, n + 1)  # the child may now write position n
        manager.check_invariants()


def test_real_model_with_prefix_cache_matches_naive(real_dir, real_model, real_tokenizer, naive_real):
    system = "You are a careful assistant. " * 12
    prompts = [
        real_tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("What is 2 + 2?", "Name a color.", "Say hi.", "What is 2 + 2?")
    ]
    params = SamplingParams(max_tokens=12)
    llm = LLM(
        real_dir, model=real_model, tokenizer=real_tokenizer, prefix_caching=True, kv_cache_bytes=64 << 20
    )
    outputs = run_one_by_one(llm, prompts, [params] * 4)
    for out, prompt in zip(outputs, prompts):
        assert out.token_ids == naive_real(prompt, params.max_tokens)
    assert llm.engine.snapshot().prefix_cache["hit_blocks"] >= 3 * (len(prompts[0]) // 16 - 1)


def test_writing_a_shared_block_is_refused():
    manager = BlockManager(4, 4)
    manager.grow(1, 6)
    manager.fork(1, 2)
    with pytest.raises(BlockManagerError, match="copy it first"):
        manager.check_writable(2, 5, 6)
    manager.check_writable(1, 0, 0)  # an empty range writes nothing
