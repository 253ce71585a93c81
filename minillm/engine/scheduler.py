"""Which sequences run this step, and how many tokens each computes.

Continuous batching (Orca's iteration-level scheduling): every step, sequences that finished
leave and waiting ones join, so the batch stays full. Static batching, the baseline, starts a new
batch of `max_num_seqs` requests only when the whole previous one has finished: short requests
wait for the longest, and their seats in the batch sit idle.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, oldest
first: a decode costs 1 token, an unfinished prefill takes what is left of the budget (chunked
prefill). Waiting sequences are admitted while budget, seats and KV blocks last, in the order the
admission policy gives (`admission.py`); a request that will fork (n samples, beam_width beams)
takes its forks' seats when admitted.

When a running sequence's next chunk finds no free block, room is made: first from a waiting
sequence that holds device blocks, then by preempting a running sequence not yet scheduled this
step (the admission policy's victim: the newest, or the one with the most remaining cost), which
goes back to the front of the queue. By *recompute* it starts over when memory allows; by *swap* its
blocks (and its request's siblings', which share them) leave for the host or disk tier and come
back before it runs again; a swapped sequence at the head of the queue comes back one step early
(prefetch), its copies behind that step's forward pass. Running out of blocks is a scheduling
event, never a crash.

The scheduler keeps only scheduling: the token budget, the seats, the admission order, the
choice of victims, chunking. Everything about memory it asks the KV cache manager
(`memory/kv_cache_manager.py`) in its words: allocate a chunk's blocks (prefix hits, swap-ins,
copy-on-write are its business) or say no, preempt this victim (swap or recompute is its
choice), fork, free, and after each forward pass `computed` (blocks registered, budgets kept).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.engine.admission import (
    FirstComeFirstServed,
    LongestPrefixFirst,
    MaxLengthReservation,
    admission_problem,
    longest_held,
)
from minillm.engine.memory_aware import MemoryAware
from minillm.engine.output_length import LearnedLengths
from minillm.engine.sequence import Sequence, Status
from minillm.engine.speculative import NgramProposer, guesses_that_fit
from minillm.memory import KVCacheManager


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens to compute this step, starting at seq.num_computed (its guesses included)
    guesses: list[int] = field(default_factory=list)  # speculated tokens after its last one, to check


@dataclass
class Schedule:
    """One step's work: the sequences and their token counts, and the swapped-out sequence to
    bring back behind its forward pass (`KVCacheManager.apply`)."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    bring_back: tuple[int, int] | None = None  # (seq_id, blocks to leave free): the next to run

    def ran(self) -> list[tuple[int, str, int, int]]:
        """(seq_id, request_id, tokens computed, KV entries attention reads) of each scheduled
        sequence, read before `Scheduler.computed` moves their counts on: who ran, as the memory
        system's `Step` event tells it."""
        return [
            (item.seq.seq_id, item.seq.request_id, item.num_tokens, item.seq.num_cached + item.num_tokens)
            for item in self.sequences
        ]


