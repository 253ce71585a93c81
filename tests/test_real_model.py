"""The real SmolLM2-135M-Instruct: minillm agrees with HF transformers on the same safetensors.

HF's eager attention is the reference: it is plain math like ours, and it is what our logits
match to the last bit. HF's default SDPA attention differs from HF eager itself by ~1e-4 on
these weights (a different summation order in fp32), so it is checked with that margin.
"""

import pytest
import torch
from helpers import REAL_CHAT_QUESTIONS

from minillm.decoding import generate
from minillm.decoding.cached import CachedDecoder
from minillm.decoding.naive import sequence_logits
from minillm.sampling import SamplingParams

POSITIONS = 96  # > 64 positions of real text


@pytest.fixture(scope="module")
def hf_eager(real_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(real_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def cached_logits(model, ids):
    decoder = CachedDecoder(model, len(ids))
    return torch.stack([decoder.prefill(ids[:8])] + [decoder.step(t) for t in ids[8:]])  # (T - 7, vocab)


def test_naive_logits_match_hf_transformers(real_model, hf_eager, real_text_ids):
    ids = real_text_ids[:POSITIONS]
    assert (sequence_logits(real_model, ids) - hf_logits(hf_eager, ids)).abs().max() <= 1e-4


# One token at a time multiplies by the weights as matrix-vector products, HF's single pass as one
# matrix product: the BLAS sums in another order. Measured on logits up to ~40: 0 on a Xeon,
# 1.5e-4 on an AMD EPYC (the same gap on the code before any change here), both on the GPL-3 text;
# 6.0e-5 on the AMD EPYC on Alice, this test's text: fp32 noise, not a bug. The bound stays at the
# 5e-4 set for the largest gap seen on any machine, since other CPUs were not measured on Alice.
CACHED_VS_HF_ATOL = 5e-4


def test_cached_logits_match_hf_transformers(real_model, hf_eager, real_text_ids):
    ids = real_text_ids[200 : 200 + POSITIONS]
    assert (cached_logits(real_model, ids) - hf_logits(hf_eager, ids)[7:]).abs().max() <= CACHED_VS_HF_ATOL


def test_logits_match_hf_default_sdpa_within_its_own_spread(real_model, hf_model, hf_eager, real_text_ids):
    ids = real_text_ids[:POSITIONS]
    sdpa, eager = hf_logits(hf_model, ids), hf_logits(hf_eager, ids)
    spread = (sdpa - eager).abs().max()
    assert (sequence_logits(real_model, ids) - sdpa).abs().max() <= max(2 * spread, 1e-4)


@pytest.mark.parametrize("prompt", REAL_CHAT_QUESTIONS)
def test_greedy_chat_reply_is_identical_to_hf(real_model, real_tokenizer, hf_model, naive_real, prompt):
    ids = real_tokenizer.encode_chat([{"role": "user", "content": prompt}])
    with torch.no_grad():
        hf_out = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=40,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            eos_token_id=real_tokenizer.eos_token_id,
            pad_token_id=real_tokenizer.eos_token_id,
        )
    expected = hf_out[0, len(ids) :].tolist()
    assert naive_real(ids, 40) == expected
    ours = generate(
        real_model, ids, SamplingParams(max_tokens=40), "cached", frozenset({real_tokenizer.eos_token_id})
    )
    assert ours.token_ids == expected


def perplexity(model, ids):
    logits = sequence_logits(model, ids)
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).exp().item()


def test_undoing_llama_cpp_rope_permutation_matters(real_dir, real_model, real_text_ids):
    """HF reads the same files as we do, so agreeing with HF cannot catch a wrong permutation.
    Perplexity on real prose can: put llama.cpp's row order back and the model stops knowing English."""
    from minillm.weights import load_model

    ids = real_text_ids[:256]
    good = perplexity(real_model, ids)
    broken = load_model(real_dir)
    cfg = broken.config
    with torch.no_grad():
        for layer in broken.layers:
            q_rows = cfg.num_heads * cfg.head_dim
            for start, heads in ((0, cfg.num_heads), (q_rows, cfg.num_kv_heads)):
                rows = layer.attn.wqkv.weight[start : start + heads * cfg.head_dim]
                # llama.cpp's order: halves (heads, 2, d/2) stored as interleaved pairs (heads, d/2, 2)
                rows.copy_(rows.reshape(heads, 2, cfg.head_dim // 2, -1).transpose(1, 2).reshape(rows.shape))
    assert good < 44
    # measured: 31.4 vs 316 (21.7 vs 180 on the GPL-3 text: < 30, > 5x)
    assert perplexity(broken, ids) > 6 * good


def test_bf16_model_stays_close_to_fp32(real_dir, real_model, real_text_ids):
    from minillm.weights import load_model

    ids = real_text_ids[:32]
    bf16 = sequence_logits(load_model(real_dir, torch.bfloat16), ids)
    fp32 = sequence_logits(real_model, ids)
    assert bf16.dtype == torch.float32  # logits are always handed to the sampler in fp32
    assert (bf16.argmax(-1) == fp32.argmax(-1)).float().mean() > 0.8
