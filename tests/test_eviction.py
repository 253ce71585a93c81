"""KV eviction: which entries each policy keeps, exactly the budget per head, exact output when
the budget covers the sequence, and composition with paging, chunked prefill, preemption,
shared blocks and the prefix cache (a cached prompt prefix stays whole and shared)."""

from collections import Counter

import pytest
import torch
from helpers import cached_blocks, free_and_intact, heard_snapshot, slots_of
from references import (
    ScheduleRecorder,
    assert_equals_eviction_reference,
    held_positions,
    kv_shape,
    run_recorded,
)

from minillm.config import ConfigError
from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams
from minillm.memory.eviction import NUM_SINKS, budget_for, kept_entries

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32


def test_budget_is_tokens_or_a_fraction_of_the_full_length():
    assert budget_for(64, 1000) == 64
    assert budget_for(0.2, 1000) == 200
    assert budget_for(0.2, 11) == 3  # rounded up
    assert budget_for(0.01, 5) == 1  # never empty
    assert budget_for(1.0, 37) == 37


def test_h2o_keeps_the_recent_window_and_the_most_attended_per_query_not_in_total():
    mass = torch.tensor(
        [
            # layer 0: entry 0 has more in total, entry 4 more per query that saw it
            [[4.0, 0.1, 0.2, 0.3, 2.4, 3.0, 0.0, 0.0]],
            [[7.0, 0.1, 0.2, 0.3, 2.4, 3.0, 0.0, 0.0]],
        ]
    )
    kept = kept_entries("h2o", length=8, keep=4, num_layers=2, num_kv_heads=1, mass=mass)
    # recent window = 2 (entries 6, 7, kept whatever their score); 2 heavy hitters among 0..5, which 8, 7, 6,
    # 5, 4, 3 queries saw: entry 5 (1.0 a query), then entry 4 (0.6) over entry 0 (4.0 / 8 = 0.5) ...
    assert kept[0, 0].tolist() == [4, 5, 6, 7]
    assert kept[1, 0].tolist() == [0, 5, 6, 7]  # ... but not over 7.0 / 8 = 0.875


def test_h2o_divides_by_the_queries_that_saw_an_entry_known_from_its_position():
    mass = torch.tensor([[[6.0, 0.0, 3.0, 0.0, 0.0, 0.0]]])
    by_order = kept_entries("h2o", length=6, keep=2, num_layers=1, num_kv_heads=1, mass=mass)
    assert by_order[0, 0].tolist() == [
        0,
        5,
    ]  # entry 0, seen by at least the 6 entries from it on: 1.0 > 3.0 / 4
    positions = torch.tensor([[[0, 1, 40, 41, 42, 43]]])  # tokens 2..39 were evicted after seeing entry 0
    by_position = kept_entries(
        "h2o", length=6, keep=2, num_layers=1, num_kv_heads=1, mass=mass, positions=positions
    )
    assert by_position[0, 0].tolist() == [2, 5]  # 6.0 / 44 queries < 3.0 / 4


def test_h2o_chooses_per_kv_head_and_keeps_the_same_count_in_each():
    gen = torch.Generator().manual_seed(0)
    mass = torch.rand(3, 4, 50, generator=gen)
    kept = kept_entries("h2o", length=50, keep=10, num_layers=3, num_kv_heads=4, mass=mass)
    assert kept.shape == (3, 4, 10)
    seen = torch.arange(50, 0, -1)  # entries at or after each one
    for layer in range(3):
        for head in range(4):
            entries = kept[layer, head]
            assert torch.equal(entries, entries.unique())  # distinct, increasing
            assert entries[-5:].tolist() == list(range(45, 50))  # the recent half
            heavy = (mass[layer, head, :45] / seen[:45]).topk(5).indices.sort().values
            assert torch.equal(entries[:5], heavy)
    assert not torch.equal(kept[0, 0], kept[0, 1])  # heads really differ


