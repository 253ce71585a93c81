"""The dense part of a step in bf16: the weight-streaming C++ kernel and the oneDNN-packed matmul
`matmul.py` gives bf16 on a CPU compute what torch's bf16 F.linear computes within bf16
rounding, the packed copy follows writes to its weight, and the engine's greedy tokens in bf16
equal the naive decoder's in bf16 (the oracle in the same dtype) but at ties."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from minillm.decoding import generate
from minillm.decoding.naive import NaiveDecoder
from minillm.engine import LLM, SamplingParams
from minillm.matmul import DENSE_MAX_ROWS, ONEDNN, Linear, dense_kernel, onednn_packs
from minillm.model import RMSNorm, apply_rope
from minillm.weights import load_model

needs_onednn = pytest.mark.skipif(
    not ONEDNN, reason="this CPU's oneDNN packs no bf16 (it needs avx512bw/vl/dq or avx_ne_convert)"
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


def test_dense_kernel_equals_the_float_product_within_bf16_rounding():
    """Every decode-sized row count, both of SmolLM2's input widths, an output count that is a
    few weight groups and one that is many; each row computed as if it were alone."""
    kernel = dense_kernel()
    assert kernel is not None, "the CPU kernels must build here"
    gen = torch.Generator().manual_seed(1)
    for in_features, out_features in ((576, 960), (1536, 576), (64, 24)):
        weight = (torch.randn(out_features, in_features, generator=gen) / 24).to(torch.bfloat16)
        assert kernel.dense_fits(in_features, out_features)
        for rows in range(1, DENSE_MAX_ROWS + 1):
            x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
            out = kernel.dense(x, weight)
            expected = x.float() @ weight.float().T
            assert (out.float() - expected).abs().max() <= 2**-7 * expected.abs().max()
            assert torch.equal(out[-1:], kernel.dense(x[-1:].contiguous(), weight))  # rows are independent
    assert not kernel.dense_fits(576, 12) and not kernel.dense_fits(100, 64)  # F.linear or oneDNN then


def test_the_bf16_norm_kernel_is_torchs_norm_within_a_bf16_step():
    """dense_cpu.cpp's rms_norm against model.py's torch formula, on rows of very different sizes."""
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(576, generator=gen).to(torch.bfloat16)
    x = (torch.randn(40, 576, generator=gen) * torch.logspace(-3, 3, 40)[:, None]).to(torch.bfloat16)
    expected = norm.weight * F.rms_norm(x.float(), (576,), eps=1e-5).to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert ((out.float() - expected.float()).abs() <= 2**-7 * expected.float().abs() + 1e-30).all()
    assert torch.equal(norm(x[7:8]), out[7:8])  # a row alone is the same row in a batch


def test_the_bf16_rope_kernel_gives_torchs_bits():
    """apply_rope's C++ path against the same formula in torch's bf16 operations, on q and k heads
    that are a view into the wider rows of the fused projection (as the model calls it)."""
    gen = torch.Generator().manual_seed(3)
    for tokens in (1, 7, 130):
        rows = torch.randn(tokens, 960, generator=gen).to(torch.bfloat16)
        heads = rows[:, :768].view(tokens, 12, 64)
        cos, sin = (torch.randn(tokens, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
        swapped = heads.roll(32, dims=-1)
        assert torch.equal(apply_rope(heads, cos, sin), heads * cos[:, None, :] + swapped * sin[:, None, :])


def test_a_weight_the_kernel_does_not_fit_takes_the_packed_copy():
    layer = Linear(100, 36).to(torch.bfloat16)  # 100 inputs: no whole vector steps
    x = torch.randn(1, 100).to(torch.bfloat16)
    expected = x.float() @ layer.weight.float().T
    assert (layer(x).float() - expected).abs().max() <= 2**-7 * expected.abs().max()


def test_the_read_probe_reads_every_byte():
    words = torch.randint(-(2**40), 2**40, (3 << 16,), dtype=torch.int64)
    assert dense_kernel().read_bytes(words) == words.sum().item()


@needs_onednn
def test_the_packed_copy_follows_writes_to_the_weight():
    layer = Linear(64, 32).to(torch.bfloat16)
    x = torch.ones(DENSE_MAX_ROWS + 1, 64, dtype=torch.bfloat16)  # rows the packed copy takes
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


def bf16_steps_apart(logits: torch.Tensor, a: int, b: int) -> float:
    """How many bf16 rounding steps (at the larger logit's size) separate tokens a and b."""
    hi = max(logits[a].item(), logits[b].item())
    step = 2.0 ** (math.floor(math.log2(abs(hi))) - 7)  # bf16 keeps 8 significant bits
    return abs(logits[a].item() - logits[b].item()) / step


@pytest.mark.slow  # real weights through a whole decode (15-45 s)
def test_bf16_engine_matches_bf16_cached_decoding_on_the_real_model(real_dir, real_tokenizer):
    """The fp32 test's prompts, in bf16 and under preemption, against the plain KV-cache decoder
    (one sequence at a time, no paging; the naive decoder took 100 s here on an AVX2-only CPU,
    which computes bf16 slowly). bf16 logits are coarse: one step is 0.125 at 25, and two kernels
    that sum in another order (a batch's rows and a lone row take different products) may pick
    either of two tokens that close. So every prompt gives the reference's tokens, or parts from
    them where the naive decoder's logits put the two tokens within two bf16 steps — a tie, not a
    bug — and most give them exactly (7 of 8 on an AVX-512 CPU, 6 of 8 on an AVX2-only EPYC,
    whose bf16 products take F.linear and sum in yet another order, 5 of 8 on a Xeon with AMX,
    whose tiles sum in another order again). The tie rule is the property; the count only checks
    that ties stay the exception."""
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
    exact = 0
    for out, prompt, sp in zip(llm.generate(prompts, params), prompts, params):
        ids = real_tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        expected = generate(model, ids, sp, "cached", frozenset({real_tokenizer.eos_token_id})).token_ids
        if out.token_ids == expected:
            exact += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(out.token_ids, expected)) if a != b)
        logits = NaiveDecoder(model, len(ids) + at + 1).prefill(ids + expected[:at])
        assert bf16_steps_apart(logits, expected[at], out.token_ids[at]) <= 2, (prompt, at)
    assert exact > len(prompts) // 2
    assert llm.engine.num_preemptions > 0


