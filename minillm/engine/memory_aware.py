"""Memory-aware admission: price each request by what its whole life will cost the memory system.

A request's KV cost is an *area*: the blocks it holds times the steps it holds them, and every one
of those steps reads them (the bandwidth decode is bound by). A document holds 13 blocks for a
few steps; a long answer 5 blocks for 70: the document is the cheaper one to serve, though its
peak is the higher. So the price of a waiting request (`cost`) is its remaining life in one
unit, *engine steps' worth of the machine*:

    cost = KV block-steps it will hold / the pool's blocks       (memory, and the reads of it)
         + tokens it will compute      / a step's token budget   (prefill, then one a step)

counting the prompt blocks the prefix cache does not hold yet (held from its prefill to its last
token), its output blocks as they grow, and each of its n samples or beams. Its length is
predicted from its shape (`output_length.py`). Benefit: one request served within its targets,
times vLLM's priority weight (2 ** -priority). Requests are admitted best benefit / cost first:
shortest predicted work first, which is what serves the most requests when the machine is short.

Deadlines (`ttft_target`, seconds, when the engine is told its target): a request whose first token
can still come in time, but only if it starts within URGENT_STEPS steps, is *urgent*: it goes
before the cheaper ones, least slack first, the blocks of its first chunk are kept for it, and it
does not wait for the headroom below. Without that a costly request (a document's long prompt)
would be passed over until too late, by every cheaper one that fits in the blocks it needs. A
request that can no longer meet its target (it has waited too long already) yields to every one
that can: serving it now spends the machine on a request lost either way. It is still served,
within the starvation bound below. Slack is counted in steps, from a median of recent step times
(`StepTimer`): the time left to its target, less the steps its prefill will take.

Headroom: a request is admitted only while the blocks left free cover what the batch, this request
in it, is expected to grow into: its peak over time, as each sequence decodes its expected output
and gives its blocks back (`growth.py`). When memory is tight that limits concurrency, and the
batch it builds can decode without a preemption storm. What headroom buys is measured small
(`bench scheduling`: preemptions cost a few % of busy time); what pays is the order.

Victims: when a running sequence's next chunk finds no block, the running sequence with the most
remaining cost leaves (not the newest): it frees the most for the longest.

No starvation: a request that has waited MAX_WAIT_STEPS engine steps, or was preempted, is *due*
(`admission.is_due`): due requests go first, oldest first, wait for their first chunk's blocks and
the batch's headroom like any other, and have their blocks kept for them, so nobody overtakes
them into starving. The bound is long on purpose: were it shorter than a TTFT target, under load
every request would be due before it could miss its target, and the order would be arrival order.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable

from minillm.engine.admission import is_due, ranked
from minillm.engine.growth import GrowthProfile
from minillm.engine.output_length import LearnedLengths
from minillm.engine.sequence import Sequence
from minillm.memory import KVCacheManager

LATE_REFUSAL = "This server cannot give this request its first token within its TTFT target"
URGENT_STEPS = 24  # a request that must start within this many steps to meet its TTFT target is urgent


class StepTimer:
    """Seconds per engine step: the median of the latest few, measured between calls (a step after
    an idle wait is one slow sample among them)."""

    def __init__(self):
        self._last: tuple[int, float] | None = None  # (step, time) at the last call
        self._recent: deque[float] = deque(maxlen=16)

    def tick(self, step: int, now: float) -> None:
        if self._last is not None and step > self._last[0]:
            self._recent.append((now - self._last[1]) / (step - self._last[0]))
        self._last = (step, now)

    @property
    def seconds(self) -> float:
        return statistics.median(self._recent) if self._recent else 0.0


class MemoryAware:
    """Benefit over the cost of a request's remaining life, deadlines when they are close, a
    headroom for the batch's growth, and aging against starvation."""

    def __init__(
        self,
        manager: KVCacheManager,
        step_tokens: int,
        lengths: LearnedLengths,
        ttft_target: float | None = None,
        refuse_late: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """`ttft_target`: the time to first token requests should get (seconds), or None;
        `refuse_late`: refuse a request that can no longer meet it instead of serving it late;
        `clock`: the time, in the unit and origin of `Sequence.arrival_time`."""
        self.manager, self.step_tokens, self.lengths = manager, step_tokens, lengths
        self.capacity = manager.capacity()  # the pool's size and block size, fixed for the run
        self.ttft_target, self.refuse_late, self.clock = ttft_target, refuse_late, clock
        self.timer = StepTimer()
        self._profile: tuple | None = None  # (the batch it was built for, its GrowthProfile, blocks held)
        # this step's answers, seq_id -> value: each is asked several times a step (rank, room, keep)
        self._cached: dict[int, int] = {}  # prefix blocks cached
        self._slack: dict[int, float | None] = {}  # `slack_steps`
        self._expected: dict[tuple[int, int], int] = {}  # `expected_output`, by (seq_id, generated)
        self._now = 0.0  # the time of this step's order

    # ---------------------------------------------------------------- the order
    def order(self, waiting: Iterable[Sequence], step: int) -> list[Sequence]:
        """Due requests first, oldest first; then those whose deadline is close, least slack first;
        then the others by benefit / cost, best first; those past saving last."""
        self._cached, self._slack, self._expected, self._now = {}, {}, {}, self.clock()
        self.timer.tick(step, self._now)
        return ranked(waiting, step, key=self.rank)

    def rank(self, seq: Sequence) -> tuple:
        """(0, slack, -benefit / cost) if it is urgent; (1, -benefit / cost) if it can still meet
        its target (or there is none); (2, -benefit / cost) if it cannot: smallest first. With
        `refuse_late` those that cannot come first instead, to be refused (`refusal`)."""
        slack, value = self.slack_steps(seq), -self.benefit(seq) / self.cost(seq)
        if slack is not None and 0 <= slack < URGENT_STEPS:
            return (0, slack, value)
        late = slack is not None and slack < 0
        if late and self.refuse_late:
            return (-1, value)
        return (2 if late else 1, value)

    def slack_steps(self, seq: Sequence) -> float | None:
        """Steps it could still wait and have its first token within the TTFT target, if its
        prefill then takes the steps its uncomputed prompt needs; negative once too late. None
        without a target, or once it has its first token (a preempted request)."""
        if seq.seq_id not in self._slack:
            step_s, slack = self.timer.seconds, None
            if self.ttft_target is not None and not seq.output_ids and step_s > 0:
                left_s = seq.arrival_time + self.ttft_target - self._now
                slack = left_s / step_s - math.ceil(seq.num_uncomputed / self.step_tokens)
            self._slack[seq.seq_id] = slack
        return self._slack[seq.seq_id]

    def is_urgent(self, seq: Sequence) -> bool:
        """Must it start within URGENT_STEPS steps to meet its TTFT target (and still can)?"""
        slack = self.slack_steps(seq)
        return slack is not None and 0 <= slack < URGENT_STEPS

    def is_late(self, seq: Sequence) -> bool:
        """Can it no longer meet its TTFT target, even if it started now?"""
        slack = self.slack_steps(seq)
        return slack is not None and slack < 0

    def refusal(self, seq: Sequence) -> str | None:
        """With `refuse_late`, why a request that can no longer meet its target is refused now
        (Mooncake's early rejection: its client can retry elsewhere); else None."""
        if not (self.refuse_late and self.is_late(seq)):
            return None
        waited = self._now - seq.arrival_time
        return f"{LATE_REFUSAL} ({self.ttft_target:g} s): it has waited {waited:.2f} s; retry later."

    @staticmethod
    def benefit(seq: Sequence) -> float:
        return 2.0**-seq.priority

    def cached_blocks(self, seq: Sequence) -> int:
        """Its prompt blocks the prefix cache holds, looked up once a step (an admission that takes
        a cached block's place may make it an overestimate: allocation has the last word)."""
        if seq.seq_id not in self._cached:
            self._cached[seq.seq_id] = self.manager.cached_prefix_blocks(seq.seq_id, seq.token_ids)
        return self._cached[seq.seq_id]

    def cost(self, seq: Sequence) -> float:
        """Its remaining life in engine steps' worth of the machine: the KV block-steps it will hold
        over the pool's blocks, plus the tokens it will compute over a step's token budget."""
        manager, capacity, rows = self.manager, self.capacity, seq.num_seats  # rows: it and its forks to come
        holding = manager.holding(seq.seq_id)
        if holding.has_table:  # running (or brought back): what it holds now
            held, to_compute = holding.num_blocks, seq.num_uncomputed
        else:
            cached = self.cached_blocks(seq)
            held = capacity.blocks_for(seq.num_tokens) - cached
            to_compute = seq.num_uncomputed - cached * capacity.block_size
        prefill_steps = math.ceil(max(0, to_compute - 1) / self.step_tokens)
        steps = self.steps_left(seq)
        growth = capacity.blocks_for(seq.num_tokens + steps) - capacity.blocks_for(seq.num_tokens)
        block_steps = held * (prefill_steps + steps) + rows * growth * steps / 2  # its outputs grow
        tokens = to_compute + rows * steps
        return block_steps / capacity.num_blocks + tokens / self.step_tokens

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The running sequence to preempt when memory runs out: the one with the most remaining cost."""
        return max(candidates, key=self.cost)

    def holds_queue(self, seq: Sequence, step: int) -> bool:
        """Nobody stalls the queue: a due request that must wait has its blocks kept instead."""
        return False

    def room_to_keep(self, seq: Sequence, budget: int, step: int) -> int:
        """Blocks to keep free for a request that could not start: those of its first chunk if it is
        due, or urgent (its deadline close): cheaper requests behind it must not take them."""
        return self.blocks_to_start(seq, budget) if is_due(seq, step) or self.is_urgent(seq) else 0

    # ---------------------------------------------------------------- growth and headroom
    def expected_output(self, seq: Sequence) -> int:
        key = (seq.seq_id, len(seq.output_ids))
        if key not in self._expected:
            self._expected[key] = self.lengths.expected_output(seq)
        return self._expected[key]

    def steps_left(self, seq: Sequence) -> int:
        """Decode steps it is expected to run before it ends and gives its blocks back."""
        peak = min(seq.max_len, len(seq.prompt_ids) + self.expected_output(seq))
        return max(0, peak - seq.num_tokens)

    def profile(self, running: list[Sequence], step: int) -> tuple[GrowthProfile, int]:
        """The running sequences' growth over the steps ahead, and the blocks they hold now. Built
        once per step and batch: a step asks for every waiting request it tries, and the batch
        changes when one is admitted."""
        batch = (step, len(running), running[-1].seq_id if running else None)  # changes as they join or leave
        if self._profile is None or self._profile[0] != batch:
            manager, rows, held = self.manager, [], 0
            for seq in running:
                holding = manager.holding(seq.seq_id)
                if holding.has_table:
                    held += holding.num_blocks
                    steps = self.steps_left(seq)  # its forks to come share its prompt, and grow alike
                    rows += [(seq.num_tokens, steps)] + [(0, steps)] * (seq.num_seats - 1)
            self._profile = (batch, GrowthProfile(rows, self.capacity.block_size), held)
        return self._profile[1], self._profile[2]

    def blocks_to_start(self, seq: Sequence, budget: int) -> int:
        """New blocks its first chunk takes: the chunk's, less the prompt blocks the prefix cache gives."""
        chunk_end = seq.num_cached + min(seq.num_uncomputed, budget)
        needed = self.capacity.blocks_for(chunk_end) - self.manager.holding(seq.seq_id).num_blocks
        return max(0, needed - self.cached_blocks(seq))

    def has_room(self, seq: Sequence, running: list[Sequence], budget: int, kept: int, step: int) -> bool:
        """Do the free blocks, less the `kept` ones due and urgent requests wait for, cover this
        request's first chunk, and the batch's growth with it to its peak over time? A due request
        waits for that room too (admitted without it, it would be preempted again as the batch
        grows); an urgent one needs only its first chunk's blocks (waiting for the headroom would
        make it late; if the batch then runs short, the costliest leaves). With nothing running
        there is no growth to keep room for, and whatever fits may start."""
        if not running:
            return True
        free = self.manager.num_free_blocks - kept
        if self.blocks_to_start(seq, budget) > free:
            return False
        if self.is_urgent(seq):  # waiting for the headroom would make it late; preemption may follow
            return True
        profile, held = self.profile(running, step)
        new_tokens = max(0, seq.num_tokens - self.cached_blocks(seq) * self.capacity.block_size)
        return profile.peak_with(new_tokens, self.steps_left(seq), seq.num_seats) - held <= free

    def finished(self, seq: Sequence) -> None:
        """Learn from a sequence that ran to its end (eos or length)."""
        self.lengths.finished(seq)
