"""Memory-aware admission as the spec: a request priced by its whole life (KV block-steps and
tokens), output lengths learned by shape in a bounded window, the victim with the most remaining
cost, deadlines (the late yield, the urgent go first), and a starvation bound that holds."""

import itertools

import pytest
from helpers import step_without_model as step

from minillm.engine import LLM, SamplingParams
from minillm.engine.admission import MAX_WAIT_STEPS
from minillm.engine.memory_aware import LATE_REFUSAL, URGENT_STEPS, MemoryAware
from minillm.engine.output_length import HISTORY, PRIOR_PEERS, LearnedLengths, MeanOfFinished
from minillm.engine.scheduler import Scheduler, make_admission
from minillm.engine.sequence import Sequence, Status
from minillm.memory import KVCacheManager
from minillm.memory.block_manager import BlockManager

BLOCK = 4
EOT = 96  # the end-of-turn token of these tests' "chat template"
EOS_TOKEN_IDS = frozenset({EOT})  # what LearnedLengths counts as closing a message


def request(seq_id, prompt, max_tokens, n=1):
    prompt = [1] * prompt if isinstance(prompt, int) else prompt
    params = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0 if n > 1 else 0.0, ignore_eos=True)
    return Sequence(seq_id, str(seq_id), prompt, params, max_len=len(prompt) + max_tokens)


def finished(seq_id, prompt, max_tokens, length):
    seq = request(seq_id, prompt, max_tokens)
    seq.output_ids.extend([1] * length)
    return seq


TAUGHT_IDS = itertools.count(1000)  # every sequence an engine makes has its own id


def teach(lengths, prompt, max_tokens, length, times=8):
    for _ in range(times):
        lengths.finished(finished(next(TAUGHT_IDS), prompt, max_tokens, length))


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(num_blocks=64, prefix_caching=False, **kwargs) -> MemoryAware:
    manager = KVCacheManager(
        BlockManager(num_blocks=num_blocks, block_size=BLOCK, prefix_caching=prefix_caching)
    )
    return MemoryAware(manager, 64, kwargs.pop("lengths", LearnedLengths(EOS_TOKEN_IDS)), **kwargs)


def scheduler_with(admission, manager=None, max_num_seqs=16) -> Scheduler:
    return Scheduler(
        manager or admission.manager,
        "continuous",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        context_len=256,
        vocab_size=97,
        admission=admission,
    )


# ---------------------------------------------------------------- the predictor


def test_lengths_are_learned_by_the_shape_of_the_request():
    """Essays (a large max_tokens) and one-line answers (a chat turn) are told apart by shape."""
    lengths = LearnedLengths(EOS_TOKEN_IDS)
    chat_turn = [5, 6, EOT, 7, 8]
    teach(lengths, 8, 512, 300, times=32)  # raw prose, room for an essay declared: long answers
    teach(lengths, chat_turn, 64, 6, times=32)  # a chat turn with a small max_tokens: short answers
    assert 0.95 * 300 <= lengths.expected_output(request(1, 8, 512)) <= 300
    assert 6 <= lengths.expected_output(request(2, chat_turn, 64)) <= 1.5 * 6


def test_a_shape_seen_rarely_is_pulled_toward_the_coarser_estimate():
    """Its own mean counts as much as its peers are many; PRIOR_PEERS more stand for the coarser
    shape's estimate."""
    lengths = LearnedLengths(EOS_TOKEN_IDS)
    teach(lengths, 8, 64, 10)  # 8-token prompts, raw text, 64 declared
    teach(lengths, 200, 64, 40, times=1)  # one 200-token prompt
    everyone = (8 * 10 + 40) / 9
    assert lengths.expected_output(request(1, 8, 32)) == round(everyone)  # no peer declares 32
    declared = (8 * 10 + 40 + PRIOR_PEERS * everyone) / (9 + PRIOR_PEERS)  # those declaring 64 (and raw)
    messages = (8 * 10 + 40 + PRIOR_PEERS * declared) / (9 + PRIOR_PEERS)
    long_prompt = (40 + PRIOR_PEERS * messages) / (1 + PRIOR_PEERS)
    assert lengths.expected_output(request(2, 200, 64)) == round(long_prompt)
    assert 10 < long_prompt < 40 / 2  # seen once: a little above its kind's 10, far from its own 40
    assert (
        LearnedLengths(EOS_TOKEN_IDS).expected_output(request(3, 8, 16)) == 16
    )  # nothing learned: max_tokens


