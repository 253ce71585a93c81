"""The KV pool: the tensors every token's keys and values live in, and what a byte budget buys.

The pool is cut into `num_blocks` blocks of `block_size` token *slots*; slot
`block_id * block_size + offset` holds one token's key and value for every layer and KV head.
Which slots belong to which sequence is the block manager's business (`block_manager.py`); the
pool only stores numbers, behind two calls that attention uses:

    pool.write(layer, slots, k, v)    k, v (n, kv_heads, head_dim) go into `slots` (n,)
    pool.read(layer, slots)           -> keys, values (n, kv_heads, head_dim), in slot order

one that moves single entries, head by head, for eviction (`eviction.py`):

    pool.move_entries(layers, heads, src, dst)   head heads[i] of slot dst[i] in layer layers[i]
                                                 takes what that head holds in slot src[i]

and two that move whole blocks, for copy-on-write and for the tiers (`tiers.py`):

    pool.read_block(block)            -> {name: tensor}: every number of the block, every layer
    pool.write_block(block, payload)  the block now holds exactly `payload`

A block's payload is its stored form (quantized numbers with their scales and centres), so a block
copied to another pool, or saved to a file, comes back bit for bit.

A decode kernel skips `read` and reads a layer where it lies: `pool.layer(layer)` is a `KVLayer`
of the stored tensors (numbers, scales, staged keys), dequantized in the kernel's registers.

Two pools keep that contract: `PagedKVPool` (here) stores the numbers in the model's dtype;
`QuantizedKVPool` (`quantized_pool.py`) stores int8 / int4 / fp8 numbers with their scales beside
them (`quantization.py`), so attention never knows how the numbers are stored.

`make_pool` sizes a pool from a byte budget: bytes per slot (K and V, every layer, scales
included) × block_size is one block's cost, and the budget buys that many whole blocks.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from minillm.config import ConfigError, ModelConfig
from minillm.memory.quantization import FORMATS, KVLayer, bytes_per_token
from minillm.memory.quantized_pool import QuantizedKVPool


def bytes_per_slot(
    config: ModelConfig, kv_dtype: str, key_scales: str, block_size: int, dtype: torch.dtype
) -> int:
    """KV bytes one token slot costs: the model's dtype ("auto"), or a quantized format with its scales."""
    if kv_dtype == "auto":
        return config.kv_bytes_per_token(dtype)
    fmt = FORMATS[kv_dtype]  # int4 packs two numbers a byte: config.json's head_dim is even
    return math.ceil(bytes_per_token(config, fmt, key_scales, block_size))


def make_pool(
    config: ModelConfig,
    kv_cache_bytes: int,
    block_size: int,
    kv_dtype: str,
    key_scales: str,
    dtype: torch.dtype,
    device,
    pin: bool = False,
    budget_name: str = "kv_cache_bytes",
) -> PagedKVPool | QuantizedKVPool:
    """As many whole blocks as `kv_cache_bytes` pays for, in the storage `kv_dtype` asks for.
    `pin`: page-locked host memory, which a CUDA device copies from without a staging copy (the
    host tier); `budget_name` is the switch an error message names."""
    per_slot = bytes_per_slot(config, kv_dtype, key_scales, block_size, dtype)
    num_blocks = kv_cache_bytes // (per_slot * block_size)
    if num_blocks < 1:
        raise ConfigError(
            f"{budget_name}={kv_cache_bytes:,} cannot hold one block of {block_size} "
            f"tokens ({per_slot * block_size:,} bytes); raise it."
        )
    try:
        if kv_dtype == "auto":
            return PagedKVPool(config, num_blocks, block_size, dtype, device, pin)
        return QuantizedKVPool(
            config, num_blocks, block_size, FORMATS[kv_dtype], key_scales, dtype, device, pin
        )
    except (
        RuntimeError,
        MemoryError,
    ) as err:  # the allocator said no (torch's OutOfMemoryError is a RuntimeError)
        raise ConfigError(
            f"The KV pool of {budget_name}={kv_cache_bytes:,} could not be allocated on {device} "
            f"({str(err).splitlines()[0][:80]}); lower {budget_name}."
        ) from None


class PagedKVPool:
    """Numbers in the model's dtype: k_cache[layer], v_cache[layer] are (num_slots, kv_heads, head_dim)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device,
        pin: bool = False,
    ):
        self.block_size, self.num_blocks, self.device = block_size, num_blocks, torch.device(device)
        self.bytes_per_slot = config.kv_bytes_per_token(dtype)
        shape = (config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        empty = self.k_cache.new_empty(0)
        no_rows = torch.empty(0, dtype=torch.int32, device=self.device)
        self._layers = [  # made once: a step asks for every layer's view
            KVLayer(self.k_cache[layer], self.v_cache[layer], empty, empty, empty, no_rows, "auto", False)
            for layer in range(config.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    @property
    def staged_bytes(self) -> int:
        """Bytes held in full precision beside the blocks: none, every number lives in its block."""
        return 0

    quantized = False  # are the numbers stored in another format than the model's dtype?

    @property
    def fills_are_final(self) -> bool:
        """Does writing a block's last slot change the block's other entries? Not here: each
        entry is stored as written (speculation may write guesses anywhere and roll them back)."""
        return False

    def layer(self, layer: int) -> KVLayer:
        return self._layers[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (n, kv_heads, head_dim) go into `slots` (n,)."""
        stored = self._layers[layer]  # its views of k_cache and v_cache
        stored.k.index_copy_(0, slots, k)
        stored.v.index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values in `slots` (any shape): (*slots.shape, kv_heads, head_dim) each."""
        return self.k_cache[layer][slots], self.v_cache[layer][slots]

    def move_entries(
        self, layers: torch.Tensor, heads: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> None:
        """For each i (all (m,)): head heads[i] of slot dst_slots[i] in layer layers[i] takes what
        the same head holds in src_slots[i]. Eviction fills a dropped entry's place with a newcomer;
        each head may hold a different token in the same slot."""
        self.k_cache[layers, dst_slots, heads] = self.k_cache[layers, src_slots, heads]  # (m, head_dim)
        self.v_cache[layers, dst_slots, heads] = self.v_cache[layers, src_slots, heads]

    def restage_block(self, block: int) -> None:
        """Nothing to do: a block's numbers are written one slot at a time, never sealed."""

    def staged_blocks(self, layer: int) -> list[int]:
        """Blocks whose keys wait in full precision until they fill: none, nothing is quantized here."""
        return []

    def read_block(self, block: int) -> dict[str, torch.Tensor]:
        """The block's keys and values, (layers, block_size, kv_heads, head_dim) each (views)."""
        rows = slice(block * self.block_size, (block + 1) * self.block_size)
        return {"k": self.k_cache[:, rows], "v": self.v_cache[:, rows]}

    def write_block(self, block: int, payload: dict[str, torch.Tensor]) -> None:
        for name, stored in self.read_block(block).items():
            stored.copy_(payload[name], non_blocking=True)  # asynchronous from pinned host memory

    def forget_free_blocks(self, is_free: Callable[[int], bool]) -> None:
        """Nothing to do: every number lives in its block (the quantized pool keeps staging too)."""
