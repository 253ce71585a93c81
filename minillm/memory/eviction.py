"""KV eviction: keep a budget of tokens per sequence and drop the others.

Quantization makes every token cheaper; eviction keeps fewer tokens. After each step, a sequence
whose cache holds more entries than its budget drops the ones it is least likely to need:

- `window`: only the most recent tokens (the naive baseline);
- `sinks`: the first NUM_SINKS tokens plus the most recent (StreamingLLM, Xiao et al. 2023):
  softmax must put its mass somewhere, and models learn to park it on the first tokens, so
  evicting them hurts far more than their content suggests;
- `h2o`: the "heavy hitters" — tokens that drew the most attention — plus a recent window of
  half the budget (H2O, Zhang et al. 2023). Each KV head chooses for itself, from the attention
  its group of query heads paid, in every layer; every head keeps the same number of entries, so
  each layer's cache stays a rectangle (entries, kv_heads, head_dim) even though different heads
  keep different tokens. Unlike the paper, a token is scored by its attention *per query that
  saw it* (the accumulated sum over the number of such queries, `queries_seen`), not by the sum:
  the sum grows with age, so old tokens every query glanced at crowd out younger ones the text
  keeps returning to. The count is exact from the entries' positions, which `Evictor` keeps per
  layer and KV head (below) and passes to the policy; without positions (`queries_seen`'s
  fallback) it would be a lower bound from cache order.

  Measured with `minillm eval ppl`'s segments (4 x 512 tokens, 20% = 103 entries), as the ratio
  to the full cache's perplexity on Alice (prose) / lcet10 (technical proceedings), 2026-12-01:
  the paper's sum 1.06x / 1.13x; the mean per query 1.04x / 1.09x with the exact count, 1.05x /
  1.12x with the bound; sinks + window 1.14x / 1.12x. A larger recent share helps at 512 tokens
  (the sum with 3/4 recent: 1.06x / 1.10x) but hurts at 160 (32 entries: lcet10 1.30x -> 1.36x),
  where the mean with half recent is best (1.09x / 1.27x exact, 1.13x / 1.29x bound; the sum
  1.19x / 1.30x); so the split stays half. Forcing the 4 sinks in changed nothing: their
  attention keeps them anyway. The code as it is (mean per query, exact count, half recent)
  measured 1.04x / 1.09x again on 2026-12-07 (`minillm eval ppl --eviction h2o --kv-budget 0.2`,
  and `--text weights/texts/lcet10.txt`; 2-core AMD EPYC with avx512_bf16 + VNNI, torch
  2.13.0+cpu): 24.26 / 23.23 and 42.09 / 38.47.

The budget is a number of tokens (an int) or a fraction (a float) of the sequence's full length,
prompt plus max_tokens (capped by the context): 0.2 caps the cache at a fifth of what it would
grow to, H2O's definition. Until the sequence reaches its budget nothing is evicted.

Positions after eviction: keys are stored after RoPE, so a kept key keeps the rotation of its
original position, and a new token is rotated by its true position (`Sequence.num_computed`), not
by its index in the shrunken cache. The distances the model sees stay true; only which keys exist
changes. Index and position part ways: `Sequence.num_cached` (entries in the cache, where the
next one is written) vs `num_computed` (tokens processed, the next position). StreamingLLM
instead re-numbers positions inside the cache, which lets a stream run past the trained context;
minillm stays within the context, where true positions are the faithful choice.

With the prefix cache on, a prompt's full blocks are what other requests share, so they stay
whole: they are the sequence's *protected prefix*, never rewritten, moved or dropped, whether the
sequence found them in the cache or computed them itself (then registered them, and a later
request may adopt them at any time). Eviction chooses only among the entries after them, the
sequence's private part, and the budget counts only those: a sequence keeps its protected prefix
plus `budget` private entries. The shared prefix costs its memory once, for every request that
holds it, so it is not charged to any one of them. Being a property of the prompt alone (not of
what happened to be cached), the protected prefix is the same on a hit and on a miss, so a
request keeps the same entries, and gives the same tokens, either way. Without a prefix cache
nothing is protected.

Eviction moves no entry that stays: a newcomer takes a dropped entry's place. Attention of a
query is the same whatever order its keys lie in, so entries need no order among themselves, and
each KV head may hold a different token in the same slot. After a step a sequence over budget
holds `keep` private entries and the step's n newcomers after them; per (layer, KV head), the
policy drops n of them, the holes it leaves among the first `keep` are filled with the kept
newcomers of that head (`pool.move_entries`), and the blocks after the first `keep` go back. A
step at the budget moves at most n entries per head, not the whole cache.

Slots then no longer hold tokens in position order, so the sequence carries each entry's position
per layer and KV head beside its H2O scores (`Evictor.positions`), moved with them. The policy
sees every head's entries sorted by position (`kept_entries`, as if the cache had been rewritten
in order), so it keeps what it kept when it was: window and sinks by position, H2O by score
outside a recent window by position.

A block that gets written (one holding a hole, and the block the cache is cut back into, whose
later slots the next tokens write) that another sequence shares (parallel samples, beams) is
copied first, never written in place; a block the prefix cache vouches for that no other table
holds (an output block registered before the sequence first evicted, say) is forgotten by the
cache before it is written, so no later request can adopt the new content as the old. Blocks not
written keep their content and stay shared or cached. `Evictor` does this for the scheduler after
every step, on plain values (a sequence id, its number of entries and of tokens computed, its
prompt length, its length limit, its H2O scores and entry positions): memory never needs to know
what a request is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minillm.memory.block_manager import BlockManager

NUM_SINKS = 4  # StreamingLLM keeps 4 initial tokens


def budget_for(kv_budget: int | float, max_len: int) -> int:
    """Entries a sequence of at most `max_len` tokens may keep: an int is a number of tokens, a
    float a fraction of max_len (at least one)."""
    if isinstance(kv_budget, float):
        return max(1, math.ceil(kv_budget * max_len - 1e-9))
    return kv_budget


def kept_entries(
    policy: str,
    length: int,
    keep: int,
    num_layers: int,
    num_kv_heads: int,
    mass: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which of `length` cache entries to keep: (num_layers, num_kv_heads, keep) indices, in
    increasing order, into each head's entries oldest first. `mass` (num_layers, num_kv_heads,
    length) is H2O's accumulated attention; `positions` (same shape), where the cache knows them,
    are the entries' token positions, in increasing order along the last dimension (see
    `queries_seen`)."""
    shape = (num_layers, num_kv_heads, keep)
    if policy == "window" or keep < 2:
        return torch.arange(length - keep, length).expand(shape)
    if policy == "sinks":
        sinks = min(NUM_SINKS, keep - 1)
        kept = torch.cat([torch.arange(sinks), torch.arange(length - (keep - sinks), length)])
        return kept.expand(shape)
    if policy == "h2o":
        recent = keep // 2  # H2O's split: half the budget recent, half heavy hitters
        older = length - recent  # the candidates for heavy hitters: entries 0..older-1
        seen = queries_seen(length, positions, mass.device)[
            ..., :older
        ]  # (layers or 1, kv_heads or 1, older)
        mean_mass = mass[..., :older] / seen  # attention per query that saw the entry, not its age
        heavy = mean_mass.topk(keep - recent, dim=-1).indices.sort(dim=-1).values
        window = torch.arange(older, length, device=mass.device).expand(num_layers, num_kv_heads, recent)
        return torch.cat([heavy, window], dim=-1)
    raise ValueError(f"unknown eviction policy {policy!r}")


