"""`minillm bench scheduling`: the trace is seeded and what its docstring says (shares, Poisson
arrivals, conversations that resend themselves), the loads are interpolated as stated, and a run
on a tiny model keeps its promises whatever the timings (greedy tokens equal across policies,
every request served, goodput a share)."""

import math
import statistics

import pytest
from helpers import run_json, tiny_with_real_tokenizer

from minillm.benchmarks.scheduling.bench import HEAVIEST, POLICIES, rate_for
from minillm.benchmarks.scheduling.lengths import rank_quality, ranks, spearman
from minillm.benchmarks.scheduling.trace import (
    KINDS,
    QUESTIONS_ONLY,
    arrivals_for,
    make_trace,
)
from minillm.benchmarks.workload import kind_counts, next_turn_prompt
from minillm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(real_dir):
    return Tokenizer(real_dir)


@pytest.fixture(scope="module")
def vocab_dir(real_dir, tmp_path_factory):
    """The tiny random Llama with the real tokenizer, its context long enough for a chat's turns."""
    return tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("tiny-sched"), real_dir, max_position_embeddings=2048
    )


def test_the_same_seed_gives_the_same_trace_and_the_rate_only_stretches_it(tokenizer):
    slow, fast = (make_trace(tokenizer, 3, 60, rate, 0.25) for rate in (1.0, 4.0))
    assert [r.prompt_ids for r in slow] == [r.prompt_ids for r in make_trace(tokenizer, 3, 60, 1.0, 0.25)]
    assert [(r.kind, r.prompt_ids, r.output_len, r.follows) for r in slow] == [
        (r.kind, r.prompt_ids, r.output_len, r.follows) for r in fast
    ]
    for a, b in zip(slow, fast):
        if a.follows is None:
            assert a.arrival_s == pytest.approx(4 * b.arrival_s)  # exponential gaps at a quarter of the rate
        else:
            assert a.arrival_s == b.arrival_s  # a think time: not stretched
    other = make_trace(tokenizer, 4, 60, 1.0, 0.25)
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in slow]
    for trace, rate in ((slow, 1.0), (fast, 4.0), (other, 1.0)):  # every seed: the same mean gap, 1 / rate
        arrivals = [r.arrival_s for r in trace if r.follows is None]
        assert max(arrivals) == pytest.approx((len(arrivals) - 1) / rate) and min(arrivals) == 0


def test_kinds_come_in_their_shares_and_conversations_follow_their_turns(tokenizer):
    trace = make_trace(tokenizer, 1, 150, 2.0, 0.5)
    arrivals = [r for r in trace if r.follows is None]
    assert len(arrivals) == arrivals_for(150) and abs(len(trace) - 150) <= 10
    assert [sum(r.kind == kind.name for r in arrivals) for kind in KINDS] == kind_counts(len(arrivals), KINDS)
    followers = [index for index, r in enumerate(trace) if r.follows is not None]
    assert followers and all(trace[trace[i].follows].kind == "chat" == trace[i].kind for i in followers)
    assert all(trace[i].follows < i for i in followers)
    assert len({trace[i].follows for i in followers}) == len(followers)  # a chain, one turn after another
    times = [r.arrival_s for r in arrivals]
    assert times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.35)  # rate 2/s, ~100 gaps
    outputs = [r.output_len for r in trace]
    assert max(outputs) > 4 * statistics.median(outputs)  # heavy-tailed: a few long answers
    assert all(2 <= r.output_len <= r.max_tokens for r in trace)


def test_a_turn_resends_the_conversation_so_far(tokenizer):
    end = tokenizer.special_tokens["<|im_end|>"]
    previous, answer, message = [1, 2, 3], [4, 5, end], [6, 7]
    prompt = next_turn_prompt(tokenizer, previous, answer, message)
    assert prompt[:6] == previous + answer and prompt[-2:] == message
    unfinished = next_turn_prompt(tokenizer, previous, [4, 5], message)  # cut by max_tokens: closed here
    assert unfinished == prompt


def test_the_rate_at_a_goodput_is_interpolated_in_log_rate():
    grid = [(1.0, 1.0), (2.0, 0.9), (4.0, 0.5)]
    assert rate_for(grid, 0.9) == pytest.approx(2.0)
    assert rate_for(grid, 0.7) == pytest.approx(math.exp(math.log(2) + 0.5 * math.log(2)))
    assert rate_for(grid, 0.4) is None and rate_for(grid[:1], 0.9) is None


