"""Causal attention over a sequence's history, in plain torch math.

Every KV layout in minillm (no cache, one contiguous cache, paged blocks later) ends by handing
this function the keys and values of one sequence in position order. It is the readable truth
the faster paths are checked against.

Grouped-query attention (GQA): `num_heads` query heads share `num_kv_heads` key/value heads, in
groups of `group = num_heads // num_kv_heads` (SmolLM2: 9 query heads, 3 KV heads, groups of 3).
That sharing is why SmolLM2's KV cache is 3x smaller than its query width suggests. We compute it
without copying K and V: fold each group's query heads into the query axis, so one KV head
answers `group x Tq` query rows in a single matmul.
"""

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                     with_key_mass: bool = False):
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
    scores = torch.bmm(q_rows, k.permute(1, 2, 0)) * head_dim ** -0.5  # (kv_heads, group*Tq, Tk)
    if n_queries > 1:  # a single decode token is the newest position: it sees every key
        key_positions = torch.arange(k.shape[0], device=k.device)
        hidden = key_positions[None, :] > q_positions[:, None]  # (Tq, Tk)
        scores = scores.masked_fill(hidden.repeat(group, 1), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1)  # fp32 softmax, as HF does, even for bf16
    out = torch.bmm(probs.to(v.dtype), v.transpose(0, 1))  # (kv_heads, group*Tq, head_dim)
    out = out.view(num_heads, n_queries, head_dim).transpose(0, 1)
    return (out, probs.sum(dim=1)) if with_key_mass else out


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention through block tables: the contract the C++ and CUDA kernels implement.

    query (S, num_heads, head_dim): the newest token of S sequences;
    key_cache, value_cache (num_slots, num_kv_heads, head_dim), or int8 with
    k_scales, v_scales (num_slots, num_kv_heads): value = int8 x scale;
    block_tables (S, max_blocks) int32; context_lens (S,) int32. Returns (S, num_heads, head_dim).
    """
    out = torch.empty_like(query)
    for seq in range(query.shape[0]):
        positions = torch.arange(int(context_lens[seq]), device=query.device)
        slots = block_tables[seq, positions // block_size].long() * block_size + positions % block_size
        k, v = key_cache[slots], value_cache[slots]  # (context_len, num_kv_heads, head_dim)
        if k_scales is not None:
            k = (k.float() * k_scales[slots][..., None]).to(query.dtype)
            v = (v.float() * v_scales[slots][..., None]).to(query.dtype)
        out[seq] = causal_attention(query[seq:seq + 1], k, v, positions[-1:])[0]
    return out
