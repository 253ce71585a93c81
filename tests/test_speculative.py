"""Speculative decoding from the prompt: the guesses, the check, the rollback.

Greedy output with speculation equals naive decoding (or, for a lossy KV format or eviction, the
same engine without speculation) in every combination the engine has; seeded sampling gives the
very tokens of the naive seeded draw, and the emitted distribution is the model's (a chi-square
test on a fixed seed budget). Rollback keeps the block manager's invariants under random accept
lengths and never leaves a prefix-cache entry over a rejected token. The tiny random model falls
into loops, so its guesses are often kept and often rejected: both paths run.
"""

import random
from collections import Counter

import pytest
import torch
from helpers import (
    assert_drained,
    expected_outputs,
    heard_snapshot,
    naive,
    random_prompts,
)

from minillm.config import ConfigError, EngineConfig
from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams
from minillm.engine.beam import reference_beam_search
from minillm.engine.speculative import NgramProposer, PassCost, check_guesses
from minillm.memory import KVCacheManager
from minillm.sampling import Sampler

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
PRICED = PassCost.guesses_worth  # before `always_guess` replaces it


@pytest.fixture(autouse=True)
def _always_guess(always_guess):
    """Every test here guesses as far as it may (`conftest.always_guess`)."""


def speculating(tiny_dir, tiny_model, **switches):
    """Short n-grams: the tiny model's loops are short."""
    return LLM(
        tiny_dir,
        model=tiny_model,
        speculative="ngram",
        prompt_lookup_min=1,
        prompt_lookup_max=3,
        **{"block_size": 4, **switches},
    )


def assert_guessed_both_ways(llm):
    """Guesses were kept and guesses were rejected (so rollback ran)."""
    numbers = llm.engine.stats.speculation()
    assert 0 < numbers["accepted_tokens"] < numbers["draft_tokens"], numbers


def assert_drained_and_forgotten(llm):
    assert_drained(llm)
    assert len(llm.engine.proposer) == 0  # no n-gram index outlives its request


# ----------------------------------------------------------------------------- the pieces


def test_the_proposer_continues_the_latest_occurrence_of_the_longest_ngram():
    proposer = NgramProposer(num_tokens=3, min_n=1, max_n=3)
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7]
    # (5, 6, 7) occurred at the start: its continuation is 8, 9, 1; the shorter (6, 7) occurred
    # later (followed by 2), but the longest n-gram wins
    assert proposer.propose(0, tokens, limit=3) == [8, 9, 1]
    assert proposer.propose(1, tokens, limit=2) == [8, 9]
    assert proposer.propose(2, [1, 2, 3, 4], limit=3) == []  # 4 never occurred before
    growing = [1, 2, 1, 2, 3, 1, 2]
    assert proposer.propose(3, growing, limit=3) == [3, 1, 2]  # latest (1, 2) before the end: followed by 3
    growing += [3, 9]
    assert proposer.propose(3, growing, limit=3) == []  # the index grew: 9 is new


def test_a_guess_is_made_while_its_chance_pays_for_its_row():
    cost = PassCost()
    cost.guesses_worth = lambda *args, **kwargs: PRICED(cost, *args, **kwargs)  # the real rule here
    assert cost.guesses_worth(0.1, batch=1, most=4) == 4  # no fit yet: guess, and measure
    for rows in (1, 2, 3, 5, 1, 4):  # seconds = 20 ms + 2 ms per row
        cost.record(rows, 0.020 + 0.002 * rows)
    fixed, per_row = cost.fit()
    assert fixed == pytest.approx(0.020) and per_row == pytest.approx(0.002)
    # batch 1: a kept guess saves 22 ms for a 2 ms row, so it pays from a chance of 1/11
    assert cost.guesses_worth(0.5, batch=1, most=4) == 3  # 0.5, 0.25, 0.125 >= 0.091 > 0.0625
    assert cost.guesses_worth(0.05, batch=1, most=4) == 0
    # batch 20: it saves 2 + 1 ms, so a guess needs a chance of 2/3
    assert cost.guesses_worth(0.9, batch=20, most=4) == 3  # 0.9, 0.81, 0.73 >= 0.67 > 0.66
    assert cost.guesses_worth(0.6, batch=20, most=4) == 0


def test_greedy_check_keeps_the_agreeing_prefix_and_the_models_next_token():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([4, 5, 6, 7]):
        logits[row, best] = 1.0
    greedy = Sampler(SamplingParams())
    assert check_guesses([4, 5, 6], logits, greedy) == [4, 5, 6, 7]  # all kept, one more for free
    assert check_guesses([4, 9, 6], logits, greedy) == [4, 5]  # the second was wrong: the model's 5
    assert check_guesses([0, 5, 6], logits, greedy) == [4]


