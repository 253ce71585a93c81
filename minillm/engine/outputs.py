"""What the engine reports: one `RequestOutput` per request that changed, `EngineStats` per run.

A request's output carries its tokens so far (every sample's, every beam's), whether it has
finished and why, its error if it failed alone, and its latencies: time to first token (from
arrival) and time per output token after that. The engine's stats count steps, tokens computed,
generated and evicted, and after every step a snapshot of KV memory (`memory/accounting.py`) and
the pressure ladder's rungs taken in that step (`memory/pressure.py`).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from minillm.config import ConfigError
from minillm.engine.scheduler import Schedule
from minillm.engine.sequence import Sequence, Status
from minillm.memory import MemoryStats
from minillm.memory.prefix_cache import PrefixMiss
from minillm.sampling import TokenLogprob
from minillm.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    """One sample (or beam) of a request, shaped like vLLM's, so `out.outputs[0].text` reads the
    same on both engines; finish_reason speaks the OpenAI API's words ("stop" for EOS)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked (SamplingParams.logprobs)


@dataclass
class RequestOutput:
    """A request's state. With n parallel samples, `token_ids` is sample 0 and `samples` holds all;
    with beam search, `samples` are the beams, best first."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool  # every sample has finished
    finish_reason: str | None
    error: str | None
    ttft: float | None  # seconds from arrival to first token
    tpot: float | None  # seconds per output token after the first
    num_preemptions: int
    samples: list[list[int]] = field(default_factory=list)
    tokenizer: Tokenizer | None = field(default=None, repr=False)
    prefix_miss: PrefixMiss | None = None  # why the prompt's prefix-cache hit ended there (cache on)
    logprobs: list[list[TokenLogprob]] | None = None  # per sample, per token (when asked)
    stop_token_ids: tuple[int, ...] = ()  # tokens that ended a sample as EOS does (SamplingParams)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, None for the first
    eos_token_ids: frozenset[int] = frozenset()  # the engine's end-of-sequence tokens, never text

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ConfigError("This engine has no tokenizer; read token_ids instead of text.")
        hidden = {*self.eos_token_ids, *self.stop_token_ids}  # a stop token ends, it is not text
        return self.tokenizer.decode([t for t in token_ids if t not in hidden])

    @property
    def text(self) -> str:
        return self.decode(self.token_ids)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """Every sample or beam as vLLM's RequestOutput.outputs lists them (decoded on each read)."""
        ended = "length" if self.finish_reason in ("eos", "length") else self.finish_reason
        stops = {*self.eos_token_ids, *self.stop_token_ids}

        def reason(ids: list[int]) -> str | None:
            return ("stop" if ids and ids[-1] in stops else ended) if self.finished else None

        logprobs = self.logprobs or [None] * len(self.samples or [self.token_ids])
        return [
            CompletionOutput(i, self.decode(ids), list(ids), reason(ids), logprobs[i])
            for i, ids in enumerate(self.samples or [self.token_ids])
        ]

    @classmethod
    def of(
        cls, seqs: list[Sequence], tokenizer: Tokenizer | None, eos_token_ids: frozenset[int]
    ) -> "RequestOutput":
        first = seqs[0]
        ttft = tpot = None
        if first.first_token_time is not None:
            ttft = first.first_token_time - first.arrival_time
            if first.finish_time is not None and len(first.output_ids) > 1:
                tpot = (first.finish_time - first.first_token_time) / (len(first.output_ids) - 1)
        finished = (
            all(seq.status is Status.FINISHED for seq in seqs)
            and len(seqs) == first.params.num_outputs
            or first.finish_reason in ("error", "abort")
        )
        return cls(
            first.request_id,
            list(first.prompt_ids),
            list(first.output_ids),
            finished,
            first.finish_reason,
            first.error,
            ttft,
            tpot,
            sum(seq.num_preemptions for seq in seqs),
            [list(seq.output_ids) for seq in seqs],
            tokenizer,
            first.prefix_miss,
            [list(seq.logprobs) for seq in seqs] if first.params.logprobs is not None else None,
            first.params.stop_token_ids,
            [None, *first.prompt_logprobs] if first.params.prompt_logprobs is not None else None,
            eos_token_ids,
        )

    def prefix_miss_report(self) -> dict | None:
        """The prefix-cache miss, explained (`describe_miss`); None with prefix caching off."""
        if self.prefix_miss is None:
            return None
        return describe_miss(self.prefix_miss, self.prompt_token_ids, self.tokenizer)


def describe_miss(miss: PrefixMiss, prompt_ids: list[int], tokenizer: Tokenizer | None) -> dict:
    """A `PrefixMiss` for people: its numbers, the text just before the prompt parted from the
    cached (or recent) one, both continuations, and one sentence saying what happened."""

    def text(ids) -> str:
        return tokenizer.decode(list(ids)) if tokenizer else " ".join(map(str, ids))

    report = {
        "cause": miss.cause,
        "prompt_tokens": miss.prompt_tokens,
        "cacheable_tokens": miss.cacheable_tokens,
        "cached_tokens": miss.cached_tokens,
        "recomputed_tokens": miss.recomputed_tokens,
        "diverged_at": miss.diverged_at,
    }
    if miss.diverged_at is not None:
        at = miss.diverged_at
        report |= {
            "before": text(prompt_ids[max(0, at - 8) : at]),
            "prompt_text": text(miss.ours),
            "cached_text": text(miss.theirs),
        }
    report["summary"] = _miss_sentence(miss, report)
    return report


