"""The KV cache manager: the memory system behind one door.

The scheduler decides *who* runs; this object decides *where their keys and values live*, and is
the engine's one counterpart about memory (vLLM v1 calls it the KVCacheManager, mini-sglang
the CacheManager). It owns every part of the memory system and answers in the scheduler's words:

    capacity()           what planning needs, fixed for the run: blocks, block size, budgets
    num_free_blocks, holding(seq), holders_of_device_blocks,
    cached_prefix_blocks what the scheduler counts on, asked as it plans
    allocate(seq, ...)   blocks for a sequence's next chunk: prefix hits adopted, a swapped-out
                         sequence brought back, the table grown, shared blocks copied; or "no"
    preempt(...)         take a victim off the device, by swap or by recompute (its cost model)
    fork / free          a parallel sample or beam shares its parent's blocks; blocks go back
    apply(bring_back)    before the forward pass, every block copy decided (swaps, spills,
                         copy-on-write) performed in order; a swapped-out sequence brought back
                         one step early, its copies behind the pass (prefetch)
    pool() / append(...) the tensors attention uses, and where a chunk's K/V go (slots) with the
                         table its history is read through
    computed(...)        after a forward pass: attention's scores kept, full blocks registered,
                         eviction budgets kept
    rollback(...)        speculation's rejected guesses cut (`rollback.py`)
    begin_step / end_step   a step's events numbered, its pass timed, who ran told; its numbers
    sessions()           a conversation's KV parked in a file, and back (`sessions.Sessions`)
    fetch_remote / install_remote   a prompt's blocks asked of the store engines share, and put
                         into the pool as cached prefix blocks when they come (`remote.py`)
    snapshot(...)        one read-only picture of all of it (`accounting.MemorySnapshot`)
    subscribe(...)       every change of a block's life from now on, as events (`events.py`);
                         it returns the call that stops them
    eviction_state / check_invariants   what a test looks at: H2O scores and entry positions; the
                         block manager's invariants, and the state the events rebuild

Inside, each part keeps its one job: `BlockManager` (tables, refcounts, copy-on-write) and its
`TierMoves` (swaps, spills, bring-backs over the same tables), `PrefixCache` (blocks found by
content), the pools (tensors), `TieredKV` (host and disk, the copies), `Evictor` (budgets, and
every sequence's H2O scores and entry positions: one owner), `SwapCost` (swap or recompute,
measured), `PressureLadder` (what to give up first). None of them is reached from outside.

When the device pool runs short, the pressure ladder (`pressure.py`) says what to give up,
cheapest first: reclaim cached blocks nobody holds, preempt (swap or recompute, measured), evict
(only if allowed); this object obeys it, and the scheduler only chooses the victims.

It imports neither the engine nor attention and knows no `Sequence`: it is told ids and counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from minillm.config import EngineConfig, ModelConfig
from minillm.memory.accounting import MemorySnapshot, MemoryStats, paged_stats, take_snapshot
from minillm.memory.block_manager import BlockManager
from minillm.memory.events import EntriesEvicted, Preempted, Step, Subscriber
from minillm.memory.eviction import Evictor
from minillm.memory.prefix_cache import PrefixMiss
from minillm.memory.pressure import PressureLadder
from minillm.memory.remote import Fetch, RemoteKV
from minillm.memory.replay import Replayer
from minillm.memory.rollback import Rollback, room_to_guess
from minillm.memory.sessions import Sessions
from minillm.memory.tiers import SwapCost, TieredKV

COUNTERS = ("swapped_out", "swapped_in", "prefetched", "recomputed_tokens")


def _never_swapped() -> bool:
    return False


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


@dataclass(frozen=True)
class Holding:
    """What a sequence holds now: a block table of `num_blocks` (`has_table`: running, or swapped
    out; without one it never started, or was forgotten), and whether it is off the device."""

    has_table: bool
    num_blocks: int
    _is_swapped: Callable[[], bool]

    @property
    def swapped(self) -> bool:
        """Asked only when read: with tiers the answer walks the table, and the scheduler asks
        `has_table` of many sequences a step, `swapped` of few."""
        return self._is_swapped()


@dataclass(frozen=True)
class Capacity:
    """What the scheduler plans with, fixed for the run: the device pool's `num_blocks` blocks of
    `block_size` token slots, whether attention must report the attention each entry receives
    (H2O scores keys by it), and the bounds eviction (`kept`: entries a sequence holds at most
    after a step, by prompt length and length limit; None without eviction) and keys quantized
    per block (`fills_are_final`) put on a sequence."""

    num_blocks: int
    block_size: int
    keeps_attention_mass: bool
    kept: Callable[[int, int], int] | None
    fills_are_final: bool

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def most_held(self, prompt_len: int, max_len: int, step_tokens: int) -> int:
        """Tokens a sequence holds at most at once: all of them, or with eviction what it keeps
        (protected prefix and budget) plus one step's tokens before it evicts."""
        if self.kept is None:
            return max_len
        return min(max_len, self.kept(prompt_len, max_len) + step_tokens)

    def room_to_guess(self, num_cached: int, prompt_len: int, max_len: int) -> int:
        """Speculated entries a sequence may write after its next token and still roll back
        exactly (`rollback.room_to_guess`)."""
        kept = self.kept(prompt_len, max_len) if self.kept else None
        return room_to_guess(num_cached, max_len, kept, self.block_size, self.fills_are_final)


