"""Decode attention kernels: a C++ CPU kernel and a CUDA kernel.

Both implement the contract of the torch reference `paged_decode_attention(query, key_cache,
value_cache, block_tables, context_lens, block_size, k_scales, v_scales)` (see `reference.py`)
and are checked against it. `EngineConfig.attention_backend` "cpu" or "cuda" hands the step's
decode tokens to one of them; with "torch" the engine attends sequence by sequence in plain
torch instead (`attention/paged.py`). The kernels' sources live in `kernels_cuda/`, installed
with minillm as package data, and are compiled on first use with
`torch.utils.cpp_extension.load_inline`; the build is cached (under ~/.cache/torch_extensions)
and reused by later runs.
"""

from __future__ import annotations

import functools
from importlib.resources import files
from typing import Callable

import torch

from minillm.config import ConfigError

CPU_SOURCE = files("kernels_cuda") / "paged_attention_cpu.cpp"  # package data, wherever minillm is installed
CUDA_SOURCE = files("kernels_cuda") / "paged_attention.cu"
# -march=native: this machine's vector width (the build is cached per machine). The three math
# flags let the compiler reorder the float sums of the dot products, so it can vectorize them.
CPU_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
DECLARATION = ("torch::Tensor paged_attention_decode(torch::Tensor query, torch::Tensor key_cache, "
               "torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size, "
               "torch::Tensor k_scales, torch::Tensor v_scales);")  # the .cu defines it; the bindings need it


def build(name: str, **sources) -> object:
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline(name=name, functions=["paged_attention_decode"], extra_cflags=CPU_FLAGS,
                           extra_cuda_cflags=["-O3"], **sources)
    except Exception as err:  # compiler missing, compile error, ...
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ConfigError(f"The {name} kernel did not build ({reason}); use attention_backend='torch'.") from err


@functools.cache
def cpu_kernel():
    return build("minillm_paged_attention_cpu", cpp_sources=[CPU_SOURCE.read_text()])


@functools.cache
def cuda_kernel():
    if not torch.cuda.is_available():
        raise ConfigError("attention_backend='cuda' needs a CUDA GPU, and torch sees none; use 'cpu' or 'torch'.")
    return build("minillm_paged_attention_cuda", cpp_sources=[DECLARATION],
                 cuda_sources=[CUDA_SOURCE.read_text()])


def with_empty_scales(kernel_fn):
    """The kernels take empty tensors where the reference takes None (no int8 scales)."""
    def call(query, key_cache, value_cache, block_tables, context_lens, block_size, k_scales=None, v_scales=None):
        empty = query.new_empty(0, dtype=torch.float32)
        return kernel_fn(query, key_cache, value_cache, block_tables, context_lens, block_size,
                         empty if k_scales is None else k_scales, empty if v_scales is None else v_scales)
    return call


def decode_backend(name: str) -> Callable:
    """The decode kernel for `attention_backend=name` ("cpu" or "cuda"); builds it if needed."""
    if name == "cpu":
        return with_empty_scales(cpu_kernel().paged_attention_decode)
    if name == "cuda":
        return with_empty_scales(cuda_kernel().paged_attention_decode)
    raise ConfigError(f"There is no {name!r} decode kernel; the kernels are 'cpu' and 'cuda'.")
