"""The paged-attention kernels agree with the torch reference; the CUDA one at least compiles here.

The kernels read a real KV pool as it is stored (`pool.layer(l)`), in every format: fp32 within
1e-5 of the reference. In bf16/fp16 the kernels still compute in fp32 and round only their
output (to 8/11 significant bits), so they are compared with the fp32 reference over the same
rounded numbers, within 8e-3 / 1e-3. Quantized pools (int8 / int4 / fp8, keys per channel with staged
filling blocks, or per token) are compared with the reference reading the same stored numbers
(1e-5), and so is the attention mass H2O accumulates. The reference itself is checked against
`causal_attention` over each sequence's gathered history, one sequence at a time.
"""

import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import REAL_PLAIN_PROMPTS, TINY_CONFIG, random_llama_tensors, write_checkpoint

from minillm.attention.kernels import CUDA_PREFILL_SOURCE, CUDA_SOURCE, STALE_LOCK_S, build, kernel_backend
from minillm.attention.reference import causal_attention, paged_decode_attention, paged_prefill_attention
from minillm.config import ConfigError, ModelConfig
from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams
from minillm.memory.pool import PagedKVPool
from minillm.memory.quantization import FORMATS
from minillm.memory.quantized_pool import QuantizedKVPool

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
HAS_CUDA = torch.cuda.is_available()


def random_case(
    seed,
    num_seqs,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    kv_dtype="auto",
    key_scales="channel",
    dtype=torch.float32,
    device="cpu",
    rounded_to=None,
    lens_between=(1, 300),
):
    """Ragged sequences whose blocks are scattered at random through one layer of a real pool;
    the last block of most is still filling (with per-channel keys: staged). `rounded_to`: the
    numbers are rounded to that dtype first (an fp32 twin of a bf16 case)."""
    rng = random.Random(seed)
    lens = [rng.randint(*lens_between) for _ in range(num_seqs)]
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 5
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables, cursor = [], 0
    for count in blocks_per_seq:
        tables.append(order[cursor : cursor + count] + [0] * (max(blocks_per_seq) - count))
        cursor += count
    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 1,
            "hidden_size": 8,
            "intermediate_size": 1,
            "num_hidden_layers": 1,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
        }
    )
    pool = (
        PagedKVPool(config, num_blocks, block_size, dtype, device)
        if kv_dtype == "auto"
        else QuantizedKVPool(config, num_blocks, block_size, FORMATS[kv_dtype], key_scales, dtype, device)
    )
    gen = torch.Generator().manual_seed(seed)
    slots = torch.tensor(
        [
            table[t // block_size] * block_size + t % block_size
            for table, n in zip(tables, lens)
            for t in range(n)
        ],
        device=device,
    )
    shape = (len(slots), num_kv_heads, head_dim)
    keys = torch.randn(shape, generator=gen) * (1 + 3 * torch.rand(num_kv_heads, head_dim, generator=gen))
    values, query = (
        torch.randn(shape, generator=gen),
        torch.randn(num_seqs, num_heads, head_dim, generator=gen),
    )
    if rounded_to is not None:
        keys, values, query = (x.to(rounded_to).float() for x in (keys, values, query))
    pool.write(0, slots, keys.to(device, dtype), values.to(device, dtype))
    return {
        "query": query.to(device, dtype),
        "pool": pool,
        "layer": 0,
        "block_tables": torch.tensor(tables, dtype=torch.int32, device=device),
        "context_lens": torch.tensor(lens, dtype=torch.int32, device=device),
    }


SHAPES = [  # (num_seqs, num_heads, num_kv_heads, head_dim, block_size)
    (1, 9, 3, 64, 16),
    (7, 9, 3, 64, 1),
    (33, 8, 8, 64, 16),
    (5, 8, 1, 128, 32),
    (12, 4, 2, 64, 128),
    (3, 4, 2, 16, 4),
]
FORMATS_TESTED = [
    ("int8", "channel"),
    ("int8", "token"),
    ("int4", "channel"),
    ("fp8", "token"),
    ("fp8", "channel"),
]


def one_sequence_at_a_time(query, pool, layer, block_tables, context_lens):
    """The reference's meaning, spelled out: each sequence's history gathered, then causal_attention."""
    out = torch.empty_like(query)
    for seq, length in enumerate(context_lens.tolist()):
        positions = torch.arange(length, device=query.device)
        slots = (
            block_tables[seq, positions // pool.block_size].long() * pool.block_size
            + positions % pool.block_size
        )
        keys, values = pool.read(layer, slots)
        out[seq] = causal_attention(query[seq : seq + 1], keys, values, positions[-1:])[0]
    return out


@pytest.mark.parametrize("kv_dtype, key_scales", [("auto", "channel"), *FORMATS_TESTED])
def test_the_batched_reference_is_causal_attention_per_sequence(kv_dtype, key_scales):
    case = random_case(5, 9, 9, 3, 64, 16, kv_dtype, key_scales)
    out, _ = paged_decode_attention(**case)
    assert (out - one_sequence_at_a_time(**case)).abs().max() <= 1e-5


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_reference(shape, dtype):
    expected, _ = paged_decode_attention(**random_case(sum(shape), *shape, rounded_to=dtype))
    got, _ = kernel_backend("cpu").decode(**random_case(sum(shape), *shape, dtype=dtype))
    assert (got.float() - expected.float()).abs().max() <= TOLERANCE[dtype]


@pytest.mark.parametrize("kv_dtype, key_scales", FORMATS_TESTED)
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:])
def test_cpu_kernel_reads_quantized_blocks_in_place(shape, kv_dtype, key_scales):
    case = random_case(7 + sum(shape), *shape, kv_dtype, key_scales)
    expected, expected_mass = paged_decode_attention(**case, with_mass=True)
    got, mass = kernel_backend("cpu").decode(**case, with_mass=True)
    assert (got - expected).abs().max() <= 1e-5
    assert (mass - expected_mass).abs().max() <= 1e-5


