"""Which waiting request joins the batch next (by arrival, cached prefix, memory cost or reservation),
and which never can.

Max-length reservation (`admission="reserve"`) is the baseline before paging (Orca, FasterTransformer):
a request is admitted only when its whole possible length, prompt plus max_tokens, is free for
it; a contiguous allocator must reserve that much up front. Here it is played on the paged pool
(held blocks plus reserved ones), which spares it the external fragmentation a real contiguous
arena adds (`arena.py`): a baseline no worse than the real one.

First come first served (`admission="fcfs"`, vLLM's default) admits the head of the queue while
blocks, seats and the step's token budget last, and nobody overtakes it. Fair, and blind to
memory: one long document at the head holds every short question behind it until its blocks are
free, and requests are admitted as long as one block is free, so the batch outgrows the pool
and preempts as it decodes.

Longest prefix first (`admission="lpm"`, SGLang's cache-aware order) admits first the request
whose prompt the prefix cache holds most of: its prefill is mostly done already, and served now
its prefix is still cached (served later, the cache may have let it go). It holds the queue as
first come first served does; ties keep arrival order.

Memory-aware admission (`admission="memory"`) prices every waiting request:

    cost    = the KV blocks it will newly hold at its peak (prompt plus expected output, for each
              of its n samples or beams, less the prompt blocks the prefix cache already holds)
            + the KV blocks each of its decode steps reads at that peak (its bandwidth: a shared
              prefix is read though it is not held)
    benefit = 2 ** -priority

and admits by benefit / cost, best first, while memory lasts; one that does not fit now lets a
smaller one behind it in. The expected output is learned: the mean output length of the
(latest HISTORY) finished requests that ran longer than this one has so far, capped by its
max_tokens (max_tokens itself while none has).
Priority is vLLM's: lower values go first. `admission="memory+lpm"` orders as lpm does (ties by
benefit / cost) and admits with memory-aware's room rules below.

Headroom: it admits only while the blocks left free cover what the batch, this request in it, is
expected to grow into: its peak over time, as each sequence decodes its expected output and then
gives its blocks back (`growth.py`). Not the sum of each one's own peak, which would keep idle the
blocks of those that finish before the others peak. So the batch it builds can decode without a
preemption storm.

No starvation (every policy but fcfs and reserve, which never overtake): a request that has waited
MAX_WAIT_STEPS engine steps, or was preempted, is *due*. Due requests go first, oldest first. With
lpm a due request that cannot start holds the queue, as fcfs's head does. With memory-aware
admission it waits, like any other, for its first chunk's blocks and the batch's headroom
(admitted without the headroom it would only be preempted again), and has its blocks kept for
it: a request behind it is admitted only into blocks beyond those (backfilling, as batch
schedulers do), so it cannot be overtaken into starving. Every request therefore starts within
MAX_WAIT_STEPS steps of its arrival plus the steps the sequences running then take to give back
its blocks (each is bounded by its max_tokens) — the bound `test_admission.py` checks on an
adversarial stream of small requests.

The policy's own cost stays flat however long the queue: only the first WINDOW waiting requests
(the oldest, so every due one) are ranked and tried in a step; the rest wait behind them, in
arrival order, for a place in the window. When more than WINDOW requests wait the engine is far
behind, and ranking the tail would cost every step more than it could win (SGLang drops its
cache-aware order for arrival order past 128 waiting requests, for the same reason).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Iterable
from itertools import accumulate, islice

from minillm.config import prompt_problem
from minillm.engine.growth import GrowthProfile
from minillm.engine.sequence import Sequence
from minillm.memory import KVCacheManager

MAX_WAIT_STEPS = 32  # steps after which a waiting request is due: served first, its blocks kept for it
HISTORY = 1024  # finished requests the expected output is learned from (the latest)
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

    def finished(self, seq: Sequence) -> None:
        pass


class MaxLengthReservation(FirstComeFirstServed):
    """FCFS, admitting only while every running request's maximum length stays reserved."""

    def __init__(self, manager: KVCacheManager):
        self.manager = manager

    def blocks_at_most(self, seq: Sequence) -> int:
        manager = self.manager
        prompt_blocks = manager.blocks_for(len(seq.prompt_ids))
        return prompt_blocks + seq.params.num_outputs * (manager.blocks_for(seq.max_len) - prompt_blocks)

    def has_room(self, seq: Sequence, running: list[Sequence], budget: int, kept: int, step: int) -> bool:
        """Room for its maximum beside the others' (alone, it may take the pool and preempt its own forks)."""
        reserved = sum(self.blocks_at_most(other) for other in running if other.request_id != seq.request_id)
        return not reserved or reserved + self.blocks_at_most(seq) <= self.manager.num_blocks


