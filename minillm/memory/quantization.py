"""KV quantization: keys and values in 8 bits, 4 bits or fp8, with scales stored beside them.

The KV cache is what grows with every token and every sequence, so its bytes per token decide how
many sequences fit. Storing each number in fewer bits buys room directly: int8 halves a bf16 cache
and quarters an fp32 one, int4 (two values packed in one byte) halves it again.

Quantizing a group of numbers x that share one scale:

    center = (max x + min x) / 2           the middle of the group's range
    scale  = (max x - min x) / 2 / qmax    qmax = 127 (int8), 7 (int4), 448 (fp8 e4m3's largest)
    stored = round((x - center) / scale)   int8 / int4: an integer in [-qmax, qmax]
           = fp8((x - center) / scale)     fp8: the nearest e4m3 float (3 mantissa bits)
    x     ~= stored * scale + center       the error is at most scale / 2 for the integer formats

The center costs 2 bytes per group and pays for itself: a key channel whose values sit in
[1, 4] uses all 15 int4 levels on that range instead of half of them on [-4, 4]. Measured on
SmolLM2 (lesson 07's text, 2026-11-29): int4 perplexity +1.00 with a plain max|x| scale, +0.27
centred. (`minillm eval ppl --kv-dtype int4`, 4 x 512 tokens of Alice, centred, keys per channel:
+0.48 on 2026-12-07, docs/memory.md.)

Which numbers share a scale (the *granularity*) matters as much as the bits. Values are
quantized per token and head: one scale per head_dim-long vector. Keys are different: a few
channels of the key vectors are large for every token (in SmolLM2's layer 15 the largest |key|
per channel runs from 1 to 15), so one scale per token is set by those channels and rounds the
small ones to a few levels. Quantizing
keys per *channel* — one scale per (head, dimension) over the tokens of a block — gives each
channel a scale that fits it (KIVI, Liu et al. 2024). `kv_key_scales` picks "channel" (default)
or "token"; lesson 07 measures both.

A per-channel scale needs the whole block, so a block's keys wait in full precision ("staging")
until its last slot is written, and are quantized then, once. Values are quantized on write.

Memory per token, scales included (`bytes_per_token`; SmolLM2: 30 layers x 3 KV heads x
head_dim 64, blocks of 16, scale and center in fp16): fp32 46,080 B; int8 11,520 B of numbers +
360 B for the values' scales and centers + 1,440 B for the keys' (30 x 3 x 64 x 4 B per block,
shared by its 16 tokens) = 13,320 B, 3.5x smaller; int4 7,560 B, 6.1x smaller.
The staging block of each running sequence comes on top: at most one block per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.config import ModelConfig

SCALE_DTYPE = torch.float16  # scales and centers; quantizing uses the rounded ones, so nothing drifts


@dataclass(frozen=True)
class KVFormat:
    name: str
    qmax: float  # the largest magnitude a stored number may have
    values_per_byte: int  # 2 for int4: two 4-bit numbers share a byte


FORMATS = {
    "int8": KVFormat("int8", 127.0, 1),
    "int4": KVFormat("int4", 7.0, 2),
    "fp8": KVFormat("fp8", 448.0, 1),
}


def quantize(x: torch.Tensor, fmt: KVFormat, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> (stored (..., head_dim / values_per_byte), scales (..., 2)).

    The numbers sharing a scale are those along `dim` (-1: per token, 0: per channel). Each group
    is centred first: center = (max + min) / 2, scale = (max - min) / 2 / qmax, so the group's
    range maps onto [-qmax, qmax] even when it is not centred on zero (key channels often are
    not). `scales[..., 0]` is the scale and `scales[..., 1]` the center, with `dim` kept as size 1.
    """
    low, high = (bound.float() for bound in torch.aminmax(x, dim=dim, keepdim=True))  # one pass over x
    center = ((high + low) / 2).to(SCALE_DTYPE)
    scale = ((high - low) / 2 / fmt.qmax).clamp_min(torch.finfo(SCALE_DTYPE).tiny).to(SCALE_DTYPE)
    scaled = (x.float() - center.float()) / scale.float()
    scales = torch.stack([scale, center], dim=-1)
    if fmt.name == "fp8":
        # stored as raw bytes: torch's CPU index_copy_ has no float8 kernel, uint8 moves the same bits
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scales
    ints = scaled.round().clamp(-fmt.qmax, fmt.qmax)
    if fmt.name == "int8":
        return ints.to(torch.int8), scales
    return pack_int4(ints), scales


def quantize_onto(x: torch.Tensor, scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """x (..., head_dim) rounded onto scales a group already has (..., head_dim, 2) or (..., 1, 2),
    without changing them: what lies outside the group's range is clamped to its ends. Eviction
    moves a key into a block whose keys were quantized together (`QuantizedKVPool.move_entries`)."""
    scaled = ((x.float() - scales[..., 1].float()) / scales[..., 0].float()).clamp(-fmt.qmax, fmt.qmax)
    if fmt.name == "fp8":
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    ints = scaled.round()
    if fmt.name == "int8":
        return ints.to(torch.int8)
    return pack_int4(ints)


def dequantize(stored: torch.Tensor, scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """The inverse of `quantize`, in fp32; `scales` (..., 2) broadcasts against (..., head_dim)."""
    if fmt.name == "fp8":
        numbers = stored.view(torch.float8_e4m3fn).float()
    elif fmt.name == "int8":
        numbers = stored.float()
    else:
        numbers = unpack_int4(stored)
    return numbers * scales[..., 0].float() + scales[..., 1].float()


def pack_int4(ints: torch.Tensor) -> torch.Tensor:
    """Integers in [-7, 7] (..., d) -> bytes (..., d/2): dimension 2i in the low 4 bits, 2i+1 in
    the high 4 bits, each stored as value + 8 (so 1..15, never negative)."""
    nibbles = (ints + 8).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2).float() - 8  # (..., d) in [-7, 7]


def bytes_per_token(config: ModelConfig, fmt: KVFormat, key_scales: str, block_size: int) -> float:
    """KV bytes one token costs in a quantized pool, scales included (per-channel key scales are
    shared by a block's tokens, so each token pays 1 / block_size of them)."""
    heads = config.num_layers * config.num_kv_heads
    data = 2 * heads * config.head_dim // fmt.values_per_byte
    scale_size = 2 * torch.empty((), dtype=SCALE_DTYPE).element_size()  # a scale and a center
    value_scales = heads * scale_size
    key_scales_bytes = (
        heads * config.head_dim * scale_size / block_size if key_scales == "channel" else value_scales
    )
    return data + value_scales + key_scales_bytes


@dataclass
class KVLayer:
    """One layer of a pool as it is stored: what a decode kernel reads in place.

    A pool in the model's dtype fills only k and v; the other tensors are then empty."""

    k: torch.Tensor  # (num_slots, kv_heads, head_dim / values_per_byte): the numbers as stored
    v: torch.Tensor
    k_scale: torch.Tensor  # (scale, center) in fp16: (num_blocks, kv_heads, head_dim, 2) per channel,
    v_scale: torch.Tensor  # or (num_slots, kv_heads, 1, 2) per token, as values always are
    # (rows, block_size, kv_heads, head_dim), model dtype: keys of blocks still filling
    k_staged: torch.Tensor
    staged_row: torch.Tensor  # (num_blocks,) int32: a block's row in k_staged, -1 once its keys are quantized
    kv_format: str  # "auto" (the model's dtype), "int8", "int4" or "fp8"
    keys_per_channel: bool
