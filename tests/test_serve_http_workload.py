"""`minillm bench serve-http --workload`: bench scheduling's workload sent to a `minillm serve` over HTTP.

Every request is answered with exactly the tokens the trace says, a chat turn carries the
conversation so far (an empty answer where its previous turn failed) and waits for it, and goodput
counts the requests within both SLOs, a failure as a miss. The server is a child process on the
tiny random Llama with the real tokenizer; the replay's loop and the summary are also checked
without one.
"""

import asyncio
import json

import pytest
from helpers import tiny_with_real_tokenizer

from minillm.benchmarks import serve_http_workload
from minillm.benchmarks.scheduling.trace import make_trace
from minillm.benchmarks.serve_http_workload import Answered, replay_http, served_summary
from minillm.benchmarks.workload import next_turn_prompt
from minillm.cli import main
from minillm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(real_dir, tmp_path_factory):
    return tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("trace-model"),
        real_dir,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )


@pytest.mark.slow  # a whole benchmark run against a child server (15-45 s)
def test_workload_over_http_answers_every_request_and_reports_goodput(capsys, model_dir):
    sizes = ["--workload-requests", "8", "--workload-scale", "0.1"]
    sizes += ["--workload-rate", "8", "--workload-seed", "3"]
    engine = ["--admission", "memory", "--prefix-caching", "--kv-cache-mb", "8", "--threads", "1"]
    argv = ["bench", "serve-http", "--workload", "--json", *sizes, *engine, "--model", str(model_dir)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    served, workload, slo, idle = report["served"], report["workload"], report["slo"], report["idle"]
    args = report["serve_args"]
    assert report["engine"]["admission"] == args[args.index("--admission") + 1] == "memory"  # forwarded
    assert workload["kinds"]["chat"] >= 2  # a conversation's later turn went out after its answer
    assert served["requests"] == workload["requests"] and served["errors"] == 0, served["first_errors"]
    assert served["output_tokens"] == workload["output_tokens"]  # exactly output_len each, EOS ignored
    assert 0 <= served["goodput"] <= 1
    assert (
        0 < served["ttft_p50_s"] <= served["ttft_p99_s"] and 0 < served["tpot_p50_s"] <= served["tpot_p99_s"]
    )
    assert served["wall_s"] >= workload["last_arrival_s"]  # sent on the wall clock, idle time not skipped
    assert slo["ttft_s"] == pytest.approx(5 * idle["prefill_s"]) and idle["prefill_s"] > 0
    assert slo["tpot_s"] == pytest.approx(5 * idle["decode_tpot_s"]) and idle["decode_tpot_s"] > 0
    assert report["blocks_held_after"] == 0
    assert report["answers_with_token_ids"] == served["requests"]  # asked for, and minillm sends them
    assert 0 <= report["answers_retokenized_apart"] <= served["requests"]
    assert 0 <= report["prefix_hit_rate"] <= 1


@pytest.mark.parametrize("old, new", [("--trace", "--workload"), ("--trace-seed", "--workload-seed")])
def test_the_old_trace_flags_say_what_they_became(capsys, real_dir, old, new):
    value = ["3"] if old != "--trace" else []
    assert main(["bench", "serve-http", old, *value, "--model", str(real_dir)]) == 2
    assert f"serve-http: {old} is now {new}" in capsys.readouterr().err


def answer(ttft: float | None, tpot: float | None, error: str | None = None) -> Answered:
    return Answered("question", 10, "", None, 0 if error else 4, ttft, tpot, error)


def test_goodput_is_the_share_within_both_slos_and_a_failure_misses():
    answered = [
        answer(0.5, 0.05),  # good
        answer(1.0, 0.10),  # good: at the SLOs
        answer(1.5, 0.05),  # TTFT missed
        answer(0.5, 0.20),  # TPOT missed
        answer(None, None, "HTTP 503"),
    ]
    summary = served_summary(answered, {"ttft_s": 1.0, "tpot_s": 0.1}, wall_s=3.0)
    assert summary["requests"] == 5 and summary["errors"] == 1 and summary["goodput"] == 2 / 5
    assert summary["ttft_p50_s"] == 0.5 and summary["ttft_p99_s"] == 1.5  # nearest rank, of the 4 answered
    assert summary["first_errors"] == ["HTTP 503"]
    nothing = served_summary([answer(None, None, "HTTP 429")], {"ttft_s": 1.0, "tpot_s": 0.1}, 1.0)
    assert nothing["goodput"] == 0 and nothing["ttft_p50_s"] is None


def test_a_chat_turn_carries_the_conversation_and_an_empty_answer_after_a_failure(real_dir, monkeypatch):
    """With `send` replaced: each turn's prompt, and that it goes out only once the last one answered.
    Half the answers come with token ids (resent as they are), half without (their text, tokenized)."""
    tokenizer = Tokenizer(real_dir)
    trace = make_trace(tokenizer, seed=5, num_requests=12, rate=50.0, scale=0.1)
    for request in trace:
        request.arrival_s = min(request.arrival_s, 0.01)  # no waiting: the order is what counts
    chats = [i for i, r in enumerate(trace) if r.follows is not None]
    assert len(chats) >= 2
    failing = trace[chats[0]].follows  # this turn fails: its follower gets an empty answer
    sent, finished = {}, set()  # index -> the prompt it was sent with; the indexes answered

    def which(prompt_ids: list[int]) -> int:
        """The request this prompt is for: each ends with its own trace entry's ids."""
        matches = [
            i
            for i, r in enumerate(trace)
            if i not in sent and prompt_ids[-len(r.prompt_ids) :] == r.prompt_ids
        ]
        assert len(matches) == 1
        return matches[0]

    async def fake_send(port, model, prompt_ids, max_tokens, kind=""):
        index = which(prompt_ids)
        assert trace[index].follows is None or trace[index].follows in finished  # a closed loop
        assert max_tokens == trace[index].output_len
        sent[index] = prompt_ids
        await asyncio.sleep(0.002)
        finished.add(index)
        if index == failing:
            return Answered(kind, len(prompt_ids), "", None, 0, None, None, "HTTP 503")
        return Answered(kind, len(prompt_ids), f" answer {index}", ids_of(index), max_tokens, 0.1, 0.01, None)

    def ids_of(index: int) -> list[int] | None:
        return [7, 8, 9 + index] if index % 2 else None

    monkeypatch.setattr(serve_http_workload, "send", fake_send)
    answered, _ = asyncio.run(replay_http(0, "tiny", tokenizer, trace, progress=False))
    assert sorted(sent) == list(range(len(trace))) and all(a is not None for a in answered)
    for index in chats:
        before = trace[index].follows
        previous = ids_of(before) or tokenizer.encode(f" answer {before}")
        previous = [] if before == failing else previous
        assert sent[index] == next_turn_prompt(tokenizer, sent[before], previous, trace[index].prompt_ids)
    assert answered[failing].error == "HTTP 503"