def queries_seen(length: int, positions: torch.Tensor | None, device) -> torch.Tensor:
    """How many queries have attended to each entry, H2O's divisor: (layers, kv_heads, length)
    from the entries' token positions (the newest entry, always kept, is the newest token, which
    attended to itself), or, without positions, (1, 1, length) from cache order: the entries at or
    after an entry are tokens that saw it, so their number is a lower bound (exact until the first
    eviction, then short by the dropped tokens that saw it)."""
    if positions is not None:
        return (positions.amax(dim=-1, keepdim=True) + 1 - positions).float()
    return torch.arange(length, 0, -1, device=device, dtype=torch.float32).view(1, 1, length)


def grow_attention_mass(
    mass: torch.Tensor | None, length: int, num_layers: int, num_kv_heads: int, device
) -> torch.Tensor:
    """An H2O accumulator (layers, kv_heads, entries so far), extended with zeros to `length` entries."""
    if mass is None:
        mass = torch.zeros(num_layers, num_kv_heads, 0, device=device)
    if mass.shape[-1] < length:
        mass = torch.cat([mass, mass.new_zeros(num_layers, num_kv_heads, length - mass.shape[-1])], dim=-1)
    return mass


@dataclass
class _SequenceState:
    """One sequence's H2O scores and entry positions, (layers, kv_heads, entries) each, or None."""

    mass: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # None while entry i holds position i

    def copy(self) -> _SequenceState:
        return _SequenceState(*(None if t is None else t.clone() for t in (self.mass, self.positions)))


