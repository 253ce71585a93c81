"""The quantized KV pool: int8 / int4 / fp8 numbers with their scales, behind the pool's contract.

It keeps `pool.py`'s calls (`write`, `read`, `move_entries`, `read_block`, `write_block`, `layer`)
so attention and the tiers never know the numbers are quantized; the formats themselves, and
why keys are scaled per channel and values per token, are `quantization.py`'s chapter. What is
particular here is staging: a block's keys wait in full precision until the block is full (a
per-channel scale needs the whole block) and are quantized then, once.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch

from minillm.config import ModelConfig
from minillm.memory.quantization import (
    SCALE_DTYPE,
    KVFormat,
    KVLayer,
    bytes_per_token,
    dequantize,
    quantize,
    quantize_onto,
)


class QuantizedKVPool:
    """The paged KV pool with quantized numbers; the same `write` / `read` as `PagedKVPool`.

    Per layer: key and value numbers (num_slots, kv_heads, head_dim / values_per_byte), value
    scales per slot and head, key scales per slot and head ("token") or per block, head and
    channel ("channel"), and the staged keys of blocks still filling (channel scales only).

    Staging lives in tensors too, so a kernel can read it where it lies: `k_staged[layer]`
    (rows, block_size, kv_heads, head_dim) in the model's dtype, and `staged_row[layer, block]`,
    the row holding that block's keys, or -1 once the block is full and its keys quantized.
    Rows are taken and given back as blocks start and fill; the tensor grows (doubling) when
    more blocks fill at once than it has rows. A lock keeps a tier's prefetch thread (which
    restores staged keys) and the step's writes from growing or taking rows under each other.
    """

    quantized = True

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        fmt: KVFormat,
        key_scales: str,
        dtype: torch.dtype,
        device,
        pin: bool = False,
    ):
        self.block_size, self.num_blocks, self.device = block_size, num_blocks, torch.device(device)
        self.fmt, self.key_scales, self.dtype, self.pin = fmt, key_scales, dtype, pin
        self.bytes_per_slot = math.ceil(bytes_per_token(config, fmt, key_scales, block_size))
        layers, slots, heads = config.num_layers, num_blocks * block_size, config.num_kv_heads
        stored = (layers, slots, heads, config.head_dim // fmt.values_per_byte)
        storage_dtype = torch.int8 if fmt.name == "int8" else torch.uint8
        self.k_data = torch.zeros(stored, dtype=storage_dtype, device=device, pin_memory=pin)
        self.v_data = torch.zeros(stored, dtype=storage_dtype, device=device, pin_memory=pin)
        self.v_scale = torch.zeros(
            layers, slots, heads, 1, 2, dtype=SCALE_DTYPE, device=device, pin_memory=pin
        )
        key_scale_shape = (
            (layers, num_blocks, heads, config.head_dim, 2)
            if key_scales == "channel"
            else (layers, slots, heads, 1, 2)
        )
        self.k_scale = torch.zeros(key_scale_shape, dtype=SCALE_DTYPE, device=device, pin_memory=pin)
        self.k_staged = torch.zeros(layers, 0, block_size, heads, config.head_dim, dtype=dtype, device=device)
        self.staged_row = torch.full((layers, num_blocks), -1, dtype=torch.int32, device=device)
        self.free_rows: list[list[int]] = [
            [] for _ in range(layers)
        ]  # per layer: rows of k_staged nobody uses
        self.staging_lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return (
            self.k_data.nbytes
            + self.v_data.nbytes
            + self.v_scale.nbytes
            + self.k_scale.nbytes
            + self.staged_bytes
        )

    @property
    def staged_bytes(self) -> int:
        """Bytes of the filling blocks' keys, waiting in full precision until their block is full."""
        rows_in_use = int((self.staged_row >= 0).sum())
        return rows_in_use * self.k_staged[0, 0].nbytes if rows_in_use else 0

    @property
    def fills_are_final(self) -> bool:
        """Does writing a block's last slot change the block's other entries? With channel scales,
        yes: it quantizes the block's staged keys with one scale per channel, so a speculated
        key written there would be baked into the scales of the keys kept (`rollback.room_to_guess`)."""
        return self.key_scales == "channel"

    def layer(self, layer: int) -> KVLayer:
        return KVLayer(
            self.k_data[layer],
            self.v_data[layer],
            self.k_scale[layer],
            self.v_scale[layer],
            self.k_staged[layer],
            self.staged_row[layer],
            self.fmt.name,
            self.key_scales == "channel",
        )

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        numbers: Callable | None = None,
    ) -> None:
        """Store the new keys and values (N, kv_heads, head_dim) of `slots` (N,) in `layer`.

        `numbers(kv_layer, block_size, slots, k, v)`, when given, computes and stores the numbers
        (a kernel: `attention/kernels.py`) with this method's rounding; the pool still decides which
        staging rows blocks get and when they are given back."""
        if numbers is None:
            self._write_in_torch(layer, slots, k, v)
            return
        if self.key_scales == "token":
            numbers(self.layer(layer), self.block_size, slots, k, v)
            return
        with self.staging_lock:
            blocks = self._give_rows(layer, slots)
            numbers(self.layer(layer), self.block_size, slots, k, v)
            filled = blocks[slots % self.block_size == self.block_size - 1]
            if len(filled):
                self._release_rows(layer, filled)

    def _write_in_torch(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        data, scale = quantize(v, self.fmt, dim=-1)
        self.v_data[layer].index_copy_(0, slots, data)
        self.v_scale[layer].index_copy_(0, slots, scale)
        if self.key_scales == "token":
            data, scale = quantize(k, self.fmt, dim=-1)
            self.k_data[layer].index_copy_(0, slots, data)
            self.k_scale[layer].index_copy_(0, slots, scale)
        else:
            with self.staging_lock:
                self._stage_keys(layer, slots, k)

    def _give_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """A staging row for each block of `slots` that has none (its first keys); the blocks (N,)."""
        blocks = slots // self.block_size
        rows = self.staged_row[layer, blocks]
        if bool((rows < 0).any()):
            for block in blocks[rows < 0].unique().tolist():
                self.staged_row[layer, block] = self._take_row(layer)
        return blocks

    def _stage_keys(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Keys wait in their block's staging row; the write that fills a block quantizes it."""
        blocks, offsets = self._give_rows(layer, slots), slots % self.block_size
        rows = self.staged_row[layer, blocks]
        self.k_staged[layer, rows.long(), offsets] = k.to(self.dtype)
        filled = offsets == self.block_size - 1  # the last slot: the block is full
        if bool(filled.any()):
            self._quantize_staged(layer, blocks[filled])

    def _quantize_staged(self, layer: int, blocks: torch.Tensor) -> None:
        """Quantize the staged keys of full `blocks` (n,), one scale per (head, channel); free their rows."""
        rows = self.staged_row[layer, blocks].long()
        # (n, block_size, ...), (n, 1, heads, hd, 2)
        data, scale = quantize(self.k_staged[layer, rows], self.fmt, dim=1)
        slots = (
            blocks[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)
        ).flatten()
        self.k_data[layer].index_copy_(0, slots, data.flatten(0, 1))
        self.k_scale[layer].index_copy_(0, blocks, scale[:, 0])
        self._release_rows(layer, blocks)

    def _take_row(self, layer: int) -> int:
        if not self.free_rows[layer]:  # every row is in use: double them, for every layer
            capacity = self.k_staged.shape[1]
            grown = max(1, capacity)
            with torch.inference_mode(
                False
            ):  # a plain tensor: the prefetch thread writes it outside inference mode
                extra = self.k_staged.new_zeros(self.k_staged.shape[0], grown, *self.k_staged.shape[2:])
                self.k_staged = torch.cat([self.k_staged, extra], dim=1)
            for free in self.free_rows:
                free.extend(range(capacity, capacity + grown))
        return self.free_rows[layer].pop()

    def _release_rows(self, layer: int, blocks: torch.Tensor) -> None:
        self.free_rows[layer].extend(self.staged_row[layer, blocks].tolist())
        self.staged_row[layer, blocks] = -1

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values in `slots` (any shape): (*slots.shape, kv_heads, head_dim)."""
        values = dequantize(self.v_data[layer][slots], self.v_scale[layer][slots], self.fmt)
        if self.key_scales == "token":
            keys = dequantize(self.k_data[layer][slots], self.k_scale[layer][slots], self.fmt)
            return keys.to(self.dtype), values.to(self.dtype)
        blocks = slots // self.block_size
        keys = dequantize(self.k_data[layer][slots], self.k_scale[layer][blocks], self.fmt)
        rows = self.staged_row[layer][blocks]
        filling = rows >= 0  # a block still filling: its keys are the exact staged ones
        keys[filling] = self.k_staged[layer][rows[filling].long(), (slots % self.block_size)[filling]].float()
        return keys.to(self.dtype), values.to(self.dtype)

    def move_entries(
        self, layers: torch.Tensor, heads: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> None:
        """For each i (all (m,)): head heads[i] of slot dst_slots[i] in layer layers[i] takes what
        the same head holds in src_slots[i] (eviction: a newcomer fills a dropped entry's place).

        Values, and keys scaled per token, have a scale per (slot, head): numbers and scales copy
        exactly. Keys scaled per channel share the scales of their (block, head): into a block still
        filling goes the exact key (staged; dequantized where its source block is quantized). Into
        a quantized block, a key within the range of that (block, head)'s scales in every channel is
        rounded onto them (`quantize_onto`) and nothing else changes; one outside it has that (block, head)
        quantized anew, its keys and the newcomers together, with fresh scales (clamping instead
        would flatten it onto a range set by a few other tokens). So a key is rounded once more
        only when its block takes a newcomer out of its range, never more often than a rewrite of
        the whole cache each step would round it."""
        self.v_data[layers, dst_slots, heads] = self.v_data[
            layers, src_slots, heads
        ]  # (m, head_dim / per byte)
        self.v_scale[layers, dst_slots, heads] = self.v_scale[layers, src_slots, heads]  # (m, 1, 2)
        if self.key_scales == "token":
            self.k_data[layers, dst_slots, heads] = self.k_data[layers, src_slots, heads]
            self.k_scale[layers, dst_slots, heads] = self.k_scale[layers, src_slots, heads]
            return
        with self.staging_lock:
            keys = self._keys_at(layers, heads, src_slots)  # (m, head_dim) fp32, read before any write
            blocks, offsets = dst_slots // self.block_size, dst_slots % self.block_size
            rows = self.staged_row[layers, blocks]
            filling = rows >= 0
            self.k_staged[layers[filling], rows[filling].long(), offsets[filling], heads[filling]] = keys[
                filling
            ].to(self.dtype)
            scales = self.k_scale[layers, blocks, heads].float()  # (m, head_dim, 2): scale, center
            # within half a step of the range it rounds into it, as any key of the block did
            fits = ((keys - scales[..., 1]).abs() <= scales[..., 0] * (self.fmt.qmax + 0.5)).all(dim=-1)
            group = (layers * self.num_blocks + blocks) * self.k_data.shape[
                2
            ] + heads  # (m,) its (layer, block, head)
            anew = ~filling & torch.isin(group, group[~filling & ~fits])  # in a group some key does not fit
            onto = ~filling & ~anew
            self.k_data[layers[onto], dst_slots[onto], heads[onto]] = quantize_onto(
                keys[onto], scales[onto], self.fmt
            )
            if bool(anew.any()):
                self._quantize_anew(layers[anew], blocks[anew], heads[anew], offsets[anew], keys[anew])

    def _quantize_anew(
        self,
        layers: torch.Tensor,
        blocks: torch.Tensor,
        heads: torch.Tensor,
        offsets: torch.Tensor,
        keys: torch.Tensor,
    ) -> None:
        """Put `keys` (m, head_dim) at `offsets` of head heads[i] of quantized block blocks[i] in
        layer layers[i], and quantize each such (layer, block, head) anew, with fresh per-channel
        scales over its keys as they are now."""
        group = (layers * self.num_blocks + blocks) * self.k_data.shape[2] + heads
        groups, member = group.unique(return_inverse=True)  # (g,), and each key's group
        first = torch.zeros_like(groups).scatter_(0, member, torch.arange(len(group), device=group.device))
        g_layers, g_blocks, g_heads = layers[first], blocks[first], heads[first]  # (g,) each
        # (g, block_size)
        slots = g_blocks[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)
        # (g, block_size, head_dim)
        current = dequantize(
            self.k_data[g_layers[:, None], slots, g_heads[:, None]],
            self.k_scale[g_layers, g_blocks, g_heads][:, None],
            self.fmt,
        )
        current[member, offsets] = keys
        data, scales = quantize(current, self.fmt, dim=1)  # (g, block_size, ...), (g, 1, head_dim, 2)
        self.k_data[g_layers[:, None], slots, g_heads[:, None]] = data
        self.k_scale[g_layers, g_blocks, g_heads] = scales[:, 0]

    def _keys_at(self, layers: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Keys scaled per channel, one per (layer, head, slot) triple: (m, head_dim) fp32, exact
        where the block is still filling."""
        blocks = slots // self.block_size
        keys = dequantize(self.k_data[layers, slots, heads], self.k_scale[layers, blocks, heads], self.fmt)
        rows = self.staged_row[layers, blocks]
        filling = rows >= 0
        keys[filling] = self.k_staged[
            layers[filling], rows[filling].long(), (slots % self.block_size)[filling], heads[filling]
        ].float()
        return keys

    def restage_block(self, block: int) -> None:
        """Eviction cut a sequence back into `block`, whose later slots the next tokens write
        again: where its keys were quantized (it had filled), they go back to staging,
        dequantized, to be quantized anew with the block's new keys when it fills again."""
        if self.key_scales == "token":
            return
        with self.staging_lock:
            slots = torch.arange(block * self.block_size, (block + 1) * self.block_size, device=self.device)
            for layer in (self.staged_row[:, block] < 0).nonzero().flatten().tolist():
                # (block_size, heads, hd)
                keys = dequantize(self.k_data[layer, slots], self.k_scale[layer, block], self.fmt)
                row = self._take_row(layer)
                self.k_staged[layer, row] = keys.to(self.dtype)
                self.staged_row[layer, block] = row

    def staged_blocks(self, layer: int) -> list[int]:
        """Blocks whose keys wait in full precision in this layer until they fill (then quantized)."""
        return (self.staged_row[layer] >= 0).nonzero().flatten().tolist()

    def read_block(self, block: int) -> dict[str, torch.Tensor]:
        """The block as stored: numbers and scales of every layer (views), and the staged keys
        (block_size, kv_heads, head_dim) of each layer where it is still filling."""
        rows = slice(block * self.block_size, (block + 1) * self.block_size)
        payload = {
            "k_data": self.k_data[:, rows],
            "v_data": self.v_data[:, rows],
            "v_scale": self.v_scale[:, rows],
            "k_scale": self.k_scale[:, block] if self.key_scales == "channel" else self.k_scale[:, rows],
        }
        for layer, row in enumerate(self.staged_row[:, block].tolist()):
            if row >= 0:
                payload[f"k_staging.{layer}"] = self.k_staged[layer, row]
        return payload

    def write_block(self, block: int, payload: dict[str, torch.Tensor]) -> None:
        stored = self.read_block(block)
        for name in ("k_data", "v_data", "v_scale", "k_scale"):
            stored[name].copy_(payload[name], non_blocking=True)  # asynchronous from pinned host memory
        with self.staging_lock:
            self._write_staged(block, payload)

    def _write_staged(self, block: int, payload: dict[str, torch.Tensor]) -> None:
        """The block's staged keys are the payload's: rows taken where it has some, given back where not."""
        for layer in range(len(self.k_data)):
            staged = payload.get(f"k_staging.{layer}")
            row = int(self.staged_row[layer, block])
            if staged is not None:
                if row < 0:
                    row = self._take_row(layer)
                    self.staged_row[layer, block] = row
                self.k_staged[layer, row].copy_(staged, non_blocking=True)
            elif row >= 0:
                self._release_rows(layer, torch.tensor([block], device=self.device))

    def forget_free_blocks(self, is_free: Callable[[int], bool]) -> None:
        """Give back the staging rows of blocks no sequence holds any more (finished or preempted)."""
        with self.staging_lock:
            for layer in range(len(self.k_data)):
                freed = [block for block in self.staged_blocks(layer) if is_free(block)]
                if freed:
                    self._release_rows(layer, torch.tensor(freed, device=self.device))