def _miss_sentence(miss: PrefixMiss, report: dict) -> str:
    cached = f"{miss.cached_tokens} of {miss.cacheable_tokens} cacheable prompt tokens came from the cache"
    if miss.cause == "hit":
        if not miss.cacheable_tokens:
            return "The prompt fills no block: there was nothing to find in the prefix cache."
        return f"Every full block hit: {cached}."
    if miss.cause == "new":
        return f"{cached}; no cached or recent prompt begins like this one."
    where = f"token {miss.diverged_at}, after {report['before']!r}: this prompt has {report['prompt_text']!r}"
    other = f"the other {report['cached_text']!r}" if miss.theirs else "the other prompt ended there"
    if miss.cause == "evicted":
        return (
            f"{cached}; a recent prompt shared {miss.diverged_at} tokens, but their blocks have left the "
            f"cache (reused for other content, or not computed yet). It parts at {where}, {other}."
        )
    return (
        f"{cached}; it parts from the cached prompt at {where}, {other}. Everything from that "
        "token's block on is computed again; if what differs there changes with every request (a "
        "timestamp, an id), move it to the end of the prompt or normalize it."
    )


@dataclass
class EngineStats:
    """Counters over the whole run, and per-step detail for the last `window` steps only: an engine
    that serves for days must not grow with every step."""

    window: int = 10_000  # steps whose memory snapshot and batch are kept
    steps: int = 0
    tokens_computed: int = 0  # prefill + decode tokens through the model
    tokens_generated: int = 0
    tokens_evicted: int = 0  # KV entries eviction dropped, per sequence (not per layer or head), counted at
    #   each drop: a sequence recomputed after a preemption drops, and counts, its entries again
    live_slot_steps: int = 0  # live slots summed over every step (utilization over the whole run)
    reserved_slot_steps: int = 0
    rungs: Counter[str] = field(default_factory=Counter)  # the pressure ladder's rungs taken, over the run
    # speculative decoding: sequence-steps that guessed, tokens guessed, guesses kept, and guesses
    #   kept by position (vLLM's spec_decode_num_drafts / _draft_tokens / _accepted_tokens[_per_pos])
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: Counter[int] = field(default_factory=Counter)
    memory: deque[MemoryStats] = field(init=False)  # after each of the last `window` steps
    batches: deque[list[tuple[str, int]]] = field(init=False)  # the same steps: (request_id, tokens computed)
    ladder: deque[dict[str, int]] = field(init=False)  # the same steps: rung -> blocks reclaimed,
    #   sequences preempted, entries evicted (only the rungs taken)
    schedule_s: deque[float] = field(init=False)  # the same steps: seconds the scheduler took to decide

    def __post_init__(self):
        self.memory, self.batches, self.ladder, self.schedule_s = deque(), deque(), deque(), deque()
        self.keep_last(self.window)

    def keep_last(self, steps: int) -> None:
        """From now on keep per-step detail for the last `steps` steps (about a kilobyte each)."""
        self.window = steps
        self.memory, self.batches = deque(self.memory, steps), deque(self.batches, steps)
        self.ladder, self.schedule_s = deque(self.ladder, steps), deque(self.schedule_s, steps)

    def record(
        self, schedule: Schedule, sampled: int, evicted: int, memory: MemoryStats, rungs: dict[str, int]
    ) -> None:
        self.steps += 1
        self.tokens_computed += sum(item.num_tokens for item in schedule.sequences)
        self.tokens_generated += sampled
        self.tokens_evicted += evicted
        self.live_slot_steps += memory.live_slots
        self.reserved_slot_steps += memory.reserved_slots
        self.batches.append([(item.seq.request_id, item.num_tokens) for item in schedule.sequences])
        self.memory.append(memory)
        self.ladder.append(rungs)
        self.rungs.update(rungs)

    def record_guesses(self, proposed: int, accepted: int) -> None:
        """A sequence guessed `proposed` tokens this step and the model kept the first `accepted`."""
        self.spec_drafts += 1
        self.spec_draft_tokens += proposed
        self.spec_accepted_tokens += accepted
        self.spec_accepted_per_pos.update(range(accepted))

    def speculation(self) -> dict:
        """Speculative decoding's numbers over the run: guesses made and kept, the acceptance rate,
        and the tokens each checking pass gave a guessing sequence (its kept guesses and one more)."""
        drafts, by_position = self.spec_drafts, self.spec_accepted_per_pos
        return {
            "drafts": drafts,
            "draft_tokens": self.spec_draft_tokens,
            "accepted_tokens": self.spec_accepted_tokens,
            "acceptance_rate": self.spec_accepted_tokens / self.spec_draft_tokens if drafts else 0.0,
            "tokens_per_pass": 1 + self.spec_accepted_tokens / drafts if drafts else 1.0,
            "accepted_per_position": [by_position[i] for i in range(max(by_position, default=-1) + 1)],
        }

    def kv_utilization(self) -> float:
        """Live slots / reserved slots, summed over all steps."""
        return self.live_slot_steps / self.reserved_slot_steps if self.reserved_slot_steps else 1.0
