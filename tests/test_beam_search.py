"""Beam search in the engine gives the beams of a reference search that recomputes everything,
while the beams share their history's blocks and dropped beams release theirs."""

import itertools
import random

import pytest
import torch
from helpers import free_and_intact
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine import LLM, SamplingParams
from minillm.engine.beam import BeamGroup, reference_beam_search, select
from minillm.engine.sequence import Finish, Sequence

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32


@pytest.mark.parametrize("width, prompt_len", [(2, 5), (4, 13), (4, 16)])
def test_engine_beams_equal_reference_beams(tiny_dir, tiny_model, width, prompt_len):
    prompt = [(11 * i + 3) % 97 for i in range(prompt_len)]
    params = SamplingParams(beam_width=width, max_tokens=10, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=1 << 20)
    out = llm.generate([prompt], params)[0]
    assert out.samples == reference_beam_search(tiny_model, prompt, width, 10, frozenset())
    assert out.token_ids == out.samples[0] and out.finished
    assert free_and_intact(llm.engine)  # dropped and finished beams gave everything back
    assert max(m.shared_slots for m in llm.engine.stats.memory) > 0


def test_beams_stop_at_eos(tiny_dir, tiny_model):
    prompt = [1, 2, 3, 4]
    eos = reference_beam_search(tiny_model, prompt, 3, 3, frozenset())[1][1]  # a token some beam emits second
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=1 << 20)
    out = llm.generate([prompt], SamplingParams(beam_width=3, max_tokens=8))[0]
    assert out.samples == reference_beam_search(
        tiny_model, prompt, 3, 8, frozenset(tiny_model.config.eos_token_ids)
    )
    assert eos is not None


def test_beam_search_under_preemption(tiny_dir, tiny_model):
    prompts = [[(5 * i + j) % 97 for j in range(9 + 2 * i)] for i in range(3)]
    params = SamplingParams(beam_width=3, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=16 * 4 * KV_BYTES_PER_TOKEN)
    outputs = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0
    for out, prompt in zip(outputs, prompts):
        assert out.samples == reference_beam_search(tiny_model, prompt, 3, 12, frozenset())


def test_beam_search_needs_greedy_settings():
    with pytest.raises(ValueError, match="beam search is deterministic"):
        SamplingParams(beam_width=2, temperature=0.7)


def brute_force_select(scores, logprobs, width):
    """Every (beam, token) pair with its total, best first."""
    pairs = [
        (beam, token, scores[beam] + float(logprobs[beam, token]))
        for beam in range(len(scores))
        for token in range(logprobs.shape[1])
    ]
    return sorted(pairs, key=lambda pair: -pair[2])[:width]


@settings(max_examples=150, deadline=None)
@given(beams=st.integers(1, 4), vocab=st.integers(2, 9), width=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_select_keeps_the_best_pairs_by_total_log_probability(beams, vocab, width, seed):
    """Non-square shapes, so mixing up beam = flat // vocab and token = flat % vocab shows."""
    gen = torch.Generator().manual_seed(seed)
    scores = (torch.rand(beams, generator=gen, dtype=torch.float64) * -5).tolist()
    logprobs = torch.log_softmax(torch.randn(beams, vocab, generator=gen) * 3, dim=-1)
    width = min(width, beams * vocab)
    assert select(scores, logprobs, width) == brute_force_select(scores, logprobs, width)


def test_select_breaks_ties_without_repeating_a_pair():
    scores, logprobs = [0.0, 0.0], torch.full((2, 3), -1.0)  # six equally good continuations
    chosen = select(scores, logprobs, 4)
    assert len({(beam, token) for beam, token, _ in chosen}) == 4
    assert all(score == -1.0 for _, _, score in chosen)


def test_a_worse_beam_can_still_win_with_a_better_token():
    scores = [-1.0, -3.0]
    logprobs = torch.log(torch.tensor([[0.06, 0.04, 0.9], [0.98, 0.01, 0.01]]))
    assert [(beam, token) for beam, token, _ in select(scores, logprobs, 3)] == [(0, 2), (1, 0), (0, 0)]


def test_a_beam_group_takes_only_logits_that_fit_its_beams():
    """Several beams can finish computing in one step. The first to complete the group advances
    it at once, so a later one may be pruned by then, or already extended by a token: its logits
    predict the token it now has, and must not count as scores for the next one."""
    params = SamplingParams(beam_width=2, max_tokens=8, ignore_eos=True)
    beams = [Sequence(i, "r", [1, 2, 3], params, max_len=11, num_computed=3) for i in range(2)]
    group = BeamGroup(2, live=[(beams[0], 0.0), (beams[1], -10.0)])  # beam 0 far ahead: it is forked
    logits = torch.zeros(97)
    logits[5], logits[6] = 2.0, 1.0  # every beam's best two: tokens 5 and 6
    assert not group.offer(beams[0], logits) and group.offer(beams[1], logits)
    survivors, changes = group.advance(itertools.count(2), frozenset())
    pruned = [beam for beam in beams if beam not in survivors]
    assert len(survivors) == 2 and pruned == [beams[1]] and changes[0] == Finish(beams[1], "pruned")
    for beam in survivors:  # extended by one token, not computed yet: these logits are stale
        assert not group.offer(beam, logits)
    assert not group.offer(pruned[0], logits)  # pruned: never again part of the search
    assert not group.pending


@pytest.mark.parametrize("max_tokens", [3, 5, 7, 9])
def test_beams_with_prefix_caching_and_preemption_under_static_batching(tiny_dir, tiny_model, max_tokens):
    """Found by a hostile run: prefix hits make a preempted beam's recompute finish in the same
    step as its siblings', so one beam's logits arrived after the group had already moved on."""
    rng = random.Random(0)
    prompt = [rng.randrange(97) for _ in range(225)]
    others = [[rng.randrange(97) for _ in range(rng.randint(3, 20))] for _ in range(2)]
    params = [SamplingParams(beam_width=4, max_tokens=max_tokens, ignore_eos=True)] + [
        SamplingParams(max_tokens=12, ignore_eos=True)
    ] * 2
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        block_size=4,
        kv_cache_bytes=62 * 4 * KV_BYTES_PER_TOKEN,
        scheduling="static",
        prefix_caching=True,
    )
    out = llm.generate([prompt] + others, params)[0]
    assert llm.engine.num_preemptions > 0
    assert out.error is None and out.samples == reference_beam_search(
        tiny_model, prompt, 4, max_tokens, frozenset()
    )
    assert free_and_intact(llm.engine)
