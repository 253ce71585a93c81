"""The dense part of a step in bf16: the oneDNN-packed matmul `model.py` uses for bf16 on a CPU
computes what torch's bf16 F.linear computes, follows writes to its weight, and the engine's
greedy tokens in bf16 equal the naive decoder's in bf16 (the oracle in the same dtype)."""

import random

import pytest
import torch
import torch.nn.functional as F

from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams
from minillm.model import Linear, onednn_packs
from minillm.weights import load_model

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@needs_onednn
def test_packed_bf16_matmul_equals_torch_linear_within_bf16_rounding():
    gen = torch.Generator().manual_seed(0)
    layer = Linear(576, 960).to(torch.bfloat16)
    layer.weight.data = (torch.randn(960, 576, generator=gen) / 24).to(torch.bfloat16)
    assert onednn_packs(layer.weight)
    for rows in (1, 3, 16, 63, 64, 300):  # decode, small batches (packed), prefill-sized (F.linear)
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        expected = x.float() @ layer.weight.float().T
        assert (layer(x).float() - expected).abs().max() <= 2**-7 * expected.abs().max()  # one bf16 step


@needs_onednn
def test_the_packed_copy_follows_writes_to_the_weight():
    layer = Linear(64, 32).to(torch.bfloat16)
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.fill_(1)
        assert layer(x).float().unique().tolist() == [64.0]
        layer.weight.fill_(2)  # in place: the packed copy made above is stale and must be made again
        assert layer(x).float().unique().tolist() == [128.0]
    layer.weight = torch.nn.Parameter(torch.full((32, 64), 3, dtype=torch.bfloat16))  # replaced
    assert layer(x).float().unique().tolist() == [192.0]


def test_fp32_matmul_is_torch_linear_bit_for_bit(tiny_model):
    """fp32 keeps torch's own kernel, the one HF transformers uses: no second copy, same bits."""
    layer = tiny_model.layers[0].mlp.w_gate_up
    assert not onednn_packs(layer.weight)
    x = torch.randn(5, layer.weight.shape[1])
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_bf16_engine_matches_bf16_naive_on_the_tiny_model(tiny_dir):
    """Attention in torch, the naive decoder's own bf16 operations: the tiny model's random logits
    sit within a bf16 step of each other often, and the kernels (fp32 inside, rounded once) part
    from torch's bf16 matmuls at such ties. The real-model test below runs the default kernels."""
    model = load_model(tiny_dir, torch.bfloat16)
    rng = random.Random(3)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True) for _ in prompts]
    llm = LLM(
        tiny_dir,
        model=model,
        dtype="bfloat16",
        block_size=8,
        kv_cache_bytes=1 << 20,
        attention_backend="torch",
    )
    for out, prompt, sp in zip(llm.generate(prompts, params), prompts, params):
        assert out.token_ids == generate(model, prompt, sp, "naive").token_ids, out.request_id


def test_bf16_engine_matches_bf16_naive_on_the_real_model(real_dir, real_tokenizer):
    """The fp32 test's prompts, in bf16 and under preemption. (bf16 logits are coarse: a prompt
    whose top two logits sit one bf16 step apart, 0.0625 at 15, may go either way between any
    two kernels; these prompts have no such tie.)"""
    model = load_model(real_dir, torch.bfloat16)
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "1, 2, 3, 4,",
        "The GNU General Public License is",
    ] + [
        real_tokenizer.encode_chat([{"role": "user", "content": q}])
        for q in ("What is 2 + 2?", "Name three colors.", "Say hello in French.")
    ]
    params = [SamplingParams(max_tokens=n) for n in (24, 32, 24, 24, 24, 24, 32, 24)]
    llm = LLM(
        real_dir,
        model=model,
        tokenizer=real_tokenizer,
        dtype="bfloat16",
        kv_cache_bytes=6 * 16 * model.config.kv_bytes_per_token(model.dtype),
    )
    for out, prompt, sp in zip(llm.generate(prompts, params), prompts, params):
        ids = real_tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.token_ids == generate(model, ids, sp, "naive", real_tokenizer.eos_token_id).token_ids
    assert llm.engine.num_preemptions > 0