@pytest.mark.slow  # a whole benchmark run (15-45 s)
def test_bench_scheduling_json_keeps_its_promises(capsys, vocab_dir):
    report = run_json(
        capsys,
        "bench",
        "scheduling",
        "--json",
        "--quick",
        "--requests",
        16,
        "--seeds",
        "1",
        "--rates",
        "2,8",
        "--dtype",
        "float32",
        "--model",
        vocab_dir,
    )
    assert report["sizes"]["seeds"] == [1] and report["sizes"]["tuning_seeds"] == [0, 6, 7]
    assert list(report["loads"]["rates"].values()) == [2, 8]
    assert report["outputs_differing_from_fcfs"] == {row: 0 for row in HEAVIEST}  # float32: order only
    for load, by_row in report["runs"].items():
        assert list(by_row) == list(
            HEAVIEST if load == "8/s" else POLICIES
        )  # the lengths' rows at the heaviest
        for row, runs in by_row.items():
            assert [run["seed"] for run in runs] == [1]
            for run in runs:
                assert run["errors"] == 0 and 0 <= run["goodput"] <= 1
                assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
                assert (run["lengths"] is not None) == (row == "memory")
            mean = report["summary"][load][row]["goodput_mean"]
            assert mean == pytest.approx(statistics.mean(run["goodput"] for run in runs))
    assert set(report["sustained_rate"]) == set(POLICIES)
    assert -1 <= report["lengths"]["spearman"]["median"] <= 1
    cost = report["scheduler_cost_ms"]
    assert set(cost) == set(POLICIES) and all(
        ms > 0 for by_waiting in cost.values() for ms in by_waiting.values()
    )


@pytest.mark.parametrize("seeds", ["0,1", "1,7"])
def test_a_tuning_seed_is_refused_as_a_held_out_one(capsys, vocab_dir, seeds):
    from minillm.cli import main

    assert main(["bench", "scheduling", "--seeds", seeds, "--model", str(vocab_dir)]) != 0
    assert "is a tuning seed" in capsys.readouterr().err


def test_spearman_is_pearson_on_ranks_with_ties_shared():
    assert ranks([10, 30, 20, 20]) == [1, 4, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1)
    assert spearman([1, 2, 3, 4], [5, 5, 5, 5]) is None  # nothing to rank
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(
        1 - 6 * 4 / (5 * 24)
    )  # 1 - 6 sum d^2 / n(n^2 - 1)


def test_the_kind_ceiling_knows_the_kind_and_nothing_else(tokenizer):
    """A predictor that guesses each request's kind's mean exactly scores the ceiling; one that
    knows the true lengths scores 1."""
    trace = make_trace(tokenizer, 1, 60, 2.0, 0.25)
    by_kind = {}
    for r in trace:
        by_kind.setdefault(r.kind, []).append(r.output_len)
    kind_mean = {kind: statistics.fmean(lengths) for kind, lengths in by_kind.items()}
    guessed = rank_quality({str(i): kind_mean[r.kind] for i, r in enumerate(trace)}, trace)
    assert guessed["spearman"] == pytest.approx(guessed["kind_ceiling"])
    assert rank_quality({str(i): r.output_len for i, r in enumerate(trace)}, trace)[
        "spearman"
    ] == pytest.approx(1)


def test_each_kind_declares_its_clients_max_tokens_and_never_runs_past_it(tokenizer):
    trace = make_trace(tokenizer, 2, 150, 2.0, 0.35)
    declared = {kind.name: round(kind.max_tokens * 0.35) for kind in KINDS}
    assert all(r.max_tokens == declared[r.kind] and 2 <= r.output_len <= r.max_tokens for r in trace)
    assert declared["long answer"] > declared["question"] > declared["document"]


def test_a_mix_of_questions_only_has_nothing_to_share(tokenizer):
    trace = make_trace(tokenizer, 1, 40, 2.0, 0.25, mix=QUESTIONS_ONLY)
    assert len(trace) == 40 and {r.kind for r in trace} == {"question"}
    assert all(r.follows is None for r in trace)
