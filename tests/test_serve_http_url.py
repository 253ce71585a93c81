"""`minillm bench serve-http --url`: bench serve-http's clients against a server it did not start.

A fake OpenAI-compatible server (http.server in a thread, no model) streams one chunk per token
DELAY_S apart, ending as llama.cpp's does (an empty chunk with the finish reason), with or
without `usage`: the report must count its tokens, name the model /v1/models lists, and measure
an inter-token latency of DELAY_S. An unreachable URL, https or a failing request is one line
that says what to do. Then a real `minillm serve` (uvicorn in a thread, the tiny random Llama)
through --url, the clients and the trace replay.
"""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import tokenizers
from helpers import tiny_with_real_tokenizer
from serving import fetch, running_server

from minillm.benchmarks.serve import OUTPUT_LEN, PROMPT_LEN
from minillm.benchmarks.serve_http import client_trace
from minillm.benchmarks.serve_http_turns import MESSAGE_LEN
from minillm.benchmarks.workload import uniform_trace
from minillm.cli import main
from minillm.cli.flags import SERVING_DEFAULTS
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.evaluation import read_text
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.metrics import parse_metrics
from minillm.tokenizer import Tokenizer

DELAY_S = 0.03  # between two tokens of the fake server's streams
FAKE_MODEL = "fake/llama-135m"
FAKE_ID = 1000  # the fake server's first token id in an answer; the next are 1001, 1002...


