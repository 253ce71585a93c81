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
manager cuts the sequence back (`KVCacheManager.truncate`) before anything is registered or read
again: blocks past the kept tokens go back to the pool, and no prefix-cache entry ever covers a
rejected token.

When it pays. Every guess is an extra row in the pass. Where the pass is bound by reading the
weights, rows are nearly free; but a sequence whose guesses keep failing only pays for them, so
`NgramProposer` stops guessing for a sequence whose recent guesses were mostly wrong, and tries
again later (`Backoff`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

# A sequence whose guesses were kept less often than this, over its recent guesses, stops
# guessing for a while (tuned on Alice's passages, `minillm bench speculative`).
MIN_ACCEPTANCE = 0.3
RECENT = 4  # guesses an acceptance rate is judged over
MAX_PAUSE = 16  # steps a sequence rests at most before it guesses again


@dataclass
class Backoff:
    """A sequence's recent guesses: how many were proposed and kept, and how long it rests."""

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0  # guesses since the last judgment
    pause: int = 0  # steps left without guessing
    next_pause: int = 1  # the rest after the next bad judgment (doubles up to MAX_PAUSE)

    def may_guess(self) -> bool:
        if self.pause:
            self.pause -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.rounds += 1
        if self.rounds < RECENT:
            return
        if self.accepted < MIN_ACCEPTANCE * self.proposed:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, MAX_PAUSE)
        else:
            self.next_pause = 1
        self.proposed = self.accepted = self.rounds = 0


@dataclass
class _Index:
    """Where each n-gram of a sequence last ended, for every n asked: n-gram -> the index just
    past it (where its continuation starts), grown as tokens are appended."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # continuation starts indexed so far
    backoff: Backoff = field(default_factory=Backoff)


class NgramProposer:
    """Guesses from the sequence itself: the tokens that followed the latest earlier occurrence of
    its last n tokens, for the longest n in [min_n, max_n] that occurred (vLLM's knobs:
    num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n
        self._indexes: dict[int, _Index] = {}  # seq_id -> its n-gram index

    def propose(self, seq_id: int, token_ids: list[int], limit: int) -> list[int]:
        """At most min(k, limit) guessed tokens to follow `token_ids`, or none."""
        index = self._indexes.setdefault(seq_id, _Index())
        if limit <= 0 or not index.backoff.may_guess():
            return []
        self._grow(index, token_ids)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = index.ends.get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start : start + min(self.num_tokens, limit)]
        return []

    def _grow(self, index: _Index, token_ids: list[int]) -> None:
        """Index every n-gram that has a continuation: those ending before the last token."""
        for end in range(max(index.indexed, self.min_n), len(token_ids)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.ends[tuple(token_ids[end - n : end])] = end
        index.indexed = max(index.indexed, len(token_ids))

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """How the sequence's last guesses fared: it guesses less when they keep failing."""
        self._indexes[seq_id].backoff.record(proposed, accepted)

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
