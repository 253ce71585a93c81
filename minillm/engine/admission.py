"""Which waiting request joins the batch next (by arrival, cached prefix or reservation), which
never can, and what every ranking policy shares: a window and a bound on waiting.

Max-length reservation (`admission="reserve"`) is the baseline before paging (Orca, FasterTransformer):
a request is admitted only when its whole possible length, prompt plus max_tokens, is free for
it; a contiguous allocator must reserve that much up front. Here it is played on the paged pool
(held blocks plus reserved ones), which spares it the external fragmentation a real contiguous
arena adds (`arena.py`): a baseline no worse than the real one.

First come first served (`admission="fcfs"`, vLLM's default) admits the head of the queue while
blocks, seats and the step's token budget last, and nobody overtakes it. Fair, and blind to
memory: one long document at the head holds every short question behind it until its blocks are
free, and requests are admitted as long as one block is free, so the batch outgrows the pool
and preempts as it decodes. When blocks run out, the newest running sequence leaves.

Longest prefix first (`admission="lpm"`, SGLang's cache-aware order) admits first the request
whose prompt the prefix cache holds most of: its prefill is mostly done already, and served now
its prefix is still cached (served later, the cache may have let it go). It holds the queue as
first come first served does; ties keep arrival order.

Memory-aware admission (`admission="memory"`) prices each request by what its whole life will
cost the memory system, and prefers those that can still meet their TTFT target: `memory_aware.py`.

No starvation (every policy but fcfs and reserve, which never overtake): a request that has waited
MAX_WAIT_STEPS engine steps, or was preempted, is *due*, and due requests go first, oldest first.
With lpm a due request that cannot start holds the queue, as fcfs's head does; with memory-aware
admission it has its blocks kept for it instead (`memory_aware.py`). Every request therefore
starts within MAX_WAIT_STEPS steps of its arrival plus the steps the sequences running then take
to give back its blocks (each is bounded by its max_tokens): the bound `test_admission.py` checks
on an adversarial stream of small requests.

A ranking policy's own cost stays flat however long the queue: only the first WINDOW waiting
requests (the oldest, so every due one) are ranked and tried in a step; the rest wait behind them,
in arrival order, for a place in the window. When more than WINDOW requests wait the engine is far
behind, and ranking the tail would cost every step more than it could win (SGLang drops its
cache-aware order for arrival order past 128 waiting requests, for the same reason).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from minillm.config import prompt_problem
from minillm.engine.sequence import Sequence
from minillm.memory import Capacity, KVCacheManager

# steps after which a waiting request is due: served first, its blocks kept for it. Longer than
# any TTFT target in steps, or under load every request is due before it can miss its target and
# every order becomes arrival order (`memory_aware.py`)
MAX_WAIT_STEPS = 512
WINDOW = 128  # waiting requests ranked each step (the oldest); the rest keep arrival order behind them


class FirstComeFirstServed:
    """The queue's order; whoever cannot be admitted holds everyone behind it."""

    def order(self, waiting: Iterable[Sequence], step: int) -> list[Sequence]:
        return list(waiting)

    def holds_queue(self, seq: Sequence, step: int) -> bool:
        return True

    def room_to_keep(self, seq: Sequence, budget: int, step: int) -> int:
        return 0

    def has_room(self, seq: Sequence, running: list[Sequence], budget: int, kept: int, step: int) -> bool:
        return True

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The running sequence to preempt when memory runs out (candidates oldest first): the newest."""
        return candidates[-1]

    def refusal(self, seq: Sequence) -> str | None:
        """Why a waiting request is refused now rather than served (memory-aware admission's
        `refuse_late`), or None: it waits."""
        return None

    def finished(self, seq: Sequence) -> None:
        pass


class MaxLengthReservation(FirstComeFirstServed):
    """FCFS, admitting only while every running request's maximum length stays reserved."""

    def __init__(self, manager: KVCacheManager):
        self.capacity = manager.capacity()

    def blocks_at_most(self, seq: Sequence) -> int:
        capacity = self.capacity
        prompt_blocks = capacity.blocks_for(len(seq.prompt_ids))
        return prompt_blocks + seq.params.num_outputs * (capacity.blocks_for(seq.max_len) - prompt_blocks)

    def has_room(self, seq: Sequence, running: list[Sequence], budget: int, kept: int, step: int) -> bool:
        """Room for its maximum beside the others' (alone, it may take the pool and preempt its own forks)."""
        reserved = sum(self.blocks_at_most(other) for other in running if other.request_id != seq.request_id)
        return not reserved or reserved + self.blocks_at_most(seq) <= self.capacity.num_blocks


