"""The naive decoder: no cache at all. The oracle every other path is diffed against.

For each new token it runs the model over the *whole* sequence again, so step t costs O(t) in
matmuls and O(t^2) in attention; generating n tokens costs O(n^2) and O(n^3). It is slow on
purpose and simple on purpose: there is no state that could be stale, so what it produces is
what the model means.
"""

from __future__ import annotations

import torch

from minillm.attention.reference import causal_attention
from minillm.model import Transformer


class NoCache:
    """An attention context that keeps nothing: this step's k and v are the whole history."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions  # (T,) = 0..T-1

    def attend(self, layer_idx, q, k, v):
        return causal_attention(q, k, v, self.positions)


@torch.inference_mode()
def sequence_logits(model: Transformer, token_ids: list[int]) -> torch.Tensor:
    """Logits after every token of `token_ids`: (T, vocab_size)."""
    tokens = torch.tensor(token_ids, device=model.device)
    positions = torch.arange(len(token_ids), device=model.device)
    return model.logits(model(tokens, positions, NoCache(positions)))


class NaiveDecoder:
    def __init__(self, model: Transformer, max_len: int):
        self.model = model
        self.token_ids: list[int] = []

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        self.token_ids = list(prompt_ids)
        return sequence_logits(self.model, self.token_ids)[-1]

    def step(self, token_id: int) -> torch.Tensor:
        self.token_ids.append(token_id)
        return sequence_logits(self.model, self.token_ids)[-1]  # recompute everything, keep the last

    @property
    def kv_bytes(self) -> int:
        return 0
