"""Memory-aware admission and the pressure ladder: only the order of work changes (greedy ids equal
naive decoding under preemption, prefix hits, samples and beams); FCFS's head-of-line blocking
and its cure; the starvation bound; the ladder's rungs in order, lossy ones only when allowed; a
request without max_tokens admitted on a pool smaller than the context, ending at the pool's end."""

import random

import pytest
from helpers import assert_drained, naive, random_prompts
from helpers import step_without_model as step

from minillm.config import ConfigError
from minillm.engine import LLM, SamplingParams
from minillm.engine.admission import WINDOW
from minillm.engine.beam import reference_beam_search
from minillm.engine.scheduler import Scheduler, make_admission
from minillm.engine.sequence import Sequence, Status
from minillm.memory import KVCacheManager
from minillm.memory.block_manager import BlockManager
from minillm.memory.pressure import RUNGS

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32
BLOCK = 4


def tight(tiny_dir, tiny_model, blocks=14, **switches):
    switches = {"admission": "memory", **switches}
    return LLM(
        tiny_dir,
        model=tiny_model,
        block_size=BLOCK,
        kv_cache_bytes=blocks * BLOCK * KV_BYTES_PER_TOKEN,
        **switches,
    )


# ---------------------------------------------------------------- the scheduler alone


def scheduler(admission, num_blocks=10, prefix_caching=False, max_num_seqs=16):
    manager = KVCacheManager(
        BlockManager(num_blocks=num_blocks, block_size=BLOCK, prefix_caching=prefix_caching)
    )
    return Scheduler(
        manager,
        "continuous",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        context_len=128,
        vocab_size=97,
        admission=make_admission(admission, manager, 64),
    )


def request(seq_id, prompt_len, max_tokens, priority=0):
    seq = Sequence(
        seq_id,
        str(seq_id),
        [1] * prompt_len,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_len=prompt_len + max_tokens,
    )
    seq.priority = priority
    return seq


@pytest.mark.parametrize("admission, small_ones_admitted", [("fcfs", 0), ("memory", 1)])
def test_fcfs_lets_one_huge_request_hold_the_small_ones_behind_it(admission, small_ones_admitted):
    sched = scheduler(admission)
    first = request(0, 20, 8)
    sched.add(first)
    step(sched)  # first's prompt: 5 of the 10 blocks, then its first token needs a sixth
    huge = request(1, 28, 4)  # 7 blocks: it cannot start until first is done
    small = [request(2 + i, 3, 4) for i in range(3)]  # a block now, two at their peak
    for seq in (huge, *small):
        sched.add(seq)
    started = step(sched)
    assert first in started and huge not in started
    assert sum(seq in started for seq in small) == small_ones_admitted
    # memory-aware stops at 1: with a second, the batch would need 7 + 2 + 2 of the 10 blocks at its
    # peak (step 4, as the small ones end)


def test_lower_priority_values_are_admitted_first():
    sched = scheduler("memory", num_blocks=3)
    late, urgent = request(0, 6, 4), request(1, 6, 4, priority=-1)  # 3 blocks at their peak each
    sched.add(late)
    sched.add(urgent)
    assert step(sched) == [urgent]


def cached_scheduler(admission, num_blocks=32):
    return scheduler(admission, num_blocks, prefix_caching=True, max_num_seqs=1)


def run_alone(sched, seq, most_steps: int = 1000):
    sched.add(seq)
    for _ in range(most_steps):
        if seq.status is Status.FINISHED:
            return
        step(sched)
    raise AssertionError(f"the request did not finish in {most_steps} steps")


@pytest.mark.parametrize("admission, first", [("fcfs", "cold"), ("lpm", "warm"), ("memory", "warm")])
def test_lpm_admits_the_request_whose_prefix_is_cached_first(admission, first):
    """One seat; a request whose prompt is cached (its first 3 blocks) waits behind an older one
    with nothing cached. Longest prefix first takes the warm one first, and so does memory-aware
    admission (its cached blocks are neither held anew nor computed); fcfs keeps arrival order."""
    sched = cached_scheduler(admission)
    shared = [7] * (3 * BLOCK)
    run_alone(sched, request_with(0, shared + [1], 2))  # leaves its 3 full prompt blocks cached
    cold, warm = request_with(1, [9] * (3 * BLOCK + 1), 2), request_with(2, shared + [2], 2)
    sched.add(cold)
    sched.add(warm)
    assert step(sched) == [{"cold": cold, "warm": warm}[first]]


def request_with(seq_id, prompt, max_tokens):
    seq = Sequence(
        seq_id,
        str(seq_id),
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_len=len(prompt) + max_tokens,
    )
    return seq


