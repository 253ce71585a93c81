"""Independent references for the lossy switches: what the engine's cache should have shown each
query, recomputed with no cache at all.

The engine computes a sequence in chunks (prefill chunks, then one token per decode step; all
over again after a preemption), and what a query sees depends on that history: with eviction,
only the entries kept when its chunk ran; with a quantized pool, keys and values rounded as they
were stored by then. `ScheduleRecorder` writes the history down as the engine runs;
`replay_eviction` and `replay_quantized` then recompute the sequence chunk by chunk with the
naive model over *all* its tokens, each chunk's queries masked to (or reading rounded copies of)
exactly the keys the engine should have kept. Nothing here reads the engine's cache, block tables
or eviction code: from the engine comes only the schedule (which tokens each step computed, and
whether a step's eviction ran); the kept sets, the H2O scores and the rounding are worked out
anew from token positions (only the budget's count, `budget_for`, is the engine's: tested alone).
The `assert_...` functions at the end hold a recorded run to these references, within the
bounds each lossy switch is allowed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from minillm.memory.eviction import budget_for
from minillm.memory.quantization import dequantize, quantize
from minillm.sampling import Sampler

NUM_SINKS = 4  # StreamingLLM's initial tokens, as the papers (and DESIGN.md) state
QUANT_REFERENCE_ATOL = 1e-4  # float noise between two ways of summing the same numbers


@dataclass
class Chunk:
    step: int
    start: int  # the sequence's first token computed in this chunk
    num_tokens: int
    samples: bool  # the chunk reached the sequence's last token, so its logits chose the next one
    cached_after: int | None = (
        None  # cache entries after the step: did eviction run (or wait for a free block)?
    )

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class ScheduleRecorder:
    """Records every chunk the engine computes, per sequence, by wrapping `ModelRunner.forward`,
    how many cache entries each sequence holds after the step, by wrapping `LLMEngine.step`, and
    the H2O scores and entry positions the KV cache manager held for a sequence when it let go of
    it (`freed_state`), by wrapping `KVCacheManager.free`."""

    def __init__(self, engine):
        self.chunks: dict[int, list[Chunk]] = defaultdict(list)
        self.step = 0
        self.this_step: list[tuple[object, Chunk]] = []
        forward, step = engine.runner.forward, engine.step

        def recording_forward(scheduled):
            for item in scheduled:
                seq = item.seq
                chunk = Chunk(
                    self.step,
                    seq.num_computed,
                    item.num_tokens,
                    seq.num_computed + item.num_tokens == seq.num_tokens,
                )
                self.chunks[seq.seq_id].append(chunk)
                self.this_step.append((seq, chunk))
            return forward(scheduled)

        def recording_step():
            self.this_step = []
            outputs = step()
            for seq, chunk in self.this_step:
                chunk.cached_after = seq.num_cached
            self.step += 1
            return outputs

        kv_cache, free = engine.kv_cache, engine.kv_cache.free
        self.freed_state: dict[
            int, tuple
        ] = {}  # seq_id -> (attention mass, entry positions) at its last free

        def recording_free(seq_id):
            self.freed_state[seq_id] = kv_cache.eviction_state(seq_id)
            free(seq_id)

        engine.runner.forward, engine.step, kv_cache.free = recording_forward, recording_step, recording_free

    def history(self, seq, parent=None) -> list[Chunk]:
        """The chunks that built `seq`'s cache. A parallel sample forked from `parent` at the
        parent's first sampling inherits the parent's chunks up to that step."""
        own = self.chunks[seq.seq_id]
        if parent is None or parent is seq:
            return own
        fork_step = next(chunk.step for chunk in self.chunks[parent.seq_id] if chunk.samples)
        return [chunk for chunk in self.chunks[parent.seq_id] if chunk.step <= fork_step] + own


class RecordingSampler:
    """Wraps a sequence's sampler to keep the logits it was given."""

    def __init__(self, sampler):
        self.sampler, self.logits = sampler, []

    def __call__(self, logits):
        self.logits.append(logits.clone())
        return self.sampler(logits)


