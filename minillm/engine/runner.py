"""The model runner: turns one step's schedule into one forward pass of the model.

The scheduled sequences' new tokens are laid end to end in one flat batch of N tokens, whatever
mix of prefill chunks and decode tokens it holds. For each token the runner knows its id, its
position (for RoPE) and its *slot* (where its k and v go, through its sequence's block table);
for each sequence, which slots hold its history. That is everything attention needs
(`attention/paged.py`); the model itself never sees a block.

Decode tokens (one query each) are attended together, and so are prefill chunks (many queries
each, ragged), by the run's backend: the torch references or the kernels (`attention/kernels.py`).
Both can report the attention each key received, which the runner hands back per sequence, for
the KV cache manager to add to H2O's scores (`computed`). A sequence's speculated tokens
(`speculative.py`) follow its last one; each of those rows is attended as a decode query of its
own, over the entries up to its own (the causal mask of a chunk, at the cost of a decode), and
its attention is kept per row, so that a rejected guess's can be left out of H2O's scores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minillm.attention.kernels import Backend
from minillm.attention.paged import DecodeBatch, PagedAttention, PrefillBatch
from minillm.engine.scheduler import ScheduledSequence
from minillm.memory import KVCacheManager
from minillm.model import Transformer


@dataclass
class Forward:
    """What a forward pass gives: the hidden states (N, hidden), each sequence's last row, and
    with H2O the attention each sequence's entries received, seq_id -> (mass (layers, kv_heads,
    longest), entries it covers) per query batch it took part in: one for a decode token or a
    chunk, one per row for a token and its guesses (only the rows whose guesses are kept count).
    `started`: when the pass began (`time.perf_counter()`); `seconds`: how long it took."""

    hidden: torch.Tensor
    last_rows: list[int]
    attention: dict[int, list[tuple[torch.Tensor, int]]]
    started: float
    seconds: float


class ModelRunner:
    def __init__(self, model: Transformer, kv_cache: KVCacheManager, backend: Backend):
        self.model, self.kv_cache = model, kv_cache
        self.backend = backend  # attends the step's decode tokens at once, and its prefill chunks at once
        self.pool = kv_cache.pool()  # the tensors attention writes and reads
        # with H2O, every layer's attention mass is kept; else none
        self.mass_layers = model.config.num_layers if kv_cache.capacity().keeps_attention_mass else 0

    def forward(self, scheduled: list[ScheduledSequence]) -> Forward:
        """One forward pass over every scheduled token, sequences laid end to end (a sequence's
        guesses after its last token)."""
        started = time.perf_counter()
        device = self.model.device
        token_ids, positions, write_slots, last_rows = [], [], [], []
        decode_rows, decode_tables, decode_lens, decoding = [], [], [], []
        chunks, chunk_tables, prefilling = [], [], []
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            first, end = seq.num_cached, seq.num_cached + n  # cache indices of the new tokens
            row = len(token_ids)
            token_ids += seq.token_ids[seq.num_computed : seq.num_computed + n - len(item.guesses)]
            token_ids += item.guesses
            positions += range(seq.num_computed, seq.num_computed + n)
            slots, table = self.kv_cache.append(seq.seq_id, first, end)
            write_slots += slots
            if n == 1 or item.guesses:  # one query (a decode token), or a token and its guesses: each
                for i in range(n):  # row a query of its own over the entries up to its own
                    decode_rows.append(row + i)
                    decode_tables.append(table)
                    decode_lens.append(first + i + 1)
                    decoding.append((seq.seq_id, first + i + 1))
            else:
                chunks.append((row, first, n))
                chunk_tables.append(table)
                prefilling.append((seq.seq_id, end))
            last_rows.append(row + n - 1)
        mass_layers, kv_heads = self.mass_layers, self.model.config.num_kv_heads
        decode = (
            DecodeBatch.of(decode_rows, decode_tables, decode_lens, device, mass_layers, kv_heads)
            if decode_rows
            else None
        )
        prefill = PrefillBatch.of(chunks, chunk_tables, device, mass_layers, kv_heads) if chunks else None
        slots = torch.tensor(write_slots, device=device)
        ctx = PagedAttention(self.pool, slots, decode, prefill, self.backend)
        ids, positions = torch.tensor(token_ids, device=device), torch.tensor(positions, device=device)
        hidden = self.model(ids, positions, ctx)
        attention: dict[int, list] = {}
        for batch, members in ((decode, decoding), (prefill, prefilling)):
            if batch is not None and batch.mass is not None:
                for i, (seq_id, end) in enumerate(members):
                    attention.setdefault(seq_id, []).append((batch.mass[:, i], end))
        return Forward(hidden, last_rows, attention, started, time.perf_counter() - started)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Next-token logits (len(rows), vocab) of the chosen rows of the hidden states."""
        return self.model.logits(hidden[torch.tensor(rows, device=hidden.device)])
