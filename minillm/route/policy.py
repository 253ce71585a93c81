"""Which engine a request goes to: the one where it costs least, or simply the next in turn.

`KvPolicy` is Dynamo's KV router cost (NVIDIA Dynamo, "KV cache routing"), for each live engine:

    cost = overlap_score_weight x new prefill blocks + active blocks

where new prefill blocks = the prompt's full blocks - those the engine already caches (the
index's overlap: prefill it would not need), and active blocks = the blocks of the requests the
router has sent the engine and that are still running (their prompts' blocks, counted by the
router itself over each request's life, `ActiveBlocks`). overlap_score_weight is 1.0: a block to
prefill weighs what a block being decoded does. The lowest cost wins; ties go round-robin.

The index is only as good as the feeds: when any live engine's feed lags (`feeds.py`), the policy
falls back to round-robin for that request and counts it, rather than send traffic after a
cache it no longer sees. `RoundRobin` alone (`--policy round-robin`) is the baseline a benchmark
compares against.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from minillm.route.index import BlockIndex

OVERLAP_SCORE_WEIGHT = 1.0


@dataclass(frozen=True)
class Choice:
    engine: str
    predicted_hit_blocks: int | None  # the index's overlap on that engine; None when not consulted
    reason: str  # "kv", "round-robin", or "fallback" (the kv policy, a feed lagging)


class RoundRobin:
    """The engines in turn, skipping those not offered."""

    def __init__(self, urls: list[str]):
        self.urls, self.turn = list(urls), 0

    def next_of(self, candidates: list[str]) -> str:
        """The first of `candidates` from the current turn on (in the engines' order); the turn
        moves past it."""
        for step in range(len(self.urls)):
            url = self.urls[(self.turn + step) % len(self.urls)]
            if url in candidates:
                self.turn = (self.turn + step + 1) % len(self.urls)
                return url
        raise ValueError("no candidate engine")

    def choose(self, candidates: list[str], prompt_ids: list[int] | None, lagging: bool) -> Choice:
        return Choice(self.next_of(candidates), None, "round-robin")


class ActiveBlocks:
    """Blocks of the requests each engine is running, as the router counts them: a request's
    prompt blocks from when it is sent until its answer ends."""

    def __init__(self):
        self.blocks: Counter[str] = Counter()

    def start(self, engine: str, blocks: int) -> None:
        self.blocks[engine] += blocks

    def finish(self, engine: str, blocks: int) -> None:
        self.blocks[engine] -= blocks

    def of(self, engine: str) -> int:
        return self.blocks[engine]


class KvPolicy:
    """Dynamo's cost over the live engines; round-robin for prompts it cannot read, for ties,
    and while a feed lags."""

    def __init__(self, urls: list[str], index: BlockIndex, active: ActiveBlocks):
        self.index, self.active, self.round_robin = index, active, RoundRobin(urls)

    def choose(self, candidates: list[str], prompt_ids: list[int] | None, lagging: bool) -> Choice:
        if prompt_ids is None or self.index.block_size is None:
            return self.round_robin.choose(candidates, prompt_ids, lagging)
        if lagging:
            return Choice(self.round_robin.next_of(candidates), None, "fallback")
        overlap = self.index.overlap(cacheable(prompt_ids))
        prompt_blocks = len(prompt_ids) // self.index.block_size

        def cost(engine: str) -> float:
            new_prefill = prompt_blocks - overlap.get(engine, 0)
            return OVERLAP_SCORE_WEIGHT * new_prefill + self.active.of(engine)

        lowest = min(map(cost, candidates))
        engine = self.round_robin.next_of([e for e in candidates if cost(e) == lowest])
        return Choice(engine, overlap.get(engine, 0), "kv")


def cacheable(prompt_ids: list[int]) -> list[int]:
    """The part of a prompt a prefix-cache hit can cover: all but its last token, which the engine
    always computes (its logits give the first new token)."""
    return prompt_ids[:-1]


POLICIES = ("kv", "round-robin")


def make_policy(name: str, urls: list[str], index: BlockIndex, active: ActiveBlocks):
    """The policy `--policy` names."""
    if name == "kv":
        return KvPolicy(urls, index, active)
    if name == "round-robin":
        return RoundRobin(urls)
    raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {name!r}.")
