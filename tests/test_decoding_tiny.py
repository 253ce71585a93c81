"""Naive (no cache) and cached decoding agree on a tiny random Llama: same greedy ids, same logits.
The tiny model also goes through HF transformers, an independent implementation of the math."""

import random

import pytest
import torch

from minillm.decoding import generate
from minillm.decoding.cached import CachedDecoder
from minillm.decoding.naive import sequence_logits
from minillm.sampling import SamplingParams


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(count)]


@pytest.mark.parametrize("max_tokens", [1, 7, 30])
def test_naive_and_cached_greedy_ids_are_identical(tiny_model, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for prompt in random_prompts(12, tiny_model.config.vocab_size, seed=max_tokens):
        naive = generate(tiny_model, prompt, params, decoder="naive")
        cached = generate(tiny_model, prompt, params, decoder="cached")
        assert cached.token_ids == naive.token_ids
        assert len(naive.token_ids) == max_tokens


def test_cached_logits_match_naive_at_every_step(tiny_model):
    rng = random.Random(1)
    tokens = [rng.randrange(tiny_model.config.vocab_size) for _ in range(60)]
    full = sequence_logits(tiny_model, tokens)  # (60, vocab)
    decoder = CachedDecoder(tiny_model, max_len=len(tokens))
    steps = [decoder.prefill(tokens[:5])] + [decoder.step(t) for t in tokens[5:]]
    assert torch.allclose(torch.stack(steps), full[4:], atol=1e-5, rtol=0)


def test_prefill_in_chunks_matches_one_prefill(tiny_model):
    """The cache attends with absolute positions, so a prompt fed in pieces gives the same logits."""
    tokens = list(range(3, 40))
    whole = CachedDecoder(tiny_model, 64).prefill(tokens)
    pieces = CachedDecoder(tiny_model, 64)
    for start in range(0, len(tokens), 9):
        last = pieces.forward(tokens[start : start + 9])
    assert torch.allclose(last, whole, atol=1e-5, rtol=0)


def test_tiny_model_matches_hf_transformers(tiny_dir, tiny_model):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tokens = random_prompts(1, tiny_model.config.vocab_size, seed=5)[0] * 3
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    assert torch.allclose(sequence_logits(tiny_model, tokens), expected, atol=1e-5, rtol=0)


def test_generation_stops_at_eos_and_at_the_context_end(tiny_model):
    prompt = [5, 6, 7]
    first = generate(tiny_model, prompt, SamplingParams(max_tokens=1)).token_ids[0]
    stopped = generate(tiny_model, prompt, SamplingParams(max_tokens=20), eos_token_ids=frozenset({first}))
    assert stopped.token_ids == [first] and stopped.finish_reason == "eos"
    squeezed = generate(tiny_model, prompt, SamplingParams(max_tokens=20, ignore_eos=True), context_len=10)
    assert len(squeezed.token_ids) == 7 and squeezed.finish_reason == "length"


def test_kv_cache_bytes_follow_the_formula(tiny_model):
    cfg = tiny_model.config
    decoder = CachedDecoder(tiny_model, max_len=50)
    assert decoder.kv_bytes == 50 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert decoder.kv_bytes == 50 * cfg.kv_bytes_per_token(torch.float32)
