"""The serving engine: requests in, tokens out, one batched forward pass per step.

`LLMEngine.step()` is the algorithm, one call per stage into the object that owns it:
  1. the scheduler picks sequences and token counts (decode tokens, prefill chunks), asking the
     KV cache manager for their blocks — or preempting when blocks run out (`scheduler.py`);
  2. the KV cache manager performs the block copies its allocations decided — swaps between the
     device pool and the host or disk tier, prefix spills, copy-on-write — in order
     (`memory/tiers.py`), and starts copying back, in the background, the swapped sequence the
     scheduler named to run next (prefetch);
  3. the runner lays every scheduled token end to end and runs the model once; each attention
     layer writes k, v into the tokens' slots and reads each sequence's history through its
     block table (`runner.py`, `attention/paged.py`);
  4. the scheduler hears what was computed (after the token chooser has scored prompts and checked
     guesses, which read the counts before they move on): rejected guesses are rolled back, H2O
     scores grow, full blocks become findable in the prefix cache, sequences over their eviction
     budget drop entries;
  5. the token chooser gives every sequence whose tokens are all computed its next token (n
     samples fork at their first token; beams advance together), `token_choice.py`, and returns
     what that changes: the scheduler carries out the forks and the finishes (blocks go back);
  6. one `RequestOutput` for every request that changed (`outputs.py`).

With a remote KV store (`memory/remote.py`), a new request first asks it for the prompt's blocks
the local prefix cache lacks; it is held out of the scheduler (`fetching`) until they come back and
are installed as cached prefix blocks, or until waiting would cost more than recomputing them.

The memory system's bookkeeping of a step (its events numbered, the pass timed for the swap cost
model, who ran told to listeners, the pressure ladder's rungs) is its own: `begin_step` and
`end_step`. Speculation's (what a decode step costs, which guesses were checked) is the token
chooser's.

`LLM` (`llm.py`) wraps it with a vLLM-shaped API.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Callable

import torch

from minillm.attention.kernels import attention_backend
from minillm.config import ConfigError, EngineConfig
from minillm.engine.output_length import LearnedLengths
from minillm.engine.outputs import EngineStats, RequestOutput
from minillm.engine.runner import ModelRunner
from minillm.engine.scheduler import Schedule, Scheduler, make_admission
from minillm.engine.sequence import Fail, Fork, Sequence, Status
from minillm.engine.speculative import NgramProposer
from minillm.engine.token_choice import Choice, TokenChooser
from minillm.memory import KVCacheManager, MemorySnapshot, MemoryStats
from minillm.memory.events import Subscriber
from minillm.memory.remote import Fetch
from minillm.model import Transformer
from minillm.sampling import Sampler, SamplingParams
from minillm.structured import Grammars
from minillm.tokenizer import Tokenizer, end_of_sequence
from minillm.tracing import attach
from minillm.weights import load_model_for, model_fingerprint

FETCH_POLL_S = 0.005  # a step with nothing to run but remote fetches waits this long for one, at most


def check_request_args(params: SamplingParams, arrival_time, priority, sampler, vocab_size: int) -> None:
    """`add_request`'s arguments beside the prompt, each refused with a line saying what it takes."""
    named = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
    if any(t >= vocab_size for t in named):
        raise ValueError(
            f"logit_bias and stop_token_ids take token ids in [0, {vocab_size}), got {max(named)}"
        )
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 64:
        raise ValueError(
            f"priority must be a whole number in [-64, 64] (lower is served first), not {priority!r}"
        )
    if arrival_time is not None and (
        isinstance(arrival_time, bool)
        or not isinstance(arrival_time, (int, float))
        or not math.isfinite(arrival_time)
    ):
        raise ValueError(f"arrival_time must be a time.perf_counter() value, not {arrival_time!r}")
    if sampler is not None:
        if not callable(sampler):
            raise ValueError(f"sampler must be callable with the next-token logits, not {sampler!r}")
        if params.n > 1 or params.beam_width > 1:
            raise ValueError("A custom sampler drives one sequence; use n=1 and beam_width=1 with it.")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: Transformer | None = None,
        tokenizer: Tokenizer | None = None,
        output_lengths: LearnedLengths | None = None,
    ):
        """`output_lengths`: how memory-aware admission predicts a request's output length
        (default: learned from finished requests by their shape, `output_length.py`)."""
        self.config = config
        self.model = model if model is not None else load_model_for(config)
        self.tokenizer = (
            tokenizer if tokenizer is not None or model is not None else Tokenizer(config.model_dir)
        )
        self.eos_token_ids = end_of_sequence(self.model.config.eos_token_ids, self.tokenizer)
        self.context_len = self.model.config.context_len(config.max_seq_len)
        model_config = self.model.config
        identity = self._session_identity() if config.remote_kv else None  # names its blocks in the store
        model_dtype, device = self.model.dtype, self.model.device
        self.kv_cache = KVCacheManager.build(config, model_config, model_dtype, device, identity)
        attach(self.kv_cache)  # `--trace FILE`: this engine's KV events go into the command's trace
        self.proposer = None
        if config.speculative == "ngram":
            self.proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        self.scheduler = self._scheduler(output_lengths or LearnedLengths(self.eos_token_ids))
        self.runner = ModelRunner(self.model, self.kv_cache, attention_backend(config))
        self.requests: dict[str, list[Sequence]] = {}  # request_id -> its samples' (or beams') sequences
        self.rejected: list[Sequence] = []  # failed at admission; reported by the next step
        self.fetching: dict[str, tuple[Sequence, Fetch]] = {}  # request_id -> its sequence, held out of
        #   the scheduler while the remote store is asked for its prompt's blocks
        self.stats = EngineStats()
        self.seq_ids = itertools.count()
        self.num_steps = 0
        self.chooser = TokenChooser(  # guess checks, prompt scoring, sampling, constraints, forks
            self.runner,
            self.stats,
            self.eos_token_ids,
            model_config.vocab_size,
            self.tokenizer,
            self.proposer,
            self.seq_ids,
        )

    def _scheduler(self, output_lengths: LearnedLengths) -> Scheduler:
        """The scheduler over this engine's KV cache, with the admission policy the config names."""
        config = self.config
        admission = make_admission(
            config.admission,
            self.kv_cache,
            config.max_num_batched_tokens,
            output_lengths,
            config.ttft_target,
            config.refuse_late,
        )
        return Scheduler(
            self.kv_cache,
            config.scheduling,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.context_len,
            self.model.config.vocab_size,
            admission,
            self.proposer,
        )

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        sampler: Sampler | None = None,
    ) -> str:
        """Queue a request; `arrival_time` (a time.perf_counter() value, default now) is when its
        time to first token starts counting, for a caller that took the request in earlier.
        `priority` (an int, lower first, as in vLLM) weighs in with admission="memory".
        `sampler` replaces the sampler `params` would build: anything called with the next-token
        logits (vocab,) that returns a token id, e.g. teacher forcing (`evaluation.TeacherForcing`),
        which scores a given text through the cache instead of choosing tokens."""
        params = params or SamplingParams()
        check_request_args(params, arrival_time, priority, sampler, self.model.config.vocab_size)
        seq_id = next(self.seq_ids)
        request_id = request_id if request_id is not None else str(seq_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ConfigError("This engine has no tokenizer; pass prompts as token ids.")
        prompt_ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else token_list(prompt)
        seq = Sequence(
            seq_id, request_id, prompt_ids, params, self.scheduler.max_len(len(prompt_ids), params.max_tokens)
        )
        if sampler is not None:
            seq.sampler = sampler
        if params.structured is not None:
            seq.grammar = self.grammars().start(params.structured)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        seq.priority = priority
        self.requests[request_id] = [seq]
        if params.beam_width > 1:
            self.chooser.start_beams(request_id, params.beam_width, seq)
        if not self.scheduler.admits(seq):
            self.rejected.append(seq)
        elif not self._fetch_from_store(seq):
            self.scheduler.add(seq)
        return request_id

    def _fetch_from_store(self, seq: Sequence) -> bool:
        """Ask the remote store for the prompt's blocks missing here; True if the sequence waits for
        them (not a request that needs every prompt token's logits: it computes them all anyway)."""
        fetch = self.kv_cache.fetch_remote(seq.prompt_ids) if seq.params.prompt_logprobs is None else None
        if fetch is not None:
            self.fetching[seq.request_id] = (seq, fetch)
        return fetch is not None

    def _take_fetched(self) -> None:
        """Requests whose fetch came back (its blocks installed first) or is too late to wait for
        (they recompute; what comes after is dropped) join the scheduler."""
        for request_id, (seq, fetch) in list(self.fetching.items()):
            if fetch.ended:
                del self.fetching[request_id]
                self.kv_cache.install_remote(fetch)
                self.scheduler.add(seq)

    def _wait_for_fetch(self) -> None:
        """Nothing else to run: wait briefly for a fetch to end rather than spin."""
        _, fetch = next(iter(self.fetching.values()))
        fetch.wait(FETCH_POLL_S)

    def grammars(self) -> Grammars:
        """Structured output's grammar compiler for this engine's vocabulary (the token chooser's)."""
        return self.chooser.grammars()

    def abort(self, request_id: str) -> None:
        """Stop a request now: its blocks go back, and the engine forgets it (no output follows)."""
        if request_id not in self.requests:
            raise ValueError(f"There is no request {request_id!r} to abort (unknown, or already returned).")
        held = self.fetching.pop(request_id, None)
        if held is not None:
            held[1].cancel()
        for seq in self.requests[request_id]:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")
        self.rejected = [seq for seq in self.rejected if seq.request_id != request_id]
        self._forget(request_id)

    def has_request(self, request_id: str) -> bool:
        """Is the request still the engine's (queued, running, or finished but not yet returned)?"""
        return request_id in self.requests

    def refusal(self, request_id: str) -> str | None:
        """Why the request was refused at admission (it never runs), or None if it was queued."""
        seq = self.requests[request_id][0]
        return seq.error if seq.status is Status.FINISHED and seq.finish_reason == "error" else None

    def max_len(self, prompt_len: int, max_tokens: int | None) -> int:
        """Where a request's sequence stops: prompt + max_tokens within the context (or the pool's end)."""
        return self.scheduler.max_len(prompt_len, max_tokens)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.rejected) or bool(self.fetching)

    # ----------------------------------------------------------------- one step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that got a token or ended."""
        outputs = self._outputs_of([seq.request_id for seq in self.rejected])
        self.rejected.clear()
        self.num_steps += 1
        self.kv_cache.begin_step(self.num_steps)  # its events carry the number; last step's prefetch is done
        self._take_fetched()
        if self.fetching and not self.scheduler.has_unfinished():
            self._wait_for_fetch()
            return outputs
        started = time.perf_counter()
        schedule = self.scheduler.schedule()  # 1. who runs, how many tokens; blocks reserved
        self.stats.schedule_s.append(time.perf_counter() - started)
        outputs += self._outputs_of(self.scheduler.take_refused())  # too late for their target
        if not schedule.sequences:  # requests wait but none can run: fail them rather than spin forever
            stuck = {seq.request_id for seq in self.scheduler.unfinished()}
            return outputs + self._fail(stuck, "The scheduler found nothing it could run (a bug in minillm).")
        try:
            return outputs + self._run(schedule)
        except Exception as err:  # the batch fails, the engine goes on serving the others
            failed = {item.seq.request_id for item in schedule.sequences}
            return outputs + self._fail(failed, f"This step failed ({type(err).__name__}: {err}).")

    def _run(self, schedule: Schedule) -> list[RequestOutput]:
        """Stages 2 to 6 of one step, over what the scheduler chose."""
        self.kv_cache.apply(schedule.bring_back)  # 2. copies before anyone writes
        forward = self.runner.forward(schedule.sequences)  # 3. one forward pass
        ran = schedule.ran()  # who ran and what attention read, before 4 moves their counts on
        checked = self.chooser.check(schedule, forward)  # prompts scored, guesses checked: before 4 too
        evicted = self.scheduler.computed(schedule, checked.kept, forward.attention)  # 4.
        self._carry_out(checked)  # guessing sequences that stop
        chosen = self.chooser.choose(schedule, forward)  # 5. next tokens
        self._carry_out(chosen)  # forks join, finished sequences leave
        step_seconds = time.perf_counter() - forward.started
        live = self.scheduler.cached_entries()
        memory, rungs = self.kv_cache.end_step(ran, forward.seconds, step_seconds, live, self.scheduler.queue)
        self.stats.record(schedule, checked.appended + chosen.appended, evicted, memory, rungs)
        return self._outputs_of(list(dict.fromkeys(checked.changed + chosen.changed)))  # 6.

    def _carry_out(self, choice: Choice) -> None:
        """Have the scheduler carry out what token choice decided, in its order."""
        for request_id, seqs in choice.families.items():
            self.requests[request_id][:] = seqs
        for change in choice.changes:
            if isinstance(change, Fork):
                self.scheduler.fork(change.parent, change.child)
            elif isinstance(change, Fail):
                self._end_with_error(change.request_id, change.error)
            elif change.seq.status is not Status.FINISHED:  # its request may have failed first
                self.scheduler.finish(change.seq, change.reason)

    def _fail(self, request_ids: set[str], error: str) -> list[RequestOutput]:
        """End these requests with `error`; their blocks go back and the engine stays usable."""
        for request_id in request_ids:
            self._end_with_error(request_id, error)
        return self._outputs_of(sorted(request_ids))

    def _end_with_error(self, request_id: str, error: str) -> None:
        for seq in self.requests[request_id]:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "error", error)

    def _outputs_of(self, request_ids: list[str]) -> list[RequestOutput]:
        """The requests' outputs. A request whose output is final is forgotten: a long-lived engine
        keeps nothing of the requests it has answered."""
        outputs = [
            RequestOutput.of(self.requests[request_id], self.tokenizer, self.eos_token_ids)
            for request_id in request_ids
        ]
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def _forget(self, request_id: str) -> None:
        self.chooser.forget(request_id, self.requests.pop(request_id))

    # ----------------------------------------------------------------- sessions (memory/sessions.py)
    def _session_identity(self) -> dict[str, str]:
        """What a session's KV depends on: the model (its fingerprint), block size, storage format."""
        c = self.config
        return {
            "model": model_fingerprint(self.model),
            "block_size": str(c.block_size),
            "dtype": c.dtype,
            "kv_dtype": c.kv_dtype,
            "kv_key_scales": c.kv_key_scales,
        }

    def save_session(self, path: Path, token_ids: list[int], extra: dict | None = None) -> int:
        """Park the cached KV of `token_ids` (a finished conversation) in a file; returns the tokens kept."""
        return self.kv_cache.sessions().save(path, token_ids, self._session_identity(), extra)

    def load_session(self, path: Path) -> tuple[list[int], dict]:
        """Load a parked session's KV as cached prefix blocks; returns (its token ids, its extra)."""
        return self.kv_cache.sessions().load(path, self._session_identity())

    def memory_stats(self) -> MemoryStats:
        return self.snapshot().stats

    def snapshot(self) -> MemorySnapshot:
        """The memory system now, read-only (`memory/accounting.py`): blocks per state and tier,
        bytes, tables, counters, prefix-cache hits. What anything outside the engine reads."""
        sequences = [
            (seq.seq_id, seq.request_id, seq.status.value, seq.num_computed, seq.num_cached, seq.max_len)
            for seq in [*self.scheduler.unfinished(), *(seq for seq, _ in self.fetching.values())]
        ]
        return self.kv_cache.snapshot(sequences, {"preemptions": self.scheduler.num_preemptions})

    def checked_guesses(self) -> dict[int, list[int]]:
        """Speculation in the last step: seq_id -> the tokens guessed after its last token and
        checked in that pass, kept or not (`speculative.py`); empty when nobody guessed."""
        return self.chooser.checked_guesses()

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """`subscriber(step, event)` hears every change of a block's life from now on, first a
        `Snapshot` of the state now (`memory/events.py`). Returns the call that stops it hearing."""
        return self.kv_cache.subscribe(subscriber)

    def prefix_hit_tokens(self) -> int:
        """Prompt tokens the prefix cache has saved from prefill so far (0 without a cache)."""
        snapshot = self.snapshot()
        cache = snapshot.prefix_cache
        return cache["hit_blocks"] * snapshot.block_size if cache else 0

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions


def token_list(prompt) -> list:
    """A prompt given as token ids, as a list (each id is checked at admission)."""
    try:
        return list(prompt)
    except TypeError:
        raise ValueError(f"A prompt is text or a list of token ids, not {type(prompt).__name__}.") from None
