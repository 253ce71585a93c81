"""KV eviction: which entries each policy keeps, exactly the budget per head, exact output when
the budget covers the sequence, and composition with paging, chunked prefill, preemption and
shared blocks."""

import pytest
import torch

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


def test_h2o_evicts_the_smallest_accumulated_score_outside_the_recent_window():
    mass = torch.tensor([[[5.0, 0.1, 3.0, 2.0, 0.0, 0.0]],  # layer 0: entry 1 is the lightest old one
                         [[0.2, 4.0, 3.0, 2.0, 9.0, 9.0]]])  # layer 1: entry 0 is
    kept = kept_entries("h2o", length=6, keep=5, num_layers=2, num_kv_heads=1, mass=mass)
    # recent window = 2 (entries 4, 5, kept whatever their score); 3 heavy hitters among 0..3
    assert kept[0, 0].tolist() == [0, 2, 3, 4, 5]
    assert kept[1, 0].tolist() == [1, 2, 3, 4, 5]


def test_h2o_chooses_per_kv_head_and_keeps_the_same_count_in_each():
    gen = torch.Generator().manual_seed(0)
    mass = torch.rand(3, 4, 50, generator=gen)
    kept = kept_entries("h2o", length=50, keep=10, num_layers=3, num_kv_heads=4, mass=mass)
    assert kept.shape == (3, 4, 10)
    for layer in range(3):
        for head in range(4):
            entries = kept[layer, head]
            assert torch.equal(entries, entries.unique())  # distinct, increasing
            assert entries[-5:].tolist() == list(range(45, 50))  # the recent half
            heavy = mass[layer, head, :45].topk(5).indices.sort().values
            assert torch.equal(entries[:5], heavy)
    assert not torch.equal(kept[0, 0], kept[0, 1])  # heads really differ


def test_sinks_keep_the_first_tokens_and_window_only_the_last():
    sinks = kept_entries("sinks", length=100, keep=20, num_layers=1, num_kv_heads=2)
    assert sinks[0, 0].tolist() == list(range(NUM_SINKS)) + list(range(100 - 20 + NUM_SINKS, 100))
    window = kept_entries("window", length=100, keep=20, num_layers=1, num_kv_heads=2)
    assert window[0, 1].tolist() == list(range(80, 100))


def mixed(count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 97, (int(torch.randint(2, 50, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(count)]
    return prompts, SamplingParams(max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("policy", ["h2o", "sinks", "window"])
def test_a_budget_covering_the_sequence_is_exact(tiny_dir, tiny_model, policy):
    prompts, params = mixed(12, seed=1)
    llm = LLM(tiny_dir, model=tiny_model, eviction=policy, kv_budget=80, block_size=4, max_num_batched_tokens=16,
              kv_cache_bytes=40 * 4 * KV_BYTES_PER_TOKEN)  # chunked prefill and preemption too
    for out, prompt in zip(llm.generate(prompts, params), prompts):
        assert out.token_ids == generate(tiny_model, prompt, params, "naive").token_ids
    assert llm.engine.num_preemptions > 0


@pytest.mark.parametrize("policy, budget", [("h2o", 12), ("sinks", 12), ("window", 7), ("h2o", 0.3)])
def test_exactly_the_budget_is_kept_and_the_rest_given_back(tiny_dir, tiny_model, policy, budget):
    prompts, params = mixed(6, seed=2)
    llm = LLM(tiny_dir, model=tiny_model, eviction=policy, kv_budget=budget, block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    evicted = False
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            keep = budget_for(budget, seq.max_len)
            assert seq.num_cached == min(keep, seq.num_computed)
            assert len(engine.block_manager.table(seq.seq_id)) == engine.block_manager.blocks_for(seq.num_cached)
            if policy == "h2o":
                assert seq.attention_mass.shape == (3, 2, seq.num_cached)
            evicted |= seq.num_evicted > 0
        engine.block_manager.check_invariants()
    assert evicted
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_eviction_changes_the_output_so_the_cache_is_really_read(tiny_dir, tiny_model):
    prompt, params = list(range(40)), SamplingParams(max_tokens=20, ignore_eos=True)
    full = LLM(tiny_dir, model=tiny_model).generate([prompt], params)[0].token_ids
    window = LLM(tiny_dir, model=tiny_model, eviction="window", kv_budget=2).generate([prompt], params)[0].token_ids
    assert window != full


@pytest.mark.parametrize("policy", ["h2o", "window"])
def test_eviction_never_writes_a_shared_block(tiny_dir, tiny_model, policy):
    """Parallel samples share the prompt's blocks; each evicts on its own. Were one to write a
    shared block in place, its sibling's tokens would change."""
    prompt = [(7 * j + 3) % 97 for j in range(37)]
    switches = dict(eviction=policy, kv_budget=24, block_size=4)
    sampling = dict(temperature=1.0, seed=3, max_tokens=25, ignore_eos=True)
    together = LLM(tiny_dir, model=tiny_model, **switches).generate([prompt], SamplingParams(n=3, **sampling))[0]
    for index, sample in enumerate(together.samples):
        alone = LLM(tiny_dir, model=tiny_model, **switches)
        params = SamplingParams(**{**sampling, "seed": sampling["seed"] + index})
        assert sample == alone.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("switches, words", [
    ({"eviction": "h2o"}, "needs kv_budget"),
    ({"kv_budget": 10}, "only applies with eviction"),
    ({"eviction": "lru", "kv_budget": 10}, "eviction must be one of"),
    ({"eviction": "h2o", "kv_budget": 1.5}, "fraction in"),
    ({"eviction": "h2o", "kv_budget": 0}, "token count"),
    ({"eviction": "sinks", "kv_budget": 10, "prefix_caching": True}, "do not combine"),
    ({"kv_dtype": "int8", "attention_backend": "cpu"}, "attention_backend='torch'"),
    ({"eviction": "h2o", "kv_budget": 10, "attention_backend": "cpu"}, "attention_backend='torch'"),
    ({"kv_dtype": "int3"}, "kv_dtype must be"),
    ({"kv_key_scales": "group"}, "kv_key_scales must be"),
])
def test_unsupported_compression_switches_are_refused(tiny_dir, tiny_model, switches, words):
    with pytest.raises(ConfigError, match=words):
        LLM(tiny_dir, model=tiny_model, **switches)


def test_a_request_too_long_for_the_pool_runs_when_eviction_bounds_its_cache(tiny_dir, tiny_model):
    pool = dict(block_size=4, kv_cache_bytes=12 * 4 * KV_BYTES_PER_TOKEN, max_num_batched_tokens=8)  # 48 slots
    prompt, params = list(range(20)), SamplingParams(max_tokens=100, ignore_eos=True)
    refused = LLM(tiny_dir, model=tiny_model, **pool).generate([prompt], params)[0]
    assert refused.finish_reason == "error"
    evicting = LLM(tiny_dir, model=tiny_model, eviction="sinks", kv_budget=32, **pool).generate([prompt], params)[0]
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
    request_id = llm.engine.add_request(prompt, params)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    seq = llm.engine.requests[request_id][0]
    computed = seq.token_ids[:seq.num_computed]  # the last sampled token was never fed back
    ctx = AttentionColumnSums(len(computed))
    tiny_model(torch.tensor(computed), torch.arange(len(computed)), ctx)
    assert torch.allclose(seq.attention_mass, torch.stack(ctx.mass), atol=1e-4)