def test_sinks_keep_the_first_tokens_and_window_only_the_last():
    sinks = kept_entries("sinks", length=100, keep=20, num_layers=1, num_kv_heads=2)
    assert sinks[0, 0].tolist() == list(range(NUM_SINKS)) + list(range(100 - 20 + NUM_SINKS, 100))
    window = kept_entries("window", length=100, keep=20, num_layers=1, num_kv_heads=2)
    assert window[0, 1].tolist() == list(range(80, 100))


def mixed(count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, 97, (int(torch.randint(2, 50, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(count)
    ]
    return prompts, SamplingParams(max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("policy", ["h2o", "sinks", "window"])
def test_a_budget_covering_the_sequence_is_exact(tiny_dir, tiny_model, policy):
    prompts, params = mixed(12, seed=1)
    # chunked prefill and preemption too
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        eviction=policy,
        kv_budget=80,
        block_size=4,
        max_num_batched_tokens=16,
        kv_cache_bytes=40 * 4 * KV_BYTES_PER_TOKEN,
    )
    for out, prompt in zip(llm.generate(prompts, params), prompts):
        assert out.token_ids == generate(tiny_model, prompt, params, "naive").token_ids
    assert llm.engine.num_preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy, budget", [("h2o", 12), ("sinks", 12), ("window", 7), ("h2o", 0.3)])
def test_exactly_the_budget_is_kept_and_the_rest_given_back(tiny_dir, tiny_model, policy, budget):
    prompts, params = mixed(6, seed=2)
    llm = LLM(
        tiny_dir, model=tiny_model, eviction=policy, kv_budget=budget, block_size=4, max_num_batched_tokens=16
    )
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    evicted = False
    while engine.has_unfinished_requests():
        engine.step()
        tables = {view.seq_id: view.table for view in engine.snapshot().sequences}  # one snapshot a step
        for seq in engine.scheduler.running:
            keep = budget_for(budget, seq.max_len)
            assert seq.num_cached == min(keep, seq.num_computed)
            table = tables[seq.seq_id]
            assert len(table) == engine.kv_cache.capacity().blocks_for(seq.num_cached)
            if policy == "h2o":
                mass, _ = engine.kv_cache.eviction_state(seq.seq_id)
                assert mass.shape == (3, 2, seq.num_cached)
            evicted |= seq.num_evicted > 0
        engine.kv_cache.check_invariants()
    assert evicted
    assert free_and_intact(engine)


def test_eviction_changes_the_output_so_the_cache_is_really_read(tiny_dir, tiny_model):
    prompt, params = list(range(40)), SamplingParams(max_tokens=20, ignore_eos=True)
    full = LLM(tiny_dir, model=tiny_model).generate([prompt], params)[0].token_ids
    window = (
        LLM(tiny_dir, model=tiny_model, eviction="window", kv_budget=2)
        .generate([prompt], params)[0]
        .token_ids
    )
    assert window != full


@pytest.mark.parametrize("policy", ["h2o", "window"])
def test_eviction_never_writes_a_shared_block(tiny_dir, tiny_model, policy):
    """Parallel samples share the prompt's blocks; each evicts on its own. Were one to write a
    shared block in place, its sibling's tokens would change."""
    prompt = [(7 * j + 3) % 97 for j in range(37)]
    switches = dict(eviction=policy, kv_budget=24, block_size=4)
    sampling = dict(temperature=1.0, seed=3, max_tokens=25, ignore_eos=True)
    together = LLM(tiny_dir, model=tiny_model, **switches).generate(
        [prompt], SamplingParams(n=3, **sampling)
    )[0]
    for index, sample in enumerate(together.samples):
        alone = LLM(tiny_dir, model=tiny_model, **switches)
        params = SamplingParams(**{**sampling, "seed": sampling["seed"] + index})
        assert sample == alone.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize(
    "switches, words",
    [
        ({"eviction": "h2o"}, "needs kv_budget"),
        ({"kv_budget": 10}, "only applies with eviction"),
        ({"eviction": "lru", "kv_budget": 10}, "eviction must be one of"),
        ({"eviction": "h2o", "kv_budget": 1.5}, "fraction in"),
        ({"eviction": "h2o", "kv_budget": 0}, "token count"),
        ({"kv_dtype": "int3"}, "kv_dtype must be"),
        ({"kv_key_scales": "group"}, "kv_key_scales must be"),
    ],
)
def test_unsupported_compression_switches_are_refused(tiny_dir, tiny_model, switches, words):
    with pytest.raises(ConfigError, match=words):
        LLM(tiny_dir, model=tiny_model, **switches)


def test_a_request_too_long_for_the_pool_runs_when_eviction_bounds_its_cache(tiny_dir, tiny_model):
    # 48 slots
    pool = dict(block_size=4, kv_cache_bytes=12 * 4 * KV_BYTES_PER_TOKEN, max_num_batched_tokens=8)
    prompt, params = list(range(20)), SamplingParams(max_tokens=100, ignore_eos=True)
    refused = LLM(tiny_dir, model=tiny_model, **pool).generate([prompt], params)[0]
    assert refused.finish_reason == "error"
    evicting = LLM(tiny_dir, model=tiny_model, eviction="sinks", kv_budget=32, **pool).generate(
        [prompt], params
    )[0]
    assert evicting.error is None and len(evicting.token_ids) == 100


class AttentionColumnSums:
    """A no-cache attention context that also sums, per layer and KV head, the attention each
    key receives from every later query (the H2O score), computed head by head in plain math."""

    def __init__(self, length):
        self.mask = torch.ones(length, length).tril().bool()
        self.mass = []

    def attend(self, layer_idx, q, k, v):
        group = q.shape[1] // k.shape[1]
        out, mass = torch.empty_like(q), torch.zeros(k.shape[1], k.shape[0])
        for head in range(q.shape[1]):
            kv_head = head // group
            scores = (q[:, head] @ k[:, kv_head].T) / q.shape[-1] ** 0.5
            probs = scores.masked_fill(~self.mask, float("-inf")).softmax(dim=-1)
            out[:, head] = probs @ v[:, kv_head]
            mass[kv_head] += probs.sum(dim=0)
        self.mass.append(mass)
        return out


@torch.inference_mode()
def test_h2o_accumulates_the_attention_each_key_received(tiny_dir, tiny_model):
    prompt, params = [(11 * j + 5) % 97 for j in range(21)], SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_dir, model=tiny_model, eviction="h2o", kv_budget=200, max_num_batched_tokens=8)  # chunked
    recorder = ScheduleRecorder(llm.engine)  # keeps the scores the evictor held when the sequence ended
    seq = llm.engine.requests[llm.engine.add_request(prompt, params)][0]
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    computed = seq.token_ids[: seq.num_computed]  # the last sampled token was never fed back
    ctx = AttentionColumnSums(len(computed))
    tiny_model(torch.tensor(computed), torch.arange(len(computed)), ctx)
    mass, _ = recorder.freed_state[seq.seq_id]
    assert torch.allclose(mass, torch.stack(ctx.mass), atol=1e-4)


# ---------------------------------------------------------------- against a reference while evicting
# The engine's output while entries are really being dropped, compared with `references.replay_eviction`:
# a no-cache forward whose every query is masked, per layer and KV head, to the entries the policy
# keeps — chosen anew from token positions and attention scores computed head by head.


@pytest.mark.parametrize(
    "policy, backend", [("h2o", "torch"), ("sinks", "torch"), ("window", "torch"), ("sinks", "cpu")]
)
def test_engine_under_active_eviction_equals_a_masked_no_cache_reference(
    tiny_dir, tiny_model, policy, backend
):
    """Chunked prefill, preemption and a budget far below every sequence's length."""
    prompts, params = mixed(10, seed=4)
    budget = 11
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        eviction=policy,
        kv_budget=budget,
        block_size=4,
        max_num_batched_tokens=16,
        kv_cache_bytes=24 * 4 * KV_BYTES_PER_TOKEN,
        attention_backend=backend,
    )
    recorder, requests = run_recorded(llm, prompts, params)
    assert llm.engine.num_preemptions > 0
    assert all(seqs[0].num_evicted > 0 for seqs in requests)
    dropped = assert_equals_eviction_reference(tiny_model, recorder, requests, params, policy, budget)
    assert llm.engine.stats.tokens_evicted == dropped  # every drop counted once, a recompute's drops again


@pytest.mark.parametrize("policy", ["h2o", "sinks"])
def test_parallel_samples_under_active_eviction_equal_the_reference(tiny_dir, tiny_model, policy):
    """Samples share the prompt's evicted cache, then each evicts on its own."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 97, (length,), generator=gen).tolist() for length in (30, 19, 41)]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    budget = 0.25
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        eviction=policy,
        kv_budget=budget,
        block_size=4,
        max_num_batched_tokens=12,
        kv_cache_bytes=30 * 4 * KV_BYTES_PER_TOKEN,
    )
    recorder, requests = run_recorded(llm, prompts, params)
    assert all(len(seqs) == 3 and all(seq.num_evicted > 0 for seq in seqs) for seqs in requests)
    dropped = assert_equals_eviction_reference(tiny_model, recorder, requests, params, policy, budget)
    assert llm.engine.stats.tokens_evicted == dropped


# ---------------------------------------------------------------- newcomers fill dropped entries' slots
# Eviction moves no entry that stays: per layer and KV head, a kept newcomer takes a dropped
# entry's slot, so slots hold tokens in no order and the sequence says which position each holds.


def record_written_keys(pool, num_layers: int) -> list[list[torch.Tensor]]:
    """Every key the step's attention writes, per layer, in the order written: for one sequence
    that is never preempted, entry p of a layer's list is position p's key."""
    written, write = [[] for _ in range(num_layers)], pool.write

    def recording_write(layer, slots, k, v):
        written[layer] += list(k.clone())
        return write(layer, slots, k, v)

    pool.write = recording_write
    return written


def cache_keys(engine, seq) -> torch.Tensor:
    """(layers, num_cached, kv_heads, head_dim): the keys the pool holds for the sequence's entries."""
    slots = torch.tensor(slots_of(engine, seq))
    return torch.stack(
        [engine.kv_cache.pool().read(layer, slots)[0] for layer in range(engine.model.config.num_layers)]
    )


@pytest.mark.parametrize("policy", ["window", "sinks"])
def test_each_head_holds_what_the_policy_keeps_out_of_the_whole_history(tiny_dir, tiny_model, policy):
    """After every step at the budget, each (layer, KV head) holds exactly the positions the policy
    keeps out of all tokens so far (window: the last `budget`; sinks: the first NUM_SINKS and the
    most recent), whatever slots they lie in, and the pool holds there the very keys attention
    wrote for those positions."""
    budget = 9
    llm = LLM(tiny_dir, model=tiny_model, eviction=policy, kv_budget=budget, block_size=4)
    engine, shape = llm.engine, kv_shape(tiny_model)
    seq = engine.requests[
        engine.add_request(list(range(5, 20)), SamplingParams(max_tokens=30, ignore_eos=True))
    ][0]
    # (positions, keys) after each step at the budget
    held, written = [], record_written_keys(engine.kv_cache.pool(), shape[0])
    while engine.has_unfinished_requests():
        engine.step()
        if seq.num_evicted and seq.status.value == "running":
            sinks = NUM_SINKS if policy == "sinks" else 0
            expected = list(range(sinks)) + list(range(seq.num_computed - (budget - sinks), seq.num_computed))
            positions = held_positions(engine.kv_cache.eviction_state(seq.seq_id)[1], seq, shape)
            assert all(sorted(head) == expected for layer in positions.tolist() for head in layer)
            held.append((positions.clone(), cache_keys(engine, seq)))
    assert len(held) >= 20
    # really out of order
    assert any(not torch.equal(positions.sort(-1).values, positions) for positions, _ in held)
    assert engine.num_preemptions == 0  # so each layer's keys were written in position order
    for positions, keys in held:
        for layer, head in [(layer, head) for layer in range(shape[0]) for head in range(shape[1])]:
            expected_keys = torch.stack(
                [written[layer][position][head] for position in positions[layer, head]]
            )
            assert torch.equal(keys[layer, :, head], expected_keys)


class MoveCounter:
    """Counts, per step, the entries eviction moves per (layer, KV head) and the slots written."""

    def __init__(self, pool):
        self.moved, self.written = {}, 0
        move, write = pool.move_entries, pool.write

        def counting_move(layers, heads, src, dst):
            for layer, head in zip(layers.tolist(), heads.tolist()):
                self.moved[layer, head] = self.moved.get((layer, head), 0) + 1
            return move(layers, heads, src, dst)

        def counting_write(layer, slots, k, v):
            self.written += len(slots)
            return write(layer, slots, k, v)

        pool.move_entries, pool.write = counting_move, counting_write

    def reset(self):
        self.moved, self.written = {}, 0


@pytest.mark.parametrize("policy", ["h2o", "sinks", "window"])
def test_a_step_at_the_budget_moves_at_most_its_new_entries_per_head(tiny_dir, tiny_model, policy):
    """Eviction writes nothing but the moves, and a step that computed n tokens of a sequence
    moves at most n of its entries per (layer, KV head), however long its cache: not a rewrite.
    Chunked prefill evicts with chunks of 6 before decoding evicts one entry a step."""
    llm = LLM(
        tiny_dir, model=tiny_model, eviction=policy, kv_budget=10, block_size=4, max_num_batched_tokens=6
    )
    engine = llm.engine
    layers = engine.model.config.num_layers
    seq = engine.requests[
        engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=25, ignore_eos=True))
    ][0]
    counter, moved_any = MoveCounter(engine.kv_cache.pool()), 0
    while engine.has_unfinished_requests():
        before = seq.num_computed
        counter.reset()
        engine.step()
        computed = seq.num_computed - before
        assert counter.written == computed * layers  # the step's own keys and values, nothing rewritten
        assert all(count <= computed for count in counter.moved.values())
        moved_any += bool(counter.moved)
    assert seq.num_evicted > 0 and moved_any >= 20


