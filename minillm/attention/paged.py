"""Paged attention: write K/V into slots, read them back through block tables.

The KV pool holds *slots*: one per token, numbered block_id * block_size + offset. Which slots
belong to which sequence is the block manager's business; this module only needs, for one step,
  - `write_slots` (N,): where each of the step's N tokens stores its k and v;
  - the decode tokens (one query each) with their block tables and context lengths, attended
    together in one call: the batched torch reference (`reference.paged_decode_attention`), or a
    kernel (`attention_backend` "cpu" / "cuda") that reads the pool's blocks where they lie;
  - for each prefill chunk, attended in torch: its rows in the flat batch, the cache indices of
    its queries, and `context_slots` — the slots of its cache entries 0..last, in order, read
    through its block table.

A step may mix prefill chunks and decode tokens of many sequences of different lengths (ragged);
each sequence attends only over its own history.

The pool itself (`memory/pool.py`) is a `PagedKVPool` (numbers in the model's dtype) or a
`QuantizedKVPool` (int8 / int4 / fp8 with scales); both offer `write(layer, slots, k, v)` and
`read(layer, slots)`, so attention does not care how the numbers are stored. A cache index
equals the token's position until eviction (`memory/eviction.py`) drops entries; then positions
run ahead of indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from minillm.attention.reference import causal_attention


@dataclass
class SequenceSlice:
    """One sequence's share of a step, attended in torch (a prefill chunk, or a decode token)."""

    query_start: int  # its queries are rows query_start..query_end-1 of the flat batch
    query_end: int
    q_indices: torch.Tensor  # (n,) cache indices of those queries (their positions, until eviction)
    context_slots: torch.Tensor  # (context_len,) slots of cache entries 0..context_len-1
    attention_mass: torch.Tensor | None = None  # (layers, kv_heads, context_len), accumulated for H2O


def context_slots(block_table: list[int], block_size: int, context_len: int, device) -> torch.Tensor:
    """Slots of entries 0..context_len-1: table[i // block_size] * block_size + i % block_size."""
    indices = torch.arange(context_len, device=device)
    table = torch.tensor(block_table, device=device)
    return table[indices // block_size] * block_size + indices % block_size


@dataclass
class DecodeBatch:
    """The step's decode tokens: one query per sequence, attended together."""

    rows: torch.Tensor  # (S,) their rows in the flat batch
    block_tables: torch.Tensor  # (S, max_blocks) int32, padded with block 0
    context_lens: torch.Tensor  # (S,) int32
    mass: torch.Tensor | None  # (layers, S, kv_heads, longest context): attention each entry got, for H2O

    @classmethod
    def of(
        cls,
        rows: list[int],
        tables: list[list[int]],
        context_lens: list[int],
        device,
        mass_layers: int = 0,
        num_kv_heads: int = 0,
    ) -> "DecodeBatch":
        """`mass_layers` > 0: keep the attention mass of every layer (H2O)."""
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]
        mass = (
            torch.zeros(mass_layers, len(rows), num_kv_heads, max(context_lens), device=device)
            if mass_layers
            else None
        )
        return cls(
            torch.tensor(rows, device=device),
            torch.tensor(padded, dtype=torch.int32, device=device),
            torch.tensor(context_lens, dtype=torch.int32, device=device),
            mass,
        )


class PagedAttention:
    """The attention context of one engine step (see `model.AttentionContext`)."""

    def __init__(
        self,
        pool,
        write_slots: torch.Tensor,
        sequences: list[SequenceSlice],
        decode: DecodeBatch | None,
        decode_attention: Callable,
    ):
        self.pool = pool
        self.write_slots = write_slots  # (N,)
        self.sequences = sequences
        self.decode = decode
        self.decode_attention = (
            decode_attention  # reference.paged_decode_attention, or a kernel with its signature
        )

    def attend(self, layer_idx, q, k, v):
        self.pool.write(layer_idx, self.write_slots, k, v)  # store this step's keys and values first:
        out = torch.empty_like(q)  # (N, num_heads, head_dim)      every query attends to its own token too
        if self.decode is not None:
            d = self.decode
            out[d.rows], mass = self.decode_attention(
                q[d.rows].contiguous(),
                self.pool,
                layer_idx,
                d.block_tables,
                d.context_lens,
                with_mass=d.mass is not None,
            )
            if d.mass is not None:
                d.mass[layer_idx] = mass
        for seq in self.sequences:
            rows = slice(seq.query_start, seq.query_end)
            keys, values = self.pool.read(layer_idx, seq.context_slots)
            if seq.attention_mass is None:
                out[rows] = causal_attention(q[rows], keys, values, seq.q_indices)
            else:
                out[rows], mass = causal_attention(q[rows], keys, values, seq.q_indices, with_key_mass=True)
                seq.attention_mass[layer_idx] += mass
        return out