class KVCacheManager:
    def __init__(
        self,
        block_manager: BlockManager,
        tiers: TieredKV | None = None,
        preemption: str = "recompute",
        evictor: Evictor | None = None,
        eviction_trigger: str | None = None,
        remote: RemoteKV | None = None,
    ):
        """`preemption`: "recompute", "swap" or "auto"; `eviction_trigger`: None (no eviction),
        "always" or "pressure"; `remote`: the store engines share, or None."""
        self._blocks, self._tiers, self._evictor = block_manager, tiers, evictor
        self._moves = block_manager.moves  # swaps, spills, bring-backs over the block manager's tables
        self._pool = tiers.device if tiers else None  # what attention reads and writes
        self._quantized = self._pool is not None and self._pool.quantized  # told in each `Filled`
        # swap or recompute is only a question with somewhere to swap to: without, nothing is timed
        self._swap_cost = SwapCost(tiers) if tiers and (tiers.host or tiers.disk) else None
        self._ladder = PressureLadder(self._moves, preemption, self._swap_cost, eviction_trigger)
        self._remote = remote
        # the prefill rate measured from the passes: swap or recompute weighs it, and a remote fetch
        #   is waited for no longer than prefilling its tokens would take
        self._prefill = self._swap_cost or (SwapCost(tiers) if remote else None)
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._events = block_manager.events
        self._rollback = Rollback(block_manager, self._pool, evictor)  # speculation's guesses undone

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        model: ModelConfig,
        dtype: torch.dtype,
        device,
        identity: dict[str, str] | None = None,
    ) -> KVCacheManager:
        """The memory system a run's switches ask for: the tiers (`TieredKV.build`), the block
        manager over them, an evictor, the remote store (`identity`: what the engine's KV depends
        on, which names its blocks there)."""
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
        remote = None
        if config.remote_kv is not None:
            remote = RemoteKV(config.remote_kv, config.remote_kv_ttl, identity, blocks, tiers)
        trigger = config.eviction_trigger if evictor else None
        return cls(blocks, tiers, preemption, evictor, trigger, remote)

    # ---------------------------------------------------------------- what the scheduler asks
    def capacity(self) -> Capacity:
        evictor = self._evictor
        return Capacity(
            self._blocks.num_blocks,
            self._blocks.block_size,
            evictor is not None and evictor.policy == "h2o",
            evictor.kept if evictor else None,
            self._pool is not None and self._pool.fills_are_final,
        )

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free_blocks

    def holding(self, seq_id: int) -> Holding:
        if not self._blocks.has_table(seq_id):
            return Holding(False, 0, _never_swapped)
        return Holding(True, len(self._blocks.table(seq_id)), lambda: self._moves.is_swapped(seq_id))

    def holders_of_device_blocks(self) -> set[int]:
        return self._moves.holders_of_device_blocks()

    def cached_prefix_blocks(self, seq_id: int, token_ids: list[int]) -> int:
        """Leading blocks of a sequence not yet started that the prefix cache holds."""
        cache = self._blocks.prefix_cache
        return len(cache.lookup(token_ids)) if cache and not self._blocks.has_table(seq_id) else 0

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
        manager, moves = self._blocks, self._moves
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
            self._counters["swapped_in"] += 1
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
        manager = self._blocks
        start, end = num_cached, num_cached + min(num_tokens - num_cached, budget)
        off_device = self._moves.held_off_device([seq_id])
        needed = (
            len(off_device)
            + manager.blocks_missing(seq_id, end)
            + len(manager.shared_blocks(seq_id, start, end))
        )
        return needed <= manager.num_blocks and self._tiers.readable(off_device)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (writes copy first) and starts with a copy
        of its eviction state."""
        self._blocks.fork(parent_id, child_id)
        if self._evictor:
            self._evictor.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        """The sequence is done (or starts over): its blocks go back, its eviction state goes."""
        if self._blocks.has_table(seq_id):
            self._blocks.free(seq_id)
        if self._evictor:
            self._evictor.forget(seq_id)

    def _forget(self, seq_id: int, num_computed: int) -> None:
        """The sequence's KV is thrown away: it will be recomputed."""
        self.free(seq_id)
        self._counters["recomputed_tokens"] += num_computed

    # ---------------------------------------------------------------- making room (the ladder's rung 3)
    def preempt(
        self, victim: int, num_computed: int, swap_group: dict[int, int], for_seq: int = -1
    ) -> list[int]:
        """Take `victim` (`num_computed` tokens) off the device, to make room for `for_seq` (-1: for
        the queue). `swap_group`: seq_id -> tokens computed, of the sequences that would leave with
        it by swap (its request's running ones, which share blocks; empty if the victim holds none).
        By swap, when a tier can take their device blocks and the policy or the cost model prefers
        it, the group moves to the host (or disk) and keeps its tables; otherwise the victim alone
        is freed, to be recomputed. Returns the sequences that left."""
        if swap_group and self._ladder.prefers_swap(list(swap_group), sum(swap_group.values())):
            self._moves.swap_out(list(swap_group))
            self._counters["swapped_out"] += len(swap_group)
            left, how = list(swap_group), "swap"
        else:
            self._forget(victim, num_computed)
            left, how = [victim], "recompute"
        self._ladder.took("preempt", len(left))
        if self._events:
            self._events.emit(Preempted(tuple(left), how, for_seq))
        return left

    # ---------------------------------------------------------------- copies and the forward pass
    def apply(self, bring_back: tuple[int, int] | None = None) -> None:
        """Before a forward pass: perform every block copy decided since the last call, in order (the
        one queue of swaps, spills, bring-backs and copy-on-write), and let the pool forget what
        freed blocks staged. `bring_back`: (seq_id, spare_blocks), a swapped-out sequence to run from
        the next step on, brought back now if its blocks fit with `spare_blocks` left free (and its
        disk files read back); its copies run behind this forward pass (the next `begin_step` waits
        for them) instead of delaying a step."""
        copies = self._blocks.take_copies()
        if copies:
            self._tiers.copy(copies)
        refcounts = self._blocks.refcounts
        self._pool.forget_free_blocks(lambda block: refcounts[block] == 0)
        if bring_back is not None and self._prefetch(*bring_back):
            self._tiers.start_prefetch(self._blocks.take_copies())

    def _prefetch(self, seq_id: int, spare_blocks: int) -> bool:
        moves = self._moves
        fits = moves.can_swap_in([seq_id], extra=spare_blocks)
        if not fits or not self._tiers.readable(moves.held_off_device([seq_id])):
            return False
        moves.swap_in([seq_id])
        self._counters["swapped_in"] += 1
        self._counters["prefetched"] += 1
        return True

    def pool(self):
        """The device pool (`pool.py` or `quantized_pool.py`): the tensors attention reads and writes."""
        return self._pool

    def append(self, seq_id: int, start: int, end: int) -> tuple[list[int], list[int]]:
        """The sequence appends cache entries start..end-1 this step: their slot ids (after checking
        they may be written), and its block table, through which attention reads its history."""
        self._blocks.check_writable(seq_id, start, end)
        return self._blocks.slots(seq_id, start, end), self._blocks.table(seq_id)

    # ---------------------------------------------------------------- after the forward pass
    def computed(
        self,
        seq_id: int,
        token_ids: list[int],
        num_computed: int,
        num_cached: int,
        prompt_len: int,
        max_len: int,
        attention: list[tuple[torch.Tensor, int]] = (),
    ) -> int:
        """The sequence's first `num_computed` tokens of `token_ids` (`num_cached` entries) now have
        their K/V in the pool, and its entries got `attention` from this step's queries (H2O: mass
        (layers, kv_heads, longest) and the entries it covers, per query): H2O's scores grow, newly
        full blocks become findable in the prefix cache, and a sequence over its budget evicts.
        Returns the entries it dropped."""
        for mass, end in attention:
            self._evictor.attention_mass(seq_id, end)[..., :end] += mass[..., :end]
        cache = self._blocks.prefix_cache
        self._blocks.filled(seq_id, num_cached, self._quantized)
        if cache and num_cached == num_computed:  # once it evicts, its table no longer maps positions
            cache.register(seq_id, self._blocks.table(seq_id), token_ids, num_computed)
        if not self._ladder.evicts_now():
            return 0
        dropped = self._evictor.shrink(seq_id, num_cached, num_computed, prompt_len, max_len)
        self._ladder.took("evict", dropped)
        if dropped and self._events:
            self._events.emit(EntriesEvicted(seq_id, dropped))
        return dropped

    def rollback(self, seq_id: int, num_entries: int) -> None:
        """Speculation: keep only the sequence's first `num_entries` entries (`Rollback.truncate`)."""
        self._rollback.truncate(seq_id, num_entries)

    def eviction_state(self, seq_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What eviction keeps of a sequence, to look at: its H2O scores and the token each entry
        holds once entries moved, (layers, kv_heads, entries) each, or None."""
        if self._evictor is None:
            return None, None
        return self._evictor.attention_mass(seq_id), self._evictor.positions(seq_id)

    # ---------------------------------------------------------------- one step's bookkeeping
    def begin_step(self, step: int) -> None:
        """Engine step `step` begins: the events from now on belong to it, and the last step's
        background copies (prefetch) are done before anything is decided."""
        self._events.step = step
        self._finish_prefetch()

    def end_step(
        self,
        ran: list[tuple[int, str, int, int]],
        forward_seconds: float,
        seconds: float,
        live: dict[int, int],
        queue: Callable[[], list[tuple[int, str]]] = list,
    ) -> tuple[MemoryStats, dict[str, int]]:
        """The step is over. `ran`: (seq_id, request_id, tokens computed, KV entries attention read)
        of each sequence in its forward pass, which took `forward_seconds` of the step's `seconds`;
        `live`: seq_id -> KV entries each running sequence stores now; `queue()`: (seq_id,
        request_id) of the waiting, asked only if somebody listens. The cost model learns the
        prefill rate from the pass, a `Step` event tells who ran and who waits. Returns the
        memory's numbers now and this step's rungs of the pressure ladder, in ladder order."""
        if self._prefill:
            tokens = sum(num_tokens for _, _, num_tokens, _ in ran)
            self._prefill.record_forward(tokens, len(ran), forward_seconds)
        if self._events:
            self._events.emit(Step(seconds, tuple(ran), tuple(queue())))
        stats = paged_stats(self._blocks, live, self._pool.bytes_per_slot, self._tiers.moved())
        return stats, self._ladder.end_step()

    def _finish_prefetch(self) -> None:
        if self._swap_cost:  # a prefetch needs a tier to come back from
            self._tiers.finish_prefetch()

    # ---------------------------------------------------------------- sessions
    def sessions(self) -> Sessions:
        """Parking a conversation's KV in a file and loading it back (`sessions.py`)."""
        return Sessions(self._blocks, self._tiers, self._finish_prefetch)

    # ---------------------------------------------------------------- the remote store (remote.py)
    def fetch_remote(self, token_ids: list[int]) -> Fetch | None:
        """Ask the shared store for the prompt's full blocks after those cached here; None without a
        store, when it is backing off, or when there is nothing to ask for. The engine holds the
        request until `fetch.ended`, then calls `install_remote`."""
        if self._remote is None:
            return None
        return self._remote.fetch(token_ids, self._prefill.prefill_rate())

    def install_remote(self, fetch: Fetch) -> int:
        """The blocks a fetch brought, as cached prefix blocks (nothing if it came too late).
        Returns how many."""
        self._finish_prefetch()  # no block is written while a prefetch may copy into the pool
        return self._remote.install(fetch)

    # ---------------------------------------------------------------- events and pictures
    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """`subscriber(step, event)` hears every change of a block's life from now on, first a
        `Snapshot` of the state now. Returns the call that stops it hearing."""
        self._blocks.subscribe(subscriber, self._pool.bytes_per_slot)
        return lambda: self._events.remove(subscriber)

    def check_invariants(self, replayed: Replayer | None = None) -> None:
        """Raise AssertionError if the block manager's invariants are broken (`BlockManager`), or
        if the state `replayed` rebuilt from the events alone differs from the real one (tables,
        refcounts, prefix-cache keys): what the tests and the soaks check after a step."""
        self._blocks.check_invariants()
        if replayed is not None:
            cache = self._blocks.prefix_cache
            keys = {block: entry.key for block, entry in cache.entries.items()} if cache else {}
            replayed.check(self._blocks.block_tables, self._blocks.refcounts, keys)

    def snapshot(self, sequences: list[tuple], counters: dict[str, int]) -> MemorySnapshot:
        """The picture. `sequences`: (seq_id, request_id, status, num_computed, num_cached, max_len)
        of every unfinished sequence, running ones first; `counters`: the scheduler's own (preemptions)."""
        every_counter, preemption = {**counters, **self._counters}, self._ladder.preemption
        remote = self._remote.stats() if self._remote else None
        return take_snapshot(
            self._blocks, self._tiers, sequences, every_counter, preemption, self._swap_cost, remote
        )