class FakeCompletions(BaseHTTPRequestHandler):
    """GET /v1/models and a streamed POST /v1/completions; the body ends when the connection closes."""

    protocol_version = "HTTP/1.0"

    def do_GET(self):
        self.reply(200, {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        if self.server.error:
            return self.reply(400, {"error": {"message": self.server.error}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            time.sleep(DELAY_S if i else 0)
            choice = {"index": 0, "text": f" w{i}", "finish_reason": None}
            if self.server.ids and body.get("return_token_ids"):
                choice["token_ids"] = [FAKE_ID + i]
            self.event({"choices": [choice]})
        self.event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if self.server.usage:
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            self.event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")

    def event(self, message: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(message).encode() + b"\n\n")

    def reply(self, status: int, message: dict) -> None:
        payload = json.dumps(message).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    """Start one with start(usage=..., error=..., ids=...): its URL, and the request bodies it got."""
    servers = []

    def start(usage: bool = True, error: str | None = None, ids: bool = False):
        server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
        server.daemon_threads, server.usage, server.error, server.bodies = True, usage, error, []
        server.ids = ids  # send each token's id (FAKE_ID + its index) when asked, as minillm and vLLM do
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server.bodies

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def bench_url(capsys, real_dir, url: str, *flags: str) -> dict:
    args = ["bench", "serve-http", "--url", url, "--json", *flags, "--model", str(real_dir)]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_url_reports_the_servers_tokens_its_model_and_each_clients_inter_token_latency(
    capsys, real_dir, fake_server
):
    url, bodies = fake_server(usage=True)
    report = bench_url(capsys, real_dir, url, "--clients", "3", "--max-tokens", "6", "--repeats", "2")
    assert report["model"] == FAKE_MODEL and report["url"] == url
    assert len(report["rounds"]) == 2 and report["tokens_from"] == "usage"
    assert all(run["output_tokens"] == run["output_tokens_asked"] == 3 * 6 for run in report["rounds"])
    assert len(bodies) == 1 + 2 * 3  # the warm-up, then 2 rounds of 3 clients
    for body in bodies:
        assert body["model"] == FAKE_MODEL and body["max_tokens"] == 6 and body["stream"]
        assert body["temperature"] == 0 and body["ignore_eos"] and body["stream_options"]["include_usage"]
        assert isinstance(body["prompt"], list) and all(isinstance(t, int) for t in body["prompt"])
    for run in report["rounds"]:
        assert DELAY_S * 0.9 < run["itl_p50_s"] <= run["itl_p99_s"] < DELAY_S * 3
        assert 1 / (DELAY_S * 3) < run["decode_tok_s_per_client"] < 1 / (DELAY_S * 0.9)
    tok_s = report["spread"]["output_tok_s"]
    assert tok_s["min"] <= tok_s["median"] <= tok_s["max"]
    assert sorted([tok_s["min"], tok_s["max"]]) == sorted(run["output_tok_s"] for run in report["rounds"])


def test_without_usage_the_tokens_are_the_chunks_that_carried_text(capsys, real_dir, fake_server):
    url, _ = fake_server(usage=False)
    report = bench_url(capsys, real_dir, url, "--clients", "2", "--max-tokens", "5")
    assert report["tokens_from"] == "chunks"
    assert report["rounds"][0]["output_tokens"] == 2 * 5  # the closing chunk, without text, not counted
    assert DELAY_S * 0.9 < report["rounds"][0]["itl_p50_s"] < DELAY_S * 3
    flags = ["--url", url, "--clients", "2", "--max-tokens", "3", "--model", str(real_dir)]
    assert main(["bench", "serve-http", *flags]) == 0  # the table, not --json
    printed = " ".join(capsys.readouterr().out.split())  # as one line, however the table wrapped it
    assert FAKE_MODEL in printed and "the server sent no usage" in printed


@pytest.mark.parametrize("flags", [[], ["--prompt-tokens", "50"]], ids=["the trace's lengths", "50 tokens"])
def test_every_round_and_the_warm_up_send_prompts_of_their_own(capsys, real_dir, fake_server, flags):
    """No round's prompt is one an earlier round (or the warm-up) left in the server's cache; each
    is a stretch of the prose (decoded by the `tokenizers` library), of exactly --prompt-tokens."""
    url, bodies = fake_server()
    report = bench_url(capsys, real_dir, url, "--clients", "3", "--max-tokens", "2", "--repeats", "2", *flags)
    assert len(bodies) == 1 + 2 * 3 and report["trace"]["seeds"] == {"warm_up": 0, "rounds": [1, 2]}
    reference = tokenizers.Tokenizer.from_file(str(real_dir / "tokenizer.json"))
    assert all(reference.decode(body["prompt"]) in read_text() for body in bodies)
    sent = [{tuple(body["prompt"]) for body in group} for group in (bodies[:1], bodies[1:4], bodies[4:])]
    assert [len(prompts) for prompts in sent] == [1, 3, 3]  # the clients of a round differ too
    assert not sent[0] & sent[1] and not sent[0] & sent[2] and not sent[1] & sent[2]
    lengths = [len(body["prompt"]) for body in bodies]
    if flags:
        assert lengths == [50] * 7 and report["trace"]["prompt_len"] == "50"
    else:
        assert all(PROMPT_LEN[0] <= n <= PROMPT_LEN[1] for n in lengths)
    assert sum(run["prompt_tokens"] for run in report["rounds"]) == sum(lengths[1:])


@pytest.mark.parametrize(
    "tokens, says",
    [("0", "0 is not a positive count"), ("1000000", "prompts of up to 1000000 tokens cannot be cut")],
)
def test_prompt_tokens_that_no_prompt_can_have_is_one_line(capsys, real_dir, tokens, says):
    flags = ["--url", "http://127.0.0.1:9", "--prompt-tokens", tokens, "--model", str(real_dir)]
    assert main(["bench", "serve-http", *flags]) == 2  # refused before any request: nothing listens there
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "url, says",
    [
        ("https://127.0.0.1:8443", "only http:// is supported"),
        ("127.0.0.1:8080", "is not http://HOST:PORT"),
        ("http://127.0.0.1:8080/v1", "is not http://HOST:PORT"),
    ],
)
def test_a_url_other_than_http_host_port_is_one_line(capsys, real_dir, url, says):
    assert main(["bench", "serve-http", "--url", url, "--model", str(real_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1


def test_an_unreachable_server_is_one_line_asking_whether_it_runs(capsys, real_dir):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed once the block ends: nothing listens there
    assert main(["bench", "serve-http", "--url", f"http://127.0.0.1:{port}", "--model", str(real_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach http://127.0.0.1:{port}: ") and err.count("\n") == 1
    assert err.rstrip().endswith("is the server running?")


def test_a_failing_request_stops_the_bench_with_what_the_server_said(capsys, real_dir, fake_server):
    url, _ = fake_server(error="the prompt is too long")
    assert main(["bench", "serve-http", "--url", url, "--clients", "2", "--model", str(real_dir)]) == 2
    err = capsys.readouterr().err
    assert "HTTP 400" in err and "the prompt is too long" in err and err.count("\n") == 1


def test_max_tokens_makes_every_output_that_long_on_the_same_prompts(real_dir):
    tokenizer = Tokenizer(real_dir)
    seeded = uniform_trace(tokenizer, 4, PROMPT_LEN, OUTPUT_LEN)
    assert client_trace(tokenizer, 4) == seeded
    longer = client_trace(tokenizer, 4, max_tokens=128)
    assert [(r.prompt_ids, r.output_len) for r in longer] == [(r.prompt_ids, 128) for r in seeded]


@pytest.mark.parametrize("ids", [True, False], ids=["the server's ids", "its text tokenized again"])
def test_each_turn_resends_the_last_prompt_its_answer_and_a_new_message(capsys, real_dir, fake_server, ids):
    """--turns: the answer resent is the server's token ids where it sends them, else its text
    tokenized again (here by the `tokenizers` library, minillm's tokenizer's reference); the new
    message is a stretch of the trace's prose."""
    url, bodies = fake_server(ids=ids)
    report = bench_url(capsys, real_dir, url, "--turns", "3", "--clients", "1", "--max-tokens", "3")
    reference = tokenizers.Tokenizer.from_file(str(real_dir / "tokenizer.json"))
    answer = [FAKE_ID, FAKE_ID + 1, FAKE_ID + 2] if ids else reference.encode(" w0 w1 w2").ids
    turns = bodies[1:]  # after the warm-up
    assert len(turns) == 3 and all(body["return_token_ids"] for body in turns)
    for last, this in zip(turns, turns[1:]):
        resent = [*last["prompt"], *answer]
        message = this["prompt"][len(resent) :]
        assert this["prompt"][: len(resent)] == resent
        assert MESSAGE_LEN[0] <= len(message) <= MESSAGE_LEN[1] and reference.decode(message) in read_text()
    assert list(report["by_turn"]) == ["1", "2", "3", "2-3"]
    assert [report["by_turn"][turn]["prompt_tokens"] for turn in "123"] == [len(b["prompt"]) for b in turns]
    assert report["answers"] == 3 and report["answers_tokenized_again"] == (0 if ids else 3)
    assert report["rounds"][0]["output_tokens"] == report["rounds"][0]["output_tokens_asked"] == 3 * 3
    for turn in report["by_turn"].values():
        assert 0 < turn["ttft_p50_s"]["median"] <= turn["ttft_p99_s"]["median"]


def test_turns_and_workload_are_two_loads_one_line_says(capsys, real_dir):
    flags = ["--turns", "2", "--workload", "--url", "http://127.0.0.1:9", "--model", str(real_dir)]
    assert main(["bench", "serve-http", *flags]) == 2
    err = capsys.readouterr().err
    assert "--turns and --workload" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def minillm_url(real_dir, tmp_path_factory):
    """A `minillm serve` app on the tiny random Llama with the real tokenizer, served as "tiny", its
    prefix cache on as `minillm serve` starts it."""
    model_dir = tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("url-model"), real_dir, max_position_embeddings=1024, tie_word_embeddings=True
    )
    config = EngineConfig(model_dir=model_dir, kv_cache_bytes=8 << 20, max_num_seqs=8, **SERVING_DEFAULTS)
    engine = LLMEngine(config)
    with running_server(EngineLoop(engine)) as url:
        yield url, model_dir


def test_url_drives_a_minillm_serve_started_by_hand(capsys, minillm_url):
    url, model_dir = minillm_url
    report = bench_url(capsys, model_dir, url, "--clients", "3", "--max-tokens", "8")
    served = report["rounds"][0]
    assert report["model"] == "tiny" and report["tokens_from"] == "usage" and served["all_finished"]
    assert served["output_tokens"] == 3 * 8
    assert 0 < served["ttft_p50_s"] <= served["ttft_p99_s"] and 0 < served["itl_p50_s"] <= served["itl_p99_s"]


def test_the_workload_replays_against_a_url(capsys, minillm_url):
    url, model_dir = minillm_url
    sizes = ["--workload-seed", "7", "--workload-requests", "4"]
    sizes += ["--workload-scale", "0.1", "--workload-rate", "8"]
    report = bench_url(capsys, model_dir, url, "--workload", *sizes, "--max-tokens", "4")
    served = report["served"]
    assert report["url"] == url and report["model"] == "tiny" and report["serve_args"] == []
    assert report["workload"]["kinds"]["chat"] == 2  # a chat turn, sent after its answer came back
    assert served["requests"] == 4 and served["errors"] == 0, served["first_errors"]
    assert served["output_tokens"] == report["workload"]["output_tokens"] == 4 * 4
    assert report["blocks_held_after"] is None  # /metrics is minillm's: not read through --url


def test_each_turn_finds_the_history_it_resends_in_minillm_serves_prefix_cache(capsys, minillm_url):
    """Turn k resends turn k-1's prompt and answer: the cache holds at least that prompt's full
    16-token blocks (/metrics' hits, in tokens), and the answers went back as the server's ids."""
    url, model_dir = minillm_url
    before = parse_metrics(fetch(url + "/metrics").text)
    report = bench_url(capsys, model_dir, url, "--turns", "3", "--clients", "1", "--max-tokens", "4")
    after = parse_metrics(fetch(url + "/metrics").text)
    prompts = [report["by_turn"][turn]["prompt_tokens"] for turn in "123"]
    assert prompts[0] < prompts[1] < prompts[2] and report["answers_tokenized_again"] == 0
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    assert hits >= sum(tokens // 16 * 16 for tokens in prompts[:2]) > 0
