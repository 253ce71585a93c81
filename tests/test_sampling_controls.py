"""presence / frequency / repetition penalties, logit_bias, min_tokens and stop_token_ids: the
engine's greedy tokens equal a direct computation here — the naive decoder's logits for the whole
sequence, each control applied by hand, one token at a time — alone, together, with the prefix
cache, preemption and speculation (each row's penalties counting the guesses before it)."""

import pytest
import torch

from minillm.decoding.naive import sequence_logits
from minillm.engine import LLM, SamplingParams

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32
EOS = 2  # the tiny model's eos_token_id (tests/conftest.py TINY_CONFIG)


def by_hand(model, prompt: list[int], params: SamplingParams, eos: int) -> list[int]:
    """Greedy decoding with every control applied by hand, in plain Python over the vocabulary."""
    tokens: list[int] = []
    while len(tokens) < params.max_tokens:
        logits = sequence_logits(model, prompt + tokens)[-1].float().tolist()
        if len(tokens) < params.min_tokens:
            for banned in (eos, *params.stop_token_ids):
                logits[banned] = float("-inf")
        for token, bias in params.logit_bias:
            logits[token] += bias
        seen = set(prompt) | set(tokens)
        for token in range(len(logits)):
            if token in seen and params.repetition_penalty != 1:
                value = logits[token]
                logits[token] = (
                    value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
                )
            count = tokens.count(token)
            logits[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        tokens.append(max(range(len(logits)), key=logits.__getitem__))
        if tokens[-1] == eos and not params.ignore_eos or tokens[-1] in params.stop_token_ids:
            break
    return tokens


CONTROLS = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.8},
    "repetition": {"repetition_penalty": 1.4},
    "repetition_below_1": {"repetition_penalty": 0.6},
    "logit_bias": {"logit_bias": ((5, 4.0), (11, -100.0))},
    "together": {"presence_penalty": -0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    # a loop the n-gram guesser follows, until each token's count outweighs its bias: under
    # speculation, a row's count must include the guesses before it
    "loop_until_counted": {"logit_bias": ((3, 9.0), (4, 9.0), (5, 9.0)), "frequency_penalty": 1.5},
}


@pytest.mark.parametrize("controls", CONTROLS.values(), ids=CONTROLS)
@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"prefix_caching": True, "block_size": 4, "kv_cache_bytes": 12 * 4 * KV_BYTES_PER_TOKEN},
        {"speculative": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    ],
    ids=["plain", "cache+preemption", "speculation"],
)
def test_controls_equal_a_direct_computation(tiny_dir, tiny_model, controls, switches, always_guess):
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 9, 9, 2, 9, 9], [3, 4, 5, 3, 4, 6, 1]]
    params = SamplingParams(max_tokens=14, ignore_eos=True, **controls)
    outs = LLM(tiny_dir, model=tiny_model, **switches).generate(prompts, params)
    for out, prompt in zip(outs, prompts):
        assert out.error is None and out.token_ids == by_hand(tiny_model, prompt, params, EOS)
    plain = LLM(tiny_dir, model=tiny_model).generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True))
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]  # the control changed something


def test_min_tokens_holds_eos_back_and_a_stop_token_ends_like_eos(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model)
    eos_likely = SamplingParams(max_tokens=10, min_tokens=4, logit_bias=((EOS, 100.0),))
    (out,) = llm.generate([[1, 5, 3]], eos_likely)
    assert out.token_ids == by_hand(tiny_model, [1, 5, 3], eos_likely, EOS)
    assert len(out.token_ids) == 5 and out.token_ids[-1] == EOS and EOS not in out.token_ids[:4]
    stop_at_7 = SamplingParams(max_tokens=10, logit_bias=((7, 100.0),), stop_token_ids=(7,))
    (out,) = llm.generate([[1, 5, 3]], stop_at_7)
    assert out.token_ids == [7] and out.finish_reason == "eos"


def test_sampled_controls_draw_from_the_processed_distribution(tiny_dir, tiny_model):
    """A logit_bias of -100 makes a token impossible to draw; +100 makes it certain."""
    llm = LLM(tiny_dir, model=tiny_model)
    banned = SamplingParams(
        max_tokens=30, temperature=1.5, seed=3, ignore_eos=True, logit_bias=((4, -100.0),)
    )
    forced = SamplingParams(max_tokens=6, temperature=1.5, seed=3, ignore_eos=True, logit_bias=((4, 100.0),))
    assert 4 not in llm.generate([[1, 5, 3]], banned)[0].token_ids
    assert llm.generate([[1, 5, 3]], forced)[0].token_ids == [4] * 6


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in \\[-2, 2\\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias must be"),
        ({"min_tokens": 9, "max_tokens": 8}, "must not exceed max_tokens"),
        ({"stop_token_ids": (True,)}, "stop_token_ids must be token ids"),
        ({"beam_width": 2, "repetition_penalty": 1.2}, "not beams"),
    ],
)
def test_bad_controls_are_one_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_a_token_id_beyond_the_vocabulary_is_refused_at_add_request(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model)
    with pytest.raises(ValueError, match="token ids in \\[0, 97\\)"):
        llm.engine.add_request([1, 2], SamplingParams(logit_bias=((97, 1.0),)))
    assert torch.is_tensor(sequence_logits(tiny_model, [1, 2]))  # the engine is untouched and usable
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].error is None
