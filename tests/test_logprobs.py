"""Log-probabilities of the new tokens (`SamplingParams.logprobs`): each equals the log-softmax of
the naive decoder's logits (the whole sequence recomputed, no cache) at that position, within
1e-4 in fp32, through the engine with the prefix cache, preemption, n > 1 and speculation; the k
most likely tokens are the naive logits' top k."""

import random

import pytest
import torch

from minillm.decoding.naive import sequence_logits
from minillm.engine import LLM, SamplingParams

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32


def check_against_naive(model, prompt: list[int], tokens: list[int], logprobs, top: int) -> None:
    reference = torch.log_softmax(sequence_logits(model, prompt + tokens).float(), dim=-1)  # (T, vocab)
    assert len(logprobs) == len(tokens)
    for i, (token, got) in enumerate(zip(tokens, logprobs)):
        row = reference[len(prompt) - 1 + i]  # the logits token i was drawn from
        assert got.token_id == token
        assert abs(got.logprob - float(row[token])) <= 1e-4, (i, got.logprob, float(row[token]))
        best = torch.topk(row, top)
        assert len(got.top) == top
        for (token_id, value), want in zip(got.top, best.values.tolist()):
            assert abs(value - want) <= 1e-4 and abs(value - float(row[token_id])) <= 1e-4


@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"prefix_caching": True, "block_size": 4},
        {"kv_cache_bytes": 12 * 4 * KV_BYTES_PER_TOKEN, "block_size": 4},  # preemption
        {"speculative": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2, "prefix_caching": True},
    ],
    ids=["plain", "prefix-cache", "preemption", "speculation"],
)
def test_logprobs_equal_the_naive_decoders_log_softmax(tiny_dir, tiny_model, switches, always_guess):
    rng = random.Random(0)
    shared = [rng.randrange(97) for _ in range(12)]
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    llm = LLM(tiny_dir, model=tiny_model, **switches)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2, n=2, temperature=0.7, seed=5)
    outs = llm.generate(prompts, greedy) + llm.generate(prompts[:3], sampled)
    for out, prompt, params in zip(outs, prompts + prompts[:3], [greedy] * 6 + [sampled] * 3):
        assert out.error is None and len(out.samples) == len(out.logprobs) == params.n
        for tokens, logprobs in zip(out.samples, out.logprobs):
            check_against_naive(tiny_model, prompt, tokens, logprobs, params.logprobs)
    if "kv_cache_bytes" in switches:
        assert llm.engine.num_preemptions > 0


def test_no_logprobs_unless_asked(tiny_dir, tiny_model):
    (out,) = LLM(tiny_dir, model=tiny_model).generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert out.logprobs is None
    (out,) = LLM(tiny_dir, model=tiny_model).generate([[1, 2, 3]], SamplingParams(max_tokens=3, logprobs=0))
    assert [lp.top for lp in out.logprobs[0]] == [(), (), ()]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"logprobs": 21}, "logprobs must be None or an integer in \\[0, 20\\]"),
        ({"logprobs": -1}, "logprobs must be"),
        ({"logprobs": True}, "logprobs must be"),
        ({"logprobs": 1, "beam_width": 2}, "not beams"),
    ],
)
def test_bad_logprobs_are_one_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


@pytest.mark.parametrize(
    "switches",
    [
        {"max_num_batched_tokens": 8},  # the prompt in chunks
        {"prefix_caching": True, "block_size": 4},  # a scored prompt computes what the cache holds
        {"kv_cache_bytes": 12 * 4 * KV_BYTES_PER_TOKEN, "block_size": 4, "max_num_batched_tokens": 16},
    ],
    ids=["chunked", "prefix-cache", "preemption"],
)
def test_prompt_logprobs_equal_the_naive_decoders_log_softmax(tiny_dir, tiny_model, switches):
    rng = random.Random(1)
    shared = [rng.randrange(97) for _ in range(12)]
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    llm = LLM(tiny_dir, model=tiny_model, **switches)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # cached, for the prefix-cache case
    params = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=2, n=2, temperature=1.0, seed=1)
    for out, prompt in zip(llm.generate(prompts, params), prompts):
        assert (
            out.error is None and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        )
        check_against_naive(tiny_model, prompt[:1], prompt[1:], out.prompt_logprobs[1:], 2)
