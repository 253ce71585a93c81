"""One bad request fails alone, with finish_reason "error" and a message, and the engine keeps
serving: bad token ids, a beam wider than the vocabulary, a sampler that raises or chooses no
token, a step that raises, a scheduler that finds nothing to run. A temperature so small that
logits / temperature would overflow is greedy instead, and fails nobody. Afterwards every block is
free and the next requests equal naive decoding."""

import re

import pytest
from helpers import FailingSampler, free_and_intact, raise_fault

from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams
from minillm.engine.scheduler import Schedule

GOOD = [[5, 6, 7], [8, 9, 10, 11]]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def assert_serves_good_requests(model, llm):
    for out, prompt in zip(llm.generate(GOOD, PARAMS), GOOD):
        assert out.error is None and out.token_ids == generate(model, prompt, PARAMS, "naive").token_ids
    assert free_and_intact(llm.engine)


@pytest.mark.parametrize(
    "prompt, params, words",
    [
        ([5, -1, 7], PARAMS, "Token 1 of the prompt is -1"),
        ([5, 97], PARAMS, r"Token 1 of the prompt is 97; token ids are integers in \[0, 97\)"),
        ([5, 2.0], PARAMS, "Token 1 of the prompt is 2.0"),
        ([True, 5], PARAMS, "Token 0 of the prompt is True"),
        ([5, 6], SamplingParams(beam_width=98, max_tokens=2), "beam_width=98 is more than the 97 tokens"),
    ],
)
def test_a_bad_request_fails_alone_beside_good_ones(tiny_dir, tiny_model, prompt, params, words):
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=1 << 20, max_num_seqs=128)
    outputs = llm.generate([GOOD[0], prompt, GOOD[1]], [PARAMS, params, PARAMS])
    bad = outputs[1]
    assert bad.finished and bad.finish_reason == "error" and bad.token_ids == []
    assert re.search(words, bad.error)
    for out, good in zip((outputs[0], outputs[2]), GOOD):
        assert out.token_ids == generate(tiny_model, good, PARAMS, "naive").token_ids
    assert_serves_good_requests(tiny_model, llm)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-300, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=5e-324, n=2, seed=3, max_tokens=6, ignore_eos=True),
    ],
    ids=["1e-300", "5e-324 n=2"],
)
def test_a_temperature_too_small_to_divide_by_is_greedy_and_fails_nobody(tiny_dir, tiny_model, params):
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=1 << 20)
    outputs = llm.generate([GOOD[0], [12, 13], GOOD[1]], [PARAMS, params, PARAMS])
    assert all(out.error is None for out in outputs)
    greedy = generate(tiny_model, [12, 13], PARAMS, "naive").token_ids
    assert outputs[1].samples == [greedy] * params.n
    for out, good in zip((outputs[0], outputs[2]), GOOD):
        assert out.token_ids == generate(tiny_model, good, PARAMS, "naive").token_ids
    assert_serves_good_requests(tiny_model, llm)


@pytest.mark.parametrize(
    "fault, words",
    [
        (raise_fault, r"Sampling failed \(RuntimeError: probability tensor contains"),
        (lambda: 97, r"Sampling failed \(ValueError: the sampler chose 97, not a token id in \[0, 97\)\)"),
        (lambda: -1, "the sampler chose -1"),
        (lambda: "7", "the sampler chose '7'"),
    ],
    ids=["raises", "past the vocabulary", "negative", "not an int"],
)
def test_a_sampler_that_fails_ends_its_request_alone(tiny_dir, tiny_model, fault, words):
    """The others in the step keep exactly their tokens, and nothing wrong reaches the next forward."""
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=1 << 20)
    engine, final = llm.engine, {}
    ids = [engine.add_request(GOOD[0], PARAMS)]
    ids.append(engine.add_request([12, 13], PARAMS, sampler=FailingSampler(2, fault)))
    ids.append(engine.add_request(GOOD[1], PARAMS))
    while engine.has_unfinished_requests():
        final |= {out.request_id: out for out in engine.step() if out.finished}
    bad = final[ids[1]]
    assert bad.finish_reason == "error" and re.search(words, bad.error) and len(bad.token_ids) == 2
    for request_id, good in zip((ids[0], ids[2]), GOOD):
        assert final[request_id].error is None
        assert final[request_id].token_ids == generate(tiny_model, good, PARAMS, "naive").token_ids
    assert_serves_good_requests(tiny_model, llm)


def test_a_prompt_that_is_not_token_ids_is_refused_in_one_line(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="A prompt is text or a list of token ids, not int"):
        llm.engine.add_request(5, PARAMS)
    assert_serves_good_requests(tiny_model, llm)


def test_a_step_that_raises_fails_its_batch_and_the_engine_goes_on(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=1 << 20)
    forward, calls = llm.engine.runner.forward, []

    def failing_once(scheduled):
        calls.append(len(calls))
        if len(calls) == 3:  # mid-decode: blocks are held, tokens were generated
            raise RuntimeError("injected fault")
        return forward(scheduled)

    llm.engine.runner.forward = failing_once
    outputs = llm.generate(GOOD, PARAMS)
    assert all(
        out.finish_reason == "error" and "RuntimeError: injected fault" in out.error for out in outputs
    )
    assert_serves_good_requests(tiny_model, llm)


def test_a_scheduler_with_nothing_to_run_ends_the_requests_instead_of_spinning(
    tiny_dir, tiny_model, monkeypatch
):
    llm = LLM(tiny_dir, model=tiny_model, kv_cache_bytes=1 << 20)
    monkeypatch.setattr(llm.engine.scheduler, "schedule", lambda: Schedule())
    outputs = llm.generate(GOOD, PARAMS)
    assert all(out.finish_reason == "error" and "found nothing it could run" in out.error for out in outputs)
    monkeypatch.undo()
    assert_serves_good_requests(tiny_model, llm)


def test_misuse_of_the_engine_api_is_one_line(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="There is no request 'nope' to abort"):
        llm.engine.abort("nope")
    with pytest.raises(ValueError, match="3 prompts but 2 SamplingParams"):
        llm.generate([[1], [2], [3]], [PARAMS, PARAMS])
    assert_serves_good_requests(tiny_model, llm)