# ---------------------------------------------------------------- with the prefix cache
# A prompt's full blocks are the protected prefix: never rewritten, moved or dropped, and not
# counted against the budget; each sequence evicts only from what follows them.

BLOCK = 4
SYSTEM = [(5 * j + 2) % 97 for j in range(26)]  # a system prompt: 6 full blocks and 2 tokens
TAILS = [[60, 3, 9], [41, 8, 8, 17, 2], [33], [70, 1, 4, 4, 12, 90, 5]]  # each request's own question


def snapshot(pool, block):
    return {name: stored.clone() for name, stored in pool.read_block(block).items()}


@pytest.mark.parametrize("policy", ["h2o", "window"])
def test_a_shared_prefix_is_never_written_or_dropped_while_its_sequences_evict(tiny_dir, tiny_model, policy):
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        prefix_caching=True,
        eviction=policy,
        kv_budget=6,
        block_size=BLOCK,
        max_num_batched_tokens=16,
    )
    engine, params = llm.engine, SamplingParams(max_tokens=24, ignore_eos=True)
    seqs = [engine.requests[engine.add_request(SYSTEM + TAILS[0], params)][0]]
    while (
        engine.has_unfinished_requests() and len(cached_blocks(engine, SYSTEM + [0])) < len(SYSTEM) // BLOCK
    ):
        engine.step()
    shared = cached_blocks(engine, SYSTEM + [0])  # the first request computed and registered them
    assert len(shared) == len(SYSTEM) // BLOCK
    stored = {block: snapshot(engine.kv_cache.pool(), block) for block in shared}
    seqs += [engine.requests[engine.add_request(SYSTEM + tail, params)][0] for tail in TAILS[1:]]
    while engine.has_unfinished_requests():
        engine.step()
        state = heard_snapshot(engine)
        held = Counter(block for table in state.tables.values() for block in table)
        for block in shared:
            assert block in {cached for cached, *_ in state.cached}
            assert held[block] == len(engine.scheduler.running)  # every running request holds it
            for name, tensor in engine.kv_cache.pool().read_block(block).items():
                assert torch.equal(tensor, stored[block][name])
        engine.kv_cache.check_invariants()
    assert all(seq.num_evicted > 0 for seq in seqs)
    assert engine.snapshot().prefix_cache["hit_blocks"] == len(shared) * len(TAILS[1:])
    assert free_and_intact(engine)


