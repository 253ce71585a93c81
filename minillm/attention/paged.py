"""Paged attention: write K/V into slots, read them back through block tables.

The KV pool is one tensor per layer of *slots*: (num_blocks * block_size, kv_heads, head_dim).
Which slots belong to which sequence is the block manager's business; this module only needs,
for one engine step,
  - `write_slots` (N,): where each of the step's N tokens stores its k and v;
  - for each prefill chunk: its rows in the flat batch, their positions, and `context_slots` —
    the slots of its positions 0..last, in order, read through its block table;
  - for the decode tokens (one query each): their rows, block tables and context lengths, handed
    together to the decode backend — the torch reference, the C++ kernel or the CUDA kernel
    (`attention_backend`), which all share one signature.

A step may mix prefill chunks and decode tokens of many sequences of different lengths (ragged);
each sequence attends only over its own history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's keys and values, in every layer."""
        size = self.block_size
        for src, dst in pairs:
            self.k_cache[:, dst * size:(dst + 1) * size] = self.k_cache[:, src * size:(src + 1) * size]
            self.v_cache[:, dst * size:(dst + 1) * size] = self.v_cache[:, src * size:(src + 1) * size]


@dataclass
class SequenceSlice:
    """One prefill chunk's share of a step."""

    query_start: int  # its queries are rows query_start..query_end-1 of the flat batch
    query_end: int
    q_positions: torch.Tensor  # (n,) positions of those queries
    context_slots: torch.Tensor  # (context_len,) slots of positions 0..context_len-1


def context_slots(block_table: list[int], block_size: int, context_len: int, device) -> torch.Tensor:
    """Slots of positions 0..context_len-1: table[p // block_size] * block_size + p % block_size."""
    positions = torch.arange(context_len, device=device)
    table = torch.tensor(block_table, device=device)
    return table[positions // block_size] * block_size + positions % block_size


@dataclass
class DecodeBatch:
    """The step's decode tokens: one query per sequence, attended by the decode backend together."""

    rows: torch.Tensor  # (S,) their rows in the flat batch
    block_tables: torch.Tensor  # (S, max_blocks) int32, padded with block 0
    context_lens: torch.Tensor  # (S,) int32

    @classmethod
    def of(cls, rows: list[int], tables: list[list[int]], context_lens: list[int], device) -> "DecodeBatch":
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]
        return cls(torch.tensor(rows, device=device), torch.tensor(padded, dtype=torch.int32, device=device),
                   torch.tensor(context_lens, dtype=torch.int32, device=device))


class PagedAttention:
    """The attention context of one engine step (see `model.AttentionContext`)."""

    def __init__(self, cache: PagedKVCache, write_slots: torch.Tensor, prefills: list[SequenceSlice],
                 decode: DecodeBatch | None, decode_attention: Callable):
        self.cache = cache
        self.write_slots = write_slots  # (N,)
        self.prefills = prefills
        self.decode = decode
        self.decode_attention = decode_attention

    def attend(self, layer_idx, q, k, v):
        k_cache, v_cache = self.cache.k_cache[layer_idx], self.cache.v_cache[layer_idx]
        k_cache.index_copy_(0, self.write_slots, k)  # store this step's keys and values first:
        v_cache.index_copy_(0, self.write_slots, v)  # every query attends to its own token too
        out = torch.empty_like(q)  # (N, num_heads, head_dim)
        if self.decode is not None:
            d = self.decode
            out[d.rows] = self.decode_attention(q[d.rows].contiguous(), k_cache, v_cache, d.block_tables,
                                                d.context_lens, self.cache.block_size)
        for seq in self.prefills:
            rows = slice(seq.query_start, seq.query_end)
            out[rows] = causal_attention(q[rows], k_cache[seq.context_slots], v_cache[seq.context_slots],
                                         seq.q_positions)
        return out
