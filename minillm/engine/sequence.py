"""A request as the engine sees it: its tokens, how many have their KV computed, its timings.

`num_computed` is the heart of iteration-level scheduling: a sequence's tokens [0, num_computed)
have keys and values in the cache; the rest still need a forward pass. A prefill is "compute many
at once", a decode step is "compute the one token sampled last", a chunked prefill is "compute
some now, the rest later", and preemption by recompute is "forget them all" (num_computed = 0).

With KV eviction the cache holds fewer entries than tokens computed: `num_evicted` of them were
dropped, and the next token's K/V go to cache index `num_cached = num_computed - num_evicted`
while its position (for RoPE) stays `num_computed`. Which token each entry holds, and the H2O
scores, are the KV cache manager's to keep (`memory/kv_cache_manager.py`): a sequence only counts.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from minillm.memory.prefix_cache import PrefixMiss
from minillm.sampling import Sampler, SamplingParams, TokenLogprob
from minillm.structured import GrammarState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # min(context length, prompt + max_tokens), or the pool's end: it stops there
    sample_index: int = 0  # which of the request's n parallel samples this is
    sampler: Sampler = field(init=False)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_evicted: int = 0  # tokens computed whose K/V eviction dropped
    status: Status = Status.WAITING
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None  # "eos", "length", "abort", "error"
    error: str | None = None
    num_preemptions: int = 0
    priority: int = 0  # admission by memory serves lower values first (vLLM's convention)
    arrival_step: int = 0  # the scheduler's step count when it was queued: its age in steps
    prefix_miss: PrefixMiss | None = None  # why its prompt's prefix-cache hit ended where it did
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if params ask
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (if asked)
    grammar: GrammarState | None = None  # structured output: where its output is in the grammar

    def __post_init__(self):
        self.sampler = Sampler(self.params, self.sample_index)
        self._token_ids = self.prompt_ids + self.output_ids  # kept as tokens are appended

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output tokens, in order: the sequence's own list, read every step (not a copy:
        do not change it; `append` does)."""
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_seats(self) -> int:
        """The batch seats it takes: its own, and its forks to come (n samples or beams) if it has
        not sampled yet."""
        return self.params.num_outputs if not self.output_ids else 1

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def num_cached(self) -> int:
        """Entries in the KV cache; equal to num_computed unless eviction dropped some."""
        return self.num_computed - self.num_evicted

    def forget_cache(self) -> None:
        """Preemption by recompute: nothing of this sequence is in the cache any more."""
        self.restart(0)

    def restart(self, num_computed: int) -> None:
        """Its cache now holds exactly its first `num_computed` tokens (0, or prefix-cache hits)."""
        self.num_computed, self.num_evicted = num_computed, 0

    def append(
        self, token_id: int, eos_token_ids: frozenset[int], logprob: TokenLogprob | None = None
    ) -> str | None:
        """Add a sampled token (with its log-probability, if asked); return why the sequence must
        stop now ("eos", "length"), or None. Finishing is the scheduler's call: it also gives the
        blocks back."""
        now = time.perf_counter()
        self.output_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        self._token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        if token_id in eos_token_ids and not self.params.ignore_eos or token_id in self.params.stop_token_ids:
            return "eos"
        return "length" if self.num_tokens >= self.max_len else None

    def fork(self, seq_id: int, sample_index: int) -> "Sequence":
        """A parallel sample: the same tokens so far (its KV blocks are shared, not copied), its
        own sampler."""
        return Sequence(
            seq_id,
            self.request_id,
            self.prompt_ids,
            self.params,
            self.max_len,
            sample_index,
            output_ids=list(self.output_ids),
            logprobs=list(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,  # the same prompt: shared, never changed again
            grammar=self.grammar.fork() if self.grammar is not None else None,
            num_computed=self.num_computed,
            num_evicted=self.num_evicted,
            status=self.status,
            arrival_time=self.arrival_time,
            priority=self.priority,
            arrival_step=self.arrival_step,
        )

    def finish(self, reason: str, error: str | None = None) -> None:
        """Mark the sequence done (its blocks are the scheduler's to release: `Scheduler.finish`)."""
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error
        self.finish_time = time.perf_counter()


# ----------------------------------------------------------------- changes to a request's sequences
# The token chooser decides them (`token_choice.py`, `beam.py`); the engine has the scheduler carry
# them out, in the order decided.
@dataclass(frozen=True)
class Fork:
    """`child`, a parallel sample or a beam, joins beside `parent`, sharing its blocks."""

    parent: Sequence
    child: Sequence


@dataclass(frozen=True)
class Finish:
    """`seq` ends ("eos", "length", "pruned"): it leaves the batch and its blocks go back."""

    seq: Sequence
    reason: str


@dataclass(frozen=True)
class Fail:
    """The request ends with `error`: every sequence of it still going stops, alone."""

    request_id: str
    error: str


Change = Fork | Finish | Fail
