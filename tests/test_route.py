"""`minillm route`: a KV-aware router over two in-process engines (the tiny random Llama with the
real tokenizer), itself in-process on a free port, driven over HTTP.

A prompt must land where its prefix is cached, and the blocks the router predicted must be the ones
the engine reports (usage's cached_tokens); answers through the router must be the engine's own,
streamed or not; an engine that is gone, or fails before answering, must cost a client nothing, and
one that fails midway must end the stream with an error event and [DONE], within a deadline; a
router restarted must know what the engines cache from its feeds' first messages; a feed that lags
must turn the policy to round-robin, and /metrics must count it. Stub engines (a FastAPI app, a
socket that hangs up) play the failures.
"""

import asyncio
import json
import socket
import threading
import time
from contextlib import ExitStack, contextmanager

import openai
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from helpers import tiny_with_real_tokenizer
from serving import fetch, read_all, running_app, running_server

from minillm.cli import main
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.route.app import Router, build_app
from minillm.route.index import BlockIndex
from minillm.route.policy import cacheable
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.metrics import parse_metrics
from minillm.tokenizer import Tokenizer

pytestmark = pytest.mark.server  # it starts HTTP servers, as the test_serve* modules do

SHARED = "You are the router's test. Every request in this test begins with this long instruction. "
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(real_dir, tmp_path_factory):
    return tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("route-model"), real_dir, max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


def engine_loop(model_dir) -> EngineLoop:
    config = EngineConfig(model_dir=model_dir, kv_cache_bytes=4 << 20, prefix_caching=True, max_num_seqs=8)
    return EngineLoop(LLMEngine(config))


@pytest.fixture(scope="module")
def engines(model_dir):
    """Two engine servers for the module: their base URLs."""
    with running_server(engine_loop(model_dir)) as first, running_server(engine_loop(model_dir)) as second:
        yield [first, second]


def served(app: FastAPI):
    """Any ASGI app (a router, a stub engine) on a free port in a thread: its base URL."""
    return running_app(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))


@contextmanager
def running_router(urls, tokenizer, wait_for_feeds=True, **options):
    """(URL, Router) of a router over `urls`; by default once every feed has joined."""
    router = Router(urls, tokenizer, **options)
    with served(build_app(router)) as url:
        if wait_for_feeds:
            wait_until(lambda: not any(metrics(url)["feed_lagging"].values()), "the feeds did not join")
        yield url, router


