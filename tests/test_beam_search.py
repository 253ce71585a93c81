"""Beam search in the engine gives the beams of a reference search that recomputes everything,
while the beams share their history's blocks and dropped beams release theirs."""

import pytest

from minillm.engine import LLM, SamplingParams
from minillm.engine.beam import reference_beam_search

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32


@pytest.mark.parametrize("width, prompt_len", [(2, 5), (4, 13), (4, 16)])
def test_engine_beams_equal_reference_beams(tiny_dir, tiny_model, width, prompt_len):
    prompt = [(11 * i + 3) % 97 for i in range(prompt_len)]
    params = SamplingParams(beam_width=width, max_tokens=10, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=1 << 20)
    out = llm.generate([prompt], params)[0]
    assert out.samples == reference_beam_search(tiny_model, prompt, width, 10, None)
    assert out.token_ids == out.samples[0] and out.finished
    manager = llm.engine.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks  # dropped and finished beams gave everything back
    assert max(m.shared_slots for m in llm.engine.stats.memory) > 0


def test_beams_stop_at_eos(tiny_dir, tiny_model):
    prompt = [1, 2, 3, 4]
    eos = reference_beam_search(tiny_model, prompt, 3, 3, None)[1][1]  # a token some beam emits second
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=1 << 20)
    out = llm.generate([prompt], SamplingParams(beam_width=3, max_tokens=8))[0]
    assert out.samples == reference_beam_search(tiny_model, prompt, 3, 8, tiny_model.config.eos_token_id)
    assert eos is not None


def test_beam_search_under_preemption(tiny_dir, tiny_model):
    prompts = [[(5 * i + j) % 97 for j in range(9 + 2 * i)] for i in range(3)]
    params = SamplingParams(beam_width=3, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=16 * 4 * KV_BYTES_PER_TOKEN)
    outputs = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0
    for out, prompt in zip(outputs, prompts):
        assert out.samples == reference_beam_search(tiny_model, prompt, 3, 12, None)


def test_beam_search_needs_greedy_settings():
    with pytest.raises(ValueError, match="beam search is deterministic"):
        SamplingParams(beam_width=2, temperature=0.7)
