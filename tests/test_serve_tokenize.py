"""The server's tokenizer routes (vLLM's /tokenize, /detokenize, /tokenizer_info), as an evaluation
harness uses them: the ids they give are the ones /v1/completions scores, the special tokens a
client looks up are found, and every bad body is a 400 that names its field, never a 500.

One server for the module, on the tiny random Llama with the real tokenizer, small limits
(`LIMITS`) and an API key. Each refusal is a row of tests/BAD_INPUTS.md.
"""

import http.client
import json
import time
import urllib.parse

import jinja2
import pytest
from fastapi.testclient import TestClient
from helpers import ANY_JSON, set_chat_template, tiny_gpt2_tokenizer_json, tiny_with_real_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import fetch, running_server
from upstream import upstream_file

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.serve.app import build_app
from minillm.serve.endpoints import parse_chat
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.limits import ServeLimits
from minillm.serve.tokenize import tokenize
from minillm.tokenizer import Tokenizer

KEY = "open-sesame"
CONTEXT = 1024
LIMITS = ServeLimits(max_body_kb=64, max_request_tokens=512)
TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank, 1234 times."


@pytest.fixture(scope="module")
def server(real_dir, tmp_path_factory):
    model_dir = tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("tokenize-model"), real_dir, max_position_embeddings=CONTEXT
    )
    engine = LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_bytes=2 << 20))
    with running_server(EngineLoop(engine), LIMITS, api_key=KEY) as url:
        yield url


def call(server, path: str, body=None, key: str | None = KEY):
    """GET `path` (POST `body` as JSON if given) with the API key; (status, JSON answer)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    response = fetch(server + path, None if body is None else json.dumps(body), headers)
    return response.status_code, response.json()


def tokens_of(server, **body) -> list[int]:
    status, answer = call(server, "/tokenize", body)
    assert status == 200, answer
    return answer["tokens"]


# ----------------------------------------------------------------------------- what they answer


def test_tokenize_gives_the_ids_a_completion_of_the_text_scores(server, real_tokenizer):
    status, answer = call(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    ids = real_tokenizer.encode(TEXT)
    assert status == 200 and answer == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids}
    assert tokens_of(server, prompt=TEXT, add_special_tokens=True) == ids  # SmolLM2 adds no BOS or EOS
    status, completion = call(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 1, "temperature": 0})
    assert completion["usage"]["prompt_tokens"] == len(ids)


def test_detokenize_gives_the_text_back(server):
    status, answer = call(server, "/detokenize", {"tokens": tokens_of(server, prompt=TEXT)})
    assert status == 200 and answer == {"prompt": TEXT}


def test_tokenizer_info_names_the_special_tokens_tokenize_finds(server, real_tokenizer):
    """lm-eval's RemoteTokenizer takes eos_token_id = tokenize(eos_token)[0], likewise the BOS id
    (the token a text scored from its start is conditioned on): both must come back as one token."""
    status, info = call(server, "/tokenizer_info")
    assert status == 200
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|im_end|>", "<|im_start|>", None)
    assert info["model_max_length"] == CONTEXT and info["chat_template"] == real_tokenizer.chat_template
    assert tokens_of(server, prompt=info["eos_token"], add_special_tokens=False) == [
        real_tokenizer.eos_token_id
    ]
    assert tokens_of(server, prompt=info["bos_token"], add_special_tokens=False) == [1]


def test_special_token_names_are_plain_text_to_completions_only(server, real_tokenizer):
    """The one documented difference: /tokenize reads "<|im_end|>" as the token (vLLM's reading), a
    completion's prompt string as seven tokens of text (no forged control tokens)."""
    assert tokens_of(server, prompt="<|im_end|>") == [2]
    status, completion = call(server, "/v1/completions", {"prompt": "<|im_end|>", "max_tokens": 1})
    assert completion["usage"]["prompt_tokens"] == len(real_tokenizer.encode("<|im_end|>")) == 7


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_chat_tokenizes_as_its_template_rendered_by_the_client(
    server, real_tokenizer, add_generation_prompt
):
    """/tokenize with messages, the template rendered by the client from /tokenizer_info (as
    RemoteTokenizer.apply_chat_template does) and tokenized, and the server's own chat: one list."""
    messages = [
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "Memory."},
    ]
    ids = tokens_of(server, messages=messages, add_generation_prompt=add_generation_prompt)
    template = jinja2.Environment().from_string(call(server, "/tokenizer_info")[1]["chat_template"])
    rendered = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
    assert (
        ids
        == tokens_of(server, prompt=rendered)
        == real_tokenizer.encode_chat(messages, add_generation_prompt)
    )


