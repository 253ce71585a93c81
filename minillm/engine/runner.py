"""The model runner: turns one step's schedule into one forward pass of the model.

The scheduled sequences' new tokens are laid end to end in one flat batch of N tokens, whatever
mix of prefill chunks and decode tokens it holds. For each token the runner knows its id, its
position (for RoPE) and its *slot* (where its k and v go, through its sequence's block table);
for each sequence, which slots hold its history. That is everything attention needs
(`attention/paged.py`); the model itself never sees a block.

Decode tokens (one query each) are attended together, by the batched torch reference or a
kernel; prefill chunks sequence by sequence in torch. Both can report the attention each key
received, which the runner adds to the sequence's H2O accumulator (the KV cache manager's).
"""

from __future__ import annotations

from typing import Callable

import torch

from minillm.attention.paged import DecodeBatch, PagedAttention, SequenceSlice, context_slots
from minillm.engine.scheduler import ScheduledSequence
from minillm.memory import KVCacheManager
from minillm.model import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, kv_cache: KVCacheManager, decode_attention: Callable):
        self.model, self.kv_cache = model, kv_cache
        self.decode_attention = decode_attention  # the torch reference or a kernel: all decode tokens at once

    def forward(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[int]]:
        """One forward pass over every scheduled token, sequences laid end to end.
        Returns the hidden states (N, hidden) and each sequence's last row."""
        device, kv_cache = self.model.device, self.kv_cache
        token_ids, positions, write_slots, sequences = [], [], [], []
        decode_rows, decode_tables, decode_lens, decoding, last_rows = [], [], [], [], []
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            first, end = seq.num_cached, seq.num_cached + n  # cache indices of the new tokens
            row = len(token_ids)
            token_ids += seq.token_ids[seq.num_computed : seq.num_computed + n]
            positions += range(seq.num_computed, seq.num_computed + n)
            write_slots += kv_cache.slots(seq.seq_id, first, end)
            table = kv_cache.table(seq.seq_id)
            if n == 1:  # one query: a decode token
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
                decoding.append(seq)
            else:
                queries = torch.arange(first, end, device=device)
                context = context_slots(table, kv_cache.block_size, end, device)
                mass = kv_cache.attention_mass(seq.seq_id, end)
                sequences.append(SequenceSlice(row, row + n, queries, context, mass))
            last_rows.append(row + n - 1)
        decode = self._decode_batch(decode_rows, decode_tables, decode_lens) if decode_rows else None
        slots = torch.tensor(write_slots, device=device)
        ctx = PagedAttention(kv_cache.pool, slots, sequences, decode, self.decode_attention)
        ids, positions = torch.tensor(token_ids, device=device), torch.tensor(positions, device=device)
        hidden = self.model(ids, positions, ctx)
        if decode is not None and decode.mass is not None:
            for i, (seq, end) in enumerate(zip(decoding, decode_lens)):
                kv_cache.attention_mass(seq.seq_id, end)[..., :end] += decode.mass[:, i, :, :end]
        return hidden, last_rows

    def _decode_batch(self, rows: list[int], tables: list[list[int]], lens: list[int]) -> DecodeBatch:
        """The step's decode tokens, attended together; with H2O, room for the attention they pay."""
        config = self.model.config
        mass_layers = config.num_layers if self.kv_cache.keeps_attention_mass else 0
        return DecodeBatch.of(rows, tables, lens, self.model.device, mass_layers, config.num_kv_heads)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Next-token logits (len(rows), vocab) of the chosen rows of the hidden states."""
        return self.model.logits(hidden[torch.tensor(rows, device=hidden.device)])
