"""Weights read as GGUF blocks (`--weights q4_1 | int8`, `quantized_weights.py`) and the fused decode
layer: the C++ product multiplies by the blocks' exact fp32 values (checked against F.linear on the
`gguf` package's dequantization), a model whose dense weights *are* those values decodes the naive
decoder's greedy tokens through blocks and fused layers, the fused layer equals the unfused one,
and the fetched Q4_1 blocks dequantize to model.safetensors bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quantize
from helpers import (
    KV_BYTES_PER_TOKEN,
    REAL_PLAIN_PROMPTS,
    TINY_CONFIG,
    assert_fused_layers_equal_unfused,
    random_llama_tensors,
    snap_to_blocks,
    write_checkpoint,
)
from safetensors.torch import load_file, save_file

from minillm.config import ConfigError
from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams
from minillm.matmul import QUANT_MAX_ROWS, dense_kernel
from minillm.quantized_weights import FORMAT_CODES, PACKED_FILE, QuantizedWeight, read_packed
from minillm.weights import load_model, resolve_weights

BLOCK_FORMATS = ["q4_0", "q4_1", "q8_0"]  # what quant_dense reads


def blocks_of(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """`weight` quantized by the `gguf` package, as llama.cpp writes a GGUF's blocks."""
    blocks = quantize(weight.numpy(), GGMLQuantizationType[fmt.upper()])
    return QuantizedWeight(torch.from_numpy(blocks), fmt)


def assert_within_rounding(out: torch.Tensor, x: torch.Tensor, exact: torch.Tensor) -> None:
    """out == x @ exact.T but for the rounding of the sums (and of bf16's result): each output
    within a tolerance of sum_k |x_k w_k|, what a dot product's rounding error is bounded by."""
    expected = F.linear(x.double(), exact.double())
    magnitude = F.linear(x.double().abs(), exact.double().abs())
    tolerance = 2**-7 if x.dtype == torch.bfloat16 else 1e-5
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert ((out.double() - expected).abs() <= tolerance * magnitude).all()


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_dense_is_the_dequantized_product_within_rounding(fmt, dtype):
    """Every decode-sized row count; output counts that are whole weight groups and ones that are
    not (1, 3, 17, 97); rows of 1, 3 and 5 blocks (not whole pairs); a row's result does not
    depend on the rows beside it."""
    kernel = dense_kernel()
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in ((1, 32), (3, 96), (17, 160), (96, 64), (97, 96), (576, 1536)):
        weight = blocks_of(torch.randn(out_features, in_features, generator=gen) / 8, fmt)
        exact = weight.dequantize()  # the gguf package's fp32 values
        for rows in range(1, QUANT_MAX_ROWS + 1):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            out = kernel.quant_dense(x, weight.blocks, FORMAT_CODES[fmt])
            assert_within_rounding(out, x, exact)
            assert torch.equal(
                out[-1:], kernel.quant_dense(x[-1:].contiguous(), weight.blocks, FORMAT_CODES[fmt])
            )


def snapped_checkpoint(folder, fmt: str):
    """The tiny model with every matrix snapped to `fmt`'s grid, its blocks written beside it
    (`helpers.snap_to_blocks`)."""
    tensors, packed, formats = snap_to_blocks(random_llama_tensors(TINY_CONFIG, seed=3), fmt)
    write_checkpoint(folder, TINY_CONFIG, tensors)
    save_file(packed, folder / PACKED_FILE, metadata=formats)
    return folder


@pytest.mark.parametrize(
    "weights, fmt", [("q4_1", "q4_1"), ("q4_1", "q4_0"), ("q4_1", "q8_0"), ("int8", "q8_0")]
)
@pytest.mark.parametrize("fused", [True, False])
def test_decoding_through_blocks_gives_the_naive_decoders_tokens(tmp_path, weights, fmt, fused):
    """fp32, paged KV, C++ attention, batches of 1-4 sequences (decode-sized, so every product of a
    decode step reads blocks), greedy: the engine's tokens equal the naive decoder's on the same values."""
    folder = snapped_checkpoint(tmp_path / "tiny", fmt)
    dense = load_model(folder)
    model = load_model(folder, weights=weights, fused=fused)
    assert all(m.quantized is not None for m in model.products().values())
    assert all(layer.fused == fused for layer in model.layers)
    prompts = [[5, 9, 14, 3, 7], [11, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68], [8] * 20]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = LLM(folder, model=model, attention_backend="cpu")
    for out, prompt in zip(llm.generate(prompts, params), prompts):
        assert out.token_ids == generate(dense, prompt, params, "naive").token_ids


