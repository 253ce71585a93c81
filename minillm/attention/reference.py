"""Causal attention over a sequence's history, in plain torch math.

Every KV layout in minillm (no cache, one contiguous cache, paged blocks later) ends by handing
`causal_attention` the keys and values of one sequence in position order. It is the readable
truth the faster paths are checked against. Its two paged forms read a paged pool through block
tables and state the kernels' contracts: `paged_decode_attention` for decode tokens (one query per
sequence, all sequences in two batched matmuls) and `paged_prefill_attention` for prefill chunks
(ragged: every chunk of a step in one call, its queries given by cu_seqlens).

Grouped-query attention (GQA): `num_heads` query heads share `num_kv_heads` key/value heads, in
groups of `group = num_heads // num_kv_heads` (SmolLM2: 9 query heads, 3 KV heads, groups of 3).
That sharing is why SmolLM2's KV cache is 3x smaller than its query width suggests. We compute it
without copying K and V: fold each group's query heads into the query axis, so one KV head
answers `group x Tq` query rows in a single matmul.
"""

import torch


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, with_key_mass: bool = False
):
    """q: (Tq, num_heads, head_dim) at positions `q_positions` (Tq,);
    k, v: (Tk, num_kv_heads, head_dim) for positions 0..Tk-1. Returns (Tq, num_heads, head_dim),
    and with `with_key_mass` also the attention each key received, summed over all queries and
    the query heads of its group: (num_kv_heads, Tk) in fp32 (what H2O accumulates).

    Query i sees key j iff j <= q_positions[i]: the causal mask, in absolute positions, so a
    prefill chunk that starts mid-sequence is masked correctly too. (After eviction these are
    indices in the cache, not token positions: the mask only needs their order.)
    """
    n_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q_rows = q.permute(1, 0, 2).reshape(num_kv_heads, group * n_queries, head_dim)  # (kv_heads, group*Tq, hd)
    scores = torch.bmm(q_rows, k.permute(1, 2, 0)) * head_dim**-0.5  # (kv_heads, group*Tq, Tk)
    if n_queries > 1:  # a single decode token is the newest position: it sees every key
        key_positions = torch.arange(k.shape[0], device=k.device)
        hidden = key_positions[None, :] > q_positions[:, None]  # (Tq, Tk)
        scores = scores.masked_fill(hidden.repeat(group, 1), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1)  # fp32 softmax, as HF does, even for bf16
    out = torch.bmm(probs.to(v.dtype), v.transpose(0, 1))  # (kv_heads, group*Tq, head_dim)
    out = out.view(num_heads, n_queries, head_dim).transpose(0, 1)
    return (out, probs.sum(dim=1)) if with_key_mass else out


def paged_decode_attention(
    query: torch.Tensor,
    pool,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    with_mass: bool = False,
):
    """Decode attention for S sequences at once, through their block tables: the contract the C++
    and CUDA kernels implement, and the torch backend's decode path.

    query (S, num_heads, head_dim): the newest token of S sequences; `pool` any KV pool (its
    `read` dequantizes whatever it stores), `layer` which of its layers; block_tables
    (S, max_blocks) int32; context_lens (S,) int32. Returns out (S, num_heads, head_dim) and, with
    `with_mass`, the attention each entry received, summed over the query heads of its KV head:
    (S, num_kv_heads, longest context) fp32, zero past a sequence's context (else None).

    Every sequence's history is gathered into one padded batch (S, longest context) and attended
    with two batched matmuls; a mask hides the padding. No loop over sequences.
    """
    num_seqs, num_heads, head_dim = query.shape
    width, block_size = int(context_lens.max()), pool.block_size
    positions = torch.arange(width, device=query.device)
    # (S, width)
    slots = block_tables[:, positions // block_size].long() * block_size + positions % block_size
    keys, values = pool.read(layer, slots)  # (S, width, kv_heads, head_dim) each
    num_kv_heads = keys.shape[2]
    # (S, kv_heads, group, hd)
    q_rows = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = q_rows @ keys.permute(0, 2, 3, 1) * head_dim**-0.5  # (S, kv_heads, group, width)
    padding = positions[None, :] >= context_lens[:, None]  # (S, width)
    scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1)  # fp32 softmax, as in causal_attention
    out = (probs.to(values.dtype) @ values.transpose(1, 2)).view(num_seqs, num_heads, head_dim)
    return out, (probs.sum(dim=2) if with_mass else None)


def context_slots(block_table: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """Slots of entries 0..context_len-1: table[i // block_size] * block_size + i % block_size."""
    indices = torch.arange(context_len, device=block_table.device)
    return block_table[indices // block_size].long() * block_size + indices % block_size


def paged_prefill_attention(
    query: torch.Tensor,
    pool,
    layer: int,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    q_indices: torch.Tensor,
    context_lens: torch.Tensor,
    with_mass: bool = False,
):
    """Attention for every prefill chunk of a step, through the block tables: the contract of the
    flash prefill kernels, and the torch backend's prefill path.

    query (Nq, num_heads, head_dim): the chunks' queries end to end, sequence s owning rows
    cu_seqlens[s]..cu_seqlens[s+1]-1 (cu_seqlens (S+1,) int32); q_indices (Nq,) int32 each query's
    cache index (it sees entries 0..q_index); block_tables (S, max_blocks) int32; context_lens (S,)
    int32 the entries of each sequence, its chunk included. Returns out (Nq, num_heads, head_dim)
    and, with `with_mass`, the attention each entry received, summed over the chunk's queries and
    the query heads of its KV head: (S, num_kv_heads, longest context) fp32 (else None).

    One sequence at a time: read its history (`pool.read` dequantizes whatever it stores) and hand
    it to `causal_attention`, which builds the whole (queries x entries) score matrix.
    """
    out = torch.empty_like(query)
    bounds, lens = cu_seqlens.tolist(), context_lens.tolist()
    mass = None
    if with_mass:
        num_kv_heads = pool.layer(layer).k.shape[1]
        mass = torch.zeros(len(lens), num_kv_heads, max(lens), device=query.device)
    for s, context_len in enumerate(lens):
        rows = slice(bounds[s], bounds[s + 1])
        keys, values = pool.read(layer, context_slots(block_tables[s], pool.block_size, context_len))
        attended = causal_attention(query[rows], keys, values, q_indices[rows], with_key_mass=with_mass)
        if with_mass:
            out[rows], mass[s, :, :context_len] = attended
        else:
            out[rows] = attended
    return out, mass
