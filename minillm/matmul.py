"""The dense products of a step, x @ weight.T, by whichever of three paths is fastest for its shape.

A decode step multiplies a few rows (one per running sequence) by every weight of the model, so
at batch 1-6 it is bound by reading the weights, not by arithmetic: each weight element is used
once per row. The C++ kernel in `kernels_cuda/dense_cpu.cpp` streams each weight row past the
activation rows (`DENSE_MAX_ROWS`) and reads the weights at about the machine's read speed.

Past that, bf16 on a CPU takes oneDNN on a copy of the weight packed once into its blocked layout:
torch's bf16 F.linear re-lays the weight out on every call, the packed copy pays that once
(`PACKED_MAX_ROWS`). Only a CPU whose oneDNN packs bf16 (avx512bw/vl/dq or avx_ne_convert) has it.

A weight can also carry its GGUF blocks (`quantized_weights.py`, `EngineConfig.weights`): up to
`QUANT_MAX_ROWS` rows then read those, 4 or 8 bits a weight, in fp32 or bf16 (`quant_dense`).

Everything else takes torch's F.linear: prefill-sized products (where the packing no longer pays),
other devices, and fp32, which stays the exact reference (HF transformers' kernels, HF's bits).
The same build gives `model.py` its bf16 norm and RoPE kernels (`bf16_kernel`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from minillm.quantized_weights import FORMAT_CODES, QuantizedWeight


def _onednn_packs_bf16() -> bool:
    """Whether this CPU's oneDNN packs bf16 weights: it needs avx512bw/vl/dq or avx_ne_convert, so
    an AVX2-only CPU (an AMD EPYC here had neither) refuses, and its products take F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


ONEDNN = _onednn_packs_bf16()  # asked once: every product of a step asks onednn_packs


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether `Matmul` may multiply by this weight through a oneDNN-packed copy: bf16 on a CPU.

    Measured on a 2-core AMD EPYC (avx512_bf16), one thread, SmolLM2's shapes, weights read from
    memory: torch's bf16 F.linear re-lays the weight out on every call and reaches ~14 GFLOP/s at
    one row (14 GB/s of weights); a copy packed once reaches ~25 (1.8x, in every run) and 0.9-1.5x
    at 16 rows. From 64 rows on it is no faster, and at 256 often slower (0.7-1.0x), so prefill-
    sized products keep F.linear (`PACKED_MAX_ROWS`). fp32 would gain too (torch's fp32 BLAS runs
    1.4-2x slower than oneDNN on this CPU), but its sums would come out in another order and the
    fp32 logits would no longer equal HF transformers' bit for bit: fp32 stays the exact reference.
    """
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and ONEDNN


PACKED_MAX_ROWS = 63  # decode batches (one row per sequence) take the packed copy; prefill chunks, F.linear
# Up to this many rows the weight-streaming C++ kernel beats the packed copy. Measured on a 2-core
# Xeon (AMX), 2 threads, all of SmolLM2's bf16 products in a row, median of 5 interleaved: 2.0x at
# 1-2 rows (19 GB/s of weights against 10), 1.65x at 3, 1.5x at 4, 1.2-1.3x at 5-6, even at 8
# (the kernel's tiles hold 3 rows; oneDNN's, on AMX, many more).
DENSE_MAX_ROWS = 6
QUANT_MAX_ROWS = 8  # GGUF blocks up to here; more rows take the dense weight's paths


@functools.cache
def dense_kernel():
    """The CPU kernels' build (kernels_cuda/dense_cpu.cpp), or None where it does not build: the
    packed copy then takes every decode-sized product, and torch the norms and RoPE."""
    from minillm.attention.kernels import cpu_kernel  # the build only; attention itself stays out
    from minillm.config import ConfigError

    try:
        return cpu_kernel()
    except ConfigError:
        return None


def bf16_kernel(t: torch.Tensor):
    """dense_cpu.cpp's kernels for a bf16 tensor on a CPU (where they build), else None."""
    return dense_kernel() if t.dtype == torch.bfloat16 and t.device.type == "cpu" else None


class Matmul:
    """x @ weight.T, by whichever CPU path is fastest for its shape:
    - up to `QUANT_MAX_ROWS` rows, when the weight has GGUF blocks (`quantized`): `quant_dense`;
    and otherwise, in bf16:
    - up to `DENSE_MAX_ROWS` rows: the C++ kernel that streams the weight (`dense_cpu.cpp`);
    - up to `PACKED_MAX_ROWS`: oneDNN on a copy of the weight packed once;
    - more rows, other dtypes, other devices: F.linear.

    The packed copy is made on first use and made again if the weight was replaced or written since
    (torch counts in-place writes in `_version`); it costs the weight's bytes a second time (bf16
    SmolLM2: 269 MB plain + 269 MB packed, the size of the fp32 weights alone).
    """

    def __init__(self):
        self.packed: torch.Tensor | None = None
        self.packed_from = None  # (address, version) of the weight it was packed from
        self.quantized: QuantizedWeight | None = None  # the weight's GGUF blocks (load_model sets them)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.quantized is not None and rows <= QUANT_MAX_ROWS:
            return dense_kernel().quant_dense(x, self.quantized.blocks, FORMAT_CODES[self.quantized.format])
        kernel = bf16_kernel(weight) if rows <= DENSE_MAX_ROWS else None
        if kernel is not None and weight.is_contiguous() and kernel.dense_fits(*weight.shape[::-1]):
            return kernel.dense(x.contiguous(), weight)
        if not onednn_packs(weight):
            return F.linear(x, weight)
        if rows > PACKED_MAX_ROWS:
            return _in_buckets(lambda rows: F.linear(rows, weight), x, PREFILL_BUCKET)
        source = (weight.data_ptr(), weight._version)
        if self.packed_from != source:
            self.packed, self.packed_from = torch.ops.mkldnn._reorder_linear_weight(weight.detach()), source
        packed = self.packed
        return _in_buckets(
            lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], ""),
            x,
            DECODE_BUCKET,
        )


# bf16 products through oneDNN run on row counts rounded up to these (zero rows, results dropped).
# oneDNN keeps a primitive, and torch's ideep a cached computation, for every row count it has
# seen: a server prefilling chunks of every length grew ~2.7 MB per length in bf16 (400 lengths:
# +1.1 GB on a 2-core Xeon; fp32 +28 MB). Buckets bound the shapes per weight to 8 for decode
# batches (a few zero rows cost next to nothing in a product that reads the weight anyway) and to
# max_num_batched_tokens / 32 for prefill chunks (at most 31 rows of extra work a chunk): measured,
# 400 prompt lengths then grew RSS by 68 MB.
DECODE_BUCKET, PREFILL_BUCKET = 8, 32


def _in_buckets(product, x: torch.Tensor, bucket: int) -> torch.Tensor:
    """product(x padded with zero rows to a multiple of `bucket`), the padding's rows dropped."""
    rows = x.shape[0]
    padded = -(-rows // bucket) * bucket
    return product(x) if padded == rows else product(F.pad(x, (0, 0, 0, padded - rows)))[:rows]


class Linear(nn.Linear):
    """An nn.Linear whose product goes through `Matmul`. Most have no bias; where one has (Qwen2's
    q/k/v), it is added to the product, rounded in the model's dtype, as the fused layer adds it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.matmul = Matmul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = self.matmul(x, self.weight)
        return product if self.bias is None else product + self.bias

    def blocks(self) -> tuple[torch.Tensor, int]:
        """The weight's GGUF blocks and their format code, as the C++ kernels take them."""
        quantized = self.matmul.quantized
        return quantized.blocks, FORMAT_CODES[quantized.format]