def test_a_running_request_is_expected_to_outlive_what_it_has_generated():
    lengths = LearnedLengths(EOS_TOKEN_IDS)
    for length in (2, 4, 10, 20, 30, 40, 50, 60):
        lengths.finished(finished(next(TAUGHT_IDS), 8, 100, length))
    survivor = request(1, 8, 100)
    survivor.output_ids.extend([1] * 25)
    assert lengths.expected_output(survivor) == round((30 + 40 + 50 + 60) / 4)  # those that ran longer
    survivor.output_ids.extend([1] * 40)
    assert lengths.expected_output(survivor) == 100  # outlived them all: its max_tokens


def test_the_window_is_bounded_and_follows_the_latest_requests():
    """However many requests finish, HISTORY are kept (memory stays flat), and traffic that
    changes is followed."""
    lengths = LearnedLengths(EOS_TOKEN_IDS)
    for i in range(3 * HISTORY):
        lengths.finished(finished(next(TAUGHT_IDS), 8 + i % 50, 256, 100 if i < 2 * HISTORY else 10))
    assert lengths.learned() == HISTORY
    assert lengths.stored() == 4 * HISTORY  # each at its 4 levels of detail, no more
    assert lengths.expected_output(request(1, 8, 256)) == 10


def test_the_mean_of_finished_knows_no_shapes():
    mean = MeanOfFinished(EOS_TOKEN_IDS)
    teach(mean, 8, 512, 300)
    teach(mean, [5, EOT, 6], 64, 6)
    assert mean.expected_output(request(1, 8, 512)) == mean.expected_output(request(2, [5, EOT, 6], 512))


# ---------------------------------------------------------------- the price of a life


def test_a_document_costs_less_than_a_long_answer_whose_peak_is_lower():
    """KV block-steps, not peak blocks: 31 blocks for 4 steps is cheaper than 2 growing to 22 for 80."""
    lengths = LearnedLengths(EOS_TOKEN_IDS)
    teach(lengths, 120, 16, 2)  # documents: a long prompt, a short answer
    teach(lengths, 8, 128, 80)  # long answers: a short prompt, a long answer
    costs = policy(lengths=lengths)
    document, long_answer = request(1, 120, 16), request(2, 8, 128)

    def peak(seq):
        return costs.capacity.blocks_for(seq.num_tokens + costs.expected_output(seq))

    assert peak(document) > peak(long_answer)
    assert costs.cost(document) < costs.cost(long_answer)


def test_the_price_is_block_steps_over_the_pool_plus_tokens_over_the_budget():
    """The formula, spelled out on an 8-token prompt (2 blocks of 4) expected to answer in 8 tokens,
    a 64-block pool and a 64-token step: it holds its 2 prompt blocks for its prefill step and its
    8 decode steps, and its 2 output blocks as they grow; it computes 8 + 8 tokens."""
    lengths = LearnedLengths(EOS_TOKEN_IDS)
    teach(lengths, 8, 16, 8)
    assert policy(lengths=lengths).cost(request(1, 8, 16)) == pytest.approx(
        (2 * (1 + 8) + 2 * 8 / 2) / 64 + (8 + 8) / 64
    )