@pytest.mark.parametrize("kv_dtype, key_scales", [("auto", "channel"), *FORMATS_TESTED])
def test_cpu_kernel_splits_long_histories_over_threads_and_merges_them(kv_dtype, key_scales):
    """Past 128 tokens a history is attended in partitions, on every thread, then merged: the same
    attention and mass as the reference, and the same bits whatever the thread count."""
    case = random_case(11, 3, 9, 3, 64, 16, kv_dtype, key_scales, lens_between=(600, 1600))
    expected, expected_mass = paged_decode_attention(**case, with_mass=True)
    got, mass = kernel_backend("cpu").decode(**case, with_mass=True)
    assert (got - expected).abs().max() <= 1e-5
    assert (mass - expected_mass).abs().max() <= 1e-5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone, _ = kernel_backend("cpu").decode(**case)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, got)


def test_cpu_kernel_attention_mass_sums_to_the_group_size():
    case = random_case(3, 6, 9, 3, 64, 16)
    # (S, kv_heads, longest): each head's probabilities
    _, mass = kernel_backend("cpu").decode(**case, with_mass=True)
    assert torch.allclose(mass.sum(-1), torch.full((6, 3), 3.0), atol=1e-4)
    for seq, length in enumerate(case["context_lens"].tolist()):
        assert (mass[seq, :, length:] == 0).all()  # nothing past a sequence's context


def relative_error(got, expected) -> float:
    """The largest error, relative to the number's size where it exceeds 1."""
    return float(((got.float() - expected.float()) / expected.float().abs().clamp(min=1)).abs().max())


