"""Speculative decoding from the prompt: guess the next tokens by n-gram lookup, check them all
in one forward pass, keep the longest agreeing prefix.

Decode at batch 1 reads every weight once per token, and a pass over k + 1 tokens reads them
once too: if the guesses are right, k + 1 tokens cost about one pass. Guesses need no draft model
when the text repeats itself, as summaries, quotes and code edits do: the last n tokens of the
sequence (prompt and output) are looked up earlier in it, and the tokens that followed them there
are the guess (prompt lookup, n-gram speculation in vLLM, llama.cpp and HF transformers).

Checking. The sequence's last sampled token and its k guesses go through the model as a small
chunk, causally masked, in the same batched pass as everyone else's tokens. Row i gives the
logits of the token after guess i - 1. Walking the rows, the sequence's own sampler draws each
row's token exactly as decoding one token at a time would; while the draw equals the guess, the
guess is kept and the next row is valid; at the first difference the draw is kept instead and the
walk stops; after k kept guesses the last row gives one more token for free. Greedy, the draw is
the argmax, so the output is exactly what decoding one token at a time gives.

Sampling, this is the standard rule of speculative sampling (Leviathan et al. 2023; Chen et al.
2023) for a guess that is one token for sure (q one-hot): a guess g is kept with probability
min(1, p(g) / q(g)) = p(g), and when it is not, the token comes from the residual max(0, p - q),
renormalized: p without g. Drawing x from p and keeping g iff x = g does exactly that (x = g has
probability p(g); given x != g, x is distributed as p without g). So every emitted token has the
non-speculative distribution, and more: the sampler makes one draw per emitted token, in order,
as it would without speculation, so a seeded request gives the very tokens it gives without it.
A custom sampler (teacher forcing) is called the same way, once per token, in order.

Rollback. A rejected guess has already written its K/V into the sequence's blocks; the KV cache
manager's `Rollback` (`memory/rollback.py`) cuts the sequence back before anything is registered
or read again: blocks past the kept tokens go back to the pool, and no prefix-cache entry ever
covers a rejected token.

When it pays. Every guess is an extra row in the pass, and a row costs time: little where the pass
is bound by reading the weights (batch 1), more as the batch grows and the pass turns to compute.
The engine fits what a decode step costs, seconds = fixed + per_row x rows, to its own steps
(`PassCost`); a kept guess saves its sequence a step (its row, and its share of the fixed cost
among the batch's sequences), a guess costs a row. So the i-th guess of a sequence is worth
making while acceptance^i x (per_row + fixed / batch) >= per_row, acceptance being the rate at
which that sequence's guesses were kept lately (`NgramProposer`). A sequence whose guesses keep
failing stops guessing, and its estimate drifts back towards the prior, so it tries again later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from minillm.engine.sequence import Sequence
    from minillm.memory import Capacity

PRIOR_ACCEPTANCE = 0.5  # a sequence's acceptance estimate before its first check
LAST_WEIGHT = 0.5  # the weight of the last check in a sequence's estimate
RECOVERY = 0.05  # each step it does not guess, the estimate moves this share back to the prior
COST_MEMORY = 0.98  # PassCost's decay per step: it remembers about the last 50 steps


class PassCost:
    """seconds = fixed + per_row x rows, fitted by least squares to the decode steps (no prompt
    chunk: the pass, its logits and the checks) seen lately, each weighing COST_MEMORY times
    less than the next."""

    def __init__(self):
        self._sums = [0.0] * 5  # weighted count, rows, seconds, rows^2, rows x seconds

    def record(self, rows: int, seconds: float) -> None:
        for i, value in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            self._sums[i] = COST_MEMORY * self._sums[i] + value

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds, or None before passes of two different sizes were seen."""
        count, rows, seconds, rows2, rows_seconds = self._sums
        spread = count * rows2 - rows * rows
        if count < 2 or spread <= 1e-6 * count * count:
            return None
        per_row = max(0.0, (count * rows_seconds - rows * seconds) / spread)
        return max(0.0, (seconds - per_row * rows) / count), per_row

    def guesses_worth(self, acceptance: float, batch: int, most: int) -> int:
        """How many guesses (up to `most`) pay for their rows, for a sequence whose guesses are kept
        at rate `acceptance`, among `batch` decoding sequences. Until the fit exists, all."""
        fit = self.fit()
        if fit is None:
            return most
        fixed, per_row = fit
        saved_per_kept = per_row + fixed / max(1, batch)
        count, chance = 0, acceptance
        while count < most and chance * saved_per_kept >= per_row:
            count, chance = count + 1, chance * acceptance
        return count


