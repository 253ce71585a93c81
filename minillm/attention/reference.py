"""Causal attention over a sequence's history, in plain torch.

Every KV layout in minillm (no cache, one contiguous cache, paged blocks later) ends by handing
this function the keys and values of one sequence in position order. Grouped-query attention
(GQA) lets `num_heads` query heads share `num_kv_heads` key/value heads: that sharing is what
makes the KV cache of SmolLM2 three times smaller than its query width suggests.
"""

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     q_positions: torch.Tensor) -> torch.Tensor:
    """q: (Tq, num_heads, head_dim) at positions `q_positions` (Tq,);
    k, v: (Tk, num_kv_heads, head_dim) for positions 0..Tk-1. Returns (Tq, num_heads, head_dim).

    Query i sees key j iff j <= q_positions[i]: the causal mask, in absolute positions, so a
    prefill chunk that starts mid-sequence is masked correctly too.
    """
    key_positions = torch.arange(k.shape[0], device=k.device)
    visible = key_positions[None, :] <= q_positions[:, None]  # (Tq, Tk)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # (heads, T, head_dim)
        attn_mask=visible, enable_gqa=True,
    )  # (num_heads, Tq, head_dim)
    return out.transpose(0, 1)
