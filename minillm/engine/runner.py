"""The model runner: turns one step's schedule into one forward pass of the model.

The scheduled sequences' new tokens are laid end to end in one flat batch of N tokens, whatever
mix of prefill chunks and decode tokens it holds. For each token the runner knows its id, its
position (for RoPE) and its *slot* (where its k and v go, through its sequence's block table);
for each sequence, which slots hold its history. That is everything attention needs
(`attention/paged.py`); the model itself never sees a block.

Decode tokens (one query each) are attended together, by the batched torch reference or a
kernel; prefill chunks sequence by sequence in torch. Both can report the attention each key
received, which the runner adds to the sequence's H2O accumulator.
"""

from __future__ import annotations

from typing import Callable

import torch

from minillm.attention.paged import DecodeBatch, PagedAttention, SequenceSlice, context_slots
from minillm.engine.scheduler import ScheduledSequence
from minillm.memory import BlockManager, grow_attention_mass
from minillm.model import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, pool, block_manager: BlockManager, decode_attention: Callable,
                 keeps_attention_mass: bool):
        self.model, self.pool, self.block_manager = model, pool, block_manager
        self.decode_attention = decode_attention  # the torch reference or a kernel: all decode tokens at once
        self.keeps_attention_mass = keeps_attention_mass  # H2O eviction scores keys by the attention they get

    def forward(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[int]]:
        """One forward pass over every scheduled token, sequences laid end to end.
        Returns the hidden states (N, hidden) and each sequence's last row."""
        device, manager = self.model.device, self.block_manager
        token_ids, positions, write_slots, sequences = [], [], [], []
        decode_rows, decode_tables, decode_lens, decoding, last_rows = [], [], [], [], []
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            first, end = seq.num_cached, seq.num_cached + n  # cache indices of the new tokens
            row = len(token_ids)
            token_ids += seq.token_ids[seq.num_computed:seq.num_computed + n]
            positions += range(seq.num_computed, seq.num_computed + n)
            manager.check_writable(seq.seq_id, first, end)
            write_slots += manager.slots(seq.seq_id, first, end)
            table = manager.table(seq.seq_id)
            if n == 1:  # one query: a decode token
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
                decoding.append(seq)
            else:
                sequences.append(SequenceSlice(row, row + n, torch.arange(first, end, device=device),
                                               context_slots(table, manager.block_size, end, device),
                                               self.attention_mass(seq, end)))
            last_rows.append(row + n - 1)
        config = self.model.config
        decode = DecodeBatch.of(decode_rows, decode_tables, decode_lens, device,
                                config.num_layers if self.keeps_attention_mass else 0,
                                config.num_kv_heads) if decode_rows else None
        ctx = PagedAttention(self.pool, torch.tensor(write_slots, device=device), sequences, decode,
                             self.decode_attention)
        hidden = self.model(torch.tensor(token_ids, device=device), torch.tensor(positions, device=device), ctx)
        if decode is not None and decode.mass is not None:
            for i, (seq, end) in enumerate(zip(decoding, decode_lens)):
                self.attention_mass(seq, end)[..., :end] += decode.mass[:, i, :, :end]
        return hidden, last_rows

    def attention_mass(self, seq, num_entries: int) -> torch.Tensor | None:
        """H2O: the sequence's accumulator, grown to cover its entries; attention adds to it."""
        if not self.keeps_attention_mass:
            return None
        config = self.model.config
        seq.attention_mass = grow_attention_mass(seq.attention_mass, num_entries, config.num_layers,
                                                 config.num_kv_heads, self.model.device)
        return seq.attention_mass

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Next-token logits (len(rows), vocab) of the chosen rows of the hidden states."""
        return self.model.logits(hidden[torch.tensor(rows, device=hidden.device)])