def test_sampled_checks_emit_the_models_distribution():
    """Rows with known probabilities, a guess per row: over 20,000 seeded checks, the first
    emitted token follows row 0's distribution, and the second, after a kept first guess, row 1's."""
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.6, 0.1, 0.1, 0.1], [0.2] * 5])
    logits = probs.clamp_min(1e-30).log()
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7))
    first, second = Counter(), Counter()
    for _ in range(20_000):
        tokens = check_guesses([2, 1], logits, sampler)
        first[tokens[0]] += 1
        if tokens[0] == 2:
            second[tokens[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        total = sum(counts.values())
        expected = p * total
        chi2 = sum((counts[t] - expected[t]) ** 2 / expected[t] for t in range(5) if expected[t] > 0)
        assert chi2 < 18.5, (counts, p)  # 4 degrees of freedom: p < 0.001 by chance
        assert counts[4] == 0 or p[4] > 0
    assert sum(first.values()) == 20_000 and 3000 < sum(second.values()) < 5000  # p0(2) = 0.2


# ----------------------------------------------------------------------------- exact, in every combination


@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"block_size": 1},
        {"block_size": 16},
        {"max_num_batched_tokens": 7},  # chunked prefill, and guesses cut by the token budget
        {"attention_backend": "cpu"},
        {"prefix_caching": True},
        {"kv_cache_bytes": 40 * 4 * KV_BYTES_PER_TOKEN},  # 40 blocks: preemption by recompute
        {"kv_cache_bytes": 40 * 4 * KV_BYTES_PER_TOKEN, "host_cache_bytes": 1 << 20, "preemption": "swap"},
    ],
    ids=["default", "block_1", "block_16", "chunked", "cpu_kernel", "prefix", "recompute", "swap"],
)
def test_greedy_speculation_equals_naive(tiny_dir, tiny_model, switches):
    batch = random_prompts(10, seed=len(str(switches)), shortest=1)
    llm = speculating(tiny_dir, tiny_model, **switches)
    outputs = llm.generate(batch, GREEDY)
    assert [out.error for out in outputs] == [None] * len(batch)
    assert [out.token_ids for out in outputs] == [naive(tiny_model, prompt, GREEDY) for prompt in batch]
    assert_guessed_both_ways(llm)
    if "kv_cache_bytes" in switches:
        assert llm.engine.num_preemptions > 0
    assert_drained_and_forgotten(llm)


def test_seeded_samples_and_beams_are_unchanged(tiny_dir, tiny_model):
    """n > 1 samples fork and share the tail block their guesses write (copy-on-write); each
    draws once per token, so each equals the naive seeded draw. Beams do not guess."""
    batch = random_prompts(4, seed=5, shortest=1)
    sampled = SamplingParams(n=3, temperature=0.3, seed=11, max_tokens=32, ignore_eos=True)
    beams = SamplingParams(beam_width=3, max_tokens=12, ignore_eos=True)
    llm = speculating(tiny_dir, tiny_model)
    outputs = llm.generate(batch + batch[:2], [sampled] * 4 + [beams] * 2)
    for out, prompt in zip(outputs[:4], batch):
        assert out.samples == expected_outputs(tiny_model, prompt, sampled)
    for out, prompt in zip(outputs[4:], batch[:2]):
        assert out.samples == reference_beam_search(tiny_model, prompt, 3, 12, frozenset())
    assert_guessed_both_ways(llm)
    assert_drained_and_forgotten(llm)


@pytest.mark.parametrize(
    "switches",
    [
        {"kv_dtype": "int4"},  # keys scaled per channel of a block: guesses never fill a block
        {"kv_dtype": "int8", "kv_key_scales": "token"},
        {"kv_dtype": "fp8"},
        {"eviction": "sinks", "kv_budget": 24},
        {"eviction": "h2o", "kv_budget": 24},  # each guess's attention counts only if it is kept
        {"eviction": "window", "kv_budget": 0.5, "prefix_caching": True},
    ],
    ids=["int4", "int8_token", "fp8", "sinks", "h2o", "window_prefix"],
)
def test_lossy_formats_give_what_they_give_without_speculation(tiny_dir, tiny_model, switches):
    batch = random_prompts(8, seed=9, shortest=1)
    plain = LLM(tiny_dir, model=tiny_model, block_size=4, **switches).generate(batch, GREEDY)
    llm = speculating(tiny_dir, tiny_model, **switches)
    assert [out.token_ids for out in llm.generate(batch, GREEDY)] == [out.token_ids for out in plain]
    assert_guessed_both_ways(llm)
    assert_drained_and_forgotten(llm)


def test_real_model_speculation_equals_the_cached_decoder_on_a_passage(
    real_dir, real_model, real_tokenizer, real_text_ids
):
    """The real model repeating a passage of Alice: most guesses are kept. The reference is the
    cached decoder (one contiguous cache, no engine), itself checked against naive decoding."""
    prompt = real_tokenizer.encode("Repeat this text exactly:\n\n") + real_text_ids[2000:2200]
    params = SamplingParams(max_tokens=48)
    llm = LLM(real_dir, model=real_model, tokenizer=real_tokenizer, speculative="ngram")
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == generate(real_model, prompt, params, "cached").token_ids
    assert llm.engine.stats.speculation()["tokens_per_pass"] > 1.5