def make_admission(
    policy: str,
    manager: KVCacheManager,
    step_tokens: int,
    lengths: LearnedLengths | None = None,
    ttft_target: float | None = None,
    refuse_late: bool = False,
) -> FirstComeFirstServed | MemoryAware:
    """The admission policy named `policy`. Memory-aware admission predicts output lengths with
    `lengths` (learned from finished requests by their shape, `output_length.py`) and, given the
    TTFT target `ttft_target` (seconds), puts requests that can still meet it first (and with
    `refuse_late` refuses those that cannot)."""
    if policy == "memory":
        return MemoryAware(
            manager, step_tokens, lengths or LearnedLengths(frozenset()), ttft_target, refuse_late
        )
    simple = {"fcfs": FirstComeFirstServed, "lpm": LongestPrefixFirst, "reserve": MaxLengthReservation}
    return simple[policy]() if policy == "fcfs" else simple[policy](manager)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        policy: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        context_len: int,
        vocab_size: int,
        admission: FirstComeFirstServed | MemoryAware | None = None,
        proposer: NgramProposer | None = None,
    ):
        """`admission`: who joins the batch first (`make_admission`; default first come first
        served). `proposer`: the speculated tokens to follow a decoding sequence (`speculative.py`),
        or None without speculation."""
        self.kv_cache, self.capacity = kv_cache, kv_cache.capacity()
        self.proposer = proposer
        self.policy = policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.context_len, self.vocab_size = context_len, vocab_size
        self.admission = admission or FirstComeFirstServed()
        self.steps = 0  # schedules made: the clock a waiting request ages by
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0
        self._refused: list[str] = []  # request ids the admission policy refused this step
        self._scheduled_ids: set[int] = set()  # scheduled this step from the running: they stay on the device

    # ----------------------------------------------------------------- admission
    def max_len(self, prompt_len: int, max_tokens: int | None) -> int:
        """Where a new sequence stops: prompt + max_tokens within the context; without max_tokens,
        the context or the pool's end (`admission.longest_held`)."""
        if max_tokens is None:
            return longest_held(self.capacity, prompt_len, self.context_len, self.max_num_batched_tokens)
        return min(self.context_len, prompt_len + max_tokens)

    def add(self, seq: Sequence) -> bool:
        """Queue a new request's sequence, or finish it with the reason it can never run (it
        fails alone; the others go on). Returns whether it was queued."""
        if not self.admits(seq):
            return False
        seq.arrival_step = self.steps
        self.waiting.append(seq)
        return True

    def admits(self, seq: Sequence) -> bool:
        """Can the new sequence ever run here? If not, it is finished with the reason."""
        limits = (self.context_len, self.vocab_size, self.max_num_seqs, self.max_num_batched_tokens)
        problem = admission_problem(seq, self.capacity, *limits)
        if problem:
            seq.finish("error", problem)
        return not problem

    def take_refused(self) -> list[str]:
        """The requests the admission policy refused since the last call (their sequences have ended)."""
        refused, self._refused = self._refused, []
        return refused

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def unfinished(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def queue(self) -> list[tuple[int, str]]:
        """(seq_id, request_id) of each waiting sequence, in the queue's order."""
        return [(seq.seq_id, seq.request_id) for seq in self.waiting]

    # ----------------------------------------------------------------- one step
    def schedule(self) -> Schedule:
        """This step's sequences and token counts. If nothing could be scheduled while requests wait
        (beams waiting for a sibling that waits for memory, or every running sequence left to make
        room), make room for the head of the queue and try again: the newest running sequence
        queues behind it, or it would take the room back."""
        self.steps += 1
        scheduled, preempted = self._schedule_pass()
        while not scheduled and (self.running or preempted) and any(s.num_uncomputed for s in self.waiting):
            if self.running:
                self._preempt(self.running[-1], front=False)
            scheduled, preempted = self._schedule_pass()
        return Schedule(scheduled, self._next_to_bring_back() if scheduled else None)

    def _schedule_pass(self) -> tuple[list[ScheduledSequence], bool]:
        """Running sequences first, oldest first, then waiting ones in the admission policy's order
        (not after a preemption: the room was made for the running). Returns (the scheduled,
        whether a sequence had to leave the device)."""
        if self.policy == "static" and not self.running:
            self._start_static_batch()
        budget, scheduled, preempted = self.max_num_batched_tokens, [], False
        self._scheduled_ids = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.num_uncomputed == 0:  # preempted in this loop, or a
                continue  # beam whose scores are in, waiting for its siblings
            item = self._with_guesses(seq, budget)
            if item is None:
                num_tokens, made_room = self._reserve_running(seq, budget)
                preempted |= made_room
                item = ScheduledSequence(seq, num_tokens) if num_tokens else None
            if item is not None:
                scheduled.append(item)
                self._scheduled_ids.add(seq.seq_id)
                budget -= item.num_tokens
        if self.policy == "continuous" and not preempted:
            self._admit_waiting(scheduled, budget)
        return scheduled, preempted

    def _reserve_running(self, seq: Sequence, budget: int) -> tuple[int, bool]:
        """Blocks for a running sequence's next chunk, making room while memory is short: from a
        waiting sequence that holds device blocks, else by preempting the admission policy's victim
        among the running ones this step has not scheduled (it may be `seq` itself). Returns (the
        chunk's tokens, 0 if `seq` left; whether room was made)."""
        made_room = False
        while seq.status is Status.RUNNING:
            num_tokens = self._reserve(seq, budget)
            if num_tokens:
                return num_tokens, made_room
            made_room = True
            if not self._release_waiting(seq):
                unscheduled = [s for s in self.running if s.seq_id not in self._scheduled_ids]
                self._preempt(self.admission.victim(unscheduled), protect=seq)
        return 0, made_room

    def _with_guesses(self, seq: Sequence, budget: int) -> ScheduledSequence | None:
        """A decoding sequence's last token and the guesses after it, if it has some and free
        blocks hold them (`speculative.guesses_that_fit`); else None, and it runs as usual."""
        if self.proposer is None or seq.num_uncomputed != 1 or not seq.output_ids:
            return None
        free = self.kv_cache.num_free_blocks
        guesses = guesses_that_fit(self.proposer, self.capacity, free, seq, budget, len(self.running))
        if not guesses:
            return None
        num_tokens = 1 + len(guesses)
        tokens = [*seq.token_ids, *guesses]
        grant = self.kv_cache.allocate(seq.seq_id, tokens, seq.num_computed, seq.num_cached, num_tokens)
        return ScheduledSequence(seq, num_tokens, guesses) if grant.num_tokens == num_tokens else None

    def _admit_waiting(self, scheduled: list[ScheduledSequence], budget: int) -> None:
        """Start waiting sequences while the budget, seats and the admission policy allow."""
        kept = 0  # blocks kept free for due requests that could not start (memory-aware admission)
        seats = self.max_num_seqs - self._seats_taken()
        for seq in self.admission.order(self.waiting, self.steps):
            refusal = self.admission.refusal(seq)  # (the policy orders the ones it refuses first)
            if refusal is not None:  # it can no longer be served as asked: it ends now, alone
                self.finish(seq, "error", refusal)
                self._refused.append(seq.request_id)
                continue
            if budget == 0 or seats == 0:
                break
            if seq.num_uncomputed == 0:  # a beam swapped out while it waited for its siblings' scores:
                continue  # nothing to run until they are in; it keeps its place
            if scheduled and self.kv_cache.holding(seq.seq_id).swapped:
                break  # prefetched instead (`schedule`): its copies hide behind this step's forward pass
            num_tokens = self._admit(seq, budget, kept) if seq.num_seats <= seats else 0
            if num_tokens:
                seats -= seq.num_seats
            else:
                if self.admission.holds_queue(seq, self.steps):
                    break  # it waits for memory or seats, and nobody overtakes it
                kept += self.admission.room_to_keep(seq, budget, self.steps)
                continue
            scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens

    def _admit(self, seq: Sequence, budget: int, kept: int) -> int:
        """Start a waiting sequence (its seats are free) if the admission policy (headroom, blocks
        `kept` for others) and blocks allow; return the tokens of its first chunk, or 0 if it must wait."""
        if not self.admission.has_room(seq, self.running, budget, kept, self.steps):
            return 0
        num_tokens = self._reserve(seq, budget)
        while not num_tokens and self._release_waiting(seq):
            num_tokens = self._reserve(seq, budget)
        if num_tokens:
            self._start_running(seq)
        return num_tokens

    def _reserve(self, seq: Sequence, budget: int) -> int:
        """Ask for the blocks of the sequence's next chunk; return its length, or 0 if memory is
        short. A sequence that starts afresh starts past its prefix-cache hits (or at 0)."""
        counts = (seq.num_computed, seq.num_cached, budget)
        # a prompt to be scored computes every token: a prefix-cache hit would have no logits
        grant = self.kv_cache.allocate(seq.seq_id, seq.token_ids, *counts, seq.params.prompt_logprobs is None)
        if grant.restart:
            seq.restart(grant.num_computed)
        if seq.prefix_miss is None:  # why its first lookup hit what it hit
            seq.prefix_miss = grant.miss
        return grant.num_tokens

    def _release_waiting(self, keep: Sequence) -> bool:
        """Free the device blocks a waiting sequence holds (brought back early, or sharing blocks
        with a sibling that came back), the last in the queue first: swapped out again, or
        forgotten. False if no waiting sequence but `keep` holds any."""
        holders = self.kv_cache.holders_of_device_blocks() - {seq.seq_id for seq in self.running}
        holders.discard(keep.seq_id)
        if not holders:  # the usual case: asked without a walk down a queue that may be long
            return False
        for seq in reversed(self.waiting):
            if seq.seq_id in holders:
                self.kv_cache.preempt(
                    seq.seq_id, seq.num_computed, {seq.seq_id: seq.num_computed}, keep.seq_id
                )
                if not self.kv_cache.holding(seq.seq_id).has_table:
                    seq.forget_cache()
                return True
        return False

    def _next_to_bring_back(self) -> tuple[int, int] | None:
        """The head of the queue, if it is swapped out: to come back during this step if memory
        allows, keeping a block free for each running sequence to grow into."""
        head = next((seq for seq in self.waiting if seq.num_uncomputed), None)  # the next to run
        if head is not None and self.kv_cache.holding(head.seq_id).swapped:
            return head.seq_id, len(self.running)
        return None

    def _start_static_batch(self) -> None:
        """Static batching: the next max_num_seqs requests form a batch that runs to its end.
        Their prefills may still be spread over several steps by the token budget."""
        while self.waiting and self._has_seats_for(self.waiting[0]):
            self._start_running(self.waiting[0])

    def _start_running(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _seats_taken(self) -> int:
        """At most max_num_seqs sequences run at once, counting the forks that running requests
        will make at their first sampling (n - 1 samples, beam_width - 1 beams) as taken."""
        return sum(running.num_seats for running in self.running)

    def _has_seats_for(self, seq: Sequence) -> bool:
        return self._seats_taken() + seq.num_seats <= self.max_num_seqs

    # ----------------------------------------------------------------- forks, victims, the end
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A parallel sample or a beam joins beside its parent, sharing all its blocks. A fork the
        parent's admission reserved a seat for always fits; a parent swapped out (or brought back
        but not yet running) keeps its child next to it in the queue. A later beam fork (a
        sibling's seat may have gone to another request while that sibling was preempted) or the
        child of a parent preempted by recompute waits instead, to be computed again."""
        running = parent.status is Status.RUNNING
        if not self.kv_cache.holding(parent.seq_id).has_table or (
            running and parent.output_ids and not self._has_seats_for(child)
        ):
            child.forget_cache()
            child.status = Status.WAITING
            self.waiting.append(child)
            return
        self.kv_cache.fork(parent.seq_id, child.seq_id)
        if running:
            self.running.append(child)
        else:
            self.waiting.insert(self.waiting.index(parent) + 1, child)

    def _preempt(self, seq: Sequence, front: bool = True, protect: Sequence | None = None) -> None:
        """Take `seq` off the device, to the front of the queue (or its back). The KV cache manager
        chooses swap or recompute; by swap, its request's other running sequences that this step
        has not scheduled go with it (they share blocks), except `protect`, the one the room is for."""
        group = {}
        if self.kv_cache.holding(seq.seq_id).has_table:
            group = {
                s.seq_id: s.num_computed
                for s in self.running
                if s.request_id == seq.request_id
                and self.kv_cache.holding(s.seq_id).has_table
                and s.seq_id not in self._scheduled_ids
                and (s is seq or s is not protect)
            }
        for_seq = protect.seq_id if protect is not None else -1
        left = set(self.kv_cache.preempt(seq.seq_id, seq.num_computed, group, for_seq))
        victims = [s for s in self.running if s.seq_id in left]
        for victim in victims:
            self.running.remove(victim)
            victim.status = Status.WAITING
            victim.num_preemptions += 1
            self.num_preemptions += 1
            if not self.kv_cache.holding(victim.seq_id).has_table:
                victim.forget_cache()  # by recompute: nothing of it is cached any more
        if front:
            self.waiting.extendleft(reversed(victims))
        else:
            self.waiting.extend(victims)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a sequence (finished, pruned, aborted): it leaves the queues and its blocks go back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache.free(seq.seq_id)
        seq.finish(reason, error)
        if reason in ("eos", "length"):
            self.admission.finished(seq)

    # ----------------------------------------------------------------- after the forward pass
    def computed(self, schedule: Schedule, kept: dict[int, int], attention: dict[int, list]) -> int:
        """The step's tokens now have their K/V in the pool, and `attention` (seq_id -> per query
        batch, with H2O: `runner.Forward`) what their entries received. A sequence that guessed
        keeps `kept[seq_id]` of its tokens (its last and the guesses accepted), and the attention
        of their rows: the KV cache manager rolls the rest back first. Then it keeps H2O's scores,
        registers full blocks and keeps budgets. Returns the entries evicted."""
        evicted = 0
        for item in schedule.sequences:
            seq, received = item.seq, attention.get(item.seq.seq_id, [])
            if item.guesses:
                seq.num_computed += kept[seq.seq_id]
                received = received[: kept[seq.seq_id]]
                if kept[seq.seq_id] < item.num_tokens:  # some were rejected: their K/V goes
                    self.kv_cache.rollback(seq.seq_id, seq.num_cached)
            else:
                seq.num_computed += item.num_tokens
            counts = (seq.num_computed, seq.num_cached, len(seq.prompt_ids), seq.max_len)
            dropped = self.kv_cache.computed(seq.seq_id, seq.token_ids, *counts, received)
            seq.num_evicted += dropped
            evicted += dropped
        return evicted

    def cached_entries(self) -> dict[int, int]:
        """seq_id -> KV entries it holds now, for every running sequence (memory accounting)."""
        return {seq.seq_id: seq.num_cached for seq in self.running}
