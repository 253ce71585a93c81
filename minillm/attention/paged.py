"""Paged attention: write K/V into slots, read them back through block tables.

The KV pool holds *slots*: one per token, numbered block_id * block_size + offset. Which slots
belong to which sequence is the block manager's business; this module only needs, for one step,
  - `write_slots` (N,): where each of the step's N tokens stores its k and v;
  - the decode tokens (one query each) with their block tables and context lengths (`DecodeBatch`);
  - the prefill chunks (many queries each) with their block tables, their queries' rows and cache
    indices and their context lengths (`PrefillBatch`).
Each group is attended in one call by the run's backend (`kernels.Backend`): the torch references
(`reference.py`) or the kernels, which read the pool's blocks where they lie.

A step may mix prefill chunks and decode tokens of many sequences of different lengths (ragged);
each sequence attends only over its own history.

The pool itself (`memory/pool.py`) is a `PagedKVPool` (numbers in the model's dtype) or a
`QuantizedKVPool` (int8 / int4 / fp8 with scales); both offer `write(layer, slots, k, v)`,
`read(layer, slots)` (what the torch references use) and `layer(l)`, the layer as stored (what the
kernels read). A cache index equals the token's position until eviction (`memory/eviction.py`)
drops entries; then positions run ahead of indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def padded_tables(tables: list[list[int]], device) -> torch.Tensor:
    """Block tables as one (S, longest) int32 tensor, padded with block 0 (never read)."""
    width = max(len(table) for table in tables)
    return torch.tensor(
        [table + [0] * (width - len(table)) for table in tables], dtype=torch.int32, device=device
    )


def mass_buffer(layers: int, num_seqs: int, num_kv_heads: int, context_lens: list[int], device):
    """Room for the attention each entry gets in every layer (H2O), or None without H2O."""
    return torch.zeros(layers, num_seqs, num_kv_heads, max(context_lens), device=device) if layers else None


@dataclass
class DecodeBatch:
    """The step's decode tokens: one query per sequence, attended together."""

    rows: torch.Tensor  # (S,) their rows in the flat batch
    block_tables: torch.Tensor  # (S, max_blocks) int32, padded with block 0
    context_lens: torch.Tensor  # (S,) int32
    mass: torch.Tensor | None  # (layers, S, kv_heads, longest context): attention each entry got, for H2O

    @classmethod
    def of(cls, rows: list[int], tables, context_lens: list[int], device, mass_layers=0, num_kv_heads=0):
        """`mass_layers` > 0: keep the attention mass of every layer (H2O)."""
        return cls(
            torch.tensor(rows, device=device),
            padded_tables(tables, device),
            torch.tensor(context_lens, dtype=torch.int32, device=device),
            mass_buffer(mass_layers, len(rows), num_kv_heads, context_lens, device),
        )


@dataclass
class PrefillBatch:
    """The step's prefill chunks: many queries per sequence, attended together (ragged)."""

    rows: torch.Tensor  # (Nq,) their rows in the flat batch, sequence after sequence
    block_tables: torch.Tensor  # (S, max_blocks) int32, padded with block 0
    cu_seqlens: torch.Tensor  # (S + 1,) int32: sequence s owns queries cu_seqlens[s]..cu_seqlens[s+1]-1
    q_indices: torch.Tensor  # (Nq,) int32: each query's cache index (its position, until eviction)
    context_lens: torch.Tensor  # (S,) int32: entries of each sequence, its chunk included
    mass: torch.Tensor | None  # (layers, S, kv_heads, longest context): attention each entry got, for H2O

    @classmethod
    def of(cls, chunks: list[tuple[int, int, int]], tables, device, mass_layers=0, num_kv_heads=0):
        """`chunks`: (first row, first cache index, tokens) of each sequence's chunk."""
        rows = [row + i for row, _, n in chunks for i in range(n)]
        indices = [first + i for _, first, n in chunks for i in range(n)]
        bounds = [0]
        for _, _, n in chunks:
            bounds.append(bounds[-1] + n)
        context_lens = [first + n for _, first, n in chunks]

        def ints(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            torch.tensor(rows, device=device),
            padded_tables(tables, device),
            ints(bounds),
            ints(indices),
            ints(context_lens),
            mass_buffer(mass_layers, len(chunks), num_kv_heads, context_lens, device),
        )


class PagedAttention:
    """The attention context of one engine step (see `model.AttentionContext`)."""

    def __init__(self, pool, write_slots: torch.Tensor, decode, prefill, backend):
        self.pool = pool
        self.write_slots = write_slots  # (N,)
        self.decode: DecodeBatch | None = decode
        self.prefill: PrefillBatch | None = prefill
        self.backend = backend  # kernels.Backend: the torch references, or kernels with their signatures

    def attend(self, layer_idx, q, k, v):
        self.backend.write(self.pool, layer_idx, self.write_slots, k, v)  # this step's keys and values first:
        if self.prefill is None:  # every query attends to its own token too
            return self._decoded(layer_idx, q.contiguous())  # decode only: the rows are the queries, in order
        out = torch.empty_like(q)  # (N, num_heads, head_dim)
        if self.decode is not None:
            out[self.decode.rows] = self._decoded(layer_idx, q[self.decode.rows])
        p = self.prefill
        out[p.rows], mass = self.backend.prefill(
            q[p.rows],
            self.pool,
            layer_idx,
            p.block_tables,
            p.cu_seqlens,
            p.q_indices,
            p.context_lens,
            with_mass=p.mass is not None,
        )
        if p.mass is not None:
            p.mass[layer_idx] = mass
        return out

    def _decoded(self, layer_idx: int, queries: torch.Tensor) -> torch.Tensor:
        """The decode queries (S, num_heads, head_dim), one per sequence, attended; their attention
        mass kept for H2O when asked."""
        d = self.decode
        out, mass = self.backend.decode(
            queries, self.pool, layer_idx, d.block_tables, d.context_lens, with_mass=d.mass is not None
        )
        if d.mass is not None:
            d.mass[layer_idx] = mass
        return out