def run_recorded(llm, prompts, params):
    """Run the prompts to the end, recording the schedule and every first sample's logits."""
    engine = llm.engine
    recorder = ScheduleRecorder(engine)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    requests = [engine.requests[request_id] for request_id in ids]  # the engine forgets them once answered
    for seqs in requests:
        seqs[0].sampler = RecordingSampler(seqs[0].sampler)
    while engine.has_unfinished_requests():
        engine.step()
    return recorder, requests


class ReplayAttention:
    """No cache: every chunk's queries attend over keys [0, chunk end) of the full sequence,
    masked by `mask_of` and read through `view` (the identity, or a rounded copy)."""

    def __init__(self, spans, mask_of, view):
        self.spans = spans  # [(start, end)] of the chunks since the cache was last empty
        self.mask_of = mask_of  # (layer, start, end) -> (kv_heads, end - start, end) bool
        self.view = view  # (layer, k, v, end) -> keys, values (end, kv_heads, head_dim)
        self.mass: list[torch.Tensor] = []  # per layer: (kv_heads, T) attention the last chunk paid each key

    def attend(self, layer, q, k, v):
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k.shape[1]
        out = torch.empty_like(q)
        mass = torch.zeros(k.shape[1], k.shape[0])
        for start, end in self.spans:
            keys, values = self.view(layer, k, v, end)
            mask = self.mask_of(layer, start, end)
            for head in range(num_heads):  # head by head: no grouping trick to get wrong
                kv_head = head // group
                scores = q[start:end, head] @ keys[:, kv_head].T * head_dim**-0.5
                probs = scores.masked_fill(~mask[kv_head], float("-inf")).softmax(dim=-1)
                out[start:end, head] = probs @ values[:, kv_head]
                if (start, end) == self.spans[-1]:
                    mass[kv_head, :end] += probs.sum(dim=0)
        self.mass.append(mass)
        return out


@dataclass
class Replayed:
    logits: list[torch.Tensor]  # the logits of every sampling chunk, in order
    dropped: int  # entries evicted in this sequence's own chunks
    held: list[list[list[int]]] | None = None  # [layer][kv_head] -> positions in the cache at the end
    mass: list[list[dict[int, float]]] | None = None  # [layer][kv_head] -> position -> H2O score


def keep_by_policy(policy: str, held: list[int], keep: int, mass: dict[int, float]) -> list[int]:
    """The `keep` positions a policy keeps out of `held` (in position order), written from the
    papers' definitions rather than from minillm's code."""
    if policy == "window" or keep < 2:
        return held[-keep:]
    if policy == "sinks":
        sinks = min(NUM_SINKS, keep - 1)
        return held[:sinks] + held[-(keep - sinks) :]
    recent = keep // 2  # H2O: half the budget for the most recent tokens, half for heavy hitters
    older, window = held[:-recent], held[-recent:]
    newest = held[-1]  # every token from a position to the newest attended to it
    heavy = sorted(older, key=lambda position: -mass[position] / (newest + 1 - position))[
        : keep - recent
    ]  # per query
    return sorted(heavy) + window


