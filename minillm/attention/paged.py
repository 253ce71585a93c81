"""Paged attention, torch reference: write K/V into slots, read them back through block tables.

The KV pool is one tensor per layer of *slots*: (num_blocks * block_size, kv_heads, head_dim).
Which slots belong to which sequence is the block manager's business; this module only needs,
for one engine step,
  - `write_slots` (N,): where each of the step's N tokens stores its k and v;
  - per sequence: which rows of the flat batch are its queries, their positions, and
    `context_slots` — the slots of its positions 0..last, in order, read through its block table.

A step may mix prefill chunks and decode tokens of many sequences of different lengths (ragged);
each sequence attends only over its own history. This loop over sequences is the readable truth
the C++ and CUDA kernels are checked against later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.attention.reference import causal_attention
from minillm.config import ModelConfig


class PagedKVCache:
    """The KV pool: k_cache[layer], v_cache[layer] are (num_slots, kv_heads, head_dim)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes


@dataclass
class SequenceSlice:
    """One sequence's share of a step."""

    query_start: int  # its queries are rows query_start..query_end-1 of the flat batch
    query_end: int
    q_positions: torch.Tensor  # (n,) positions of those queries
    context_slots: torch.Tensor  # (context_len,) slots of positions 0..context_len-1


def context_slots(block_table: list[int], block_size: int, context_len: int, device) -> torch.Tensor:
    """Slots of positions 0..context_len-1: table[p // block_size] * block_size + p % block_size."""
    positions = torch.arange(context_len, device=device)
    table = torch.tensor(block_table, device=device)
    return table[positions // block_size] * block_size + positions % block_size


class PagedAttention:
    """The attention context of one engine step (see `model.AttentionContext`)."""

    def __init__(self, cache: PagedKVCache, write_slots: torch.Tensor, sequences: list[SequenceSlice]):
        self.cache = cache
        self.write_slots = write_slots  # (N,)
        self.sequences = sequences

    def attend(self, layer_idx, q, k, v):
        k_cache, v_cache = self.cache.k_cache[layer_idx], self.cache.v_cache[layer_idx]
        k_cache.index_copy_(0, self.write_slots, k)  # store this step's keys and values first:
        v_cache.index_copy_(0, self.write_slots, v)  # a prefill chunk attends to itself too
        out = torch.empty_like(q)  # (N, num_heads, head_dim)
        for seq in self.sequences:
            rows = slice(seq.query_start, seq.query_end)
            out[rows] = causal_attention(q[rows], k_cache[seq.context_slots], v_cache[seq.context_slots],
                                         seq.q_positions)
        return out