@pytest.mark.parametrize("admission", ["lpm", "memory"])
def test_only_the_oldest_window_of_the_queue_is_ranked(admission):
    """However long the queue, a policy ranks and tries the WINDOW oldest requests only: the
    cheapest request, queued beyond them, is not among them."""
    sched = scheduler(admission, num_blocks=64)
    for seq_id in range(WINDOW):
        sched.add(request(seq_id, 20, 8))
    cheapest = request(WINDOW, 2, 1)
    sched.add(cheapest)
    order = sched.admission.order(sched.waiting, sched.steps)
    assert len(order) == WINDOW and cheapest not in order


def test_a_due_request_waits_for_the_batchs_headroom():
    """Admitted without headroom, a due request would be preempted again as the batch grows; one
    that ends before the batch peaks fits in the blocks the others will need only later."""
    sched = scheduler("memory", num_blocks=9)
    sched.add(request(0, 4, 30))  # 5 tokens in 2 blocks after its first step, 34 in 9 at its end
    step(sched)
    long_due, short_due = request(1, 4, 20), request(2, 4, 2)
    for due in (long_due, short_due):
        due.num_preemptions = 1  # preempted once: due
    assert not sched.admission.has_room(long_due, sched.running, 64, 0, sched.steps)  # 7 + 6 at step 20
    assert sched.admission.has_room(short_due, sched.running, 64, 0, sched.steps)  # 2 + 2 at step 2


# ---------------------------------------------------------------- only the order changes


@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"prefix_caching": True},
        {"max_num_batched_tokens": 7},
        {"host_cache_bytes": 400 * BLOCK * KV_BYTES_PER_TOKEN, "preemption": "swap"},
    ],
)
@pytest.mark.parametrize("admission", ["memory", "lpm"])
def test_memory_admission_under_preemption_equals_naive(tiny_dir, tiny_model, switches, admission):
    rng = random.Random(5)
    system = [rng.randrange(97) for _ in range(2 * BLOCK + 1)]
    prompts = [system + p if i % 2 else p for i, p in enumerate(random_prompts(16, seed=4))]
    # short answers first teach memory-aware admission to expect short ones: the long ones after
    # outgrow its headroom, and it must preempt
    params = [SamplingParams(max_tokens=3 if i < 6 else 16, ignore_eos=True) for i in range(len(prompts))]
    llm = tight(tiny_dir, tiny_model, admission=admission, **switches)
    outputs = llm.generate(prompts, params)
    expected = [naive(tiny_model, prompt, each) for prompt, each in zip(prompts, params)]
    assert [out.token_ids for out in outputs] == expected
    assert llm.engine.num_preemptions > 0
    if switches.get("prefix_caching"):
        assert llm.engine.snapshot().prefix_cache["hit_blocks"] > 0
    assert_drained(llm)


def test_memory_admission_with_samples_and_beams_equals_the_references(tiny_dir, tiny_model):
    prompts = random_prompts(6, seed=6)
    sampled = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    beams = SamplingParams(beam_width=2, max_tokens=8, ignore_eos=True)
    llm = tight(tiny_dir, tiny_model, blocks=24, prefix_caching=True)
    outputs = llm.generate(prompts, [sampled if i % 2 else beams for i in range(len(prompts))])
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if i % 2:
            assert out.samples == [
                naive(
                    tiny_model,
                    prompt,
                    SamplingParams(temperature=1.0, seed=3 + k, max_tokens=10, ignore_eos=True),
                )
                for k in range(3)
            ]
        else:
            assert out.samples == reference_beam_search(tiny_model, prompt, 2, 8, frozenset())
    assert_drained(llm)


# ---------------------------------------------------------------- requests without max_tokens


def test_a_request_without_max_tokens_runs_to_the_context(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, kv_cache_bytes=1 << 20, max_seq_len=24)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == naive(tiny_model, [5, 6, 7], SamplingParams(max_tokens=21, ignore_eos=True))


@pytest.mark.parametrize("admission", ["fcfs", "memory", "reserve"])
def test_requests_without_max_tokens_on_a_pool_smaller_than_the_context_end_at_its_end(
    tiny_dir, tiny_model, admission
):
    """Admitted although the pool (32 tokens) cannot hold the context (256): each grows until it
    holds the whole pool, taking turns by preemption, and finishes there with "length"."""
    llm = tight(tiny_dir, tiny_model, blocks=8, admission=admission)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=None, ignore_eos=True))
    for out, prompt in zip(outputs, prompts):
        assert out.error is None and out.finish_reason == "length"
        to_the_end = SamplingParams(max_tokens=8 * BLOCK - len(prompt), ignore_eos=True)
        assert out.token_ids == naive(tiny_model, prompt, to_the_end)
    assert llm.engine.num_preemptions > 0 or admission != "fcfs"
    assert_drained(llm)


def test_with_eviction_a_request_without_max_tokens_outgrows_the_pool_to_the_context(tiny_dir, tiny_model):
    """It holds at most its window and one step's tokens (8): the pool's 32 tokens are enough."""
    window = dict(eviction="window", kv_budget=16, max_num_batched_tokens=8)
    llm = tight(tiny_dir, tiny_model, blocks=8, max_seq_len=64, **window)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 3


