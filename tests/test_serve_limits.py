"""`minillm serve` against hostile or careless clients: every JSON a 4xx (a fuzz test), every limit
its status, a browser page kept out, a stream nobody reads cut off.

One server for the module, on the tiny random Llama with the real tokenizer and small limits
(`LIMITS`), keyed with an API key and its /metrics too. Each case is a row of tests/BAD_INPUTS.md.
"""

import asyncio
import http.client
import json
import select
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import ANY_JSON, tiny_with_real_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import Answer, fetch, running_server

from minillm.cli import main
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, SamplingParams
from minillm.serve.app import build_app
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.limits import ServeLimits
from minillm.serve.metrics import parse_metrics
from minillm.serve.origins import Allowed, allowed_for
from minillm.serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS

KEY = "open-sesame"
MAX_NUM_SEQS = 2
LIMITS = ServeLimits(
    max_body_kb=64,
    max_prompts_per_request=4,
    max_request_tokens=512,
    max_stop_strings=2,
    max_stop_chars=8,
    max_waiting_requests=2,
    max_connections=8,
    read_timeout=1.0,
    max_stream_backlog=8,
)
MAX_MESSAGE = 600  # characters: an error names what is wrong, it does not quote a huge value back
# (the longest, an unknown field's, lists the 30-odd fields minillm takes)


@pytest.fixture(scope="module")
def model_dir(real_dir, tmp_path_factory):
    return tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("limits-model"), real_dir, max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def server(model_dir):
    """(base URL, EngineLoop): a server with LIMITS, keyed, /metrics keyed too."""
    engine = LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_bytes=2 << 20, max_num_seqs=MAX_NUM_SEQS))
    engine_loop = EngineLoop(engine)
    with running_server(engine_loop, LIMITS, api_key=KEY, metrics="keyed") as url:
        yield url, engine_loop


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=30)


def post(server, body: bytes | str, path="/v1/completions", content_type="application/json"):
    """POST `body` with the API key, as `content_type` (none if "")."""
    headers = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": content_type} if content_type else {})
    return fetch(server[0] + path, body, headers)


def assert_error(response, status: int, *words: str) -> dict:
    """`response` is OpenAI's error body with `status`, a short message holding each of `words`."""
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == status and len(error["message"]) < MAX_MESSAGE, error
    for word in words:
        assert word in error["message"], error
    return error


def wait_until_idle(server, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while server[1].open_requests or server[1].engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not drain"
        time.sleep(0.02)
    memory = server[1].engine.snapshot()
    assert memory.num_free_blocks == memory.num_blocks


# ----------------------------------------------------------------------------- never a 500

HOSTILE_BODIES = [  # (body, the field named, what the message says)
    ('{"prompt": "hi", "temperature": 1%s}' % ("0" * 400), "temperature", "2**64 or more"),
    ('{"prompt": "hi", "max_tokens": %s}' % ("9" * 5000), "max_tokens", "2**64 or more"),
    ('{"prompt": "hi", "seed": -%s}' % ("9" * 30), "seed", "2**64 or more"),
    ('{"prompt": %s1%s}' % ("[" * 30_000, "]" * 30_000), None, "nests deeper than 32"),  # 60 KB
    ('{"prompt": %s1%s}' % ("[" * 40, "]" * 40), "prompt", "nests deeper than 32"),
    ('{"model": "\\ud800", "prompt": "hi"}', "model", "lone surrogate"),
    ('{"prompt": "hi", "\\udfff": 1}', "\ufffd", "lone surrogate"),
    ('{"prompt": "hi", "stop": [%s]}' % ", ".join(['"x"'] * 3), "stop", "at most 2 strings"),
    ('{"prompt": "hi", "stop": "longer than 8"}', "stop", "at most 8"),
    ('{"prompt": ["a", "b", "c", "d", "e"]}', "prompt", "at most 4 per request"),
    ('{"prompt": "hi", "n": 2, "max_tokens": 300}', "max_tokens", "at most 512 per request"),
    ('{"prompt": "hi", "max_tokens": "%s"}' % ("x" * 50_000), "max_tokens", "'max_tokens' must be"),
    ('{"model": "%s", "prompt": "hi"}' % ("m" * 50_000), "model", "does not exist"),
    ('{"prompt": "hi", "%s": 1}' % ("f" * 50_000), None, "Unknown field"),
    ('{"prompt": [[1, "%s"]]}' % ("t" * 50_000), "prompt", "Token 1 of the prompt is"),
]


@pytest.mark.parametrize("body, param, words", HOSTILE_BODIES, ids=[w for _, _, w in HOSTILE_BODIES])
def test_hostile_json_gets_a_4xx_that_names_the_field_without_echoing_it(server, body, param, words):
    status = 404 if words == "does not exist" else 400
    error = assert_error(post(server, body), status, words)
    if param is not None:
        assert error["param"] == param


PLAUSIBLE = {  # values near the valid ones, so the fuzz reaches past the first check
    "prompt": st.one_of(
        st.text(max_size=24),
        st.lists(st.integers(-2, 50_000), max_size=6),
        st.lists(st.text(max_size=8), max_size=5),
    ),
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot"]), "content": ANY_JSON}),
        max_size=3,
    ),
    "max_tokens": st.integers(-1, 12),
    "max_completion_tokens": st.integers(-1, 12),
    "n": st.integers(-1, 3),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 5),
    "seed": st.integers(-1, 2**64),
    "stop": st.one_of(st.text(max_size=9), st.lists(st.text(max_size=4), max_size=3)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
}
FIELDS = sorted({*COMPLETION_FIELDS, *CHAT_FIELDS, "logprobs", "echo", "tools", "surprise"})