@torch.inference_mode()
def replay_eviction(
    model,
    token_ids: list[int],
    history: list[Chunk],
    policy: str,
    keep: int,
    owned_from_step: int = 0,
    protected: int = 0,
) -> Replayed:
    """The sequence under eviction: after each chunk, every (layer, KV head) keeps its first
    `protected` positions (with the prefix cache: the prompt's full blocks) and `keep` of the
    others, chosen by `policy`; later queries see only those plus their own chunk (causally). The
    engine may put an eviction off by a step when the copy-on-write it needs finds no free block:
    the record says whether it ran, never which entries it kept.

    A chunk that starts where no chunk ended (the first, or a recompute after preemption) starts
    from an empty cache but for positions [0, start): prefix-cache hits, whose K/V a full causal
    prefill computed (nothing before `protected` is ever dropped) and which have no score yet.
    (A recompute whose hits end exactly where it had stopped would read as going on; the tests
    that mix hits and eviction do not preempt.)"""
    config = model.config
    layers, kv_heads, length = config.num_layers, config.num_kv_heads, len(token_ids)
    allowed = torch.zeros(layers, kv_heads, length, length, dtype=torch.bool)
    logits, dropped, end = [], 0, 0
    for chunk in history:
        start = chunk.start
        if chunk is history[0] or start < end:
            spans, allowed[:] = ([(0, start)] if start else []), False
            allowed[..., :start, :start] = torch.ones(start, start, dtype=torch.bool).tril()
            held = [[list(range(start)) for _ in range(kv_heads)] for _ in range(layers)]
            mass = [[defaultdict(float) for _ in range(kv_heads)] for _ in range(layers)]
        end = chunk.end
        for layer in range(layers):
            for kv_head in range(kv_heads):
                rows = allowed[layer, kv_head, start:end]
                rows[:, held[layer][kv_head]] = True
                rows[:, start:end] |= torch.ones(end - start, end - start, dtype=torch.bool).tril()
        spans.append((start, end))
        ctx = ReplayAttention(
            spans, lambda layer, s, e: allowed[layer, :, s:e, :e], lambda layer, k, v, e: (k[:e], v[:e])
        )
        hidden = model(torch.tensor(token_ids[:end]), torch.arange(end), ctx)
        if chunk.samples:
            logits.append(model.logits(hidden[end - 1 : end])[0])
        for layer in range(layers):
            for kv_head in range(kv_heads):
                positions = held[layer][kv_head] + list(range(start, end))
                for position in positions:
                    mass[layer][kv_head][position] += float(ctx.mass[layer][kv_head, position])
                shared = [position for position in positions if position < protected]
                private = positions[len(shared) :]
                if len(private) > keep and chunk.cached_after != len(positions):
                    assert chunk.cached_after == len(shared) + keep, (
                        f"step {chunk.step}: {chunk.cached_after} entries, {len(shared)} protected, "
                        f"budget {keep}"
                    )
                    positions = shared + keep_by_policy(policy, private, keep, mass[layer][kv_head])
                    if layer == kv_head == 0 and chunk.step >= owned_from_step:
                        dropped += len(private) - keep
                held[layer][kv_head] = positions
    return Replayed(logits, dropped, held, mass)


def fake_quantized_view(fmt, key_scales: str, block_size: int):
    """K/V as a quantized pool returns them once the first `end` tokens are written: values
    rounded per token; keys per token, or per channel over each *full* block (a block still
    filling is read exact). `fmt=None` rounds nothing: the same replay, unquantized."""

    def view(layer, k, v, end):
        if fmt is None:
            return k[:end], v[:end]
        values = dequantize(*quantize(v[:end], fmt, dim=-1), fmt)
        if key_scales == "token":
            return dequantize(*quantize(k[:end], fmt, dim=-1), fmt), values
        keys = k[:end].clone()
        for first in range(0, end - end % block_size, block_size):
            keys[first : first + block_size] = dequantize(
                *quantize(k[first : first + block_size], fmt, dim=0), fmt
            )
        return keys, values

    return view


@torch.inference_mode()
def replay_quantized(
    model, token_ids: list[int], history: list[Chunk], fmt, key_scales: str, block_size: int
) -> Replayed:
    """The sequence through a quantized pool: each chunk's queries read every earlier key and
    value rounded as the pool holds them when the chunk has been written."""
    view = fake_quantized_view(fmt, key_scales, block_size)
    logits = []
    spans = []  # (start, end) of each chunk written so far
    for chunk in history:
        if chunk.start == 0:  # a chunk from the first token starts the sequence again
            spans = []
        spans.append((chunk.start, chunk.end))
        causal = torch.ones(chunk.end, chunk.end, dtype=torch.bool).tril()
        ctx = ReplayAttention(
            spans, lambda layer, s, e: causal[s:e, :e].expand(model.config.num_kv_heads, -1, -1), view
        )
        hidden = model(torch.tensor(token_ids[: chunk.end]), torch.arange(chunk.end), ctx)
        if chunk.samples:
            logits.append(model.logits(hidden[chunk.end - 1 : chunk.end])[0])
    return Replayed(logits, 0)


def kv_shape(model) -> tuple[int, int]:
    """(layers, kv_heads): the shape of what the KV cache manager keeps per sequence entry."""
    return model.config.num_layers, model.config.num_kv_heads


