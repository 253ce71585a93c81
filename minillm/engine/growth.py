"""How a running batch's KV grows and shrinks over the steps ahead: the peak it will need.

Each running sequence holds `tokens` now and is expected to decode `steps` more, one token a
step, then finish and give its blocks back. Summing every sequence's own peak (what each holds
at its end) overstates what the batch needs: they end at different steps, and a sequence that
has finished holds nothing while the others are still growing. What the pool must hold is the
batch's peak *over time*.

Between two finishes the batch only grows, so that peak is reached just before one of them.
Sort the sequences by steps left, longest first; just before the k-th finish (at step s_k) the
k longest are alive and hold

    U_k = sum over i <= k of ceil((tokens_i + s_k) / B)  <=  (T_k + k * (s_k + B - 1)) // B

blocks, T_k being the k longest's tokens now (the bound takes each sequence's last block as
full). The peak is max_k U_k: one sort per batch, then O(log n) per candidate, since a
candidate that will live s_c steps only adds to the finishes at or before s_c, which are a
suffix of that order, and its own (a prefix maximum, a suffix maximum and a bisect).
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate


class GrowthProfile:
    """The blocks a batch holds at each of its expected finishes, and its peak with one more."""

    def __init__(self, rows: list[tuple[int, int]], block_size: int):
        """`rows`: (tokens held now, steps left) for each running sequence."""
        rows = sorted(rows, key=lambda row: -row[1])  # longest to live first
        self.block_size = bsz = block_size
        self._steps = [-steps for _, steps in rows]  # ascending, for bisect
        self._tokens = list(accumulate((tokens for tokens, _ in rows), initial=0))  # T_0..T_n
        n = len(rows)
        blocks_at = [  # U_k for k = 1..n
            (self._tokens[k] + k * (rows[k - 1][1] + bsz - 1)) // bsz for k in range(1, n + 1)
        ]
        self._peak_before = list(accumulate(blocks_at, max, initial=0))  # max of U_1..U_k
        lifted = [  # U_k's numerator with one more sequence alive, before the candidate's own tokens
            self._tokens[k] + (k + 1) * (rows[k - 1][1] + bsz - 1) for k in range(1, n + 1)
        ]
        self._peak_after = list(accumulate(reversed(lifted), max))[::-1] + [0]  # max over k..n

    @property
    def peak(self) -> int:
        return self._peak_before[-1]

    def peak_with(self, tokens: int, steps: int, rows: int = 1) -> int:
        """The batch's peak if a sequence joins it now, holding `tokens` and living `steps` steps,
        growing `rows` tokens a step (its n samples or beams)."""
        bsz = self.block_size
        longer = bisect_left(self._steps, -steps)  # sequences that live longer than it: untouched
        alive = bisect_left(self._steps, -steps + 1)  # those alive at its own end
        grown = tokens + (rows - 1) * steps + (rows - 1) * (bsz - 1)  # its rows beyond the first
        joined_later = (self._peak_after[longer] + grown) // bsz if longer < len(self._steps) else 0
        own_end = (self._tokens[alive] + alive * (steps + bsz - 1) + tokens + rows * (steps + bsz - 1)) // bsz
        return max(self._peak_before[longer], joined_later, own_end)