@st.composite
def request_bodies(draw):
    """(route, body): any subset of the fields, each plausible or any JSON at all."""
    route = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body = {"model": "tiny", "max_tokens": 4}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        body[name] = draw(PLAUSIBLE.get(name, ANY_JSON) | ANY_JSON)
    return route, body


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request_bodies())
def test_no_json_body_gets_a_500(server, route_and_body):
    route, body = route_and_body
    response = post(server, json.dumps(body), route)  # ensure_ascii: a lone surrogate goes as \\udXXX
    assert response.status_code < 500, (body, response.text[:500])
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    elif body.get("stream") is True:
        assert '"code":500' not in response.text and response.text.endswith("data: [DONE]\n\n")


# ----------------------------------------------------------------------------- limits


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_past_the_limit_gets_its_413_read_by_a_client_still_sending(server, declared):
    """The issue's case: a 20 MB prompt posted by urllib, as any plain client posts. Closed with the
    body unread, the connection was reset while the client still sent it (ConnectionResetError,
    errno 104): the 413 never reached it. The server now drops the rest of the body, then answers.
    Without Content-Length (chunked), the body is refused as soon as it grows past the limit."""
    huge = json.dumps({"prompt": "word " * 4_000_000}).encode()  # 20 MB
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    request = urllib.request.Request(
        server[0] + "/v1/completions", huge if declared else iter([huge]), headers
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 413
    error = json.loads(refused.value.read())["error"]
    assert error["code"] == 413 and "64 KB" in error["message"]
    assert fetch(server[0] + "/health").status_code == 200


def test_a_request_past_the_waiting_room_gets_a_429_with_retry_after(server, client):
    room = MAX_NUM_SEQS + LIMITS.max_waiting_requests
    streams = [
        client.completions.create(
            model="tiny", prompt="Hold on", max_tokens=300, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in range(room)
    ]
    try:
        assert server[1].open_requests == room
        response = post(server, '{"prompt": "one more"}')
        assert_error(response, 429, "busy")
        assert response.headers["retry-after"] == "1"
    finally:
        for stream in streams:
            stream.close()
    wait_until_idle(server)
    assert post(server, '{"prompt": "now there is room", "max_tokens": 2}').status_code == 200


def test_a_request_that_can_no_longer_meet_the_ttft_target_gets_a_503_with_retry_after(model_dir):
    """--ttft-target with --refuse-late: one seat, held by a long request; one sent after it misses
    a 1 microsecond target (the engine has timed its steps by then) and is refused at once, a 503
    its client can retry, not served late. The first was admitted before any step was timed."""
    config = EngineConfig(
        model_dir=model_dir, max_num_seqs=1, admission="memory", ttft_target=1e-6, refuse_late=True
    )
    engine_loop = EngineLoop(LLMEngine(config))
    with running_server(engine_loop, LIMITS) as url:
        headers = {"Content-Type": "application/json"}
        with ThreadPoolExecutor(1) as pool:
            long_one = pool.submit(
                fetch,
                url + "/v1/completions",
                '{"prompt": "Hold on", "max_tokens": 500, "ignore_eos": true}',
                headers,
            )
            deadline = time.monotonic() + 30
            while engine_loop.open_requests == 0:  # the long one has reached the engine first
                assert time.monotonic() < deadline and not long_one.done(), "the first request never started"
                time.sleep(0.01)
            refused = fetch(url + "/v1/completions", '{"prompt": "too late", "max_tokens": 2}', headers)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert "TTFT target" in refused.json()["error"]["message"]
            assert long_one.result(timeout=60).status_code == 200  # the engine went on serving


def raw_connection(server) -> socket.socket:
    host, port = server[0].removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_connections_past_the_limit_get_a_503(server):
    idle = [raw_connection(server) for _ in range(LIMITS.max_connections)]
    time.sleep(0.1)  # let the server accept them all
    with raw_connection(server) as one_more:
        one_more.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        head, _, body = read_to_close(one_more).partition(b"\r\n\r\n")  # it closes after the answer
        assert head.startswith(b"HTTP/1.1 503") and b"application/json" in head
        error = json.loads(body)["error"]  # OpenAI's error body, not uvicorn's plain text
        assert error["code"] == 503 and "--max-connections" in error["message"]
    for conn in idle:
        conn.close()
    time.sleep(0.1)
    assert fetch(server[0] + "/health").status_code == 200


def read_to_close(conn: socket.socket, within_s: float = 15) -> bytes:
    """Everything the server sent before it closed (a reset after it, for bytes the server never
    read, ends the answer too), which it must do within `within_s`."""
    answer, deadline = b"", time.monotonic() + within_s
    try:
        while chunk := conn.recv(4096):
            answer += chunk
            assert time.monotonic() < deadline, f"the server sent on and did not close: {answer[-99:]!r}"
    except ConnectionResetError:
        pass
    return answer


def test_a_connection_that_dribbles_its_head_gets_a_408_at_the_read_timeout(server):
    """A byte each 0.1 s, for as long as the connection stays open: each byte restarts uvicorn's
    own idle timer, not this deadline, so the head never ends and the server must answer."""
    with raw_connection(server) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
        deadline = time.monotonic() + 15  # the read timeout is 1 s
        while not select.select([conn], [], [], 0.1)[0]:  # until the server answers
            assert time.monotonic() < deadline, "no answer to a dribbled head within 15 s"
            conn.sendall(b"X")  # an endless header name
        head, _, body = read_to_close(conn).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"application/json" in head
    assert json.loads(body)["error"]["message"] == (
        "The request head did not arrive within 1 s (--read-timeout)."
    )


def test_an_idle_connection_is_closed_at_the_read_timeout_without_an_answer(server):
    with raw_connection(server) as conn:
        assert read_to_close(conn) == b""


def test_bytes_that_are_not_http_get_a_400_in_openais_body(server):
    with raw_connection(server) as conn:
        conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        head, _, body = read_to_close(conn).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["message"].startswith("Invalid HTTP request")


def test_a_body_that_does_not_arrive_in_time_gets_a_408(server):
    with raw_connection(server) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 100\r\n\r\n{"prompt":'
        )
        answer = read_to_close(conn)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer


def test_a_stream_whose_reader_stops_is_aborted_not_buffered(server):
    """The engine goes on generating; the stream's queue stops at max_stream_backlog outputs."""
    engine_loop = server[1]
    aborted_before = engine_loop.aborted

    async def never_read():
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        submission = engine_loop.submit([[5, 6, 7]], params, "slow", backlog=8)
        await asyncio.wait_for(submission.start(), 30)
        deadline = time.monotonic() + 20
        while not submission.closed:
            assert time.monotonic() < deadline, "the stream was never cut off"
            await asyncio.sleep(0.01)
        assert submission.queue.qsize() <= 8 + 1  # + the wake-up of close
        with pytest.raises(RuntimeError, match="fell 8 outputs behind its reader"):
            async for _ in submission.outputs():
                pass

    asyncio.run(never_read())
    wait_until_idle(server)
    assert engine_loop.aborted == aborted_before + 1


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    tokenizer = server[1].engine.tokenizer
    encode = tokenizer.encode

    def slow_encode(text):
        time.sleep(1.5)
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, server, '{"prompt": "hi", "max_tokens": 1}')
        time.sleep(0.3)  # the slow request is being tokenized now
        started = time.perf_counter()
        assert fetch(server[0] + "/health").status_code == 200
        assert time.perf_counter() - started < 0.5
        assert slow.result(timeout=30).status_code == 200


# ----------------------------------------------------------------------------- browsers and keys


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_a_body_that_is_not_declared_json_is_refused(server, content_type):
    """A web page may post text/plain or a form to any address without a CORS preflight; JSON it
    may not. So a page the user visits cannot drive a server on their machine."""
    assert_error(post(server, '{"prompt": "hi"}', content_type=content_type), 415, "application/json")


def options(url: str, headers: dict):
    """A browser's CORS preflight: OPTIONS with exactly `headers`."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("OPTIONS", parts.path, headers=headers)
        response = conn.getresponse()
        return Answer(
            response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()
        )
    finally:
        conn.close()


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::2]:80"])
def test_a_request_for_another_host_is_refused_dns_rebinding(server, host):
    """A page on evil.example whose name re-resolves to 127.0.0.1 sends same-origin JSON, but its
    Host header still says evil.example: refused on every route, before the key is even asked."""
    body = '{"prompt": "hi", "max_tokens": 2}'
    headers = {"Host": host, "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    assert_error(fetch(server[0] + "/v1/completions", body, headers), 403, "--allowed-hosts")
    assert_error(fetch(server[0] + "/health", headers={"Host": host}), 403, "DNS rebinding")
    for local in ("localhost:8000", "127.0.0.1", "[::1]:9"):
        assert fetch(server[0] + "/health", headers={"Host": local}).status_code == 200


def test_another_sites_page_is_refused_and_its_preflight_too(server):
    url = server[0] + "/v1/completions"
    body = '{"prompt": "hi", "max_tokens": 2}'
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example"):
        assert_error(fetch(url, body, headers | {"Origin": origin}), 403, "--allowed-origins")
        preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        assert_error(options(url, preflight), 403, "Origin")
    assert fetch(url, body, headers | {"Origin": "http://localhost:3000"}).status_code == 200


def test_allowed_hosts_and_origins_widen_the_check(model_dir):
    allowed = allowed_for("127.0.0.1", "my.box", "https://app.example")
    assert allowed_for("0.0.0.0").hosts is None  # every address: names this server cannot know
    assert allowed_for("0.0.0.0", "my.box").hosts == {"my.box", "localhost", "127.0.0.1", "::1"}
    assert allowed_for("127.0.0.1", "*", "*") == Allowed(None, None)
    engine_loop = EngineLoop(LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_bytes=2 << 20)))
    with running_server(engine_loop, allowed=allowed) as url:
        assert (
            fetch(
                url + "/health", headers={"Host": "MY.BOX:8000", "Origin": "https://app.example"}
            ).status_code
            == 200
        )
        assert_error(fetch(url + "/health", headers={"Host": "other.box"}), 403, "other.box")
        assert_error(
            fetch(url + "/health", headers={"Origin": "http://app.example"}), 403
        )  # http is not https


def test_v1_routes_need_the_api_key_and_health_does_not(server, client):
    for key in ("", "Bearer wrong", f"Bearer {KEY}x"):
        headers = {"Content-Type": "application/json"} | ({"Authorization": key} if key else {})
        response = fetch(server[0] + "/v1/completions", '{"prompt": "hi"}', headers)
        assert_error(response, 401, "Authorization: Bearer")
    assert_error(fetch(server[0] + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0, timeout=30).models.list()
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    assert fetch(server[0] + "/health").status_code == 200


def test_metrics_can_be_keyed_or_turned_off(server):
    assert_error(fetch(server[0] + "/metrics"), 401)
    keyed = fetch(server[0] + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert "prefix_cache_hits_total" in parse_metrics(keyed.text)
    routes = {route.path for route in build_app(server[1], "tiny", metrics="off").routes}
    assert "/health" in routes and "/metrics" not in routes


def test_serve_flags_that_cannot_work_are_one_line(capsys, model_dir):
    assert main(["serve", "--port", "70000"]) == 2
    assert "argument --port: 70000 is not a port number; give 0 to 65535" in capsys.readouterr().err
    assert main(["serve", "--model", str(model_dir), "--port", "0", "--metrics", "keyed"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --metrics keyed needs the key: give --api-key too.\n"
    for empty in ("", "  ", "\n"):  # `--api-key "$KEY"` with KEY unset must not serve without a key
        assert main(["serve", "--model", str(model_dir), "--port", "0", "--api-key", empty]) == 2
        assert "--api-key is empty" in capsys.readouterr().err


def test_serve_help_lists_every_limit(capsys):
    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, default, _ in ServeLimits.flags():
        assert "--" + name.replace("_", "-") in text
    for words in ("--api-key", "--metrics {open,keyed,off}", "(default: 4096)"):
        assert words in text
