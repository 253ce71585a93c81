"""The KV cache manager: the memory system behind one door.

The scheduler decides *who* runs; this object decides *where their keys and values live*, and is
the scheduler's one counterpart about memory (vLLM v1 calls it the KVCacheManager, mini-sglang
the CacheManager). It owns every part of the memory system and answers in the scheduler's words:

    allocate(seq, ...)   blocks for a sequence's next chunk: prefix hits adopted, a swapped-out
                         sequence brought back, the table grown, shared blocks copied; or "no"
    preempt(...)         take a victim off the device, by swap or by recompute (its cost model)
    prefetch(...)        bring a swapped-out sequence back one step early
    fork / free          a parallel sample or beam shares its parent's blocks; blocks go back
    computed(...)        after a forward pass: full blocks registered, eviction budgets kept
    take_copies()        every block copy decided (swaps, spills, copy-on-write), in order
    apply(...)           ...performed by the tiers before the forward pass that reads them
    snapshot(...)        one read-only picture of all of it (`accounting.MemorySnapshot`)
    subscribe(...)       every change of a block's life from now on, as events (`events.py`)
    rollback             how far a sequence may guess, and its rejected guesses cut (`rollback.py`)

Inside, each part keeps its one job: `BlockManager` (tables, refcounts, copy-on-write) and its
`TierMoves` (swaps, spills, bring-backs over the same tables), `PrefixCache` (blocks found by
content), the pools (tensors), `TieredKV` (host and disk, the copies), `Evictor` (budgets, and
every sequence's H2O scores and entry positions: one owner), `SwapCost` (swap or recompute,
measured), `PressureLadder` (what to give up first).

When the device pool runs short, the pressure ladder (`pressure.py`) says what to give up,
cheapest first: reclaim cached blocks nobody holds, preempt (swap or recompute, measured), evict
(only if allowed); this object obeys it, and the scheduler only chooses the victims.

It imports neither the engine nor attention and knows no `Sequence`: it is told ids and counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from minillm.config import EngineConfig, ModelConfig
from minillm.memory.accounting import MemorySnapshot, MemoryStats, paged_stats, take_snapshot
from minillm.memory.block_manager import BlockManager
from minillm.memory.events import EntriesEvicted, Subscriber
from minillm.memory.eviction import Evictor
from minillm.memory.prefix_cache import PrefixMiss
from minillm.memory.pressure import PressureLadder
from minillm.memory.rollback import Rollback
from minillm.memory.sessions import load_session, save_session
from minillm.memory.tiers import SwapCost, TieredKV

COUNTERS = ("swapped_out", "swapped_in", "prefetched", "recomputed_tokens")


@dataclass(frozen=True)
class Allocation:
    """What `allocate` granted: `num_tokens` to compute now (0: memory is short, try later),
    starting at `num_computed`. `restart`: the sequence starts afresh (it held no blocks, or its
    swapped-out KV was lost), its cache holding exactly its first `num_computed` tokens, those
    the prefix cache gave (0 without a hit). `miss`: why the prefix cache's hit ended where it
    did, when the sequence looked its prompt up (it started, with prefix caching on)."""

    num_tokens: int
    num_computed: int
    restart: bool
    miss: PrefixMiss | None = None


class KVCacheManager:
    def __init__(
        self,
        block_manager: BlockManager,
        tiers: TieredKV | None = None,
        preemption: str = "recompute",
        evictor: Evictor | None = None,
        eviction_trigger: str | None = None,
    ):
        """`preemption`: "recompute", "swap" or "auto"; `eviction_trigger`: None (no eviction),
        "always" or "pressure"."""
        self.block_manager, self.tiers, self.evictor = block_manager, tiers, evictor
        self.moves = block_manager.moves  # swaps, spills, bring-backs over the block manager's tables
        self.block_size = block_manager.block_size
        self.num_blocks = block_manager.num_blocks  # device blocks: the pool attention reads
        self.pool = tiers.device if tiers else None  # what attention reads and writes
        self._quantized = self.pool is not None and self.pool.quantized  # told in each `Filled`
        # swap or recompute is only a question with somewhere to swap to: without, nothing is timed
        self.swap_cost = SwapCost(tiers) if tiers and (tiers.host or tiers.disk) else None
        self.ladder = PressureLadder(self.moves, preemption, self.swap_cost, eviction_trigger)
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.events = block_manager.events
        self.rollback = Rollback(block_manager, self.pool, evictor)  # speculation's guesses undone

    @classmethod
    def build(cls, config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device) -> KVCacheManager:
        """The memory system a run's switches ask for: the tiers (`TieredKV.build`), the block
        manager over them, an evictor."""
        tiers = TieredKV.build(config, model, dtype, device)
        host_blocks, disk = (tiers.host.num_blocks if tiers.host else 0), tiers.disk is not None
        blocks = BlockManager(
            tiers.device.num_blocks, config.block_size, config.prefix_caching, host_blocks, disk, config.spill
        )
        evictor = None
        if config.eviction != "none":
            shape = (model.num_layers, model.num_kv_heads)
            evictor = Evictor(config.eviction, config.kv_budget, tiers, blocks, *shape)
        preemption = config.preemption if config.has_tiers else "recompute"
        return cls(blocks, tiers, preemption, evictor, config.eviction_trigger if evictor else None)

    # ---------------------------------------------------------------- what the scheduler asks
    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.block_manager.blocks_for(num_tokens)

    def has_blocks(self, seq_id: int) -> bool:
        """Does the sequence hold a block table (running, or swapped out)?"""
        return self.block_manager.has_table(seq_id)

    def num_held(self, seq_id: int) -> int:
        """Blocks in the sequence's table (0 without one)."""
        return len(self.block_manager.table(seq_id)) if self.has_blocks(seq_id) else 0

    def is_swapped(self, seq_id: int) -> bool:
        return self.moves.is_swapped(seq_id)

    def holders_of_device_blocks(self) -> set[int]:
        return self.moves.holders_of_device_blocks()

    def cached_prefix_blocks(self, seq_id: int, token_ids: list[int]) -> int:
        """Leading blocks of a sequence not yet started that the prefix cache holds."""
        cache = self.block_manager.prefix_cache
        return len(cache.lookup(token_ids)) if cache and not self.has_blocks(seq_id) else 0

    def most_held(self, prompt_len: int, max_len: int, step_tokens: int) -> int:
        """Tokens a sequence holds at most at once: all of them, or with eviction what it keeps
        (protected prefix and budget) plus one step's tokens before it evicts."""
        if self.evictor is None:
            return max_len
        return min(max_len, self.evictor.kept(prompt_len, max_len) + step_tokens)

    # ---------------------------------------------------------------- giving blocks
    def allocate(
        self,
        seq_id: int,
        token_ids: list[int],
        num_computed: int,
        num_cached: int,
        budget: int,
        use_cache: bool = True,
    ) -> Allocation:
        """Blocks for the sequence's next chunk of at most `budget` tokens, or num_tokens=0 if memory
        is short. A sequence without blocks first looks for its prompt's leading blocks in the prefix
        cache (unless `use_cache` is False: it needs every prompt token's logits): those tokens need
        no computing at all. A swapped-out one comes back first (or, if its KV cannot, starts over)."""
        manager, moves = self.block_manager, self.moves
        cache = manager.prefix_cache if use_cache else None
        if moves.is_swapped(seq_id) and not self._can_come_back(seq_id, len(token_ids), num_cached, budget):
            self._forget(seq_id, num_computed)
            num_computed = num_cached = 0
        starting = not manager.has_table(seq_id)
        hits = cache.lookup(token_ids) if cache and starting else []
        skipped = len(hits) * manager.block_size  # prompt tokens whose K/V the cache already holds
        num_tokens = min(len(token_ids) - num_computed - skipped, budget)
        start = num_cached + skipped  # cache index of the chunk's first token
        end = start + num_tokens
        copies = len(manager.shared_blocks(seq_id, start, end))
        if moves.is_swapped(seq_id):  # its blocks come back first, then it grows
            if not moves.can_swap_in([seq_id], extra=manager.blocks_missing(seq_id, end) + copies):
                return Allocation(0, num_computed, starting)
            moves.swap_in([seq_id])
            self.counters["swapped_in"] += 1
            copies = len(manager.shared_blocks(seq_id, start, end))  # blocks it shares again
        if not manager.can_grow(seq_id, end, adopting=hits, copies=copies):
            return Allocation(0, num_computed, starting)
        miss = None
        if cache and starting:
            miss = cache.record_lookup(token_ids, hits)
            manager.adopt(seq_id, hits)
            num_computed = skipped
        manager.grow(seq_id, end)
        manager.copy_on_write(seq_id, start, end)
        return Allocation(num_tokens, num_computed, starting, miss)

    def _can_come_back(self, seq_id: int, num_tokens: int, num_cached: int, budget: int) -> bool:
        """Can the swapped sequence's blocks return and take its next chunk? Not if a disk file is
        lost, nor if even the whole pool is too small: its samples shared a half-filled block that
        each must now copy, say, where recomputing it alone would fit."""
        manager = self.block_manager
        start, end = num_cached, num_cached + min(num_tokens - num_cached, budget)
        off_device = self.moves.held_off_device([seq_id])
        needed = (
            len(off_device)
            + manager.blocks_missing(seq_id, end)
            + len(manager.shared_blocks(seq_id, start, end))
        )
        return needed <= manager.num_blocks and self.tiers.readable(off_device)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (writes copy first) and starts with a copy
        of its eviction state."""
        self.block_manager.fork(parent_id, child_id)
        if self.evictor:
            self.evictor.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        """The sequence is done (or starts over): its blocks go back, its eviction state goes."""
        if self.block_manager.has_table(seq_id):
            self.block_manager.free(seq_id)
        if self.evictor:
            self.evictor.forget(seq_id)

    def _forget(self, seq_id: int, num_computed: int) -> None:
        """The sequence's KV is thrown away: it will be recomputed."""
        self.free(seq_id)
        self.counters["recomputed_tokens"] += num_computed

    # ---------------------------------------------------------------- making room (the ladder's rung 3)
    def preempt(self, victim: int, num_computed: int, swap_group: dict[int, int]) -> list[int]:
        """Take `victim` (`num_computed` tokens) off the device. `swap_group`: seq_id -> tokens
        computed, of the sequences that would leave with it by swap (its request's running ones,
        which share blocks; empty if the victim holds none). By swap, when a tier can take their
        device blocks and the policy or the cost model prefers it, the group moves to the host (or
        disk) and keeps its tables; otherwise the victim alone is freed, to be recomputed.
        Returns the sequences that left."""
        if swap_group and self.ladder.prefers_swap(list(swap_group), sum(swap_group.values())):
            self.moves.swap_out(list(swap_group))
            self.counters["swapped_out"] += len(swap_group)
            left = list(swap_group)
        else:
            self._forget(victim, num_computed)
            left = [victim]
        self.ladder.took("preempt", len(left))
        return left

    def prefetch(self, seq_id: int, spare_blocks: int) -> bool:
        """Bring a swapped-out sequence back now if its blocks fit with `spare_blocks` left free (and
        its disk files read back): it runs from the next step on, its copies behind this step's
        forward pass (`apply`) instead of delaying one."""
        moves = self.moves
        fits = moves.can_swap_in([seq_id], extra=spare_blocks)
        if not fits or not self.tiers.readable(moves.held_off_device([seq_id])):
            return False
        moves.swap_in([seq_id])
        self.counters["swapped_in"] += 1
        self.counters["prefetched"] += 1
        return True

    # ---------------------------------------------------------------- copies and the forward pass
    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies decided since the last call, in order: the one
        queue every copy goes through (swaps, spills, bring-backs, copy-on-write)."""
        return self.block_manager.take_copies()

    def apply(self, copies: list[tuple[int, int]], prefetch: list[tuple[int, int]] = ()) -> None:
        """Before a forward pass: perform `copies` in order, let the pool forget what freed blocks
        staged, and start `prefetch` in the background (`finish_prefetch` waits for it)."""
        if copies:
            self.tiers.copy(copies)
        refcounts = self.block_manager.refcounts
        self.pool.forget_free_blocks(lambda block: refcounts[block] == 0)
        if prefetch:
            self.tiers.start_prefetch(list(prefetch))

    def finish_prefetch(self) -> None:
        if self.swap_cost:  # a prefetch needs a tier to come back from
            self.tiers.finish_prefetch()

    def record_forward(self, tokens: int, sequences: int, seconds: float) -> None:
        """A forward pass's timing: the cost model learns the prefill rate from it."""
        if self.swap_cost:
            self.swap_cost.record_forward(tokens, sequences, seconds)

    # ---------------------------------------------------------------- what attention reads
    def table(self, seq_id: int) -> list[int]:
        return self.block_manager.table(seq_id)

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slot ids of cache entries start..end-1, after checking they may be written."""
        self.block_manager.check_writable(seq_id, start, end)
        return self.block_manager.slots(seq_id, start, end)

    @property
    def keeps_attention_mass(self) -> bool:
        """Does attention report the attention each entry receives (H2O scores keys by it)?"""
        return self.evictor is not None and self.evictor.policy == "h2o"

    def attention_mass(self, seq_id: int, num_entries: int | None = None) -> torch.Tensor | None:
        """H2O: the sequence's accumulator (layers, kv_heads, entries), grown to `num_entries`;
        attention adds to it (`Evictor.attention_mass`). None without H2O."""
        return self.evictor.attention_mass(seq_id, num_entries) if self.evictor else None

    def kv_positions(self, seq_id: int) -> torch.Tensor | None:
        """(layers, kv_heads, entries) the token each entry holds, once eviction moved entries."""
        return self.evictor.positions(seq_id) if self.evictor else None

    # ---------------------------------------------------------------- after the forward pass
    def computed(
        self,
        seq_id: int,
        token_ids: list[int],
        num_computed: int,
        num_cached: int,
        prompt_len: int,
        max_len: int,
    ) -> int:
        """The sequence's first `num_computed` tokens of `token_ids` (`num_cached` entries) now have
        their K/V in the pool: newly full blocks become findable in the prefix cache, and a
        sequence over its budget evicts. Returns the entries it dropped."""
        cache = self.block_manager.prefix_cache
        self.block_manager.filled(seq_id, num_cached, self._quantized)
        if cache and num_cached == num_computed:  # once it evicts, its table no longer maps positions
            cache.register(seq_id, self.block_manager.table(seq_id), token_ids, num_computed)
        if not self.ladder.evicts_now():
            return 0
        dropped = self.evictor.shrink(seq_id, num_cached, num_computed, prompt_len, max_len)
        self.ladder.took("evict", dropped)
        if dropped and self.events:
            self.events.emit(EntriesEvicted(seq_id, dropped))
        return dropped

    def end_step(self) -> dict[str, int]:
        """This step's rungs of the pressure ladder, in ladder order."""
        return self.ladder.end_step()

    # ---------------------------------------------------------------- sessions
    def save_session(self, path: Path, token_ids: list[int], identity: dict, extra: dict | None) -> int:
        """Park the cached KV of `token_ids` in a file (`sessions.py`); returns the tokens kept."""
        self.finish_prefetch()
        return save_session(Path(path), self.block_manager, self.tiers, token_ids, identity, extra)

    def load_session(self, path: Path, identity: dict[str, str]) -> tuple[list[int], dict]:
        """Load a parked session's KV as cached prefix blocks; returns (its token ids, its extra)."""
        self.finish_prefetch()
        return load_session(Path(path), self.block_manager, self.tiers, identity)

    # ---------------------------------------------------------------- events (events.py)
    def subscribe(self, subscriber: Subscriber) -> None:
        """`subscriber(step, event)` hears every change of a block's life from now on, first a
        `Snapshot` of the state now."""
        self.block_manager.subscribe(subscriber, self.pool.bytes_per_slot)

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.events.remove(subscriber)

    def begin_step(self, step: int) -> None:
        """The events from now on belong to engine step `step`."""
        self.events.step = step

    # ---------------------------------------------------------------- pictures and numbers
    def memory_stats(self, live_tokens: dict[int, int]) -> MemoryStats:
        """live_tokens: seq_id -> KV entries it stores in the device pool now."""
        return paged_stats(self.block_manager, live_tokens, self.pool.bytes_per_slot, self.tiers.moved())

    def snapshot(self, sequences: list[tuple], counters: dict[str, int]) -> MemorySnapshot:
        """The picture. `sequences`: (seq_id, request_id, status, num_computed, num_cached, max_len)
        of every unfinished sequence, running ones first; `counters`: the scheduler's own (preemptions)."""
        every_counter, preemption = {**counters, **self.counters}, self.ladder.preemption
        return take_snapshot(
            self.block_manager, self.tiers, sequences, every_counter, preemption, self.swap_cost
        )
