"""Attention kernels: C++ for the CPU, CUDA for a GPU, and the backend a run attends with.

Each kernel implements the contract of a torch reference in `reference.py` and is checked
against it: `paged_decode_attention` (one query per sequence: `paged_attention_decode`) and
`paged_prefill_attention` (every prefill chunk of a step, ragged: `paged_attention_prefill`, the
flash kernel). They read the pool's layer as it is stored (`pool.layer(l)`:
numbers in the model's dtype, or int8 / int4 / fp8 with their scales and centres and the filling
blocks' staged keys), dequantize in registers, and can return the attention mass H2O accumulates.
A third CPU kernel, `quantize_write`, stores a step's keys and values into a quantized pool with
`QuantizedKVPool`'s torch rounding, in one call per layer instead of some thirty small operations.
The CPU build also carries `dense_cpu.cpp`, bf16 decode's products, RMSNorm and RoPE: not
attention, but the same build, so `model.py` asks `cpu_kernel()` for them.

`attention_backend(config)` is what a run gets: `EngineConfig.attention_backend` "cpu" or "cuda"
names a kernel, "torch" the references, and "auto" (the default) the kernel of the config's device
when it builds here, else torch, with one line on stderr saying why. The kernels' sources live in
`kernels_cuda/`, installed with minillm as package data, and are compiled on first use with
`torch.utils.cpp_extension`; the build is cached (under ~/.cache/torch_extensions)
and reused by later runs.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Callable

import torch

from minillm.attention.reference import paged_decode_attention, paged_prefill_attention
from minillm.config import ConfigError, EngineConfig
from minillm.memory.quantized_pool import QuantizedKVPool

SOURCES = files("kernels_cuda")  # package data, wherever minillm is installed
# each build's two kernels (decode, flash prefill) share a header (kv_rows_cpu.h, kv_rows_cuda.h);
# bindings.cpp declares them to Python
CPU_SOURCES = (
    "paged_attention_cpu.cpp",
    "flash_prefill_cpu.cpp",
    "kv_write_cpu.cpp",
    "dense_cpu.cpp",
    "quant_dense_cpu.cpp",
    "decode_layer_cpu.cpp",
    "bindings.cpp",
)
CUDA_SOURCES = ("paged_attention.cu", "flash_prefill.cu", "bindings.cpp")
CUDA_SOURCE = SOURCES / "paged_attention.cu"  # decode
CUDA_PREFILL_SOURCE = SOURCES / "flash_prefill.cu"
# -march=native: this machine's vector width (the build is cached per machine). The three math
# flags let the compiler reorder the float sums of the dot products, so it can vectorize them.
CPU_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-DMINILLM_CPU_BUILD",  # bindings.cpp: the CPU build also has kv_write and the dense kernels
]
FORMAT_CODES = {"auto": 0, "int8": 1, "int4": 2, "fp8": 3}  # KVLayer.kv_format -> the kernels' kv_format


def build(name: str, compile_it: Callable) -> object:
    """compile_it(name), with a line on stderr before and after the first time this machine builds
    `name` (how long it took), and a ConfigError saying what failed if it does not build."""
    folders = _build_folders(name)
    _remove_stale_locks(folders)
    first_build = not any((folder / f"{name}.so").exists() for folder in folders)
    if first_build:
        _say_once(f"minillm: building the {name} kernels (once per machine, about a minute)...")
    started = time.perf_counter()
    try:
        kernel = compile_it(name)
    except Exception as err:  # compiler missing, compile error, ...
        lines = str(err).strip().splitlines() or [type(err).__name__]
        reason = next((line for line in lines if "error" in line.lower()), lines[-1]).strip()
        raise ConfigError(
            f"The {name} kernel did not build ({reason}); use attention_backend='torch'."
        ) from err
    if first_build:  # a build is reported as a build, never as the first request's latency
        _say_once(f"minillm: built the {name} kernels in {time.perf_counter() - started:.0f} s (cached)")
    return kernel


STALE_LOCK_S = 20 * 60  # a build takes one to six minutes; a lock this old is a killed build's


def _build_folders(name: str) -> list[Path]:
    """Where torch builds `name`: $TORCH_EXTENSIONS_DIR/<name>, else
    <its cache>/<python+accelerator>/<name>."""
    from torch.utils.cpp_extension import get_default_build_root

    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    return [Path(chosen) / name] if chosen else list(Path(get_default_build_root()).glob(f"*/{name}"))


def _remove_stale_locks(folders: list[Path]) -> None:
    """torch waits, for ever, while a build's `lock` file exists; a build killed midway (Ctrl-C)
    leaves it behind. One older than any build takes is removed, with one line saying so."""
    for lock in (folder / "lock" for folder in folders):
        try:
            if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                lock.unlink()
                _say_once(f"minillm: removed {lock}, left by a kernel build that did not finish")
        except OSError:  # gone meanwhile, or not ours to remove: torch will wait on it as before
            pass


@functools.cache
def cpu_kernel():
    """Decode, flash prefill and quantize-and-write, each file its own translation unit (they
    compile side by side)."""
    from torch.utils.cpp_extension import load

    def compile_it(name):
        sources = [str(SOURCES / file) for file in CPU_SOURCES]
        return load(name, sources, extra_cflags=CPU_FLAGS, extra_include_paths=[str(SOURCES)])

    return build("minillm_attention_cpu", compile_it)


@functools.cache
def cuda_kernel():
    """Decode and flash prefill on a CUDA GPU, each .cu its own translation unit. They include only
    ATen (and their shared header) and launch on the default stream, so they also compile against
    a CPU-only torch (which the tests do with nvcc)."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "attention_backend='cuda' needs a CUDA GPU, and torch sees none; use 'cpu' or 'torch'."
        )
    from torch.utils.cpp_extension import load

    def compile_it(name):
        sources = [str(SOURCES / file) for file in CUDA_SOURCES]
        return load(name, sources, extra_cuda_cflags=["-O3"], extra_include_paths=[str(SOURCES)])

    return build("minillm_attention_cuda", compile_it)