def is_due(seq: Sequence, step: int) -> bool:
    """Preempted, or waited MAX_WAIT_STEPS: it goes before every request that is not due."""
    return seq.num_preemptions > 0 or step - seq.arrival_step >= MAX_WAIT_STEPS


def _ranked(waiting: Iterable[Sequence], step: int, key) -> list[Sequence]:
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

        return _ranked(waiting, step, key=lambda seq: -cached(seq))


class MemoryAware:
    """Benefit over memory cost, with a headroom for growth and aging against starvation."""

    def __init__(self, manager: KVCacheManager):
        self.manager = manager
        self._finished_lengths: list[int] = []  # the last HISTORY finished requests' output lengths, sorted
        self._length_sums: list[int] = [0]  # _length_sums[i]: the sum of the i shortest of them
        self._finish_order: deque[int] = deque()  # the same lengths, in the order they finished
        self._profile: tuple | None = None  # (the batch it was built for, its GrowthProfile, blocks held)
        self._cached: dict[int, int] = {}  # seq_id -> prefix blocks cached, looked up this step

    # ---------------------------------------------------------------- the order
    def order(self, waiting: Iterable[Sequence], step: int) -> list[Sequence]:
        """Due requests first, oldest first; then the others by benefit / cost, best first."""
        self._cached = {}
        return _ranked(waiting, step, key=self.rank)

    def cached_blocks(self, seq: Sequence) -> int:
        """Its prompt blocks the prefix cache holds, looked up once a step (an admission that takes
        a cached block's place may make it an overestimate: allocation has the last word)."""
        if seq.seq_id not in self._cached:
            self._cached[seq.seq_id] = self.manager.cached_prefix_blocks(seq.seq_id, seq.token_ids)
        return self._cached[seq.seq_id]

    def rank(self, seq: Sequence) -> float:
        return -self.benefit(seq) / self.cost(seq)

    def holds_queue(self, seq: Sequence, step: int) -> bool:
        """Nobody stalls the queue: a due request that must wait has its blocks kept instead."""
        return False

    def room_to_keep(self, seq: Sequence, budget: int, step: int) -> int:
        """Blocks to keep free for a request that could not start: those of its first chunk if it is due."""
        return self.blocks_to_start(seq, budget) if is_due(seq, step) else 0

    @staticmethod
    def benefit(seq: Sequence) -> float:
        return 2.0**-seq.priority

    def cost(self, seq: Sequence) -> int:
        """Blocks newly held at the peak + blocks read per decode step at the peak."""
        manager, outputs = self.manager, seq.params.num_outputs
        prompt_blocks = manager.blocks_for(seq.num_tokens)
        peak_blocks = manager.blocks_for(self.peak_tokens(seq))
        held = prompt_blocks - self.cached_blocks(seq) + outputs * (peak_blocks - prompt_blocks)
        read = outputs * peak_blocks
        return max(1, held) + read

    # ---------------------------------------------------------------- growth and headroom
    def expected_output(self, seq: Sequence) -> int:
        """Output tokens this request is expected to generate in all, given what it has generated:
        the mean of the finished requests that ran longer than that, capped by its max_tokens.

        Conditioning on "longer than it has run" matters: the first requests to finish are the
        short ones, and their mean would promise a long-running sequence almost no more growth.
        One that has outlived every finished request is expected to run to its max_tokens."""
        most = seq.max_len - len(seq.prompt_ids)  # max_tokens, or what the context (or pool) leaves
        generated, lengths = len(seq.output_ids), self._finished_lengths
        shorter = bisect_right(lengths, generated)  # finished ones that ran no longer than this one has
        if shorter == len(lengths):
            return most
        mean_longer = (self._length_sums[-1] - self._length_sums[shorter]) / (len(lengths) - shorter)
        return max(generated + 1, min(most, round(mean_longer)))

    def peak_tokens(self, seq: Sequence) -> int:
        return min(seq.max_len, len(seq.prompt_ids) + self.expected_output(seq))

    def steps_left(self, seq: Sequence) -> int:
        """Decode steps it is expected to run before it ends and gives its blocks back."""
        return max(0, self.peak_tokens(seq) - seq.num_tokens)

    def profile(self, running: list[Sequence], step: int) -> tuple[GrowthProfile, int]:
        """The running sequences' growth over the steps ahead, and the blocks they hold now. Built
        once per step and batch: a step asks for every waiting request it tries, and the batch
        changes when one is admitted."""
        batch = (step, len(running), running[-1].seq_id if running else None)  # changes as they join or leave
        if self._profile is None or self._profile[0] != batch:
            manager, rows, held = self.manager, [], 0
            for seq in running:
                if manager.has_blocks(seq.seq_id):
                    held += manager.num_held(seq.seq_id)
                    steps = self.steps_left(seq)  # its forks to come share its prompt, and grow alike
                    rows += [(seq.num_tokens, steps)] + [(0, steps)] * (seq.num_seats - 1)
            self._profile = (batch, GrowthProfile(rows, manager.block_size), held)
        return self._profile[1], self._profile[2]

    def blocks_to_start(self, seq: Sequence, budget: int) -> int:
        """New blocks its first chunk takes: the chunk's, less the prompt blocks the prefix cache gives."""
        manager = self.manager
        chunk_end = seq.num_cached + min(seq.num_uncomputed, budget)
        needed = manager.blocks_for(chunk_end) - manager.num_held(seq.seq_id)
        return max(0, needed - self.cached_blocks(seq))

    def has_room(self, seq: Sequence, running: list[Sequence], budget: int, kept: int, step: int) -> bool:
        """Do the free blocks, less the `kept` ones due requests wait for, cover this request's first
        chunk, and the batch's growth with it to its peak over time? A due request waits for that
        room too (admitted without it, it would be preempted again as the batch grows); with
        nothing running there is no growth to keep room for, and whatever fits may start."""
        if not running:
            return True
        manager = self.manager
        profile, held = self.profile(running, step)
        new_tokens = max(0, seq.num_tokens - self.cached_blocks(seq) * manager.block_size)
        growth = profile.peak_with(new_tokens, self.steps_left(seq), seq.num_seats) - held
        free = manager.num_free_blocks - kept
        return self.blocks_to_start(seq, budget) <= free and growth <= free

    def finished(self, seq: Sequence) -> None:
        """Learn from a sequence that ran to its end (eos or length)."""
        length, lengths = len(seq.output_ids), self._finished_lengths
        insort(lengths, length)
        self._finish_order.append(length)
        if len(self._finish_order) > HISTORY:  # forget the oldest, so traffic that changes is followed
            del lengths[bisect_left(lengths, self._finish_order.popleft())]
        self._length_sums = list(accumulate(lengths, initial=0))  # once per finish, not per lookup