def test_cached_prompt_blocks_are_neither_held_anew_nor_computed():
    """The same request once its first block is cached: it holds 1 new prompt block and
    computes 4 prompt tokens (the cached block's are neither paid for)."""
    lengths = LearnedLengths(EOS_TOKEN_IDS)
    teach(lengths, 8, 16, 8)
    costs = policy(prefix_caching=True, lengths=lengths)
    sched = scheduler_with(costs)
    warm = request(1, [7, 8, 9, 10, 11, 12], 2)  # leaves its first block, [7, 8, 9, 10], cached
    sched.add(warm)
    for _ in range(100):  # two tokens: a few steps
        if warm.status is Status.FINISHED:
            break
        step(sched)
    assert warm.status is Status.FINISHED
    costs.order([], sched.steps)  # a new step: the prefix cache is looked up again
    cached = request(2, [7, 8, 9, 10, 13, 14, 15, 16], 16)
    assert costs.cost(cached) == pytest.approx((1 * (1 + 8) + 2 * 8 / 2) / 64 + (4 + 8) / 64)


def test_each_of_n_samples_is_priced():
    costs = policy()
    assert costs.cost(request(1, 8, 32, n=4)) > costs.cost(request(2, 8, 32, n=1))


def test_shortest_predicted_work_is_admitted_first():
    lengths = LearnedLengths(EOS_TOKEN_IDS)
    teach(lengths, 8, 128, 100)
    teach(lengths, 8, 16, 3)
    costs = policy(num_blocks=64, lengths=lengths)
    sched = scheduler_with(costs, max_num_seqs=1)
    long_answer, short = request(1, 8, 128), request(2, 8, 16)
    sched.add(long_answer)
    sched.add(short)
    assert step(sched) == [short]


# ---------------------------------------------------------------- the victim


@pytest.mark.parametrize("admission, victim", [("fcfs", "newest"), ("memory", "costliest")])
def test_the_victim_is_the_running_request_with_the_most_remaining_cost(admission, victim):
    """Three arrive a step apart, each expected to answer in a token (their peers did); all outlive
    that, and the pool runs short as the middle one needs a block. fcfs preempts the newest;
    memory-aware admission the one with the most life left, the middle one itself."""
    manager = KVCacheManager(BlockManager(num_blocks=9, block_size=BLOCK))
    lengths = LearnedLengths(EOS_TOKEN_IDS)
    teach(lengths, 4, 24, 1)
    teach(lengths, 4, 12, 1)
    sched = scheduler_with(make_admission(admission, manager, 64, lengths), manager)
    oldest, costliest, newest = request(1, 4, 12), request(2, 4, 24), request(3, 4, 12)
    for seq in (oldest, costliest, newest):  # running in this order, oldest first
        sched.add(seq)
        step(sched)
    while not any(seq.num_preemptions for seq in (oldest, costliest, newest)):
        assert step(sched)
    preempted = [seq for seq in (oldest, costliest, newest) if seq.num_preemptions]
    assert preempted == [{"newest": newest, "costliest": costliest}[victim]]


# ---------------------------------------------------------------- deadlines


STEP_S = 0.1  # the fake clock's seconds per engine step
TARGET = 4 * URGENT_STEPS * STEP_S  # a fresh request has 4 x URGENT_STEPS steps of slack


def deadline_policy(clock, lengths=None, num_blocks=64, refuse_late=False):
    lengths = lengths or LearnedLengths(EOS_TOKEN_IDS)
    return policy(
        num_blocks=num_blocks, lengths=lengths, ttft_target=TARGET, refuse_late=refuse_late, clock=clock
    )


def run_steps(sched, clock, steps, step_s=STEP_S):
    started = []
    for _ in range(steps):
        started += step(sched)
        clock.now += step_s
    return started


def test_a_request_that_can_no_longer_meet_its_target_yields_to_one_that_can():
    clock = FakeClock()
    costs = deadline_policy(clock)
    sched = scheduler_with(costs, max_num_seqs=1)
    run_steps(sched, clock, 3)  # the step timer learns 0.1 s a step
    late, in_time = request(1, 8, 4), request(2, 8, 4)
    late.arrival_time = clock.now - 1.5 * TARGET  # its target is gone
    in_time.arrival_time = clock.now - 0.2 * TARGET
    sched.add(late)
    sched.add(in_time)
    assert step(sched) == [in_time]
    assert costs.is_late(late) and not costs.is_late(in_time)