@dataclass
class _Index:
    """Where each n-gram of a sequence last ended, for every n asked: n-gram -> the index just
    past it (where its continuation starts), grown as tokens are appended; and how often its
    guesses were kept lately."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # continuation starts indexed so far
    acceptance: float = PRIOR_ACCEPTANCE


class NgramProposer:
    """Guesses from the sequence itself: the tokens that followed the latest earlier occurrence of
    its last n tokens, for the longest n in [min_n, max_n] that occurred (vLLM's knobs:
    num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n
        self.cost = PassCost()
        self._indexes: dict[int, _Index] = {}  # seq_id -> its n-gram index

    def propose(self, seq_id: int, token_ids: list[int], limit: int, batch: int = 1) -> list[int]:
        """At most `limit` guessed tokens to follow `token_ids` (and at most k, and as many as pay
        among `batch` decoding sequences), or none."""
        index = self._indexes.setdefault(seq_id, _Index())
        limit = self.cost.guesses_worth(index.acceptance, batch, min(self.num_tokens, limit))
        if limit <= 0:
            index.acceptance += RECOVERY * (PRIOR_ACCEPTANCE - index.acceptance)
            return []
        self._grow(index, token_ids)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = index.ends.get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start : start + limit]
        return []

    def _grow(self, index: _Index, token_ids: list[int]) -> None:
        """Index every n-gram that has a continuation: those ending before the last token."""
        for end in range(max(index.indexed, self.min_n), len(token_ids)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.ends[tuple(token_ids[end - n : end])] = end
        index.indexed = max(index.indexed, len(token_ids))

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """How the sequence's last guesses fared: `accepted` of `proposed` kept, in order, so
        accepted + 1 were tried if one failed (the rate a geometric run of keeps is estimated by)."""
        tried = accepted + (accepted < proposed)
        index = self._indexes[seq_id]
        index.acceptance += LAST_WEIGHT * (accepted / tried - index.acceptance)

    def forget(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)

    def __len__(self) -> int:
        """Sequences it keeps an index for (the soak test checks none outlives its request)."""
        return len(self._indexes)


def check_guesses(
    guesses: list[int], logits: torch.Tensor, sample: Callable[[torch.Tensor], int]
) -> list[int]:
    """The tokens to append: the longest prefix of `guesses` the model's draws agree with, then
    the draw that differed (or, all kept, one more). logits (len(guesses) + 1, vocab): row i
    scores the token after guess i - 1; `sample` draws a token from a row (the sequence's sampler)."""
    tokens = []
    for row, guess in zip(logits, [*guesses, None]):
        tokens.append(sample(row))
        if tokens[-1] != guess:
            break
    return tokens


def guesses_that_fit(
    proposer: NgramProposer, capacity: Capacity, free_blocks: int, seq: Sequence, budget: int, batch: int
) -> list[int]:
    """The scheduler's half of guessing: the guesses to check after a decoding sequence's last
    token this step, among `batch` running ones, or [] if the `free_blocks` cannot hold them
    (guesses never make anyone leave: a block stays free for each running sequence to grow).
    They stop short of its length limit, the step's token `budget`, and what the KV cache manager
    can roll back (`Capacity.room_to_guess`). Beams choose among each other's scores, not one
    draw at a time: they do not guess."""
    if seq.params.beam_width > 1:
        return []
    most = min(
        budget - 1,
        seq.max_len - seq.num_tokens - 1,
        capacity.room_to_guess(seq.num_cached, len(seq.prompt_ids), seq.max_len),
    )
    guesses = proposer.propose(seq.seq_id, seq.token_ids, most, batch) if most > 0 else []
    if not guesses:
        return []
    blocks = capacity.blocks_for
    extra = blocks(seq.num_cached + 1 + len(guesses)) - blocks(seq.num_cached + 1)
    return guesses if free_blocks - extra >= batch else []