def test_chat_template_kwargs_reach_the_template(real_dir, upstream, tmp_path):
    """Qwen3's template, over SmolLM2's vocabulary (which has its <|im_start|> and <|im_end|>): with
    and without {"enable_thinking": false}, /tokenize and the chat route give transformers' ids."""
    qwen3 = upstream_file("templates/Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    tokenizer = Tokenizer(set_chat_template(tiny_with_real_tokenizer(tmp_path, real_dir), qwen3))
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    prompts = []
    for variables in ({}, {"enable_thinking": False}):
        body = {"messages": messages, "chat_template_kwargs": variables}
        expected = upstream.apply_chat_template(
            messages, chat_template=qwen3, add_generation_prompt=True, return_dict=False, **variables
        )
        assert tokenize(body, tokenizer, "tiny", CONTEXT, LIMITS)["tokens"] == expected
        chat = parse_chat({**body, "max_tokens": 1}, tokenizer, "tiny", CONTEXT, tokenizer.vocab_size, LIMITS)
        assert chat.prompts == [expected]
        prompts.append(expected)
    assert prompts[0] != prompts[1]  # the variable changed what the template wrote


def test_keep_alive_requests_do_not_wait_for_delayed_acks(server):
    """An evaluation harness sends two /tokenize requests per scored choice on one connection. With
    Nagle's algorithm on, each answer's body waited ~40 ms for the client's delayed ACK."""
    parts = urllib.parse.urlsplit(server)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    started = time.monotonic()
    for _ in range(20):
        connection.request("POST", "/tokenize", body=b'{"prompt": "hi"}', headers=headers)
        assert connection.getresponse().read()
    connection.close()
    assert time.monotonic() - started < 0.5  # 20 x 40 ms = 0.8 s at the least with the delay


# ----------------------------------------------------------------------------- what they refuse

BAD_BODIES = [  # (route, body, status, the field named, what the message says)
    ("/tokenize", {}, 400, "prompt", "'prompt' is required"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "'prompt' must be a string, not 5"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens", "true or false"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": True}, 400, "return_token_strs", "Unknown field"),
    ("/tokenize", {"prompt": "word " * 600}, 400, "prompt", "at most 512 per request"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/tokenize", {"messages": []}, 400, "messages", "non-empty list"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "role system, user"),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"},
        400,
        "prompt",
        "Unknown",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": 1},
        400,
        "add_generation_prompt",
        "true or false",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "no thinking"},
        400,
        "chat_template_kwargs",
        "'chat_template_kwargs' must be a JSON object",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
        "which the chat sets itself",
    ),
    ("/detokenize", {}, 400, "tokens", "'tokens' must be a list of token ids, not None"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "must be a list of token ids"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens", "must be a list of token ids"),
    ("/detokenize", {"tokens": [1, 2.0]}, 400, "tokens", "must be a list of token ids"),
    (
        "/detokenize",
        {"tokens": [1, 49152]},
        400,
        "tokens",
        "Token 1 is 49152; token ids are integers in [0, 49152)",
    ),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "Token 0 is -1"),
    ("/detokenize", {"tokens": [1] * 513}, 400, "tokens", "at most 512 per request"),
    ("/detokenize", {"tokens": [10**30]}, 400, "tokens", "2**64 or more"),
]