def wait_until(condition, what: str, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def metrics(url: str) -> dict:
    values = parse_metrics(fetch(url + "/metrics", timeout=10).text)
    return {name.removeprefix("minillm_router:"): value for name, value in values.items()}


def complete(url: str, prompt, max_tokens: int = 4, **fields):
    """POST /v1/completions, greedy: the answer (its headers say which engine gave it)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    answer = fetch(url + "/v1/completions", json.dumps(body), JSON, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer


def chat(url: str, messages, max_tokens: int = 4):
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    answer = fetch(url + "/v1/chat/completions", json.dumps(body), JSON, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer


def heard(router: Router, engine: str, ids) -> bool:
    """Whether the router's index knows `engine` holds every full block of `ids` a hit can cover."""
    size = router.index.block_size
    return bool(size) and router.index.overlap(cacheable(ids)).get(engine, 0) == len(cacheable(ids)) // size


# ----------------------------------------------------------------------------- where requests go


def test_a_shared_prefix_and_chat_turns_land_where_they_are_cached(engines, tokenizer):
    with running_router(engines, tokenizer) as (url, router):
        prompt = SHARED * 3 + "First question."
        first = complete(url, prompt)
        holder = first.headers["x-minillm-engine"]
        ids = tokenizer.encode_prompt(prompt)
        wait_until(lambda: heard(router, holder, ids), "the holder's events never arrived")
        for question in ("Second question.", "Third question, longer than the others."):
            again = complete(url, SHARED * 3 + question)
            assert again.headers["x-minillm-engine"] == holder
        values = metrics(url)
        assert values["predicted_hit_blocks_total"][holder] == values["actual_hit_blocks_total"][holder] > 0

        messages = [{"role": "user", "content": "Tell me about the prefix caches of many engines. " * 3}]
        turn = chat(url, messages, max_tokens=8)
        talker = turn.headers["x-minillm-engine"]
        for question in ("And then?", "Why so?"):
            wait_until(
                lambda: heard(router, talker, tokenizer.encode_chat(messages)), "no events of the turn"
            )
            reply = json.loads(turn.text)["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
            turn = chat(url, messages, max_tokens=8)
            assert turn.headers["x-minillm-engine"] == talker
        values = metrics(url)
        for engine in engines:
            assert values["predicted_hit_blocks_total"][engine] == values["actual_hit_blocks_total"][engine]


def test_round_robin_alternates(engines, tokenizer):
    with running_router(engines, tokenizer, policy="round-robin") as (url, _):
        prompt = SHARED * 3 + "Round and round."
        sent_to = [complete(url, prompt).headers["x-minillm-engine"] for _ in range(4)]
        assert sent_to == [engines[0], engines[1], engines[0], engines[1]]
        assert metrics(url)["requests_routed_total"] == {engines[0]: 2, engines[1]: 2}


def test_answers_through_the_router_are_the_engines_own(engines, tokenizer):
    direct = openai.OpenAI(base_url=engines[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
    with running_router(engines, tokenizer) as (url, _):
        routed = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        prompt = "The router passes every answer on as it comes"
        want = direct.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        got = routed.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        chunks = read_all(
            routed.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=20,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert (
            len(chunks) > 5
            and "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
        )
        assert chunks[-1].usage.completion_tokens == 20
        messages = [{"role": "user", "content": "Say something."}]
        want = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        got = routed.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content
        chunks = read_all(
            routed.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.choices[0].message.content
        assert routed.models.list().data[0].id == "tiny"
        assert fetch(url + "/health").status_code == 200


# ----------------------------------------------------------------------------- failures


def test_requests_to_a_stopped_engine_go_to_the_other(model_dir, engines, tokenizer):
    with ExitStack() as doomed:
        loop = engine_loop(model_dir)
        gone = doomed.enter_context(running_server(loop))
        with running_router([gone, engines[1]], tokenizer) as (url, _):
            loop.drain(0)  # as SIGTERM stops `minillm serve`: the engine, its event streams, then HTTP
            doomed.close()
            for i in range(4):
                answer = complete(url, f"{SHARED} Request {i} after the first engine stopped.")
                assert answer.headers["x-minillm-engine"] == engines[1]
            wait_until(lambda: metrics(url)["engine_up"][gone] == 0, "the stopped engine stayed up")
            assert metrics(url)["failed_total"] == 0
            assert fetch(url + "/health").status_code == 200


@contextmanager
def hanging_up():
    """A socket server that reads each request and closes the connection without a byte of answer."""
    sock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(1)
            try:
                conn.recv(65536)
            except OSError:
                pass
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=10)
        sock.close()


def test_a_request_whose_engine_hangs_up_before_answering_is_retried_elsewhere(engines, tokenizer):
    with (
        hanging_up() as broken,
        running_router([broken, engines[0]], tokenizer, wait_for_feeds=False) as (
            url,
            _,
        ),
    ):
        for i in range(2):  # round-robin while a feed lags: one of the two goes to the broken engine first
            answer = complete(url, f"Retried {i}")
            assert answer.headers["x-minillm-engine"] == engines[0]
        values = metrics(url)
        assert values["retries_total"] >= 1 and values["failed_total"] == 0
        assert values["engine_up"] == {broken: 0, engines[0]: 1}


def stub_engine(stream_behaviour: str) -> FastAPI:
    """An engine that streams one chunk and then breaks ("hang up": the connection drops; "stall":
    nothing more comes), answers other requests with a fixed body, and whose event feed joins and
    then says nothing."""
    app = FastAPI()
    piece = 'data: {"choices": [{"index": 0, "text": "Hel", "finish_reason": null}]}\n\n'

    async def broken_stream():
        yield piece
        if stream_behaviour == "stall":
            await asyncio.sleep(60)
        raise RuntimeError("the engine died")

    async def silent_feed():
        yield 'data: {"step": 0, "events": [{"type": "AllBlocksCleared"}]}\n\n'
        while True:
            await asyncio.sleep(0.2)
            yield ": idle\n\n"

    @app.post("/v1/completions")
    async def completions(body: dict):
        if body.get("stream"):
            return StreamingResponse(broken_stream(), media_type="text/event-stream")
        return {"choices": [{"index": 0, "text": "stub", "finish_reason": "length"}], "usage": {}}

    @app.get("/v1/kv_events")
    async def kv_events():
        return StreamingResponse(silent_feed(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {}

    return app


@pytest.mark.parametrize("behaviour", ["hang up", "stall"])
def test_a_stream_broken_midway_ends_with_an_error_event_and_done(tokenizer, behaviour):
    with served(stub_engine(behaviour)) as stub:
        with running_router([stub], tokenizer, read_timeout=1.0) as (url, _):
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "stream": True}
            answer = fetch(url + "/v1/completions", json.dumps(body), JSON, timeout=10)
            events = [line[6:] for line in answer.text.split("\n\n") if line.startswith("data: ")]
            assert json.loads(events[0])["choices"][0]["text"] == "Hel"
            assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"
            assert metrics(url)["failed_total"] == 1


# ----------------------------------------------------------------------------- the feeds


def test_a_restarted_router_predicts_the_same_overlaps(engines, tokenizer):
    prompts = [tokenizer.encode_prompt(SHARED * 2 + f"Restart {i}: " + "words " * (10 * i)) for i in range(4)]
    with running_router(engines, tokenizer) as (url, router):
        for ids in prompts:
            engine = complete(url, ids).headers["x-minillm-engine"]
            wait_until(lambda: heard(router, engine, ids), "the engine's events never arrived")
        before = [router.index.overlap(cacheable(ids)) for ids in prompts]
    assert any(before)
    with running_router(engines, tokenizer) as (_, restarted):
        assert [restarted.index.overlap(cacheable(ids)) for ids in prompts] == before


def test_a_disconnected_feed_turns_routing_to_round_robin(model_dir, engines, tokenizer):
    """An engine without /v1/kv_events (--metrics off): its feed never connects, so it lags."""
    with running_server(engine_loop(model_dir), metrics="off") as unheard:
        with running_router([engines[0], unheard], tokenizer, wait_for_feeds=False) as (url, _):
            prompt = SHARED * 3 + "Fallback."
            sent_to = [complete(url, prompt).headers["x-minillm-engine"] for _ in range(4)]
            assert sent_to == [engines[0], unheard, engines[0], unheard]  # the cache would say engines[0]
            values = metrics(url)
            assert values["fallbacks_total"] == 4 and values["feed_lagging"][unheard] == 1


def test_a_feed_silent_after_a_request_lags(engines, tokenizer):
    """An engine whose feed joined, took a request that computes new blocks, and says nothing of it:
    after lag_s the router stops trusting the index."""
    complete(engines[1], SHARED * 2)  # a block stored: the router learns the block size from its events
    with served(stub_engine("stall")) as stub:
        with running_router([stub, engines[1]], tokenizer, lag_s=0.3) as (url, router):
            wait_until(lambda: router.index.block_size is not None, "no block size heard")
            prompt = "Nothing in any cache yet: a prompt of several blocks for the silent engine. " * 3
            assert complete(url, prompt).headers["x-minillm-engine"] == stub  # a tie: the first in turn
            assert metrics(url)["fallbacks_total"] == 0
            time.sleep(0.5)
            assert metrics(url)["feed_lagging"][stub] == 1
            complete(url, prompt)
            assert metrics(url)["fallbacks_total"] == 1


# ----------------------------------------------------------------------------- the command


def test_route_help_and_bad_flags(capsys):
    assert main(["route", "--help"]) == 0
    assert "--engine URL" in capsys.readouterr().out
    for argv, says in [
        (["route"], "needs engines"),
        (["route", "--engine", "localhost:8001"], "not an engine's base URL"),
        (["route", "--engine", "http://127.0.0.1:80x"], "not an engine's base URL"),
        (["route", "--engine", "http://127.0.0.1:8001/v1"], "not an engine's base URL"),
        (["route", "--engine", "http://a:1", "--policy", "best"], "invalid choice"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err


# ----------------------------------------------------------------------------- the index alone


def stored(block_hash, parent, tokens, medium="GPU"):
    return {
        "type": "BlockStored",
        "block_hashes": [block_hash],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 2,
        "medium": medium,
    }


def test_the_index_keys_blocks_by_content_not_by_each_engines_hash():
    index = BlockIndex()
    index.apply("a", [stored(11, None, [1, 2]), stored(12, 11, [3, 4])])
    index.apply("b", [stored(91, None, [1, 2])])  # the same first block under another process's hash
    assert index.overlap([1, 2, 3, 4, 5]) == {"a": 2, "b": 1}
    assert index.overlap([1, 2, 9, 9]) == {"a": 1, "b": 1} and index.overlap([7, 7]) == {}
    # a spill to host: removed from the device, stored on the host; still held
    index.apply(
        "a", [{"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}, stored(12, 11, [3, 4], "CPU")]
    )
    assert index.overlap([1, 2, 3, 4]) == {"a": 2, "b": 1}
    index.apply("a", [{"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}])
    assert index.overlap([1, 2, 3, 4]) == {"b": 1}  # a chain is held only from its first block on
    index.apply("b", [{"type": "AllBlocksCleared"}])
    index.drop("a")
    assert index.overlap([1, 2, 3, 4]) == {} and index.root.children == {}