# ----------------------------------------------------------------------------- rollback


@pytest.mark.parametrize("seed", range(3))
def test_random_rollbacks_keep_the_invariants_and_leave_no_stale_prefix_entry(tiny_dir, tiny_model, seed):
    """Sequences grow by a token and up to 4 guesses, keep a random number of them, and are cut
    back (now and then deeper, into registered blocks); some fork, some end. After every step each
    prefix-cache entry in a table agrees with the tokens its holder computed there (and every
    slot written was writable: not shared, not cached), and when all end every block is free."""
    rng = random.Random(seed)
    size = rng.choice([1, 2, 4])
    config = EngineConfig(
        model_dir=tiny_dir,
        block_size=size,
        prefix_caching=True,
        kv_cache_bytes=200 * size * KV_BYTES_PER_TOKEN,
    )
    kv = KVCacheManager.build(config, tiny_model.config, torch.float32, "cpu")
    capacity = kv.capacity()
    live: dict[int, list[int]] = {}  # seq_id -> its tokens with KV (the last one computed too)
    next_id = 0
    for _ in range(300):
        if len(live) < 6 and rng.random() < 0.3:
            tokens = [rng.randrange(5) for _ in range(rng.randint(1, 12))]  # few tokens: prefixes repeat
            grant = kv.allocate(next_id, tokens, 0, 0, len(tokens))
            if grant.num_tokens:
                live[next_id] = tokens[: grant.num_computed + grant.num_tokens]
                kv.computed(next_id, live[next_id], len(live[next_id]), len(live[next_id]), len(tokens), 1000)
            next_id += 1
        if not live:
            continue
        seq_id = rng.choice(list(live))
        tokens = live[seq_id]
        action = rng.random()
        if action < 0.1:
            kv.free(seq_id)
            del live[seq_id]
        elif action < 0.2 and len(live) < 6:
            kv.fork(seq_id, next_id)
            live[next_id] = list(tokens)
            next_id += 1
        elif action < 0.3:  # a deeper cut, into blocks computed (and registered) earlier
            cut = rng.randint(1, len(tokens))
            kv.rollback(seq_id, cut)
            live[seq_id] = tokens[:cut]
        else:
            guesses = [rng.randrange(5) for _ in range(rng.randint(1, 4))]
            written = tokens + [rng.randrange(5)] + guesses
            n = len(tokens)
            grant = kv.allocate(seq_id, written, n, n, len(written) - n)
            if grant.num_tokens:
                kv.append(seq_id, n, len(written))  # every slot written must be writable
                kept = rng.randint(1, len(guesses) + 1)
                kv.rollback(seq_id, n + kept)
                live[seq_id] = written[: n + kept]
                kv.computed(seq_id, live[seq_id], n + kept, n + kept, 1, 1000)
            kv.apply()  # the copies decided, performed
        kv.check_invariants()
        state = heard_snapshot(kv)  # every table, and what the prefix cache holds
        cached = {block: tokens for block, _, _, tokens in state.cached}
        for s, held in live.items():
            table = state.tables[s]
            assert len(table) == capacity.blocks_for(len(held))
            for index, block in enumerate(table):
                if block in cached:  # a block cut into may be cached still, if others hold it
                    in_block = tuple(held[index * size : (index + 1) * size])
                    assert cached[block][: len(in_block)] == in_block
    for seq_id in list(live):
        kv.free(seq_id)
    kv.check_invariants()
    assert kv.num_free_blocks == capacity.num_blocks


def test_a_later_request_finds_no_kv_of_a_rejected_guess(tiny_dir, tiny_model):
    """With the prefix cache, a second request whose prompt is the first's prompt and output
    adopts the first's blocks; its tokens still equal naive decoding, so no block it found held
    a guess the first rejected."""
    llm = speculating(tiny_dir, tiny_model, prefix_caching=True)
    first = random_prompts(1, seed=21, shortest=1)[0]
    out = llm.generate([first], GREEDY)[0]
    assert_guessed_both_ways(llm)
    follow_up = first + out.token_ids + [7, 7]
    second = llm.generate([follow_up], GREEDY)[0]
    assert second.token_ids == naive(tiny_model, follow_up, GREEDY)
    assert llm.engine.snapshot().prefix_cache["hit_blocks"] >= len(follow_up) // 4 - 1


def test_speculation_switches_are_checked(tiny_dir, tiny_model):
    with pytest.raises(ConfigError, match="prompt_lookup_max"):
        LLM(tiny_dir, model=tiny_model, speculative="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ConfigError, match="prompt_lookup_max must be at most"):
        LLM(tiny_dir, model=tiny_model, speculative="ngram", prompt_lookup_max=10**6)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(tiny_dir, model=tiny_model, speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="speculative must be one of"):
        LLM(tiny_dir, model=tiny_model, speculative="eagle")
