"""How long will this answer be? Output lengths learned online, from requests that finished.

Memory-aware admission prices a request by the KV it will hold over its life (`memory_aware.py`),
and that life lasts as long as its answer. No request says how long its answer will be, but its
*shape* does, in real traffic as in `bench scheduling`'s: a client that wants an essay declares
room for one, a conversation's tenth turn is not a one-line question, a document to summarize is
long and its summary short. Ranking requests by a length learned from their shape is what
"Efficient LLM Scheduling by Learning to Rank" (Fu et al., 2024) showed pays: shortest predicted
job first, on a learned length, not an exact one.

A request's shape, everything known when it arrives (nothing of what its text means):
    the max_tokens it declares (in doublings), the messages its prompt closes (end-of-turn
    tokens: 0 for raw text, 2 for a system prompt and a user turn, 2k - 1 for a chat's k-th
    turn), and its prompt's length (in doublings).
The share of its prompt the prefix cache holds is left out: it describes the cache's state, not
the request (the same request arrives cached or not, by the timing of others), and the messages
it closes already tell a conversation's later turns and system-prompted requests apart.

The prediction starts from the mean output length of every finished request among the latest
HISTORY (a bounded window: memory stays flat however long a server runs, and traffic that changes
is followed), and goes down the shapes, coarse to fine: the requests declaring the same max_tokens,
then with the same messages too, then with a prompt as long too. At each, the shape's own mean is
pulled toward the estimate so far as if PRIOR_PEERS more requests had had it (shrinkage, as in
empirical Bayes): a shape seen once moves the estimate a little, one seen often decides it. A run
starts empty, and rare kinds are seen rarely (10 documents in 150 requests): waiting for a fixed
number of peers before trusting a shape left them at every request's mean for most of a run. With
nothing learned at all the prediction is the request's max_tokens. A server needs no offline step.

For a request that has already generated g tokens the prediction is conditioned on that: only
its peers that ran longer than g count, at every level. The first to finish are the short ones,
and their mean would promise a long-running request almost no more growth; one that has outlived
every peer is expected to run to its max_tokens.

`MeanOfFinished` is the same predictor with one shape for every request: what admission used
before it learned shapes, kept as `bench scheduling`'s row for what the shapes add.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from itertools import accumulate

from minillm.engine.sequence import Sequence

HISTORY = 1024  # finished requests learned from (the latest)
PRIOR_PEERS = 4  # how many peers' weight a coarser shape's estimate has in a finer shape's
SHAPES_KEPT = 8192  # requests whose shape is remembered (counting a prompt's messages reads it all)


class _Lengths:
    """The output lengths of one shape's finished requests: sorted, with prefix sums, so how many
    ran longer than g, and their sum, are a bisect away."""

    def __init__(self):
        self.sorted: list[int] = []
        self._sums: list[int] = [0]  # _sums[i]: the sum of the i shortest

    def add(self, length: int) -> None:
        insort(self.sorted, length)
        self._sums = list(accumulate(self.sorted, initial=0))  # once per finish, not per lookup

    def remove(self, length: int) -> None:
        del self.sorted[bisect_left(self.sorted, length)]
        self._sums = list(accumulate(self.sorted, initial=0))

    def longer_than(self, generated: int) -> tuple[int, int]:
        """(how many ran longer than `generated`, the sum of their lengths)."""
        shorter = bisect_right(self.sorted, generated)
        return len(self.sorted) - shorter, self._sums[-1] - self._sums[shorter]


class LearnedLengths:
    """Output lengths by request shape, learned from the latest HISTORY finished requests."""

    def __init__(self, eos_token_ids: frozenset[int]):
        """`eos_token_ids`: the tokens that close a chat message (the checkpoint's end-of-sequence
        tokens: Llama 3's `<|eot_id|>` is one of three)."""
        self.eos_token_ids = eos_token_ids
        self._by_shape: dict[tuple, _Lengths] = {}  # a shape at every level of detail -> its lengths
        self._window: deque[tuple[tuple, int]] = deque()  # (finest shape, length), oldest first
        self._shapes: dict[int, list[tuple]] = {}  # seq_id -> its shapes, once looked at

    def shapes(self, seq: Sequence) -> list[tuple]:
        """The request's shape, finest first, then coarser ones down to (): every request's."""
        if seq.seq_id not in self._shapes:
            if len(self._shapes) >= SHAPES_KEPT:  # bounded: forgotten ones are simply counted again
                self._shapes.clear()
            self._shapes[seq.seq_id] = self._shapes_of(seq)
        return self._shapes[seq.seq_id]

    def _shapes_of(self, seq: Sequence) -> list[tuple]:
        declared = (seq.max_len - len(seq.prompt_ids)).bit_length()
        messages = min(sum(token in self.eos_token_ids for token in seq.prompt_ids), 9)
        prompt = len(seq.prompt_ids).bit_length()
        return [(declared, messages, prompt), (declared, messages), (declared,), ()]

    def expected_output(self, seq: Sequence) -> int:
        """Output tokens it is expected to generate in all, given those it has generated so far:
        within [generated + 1, its max_tokens]. Coarsest shape first, each finer one's mean pulled
        toward the coarser estimate by PRIOR_PEERS imagined peers (shrinkage: a shape seen once
        moves the estimate a little, one seen often decides it)."""
        most = seq.max_len - len(seq.prompt_ids)  # max_tokens, or what the context (or pool) leaves
        generated = len(seq.output_ids)
        estimate = float(most)  # with nothing learned, or once it has outlived every finished request
        for shape in reversed(self.shapes(seq)):
            peers = self._by_shape.get(shape)
            count, total = peers.longer_than(generated) if peers else (0, 0)
            if count:
                weight = PRIOR_PEERS if shape else 0  # every request's mean stands on its own
                estimate = (total + weight * estimate) / (count + weight)
        return max(generated + 1, min(most, round(estimate)))

    def finished(self, seq: Sequence) -> None:
        """Learn from a request that ran to its end (EOS or its length limit)."""
        shapes, length = self.shapes(seq), len(seq.output_ids)
        for shape in shapes:
            self._by_shape.setdefault(shape, _Lengths()).add(length)
        self._window.append((shapes[0], length))
        if len(self._window) > HISTORY:  # forget the oldest, at every level of detail
            finest, old = self._window.popleft()
            for depth in range(len(finest), -1, -1):
                shape = finest[:depth]
                self._by_shape[shape].remove(old)
                if not self._by_shape[shape].sorted:
                    del self._by_shape[shape]

    def learned(self) -> int:
        """Finished requests it learns from now (at most HISTORY)."""
        return len(self._window)

    def stored(self) -> int:
        """Lengths it holds, every shape's at every level of detail (at most 4 x HISTORY)."""
        return sum(len(lengths.sorted) for lengths in self._by_shape.values())


class MeanOfFinished(LearnedLengths):
    """Every request the same shape: the mean of the finished that ran longer than it has."""

    def _shapes_of(self, seq: Sequence) -> list[tuple]:
        return [()]
