"""The pressure ladder: what the engine gives up, and in what order, when the device pool runs short.

Each memory switch answers a shortage its own way: the prefix cache can let cached blocks go, a
tier can take a sequence's blocks, eviction can drop entries. Left alone they fight (a
preemption while cached blocks nobody holds sit on the device; an eviction, which costs quality,
where a swap, which costs only time, would do). `PressureLadder` is the one place that decides,
climbing the rungs cheapest first:

  1. reclaim  cached prefix blocks no sequence holds are the first free blocks taken, least
              recently used first: spilled to the host tier when there is one, else dropped.
              It costs nothing now, at most a later prefill (or a copy back from host).
  2. compress the KV of idle sequences re-stored in a smaller format: not built. minillm's device
              pool holds one format (`kv_dtype`), so this rung has no memory to hand out; a
              quantized store for the idle would be a tier of its own (docs/memory.md).
  3. preempt  a running sequence leaves the device: by swap to the host or disk tier, or by
              recompute, whichever the measured cost model says is cheaper for it (`SwapCost`).
              It costs time, never quality.
  4. evict    only if the user allowed a lossy eviction policy with `eviction_trigger="pressure"`:
              after a step in which memory ran short, sequences over their KV budget drop their
              least needed entries. It costs quality.

The KV cache manager asks (`prefers_swap`, `evicts_now`) and reports what it did (`took`); the
scheduler never talks to the ladder, only to the manager, which obeys it. Every step's rungs are
logged (`end_step`) for the engine's stats. (With `eviction_trigger="always"`, eviction is not a
rung but a fixed budget kept every step.)
"""

from __future__ import annotations

from collections import Counter

from minillm.memory.tier_moves import TierMoves
from minillm.memory.tiers import SwapCost

RUNGS = ("reclaim", "preempt", "evict")  # the rungs built, in the order they are taken


class PressureLadder:
    def __init__(
        self, moves: TierMoves, preemption: str, swap_cost: SwapCost | None, eviction_trigger: str | None
    ):
        """`moves`: the block manager's tier moves; `preemption`: "recompute", "swap" or "auto";
        `eviction_trigger`: None (no eviction allowed), "always" (a fixed budget every step) or
        "pressure" (rung 4)."""
        self.moves, self.preemption, self.swap_cost = moves, preemption, swap_cost
        self.eviction_trigger = eviction_trigger
        # this step's rungs: blocks reclaimed, sequences preempted, evicted
        self.rungs: Counter[str] = Counter()

    def prefers_swap(self, seq_ids: list[int], tokens: int) -> bool:
        """Rung 3 for these sequences (a request's running samples or beams, `tokens` computed in
        all): swap if a tier can take their device blocks and the policy, or for "auto" the
        measured cost model, prefers it to recomputing the tokens."""
        if self.preemption == "recompute" or not self.moves.can_swap_out(seq_ids):
            return False
        if self.preemption == "swap":
            return True
        blocks = self.moves.device_blocks(seq_ids)
        return self.swap_cost.prefers_swap(tokens, blocks, self.moves.swap_out_tier(blocks))

    def took(self, rung: str, amount: int = 1) -> None:
        self.rungs[rung] += amount

    @property
    def _short(self) -> bool:
        """Did memory run short this step (a sequence had to leave the device)?"""
        return self.rungs["preempt"] > 0

    def evicts_now(self) -> bool:
        """After this step's forward pass, do sequences over their budget evict?"""
        return self.eviction_trigger == "always" or (self.eviction_trigger == "pressure" and self._short)

    def end_step(self) -> dict[str, int]:
        """This step's rungs, in ladder order (the blocks reclaimed are the tier moves' count);
        the counts start again for the next step."""
        self.took("reclaim", self.moves.take_reclaimed())
        taken = {rung: self.rungs[rung] for rung in RUNGS if self.rungs[rung]}
        self.rungs = Counter()
        return taken
