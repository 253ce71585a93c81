"""Which sequences run this step, and how many tokens each computes.

Continuous batching (Orca's iteration-level scheduling): every step, sequences that finished
leave and waiting ones join, so the batch stays full. Static batching, the baseline, starts a new
batch of `max_num_seqs` requests only when the whole previous one has finished: short requests
wait for the longest, and their slots in the batch sit idle.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, oldest
first: a decode costs 1 token, an unfinished prefill takes what is left of the budget (chunked
prefill). Waiting sequences are admitted while budget, sequence slots and KV blocks last, in the
order the admission policy gives (`admission.py`: first come first served, by memory cost, or by
max-length reservation);
a request that will fork (n samples, beam_width beams) takes its forks' slots when admitted.

A sequence's first blocks may come from the prefix cache: its prompt's leading full blocks,
computed before for another request, are shared and skipped (num_computed starts past them).
A block that a sequence is about to write while others hold it (parallel samples share their
prompt's last, partly filled block) is copied first: copy-on-write.

When a running sequence needs a block and none is free, the pressure ladder (`memory/pressure.py`)
has already reclaimed every cached block nobody holds; the next rung is preemption: the newest
running sequence is preempted, and goes back to the front of the waiting queue. By *recompute*:
its blocks are freed and num_computed = 0, to be prefilled again (prompt + what it generated so
far) when memory allows. Or, with a host or disk tier, by *swap*: the blocks of its request's
running sequences (parallel samples or beams share theirs, and a shared block moves once) leave
the device pool, and come back before it runs again, with nothing recomputed. `preemption="auto"`
asks the measured cost model (`memory/tiers.py`), through the ladder, which is cheaper for this
victim. A swapped sequence at the head of the queue is brought back one step before it runs when
others run now (prefetch): its copies overlap their forward pass. Running out of blocks is a
scheduling event, never a crash.

The scheduler is the one owner of who holds which blocks: it admits requests (or says why one
can never run), grows and frees block tables, forks samples and beams, finishes sequences, and
after each forward pass offers newly full blocks to the prefix cache and keeps every sequence
within its eviction budget (every step, or after a step that ran short: the ladder's last rung).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.config import prompt_problem
from minillm.engine.admission import make_admission
from minillm.engine.sequence import Sequence, Status
from minillm.memory import BlockManager, Evictor, MemoryPressure, TieredKV


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens to compute this step, starting at seq.num_computed


@dataclass
class Schedule:
    """One step's work: the sequences and their token counts, and the blocks to copy first."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks: swaps, spills,
    #   copy-on-write, in the order decided; all done before the forward pass
    prefetch: list[tuple[int, int]] = field(default_factory=list)  # swap-ins for the next step, done during it