@needs_onednn
def test_bf16_onednn_products_see_few_row_counts(monkeypatch):
    """oneDNN keeps a primitive per row count it has seen (bf16 RSS grew ~2.7 MB per prefill
    length): rows are padded to multiples of DECODE_BUCKET (packed copy) or PREFILL_BUCKET
    (F.linear), so 64-300 rows reach F.linear as 8 shapes, and each row's result is unchanged."""
    from minillm import matmul

    seen = set()
    linear = F.linear

    def record(product):
        def recorded(x, *args):
            seen.add(x.shape[0])
            return product(x, *args)

        return recorded

    monkeypatch.setattr(matmul.F, "linear", record(linear))  # the prefill path's product
    gen = torch.Generator().manual_seed(6)
    layer = Linear(64, 96).to(torch.bfloat16)
    layer.weight.data = (torch.randn(96, 64, generator=gen) / 8).to(torch.bfloat16)
    for rows in range(DENSE_MAX_ROWS + 1, 301):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        out = layer(x)
        assert out.shape == (rows, 96)
        expected = x.float() @ layer.weight.float().T
        assert (out.float() - expected).abs().max() <= 2**-7 * expected.abs().max()
    prefill = {n for n in seen if n > matmul.PACKED_MAX_ROWS}
    assert prefill and all(n % matmul.PREFILL_BUCKET == 0 for n in prefill) and len(prefill) <= 300 // 32 + 1