class MemoryAwareLongestPrefix(MemoryAware):
    """Longest prefix first (ties by benefit / cost), admitted by memory-aware's room rules."""

    def rank(self, seq: Sequence) -> tuple[int, float]:
        return -self.cached_blocks(seq), super().rank(seq)


def admission_problem(
    seq: Sequence,
    kv_cache: KVCacheManager,
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
    most_held = kv_cache.most_held(len(seq.prompt_ids), seq.max_len, step_tokens)
    needed = kv_cache.blocks_for(most_held)
    if needed > kv_cache.num_blocks:
        fix = "shorten the prompt" if seq.params.max_tokens is None else "lower max_tokens"
        return (
            f"This request may need {needed} KV blocks ({most_held} tokens) but the pool has only "
            f"{kv_cache.num_blocks}; raise kv_cache_bytes or {fix}."
        )
    return None


def longest_held(kv_cache: KVCacheManager, prompt_len: int, context_len: int, step_tokens: int) -> int:
    """How long a request without max_tokens may grow: to the context, or, when the pool cannot
    hold that much at once, to the pool's end, where it finishes with "length" (vLLM caps such a
    request by the context alone, and refuses to start on a pool smaller than the context; here
    a small pool serves what it can). Never less than the prompt and one new token: a prompt the
    pool cannot hold is refused at admission."""
    if kv_cache.blocks_for(kv_cache.most_held(prompt_len, context_len, step_tokens)) <= kv_cache.num_blocks:
        return context_len
    return max(prompt_len + 1, min(context_len, kv_cache.num_blocks * kv_cache.block_size))


POLICIES = {
    "fcfs": lambda manager: FirstComeFirstServed(),
    "lpm": LongestPrefixFirst,
    "memory": MemoryAware,
    "memory+lpm": MemoryAwareLongestPrefix,
    "reserve": MaxLengthReservation,
}


def make_admission(policy: str, manager: KVCacheManager) -> FirstComeFirstServed | MemoryAware:
    return POLICIES[policy](manager)
