"""Sampling: greedy is argmax, seeds reproduce, top-k and top-p cut the support as documented, and
no parameter a request may pass makes the probabilities NaN or inf."""

import pytest
import torch

from minillm.decoding import generate
from minillm.sampling import GREEDY_BELOW, Sampler, SamplingParams


def test_same_seed_same_sample_different_seed_differs(tiny_model):
    prompt = [4, 8, 15, 16, 23, 42]
    params = lambda seed: SamplingParams(temperature=1.0, max_tokens=20, seed=seed, ignore_eos=True)  # noqa: E731
    first = generate(tiny_model, prompt, params(7)).token_ids
    assert generate(tiny_model, prompt, params(7)).token_ids == first
    assert generate(tiny_model, prompt, params(8)).token_ids != first


def test_naive_and_cached_draw_the_same_seeded_samples(tiny_model):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=15, seed=3, ignore_eos=True)
    assert (
        generate(tiny_model, [1, 2, 3], params, "naive").token_ids
        == generate(tiny_model, [1, 2, 3], params, "cached").token_ids
    )


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    for params in (
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=1),
    ):
        sampler = Sampler(params)
        assert {sampler(logits) for _ in range(50)} == {best}


def test_top_k_keeps_exactly_the_k_most_likely():
    logits = torch.arange(10, dtype=torch.float32)
    probs = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=0)).filtered_probs(logits)
    assert set(torch.nonzero(probs).flatten().tolist()) == {7, 8, 9}
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=0)).filtered_probs(probs_in.log())
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64))


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([1.0, 2.0, 3.0])
    cold = Sampler(SamplingParams(temperature=0.5, seed=0)).filtered_probs(logits)
    hot = Sampler(SamplingParams(temperature=2.0, seed=0)).filtered_probs(logits)
    assert cold[2] > torch.softmax(logits, 0)[2] > hot[2]


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, GREEDY_BELOW / 2])
def test_a_temperature_below_the_floor_is_greedy(temperature):
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=temperature, top_k=5, seed=1)
    assert params.greedy
    assert Sampler(params)(logits) == int(logits.argmax())


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(GREEDY_BELOW, 0, 1.0), (1e-3, 2, 0.5), (1e308, 0, 1.0), (1e308, 3, 1e-9)]
)
@pytest.mark.parametrize(
    "logits",
    [
        torch.tensor([3e38, -3e38, 0.0, 1.0, 1.5e38]),  # fp32's extremes
        torch.tensor([6e4, -6e4, 0.0, 1.0, 3e4], dtype=torch.float16),  # fp16's
        torch.tensor([3e38, -3e38, 0.0, 1.0, 1.5e38], dtype=torch.bfloat16),
    ],
    ids=["float32", "float16", "bfloat16"],
)
def test_no_temperature_or_cut_makes_the_probabilities_non_finite(logits, temperature, top_k, top_p):
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0))
    probs = sampler.filtered_probs(logits)
    assert torch.isfinite(probs).all() and probs.min() >= 0 and probs.sum().item() == pytest.approx(1.0)
    assert 0 <= sampler(logits) < len(logits)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": "all"}, "top_p"),
        ({"n": True}, "n must"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64 - 1, "n": 2, "temperature": 1.0}, "seed \\+ n"),
        (
            {"temperature": 10**400},
            "temperature must be a finite number",
        ),  # beyond float: not an OverflowError
        ({"top_p": -(10**400)}, "top_p"),
    ],
)
def test_invalid_sampling_parameters_are_refused_with_the_reason(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)
