"""Weights kept in GGUF blocks: decode reads 4 or 8 bits a weight instead of 16 or 32.

At batch 1 a decode step reads every weight once, so its time is the bytes it reads (lesson 03).
The default checkpoint comes from a Q4_1 GGUF file (`fetch/gguf_wheel.py`): blocks of 32 weights,
each with a scale d and a minimum m, weight = d * q + m for a four-bit q. `model.safetensors`
holds those weights dequantized to fp32; `PACKED_FILE` beside it holds the blocks themselves, as
the GGUF stores them (its embedding is Q8_0: weight = d * q for an int8 q). Q4_0 blocks, the most
common small GGUF format, hold only the scale: weight = d * (q - 8). The C++ product
`quant_dense` (`kernels_cuda/quant_dense_cpu.cpp`) reads the blocks and dequantizes in registers,
so it multiplies by exactly the fp32 checkpoint's values: lossless, up to the order of the sums.

`EngineConfig.weights` chooses what decode-sized products read:
- "q4_1": the GGUF's own blocks (the fetched default checkpoint has them; a `.gguf` given as the
  model has them for each matrix it stores as Q4_0, Q4_1 or Q8_0, read in place: `gguf_file.py`);
- "int8": every matrix quantized here to Q8_0 (per 32 weights an fp16 scale, as llama.cpp's
  Q8_0; lossy, and it works for any checkpoint);
- "model": the weights in the model's dtype, as before;
- "auto" (the default of `serve`, `chat` and `generate`; `EngineConfig` keeps "model"): "q4_1"
  where the blocks are there and the kernels build, else "model".

Products of more rows than `QUANT_MAX_ROWS` (prefill chunks, large decode batches) keep the
dense weights and the paths of `matmul.py`, so the model holds both (bf16 SmolLM2: 269 MB dense
and 96 MB of blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from minillm.config import FETCH_HINT, ConfigError
from minillm.safetensors_check import check_safetensors

PACKED_FILE = "model.q4_1.safetensors"  # written by weights_fetch.py beside model.safetensors
BLOCK = 32  # weights a block
# q4_0: d (fp16) + 16 bytes of nibbles | q4_1: d, m (fp16) + 16 bytes of nibbles | q8_0: d + 32 int8
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
SCALE_BYTES = {"q4_0": 2, "q4_1": 4, "q8_0": 2}  # the fp16 d (and Q4_1's m) opening each block
FORMAT_CODES = {"q4_1": 0, "q8_0": 1, "q4_0": 2}  # quant_dense's `format`
BLOCK_TYPES = ", ".join(fmt.upper() for fmt in BLOCK_BYTES)  # as GGUF names them: "Q4_0, Q4_1, Q8_0"


@dataclass(frozen=True)
class QuantizedWeight:
    """An (out_features, in_features) weight as GGUF blocks: `blocks` (out_features, in_features
    / 32 * block bytes) uint8, each row its blocks in order."""

    blocks: torch.Tensor
    format: str  # "q4_0" | "q4_1" | "q8_0"

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] // BLOCK_BYTES[self.format] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight, by the `gguf` package (the reference the kernel is checked against)."""
        from gguf import GGMLQuantizationType, dequantize  # imported when used: 0.2 s

        values = dequantize(self.blocks.numpy(), GGMLQuantizationType[self.format.upper()])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def quantize_q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """An fp32 or bf16 (out, in) weight as Q8_0 blocks, rounded as llama.cpp rounds them."""
    from gguf import GGMLQuantizationType, quantize

    blocks = quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType.Q8_0)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(blocks)), "q8_0")


def read_packed(model_dir: Path) -> dict[str, QuantizedWeight]:
    """`model_dir/PACKED_FILE`'s blocks by Hugging Face name (the format of each in the metadata)."""
    path = Path(model_dir) / PACKED_FILE
    if not path.is_file():
        raise ConfigError(
            f"weights='q4_1' needs {path}, the GGUF's own blocks, which weights_fetch.py writes for the "
            "default checkpoint — run python weights_fetch.py, or use --weights int8 or model."
        )
    check_safetensors(path)
    try:
        with safe_open(path, "pt") as packed:
            formats = packed.metadata() or {}
            weights = {
                name: QuantizedWeight(packed.get_tensor(name), formats.get(name, ""))
                for name in packed.keys()
            }
    except (SafetensorError, OSError, ValueError) as err:
        raise ConfigError(f"{path} is truncated or corrupt ({err}) — {FETCH_HINT}") from err
    for name, weight in weights.items():
        if weight.format not in BLOCK_BYTES or weight.blocks.dtype != torch.uint8 or weight.blocks.dim() != 2:
            raise ConfigError(
                f"{path}: {name} is not a uint8 tensor of Q4_0, Q4_1 or Q8_0 blocks — {FETCH_HINT}"
            )
        if not _scales_finite(weight):
            raise ConfigError(f"{path}: {name} has NaN or inf scales; the file is corrupt — {FETCH_HINT}")
    return weights


def _scales_finite(weight: QuantizedWeight) -> bool:
    """Each block opens with its fp16 scale d (and Q4_1's minimum m): finite ones make finite
    weights (d * q + m or d * (q - 8) with a 4-bit q, d * q with an int8 q, stay far inside
    fp32). A row that is not whole blocks is refused by its shape (`weights._blocks_for`)."""
    size = BLOCK_BYTES[weight.format]
    whole = weight.blocks[:, : weight.blocks.shape[1] // size * size]
    blocks = whole.reshape(-1, size)  # (blocks, block bytes)
    return bool(
        torch.isfinite(blocks[:, : SCALE_BYTES[weight.format]].contiguous().view(torch.float16)).all()
    )
