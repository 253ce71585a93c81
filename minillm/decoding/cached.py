"""The cached decoder: one contiguous KV cache per sequence.

Keys and values of past tokens never change, so we keep them: `k_cache[layer, position]`.
Prefill writes the prompt's k, v in one pass; each decode step then computes q, k, v for one
new token only and attends over the cache. A step costs O(1) in matmuls and O(t) in attention
instead of recomputing the sequence. The price is memory — 2 × layers × kv_heads × head_dim ×
bytes per token — reserved here for the request's whole length up front. That reservation is
the waste that paging (minillm.memory) removes.
"""

from __future__ import annotations

import torch

from minillm.attention.reference import causal_attention
from minillm.model import Transformer


class ContiguousKVCache:
    def __init__(self, model: Transformer, max_len: int):
        cfg = model.config
        # (layers, max_len, kv_heads, head_dim)
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v_cache = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.start = self.end = 0  # this step writes positions start..end-1
        self.positions: torch.Tensor | None = None  # (end - start,) the same, as a tensor

    def begin_step(self, start: int, end: int, device) -> torch.Tensor:
        """Set this step's positions once, as ints too: reading them back from the tensor in each
        of the 30 layers would cost a device sync per layer on a GPU."""
        self.start, self.end = start, end
        self.positions = torch.arange(start, end, device=device)
        return self.positions

    def attend(self, layer_idx, q, k, v):
        start, end = self.start, self.end
        self.k_cache[layer_idx, start:end] = k  # (N, kv_heads, head_dim)
        self.v_cache[layer_idx, start:end] = v
        return causal_attention(
            q, self.k_cache[layer_idx, :end], self.v_cache[layer_idx, :end], self.positions
        )

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes


class CachedDecoder:
    def __init__(self, model: Transformer, max_len: int):
        self.model = model
        self.cache = ContiguousKVCache(model, max_len)
        self.length = 0  # tokens whose k, v are in the cache

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` to the sequence; return logits after its last token (vocab_size,)."""
        device = self.model.device
        positions = self.cache.begin_step(self.length, self.length + len(token_ids), device)
        hidden = self.model(torch.tensor(token_ids, device=device), positions, self.cache)
        self.length += len(token_ids)
        return self.model.logits(hidden[-1:])[0]

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        return self.forward(prompt_ids)

    def step(self, token_id: int) -> torch.Tensor:
        return self.forward([token_id])

    @property
    def kv_bytes(self) -> int:
        return self.cache.nbytes
