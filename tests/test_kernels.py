"""The paged-attention kernels agree with the torch reference; the CUDA one at least compiles here.

fp32 within 1e-5. bf16/fp16 outputs are rounded to 8/11 significant bits, so they are compared
with 2e-2 / 2e-3. int8 caches are compared with the reference reading the same int8 values and
scales (1e-5); against the unquantized cache the error is the quantization's own (checked < 0.05).
"""

import random
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

from minillm.attention.kernels import CUDA_SOURCE, decode_backend
from minillm.attention.reference import paged_decode_attention
from minillm.config import ConfigError
from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
HAS_CUDA = torch.cuda.is_available()


def random_case(seed, num_seqs, num_heads, num_kv_heads, head_dim, block_size, device="cpu"):
    """Ragged sequences whose blocks are scattered at random through a shared pool."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 300) for _ in range(num_seqs)]
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 5
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables, cursor = [], 0
    for count in blocks_per_seq:
        tables.append(order[cursor:cursor + count] + [0] * (max(blocks_per_seq) - count))
        cursor += count
    gen = torch.Generator().manual_seed(seed)
    cache_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    return {
        "query": torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(device),
        "key_cache": torch.randn(cache_shape, generator=gen).to(device),
        "value_cache": torch.randn(cache_shape, generator=gen).to(device),
        "block_tables": torch.tensor(tables, dtype=torch.int32, device=device),
        "context_lens": torch.tensor(lens, dtype=torch.int32, device=device),
        "block_size": block_size,
    }


def cast(case, dtype):
    return {k: v.to(dtype) if k in ("query", "key_cache", "value_cache") else v for k, v in case.items()}


def quantize_int8(case):
    """Per (slot, kv head) symmetric int8: value = int8 x scale."""
    out = dict(case)
    for name, scale_name in (("key_cache", "k_scales"), ("value_cache", "v_scales")):
        scales = case[name].abs().amax(-1).clamp(min=1e-8) / 127  # (num_slots, num_kv_heads)
        out[name] = (case[name] / scales[..., None]).round().to(torch.int8)
        out[scale_name] = scales.float()
    return out


SHAPES = [  # (num_seqs, num_heads, num_kv_heads, head_dim, block_size)
    (1, 9, 3, 64, 16), (7, 9, 3, 64, 1), (33, 8, 8, 64, 16), (5, 8, 1, 128, 32), (12, 4, 2, 64, 128),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_reference(shape, dtype):
    case = cast(random_case(sum(shape), *shape), dtype)
    expected = paged_decode_attention(**case).float()
    got = decode_backend("cpu")(**case).float()
    assert (got - expected).abs().max() <= TOLERANCE[dtype]


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_cpu_kernel_reads_int8_blocks_with_scales(shape):
    case = random_case(7 + sum(shape), *shape)
    quantized = quantize_int8(case)
    got = decode_backend("cpu")(**quantized)
    assert (got - paged_decode_attention(**quantized)).abs().max() <= 1e-5
    assert (got - paged_decode_attention(**case)).abs().max() < 0.05


def test_engine_with_cpu_kernel_gives_naive_tokens(tiny_dir, tiny_model):
    rng = random.Random(21)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    llm = LLM(tiny_dir, model=tiny_model, attention_backend="cpu", block_size=8, kv_cache_bytes=4 << 20)
    for out, prompt, sp in zip(llm.generate(prompts, params), prompts, params):
        assert out.token_ids == generate(tiny_model, prompt, sp, "naive").token_ids


def test_engine_with_cpu_kernel_on_the_real_model(real_dir, real_model, real_tokenizer):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=24)
    llm = LLM(real_dir, model=real_model, tokenizer=real_tokenizer, attention_backend="cpu", kv_cache_bytes=64 << 20)
    for out, prompt in zip(llm.generate(prompts, params), prompts):
        ids = real_tokenizer.encode(prompt)
        assert out.token_ids == generate(real_model, ids, params, "naive", real_tokenizer.eos_token_id).token_ids


def test_the_wheel_carries_the_kernel_sources(tmp_path):
    """A plain `pip install .` (not editable) must find the kernels: they ship as package data."""
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the working tree
    shutil.copytree(Path(__file__).resolve().parent.parent, source,
                    ignore=shutil.ignore_patterns(".git", "weights", "build", "*.egg-info", "__pycache__", "out"))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
               str(source)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("minillm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"kernels_cuda/paged_attention.cu", "kernels_cuda/paged_attention_cpu.cpp"} <= names


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_kernel_compiles_with_nvcc(tmp_path):
    """Without a GPU we still refuse a kernel that does not build."""
    from torch.utils.cpp_extension import include_paths

    command = ["nvcc", "-c", str(CUDA_SOURCE), "-o", str(tmp_path / "paged_attention.o"), "-std=c++20",
               "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "-gencode", "arch=compute_90,code=sm_90",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-DTORCH_EXTENSION_NAME=check",
               f"-I{sysconfig.get_paths()['include']}", *[f"-I{path}" for path in include_paths()]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_reference(shape, dtype):
    case = cast(random_case(sum(shape), *shape, device="cuda"), dtype)
    expected = paged_decode_attention(**case).float()
    got = decode_backend("cuda")(**case).float()
    assert (got - expected).abs().max() <= TOLERANCE[dtype]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_kernel_reads_int8_blocks_with_scales():
    case = quantize_int8(random_case(3, 9, 9, 3, 64, 16, device="cuda"))
    assert (decode_backend("cuda")(**case) - paged_decode_attention(**case)).abs().max() <= 1e-5


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_engine_with_cuda_kernel_gives_naive_tokens(tiny_dir):
    from minillm.weights import load_model

    model = load_model(tiny_dir, device="cuda")
    prompts = [[1, 2, 3], list(range(40)), [5] * 17]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    llm = LLM(tiny_dir, model=model, device="cuda", attention_backend="cuda", kv_cache_bytes=4 << 20)
    for out, prompt in zip(llm.generate(prompts, params), prompts):
        assert out.token_ids == generate(model, prompt, params, "naive").token_ids


@pytest.mark.skipif(HAS_CUDA, reason="checks the error a machine without a GPU gives")
def test_cuda_backend_without_a_gpu_is_a_clear_error(tiny_dir, tiny_model):
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        LLM(tiny_dir, model=tiny_model, attention_backend="cuda", device="cuda")


def test_backend_and_device_must_match(tiny_dir, tiny_model):
    with pytest.raises(ConfigError, match="cannot read a KV cache"):
        LLM(tiny_dir, model=tiny_model, attention_backend="cuda", device="cpu")
