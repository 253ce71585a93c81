"""Decode attention kernels: a C++ CPU kernel and a CUDA kernel.

Both implement the contract of the torch reference `paged_decode_attention(query, pool, layer,
block_tables, context_lens, with_mass)` (see `reference.py`) and are checked against it: they
read the pool's layer as it is stored (`pool.layer(l)`: numbers in the model's dtype, or int8 /
int4 / fp8 with their scales and centres and the filling blocks' staged keys), dequantize in
registers, and can return the attention mass H2O accumulates. `EngineConfig.attention_backend`
"cpu" or "cuda" hands the step's decode tokens to one of them; with "torch" the reference
itself attends them (`attention/paged.py`). The kernels' sources live in `kernels_cuda/`, installed
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
CPU_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]
# the kernel's signature, for the binding (the .cu defines it)
DECLARATION = (
    "std::vector<torch::Tensor> paged_attention_decode(torch::Tensor query, torch::Tensor k, "
    "torch::Tensor v, torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor k_staged, "
    "torch::Tensor staged_row, torch::Tensor block_tables, torch::Tensor context_lens, "
    "int64_t block_size, int64_t kv_format, bool keys_per_channel, bool with_mass);"
)
FORMAT_CODES = {"auto": 0, "int8": 1, "int4": 2, "fp8": 3}  # KVLayer.kv_format -> the kernels' kv_format


def build(name: str, **sources) -> object:
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline(
            name=name,
            functions=["paged_attention_decode"],
            extra_cflags=CPU_FLAGS,
            extra_cuda_cflags=["-O3"],
            **sources,
        )
    except Exception as err:  # compiler missing, compile error, ...
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"The {name} kernel did not build ({reason}); use attention_backend='torch'."
        ) from err


@functools.cache
def cpu_kernel():
    return build("minillm_paged_attention_cpu", cpp_sources=[CPU_SOURCE.read_text()])


@functools.cache
def cuda_kernel():
    if not torch.cuda.is_available():
        raise ConfigError(
            "attention_backend='cuda' needs a CUDA GPU, and torch sees none; use 'cpu' or 'torch'."
        )
    return build(
        "minillm_paged_attention_cuda", cpp_sources=[DECLARATION], cuda_sources=[CUDA_SOURCE.read_text()]
    )


def reading_the_pool(kernel_fn) -> Callable:
    """The reference's signature around a kernel: it hands the kernel the layer's stored tensors."""

    def attend(query, pool, layer, block_tables, context_lens, with_mass=False):
        kv = pool.layer(layer)
        out, mass = kernel_fn(
            query,
            kv.k,
            kv.v,
            kv.k_scale,
            kv.v_scale,
            kv.k_staged,
            kv.staged_row,
            block_tables,
            context_lens,
            pool.block_size,
            FORMAT_CODES[kv.kv_format],
            kv.keys_per_channel,
            with_mass,
        )
        return out, (mass if with_mass else None)

    return attend


def decode_backend(name: str) -> Callable:
    """The decode kernel for `attention_backend=name` ("cpu" or "cuda"), with the signature of
    `reference.paged_decode_attention`; builds it if needed."""
    if name == "cpu":
        return reading_the_pool(cpu_kernel().paged_attention_decode)
    if name == "cuda":
        return reading_the_pool(cuda_kernel().paged_attention_decode)
    raise ConfigError(f"There is no {name!r} decode kernel; the kernels are 'cpu' and 'cuda'.")