class Scheduler:
    def __init__(self, block_manager: BlockManager, policy: str, max_num_seqs: int, max_num_batched_tokens: int,
                 context_len: int, vocab_size: int, evictor: Evictor | None = None,
                 pressure: MemoryPressure | None = None, tiers: TieredKV | None = None, admission: str = "fcfs"):
        self.block_manager = block_manager
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.context_len, self.vocab_size = context_len, vocab_size
        self.evictor = evictor
        self.pressure = pressure or MemoryPressure(block_manager, "recompute", None, None)
        self.tiers = tiers
        self.admission = make_admission(admission, block_manager)
        self.steps = 0  # schedules made: the clock a waiting request ages by
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0
        self.num_swapped_out = self.num_swapped_in = self.num_prefetched = 0  # sequences
        self.num_recomputed_tokens = 0  # tokens whose KV a preemption by recompute threw away
        self.scheduled_ids: set[int] = set()

    # ----------------------------------------------------------------- admission
    def add(self, seq: Sequence) -> bool:
        """Queue a new request's sequence, or finish it with the reason it can never run (it
        fails alone; the others go on). Returns whether it was queued."""
        problem = self.admission_problem(seq)
        if problem:
            seq.finish("error", problem)
            return False
        seq.arrival_step = self.steps
        self.waiting.append(seq)
        return True

    def admission_problem(self, seq: Sequence) -> str | None:
        problem = prompt_problem(seq.prompt_ids, self.context_len, self.vocab_size)
        if problem:
            return problem
        if seq.params.beam_width > self.vocab_size:
            return (f"beam_width={seq.params.beam_width} is more than the {self.vocab_size} tokens of the vocabulary; "
                    "lower it.")
        if seq.params.num_outputs > self.max_num_seqs:
            return (f"This request runs {seq.params.num_outputs} sequences at once (n or beam_width) but "
                    f"max_num_seqs is {self.max_num_seqs}; raise max_num_seqs or lower n.")
        most_held = seq.max_len
        if self.evictor:  # what it keeps (protected prefix and budget), plus one step's tokens before eviction
            kept = self.evictor.kept(len(seq.prompt_ids), seq.max_len)
            most_held = min(most_held, kept + self.max_num_batched_tokens)
        needed = self.block_manager.blocks_for(most_held)
        if needed > self.block_manager.num_blocks:
            return (f"This request may need {needed} KV blocks ({most_held} tokens) but the pool has only "
                    f"{self.block_manager.num_blocks}; raise kv_cache_bytes or lower max_tokens.")
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def unfinished(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    # ----------------------------------------------------------------- one step
    def schedule(self) -> Schedule:
        self.steps += 1
        scheduled = self.schedule_sequences()
        copies = self.block_manager.take_copies()
        if scheduled:
            self.prefetch_next()
        return Schedule(scheduled, copies, self.block_manager.take_copies())

    def schedule_sequences(self) -> list[ScheduledSequence]:
        if self.policy == "static" and not self.running:
            self.start_static_batch()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        self.scheduled_ids: set[int] = set()  # a sequence scheduled this step stays on the device
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.num_uncomputed == 0:  # preempted in this loop, or a
                continue  # beam whose scores are in, waiting for its siblings
            while not (num_tokens := self.reserve(seq, budget)):
                preempted = True
                if not self.release_waiting(seq):
                    self.preempt(self.running[-1], protect=seq)
                if seq.status is not Status.RUNNING:  # the victim, or swapped out with it
                    break
            else:
                scheduled.append(ScheduledSequence(seq, num_tokens))
                self.scheduled_ids.add(seq.seq_id)
                budget -= num_tokens

        may_admit = self.policy == "continuous" and not preempted
        kept = 0  # blocks kept free for due requests that could not start (memory-aware admission)
        for seq in self.admission.order(self.waiting, self.steps) if may_admit else []:
            if budget == 0:
                break
            if seq.num_uncomputed == 0:  # a beam swapped out while it waited for its siblings' scores:
                continue  # nothing to run until they are in; it keeps its place
            if scheduled and self.block_manager.is_swapped(seq.seq_id):
                break  # prefetched instead (`schedule`): its copies hide behind this step's forward pass
            num_tokens = self.admit(seq, budget, kept)
            if not num_tokens:
                if self.admission.holds_queue(seq, self.steps):
                    break  # it waits for memory or seats, and nobody overtakes it
                kept += self.admission.room_to_keep(seq, budget, self.steps)
                continue
            scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens
        if not scheduled and any(seq.num_uncomputed for seq in self.waiting):
            if self.running:
                # Nobody running has work (beams waiting for a sibling that waits for memory): make room
                # for the head of the queue; the victim queues behind it, or it would take the room back.
                self.preempt(self.running[-1], front=False)
                return self.schedule_sequences()
            if preempted:  # every running sequence left to make room: the room is there now
                return self.schedule_sequences()
        return scheduled

    def admit(self, seq: Sequence, budget: int, kept: int) -> int:
        """Start a waiting sequence if seats, the admission policy (headroom, blocks `kept` for
        others) and blocks allow; return the tokens of its first chunk, or 0 if it must wait."""
        if not self.has_seats_for(seq) or not self.admission.has_room(seq, self.running, budget, kept, self.steps):
            return 0
        while not (num_tokens := self.reserve(seq, budget)) and self.release_waiting(seq):
            pass
        if num_tokens:
            self.start_running(seq)
        return num_tokens

    def reserve(self, seq: Sequence, budget: int) -> int:
        """Give the sequence blocks for its next chunk (at most `budget` tokens); return the
        chunk's length, or 0 if memory is short. A sequence without blocks first looks for its
        prompt's leading blocks in the prefix cache: those tokens need no computing at all."""
        manager, cache = self.block_manager, self.block_manager.prefix_cache
        if manager.is_swapped(seq.seq_id) and not self.can_come_back(seq, budget):
            self.forget_swapped(seq)
        starting = not manager.has_table(seq.seq_id)
        hits = cache.lookup(seq.token_ids) if cache and starting else []
        skipped = len(hits) * manager.block_size  # prompt tokens whose K/V the cache already holds
        num_tokens = min(seq.num_uncomputed - skipped, budget)
        start = seq.num_cached + skipped  # cache index of the chunk's first token
        end = start + num_tokens
        copies = len(manager.shared_blocks(seq.seq_id, start, end))
        if manager.is_swapped(seq.seq_id):  # its blocks come back first, then it grows
            if not manager.can_swap_in([seq.seq_id], extra=manager.blocks_missing(seq.seq_id, end) + copies):
                return 0
            manager.swap_in([seq.seq_id])
            self.num_swapped_in += 1
        if not manager.can_grow(seq.seq_id, end, adopting=hits, copies=copies):
            return 0
        if cache and starting:
            cache.record_lookup(seq.token_ids, len(hits))
            manager.adopt(seq.seq_id, hits)
            seq.num_computed = skipped
        manager.grow(seq.seq_id, end)
        manager.copy_on_write(seq.seq_id, start, end)
        return num_tokens

    def can_come_back(self, seq: Sequence, budget: int) -> bool:
        """Can the swapped sequence's blocks return and take its next chunk? Not if a disk file is
        lost, nor if even the whole pool is too small: its samples shared a half-filled block that
        each must now copy, say, where recomputing it alone would fit."""
        manager = self.block_manager
        start, end = seq.num_cached, seq.num_cached + min(seq.num_uncomputed, budget)
        needed = len(manager.held_off_device([seq.seq_id])) + manager.blocks_missing(seq.seq_id, end) + \
            len(manager.shared_blocks(seq.seq_id, start, end))
        return needed <= manager.num_blocks and self.readable(seq)

    def readable(self, seq: Sequence) -> bool:
        """Can the swapped sequence's blocks be read back? (A disk file may be lost or corrupt.)"""
        return self.tiers.readable(self.block_manager.held_off_device([seq.seq_id]))

    def forget_swapped(self, seq: Sequence) -> None:
        """The sequence's swapped KV cannot come back: it will be recomputed instead."""
        self.block_manager.free(seq.seq_id)
        self.num_recomputed_tokens += seq.num_computed
        seq.forget_cache()

    def release_waiting(self, keep: Sequence) -> bool:
        """Free the device blocks a waiting sequence holds (brought back early, or sharing blocks
        with a sibling that came back), the last in the queue first: swap them out again, or
        forget them. False if no waiting sequence but `keep` holds any."""
        manager = self.block_manager
        for seq in reversed(self.waiting):
            if seq is not keep and manager.has_table(seq.seq_id) and \
                    any(manager.tier(block) == "device" for block in manager.table(seq.seq_id)):
                if self.pressure.preempt_by([seq.seq_id], seq.num_computed) == "swap":
                    manager.swap_out([seq.seq_id])
                    self.num_swapped_out += 1
                else:
                    manager.free(seq.seq_id)
                    self.num_recomputed_tokens += seq.num_computed
                    seq.forget_cache()
                self.pressure.took("preempt")
                return True
        return False

    def prefetch_next(self) -> None:
        """Bring the head of the queue back now if it is swapped out and memory allows, keeping
        a block free for each running sequence to grow into. It runs from the next step on; its
        copies overlap this step's forward pass instead of delaying one."""
        head = next((seq for seq in self.waiting if seq.num_uncomputed), None)  # the next to run
        if head is None or not self.block_manager.is_swapped(head.seq_id):
            return
        if self.block_manager.can_swap_in([head.seq_id], extra=len(self.running)) and self.readable(head):
            self.block_manager.swap_in([head.seq_id])
            self.num_swapped_in += 1
            self.num_prefetched += 1

    def start_static_batch(self) -> None:
        """Static batching: the next max_num_seqs requests form a batch that runs to its end.
        Their prefills may still be spread over several steps by the token budget."""
        while self.waiting and self.has_seats_for(self.waiting[0]):
            self.start_running(self.waiting[0])

    def start_running(self, seq: Sequence) -> None:
        """A waiting sequence joins the running ones."""
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_seats_for(self, seq: Sequence) -> bool:
        """At most max_num_seqs sequences run at once, counting the forks that running requests
        will make at their first sampling (n - 1 samples, beam_width - 1 beams) as taken."""
        taken = sum(1 + self.forks_to_come(running) for running in self.running)
        return taken + 1 + self.forks_to_come(seq) <= self.max_num_seqs

    @staticmethod
    def forks_to_come(seq: Sequence) -> int:
        return seq.params.num_outputs - 1 if not seq.output_ids else 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A parallel sample or a beam joins beside its parent, sharing all its blocks. A fork the
        parent's admission reserved a seat for always fits; a parent swapped out (or brought back
        but not yet running) keeps its child next to it in the queue. A later beam fork (a
        sibling's seat may have gone to another request while that sibling was preempted) or the
        child of a parent preempted by recompute waits instead, to be computed again."""
        running = parent.status is Status.RUNNING
        if not self.block_manager.has_table(parent.seq_id) or \
                (running and parent.output_ids and not self.has_seats_for(child)):
            child.forget_cache()
            child.status = Status.WAITING
            self.waiting.append(child)
            return
        self.block_manager.fork(parent.seq_id, child.seq_id)
        if running:
            self.running.append(child)
        else:
            self.waiting.insert(self.waiting.index(parent) + 1, child)

    def preempt(self, seq: Sequence, front: bool = True, protect: Sequence | None = None) -> None:
        """Take `seq` off the device: by swap (with its request's other running sequences, except
        `protect`, the one the room is made for) when the policy says so and a tier has room, else
        by recompute."""
        victims = self.swap_victims(seq, protect)
        if victims:
            self.block_manager.swap_out([victim.seq_id for victim in victims])
            self.num_swapped_out += len(victims)
        else:
            victims = [seq]
            if self.block_manager.has_table(seq.seq_id):  # a static-batch member may not have started
                self.block_manager.free(seq.seq_id)
            self.num_recomputed_tokens += seq.num_computed
            seq.forget_cache()
        for victim in victims:
            self.running.remove(victim)
            victim.status = Status.WAITING
            victim.num_preemptions += 1
            self.num_preemptions += 1
        self.pressure.took("preempt", len(victims))
        if front:
            self.waiting.extendleft(reversed(victims))
        else:
            self.waiting.extend(victims)

    def swap_victims(self, seq: Sequence, protect: Sequence | None) -> list[Sequence]:
        """The sequences to swap out with `seq` (its request's running ones that this step has not
        scheduled, `protect` excepted), or [] to recompute."""
        manager = self.block_manager
        if not manager.has_table(seq.seq_id):
            return []
        group = [s for s in self.running if s.request_id == seq.request_id and manager.has_table(s.seq_id)
                 and s.seq_id not in self.scheduled_ids and (s is seq or s is not protect)]
        swap = self.pressure.preempt_by([s.seq_id for s in group], sum(s.num_computed for s in group)) == "swap"
        return group if swap else []

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a sequence (finished, pruned, aborted): it leaves the queues and its blocks go back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.block_manager.has_table(seq.seq_id):  # running, or swapped out while waiting
            self.block_manager.free(seq.seq_id)
        seq.finish(reason, error)
        if reason in ("eos", "length"):
            self.admission.finished(seq)

    # ----------------------------------------------------------------- after the forward pass
    def computed(self, schedule: Schedule) -> int:
        """The step's tokens now have their K/V in the pool: newly full blocks become findable in
        the prefix cache, and sequences over their budget evict. Returns the entries evicted."""
        cache, evicted = self.block_manager.prefix_cache, 0
        evicts = self.evictor is not None and self.pressure.evicts_now()
        for item in schedule.sequences:
            seq = item.seq
            seq.num_computed += item.num_tokens
            if cache and seq.num_evicted == 0:  # once it evicts, its table no longer maps positions to blocks
                cache.register(seq.seq_id, self.block_manager.table(seq.seq_id), seq.token_ids, seq.num_computed)
            if evicts:
                dropped, seq.attention_mass, seq.kv_positions = self.evictor.shrink(
                    seq.seq_id, seq.num_cached, seq.num_computed, len(seq.prompt_ids), seq.max_len,
                    seq.attention_mass, seq.kv_positions)
                seq.num_evicted += dropped
                evicted += dropped
        self.pressure.took("evict", evicted)
        return evicted

    def cached_entries(self) -> dict[int, int]:
        """seq_id -> KV entries it holds now, for every running sequence (memory accounting)."""
        return {seq.seq_id: seq.num_cached for seq in self.running}