def test_a_prompt_the_pool_cannot_hold_is_refused_without_max_tokens_too(tiny_dir, tiny_model):
    llm = tight(tiny_dir, tiny_model, blocks=8)
    out = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=None))[0]
    assert out.finish_reason == "error" and out.error == (
        "This request may need 10 KV blocks (38 tokens) but the pool has only 8; "
        "raise kv_cache_bytes or shorten the prompt."
    )


def test_max_length_reservation_never_preempts_and_holds_fewer(tiny_dir, tiny_model):
    """The pre-paging baseline: every running request keeps its prompt + max_tokens reserved, so
    nothing ever runs short, and fewer requests run at once than paged FCFS lets in."""
    prompts, params = random_prompts(12, seed=10), SamplingParams(max_tokens=24, ignore_eos=True)
    most = {}
    for admission in ("reserve", "fcfs"):
        llm = tight(tiny_dir, tiny_model, blocks=24, admission=admission)
        engine, outputs = llm.engine, []
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        most[admission] = 0
        while engine.has_unfinished_requests():
            outputs += [out for out in engine.step() if out.finished]
            most[admission] = max(most[admission], len(engine.scheduler.running))
        by_id = {out.request_id: out.token_ids for out in outputs}
        assert [by_id[i] for i in ids] == [naive(tiny_model, prompt, params) for prompt in prompts]
        if admission == "reserve":
            assert engine.num_preemptions == 0
        assert_drained(llm)
    assert most["reserve"] < most["fcfs"]


# ---------------------------------------------------------------- the pressure ladder


def test_the_ladder_reclaims_cached_blocks_before_it_preempts_and_never_evicts_unasked(tiny_dir, tiny_model):
    """Warm requests leave their prompts' blocks cached and unheld; a burst then needs the whole
    pool. The cached blocks go first (reclaim), a preemption only after, no eviction at all. (First
    come first served, which does not keep headroom: the ladder is what is tested.)"""
    llm = tight(tiny_dir, tiny_model, blocks=16, prefix_caching=True, admission="fcfs")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm.generate(random_prompts(3, seed=7), params)  # leaves cached blocks behind
    burst = random_prompts(10, seed=8)
    outputs = llm.generate(burst, params)
    assert [out.token_ids for out in outputs] == [naive(tiny_model, prompt, params) for prompt in burst]
    ladder = list(llm.engine.stats.ladder)
    assert all(set(rungs) <= set(RUNGS) - {"evict"} for rungs in ladder)
    first = {
        rung: next(i for i, rungs in enumerate(ladder) if rung in rungs) for rung in ("reclaim", "preempt")
    }
    assert first["reclaim"] <= first["preempt"]
    assert llm.engine.stats.rungs["reclaim"] > 0 and llm.engine.stats.rungs["preempt"] > 0
    assert_drained(llm)


def test_eviction_under_pressure_waits_for_a_shortage(tiny_dir, tiny_model):
    """With room, the pressure trigger evicts nothing and the output is naive's; short of room,
    it evicts only after steps that had to preempt (first come first served, which does not keep
    headroom, so the short pool preempts)."""
    prompts, params = random_prompts(10, seed=9), SamplingParams(max_tokens=20, ignore_eos=True)
    switches = dict(eviction="h2o", kv_budget=12, eviction_trigger="pressure")
    roomy = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, **switches)
    assert [out.token_ids for out in roomy.generate(prompts, params)] == [
        naive(tiny_model, prompt, params) for prompt in prompts
    ]
    assert roomy.engine.stats.tokens_evicted == 0
    short = tight(tiny_dir, tiny_model, blocks=14, admission="fcfs", **switches)
    short.generate(prompts, params)
    ladder = list(short.engine.stats.ladder)
    assert short.engine.stats.tokens_evicted > 0
    assert all("preempt" in rungs for rungs in ladder if "evict" in rungs)
    assert_drained(short)


@pytest.mark.parametrize(
    "switches, message",
    [
        ({"admission": "sjf"}, "admission must be"),
        ({"admission": "memory", "scheduling": "static"}, "scheduling='continuous'"),
        ({"admission": "reserve", "scheduling": "static"}, "scheduling='continuous'"),
        ({"eviction_trigger": "pressure"}, "only applies with eviction"),
        ({"eviction": "h2o", "kv_budget": 8, "eviction_trigger": "later"}, "eviction_trigger must be"),
    ],
)
def test_admission_and_ladder_switches_are_checked(tiny_dir, tiny_model, switches, message):
    with pytest.raises(ConfigError, match=message):
        LLM(tiny_dir, model=tiny_model, **switches)


@pytest.mark.parametrize("priority", ["high", 1.5, True, 1000])
def test_a_bad_priority_is_refused_in_one_line(tiny_dir, tiny_model, priority):
    llm = LLM(tiny_dir, model=tiny_model)
    with pytest.raises(ValueError, match="priority must be"):
        llm.engine.add_request([1, 2, 3], priority=priority)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