def test_a_request_near_its_deadline_goes_before_cheaper_ones():
    clock = FakeClock()
    lengths = LearnedLengths(EOS_TOKEN_IDS)
    teach(lengths, 8, 128, 100)
    teach(lengths, 8, 16, 3)
    costs = deadline_policy(clock, lengths)
    sched = scheduler_with(costs, max_num_seqs=1)
    run_steps(sched, clock, 3)
    urgent, cheap = request(1, 8, 128), request(2, 8, 16)
    urgent.arrival_time = clock.now - TARGET + STEP_S * (URGENT_STEPS // 2)  # a few steps of slack left
    cheap.arrival_time = clock.now
    sched.add(cheap)
    sched.add(urgent)
    assert step(sched) == [urgent]


@pytest.mark.parametrize("refuse_late", [False, True])
def test_with_refuse_late_a_late_request_ends_at_once_with_a_reason(refuse_late):
    """Refused, it ends alone with an error its client can act on, even while every seat is
    taken; without refuse_late it waits, served within the starvation bound."""
    clock = FakeClock()
    costs = deadline_policy(clock, refuse_late=refuse_late)
    sched = scheduler_with(costs, max_num_seqs=1)
    running = request(1, 8, 40)
    sched.add(running)
    run_steps(sched, clock, 3)  # it holds the only seat; the step timer learns 0.1 s a step
    late = request(2, 8, 4)
    late.arrival_time = clock.now - 1.5 * TARGET
    sched.add(late)
    step(sched)
    if refuse_late:
        assert late.status is Status.FINISHED and late.finish_reason == "error"
        assert late.error.startswith(LATE_REFUSAL) and "retry" in late.error
        assert sched.take_refused() == ["2"] and sched.take_refused() == []
    else:
        assert late.status is Status.WAITING and sched.take_refused() == []
    assert running.status is Status.RUNNING


def test_without_a_target_nobody_is_late():
    costs = policy()
    seq = request(1, 8, 4)
    seq.arrival_time = -1e9
    costs.order([seq], 1)
    assert not costs.is_late(seq)


# ---------------------------------------------------------------- no starvation


def test_a_large_request_is_admitted_within_the_stated_bound_under_a_stream_of_small_ones(monkeypatch):
    """Two small requests arrive every step, each cheaper than the large one: by benefit / cost
    alone the large one would wait forever. Once it has waited MAX_WAIT_STEPS it is due, nobody
    overtakes it, and it starts as soon as the small ones running then have finished."""

    def first_step_of_the_large_one(max_wait, steps):
        monkeypatch.setattr("minillm.engine.admission.MAX_WAIT_STEPS", max_wait)
        sched = scheduler_with(policy(num_blocks=16))
        large = request(0, 44, 4)  # 12 of the 16 blocks
        sched.add(large)
        for index in range(1, steps):
            for k in range(2):
                sched.add(request(2 * index + k, 4, 6))  # 3 blocks at their peak
            if large in step(sched):
                return index
        return None

    small_lifetime = 1 + 6  # a small request's prefill step and its 6 tokens
    started = first_step_of_the_large_one(MAX_WAIT_STEPS, MAX_WAIT_STEPS + 20)
    assert started is not None and started <= MAX_WAIT_STEPS + small_lifetime + 1
    assert first_step_of_the_large_one(10**9, 400) is None  # without aging it starves


# ---------------------------------------------------------------- the switch


def test_the_ttft_target_belongs_to_memory_aware_admission(tiny_dir, tiny_model):
    from minillm.config import ConfigError

    with pytest.raises(ConfigError, match="memory-aware admission"):
        LLM(tiny_dir, model=tiny_model, ttft_target=1.0)
    with pytest.raises(ConfigError, match="positive number of seconds"):
        LLM(tiny_dir, model=tiny_model, admission="memory", ttft_target=-1)
    with pytest.raises(ConfigError, match="give ttft_target"):
        LLM(tiny_dir, model=tiny_model, admission="memory", refuse_late=True)
    LLM(tiny_dir, model=tiny_model, admission="memory", ttft_target=0.5, refuse_late=True)
