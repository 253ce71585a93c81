"""The output lengths `bench scheduling` gives memory-aware admission, and how well they rank.

Three predictors, one row of the bench each:
  learned    `LearnedLengths`: by the request's shape, from the requests finished so far (the
             engine's own, what `--admission memory` runs with);
  mean       `MeanOfFinished`: one shape for every request (what admission used before it
             learned shapes);
  oracle     the trace's own lengths (the script): the ceiling, what a perfect predictor buys.

Each run records the learned prediction made when a request is first ranked (at its arrival,
before anything of its answer is known). Spearman's rank correlation of those with the true lengths
says how well it orders requests, which is all shortest-work-first needs; the *kind ceiling* is
the same correlation for a predictor that knows each request's kind and nothing else (the kind's
mean length in the trace), the best any shape can give on this traffic (`trace.py`). Warm-up:
the correlation over the first third of the arrivals, and over the rest.
"""

from __future__ import annotations

import statistics

from minillm.engine.output_length import LearnedLengths, MeanOfFinished
from minillm.engine.sequence import Sequence

PREDICTORS = ("learned", "mean", "oracle")


class RecordedLengths(LearnedLengths):
    """The learned predictor, keeping its first prediction for every request."""

    def __init__(self, eos_token_ids: frozenset[int]):
        super().__init__(eos_token_ids)
        self.first: dict[str, int] = {}  # request_id -> its length predicted when first ranked

    def expected_output(self, seq: Sequence) -> int:
        expected = super().expected_output(seq)
        if not seq.output_ids:
            self.first.setdefault(seq.request_id, expected)
        return expected


class OracleLengths:
    """The trace's own lengths: request_id -> output tokens (the script; only the ceiling reads it)."""

    def __init__(self, lengths: dict[str, int]):
        self.lengths = lengths

    def expected_output(self, seq: Sequence) -> int:
        return max(len(seq.output_ids) + 1, self.lengths[seq.request_id])

    def finished(self, seq: Sequence) -> None:
        pass


def predictor_for(name: str, eos_token_ids: frozenset[int], lengths: dict[str, int]):
    """A fresh predictor of kind `name` for one run (every run starts knowing nothing)."""
    if name == "oracle":
        return OracleLengths(lengths)
    return RecordedLengths(eos_token_ids) if name == "learned" else MeanOfFinished(eos_token_ids)


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            result[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(predicted: list[float], actual: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on the ranks); None if either side is constant."""
    if len(predicted) < 2:
        return None
    x, y = ranks(predicted), ranks(actual)
    mean_x, mean_y = statistics.fmean(x), statistics.fmean(y)
    covariance = sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y))
    spread = (sum((a - mean_x) ** 2 for a in x) * sum((b - mean_y) ** 2 for b in y)) ** 0.5
    return covariance / spread if spread else None


def rank_quality(first: dict[str, int], trace) -> dict:
    """Spearman of the first predictions against the true lengths: all of them, the first third of
    the arrivals (warming up) and the rest; and the kind ceiling on the same requests."""
    known = [int(request_id) for request_id in first]  # in the order they were first ranked
    third = len(known) // 3

    def correlation(indices) -> float | None:
        return spearman([first[str(i)] for i in indices], [trace[i].output_len for i in indices])

    by_kind: dict[str, list[int]] = {}
    for request in trace:
        by_kind.setdefault(request.kind, []).append(request.output_len)
    kind_mean = {kind: statistics.fmean(lengths) for kind, lengths in by_kind.items()}
    return {
        "spearman": correlation(known),
        "spearman_first_third": correlation(known[:third]),
        "spearman_rest": correlation(known[third:]),
        "kind_ceiling": spearman(
            [kind_mean[trace[i].kind] for i in known], [trace[i].output_len for i in known]
        ),
        "predicted": len(known),
    }
