"""Beam search: keep the `beam_width` most likely continuations, sharing their common history.

Every step, each live beam proposes its next tokens; the `beam_width` best (beam, token) pairs by
total log-probability survive. A beam chosen twice is forked — the two children share all the
parent's blocks and copy only the last one when they write into it — and a beam chosen by nobody
is dropped and releases its blocks. A beam that emits EOS or reaches max_tokens is finished; the
search ends when no beam is live, and the results are the best finished beams.

`select` is shared by the engine and by `reference_beam_search`, which recomputes every beam
from scratch with the naive decoder: the two must agree beam for beam.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from minillm.decoding.naive import sequence_logits
from minillm.engine.sequence import Change, Finish, Fork, Sequence, Status


def select(scores: list[float], logprobs: torch.Tensor, width: int) -> list[tuple[int, int, float]]:
    """scores: total log-probability of each live beam; logprobs: (beams, vocab) for its next
    token. Returns the `width` best (beam index, token, new score), best first."""
    totals = torch.tensor(scores, dtype=torch.float64)[:, None] + logprobs.double()  # (beams, vocab)
    values, flat = totals.flatten().topk(width)
    vocab = logprobs.shape[1]
    return [(int(i) // vocab, int(i) % vocab, float(v)) for v, i in zip(values, flat)]


@dataclass
class BeamGroup:
    """The beams of one request: live ones (with their scores) and finished ones."""

    width: int
    live: list[tuple[Sequence, float]]
    finished: list[tuple[Sequence, float]] = field(default_factory=list)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> next-token log-probs

    def offer(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """A beam's next-token logits (vocab,); True once every live beam has offered its own.

        Logits that no longer fit their beam are ignored. In one engine step several beams can
        finish computing; when the first of them completes the group, the group advances at once,
        so a later one in the same step may be pruned by then, or already extended by a token
        (its logits predict the token it now has: it must compute that token and offer again).
        A beam preempted after offering keeps its scores: its tokens have not changed."""
        if seq.status is Status.FINISHED or all(beam is not seq for beam, _ in self.live):
            return False  # pruned, or finished: no longer part of the search
        if seq.num_computed != seq.num_tokens:
            return False
        self.pending[seq.seq_id] = torch.log_softmax(logits, dim=-1)
        return all(beam.seq_id in self.pending for beam, _ in self.live)

    def advance(
        self, seq_ids: Iterator[int], eos_token_ids: frozenset[int]
    ) -> tuple[list[Sequence], list[Change]]:
        """One step: keep the best `width` (beam, token) pairs; fork beams chosen more than once
        (ids from `seq_ids`), finish beams chosen by nobody (their blocks go back). Returns the
        request's sequences (the live beams, or once none is left, the best finished ones) and the
        forks and finishes, in the order the scheduler must carry them out: the pruned leave
        before the forks take seats."""
        live = self.live
        choices = select(
            [score for _, score in live], torch.stack([self.pending[s.seq_id] for s, _ in live]), self.width
        )
        self.pending.clear()
        chosen = {beam for beam, _, _ in choices}
        changes: list[Change] = [
            Finish(seq, "pruned") for index, (seq, _) in enumerate(live) if index not in chosen
        ]
        claimed, assignments = set(), []
        for beam, token, score in choices:  # fork before any beam appends, so forks copy the parent as it was
            parent = live[beam][0]
            seq = parent if beam not in claimed else parent.fork(next(seq_ids), 0)
            if seq is not parent:
                changes.append(Fork(parent, seq))
            claimed.add(beam)
            assignments.append((seq, token, score))
        self.live = []
        for seq, token, score in assignments:
            reason = seq.append(token, eos_token_ids)
            if reason:
                changes.append(Finish(seq, reason))
                self.finished.append((seq, score))
            else:
                self.live.append((seq, score))
        return [seq for seq, _ in self.live] or self.ranked(), changes

    def ranked(self) -> list[Sequence]:
        return [seq for seq, _ in sorted(self.finished, key=lambda beam: -beam[1])[: self.width]]


def reference_beam_search(
    model, prompt_ids: list[int], width: int, max_tokens: int, eos_token_ids: frozenset[int]
) -> list[list[int]]:
    """The same search, recomputing every beam's whole sequence every step (no cache at all)."""
    live, finished = [([], 0.0)], []
    while live:
        logprobs = torch.stack(
            [torch.log_softmax(sequence_logits(model, prompt_ids + out)[-1], -1) for out, _ in live]
        )
        survivors = []
        for beam, token, score in select([score for _, score in live], logprobs, width):
            out = live[beam][0] + [token]
            done = token in eos_token_ids or len(out) >= max_tokens
            (finished if done else survivors).append((out, score))
        live = survivors
    return [out for out, _ in sorted(finished, key=lambda beam: -beam[1])[:width]]