def is_due(seq: Sequence, step: int) -> bool:
    """Preempted, or waited MAX_WAIT_STEPS: it goes before every request that is not due."""
    return seq.num_preemptions > 0 or step - seq.arrival_step >= MAX_WAIT_STEPS


def ranked(waiting: Iterable[Sequence], step: int, key) -> list[Sequence]:
    """The first WINDOW waiting, due ones first, oldest first, then the others by `key`, smallest
    first (a stable sort: ties keep arrival order)."""
    window = list(islice(waiting, WINDOW))
    due = [seq for seq in window if is_due(seq, step)]
    others = [seq for seq in window if not is_due(seq, step)]
    return due + sorted(others, key=key)


class LongestPrefixFirst(FirstComeFirstServed):
    """The request whose prompt the prefix cache holds most of first; due requests before all."""

    def __init__(self, manager: KVCacheManager):
        self.manager = manager

    def order(self, waiting: Iterable[Sequence], step: int) -> list[Sequence]:
        def cached(seq: Sequence) -> int:
            return self.manager.cached_prefix_blocks(seq.seq_id, seq.token_ids)

        return ranked(waiting, step, key=lambda seq: -cached(seq))


def admission_problem(
    seq: Sequence,
    capacity: Capacity,
    context_len: int,
    vocab_size: int,
    max_num_seqs: int,
    step_tokens: int,
) -> str | None:
    """Why a request can never run here (it then fails alone, at once), or None."""
    problem = prompt_problem(seq.prompt_ids, context_len, vocab_size)
    if problem:
        return problem
    if seq.params.beam_width > vocab_size:
        width = seq.params.beam_width
        return f"beam_width={width} is more than the {vocab_size} tokens of the vocabulary; lower it."
    if seq.params.num_outputs > max_num_seqs:
        return (
            f"This request runs {seq.params.num_outputs} sequences at once (n or beam_width) but "
            f"max_num_seqs is {max_num_seqs}; raise max_num_seqs or lower n."
        )
    most_held = capacity.most_held(len(seq.prompt_ids), seq.max_len, step_tokens)
    needed = capacity.blocks_for(most_held)
    if needed > capacity.num_blocks:
        fix = "shorten the prompt" if seq.params.max_tokens is None else "lower max_tokens"
        return (
            f"This request may need {needed} KV blocks ({most_held} tokens) but the pool has only "
            f"{capacity.num_blocks}; raise kv_cache_bytes or {fix}."
        )
    return None


def longest_held(capacity: Capacity, prompt_len: int, context_len: int, step_tokens: int) -> int:
    """How long a request without max_tokens may grow: to the context, or, when the pool cannot
    hold that much at once, to the pool's end, where it finishes with "length" (vLLM caps such a
    request by the context alone, and refuses to start on a pool smaller than the context; here
    a small pool serves what it can). Never less than the prompt and one new token: a prompt the
    pool cannot hold is refused at admission."""
    if capacity.blocks_for(capacity.most_held(prompt_len, context_len, step_tokens)) <= capacity.num_blocks:
        return context_len
    return max(prompt_len + 1, min(context_len, capacity.num_blocks * capacity.block_size))
