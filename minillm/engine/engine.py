"""The serving engine: requests in, tokens out, one batched forward pass per step.

One `LLMEngine.step()`:
  1. the scheduler picks sequences and token counts (decode tokens, prefill chunks), growing
     their block tables — or preempting when blocks run out;
  2. every scheduled token gets a slot through its sequence's block table;
  3. one forward pass over all the step's tokens, laid end to end; each attention layer writes
     k, v into the slots and reads each sequence's history through its table (PagedAttention);
  4. with eviction, sequences over their KV budget drop entries (memory/eviction.py);
  5. each sequence whose tokens are all computed samples its next token; finished sequences
     release their blocks.

`LLM` wraps it with a vLLM-shaped API: `LLM(model_dir, **switches).generate(prompts, params)`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence as Seq

import torch

from minillm.attention.kernels import decode_backend
from minillm.attention.paged import DecodeBatch, PagedAttention, PagedKVCache, SequenceSlice, context_slots
from minillm.config import DEFAULT_MODEL_DIR, ConfigError, EngineConfig, prompt_problem
from minillm.engine.beam import BeamGroup, select
from minillm.engine.scheduler import ScheduledSequence, Scheduler
from minillm.engine.sequence import Sequence, Status
from minillm.memory.accounting import MemoryStats, paged_stats
from minillm.memory.block_manager import BlockManager
from minillm.memory.eviction import budget_for, evict, grow_attention_mass, kept_entries
from minillm.memory.quantization import FORMATS, QuantizedKVCache, bytes_per_token
from minillm.model import Transformer
from minillm.progress import progress_bar
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model


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

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ConfigError("This engine has no tokenizer; read token_ids instead of text.")
        return self.tokenizer.decode([t for t in token_ids if t != self.tokenizer.eos_token_id])

    @property
    def text(self) -> str:
        return self.decode(self.token_ids)

    @classmethod
    def of(cls, seqs: list[Sequence], tokenizer: Tokenizer | None) -> "RequestOutput":
        first = seqs[0]
        ttft = tpot = None
        if first.first_token_time is not None:
            ttft = first.first_token_time - first.arrival_time
            if first.finish_time is not None and len(first.output_ids) > 1:
                tpot = (first.finish_time - first.first_token_time) / (len(first.output_ids) - 1)
        finished = all(seq.status is Status.FINISHED for seq in seqs) and len(seqs) == first.params.num_outputs \
            or first.finish_reason in ("error", "abort")
        return cls(first.request_id, list(first.prompt_ids), list(first.output_ids), finished, first.finish_reason,
                   first.error, ttft, tpot, sum(seq.num_preemptions for seq in seqs),
                   [list(seq.output_ids) for seq in seqs], tokenizer)


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0  # prefill + decode tokens through the model
    tokens_generated: int = 0
    tokens_evicted: int = 0  # KV entries eviction dropped, per sequence (not per layer or head), counted at
    #   each drop: a sequence recomputed after a preemption drops, and counts, its entries again
    memory: list[MemoryStats] = field(default_factory=list)  # after every step
    batches: list[list[tuple[str, int]]] = field(default_factory=list)  # per step: (request_id, tokens computed)

    def kv_utilization(self) -> float:
        """Live slots / reserved slots, summed over all steps."""
        reserved = sum(m.reserved_slots for m in self.memory)
        return sum(m.live_slots for m in self.memory) / reserved if reserved else 1.0


class LLMEngine:
    def __init__(self, config: EngineConfig, model: Transformer | None = None, tokenizer: Tokenizer | None = None):
        self.config = config
        self.model = model if model is not None else load_model(config.model_dir, config.torch_dtype, config.device)
        self.tokenizer = tokenizer if tokenizer is not None or model is not None else Tokenizer(config.model_dir)
        self.context_len = config.max_seq_len or self.model.config.max_position_embeddings
        self.bytes_per_slot = self.kv_bytes_per_token()
        num_blocks = config.kv_cache_bytes // (self.bytes_per_slot * config.block_size)
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_bytes={config.kv_cache_bytes:,} cannot hold one block of {config.block_size} "
                              f"tokens ({self.bytes_per_slot * config.block_size:,} bytes); raise it.")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.prefix_caching)
        self.cache = self.make_cache(num_blocks)
        self.decode_kernel = None if config.attention_backend == "torch" else decode_backend(config.attention_backend)
        self.scheduler = Scheduler(self.block_manager, config.scheduling, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.requests: dict[str, list[Sequence]] = {}  # request_id -> its samples' (or beams') sequences
        self.beam_groups: dict[str, BeamGroup] = {}
        self.rejected: list[Sequence] = []  # failed at admission; reported by the next step
        self.stats = EngineStats()
        self.seq_ids = itertools.count()

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token slot costs, scales included for a quantized pool."""
        model_config, config = self.model.config, self.config
        if config.kv_dtype == "auto":
            return model_config.kv_bytes_per_token(self.model.dtype)
        if model_config.head_dim % FORMATS[config.kv_dtype].values_per_byte:
            raise ConfigError(f"kv_dtype={config.kv_dtype!r} packs two numbers per byte and needs an even head_dim "
                              f"(this model has {model_config.head_dim}); use int8 or fp8.")
        return math.ceil(bytes_per_token(model_config, FORMATS[config.kv_dtype], config.kv_key_scales,
                                         config.block_size))

    def make_cache(self, num_blocks: int):
        config, model = self.config, self.model
        if config.kv_dtype == "auto":
            return PagedKVCache(model.config, num_blocks, config.block_size, model.dtype, model.device)
        return QuantizedKVCache(model.config, num_blocks, config.block_size, FORMATS[config.kv_dtype],
                                config.kv_key_scales, model.dtype, model.device)

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; `arrival_time` (a time.perf_counter() value, default now) is when its
        time to first token starts counting, for a caller that took the request in earlier."""
        params = params or SamplingParams()
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))
                                         or not math.isfinite(arrival_time)):
            raise ValueError(f"arrival_time must be a time.perf_counter() value, not {arrival_time!r}")
        seq_id = next(self.seq_ids)
        request_id = request_id if request_id is not None else str(seq_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ConfigError("This engine has no tokenizer; pass prompts as token ids.")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_len = min(self.context_len, len(prompt_ids) + params.max_tokens)
        seq = Sequence(seq_id, request_id, prompt_ids, params, max_len)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.requests[request_id] = [seq]
        if params.beam_width > 1:
            self.beam_groups[request_id] = BeamGroup(params.beam_width, live=[(seq, 0.0)])
        problem = self.admission_problem(seq)
        if problem:
            seq.finish("error", problem)
            self.rejected.append(seq)
        else:
            self.scheduler.add(seq)
        return request_id

    def admission_problem(self, seq: Sequence) -> str | None:
        """Why a request can never run, or None. It fails alone; the others go on."""
        problem = prompt_problem(len(seq.prompt_ids), self.context_len)
        if problem:
            return problem
        if seq.params.num_outputs > self.config.max_num_seqs:
            return (f"This request runs {seq.params.num_outputs} sequences at once (n or beam_width) but "
                    f"max_num_seqs is {self.config.max_num_seqs}; raise max_num_seqs or lower n.")
        most_held = seq.max_len
        if self.config.eviction != "none":  # the budget plus one step's tokens, before they are evicted
            most_held = min(most_held, budget_for(self.config.kv_budget, seq.max_len)
                            + self.config.max_num_batched_tokens)
        needed = self.block_manager.blocks_for(most_held)
        if needed > self.block_manager.num_blocks:
            return (f"This request may need {needed} KV blocks ({seq.max_len} tokens) but the pool has only "
                    f"{self.block_manager.num_blocks}; raise kv_cache_bytes or lower max_tokens.")
        return None

    def abort(self, request_id: str) -> None:
        for seq in self.requests[request_id]:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq)
                seq.finish("abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.rejected)

    # ----------------------------------------------------------------- one step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that got a token or ended."""
        outputs = [RequestOutput.of([seq], self.tokenizer) for seq in self.rejected]
        self.rejected.clear()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return outputs
        self.cache.forget_free_blocks(self.block_manager.refcounts)
        self.cache.copy_blocks(self.scheduler.pending_copies)  # copy-on-write, before anyone writes
        self.scheduler.pending_copies = []
        hidden, last_rows = self.forward(scheduled)
        cache = self.block_manager.prefix_cache
        for item in scheduled:
            item.seq.num_computed += item.num_tokens
            if cache:  # blocks that just became full and computed can serve later prompts
                cache.register(item.seq.seq_id, self.block_manager.table(item.seq.seq_id), item.seq.token_ids,
                               item.seq.num_computed)
            if self.config.eviction != "none":
                self.evict_over_budget(item.seq)
        ready = [(item.seq, row) for item, row in zip(scheduled, last_rows) if item.seq.num_uncomputed == 0]
        if ready:
            rows = torch.tensor([row for _, row in ready], device=hidden.device)
            logits = self.model.logits(hidden[rows])  # (sequences ready to sample, vocab)
            eos = self.tokenizer.eos_token_id if self.tokenizer else self.model.config.eos_token_id
            changed = {}
            for (seq, _), seq_logits in zip(ready, logits):
                group = self.beam_groups.get(seq.request_id)
                if group is not None:
                    group.pending[seq.seq_id] = torch.log_softmax(seq_logits, dim=-1)
                    if group.ready():  # every live beam has its next-token scores: choose
                        self.advance_beams(group, eos)
                        changed[seq.request_id] = self.requests[seq.request_id]
                    continue
                for sample in self.samples_of(seq):  # n > 1: the first sampling forks the prompt
                    sample.append(sample.sampler(seq_logits), eos)
                    if sample.status is Status.FINISHED:
                        self.scheduler.finish(sample)
                changed[seq.request_id] = self.requests[seq.request_id]
            outputs += [RequestOutput.of(seqs, self.tokenizer) for seqs in changed.values()]
        self.record_step(scheduled, len(ready))
        return outputs

    def advance_beams(self, group: BeamGroup, eos: int | None) -> None:
        """One beam-search step: keep the best `width` (beam, token) pairs; fork beams chosen
        more than once, drop beams chosen by nobody (their blocks go back to the pool)."""
        live = group.live
        choices = select([score for _, score in live], torch.stack([group.pending[s.seq_id] for s, _ in live]),
                         group.width)
        group.pending.clear()
        chosen = {beam for beam, _, _ in choices}
        for index, (seq, _) in enumerate(live):
            if index not in chosen:
                self.scheduler.finish(seq)
                seq.finish("pruned")
        claimed, assignments = set(), []
        for beam, token, score in choices:  # fork before any beam appends, so forks copy the parent as it was
            parent = live[beam][0]
            seq = parent if beam not in claimed else parent.fork(next(self.seq_ids), 0)
            if seq is not parent:
                self.scheduler.fork(parent, seq)
            claimed.add(beam)
            assignments.append((seq, token, score))
        group.live = []
        for seq, token, score in assignments:
            seq.append(token, eos)
            if seq.status is Status.FINISHED:
                self.scheduler.finish(seq)
                group.finished.append((seq, score))
            else:
                group.live.append((seq, score))
        request_id = live[0][0].request_id
        self.requests[request_id] = [seq for seq, _ in group.live] or group.ranked()

    def evict_over_budget(self, seq: Sequence) -> None:
        """Drop the sequence's least needed cache entries down to its budget (eviction policy)."""
        keep = budget_for(self.config.kv_budget, seq.max_len)
        if seq.num_cached <= keep:
            return
        model_config = self.model.config
        kept = kept_entries(self.config.eviction, seq.num_cached, keep, model_config.num_layers,
                            model_config.num_kv_heads, seq.attention_mass).to(self.model.device)
        dropped = seq.num_cached - keep
        if evict(seq, kept, self.cache, self.block_manager):
            self.stats.tokens_evicted += dropped

    def samples_of(self, seq: Sequence) -> list[Sequence]:
        """The sequences that sample from `seq`'s logits: itself, and when a request with n > 1
        samples for the first time, n - 1 forks sharing its blocks (parallel sampling)."""
        if seq.params.n == 1 or len(self.requests[seq.request_id]) == seq.params.n:
            return [seq]
        forks = [seq.fork(next(self.seq_ids), index) for index in range(1, seq.params.n)]
        for child in forks:
            self.scheduler.fork(seq, child)
        self.requests[seq.request_id] += forks
        return [seq, *forks]

    def forward(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[int]]:
        """One forward pass over every scheduled token, sequences laid end to end.
        Returns the hidden states (N, hidden) and each sequence's last row."""
        device, block_size, model_config = self.model.device, self.config.block_size, self.model.config
        token_ids, positions, write_slots, sequences = [], [], [], []
        decode_rows, decode_tables, decode_lens, last_rows = [], [], [], []
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            first, end = seq.num_cached, seq.num_cached + n  # cache indices of the new tokens
            row = len(token_ids)
            token_ids += seq.token_ids[seq.num_computed:seq.num_computed + n]
            positions += range(seq.num_computed, seq.num_computed + n)
            self.block_manager.check_writable(seq.seq_id, first, end)
            write_slots += self.block_manager.slots(seq.seq_id, first, end)
            table = self.block_manager.table(seq.seq_id)
            if self.decode_kernel is not None and n == 1:  # one query: the kernel's job
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                mass = None
                if self.config.eviction == "h2o":
                    mass = grow_attention_mass(seq, end, model_config.num_layers, model_config.num_kv_heads, device)
                sequences.append(SequenceSlice(row, row + n, torch.arange(first, end, device=device),
                                               context_slots(table, block_size, end, device), mass))
            last_rows.append(row + n - 1)
        decode = DecodeBatch.of(decode_rows, decode_tables, decode_lens, device) if decode_rows else None
        ctx = PagedAttention(self.cache, torch.tensor(write_slots, device=device), sequences, decode,
                             self.decode_kernel)
        hidden = self.model(torch.tensor(token_ids, device=device), torch.tensor(positions, device=device), ctx)
        return hidden, last_rows

    def record_step(self, scheduled: list[ScheduledSequence], sampled: int) -> None:
        self.stats.steps += 1
        self.stats.tokens_computed += sum(item.num_tokens for item in scheduled)
        self.stats.tokens_generated += sampled
        self.stats.batches.append([(item.seq.request_id, item.num_tokens) for item in scheduled])
        live = {seq.seq_id: seq.num_cached for seq in self.scheduler.running}
        self.stats.memory.append(paged_stats(self.block_manager, live, self.bytes_per_slot))

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions


class LLM:
    """`LLM(model_dir, **switches)`; switches are `EngineConfig` fields (block_size, scheduling, ...)."""

    def __init__(self, model_dir: str | Path = DEFAULT_MODEL_DIR, *, model: Transformer | None = None,
                 tokenizer: Tokenizer | None = None, **switches):
        self.engine = LLMEngine(EngineConfig(model_dir=Path(model_dir), **switches), model, tokenizer)

    def generate(self, prompts: Seq[str | list[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        final: dict[str, RequestOutput] = {}
        with progress_bar("requests", len(ids), enabled=progress) as advance:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        advance()
        return [final[i] for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output each time it gains a token (the last one is finished)."""
        request_id = self.engine.add_request(prompt, params)
        while True:
            for out in self.engine.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return