@pytest.mark.parametrize("route, body, status, param, words", BAD_BODIES, ids=[b[4] for b in BAD_BODIES])
def test_bad_tokenizer_requests_get_an_error_that_names_the_field(server, route, body, status, param, words):
    answered, answer = call(server, route, body)
    error = answer["error"]
    assert answered == error["code"] == status and error["param"] == param and words in error["message"], (
        error
    )


def test_tokenizer_routes_need_the_api_key(server):
    assert call(server, "/tokenizer_info", key=None)[0] == 401
    assert call(server, "/tokenize", {"prompt": "hi"}, key="wrong")[0] == 401
    assert call(server, "/detokenize", {"tokens": [1]}, key=None)[0] == 401


def test_a_model_without_a_tokenizer_says_to_send_token_ids(tiny_dir, tiny_model):
    engine = LLMEngine(EngineConfig(model_dir=tiny_dir, kv_cache_bytes=1 << 20), model=tiny_model)
    client = TestClient(
        build_app(EngineLoop(engine), "tiny", start_engine=False), base_url="http://localhost"
    )
    for response in (client.get("/tokenizer_info"), client.post("/tokenize", json={"prompt": "hi"})):
        assert (
            response.status_code in (400, 404)
            and "send prompts as token ids" in response.json()["error"]["message"]
        )


def with_bos(tokenizer_json: dict) -> dict:
    """The tokenizer with a <|begin|> token its post-processor puts before every text (Llama 3's way)."""
    begin = {**tokenizer_json["added_tokens"][0], "id": 260, "content": "<|begin|>"}
    bos = {"SpecialToken": {"id": "<|begin|>", "type_id": 0}}
    template = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin|>": {"id": "<|begin|>", "ids": [260], "tokens": ["<|begin|>"]}},
    }
    return {
        **tokenizer_json,
        "added_tokens": [*tokenizer_json["added_tokens"], begin],
        "post_processor": template,
    }


def test_add_special_tokens_puts_the_post_processors_tokens_around_the_prompt(tiny_dir, tiny_model, tmp_path):
    """As vLLM's /tokenize does with `tokenizers`: the BOS in front unless the body says false."""
    from tokenizers import Tokenizer as HFTokenizer

    tokenizer_json = with_bos(tiny_gpt2_tokenizer_json())
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = EngineConfig(model_dir=tiny_dir, kv_cache_bytes=1 << 20)
    engine = LLMEngine(config, model=tiny_model, tokenizer=Tokenizer(tmp_path))
    client = TestClient(
        build_app(EngineLoop(engine), "tiny", start_engine=False), base_url="http://localhost"
    )
    theirs = HFTokenizer.from_str(json.dumps(tokenizer_json))
    for add_special_tokens in (True, False):
        body = {"prompt": "the theme <|end|>", "add_special_tokens": add_special_tokens}
        expected = theirs.encode(body["prompt"], add_special_tokens=add_special_tokens).ids
        assert client.post("/tokenize", json=body).json()["tokens"] == expected
        assert (expected[0] == 260) == add_special_tokens
    assert client.get("/tokenizer_info").json()["add_bos_token"] is True


TOKENIZER_BODIES = st.tuples(
    st.sampled_from(["/tokenize", "/detokenize"]),
    st.dictionaries(
        st.sampled_from(
            [
                "prompt",
                "messages",
                "tokens",
                "add_special_tokens",
                "add_generation_prompt",
                "chat_template_kwargs",
                "model",
            ]
        ),
        st.lists(st.integers(-2, 50_000), max_size=4) | st.text(max_size=12) | ANY_JSON,
        max_size=3,
    ),
)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(TOKENIZER_BODIES)
def test_no_tokenizer_body_gets_a_500(server, route_and_body):
    route, body = route_and_body
    status, answer = call(server, route, body)
    assert status < 500, (body, answer)
