"""Parallel sampling (n > 1): the samples share the prompt's blocks, copy a shared block before
writing into it, and draw exactly what independent seeded requests draw."""

import pytest
from helpers import free_and_intact

from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32


@pytest.mark.parametrize("prompt_len", [13, 16])  # a partly filled last block, and a full one
def test_samples_equal_independent_seeded_requests(tiny_dir, tiny_model, prompt_len):
    prompt = [(3 * i + 1) % 97 for i in range(prompt_len)]
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=10, max_tokens=20, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, block_size=8, kv_cache_bytes=1 << 20)
    out = llm.generate([prompt], params)[0]
    expected = [
        generate(
            tiny_model,
            prompt,
            SamplingParams(temperature=1.0, top_p=0.95, seed=10 + i, max_tokens=20, ignore_eos=True),
            "naive",
        ).token_ids
        for i in range(4)
    ]
    assert out.samples == expected and out.token_ids == expected[0]
    assert len(set(map(tuple, out.samples))) > 1  # the seeds really differ
    copies = llm.engine.snapshot().counters["copy_on_write"]
    assert copies == (3 if prompt_len % 8 else 0)  # only a partly filled block is ever copied
    assert free_and_intact(llm.engine)


def test_prompt_blocks_are_stored_once(tiny_dir, tiny_model):
    prompt = list(range(40))
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, block_size=8, kv_cache_bytes=1 << 20)
    llm.generate([prompt], params)
    peak_shared = max(m.shared_slots for m in llm.engine.stats.memory)
    assert peak_shared == 3 * 40  # 5 prompt blocks held by 4 samples: 3 extra holders each, no copies


def test_parallel_sampling_under_preemption(tiny_dir, tiny_model):
    prompts = [[(7 * i + j) % 97 for j in range(11 + i)] for i in range(4)]
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=22 * 4 * KV_BYTES_PER_TOKEN)
    outputs = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0
    for out, prompt in zip(outputs, prompts):
        expected = [
            generate(
                tiny_model,
                prompt,
                SamplingParams(temperature=0.8, seed=5 + i, max_tokens=24, ignore_eos=True),
                "naive",
            ).token_ids
            for i in range(3)
        ]
        assert out.samples == expected
    llm.engine.kv_cache.check_invariants()
    assert free_and_intact(llm.engine)