def test_a_budget_covering_the_sequence_is_exact_with_prefix_hits(tiny_dir, tiny_model):
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        prefix_caching=True,
        eviction="sinks",
        kv_budget=60,
        block_size=BLOCK,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [SYSTEM + tail for tail in TAILS]
    outputs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)  # the later ones hit
    for out, prompt in zip(outputs, prompts):
        assert out.token_ids == generate(tiny_model, prompt, params, "naive").token_ids
    assert llm.engine.snapshot().prefix_cache["hit_blocks"] >= len(SYSTEM) // BLOCK * len(TAILS[1:])


@pytest.mark.parametrize(
    "policy, params",
    [
        ("h2o", SamplingParams(max_tokens=20, ignore_eos=True)),
        ("sinks", SamplingParams(max_tokens=20, ignore_eos=True)),
        ("h2o", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)),
    ],
)
def test_prefix_hits_under_active_eviction_equal_the_reference(tiny_dir, tiny_model, policy, params):
    """Chunked prefill admits each request while the one before is still prefilling, so it hits
    the blocks registered so far; every sequence evicts far below its length. The reference
    keeps each prompt's full blocks and the budget of the rest."""
    budget = 5
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        prefix_caching=True,
        eviction=policy,
        kv_budget=budget,
        block_size=BLOCK,
        max_num_batched_tokens=16,
    )
    recorder, requests = run_recorded(llm, [SYSTEM + tail for tail in TAILS], params)
    assert llm.engine.snapshot().prefix_cache["hit_blocks"] > 0 and llm.engine.num_preemptions == 0
    assert all(seq.num_evicted > 0 for seqs in requests for seq in seqs)
    dropped = assert_equals_eviction_reference(
        tiny_model, recorder, requests, params, policy, budget, prefix_block_size=BLOCK
    )
    assert llm.engine.stats.tokens_evicted == dropped