def _layer_tensors(kv) -> tuple:
    """A `KVLayer`'s tensors in the order the kernels take them."""
    return kv.k, kv.v, kv.k_scale, kv.v_scale, kv.k_staged, kv.staged_row


def _stored(pool, layer: int) -> tuple:
    """The layer's tensors as stored, and how to read them, in the order the kernels take them."""
    kv = pool.layer(layer)
    return _layer_tensors(kv), (
        pool.block_size,
        FORMAT_CODES[kv.kv_format],
        kv.keys_per_channel,
    )


def decoding_in(kernel_fn) -> Callable:
    """`reference.paged_decode_attention`'s signature around a decode kernel."""

    def attend(query, pool, layer, block_tables, context_lens, with_mass=False):
        tensors, how = _stored(pool, layer)
        out, mass = kernel_fn(query, *tensors, block_tables, context_lens, *how, with_mass)
        return out, (mass if with_mass else None)

    return attend


def prefilling_in(kernel_fn) -> Callable:
    """`reference.paged_prefill_attention`'s signature around a flash prefill kernel."""

    def attend(query, pool, layer, block_tables, cu_seqlens, q_indices, context_lens, with_mass=False):
        tensors, how = _stored(pool, layer)
        out, mass = kernel_fn(
            query, *tensors, block_tables, cu_seqlens, q_indices, context_lens, *how, with_mass
        )
        return out, (mass if with_mass else None)

    return attend


def writing_in(kernel_fn) -> Callable:
    """The pool's write, with a quantized pool's numbers computed by a quantize-and-write kernel."""

    def numbers(kv, block_size, slots, k, v):
        how = (block_size, FORMAT_CODES[kv.kv_format], kv.keys_per_channel)
        kernel_fn(*_layer_tensors(kv), slots, k.contiguous(), v.contiguous(), *how)

    def write(pool, layer, slots, k, v):
        if isinstance(pool, QuantizedKVPool):
            pool.write(layer, slots, k, v, numbers=numbers)
        else:
            pool.write(layer, slots, k, v)

    return write


def write_in_torch(pool, layer, slots, k, v):
    pool.write(layer, slots, k, v)


@dataclass(frozen=True)
class Backend:
    """How a run attends: decode tokens with `decode`, prefill chunks with `prefill` (each with
    its reference's signature), and how it stores the step's keys and values, `write(pool, layer,
    slots, k, v)`."""

    name: str  # "cpu", "cuda" or "torch"
    decode: Callable
    prefill: Callable
    write: Callable


TORCH = Backend("torch", paged_decode_attention, paged_prefill_attention, write_in_torch)


def kernel_backend(name: str, flash_prefill: bool = True) -> Backend:
    """The kernels of `name` ("cpu" or "cuda"), built if needed; prefill chunks through its flash
    kernel with `flash_prefill`, else through the torch reference."""
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"There is no {name!r} kernel; the kernels are 'cpu' and 'cuda'.")
    kernel = cpu_kernel() if name == "cpu" else cuda_kernel()
    prefill = prefilling_in(kernel.paged_attention_prefill) if flash_prefill else paged_prefill_attention
    write = writing_in(kernel.quantize_write) if name == "cpu" else write_in_torch  # no CUDA twin yet
    return Backend(name, decoding_in(kernel.paged_attention_decode), prefill, write)


def attention_backend(config: EngineConfig) -> Backend:
    """The backend `config` asks for; "auto": its device's kernel if it builds, else torch (one
    line on stderr says why)."""
    if config.attention_backend == "torch":
        return TORCH
    if config.attention_backend != "auto":
        return kernel_backend(config.attention_backend, config.flash_prefill)
    try:
        return kernel_backend(config.device.split(":")[0], config.flash_prefill)
    except ConfigError as err:
        _say_once(f"minillm: attention_backend auto falls back to torch: {err}")
        return TORCH


@functools.cache
def _say_once(line: str) -> None:
    print(line, file=sys.stderr)