LOSSLESS_SWITCHES = [
    {"prefix_caching": True, "block_size": 4},
    {"kv_cache_bytes": 16 * 4 * KV_BYTES_PER_TOKEN, "block_size": 4},  # too few blocks: preemption
    {"speculative": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2},  # k + 1 rows checked at once
    {"attention_backend": "torch", "max_num_batched_tokens": 6},  # chunked prefill of 6-row chunks
]


@pytest.mark.parametrize("switches", LOSSLESS_SWITCHES)
def test_lossless_switches_through_fused_blocks_give_the_naive_tokens(tmp_path, switches, always_guess):
    """The fused layers under the engine's other lossless switches: shared prefixes, preemption and
    recompute, speculation's checked rows (and its rollback), small prefill chunks."""
    folder = snapped_checkpoint(tmp_path / "tiny", "q8_0")
    dense, model = load_model(folder), load_model(folder, weights="int8")
    prompts = [[5, 9, 14, 3, 7, 5, 9, 14, 3, 7], [5, 9, 14, 3, 11, 4], [21, 22, 21, 22, 21, 22, 21]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = LLM(folder, model=model, **switches)
    expected = [generate(dense, prompt, params, "naive").token_ids for prompt in prompts]
    for _ in range(2):  # the second time, prompts find the first time's blocks (prefix caching)
        assert [out.token_ids for out in llm.generate(prompts, params)] == expected


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_layer_equals_the_unfused_one(tmp_path, fmt, dtype):
    model = load_model(snapped_checkpoint(tmp_path / "tiny", fmt), dtype, weights="q4_1")
    assert {m.quantized.format for m in model.products().values()} == {fmt}
    assert_fused_layers_equal_unfused(model, positions=[0, 7, 40])


def test_weights_auto_takes_the_blocks_where_they_are_and_says_why_not(tmp_path, tiny_dir):
    snapped = snapped_checkpoint(tmp_path / "tiny", "q4_1")
    assert resolve_weights("auto", snapped, torch.float32, "cpu") == "q4_1"
    assert resolve_weights("auto", tiny_dir, torch.float32, "cpu") == "model"  # no blocks fetched
    assert resolve_weights("auto", snapped, torch.float16, "cpu") == "model"
    with pytest.raises(ConfigError, match="weights_fetch.py"):
        load_model(tiny_dir, weights="q4_1")
    with pytest.raises(ConfigError, match="float32 or bfloat16"):
        resolve_weights("int8", snapped, torch.float16, "cpu")
    with pytest.raises(ConfigError, match="CPU kernel only"):
        resolve_weights("q4_1", snapped, torch.float32, "cuda")
    with pytest.raises(ConfigError, match="must be one of"):
        LLM(snapped, weights="q4")


def test_a_corrupt_or_misshapen_packed_file_is_a_one_line_error(tmp_path):
    folder = snapped_checkpoint(tmp_path / "tiny", "q4_1")
    packed = load_file(folder / PACKED_FILE)
    name = "model.layers.0.mlp.down_proj.weight"
    save_file(
        packed | {name: packed[name][:, :-2].contiguous()},
        folder / PACKED_FILE,
        metadata={n: "q4_1" for n in packed},
    )
    with pytest.raises(ConfigError, match="do not hold a"):
        load_model(folder, weights="q4_1")
    (folder / PACKED_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        load_model(folder, weights="q4_1")


def test_the_fetched_q4_1_blocks_are_the_fp32_checkpoint_bit_for_bit(real_dir):
    """weights_fetch.py wrote both files from one GGUF: the blocks (rows put back in HF's RoPE order)
    dequantize to exactly model.safetensors' numbers, so `--weights q4_1` is lossless."""
    dense = load_file(real_dir / "model.safetensors")
    packed = read_packed(real_dir)
    assert {w.format for w in packed.values()} == {"q4_1", "q8_0"}  # the layers, and the embedding
    assert set(packed) == {name for name, t in dense.items() if t.dim() == 2}
    for name, weight in packed.items():
        assert torch.equal(weight.dequantize(), dense[name]), name


def test_the_real_model_through_q4_1_blocks_decodes_naive_fp32s_tokens(real_dir, naive_real, real_tokenizer):
    """The default serving path's weights in fp32 (blocks, fused layers) against the naive decoder."""
    llm = LLM(real_dir, weights="q4_1")
    assert llm.engine.model.layers[0].fused
    params = SamplingParams(max_tokens=24)
    for prompt in REAL_PLAIN_PROMPTS:
        ids = real_tokenizer.encode(prompt)
        assert llm.generate([ids], params)[0].token_ids == naive_real(ids, 24)


BINDING = """
#include <torch/extension.h>
at::Tensor quant_dense(const at::Tensor& x, const at::Tensor& blocks, int64_t format);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("quant_dense", &quant_dense); }
"""


@pytest.mark.slow  # a build of 20-40 s each; the AVX-512 build's products are checked in the fast tier
@pytest.mark.kernel_build
@pytest.mark.parametrize(
    "isa, flags", [("avx2", ["-mno-avx512f"]), ("scalar", ["-mno-avx512f", "-mno-avx2", "-mno-fma"])]
)
def test_quant_dense_without_avx512_builds_and_agrees(tmp_path, isa, flags):
    """The AVX2 path (an EPYC without AVX-512) and the plain C++ one, built here by turning the wider
    instructions off, give the same products as the gguf package's values."""
    from torch.utils.cpp_extension import load

    from minillm.attention.kernels import CPU_FLAGS, SOURCES

    (tmp_path / "binding.cpp").write_text(BINDING)
    kernel = load(
        f"minillm_quant_dense_{isa}",
        [str(SOURCES / "quant_dense_cpu.cpp"), str(tmp_path / "binding.cpp")],
        extra_cflags=[*CPU_FLAGS, *flags],
        build_directory=str(tmp_path),
    )
    gen = torch.Generator().manual_seed(5)
    for fmt in BLOCK_FORMATS:
        weight = blocks_of(torch.randn(97, 96, generator=gen) / 8, fmt)
        for rows in (1, 3):
            x = torch.randn(rows, 96, generator=gen)
            assert_within_rounding(
                kernel.quant_dense(x, weight.blocks, FORMAT_CODES[fmt]), x, weight.dequantize()
            )


def test_int8_leaves_a_matrix_whose_rows_are_not_whole_blocks_dense(tmp_path):
    """hidden 48: q|k|v, gate|up and the head read 48 inputs, not whole blocks of 32, so they keep
    their dense weights, no layer is fused, and the model still decodes what the dense one does."""
    config = {**TINY_CONFIG, "hidden_size": 48, "head_dim": 12}
    folder = write_checkpoint(tmp_path / "odd", config, random_llama_tensors(config))
    model = load_model(folder, weights="int8")
    with_blocks = {name for name, m in model.products().items() if m.quantized is not None}
    assert with_blocks == {f"layers.{i}.mlp.w_down.weight" for i in range(config["num_hidden_layers"])}
    assert not any(layer.fused for layer in model.layers)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    out = LLM(folder, model=model).generate([[5, 9, 14]], params)[0]
    assert len(out.token_ids) == 8


def test_a_kernel_build_that_fails_leaves_torch_serving_with_one_warning(tmp_path, monkeypatch, capsys):
    """The C++ build failing (no compiler, a compile error): attention falls back to torch with one
    line saying why, `weights="auto"` reads the dense weights, asking for blocks is a one-line
    error, and the tokens are still the naive decoder's."""
    from minillm import matmul
    from minillm.attention import kernels

    def broken():
        raise ConfigError(
            "The minillm_attention_cpu kernel did not build (error: no compiler here); use torch."
        )

    folder = snapped_checkpoint(tmp_path / "tiny", "q4_1")
    monkeypatch.setattr(kernels, "cpu_kernel", broken)
    matmul.dense_kernel.cache_clear()  # the build's answer is cached per process
    try:
        model = load_model(folder, weights="auto")
        assert all(m.quantized is None for m in model.products().values())
        llm = LLM(folder, model=model)  # attention_backend="auto"
        assert llm.engine.runner.backend.name == "torch"
        assert capsys.readouterr().err.count("no compiler here") == 1
        with pytest.raises(ConfigError, match="did not build here"):
            load_model(folder, weights="q4_1")
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        prompt = [5, 9, 14, 3]
        assert (
            llm.generate([prompt], params)[0].token_ids
            == generate(load_model(folder), prompt, params, "naive").token_ids
        )
    finally:
        monkeypatch.undo()
        matmul.dense_kernel.cache_clear()