def prefill_case(seed, *shape, dtype=torch.float32, rounded_to=None, **pool_switches):
    """`random_case`'s pool and tables, with a prefill chunk per sequence: its last 1..all entries
    are queries (one sequence's chunk may be a single query, as a decode token is)."""
    case = random_case(seed, *shape, dtype=dtype, rounded_to=rounded_to, **pool_switches)
    rng = random.Random(seed)
    lens = case.pop("context_lens").tolist()
    del case["query"]
    chunks = [rng.randint(1, n) for n in lens]
    bounds = [0]
    for n in chunks:
        bounds.append(bounds[-1] + n)
    indices = [length - n + i for length, n in zip(lens, chunks) for i in range(n)]
    query = torch.randn(bounds[-1], shape[1], shape[3], generator=torch.Generator().manual_seed(seed))
    if rounded_to is not None:
        query = query.to(rounded_to).float()
    device = case["block_tables"].device

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return {
        **case,
        "query": query.to(device, dtype),
        "cu_seqlens": ints(bounds),
        "q_indices": ints(indices),
        "context_lens": ints(lens),
    }


def test_the_prefill_reference_is_one_causal_attention_per_sequence():
    """Chunks of one long prompt, attended chunk after chunk through the pool, give what a single
    causal_attention over the whole prompt gives."""
    case = random_case(2, 1, 9, 3, 64, 16)
    length = int(case["context_lens"][0])
    query = torch.randn(length, 9, 64)
    positions = torch.arange(length)
    keys, values = case["pool"].read(0, case["block_tables"][0, positions // 16].long() * 16 + positions % 16)
    whole = causal_attention(query, keys, values, positions)
    start = 0
    for end in sorted({length // 3, length // 2, length}):
        if end <= start:
            continue
        chunk, _ = paged_prefill_attention(
            query[start:end],
            case["pool"],
            0,
            case["block_tables"],
            torch.tensor([0, end - start], dtype=torch.int32),
            torch.arange(start, end, dtype=torch.int32),
            torch.tensor([end], dtype=torch.int32),
        )
        assert (chunk - whole[start:end]).abs().max() <= 1e-5
        start = end


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_flash_prefill_kernel_matches_reference(shape, dtype):
    """Within the tolerance relative to the output's size (a prefill output may reach 4, where
    bf16's rounding step is 1/32)."""
    expected, _ = paged_prefill_attention(**prefill_case(sum(shape), *shape, rounded_to=dtype))
    got, _ = kernel_backend("cpu").prefill(**prefill_case(sum(shape), *shape, dtype=dtype))
    assert relative_error(got, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("kv_dtype, key_scales", [("auto", "channel"), *FORMATS_TESTED])
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:])
def test_flash_prefill_kernel_reads_quantized_blocks_in_place(shape, kv_dtype, key_scales):
    """Every KV format, staged filling blocks included, and the attention mass H2O needs (a sum of
    up to a chunk's worth of probabilities per entry: compared relative to the largest)."""
    case = prefill_case(11 + sum(shape), *shape, kv_dtype=kv_dtype, key_scales=key_scales)
    expected, expected_mass = paged_prefill_attention(**case, with_mass=True)
    got, mass = kernel_backend("cpu").prefill(**case, with_mass=True)
    assert relative_error(got, expected) <= 2e-5  # sums in another order than torch's, over up to 300 entries
    assert (mass - expected_mass).abs().max() <= 1e-5 * max(1.0, float(expected_mass.max()))
    assert relative_error(kernel_backend("cpu").prefill(**case)[0], expected) <= 2e-5  # without mass too


def test_a_killed_builds_lock_is_removed_and_a_running_builds_is_not(tmp_path, monkeypatch, capsys):
    """torch waits for ever on a build's lock file; a Ctrl-C during the first build leaves one."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, running = (tmp_path / name / "lock" for name in ("killed", "running"))
    for lock in (stale, running):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    assert build("killed", lambda name: not stale.exists()) is True
    assert build("running", lambda name: running.exists()) is True
    assert f"removed {stale}" in capsys.readouterr().err


def write_steps(kv_dtype, key_scales, dtype, seed, write):
    """A pool (8 blocks of 4 slots, 2 KV heads of 16) after an engine's writes, each through
    `write(pool, layer, slots, k, v)`: a prefill step that fills blocks 0 and 3 and starts 1, then
    five decode steps of three sequences that cross block ends (1, 2, 4 and 6 fill; 5 and 7 start)."""
    config = ModelConfig.from_dict({**TINY_CONFIG, "num_key_value_heads": 2, "head_dim": 16})
    pool = QuantizedKVPool(config, 8, 4, FORMATS[kv_dtype], key_scales, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    steps = [list(range(0, 7)) + list(range(12, 16))] + [[7 + i, 16 + i, 24 + i] for i in range(5)]
    for slots in steps:
        for layer in range(config.num_layers):
            k, v = (
                torch.randn(len(slots), 2, 16, generator=gen) * 3 + torch.randn(16, generator=gen)
                for _ in "kv"
            )
            write(pool, layer, torch.tensor(slots), k.to(dtype), v.to(dtype))
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype, key_scales", [*FORMATS_TESTED, ("int4", "token")])
def test_the_quantize_write_kernel_stores_what_the_torch_write_stores(kv_dtype, key_scales, dtype):
    """Byte for byte: numbers, scales and centers, staging rows and the staged keys in them."""
    by_torch = write_steps(kv_dtype, key_scales, dtype, 3, lambda pool, *args: pool.write(*args))
    by_kernel = write_steps(kv_dtype, key_scales, dtype, 3, kernel_backend("cpu").write)
    for name in ("k_data", "v_data", "k_scale", "v_scale", "staged_row"):
        assert torch.equal(getattr(by_kernel, name), getattr(by_torch, name)), name
    staged = by_torch.staged_row >= 0
    assert bool(staged.any()) == (key_scales == "channel") and by_kernel.free_rows == by_torch.free_rows
    for layer, block in staged.nonzero().tolist():
        row = int(by_torch.staged_row[layer, block])
        assert torch.equal(by_kernel.k_staged[layer, row], by_torch.k_staged[layer, row])


@pytest.mark.parametrize("switches", [{}, {"max_num_batched_tokens": 13, "prefix_caching": True}])
def test_engine_with_cpu_kernel_gives_naive_tokens(tiny_dir, tiny_model, switches):
    """Decode and flash prefill (whole prompts, or chunks of 13 tokens over prefix-cache hits)."""
    rng = random.Random(21)
    shared = [rng.randrange(97) for _ in range(20)]
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    llm = LLM(
        tiny_dir, model=tiny_model, attention_backend="cpu", block_size=8, kv_cache_bytes=4 << 20, **switches
    )
    for out, prompt, sp in zip(llm.generate(prompts, params), prompts, params):
        assert out.token_ids == generate(tiny_model, prompt, sp, "naive").token_ids


@pytest.mark.parametrize(
    "switches",
    [
        {"kv_dtype": "int8"},
        {"kv_dtype": "int4", "kv_key_scales": "token"},
        {"kv_dtype": "fp8"},
        {"eviction": "h2o", "kv_budget": 12},
    ],
)
def test_engine_with_cpu_kernel_equals_the_torch_backend_on_lossy_switches(tiny_dir, tiny_model, switches):
    """Quantized pools and H2O (whose choices follow the kernel's attention mass) give the tokens
    the torch reference gives with the same switches."""
    rng = random.Random(4)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    outputs = {
        backend: [
            out.token_ids
            for out in LLM(
                tiny_dir, model=tiny_model, attention_backend=backend, block_size=4, **switches
            ).generate(prompts, params)
        ]
        for backend in ("torch", "cpu")
    }
    assert outputs["cpu"] == outputs["torch"]


def test_engine_with_cpu_kernel_on_the_real_model(real_dir, real_model, real_tokenizer, naive_real):
    prompts = REAL_PLAIN_PROMPTS[:3]
    params = SamplingParams(max_tokens=24)
    llm = LLM(
        real_dir, model=real_model, tokenizer=real_tokenizer, attention_backend="cpu", kv_cache_bytes=64 << 20
    )
    for out, prompt in zip(llm.generate(prompts, params), prompts):
        assert out.token_ids == naive_real(real_tokenizer.encode(prompt), params.max_tokens)


def test_the_wheel_carries_the_kernel_sources(tmp_path):
    """A plain `pip install .` (not editable) must find the kernels: they ship as package data."""
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the working tree
    shutil.copytree(
        Path(__file__).resolve().parent.parent,
        source,
        ignore=shutil.ignore_patterns(".git", "weights", "build", "*.egg-info", "__pycache__", "out"),
    )
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp_path),
        str(source),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("minillm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = (
        *("paged_attention.cu", "flash_prefill.cu", "kv_rows_cuda.h", "bindings.cpp"),
        *("paged_attention_cpu.cpp", "flash_prefill_cpu.cpp", "kv_write_cpu.cpp", "kv_rows_cpu.h"),
    )
    assert {f"kernels_cuda/{name}" for name in kernels} <= names


def nvcc_command(source, tmp_path) -> list[str]:
    """nvcc on one .cu file against this (possibly CPU-only) torch, for an H100 (sm_90)."""
    from torch.utils.cpp_extension import include_paths

    return [
        "nvcc",
        "-c",
        str(source),
        "-o",
        str(tmp_path / f"{Path(str(source)).stem}.o"),
        "-std=c++20",
        "-Xcompiler",
        "-fPIC",
        "--expt-relaxed-constexpr",
        "-gencode",
        "arch=compute_90,code=sm_90",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-DTORCH_EXTENSION_NAME=check",
        f"-I{sysconfig.get_paths()['include']}",
        *[f"-I{path}" for path in include_paths()],
    ]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    """Without a GPU we still refuse a kernel that does not build: decode and flash prefill, each
    .cu compiled at the same time (a minute each, and the machines have two cores)."""
    sources = (CUDA_SOURCE, CUDA_PREFILL_SOURCE)
    compiles = [
        subprocess.Popen(nvcc_command(source, tmp_path), stderr=subprocess.PIPE, text=True)
        for source in sources
    ]
    deadline = time.monotonic() + 900  # both at once: fifteen minutes for the pair, not each
    try:
        for source, nvcc in zip(sources, compiles):
            try:
                _, errors = nvcc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"nvcc did not compile {source.name} within 900 s") from None
            assert nvcc.returncode == 0, f"{source}: {errors[-3000:]}"
    finally:
        for nvcc in compiles:
            nvcc.kill()
            nvcc.wait(timeout=30)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [shape for shape in SHAPES if shape[3] in (64, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_reference(shape, dtype):
    expected, _ = paged_decode_attention(**random_case(sum(shape), *shape, device="cuda", rounded_to=dtype))
    got, _ = kernel_backend("cuda").decode(**random_case(sum(shape), *shape, dtype=dtype, device="cuda"))
    assert (got.float() - expected.float()).abs().max() <= TOLERANCE[dtype]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype, key_scales", FORMATS_TESTED)
def test_cuda_kernel_reads_quantized_blocks_in_place(kv_dtype, key_scales):
    case = random_case(3, 9, 9, 3, 64, 16, kv_dtype, key_scales, device="cuda")
    expected, expected_mass = paged_decode_attention(**case, with_mass=True)
    got, mass = kernel_backend("cuda").decode(**case, with_mass=True)
    assert (got - expected).abs().max() <= 1e-5
    assert (mass - expected_mass).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def tiny_dir_64(tmp_path_factory):
    """The tiny Llama with head_dim 64 (the CUDA kernels take 64 and 128; the tiny one has 16)."""
    config = {**TINY_CONFIG, "head_dim": 64}
    return write_checkpoint(tmp_path_factory.mktemp("tiny64"), config, random_llama_tensors(config))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_engine_with_cuda_kernel_gives_naive_tokens(tiny_dir_64):
    from minillm.weights import load_model

    model = load_model(tiny_dir_64, device="cuda")
    prompts = [[1, 2, 3], list(range(40)), [5] * 17]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    llm = LLM(
        tiny_dir_64,
        model=model,
        device="cuda",
        attention_backend="cuda",
        flash_prefill=False,
        kv_cache_bytes=4 << 20,
    )
    for out, prompt in zip(llm.generate(prompts, params), prompts):
        assert out.token_ids == generate(model, prompt, params, "naive").token_ids


CUDA_SHAPES = [shape for shape in SHAPES if shape[3] in (64, 128)]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_flash_prefill_kernel_matches_reference(shape, dtype):
    """As the C++ flash kernel is checked: relative to the output's size."""
    expected, _ = paged_prefill_attention(**prefill_case(sum(shape), *shape, rounded_to=dtype, device="cuda"))
    got, _ = kernel_backend("cuda").prefill(**prefill_case(sum(shape), *shape, dtype=dtype, device="cuda"))
    assert relative_error(got, expected) <= TOLERANCE[dtype]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype, key_scales", [("auto", "channel"), *FORMATS_TESTED])
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_cuda_flash_prefill_kernel_reads_quantized_blocks_in_place(shape, kv_dtype, key_scales):
    """Every KV format, staged filling blocks included, with and without the attention mass."""
    case = prefill_case(11 + sum(shape), *shape, kv_dtype=kv_dtype, key_scales=key_scales, device="cuda")
    expected, expected_mass = paged_prefill_attention(**case, with_mass=True)
    got, mass = kernel_backend("cuda").prefill(**case, with_mass=True)
    assert relative_error(got, expected) <= 2e-5
    assert (mass - expected_mass).abs().max() <= 1e-5 * max(1.0, float(expected_mass.max()))
    assert relative_error(kernel_backend("cuda").prefill(**case)[0], expected) <= 2e-5


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_flash_prefill_refuses_other_head_dims():
    with pytest.raises(RuntimeError, match="head_dim 64 and 128"):
        kernel_backend("cuda").prefill(**prefill_case(3, 3, 4, 2, 16, 4, device="cuda"))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("switches", [{}, {"max_num_batched_tokens": 13, "prefix_caching": True}])
def test_engine_with_cuda_flash_prefill_gives_naive_tokens(tiny_dir_64, switches):
    """Decode and flash prefill on the GPU (whole prompts, or chunks of 13 tokens over prefix-cache hits)."""
    from minillm.weights import load_model

    model = load_model(tiny_dir_64, device="cuda")
    rng = random.Random(21)
    shared = [rng.randrange(97) for _ in range(20)]
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    llm = LLM(
        tiny_dir_64,
        model=model,
        device="cuda",
        attention_backend="cuda",
        flash_prefill=True,
        block_size=8,
        kv_cache_bytes=16 << 20,
        **switches,
    )
    for out, prompt, sp in zip(llm.generate(prompts, params), prompts, params):
        assert out.token_ids == generate(model, prompt, sp, "naive").token_ids


@pytest.mark.skipif(HAS_CUDA, reason="checks the error a machine without a GPU gives")
def test_cuda_backend_without_a_gpu_is_a_clear_error(tiny_dir, tiny_model):
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        LLM(tiny_dir, model=tiny_model, attention_backend="cuda", device="cuda")


def test_backend_and_device_must_match(tiny_dir, tiny_model):
    with pytest.raises(ConfigError, match="cannot read a KV cache"):
        LLM(tiny_dir, model=tiny_model, attention_backend="cuda", device="cpu")