class Evictor:
    """Keeps every sequence within its KV budget, in the pool and in the block manager, and is the
    one owner of each sequence's eviction state: its H2O scores (attention adds to them) and the
    token each entry holds. It works on plain values (a sequence id, its number of cache entries,
    its length limit); the KV cache manager tells it about a sequence after each step."""

    def __init__(
        self, policy: str, kv_budget: int | float, tiers, manager: BlockManager, layers: int, heads: int
    ):
        self.policy, self.kv_budget = policy, kv_budget
        self.tiers, self.pool, self.manager = tiers, tiers.device, manager
        self.num_layers, self.num_kv_heads = layers, heads
        self._states: dict[int, _SequenceState] = {}

    # ---------------------------------------------------------------- each sequence's state
    def attention_mass(self, seq_id: int, num_entries: int | None = None) -> torch.Tensor | None:
        """H2O: the sequence's accumulator (layers, kv_heads, entries), grown with zeros to
        `num_entries`; attention adds the attention each entry receives to it. None unless H2O."""
        if self.policy != "h2o":
            return None
        state = self._states.setdefault(seq_id, _SequenceState())
        if num_entries is not None:
            shape = (self.num_layers, self.num_kv_heads)
            state.mass = grow_attention_mass(state.mass, num_entries, *shape, self.pool.device)
        return state.mass

    def positions(self, seq_id: int) -> torch.Tensor | None:
        """(layers, kv_heads, entries) the token each entry holds, once entries moved; else None."""
        state = self._states.get(seq_id)
        return state.positions if state else None

    def fork(self, parent_id: int, child_id: int) -> None:
        if parent_id in self._states:
            self._states[child_id] = self._states[parent_id].copy()

    def forget(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def truncate(self, seq_id: int, num_entries: int) -> None:
        """The sequence's cache was cut back to `num_entries` entries: the scores and positions of
        the entries after them go (the next tokens' entries start afresh there)."""
        state = self._states.get(seq_id)
        if state is None:
            return
        if state.mass is not None:
            state.mass = state.mass[..., :num_entries].contiguous()
        if state.positions is not None:
            state.positions = state.positions[..., :num_entries].contiguous()

    # ---------------------------------------------------------------- budgets
    def budget(self, max_len: int) -> int:
        """Private entries a sequence of at most `max_len` tokens may keep."""
        return budget_for(self.kv_budget, max_len)

    def protected(self, prompt_len: int) -> int:
        """Leading entries eviction never touches: with a prefix cache, the prompt's full blocks."""
        if self.manager.prefix_cache is None:
            return 0
        return prompt_len // self.manager.block_size * self.manager.block_size

    def kept(self, prompt_len: int, max_len: int) -> int:
        """Entries a sequence holds at most after a step: its protected prefix and its budget."""
        return self.protected(prompt_len) + self.budget(max_len)

    def shrink(self, seq_id: int, num_cached: int, num_computed: int, prompt_len: int, max_len: int) -> int:
        """Drop the sequence's least needed private entries down to its budget; return how many.
        Nothing is dropped within budget, or when a shared block must be copied and no block is
        free (the engine tries again next step)."""
        protected, keep = self.protected(prompt_len), self.budget(max_len)
        private = num_cached - protected  # entries eviction may choose among
        if private <= keep:
            return 0
        state = self._states.setdefault(seq_id, _SequenceState())
        mass, shape = state.mass, (self.num_layers, self.num_kv_heads)
        positions = entry_positions(state.positions, num_cached, num_computed, *shape, self.pool.device)
        # (layers, kv_heads, private): private entries' indices, oldest first, and their positions
        oldest_first = positions[..., protected:].argsort(dim=-1)
        private_positions = positions[..., protected:].gather(-1, oldest_first)
        private_mass = (
            None if mass is None else mass[..., protected:].gather(-1, oldest_first.to(mass.device))
        )
        mass_positions = None if mass is None else private_positions.to(mass.device)
        chosen = kept_entries(self.policy, private, keep, *shape, private_mass, mass_positions)
        kept = oldest_first.gather(-1, chosen.to(oldest_first.device))  # (layers, kv_heads, keep)
        layers, heads, holes, newcomers = fill_plan(kept, keep, private)
        holes, newcomers = holes + protected, newcomers + protected  # cache indices
        end = protected + keep
        if not self._move(seq_id, end, layers, heads, newcomers, holes):
            return 0
        positions[layers, heads, holes] = positions[layers, heads, newcomers]
        state.positions = positions[..., :end].contiguous()
        if mass is not None:
            on_mass = [index.to(mass.device) for index in (layers, heads, holes, newcomers)]
            mass[on_mass[0], on_mass[1], on_mass[2]] = mass[on_mass[0], on_mass[1], on_mass[3]]
            state.mass = mass[..., :end].contiguous()
        return private - keep

    def _move(
        self,
        seq_id: int,
        end: int,
        layers: torch.Tensor,
        heads: torch.Tensor,
        sources: torch.Tensor,
        destinations: torch.Tensor,
    ) -> bool:
        """Cut the sequence's cache back to `end` entries, entry `sources[i]` of head `heads[i]`
        of layer `layers[i]` first taking the place of `destinations[i]` (cache indices, all below
        `end`). The blocks written are copied first if shared and forgotten by the prefix cache;
        False, and nothing changed, if a copy is needed and no block is free."""
        manager, size = self.manager, self.manager.block_size
        written = set((destinations // size).tolist())
        if end % size:
            written.add(end // size)  # the block cut back into: the next tokens write its later slots
        written = sorted(written)
        if (
            sum(len(manager.shared_blocks(seq_id, block * size, (block + 1) * size)) for block in written)
            > manager.num_free_blocks
        ):
            return False
        for block in written:
            start, stop = block * size, (block + 1) * size
            manager.copy_on_write(seq_id, start, stop)  # a copy: only some of its entries change
            manager.forget_cached(seq_id, start, stop)
            manager.check_writable(seq_id, start, stop)
        self.tiers.copy(manager.take_copies())  # the copies land before any entry moves
        table = torch.tensor(manager.table(seq_id), device=self.pool.device)
        if end % size:
            self.pool.restage_block(int(table[end // size]))
        source_slots = table[sources // size] * size + sources % size  # (moves,)
        destination_slots = table[destinations // size] * size + destinations % size
        self.pool.move_entries(layers, heads, source_slots, destination_slots)
        manager.truncate(seq_id, end)
        return True


def entry_positions(
    positions: torch.Tensor | None,
    num_cached: int,
    num_computed: int,
    num_layers: int,
    num_kv_heads: int,
    device,
) -> torch.Tensor:
    """Each of the `num_cached` entries' token position, per layer and KV head: (layers, kv_heads,
    num_cached). Entries added since `positions` was made were appended in order, and the last
    holds position num_computed - 1."""
    known = 0 if positions is None else positions.shape[-1]
    appended = torch.arange(num_computed - (num_cached - known), num_computed, device=device)
    appended = appended.expand(num_layers, num_kv_heads, num_cached - known)
    return appended.clone() if positions is None else torch.cat([positions, appended], dim=-1)


def fill_plan(kept: torch.Tensor, keep: int, length: int) -> tuple[torch.Tensor, ...]:
    """Which newcomer fills which hole. `kept` (layers, kv_heads, keep): the entries each head keeps
    out of `length`, where indices keep.. are the newcomers. Returns (layers, heads, holes,
    newcomers), each (moves,): per head, every index below `keep` not kept (a hole) paired with a
    kept index from `keep` on. Each head has as many of one as of the other, and `nonzero` lists
    them head by head, so the two lists pair up row by row."""
    is_kept = torch.zeros(*kept.shape[:2], length, dtype=torch.bool, device=kept.device)
    is_kept.scatter_(-1, kept, True)  # (layers, kv_heads, length)
    holes = (~is_kept[..., :keep]).nonzero()  # (moves, 3): layer, head, index
    newcomers = is_kept[..., keep:].nonzero()  # (moves, 3): layer, head, index - keep
    return holes[:, 0], holes[:, 1], holes[:, 2], newcomers[:, 2] + keep