def held_positions(kv_positions, seq, shape) -> torch.Tensor:
    """(layers, kv_heads, num_cached): the token position each cache entry of `seq` holds, from
    the positions the KV cache manager keeps for it (None: nothing moved yet)."""
    if kv_positions is None:  # nothing moved yet: entry i holds position i
        return torch.arange(seq.num_cached).expand(*shape, seq.num_cached)
    assert kv_positions.shape == (*shape, seq.num_cached)
    return kv_positions


def assert_equals_eviction_reference(model, recorder, requests, params, policy, budget, prefix_block_size=0):
    """The engine's output while entries are really dropped equals `replay_eviction`'s: each sampled
    token, its logits (1e-4), the positions each head holds and H2O's scores for them. Returns the
    entries the reference dropped. `prefix_block_size`: with the prefix cache on, its block size
    (each prompt's full blocks are protected from eviction); 0 without it."""
    total_dropped = 0
    for seqs in requests:
        parent = seqs[0]
        protected = (
            len(parent.prompt_ids) // prefix_block_size * prefix_block_size if prefix_block_size else 0
        )
        for seq in seqs:
            history = recorder.history(seq, parent)
            own = recorder.chunks[seq.seq_id]
            replayed = replay_eviction(
                model,
                seq.token_ids,
                history,
                policy,
                budget_for(budget, seq.max_len),
                owned_from_step=own[0].step if seq is not parent else 0,
                protected=protected,
            )
            total_dropped += replayed.dropped
            sampled = [chunk.end for chunk in history if chunk.samples]
            sampler = Sampler(params, seq.sample_index)  # the same draws, from the reference's logits
            assert [sampler(logits) for logits in replayed.logits] == [seq.token_ids[end] for end in sampled]
            if isinstance(seq.sampler, RecordingSampler):
                assert len(seq.sampler.logits) == len(replayed.logits)
                for ours, theirs in zip(seq.sampler.logits, replayed.logits):
                    assert torch.allclose(ours, theirs, atol=1e-4)
            # entries lie in no order (a newcomer takes a dropped entry's slot): sorted by position,
            # each head holds exactly the positions the reference holds
            mass, kv_positions = recorder.freed_state[seq.seq_id]
            positions = held_positions(kv_positions, seq, kv_shape(model))
            assert positions.sort(dim=-1).values.tolist() == replayed.held
            if policy == "h2o":  # the scores H2O kept for the entries it kept, head by head
                expected = torch.tensor(
                    [
                        [
                            [replayed.mass[layer][head][p] for p in replayed.held[layer][head]]
                            for head in range(len(replayed.held[layer]))
                        ]
                        for layer in range(len(replayed.held))
                    ]
                )
                in_position_order = mass.gather(-1, positions.argsort(dim=-1))
                assert torch.allclose(in_position_order, expected, atol=1e-4)
    return total_dropped


def assert_near_the_quantized_reference(model, recorder, requests, fmt, key_scales: str, block_size: int):
    """Every sampled token of a run through a quantized pool is `replay_quantized`'s argmax, and its
    logits lie within the bounds below of the reference's (`requests`: one sequence each)."""
    errors, rounding = [], []  # per sampled token: max |engine - reference|, max |reference - unrounded|
    for (seq,) in requests:
        history = recorder.history(seq)
        quantized = replay_quantized(model, seq.token_ids, history, fmt, key_scales, block_size)
        unrounded = replay_quantized(model, seq.token_ids, history, None, key_scales, block_size)
        assert len(seq.sampler.logits) == len(quantized.logits) == len(seq.output_ids)
        for ours, reference, exact in zip(seq.sampler.logits, quantized.logits, unrounded.logits):
            errors.append(float((ours - reference).abs().max()))
            rounding.append(float((reference - exact).abs().max()))
        assert [int(logits.argmax()) for logits in quantized.logits] == seq.output_ids
    # Float noise (1e-6) between the two computations can tip a value across a rounding boundary
    # now and then; a stored layout read wrongly would move most logits by as much as rounding does.
    assert sum(error <= QUANT_REFERENCE_ATOL for error in errors) >= 0.9 * len(errors)
    assert max(errors) <= 0.2 * max(rounding)
