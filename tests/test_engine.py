"""The paged, continuously batched engine gives the naive decoder's greedy tokens, whatever the
block size, KV budget (preemption), token budget (chunked prefill) or scheduling policy."""

import random
from types import SimpleNamespace

import pytest
from helpers import REAL_CHAT_QUESTIONS, REAL_PLAIN_PROMPTS, free_and_intact

import minillm.engine.sequence as sequence_module
from minillm.config import ConfigError
from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams
from minillm.engine.outputs import EngineStats
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Sequence
from minillm.memory import KVCacheManager
from minillm.memory.block_manager import BlockManager

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model: layers 3, kv heads 2, head_dim 16, fp32


def mixed_requests(count, vocab, seed=0, max_prompt=60, max_new=40):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(count)]
    params = [SamplingParams(max_tokens=rng.randint(1, max_new), ignore_eos=True) for _ in prompts]
    return prompts, params


def assert_matches_naive(model, llm, prompts, params):
    outputs = llm.generate(prompts, params)
    for out, prompt, sp in zip(outputs, prompts, params):
        assert out.finished and out.error is None
        assert out.token_ids == generate(model, prompt, sp, "naive").token_ids, out.request_id
    assert free_and_intact(llm.engine)  # the run drained: every block is free


@pytest.mark.parametrize("block_size", [1, 16, 128])  # 128 > any prompt
def test_engine_matches_naive_for_every_block_size(tiny_dir, tiny_model, block_size):
    prompts, params = mixed_requests(32, tiny_model.config.vocab_size, seed=block_size)
    llm = LLM(tiny_dir, model=tiny_model, block_size=block_size, kv_cache_bytes=8 << 20)
    assert_matches_naive(tiny_model, llm, prompts, params)


def test_engine_matches_naive_under_preemption(tiny_dir, tiny_model):
    prompts, params = mixed_requests(32, tiny_model.config.vocab_size, seed=11)
    # 30 blocks
    llm = LLM(tiny_dir, model=tiny_model, block_size=8, kv_cache_bytes=30 * 8 * KV_BYTES_PER_TOKEN)
    assert_matches_naive(tiny_model, llm, prompts, params)
    assert llm.engine.num_preemptions > 0


def test_engine_matches_naive_with_chunked_prefill(tiny_dir, tiny_model):
    prompts, params = mixed_requests(32, tiny_model.config.vocab_size, seed=12)
    llm = LLM(tiny_dir, model=tiny_model, max_num_batched_tokens=7, kv_cache_bytes=8 << 20)
    assert_matches_naive(tiny_model, llm, prompts, params)
    assert llm.engine.stats.steps > sum(len(p) for p in prompts) / 7  # prompts really went in chunks


def test_static_batching_matches_naive_and_takes_more_steps(tiny_dir, tiny_model):
    prompts, params = mixed_requests(32, tiny_model.config.vocab_size, seed=13)
    static = LLM(tiny_dir, model=tiny_model, scheduling="static", max_num_seqs=8, kv_cache_bytes=8 << 20)
    assert_matches_naive(tiny_model, static, prompts, params)
    continuous = LLM(tiny_dir, model=tiny_model, max_num_seqs=8, kv_cache_bytes=8 << 20)
    continuous.generate(prompts, params)
    assert continuous.engine.stats.steps < static.engine.stats.steps


def test_static_batching_matches_naive_under_preemption(tiny_dir, tiny_model):
    prompts, params = mixed_requests(16, tiny_model.config.vocab_size, seed=14)
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        scheduling="static",
        max_num_seqs=8,
        block_size=8,
        max_num_batched_tokens=64,
        kv_cache_bytes=20 * 8 * KV_BYTES_PER_TOKEN,
    )
    assert_matches_naive(tiny_model, llm, prompts, params)
    assert llm.engine.num_preemptions > 0


def test_seeded_sampling_in_a_batch_matches_single_sequence_sampling(tiny_dir, tiny_model):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8] * 20]
    params = [
        SamplingParams(temperature=0.9, top_k=20, seed=s, max_tokens=15, ignore_eos=True) for s in (1, 2, 3)
    ]
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=20 * 4 * KV_BYTES_PER_TOKEN)
    for out, prompt, sp in zip(llm.generate(prompts, params), prompts, params):
        assert out.token_ids == generate(tiny_model, prompt, sp, "naive").token_ids