def test_blocks_adopted_after_eviction_equal_a_fresh_prefill_bit_for_bit(tiny_dir, tiny_model):
    switches = dict(prefix_caching=True, block_size=BLOCK)
    evicting = LLM(tiny_dir, model=tiny_model, eviction="window", kv_budget=4, **switches)
    first = evicting.generate([SYSTEM + TAILS[0]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert first.error is None  # it evicted at every step after its prompt
    plain = LLM(tiny_dir, model=tiny_model, **switches)
    plain.generate([SYSTEM + TAILS[0]], SamplingParams(max_tokens=1))
    later = SYSTEM + TAILS[1]
    adopted = cached_blocks(evicting.engine, later)
    fresh = cached_blocks(plain.engine, later)
    assert len(adopted) == len(fresh) == len(SYSTEM) // BLOCK
    for ours, theirs in zip(adopted, fresh):
        stored = plain.engine.kv_cache.pool().read_block(theirs)
        for name, tensor in evicting.engine.kv_cache.pool().read_block(ours).items():
            assert torch.equal(tensor, stored[name])


@pytest.mark.parametrize("policy", ["h2o", "sinks"])
def test_a_prefix_hit_gives_the_tokens_a_miss_gives_under_eviction(tiny_dir, tiny_model, policy):
    """The protected prefix is the prompt's full blocks whether they were found or computed, so a
    request keeps the same entries either way."""
    switches = dict(prefix_caching=True, eviction=policy, kv_budget=6, block_size=BLOCK)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    warm = LLM(tiny_dir, model=tiny_model, **switches)
    warm.generate([SYSTEM + TAILS[0]], params)
    hit = warm.generate([SYSTEM + TAILS[1]], params)[0]
    assert warm.engine.snapshot().prefix_cache["hit_blocks"] == len(SYSTEM) // BLOCK
    miss = LLM(tiny_dir, model=tiny_model, **switches).generate([SYSTEM + TAILS[1]], params)[0]
    assert hit.token_ids == miss.token_ids


@pytest.mark.parametrize("budget", [2, 8])
def test_a_sequence_that_has_evicted_registers_no_more_blocks(tiny_dir, tiny_model, budget):
    """After its first eviction a table no longer maps positions to blocks: were it registered
    then, the next turn of a chat would find blocks that do not hold its tokens' K/V. Budget 2
    evicts before the block after the prompt fills; budget 8 once two output blocks were
    registered: the second, where newcomers take dropped entries' places, the cache must forget
    before it is written; the first holds the sinks (positions 8..11), is never written, and
    stays findable, its K/V those of its tokens (the next turn, which finds it, gives the tokens a
    fresh engine gives)."""
    switches = dict(prefix_caching=True, eviction="sinks", kv_budget=budget, block_size=BLOCK)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompt = SYSTEM[:10]  # 2 full blocks: the protected prefix
    llm = LLM(tiny_dir, model=tiny_model, **switches)
    first = llm.generate([prompt], params)[0]
    assert first.error is None
    next_turn = prompt + first.token_ids[:14]
    found = cached_blocks(llm.engine, next_turn)
    assert len(found) == {2: 2, 8: 3}[budget]  # the prompt's blocks, and with budget 8 the sinks' block
    fresh = LLM(tiny_dir, model=tiny_model, **switches)
    assert llm.generate([next_turn], params)[0].token_ids == fresh.generate([next_turn], params)[0].token_ids


def test_admission_counts_the_protected_prefix(tiny_dir, tiny_model):
    """A request keeps its prompt's full blocks, its budget, and one step's tokens before eviction:
    one that fits exactly runs to its end; one whose prompt alone is too long fails alone, though
    without the prefix cache it would run."""
    pool = dict(block_size=BLOCK, kv_cache_bytes=11 * BLOCK * KV_BYTES_PER_TOKEN, max_num_batched_tokens=8)
    switches = dict(eviction="sinks", kv_budget=8, **pool)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    fits = LLM(tiny_dir, model=tiny_model, prefix_caching=True, **switches).generate(
        [list(range(28))], params
    )[0]
    assert fits.error is None and len(fits.token_ids) == 60  # 28 + 8 + 8 tokens: 11 blocks
    long_prompt = list(range(40))
    refused = LLM(tiny_dir, model=tiny_model, prefix_caching=True, **switches).generate(
        [long_prompt], params
    )[0]
    assert refused.finish_reason == "error" and "may need 14 KV blocks (56 tokens)" in refused.error
    assert LLM(tiny_dir, model=tiny_model, **switches).generate([long_prompt], params)[0].error is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=20, ignore_eos=True),
        SamplingParams(beam_width=2, max_tokens=14),
    ],
)
def test_samples_and_beams_evict_beside_a_cached_prefix_without_leaking(tiny_dir, tiny_model, params):
    """Forks share the protected prefix and copy before they rewrite what follows; a tight pool
    preempts them too."""
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        prefix_caching=True,
        eviction="h2o",
        kv_budget=5,
        block_size=BLOCK,
        max_num_batched_tokens=16,
        kv_cache_bytes=16 * BLOCK * KV_BYTES_PER_TOKEN,
    )
    engine = llm.engine
    for tail in TAILS:
        engine.add_request(SYSTEM + tail, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
        engine.kv_cache.check_invariants()
    assert len(finished) == len(TAILS) and all(out.error is None for out in finished)
    assert all(len(out.samples) == params.num_outputs for out in finished)
    assert (
        engine.snapshot().prefix_cache["hit_blocks"] > 0
        and engine.stats.tokens_evicted > 0
        and engine.num_preemptions > 0
    )
    assert free_and_intact(engine)