def test_request_that_can_never_fit_fails_alone(tiny_dir, tiny_model):
    # 40 slots
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=10 * 4 * KV_BYTES_PER_TOKEN)
    prompts = [[1, 2, 3], list(range(50)), [4, 5]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    small, huge, other = llm.generate(prompts, params)
    assert huge.finish_reason == "error" and "raise kv_cache_bytes" in huge.error
    assert small.token_ids == generate(tiny_model, [1, 2, 3], params).token_ids
    assert other.finished and len(other.token_ids) == 5


def test_prompt_longer_than_the_context_fails_alone(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model, kv_cache_bytes=8 << 20)
    too_long, fine = llm.generate([[1] * 300, [1, 2]], SamplingParams(max_tokens=3))
    assert too_long.finish_reason == "error" and "shorten the prompt" in too_long.error
    assert fine.finished and fine.error is None


def test_abort_frees_the_blocks(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model, kv_cache_bytes=8 << 20)
    engine = llm.engine
    keep = engine.add_request([1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True))
    drop = engine.add_request([4, 5, 6], SamplingParams(max_tokens=30, ignore_eos=True))
    kept, dropped = engine.requests[keep][0], engine.requests[drop][0]
    engine.step()
    engine.abort(drop)
    while engine.has_unfinished_requests():
        engine.step()
    assert dropped.finish_reason == "abort" and kept.finish_reason == "length"
    assert free_and_intact(engine)


def test_stream_yields_one_token_at_a_time(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model, kv_cache_bytes=8 << 20)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    seen = [len(out.token_ids) for out in llm.stream([3, 1, 4, 1, 5], params)]
    assert seen == [1, 2, 3, 4, 5, 6]


def test_metrics_are_recorded(tiny_dir, tiny_model):
    prompts, params = mixed_requests(8, tiny_model.config.vocab_size, seed=3)
    llm = LLM(tiny_dir, model=tiny_model, kv_cache_bytes=8 << 20)
    outputs = llm.generate(prompts, params)
    assert all(o.ttft > 0 for o in outputs)
    assert all(o.tpot > 0 for o in outputs if len(o.token_ids) > 1)
    stats = llm.engine.stats
    assert stats.tokens_generated == sum(len(o.token_ids) for o in outputs)
    assert len(stats.memory) == stats.steps and 0 < stats.kv_utilization() <= 1


@pytest.mark.parametrize(
    "switches, word",
    [
        ({"scheduling": "fifo"}, "scheduling"),
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_bytes": 100}, "cannot hold one block"),
        ({"decoder": "naive"}, "no switch 'decoder'"),
        ({"kv_cache_bytes": 2**50}, "could not be allocated on cpu"),
        ({"max_seq_len": "100"}, "max_seq_len must be"),
        ({"max_seq_len": 0}, "max_seq_len must be"),
    ],
)
def test_bad_switches_are_refused_with_the_reason(tiny_dir, tiny_model, switches, word):
    with pytest.raises(ConfigError, match=word):
        LLM(tiny_dir, model=tiny_model, **switches)


def test_real_model_engine_matches_naive(real_dir, real_model, real_tokenizer, naive_real):
    prompts = REAL_PLAIN_PROMPTS + [
        real_tokenizer.encode_chat([{"role": "user", "content": q}]) for q in REAL_CHAT_QUESTIONS
    ]
    params = [SamplingParams(max_tokens=n) for n in (12, 20, 8, 16, 12, 18, 9)]
    # 6 blocks of 16 tokens: fewer than the batch wants, so sequences get preempted and recomputed
    llm = LLM(
        real_dir,
        model=real_model,
        tokenizer=real_tokenizer,
        kv_cache_bytes=6 * 16 * real_model.config.kv_bytes_per_token(real_model.dtype),
    )
    outputs = llm.generate(prompts, params)
    for out, prompt, sp in zip(outputs, prompts, params):
        ids = real_tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.token_ids == naive_real(ids, sp.max_tokens)
    assert llm.engine.num_preemptions > 0
    assert outputs[0].text == real_tokenizer.decode(outputs[0].token_ids)


def test_metrics_equal_hand_computed_values_on_a_scripted_trace(tiny_dir, tiny_model, monkeypatch):
    """Two requests, a 4-token step budget, a clock that reads 1, 2, 4, 7 at the four steps:
    step 1  A prefills 4 of its 6 prompt tokens (the budget is spent: B waits)
    step 2  A prefills its last 2 and samples; B (arrived at 0.5) prefills 2 and samples
    step 3  A and B decode; B has its 2 tokens and finishes
    step 4  A decodes its 3rd token and finishes"""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(sequence_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, max_num_batched_tokens=4, kv_cache_bytes=1 << 20)
    engine = llm.engine
    a = engine.add_request(
        [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=0.0
    )
    b = engine.add_request([11, 12], SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=0.5)
    final = {}
    for clock.now in (1.0, 2.0, 4.0, 7.0):
        final |= {out.request_id: out for out in engine.step() if out.finished}
    assert not engine.has_unfinished_requests()
    assert (final[a].ttft, final[a].tpot) == (2.0 - 0.0, (7.0 - 2.0) / 2)
    assert (final[b].ttft, final[b].tpot) == (2.0 - 0.5, (4.0 - 2.0) / 1)
    stats = engine.stats
    assert (stats.steps, stats.tokens_computed, stats.tokens_generated) == (4, 4 + 4 + 2 + 1, 5)
    # after each step: (live slots, reserved slots) of the sequences still running
    assert [(m.live_slots, m.reserved_slots) for m in stats.memory] == [
        (4, 4),
        (6 + 2, 8 + 4),
        (7, 8),
        (0, 0),
    ]
    assert stats.kv_utilization() == (4 + 8 + 7) / (4 + 12 + 8)


def test_prefix_cache_rates_equal_hand_computed_values(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model, block_size=4, prefix_caching=True, kv_cache_bytes=1 << 20)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = list(range(20, 29))  # 9 tokens: 2 full blocks can be looked up (never the last token)
    llm.generate([first], params)
    llm.generate([first[:8] + [50, 51, 52]], params)  # 11 tokens: both blocks hit
    stats = {key: value for key, value in llm.engine.snapshot().prefix_cache.items() if key != "hit_rate"}
    assert stats == {
        "queried_blocks": 2 + 2,
        "hit_blocks": 2,
        "block_hit_rate": 2 / 4,
        "prompt_tokens": 9 + 11,
        "prefill_tokens_saved": 8,
        "token_hit_rate": 8 / 20,
        "cached_blocks": 3,  # the 2 shared, and the second request's third block (filled by its first output)
        "lookups": {"new": 1, "hit": 1},  # nothing cached yet; then every full block a hit can cover
    }


def test_a_preempted_sequence_goes_back_to_the_head_of_the_queue():
    """FCFS survives preemption: the victim arrived before everyone still waiting."""
    scheduler = Scheduler(
        KVCacheManager(BlockManager(num_blocks=4, block_size=4)),
        "continuous",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        context_len=16,
        vocab_size=97,
    )
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first, second, third = (Sequence(i, str(i), list(range(8)), params, max_len=16) for i in range(3))
    scheduler.add(first)
    scheduler.add(second)
    assert [item.seq for item in scheduler.schedule().sequences] == [
        first,
        second,
    ]  # 2 blocks each: the pool is full
    scheduler.add(third)
    for seq in (first, second):
        seq.num_computed = 8
        seq.append(1, frozenset())  # the 9th token needs a third block
    assert [item.seq for item in scheduler.schedule().sequences] == [first]
    assert list(scheduler.waiting) == [second, third] and second.num_computed == 0


@pytest.mark.parametrize("arrival_time", ["soon", float("nan"), True])
def test_a_bad_arrival_time_is_refused_and_the_engine_keeps_serving(tiny_dir, tiny_model, arrival_time):
    llm = LLM(tiny_dir, model=tiny_model, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="arrival_time"):
        llm.engine.add_request([1, 2], SamplingParams(max_tokens=2), arrival_time=arrival_time)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert llm.generate([[1, 2]], params)[0].token_ids == generate(tiny_model, [1, 2], params).token_ids


def test_a_long_lived_engine_keeps_nothing_of_answered_requests(tiny_dir, tiny_model):
    """Answered, aborted and rejected requests are forgotten; per-step detail stays within its window."""
    prompts, params = mixed_requests(20, tiny_model.config.vocab_size, seed=3)
    prompts.append([5, 6, 7])
    params.append(SamplingParams(beam_width=3, max_tokens=4, ignore_eos=True))
    runs = {}
    for window in (5, 10_000):
        llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=1 << 20, prefix_caching=True)
        engine = llm.engine
        engine.stats = EngineStats(window=window)
        outputs = llm.generate(prompts, params)
        aborted = engine.add_request([1, 2, 3], SamplingParams(max_tokens=9))
        engine.step()
        engine.abort(aborted)
        rejected = engine.add_request([], SamplingParams())
        engine.abort(engine.add_request([], SamplingParams()))  # rejected, then aborted before any step
        assert [out.request_id for out in engine.step()] == [rejected]
        assert (
            not engine.has_unfinished_requests()
            and engine.requests == {}
            and engine.chooser.beam_groups == {}
        )
        runs[window] = engine.stats, [out.samples for out in outputs]
    (short, short_samples), (full, full_samples) = runs[5], runs[10_000]
    assert short_samples == full_samples and short.steps == full.steps > 5
    assert len(short.memory) == len(short.batches) == 5 and list(short.memory) == list(full.memory)[-5:]
    assert (
        short.kv_utilization()
        == full.kv_utilization()
        == pytest.approx(sum(m.live_slots for m in full.memory) / sum(m.reserved_slots for m in full.memory))
    )


@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_non_finite_scores_end_only_their_request(tiny_dir, speculative, always_guess):
    """A token whose embedding is NaN (a damaged checkpoint, or a broken kernel, on one request's
    path): greedy decoding took argmax of NaN and streamed garbage. Now the request whose scores are
    not finite ends with an error at that step, and the others decode the naive decoder's tokens.
    The poisoned token is the 4th one the request would generate, so it is caught mid-decode (with
    speculation, among the checked guesses' rows)."""
    from minillm.weights import load_model

    clean, poisoned = load_model(tiny_dir), load_model(tiny_dir)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    victim, others = [7, 8, 7, 8, 7, 8], [[5, 9, 14, 3], [30, 31, 32]]
    fourth = generate(clean, victim, params, "naive").token_ids[3]
    expected = [generate(clean, prompt, params, "naive").token_ids for prompt in others]
    assert all(fourth not in prompt + out for prompt, out in zip(others, expected)), "pick other prompts"
    poisoned.embed.weight.data[fourth] = float("nan")
    llm = LLM(tiny_dir, model=poisoned, speculative=speculative)
    outs = llm.generate([victim, *others], params)
    assert outs[0].finish_reason == "error" and "not finite" in outs[0].error
    assert len(outs[0].token_ids) <= 4
    assert [out.token_ids for out in outs[1:]] == expected
    assert free_and_intact(llm.engine)  # the failed request's blocks went back too


def test_non_finite_scores_of_checked_guesses_end_their_request(tiny_dir, tiny_model, always_guess):
    """The same on speculation's path: the rows that check a sequence's guesses turn NaN (a hook on
    the runner's vocabulary product, from its second multi-row call on). The request ends with the
    error and keeps only tokens the naive decoder also gives."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    llm = LLM(tiny_dir, model=tiny_model, speculative="ngram", prompt_lookup_min=1, prompt_lookup_max=2)
    runner, calls = llm.engine.runner, []
    scores = runner.logits

    def poisoned(hidden, rows):
        logits = scores(hidden, rows)
        calls.append(len(rows))
        return logits.fill_(float("nan")) if sum(n > 1 for n in calls) > 1 and len(rows) > 1 else logits

    runner.logits = poisoned
    out = llm.generate([prompt], params)[0]
    assert sum(n > 1 for n in calls) >= 2, "no guesses were checked: pick another prompt"
    assert out.finish_reason == "error" and "not finite" in out.error
    naive = generate(tiny_model, prompt, params, "naive").token_ids
    assert out.token_ids == naive[: len(out.token_ids)] and len(out.token_ids) < len(naive)


def _queued(engine, victim):  # still waiting: the other requests fill max_num_seqs
    return victim.status.value == "waiting" and victim.num_computed == 0


def _prefilling(engine, victim):  # part of its prompt computed, chunk by chunk
    return 0 < victim.num_computed < len(victim.prompt_ids)


def _decoding(engine, victim):
    return victim.num_computed > len(victim.prompt_ids) + 2


def _guessing(engine, victim):  # the last step checked guesses of this sequence
    return victim.seq_id in engine.checked_guesses() and bool(engine.checked_guesses()[victim.seq_id])


@pytest.mark.parametrize("phase", [_queued, _prefilling, _decoding, _guessing], ids=lambda f: f.__name__[1:])
def test_a_request_aborted_in_any_phase_leaves_nothing_held(tiny_dir, tiny_model, phase, always_guess):
    """What a server does when its client hangs up: `abort`, while the request waits in the queue,
    is half-way through a chunked prefill, decodes, or has guesses being checked. Its blocks all go
    back (prefix caching on: cached blocks are free ones), the others finish with the naive tokens."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        prefix_caching=True,
        max_num_seqs=2,
        max_num_batched_tokens=8,  # a 30-token prompt takes four prefill steps
        speculative="ngram",
        prompt_lookup_min=1,
        prompt_lookup_max=2,
    )
    engine = llm.engine
    others = [[5, 9, 14, 3], [30, 31, 32]]
    victim_prompt = [7, 8, 9] * 10
    ids = [engine.add_request(prompt, params) for prompt in others]
    victim_id = engine.add_request(victim_prompt, params)
    victim = engine.requests[victim_id][0]
    if phase is not _queued:  # let it run beside the others
        engine.abort(ids.pop())
        others.pop()
    final = {out.request_id: out for out in engine.step() if out.finished}  # one step ran, at least
    while not phase(engine, victim):
        assert engine.has_unfinished_requests() and victim.status.value != "finished", "the phase never came"
        final |= {out.request_id: out for out in engine.step() if out.finished}
    engine.abort(victim_id)
    while engine.has_unfinished_requests():
        final |= {out.request_id: out for out in engine.step() if out.finished}
    assert victim_id not in final
    assert [final[i].token_ids for i in ids] == [
        generate(tiny_model, p, params, "naive").token_ids for p in others
    ]
    assert free_and_intact(engine)
