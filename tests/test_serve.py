"""`minillm serve`, driven by the official `openai` client over HTTP on 127.0.0.1.

One server for the module (a free port, uvicorn in a thread, started and stopped by a fixture), on
the tiny random Llama with the real tokenizer, so text goes in and out and each test runs in a
second or two. Greedy answers must be `LLM.generate`'s token for token, streamed or not, one
client or twenty at once; a client that disconnects must get its request aborted and its blocks
freed; every bad request a 4xx with OpenAI's error body, never a 500.
"""

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch
from helpers import heard_snapshot, route, tiny_with_real_tokenizer
from serving import read_all, running_server

from minillm.cli import main
from minillm.config import EngineConfig
from minillm.engine import LLM, LLMEngine, SamplingParams
from minillm.memory.block_ledger import tier_of
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.metrics import parse_metrics
from minillm.serve.responses import ChoiceText
from minillm.structured import StructuredOutput

CONTEXT = 1024
MAX_NUM_SEQS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "KV caches hold",
    "Alice was beginning to get very tired",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Server, clients and reference share two cores: one torch thread each runs the tiny model fastest."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(real_dir, tmp_path_factory):
    """The tiny random Llama with the real tokenizer (vocabulary and chat template)."""
    return tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("serve-model"),
        real_dir,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def server(model_dir, always_guess):
    """(base URL, EngineLoop) of a server running in this process until the module ends."""
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            kv_cache_bytes=4 << 20,
            prefix_caching=True,
            max_num_seqs=MAX_NUM_SEQS,
            speculative="ngram",  # every answer must still equal LLM.generate's, which does not guess
        )
    )
    engine_loop = EngineLoop(engine)
    with running_server(engine_loop) as url:  # with the default limits
        yield url, engine_loop


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir):
    """LLM.generate in this process, on its own copy of the model: what the server must answer."""
    return LLM(model_dir)


def metrics(server) -> dict:
    with urllib.request.urlopen(server[0] + "/metrics", timeout=30) as response:
        return parse_metrics(response.read().decode())


def held_blocks(values: dict) -> int:
    return values["kv_blocks"]["private"] + values["kv_blocks"]["shared"]


def wait_until_idle(server, timeout: float = 20) -> dict:
    """/metrics once nothing runs, waits or holds a block (cached blocks are free)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        if values["num_requests_running"] == values["num_requests_waiting"] == held_blocks(values) == 0:
            return values
        assert time.monotonic() < deadline, f"the engine did not drain: {values}"
        time.sleep(0.05)


def greedy(reference, prompt, max_tokens: int, **fields) -> str:
    return reference.generate([prompt], SamplingParams(max_tokens=max_tokens, **fields))[0]


# ----------------------------------------------------------------------------- answers


def test_models_health_and_metrics_describe_the_server(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == CONTEXT
    with urllib.request.urlopen(server[0] + "/health", timeout=10) as response:
        assert response.status == 200
    values = metrics(server)
    assert (
        sum(values["kv_blocks"].values())
        == values["kv_blocks_total"]
        == server[1].engine.snapshot().num_blocks
    )
    for name in (
        "kv_cache_usage_perc",
        "kv_utilization",
        "prefix_cache_hit_rate",
        "num_requests_waiting",
        "generation_tokens_per_second",
        "generation_tokens_total",
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "spec_decode_num_accepted_tokens_per_pos_total",
        "prefix_cache_lookups_total",
    ):
        assert name in values


# ----------------------------------------------------------------------------- /v1/kv_events


class EventStreamReader:
    """A client of /v1/kv_events in a thread of its own: every message's events, handed to `apply`."""

    def __init__(self, url: str, apply):
        parts = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        self.conn.request("GET", parts.path + "?" + parts.query)
        self.response = self.conn.getresponse()
        assert self.response.status == 200, self.response.read()
        self.apply, self.messages, self.lock = apply, 0, threading.Lock()
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self) -> None:
        try:
            for line in self.response:
                if line.startswith(b"data: "):
                    with self.lock:
                        for item in json.loads(line[6:])["events"]:
                            self.apply(item)
                        self.messages += 1
        except (OSError, ValueError):  # closed by `close`
            pass

    def close(self) -> None:
        self.conn.sock.shutdown(socket.SHUT_RDWR)  # the reading thread's next read ends
        self.thread.join(timeout=10)
        self.conn.close()


def until_equal(reader: EventStreamReader, rebuilt, real, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while True:
        with reader.lock:
            if rebuilt() == real():
                return
        assert time.monotonic() < deadline, f"the stream never caught up: {rebuilt()} != {real()}"
        time.sleep(0.05)


def test_kv_events_rebuild_the_prefix_cache_a_router_would_route_by(server, client):
    """A router that keeps only the stream's BlockStored / BlockRemoved / AllBlocksCleared knows
    which block hashes are cached, per tier, as the server's prefix cache holds them."""
    known: set = set()
    client.completions.create(model="tiny", prompt=PROMPTS[0] * 3, max_tokens=4)  # cached before joining
    wait_until_idle(server)
    reader = EventStreamReader(server[0] + "/v1/kv_events", lambda item: route(known, item))
    try:
        shared = "A long shared instruction that every request starts with, " * 4
        for prompt in PROMPTS[:4]:
            client.completions.create(model="tiny", prompt=shared + prompt, max_tokens=6)
        wait_until_idle(server)

        def cached():
            state = heard_snapshot(server[1].engine)
            return {
                (key, tier_of(block, state.num_blocks, state.host_blocks)) for block, key, *_ in state.cached
            }

        until_equal(reader, lambda: set(known), cached)
        assert len(known) > 4 and reader.messages >= 2
    finally:
        reader.close()
    assert fetch_status(server[0] + "/v1/kv_events?events=everything") == 400


def test_kv_events_all_rebuild_every_block_table(server, client):
    from minillm.memory.events import event_from_json
    from minillm.memory.replay import Replayer

    replayer = Replayer()
    reader = EventStreamReader(
        server[0] + "/v1/kv_events?events=all", lambda item: replayer.apply(event_from_json(item))
    )
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=8), PROMPTS))
        wait_until_idle(server)

        def difference() -> str:
            """Where the replayed state differs from the real one (asked through the door), if anywhere."""
            try:
                server[1].engine.kv_cache.check_invariants(replayer)
            except AssertionError as err:
                return str(err)
            return "none"

        until_equal(reader, difference, lambda: "none")
    finally:
        reader.close()


def fetch_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_choice_ends_at_any_of_the_models_eos_tokens_and_shows_none(real_tokenizer):
    """Qwen2.5 Instruct ends on <|im_end|> or <|endoftext|> (Llama 3.1 Instruct on any of three):
    either ends a choice ("stop") and neither is text, nor under ignore_eos, which runs on."""
    hello = real_tokenizer.encode("Hello")
    ends = frozenset(real_tokenizer.special_tokens[name] for name in ("<|im_end|>", "<|endoftext|>"))
    for end in ends:
        choice = ChoiceText(real_tokenizer, [], ends, 10, ignore_eos=False)
        assert choice.update([*hello, end]) == "Hello" and choice.finish_reason == "stop"
        running = ChoiceText(real_tokenizer, [], ends, 10, ignore_eos=True)
        assert running.update([*hello, end, *hello]) == "HelloHello" and not running.done


def test_greedy_completions_equal_llm_generate(client, reference):
    for prompt in PROMPTS[:4]:
        expected = greedy(reference, prompt, 24)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == expected.text
        assert got.choices[0].finish_reason == ("stop" if expected.finish_reason == "eos" else "length")
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
            len(expected.prompt_token_ids),
            len(expected.token_ids),
        )
    # a batch of prompts, and a prompt given as token ids: one choice each, in order
    ids = reference.engine.tokenizer.encode(PROMPTS[5])
    got = client.completions.create(
        model="tiny", prompt=[PROMPTS[4], PROMPTS[6]], max_tokens=12, temperature=0
    )
    assert [c.text for c in got.choices] == [greedy(reference, p, 12).text for p in (PROMPTS[4], PROMPTS[6])]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert got.choices[0].text == greedy(reference, ids, 12).text


def test_completion_logprobs_are_llm_generates_in_openais_shape(client, reference):
    tokenizer = reference.engine.tokenizer
    for prompt in PROMPTS[:2]:
        expected = greedy(reference, prompt, 10, logprobs=3)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
        logprobs = got.choices[0].logprobs
        want = expected.logprobs[0]
        assert logprobs.tokens == [tokenizer.token_bytes(lp.token_id).decode(errors="replace") for lp in want]
        assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want], abs=1e-5)
        for top, lp in zip(logprobs.top_logprobs, want):
            assert len(top) == 3 and max(top.values()) == pytest.approx(lp.top[0][1], abs=1e-5)
        text = got.choices[0].text
        assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
        assert all(offset <= len(text) for offset in logprobs.text_offset)


def test_penalties_bias_min_tokens_and_stop_token_ids_equal_llm_generate(client, reference):
    fields = {
        "presence_penalty": 0.7,
        "frequency_penalty": 0.4,
        "repetition_penalty": 1.3,
        "logit_bias": {"30": 3.5},
        "min_tokens": 3,
    }
    params = {**fields, "logit_bias": ((30, 3.5),)}
    for prompt in PROMPTS[:2]:
        expected = greedy(reference, prompt, 12, **params)
        got = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=fields
        )
        assert got.choices[0].text == expected.text
    first = greedy(reference, PROMPTS[0], 12).token_ids[2]  # end where the third token comes
    expected = greedy(reference, PROMPTS[0], 12, stop_token_ids=(first,))
    got = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body={"stop_token_ids": [first]}
    )
    assert got.choices[0].text == expected.text and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == len(expected.token_ids) <= 3


def test_echo_with_logprobs_scores_the_prompt_as_an_evaluation_harness_asks(client, reference):
    """lm-evaluation-harness's local-completions: prompt = context + continuation, echo, logprobs
    1, max_tokens 1; the continuation's log-likelihood is read from the prompt's token_logprobs."""
    tokenizer = reference.engine.tokenizer
    prompt = PROMPTS[1] + " It is blue."
    prompt_ids = tokenizer.encode(prompt)
    expected = greedy(reference, prompt, 1, prompt_logprobs=1, logprobs=1)
    got = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = got.choices[0]
    assert choice.text == prompt + expected.text
    scored = choice.logprobs.token_logprobs
    assert (
        len(scored) == len(prompt_ids) + 1 and scored[0] is None and choice.logprobs.top_logprobs[0] is None
    )
    want = [lp.logprob for lp in expected.prompt_logprobs[1:]] + [expected.logprobs[0][0].logprob]
    assert scored[1:] == pytest.approx(want, abs=1e-5)
    assert choice.logprobs.text_offset[: len(prompt_ids)] == sorted(
        choice.logprobs.text_offset[: len(prompt_ids)]
    )
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None


def test_prompt_logprobs_are_llm_generates_in_vllms_shape(client, reference):
    """vLLM's prompt_logprobs: per prompt token after the first, {id: {logprob, rank,
    decoded_token}} for the token and the k most likely; a completion's in each choice, a chat's in
    the response; not in a stream (as vLLM)."""
    tokenizer = reference.engine.tokenizer
    messages = [{"role": "user", "content": PROMPTS[2]}]
    for chat, prompt in ((False, PROMPTS[1]), (True, tokenizer.encode_chat(messages))):
        if chat:
            answer = client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=2,
                temperature=0,
                extra_body={"prompt_logprobs": 2},
            )
            got = answer.model_extra["prompt_logprobs"]
        else:
            answer = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
            )
            got = answer.choices[0].model_extra["prompt_logprobs"]
        expected = greedy(reference, prompt, 2, prompt_logprobs=2).prompt_logprobs
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert got[0] is None and len(got) == len(expected) == len(ids)
        for token_id, entries, want in zip(ids[1:], got[1:], expected[1:]):
            chosen = entries[str(token_id)]
            assert chosen["logprob"] == pytest.approx(want.logprob, abs=1e-5)
            assert chosen["decoded_token"] == tokenizer.decode([token_id])
            top = [int(t) for t, _ in want.top]
            assert chosen["rank"] == top.index(token_id) + 1 if token_id in top else chosen["rank"] > 2
            assert {int(t) for t in entries} == {token_id, *top}
            assert [entries[str(t)]["rank"] for t in top] == [1, 2]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs is not sent in a stream"):
        client.completions.create(
            model="tiny", prompt=PROMPTS[0], stream=True, extra_body={"prompt_logprobs": 1}
        )
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None


def streamed_choices(chunks, chat: bool) -> dict[int, dict]:
    """Each choice's text and logprobs put back together from a stream's chunks, in the body's
    shape: completions' parallel lists joined, chat's content lists joined."""
    joined: dict[int, dict] = {}
    for c in chunks:
        for choice in c.choices:
            got = joined.setdefault(choice.index, {"text": "", "logprobs": None, "finish_reason": None})
            got["text"] += (choice.delta.content or "") if chat else choice.text
            got["finish_reason"] = choice.finish_reason or got["finish_reason"]
            if choice.logprobs is not None:
                part = choice.logprobs.model_dump()
                if got["logprobs"] is None:
                    got["logprobs"] = part
                else:
                    for key, values in part.items():
                        if isinstance(values, list):  # chat's refusal is None throughout
                            got["logprobs"][key] += values
    return joined


def whole_choices(answer, chat: bool) -> dict[int, dict]:
    return {
        c.index: {
            "text": c.message.content if chat else c.text,
            "logprobs": c.logprobs.model_dump() if c.logprobs is not None else None,
            "finish_reason": c.finish_reason,
        }
        for c in answer.choices
    }


def same_answer(a, b) -> bool:
    """Equal, log-probabilities within 1e-5 (two runs may batch a request with different others)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_answer(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same_answer, a, b))
    return a == b


def test_a_stream_carries_the_logprobs_and_echo_of_the_whole_answer(client, reference):
    """Streamed, each chunk carries the logprobs of the tokens since its choice's last chunk, and
    with echo a choice's first chunk starts with its prompt: the chunks joined equal the answer
    sent in one body, token for token, offsets counted across chunks; through n samples, a batch
    of prompts and a stop string (tokens whose text is held back go with the next chunk)."""
    full = greedy(reference, PROMPTS[2], 40, ignore_eos=True).text
    at = max(k for k in range(1, len(full) - 3) if full.find(full[k : k + 3]) == k)
    requests = [
        dict(prompt=PROMPTS[0], max_tokens=20, temperature=0, logprobs=3),
        dict(prompt=[PROMPTS[1], PROMPTS[4]], max_tokens=12, temperature=1.0, n=2, seed=3, logprobs=1),
        dict(prompt=PROMPTS[2], max_tokens=40, temperature=0, logprobs=2, stop=full[at : at + 3]),
        dict(prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=1, echo=True),
        dict(prompt=[PROMPTS[3], PROMPTS[5]], max_tokens=4, temperature=0, echo=True),
    ]
    for fields in requests:
        extra = {"ignore_eos": True}
        whole = whole_choices(client.completions.create(model="tiny", extra_body=extra, **fields), chat=False)
        chunks = read_all(client.completions.create(model="tiny", stream=True, extra_body=extra, **fields))
        assert len(chunks) > len(whole)  # it really streamed
        assert same_answer(streamed_choices(chunks, chat=False), whole)
    assert whole[0]["text"].startswith(PROMPTS[3]) and whole[1]["text"].startswith(PROMPTS[5])

    messages = [{"role": "user", "content": PROMPTS[0]}]
    for fields in (dict(temperature=0), dict(temperature=1.0, seed=5, n=2)):
        asked = dict(model="tiny", messages=messages, max_tokens=16, logprobs=True, top_logprobs=2, **fields)
        whole = whole_choices(client.chat.completions.create(**asked), chat=True)
        chunks = read_all(client.chat.completions.create(stream=True, **asked))
        assert same_answer(streamed_choices(chunks, chat=True), whole)
        assert len(whole[0]["logprobs"]["content"]) == 16


def test_chat_logprobs_and_top_logprobs(client, reference):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    got = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = got.choices[0].logprobs.content
    prompt = reference.engine.tokenizer.encode_chat(messages)
    expected = greedy(reference, prompt, 6, logprobs=2).logprobs[0]
    assert [item.logprob for item in content] == pytest.approx([lp.logprob for lp in expected], abs=1e-5)
    assert all(len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token for item in content)
    assert bytes(content[0].bytes).decode(errors="replace") == content[0].token
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="needs 'logprobs': true"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, top_logprobs=2)


def test_structured_output_through_the_openai_client_matches_its_schema(client, reference):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "A person, as JSON."}]
    answer = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    text = answer.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    spec = StructuredOutput.of_schema(schema)
    prompt = reference.engine.tokenizer.encode_chat(messages)
    assert text == greedy(reference, prompt, 48, structured=spec).outputs[0].text
    choice = client.completions.create(
        model="tiny", prompt="Pick:", max_tokens=8, extra_body={"guided_choice": ["left", "right"]}
    )
    assert choice.choices[0].text in ("left", "right") and choice.choices[0].finish_reason == "stop"


def test_usage_reports_the_prompt_tokens_the_prefix_cache_gave(server, client):
    """usage.prompt_tokens_details.cached_tokens, as OpenAI and vLLM report it (the official client
    reads it), streamed or not: the full blocks of a prompt sent again, all but its last token's."""
    prompt = "Cached tokens are counted in the usage the server reports. " * 6
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    wait_until_idle(server)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    block_size = server[1].engine.config.block_size
    cacheable = (again.usage.prompt_tokens - 1) // block_size * block_size
    assert first.usage.prompt_tokens_details.cached_tokens < cacheable
    assert again.usage.prompt_tokens_details.cached_tokens == cacheable > 0
    chunks = read_all(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cacheable


def test_chat_answers_with_the_chat_template(client, reference):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    prompt = reference.engine.tokenizer.encode_chat(messages)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == greedy(reference, prompt, 20).text
    assert got.usage.prompt_tokens == len(prompt)
    # a variable SmolLM2's template does not read changes nothing (test_serve_tokenize: one that does)
    unread = {"chat_template_kwargs": {"enable_thinking": False}}
    again = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0, extra_body=unread
    )
    assert again.choices[0].message.content == got.choices[0].message.content


def test_streamed_chunks_concatenate_to_the_same_text(client, reference):
    expected = greedy(reference, PROMPTS[1], 30).text
    chunks = read_all(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[1],
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) > 10  # it really streamed
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30

    messages = [{"role": "user", "content": "Tell me a story."}]
    expected = greedy(reference, reference.engine.tokenizer.encode_chat(messages), 30).text
    chunks = read_all(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=30, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_return_token_ids_gives_every_token_the_engine_made_in_a_body_and_a_stream(client, reference):
    """vLLM's extension: the ids beside the text, EOS included under ignore_eos (it has no text,
    so a client that tokenized the text again would lose it); a stream's chunks add up to them."""
    prompt_ids = reference.engine.tokenizer.encode(PROMPTS[3])
    expected = greedy(reference, prompt_ids, 40, ignore_eos=True).token_ids
    fields = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 40, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    body = client.completions.create(**fields, extra_body=extra)
    assert body.choices[0].model_extra["token_ids"] == expected
    chunks = read_all(client.completions.create(**fields, stream=True, extra_body=extra))
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == expected
    plain = client.completions.create(**fields, extra_body={"ignore_eos": True})
    assert "token_ids" not in plain.choices[0].model_extra  # only when asked


def test_stop_strings_cut_the_text_and_end_the_request(server, client, reference):
    full = greedy(reference, PROMPTS[2], 60, ignore_eos=True).text
    # the last 3 characters that first appear where they are (a random model repeats itself)
    at = max(k for k in range(1, len(full) - 3) if full.find(full[k : k + 3]) == k)
    stop = full[at : at + 3]
    got = client.completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=60,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    choice = got.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (full[:at], "stop", stop)
    streamed = client.completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=60,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in read_all(streamed)) == full[:at]
    wait_until_idle(server)  # the engine request was aborted at the stop, its blocks freed


def test_n_seeded_samples_equal_llm_generate(client, reference):
    expected = reference.generate([PROMPTS[3]], SamplingParams(max_tokens=16, temperature=1.0, n=3, seed=7))[
        0
    ]
    got = client.completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=1.0, n=3, seed=7
    )
    assert [c.text for c in got.choices] == [expected.decode(s) for s in expected.samples]
    streamed = client.completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=1.0, n=3, seed=7, stream=True
    )
    texts = ["", "", ""]
    for c in read_all(streamed):
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [expected.decode(s) for s in expected.samples]


# ----------------------------------------------------------------------------- many at once, and leaving


def test_twenty_concurrent_streams_finish_right_and_free_every_block(server, client, reference):
    jobs = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 8 + 3 * i) for i in range(20)]
    expected = [greedy(reference, prompt, n, ignore_eos=True).text for prompt, n in jobs]
    before = metrics(server)
    started = threading.Barrier(len(jobs), timeout=60)

    def stream(job):
        prompt, n = job
        started.wait()
        chunks = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(c.choices[0].text for c in read_all(chunks))

    with ThreadPoolExecutor(len(jobs)) as pool:
        assert list(pool.map(stream, jobs, timeout=120)) == expected
    after = wait_until_idle(server)
    assert after["kv_cache_usage_perc"] == 0.0
    finished = sum(after["request_success_total"].values()) - sum(before["request_success_total"].values())
    assert finished == len(jobs) and after["requests_aborted_total"] == before["requests_aborted_total"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == sum(n for _, n in jobs)
    engine = server[1].engine
    assert max(len(batch) for batch in engine.stats.batches) > 1  # the streams really shared steps
    kept = after["spec_decode_num_accepted_tokens_total"] - before["spec_decode_num_accepted_tokens_total"]
    assert kept > 0  # and some streams got several tokens a step, checked guesses


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server, client):
    before = metrics(server)
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert held_blocks(metrics(server)) > 0  # it is running, holding blocks
    stream.close()
    after = wait_until_idle(server)
    assert after["requests_aborted_total"] == before["requests_aborted_total"] + 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 900  # stopped early


def test_a_client_that_leaves_a_request_that_does_not_stream_aborts_it(server):
    before = metrics(server)
    host, port = server[0].removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 900, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        deadline = time.monotonic() + 20
        while held_blocks(metrics(server)) == 0:  # wait until it runs
            assert time.monotonic() < deadline
            time.sleep(0.01)
    after = wait_until_idle(server)
    assert after["requests_aborted_total"] == before["requests_aborted_total"] + 1


# ----------------------------------------------------------------------------- bad requests

BAD_COMPLETIONS = [  # (fields beside model, what the message says)
    ({"prompt": list(range(10, 10 + CONTEXT + 5))}, "context holds"),
    ({"prompt": "Hello", "max_tokens": CONTEXT}, "maximum context length"),
    ({"prompt": ""}, "empty"),
    ({"prompt": [10, 10**9]}, "vocabulary"),
    ({"prompt": "Hello", "temperature": -1}, "temperature"),
    ({"prompt": "Hello", "top_p": 2}, "top_p"),
    ({"prompt": "Hello", "n": 0}, "n must be"),
    ({"prompt": "Hello", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hello", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "Hello", "seed": -1}, "seed"),
    ({"prompt": "Hello", "stop": 5}, "stop"),
    ({"prompt": "Hello", "logprobs": "two"}, "'logprobs' must be an integer"),
    ({"prompt": "Hello", "echo": "yes"}, "'echo' must be true or false"),
    ({"prompt": "Hello", "response_format": {"type": "xml"}}, "type must be"),
    ({"prompt": "Hello", "guided_regex": "[a-"}, "invalid regex"),  # refused by the engine's compiler
    ({"prompt": "Hello", "presence_penalty": 3}, "presence_penalty must be a number in"),
    ({"prompt": "Hello", "logit_bias": {"x": 1}}, "'logit_bias' maps token ids"),
    ({"prompt": "Hello", "logit_bias": {"99999999": 1}}, "take token ids in"),
    ({"prompt": "Hello", "guided_json": {}, "guided_choice": ["a"]}, "one structured output"),
    ({"prompt": "Hello", "stream_options": {"include_usage": True}}, "only allowed with stream"),
    ({"prompt": "Hello", "n": MAX_NUM_SEQS + 1}, "max_num_seqs"),  # refused by the engine's admission
    ({"prompt": " " * 1_000_000}, "shorten its long runs of spaces"),  # tiktoken's regex gives up
    ({"prompt": {"text": "Hello"}}, "'prompt' must be"),
    ({}, "'prompt' is required"),
]


@pytest.mark.parametrize("fields, message", BAD_COMPLETIONS, ids=[m for _, m in BAD_COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_completion_requests_get_a_400_that_says_why(client, fields, message, stream):
    fields = {**fields, "stream": True} if stream and "stream_options" not in fields else fields
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/completions", body={"model": "tiny", **fields}, cast_to=object)
    assert caught.value.status_code == 400 and message in caught.value.body["message"]
    assert caught.value.body["code"] == 400 and caught.value.body["type"] == "BadRequestError"


BAD_CHATS = [
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role system, user or assistant"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "text parts",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        "does not support 'tools'",
    ),
    ({"messages": [{"role": "user", "content": "x " * CONTEXT}]}, "context"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ["enable_thinking"]},
        "'chat_template_kwargs' must be a JSON object",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"add_generation_prompt": False},
        },
        "sets add_generation_prompt, which the chat sets itself",
    ),
]


@pytest.mark.parametrize("fields, message", BAD_CHATS, ids=[m for _, m in BAD_CHATS])
def test_bad_chat_requests_get_a_400_that_says_why(client, fields, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/chat/completions", body={"model": "tiny", **fields}, cast_to=object)
    assert message in caught.value.body["message"]


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="Hello", max_tokens=4)
    assert "gpt-4" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "hi"}], stream=True
        )


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", '{"prompt": "\xff"}'.encode("latin-1"), 400),
        ("/v1/nowhere", b"{}", 404),
    ],
)
def test_malformed_bodies_and_unknown_routes_get_json_errors(server, path, body, status):
    request = urllib.request.Request(
        server[0] + path, data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == status
    error = json.loads(caught.value.read())["error"]
    assert error["code"] == status and error["message"]


def test_the_server_still_answers_after_bad_requests(server, client, reference):
    got = client.completions.create(model="tiny", prompt=PROMPTS[7], max_tokens=8, temperature=0)
    assert got.choices[0].text == greedy(reference, PROMPTS[7], 8).text
    wait_until_idle(server)


# ----------------------------------------------------------------------------- one bad request fails alone


def test_a_tiny_temperature_beside_a_stream_fails_nobody(server, client, reference):
    """temperature 1e-300 once overflowed the sampler and failed every sequence of its step, the
    stream of another client with them; now it is greedy, and that stream ends as it would alone."""
    expected = greedy(reference, PROMPTS[0], 100, ignore_eos=True).text
    chunks = iter(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[0],
            max_tokens=100,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    text = next(chunks).choices[0].text  # the stream runs; the tiny temperatures join its steps
    messages = [{"role": "user", "content": "Hi"}]
    with ThreadPoolExecutor(2) as pool:
        chat = pool.submit(
            client.chat.completions.create, model="tiny", messages=messages, max_tokens=20, temperature=1e-300
        )
        completion = pool.submit(
            client.completions.create, model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=5e-324
        )
        text += "".join(c.choices[0].text for c in read_all(chunks))
    assert text == expected
    chat_prompt = reference.engine.tokenizer.encode_chat(messages)
    assert chat.result(timeout=60).choices[0].message.content == greedy(reference, chat_prompt, 20).text
    assert completion.result(timeout=60).choices[0].text == greedy(reference, PROMPTS[1], 20).text
    wait_until_idle(server)


@pytest.fixture(scope="module")
def small_pool_server(model_dir):
    """A server whose KV pool (8 blocks) holds far less than the context (1,024 tokens)."""
    engine_loop = EngineLoop(LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_bytes=8 * 16 * 768)))
    with running_server(engine_loop) as url:  # 768 bytes of KV per token: 8 blocks of 16
        yield url, engine_loop


def test_a_chat_without_max_tokens_on_a_pool_smaller_than_the_context_ends_at_its_end(
    small_pool_server, reference
):
    """Without max_tokens a chat may run to the context, which this pool cannot hold: it is
    admitted all the same (it was refused: "may need 64 KV blocks"), and ends with "length" where
    the pool is full."""
    client = openai.OpenAI(base_url=small_pool_server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Tell me everything."}]
    prompt = reference.engine.tokenizer.encode_chat(messages)
    got = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    memory = small_pool_server[1].engine.snapshot()
    new_tokens = memory.num_blocks * memory.block_size - len(prompt)
    assert memory.num_blocks == 8 and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == new_tokens
    assert got.choices[0].message.content == greedy(reference, prompt, new_tokens, ignore_eos=True).text


# ----------------------------------------------------------------------------- the command


def test_serve_help_explains_routes_and_flags(capsys):
    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in (
        "/v1/chat/completions",
        "/metrics",
        "--prefix-caching",
        "--kv-dtype",
        "--host-cache-mb",
        "default: 127.0.0.1",
        ".[serve]",
    ):
        assert words in text


class Built(Exception):
    """Raised with the EngineConfig `minillm serve` built, instead of building its engine."""


@pytest.mark.parametrize("flags, cached", [([], True), (["--no-prefix-caching"], False)])
def test_serve_starts_with_the_prefix_cache_on_and_no_prefix_caching_turns_it_off(
    monkeypatch, capsys, model_dir, flags, cached
):
    def engine(config):
        raise Built(config)

    monkeypatch.setattr("minillm.engine.LLMEngine", engine)
    with pytest.raises(Built) as built:
        main(["serve", "--model", str(model_dir), "--port", "0", *flags])
    assert built.value.args[0].prefix_caching is cached
    assert main(["serve", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "--prefix-caching, --no-prefix-caching share the KV of full prompt blocks computed for "
        "earlier requests (default: on)" in help_text
    )


def test_serve_on_a_port_in_use_is_one_line(capsys, model_dir):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(model_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: Cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1


def test_llm_outputs_read_like_vllms(reference):
    """`out.outputs[i].text`, `.token_ids`, `.finish_reason`: the README's LLM.generate script runs
    on both."""
    out = reference.generate([PROMPTS[0]], SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=3))[0]
    assert [o.index for o in out.outputs] == [0, 1]
    assert [o.token_ids for o in out.outputs] == out.samples and out.outputs[0].text == out.text
    assert {o.finish_reason for o in out.outputs} == {"length"}


@pytest.mark.slow  # a whole benchmark run against a child server (15-45 s)
def test_bench_serve_http_reports_speed_latency_and_no_block_left(capsys, model_dir):
    assert (
        main(
            [
                "bench",
                "serve-http",
                "--json",
                "--clients",
                "4",
                "--threads",
                "1",
                "--kv-cache-mb",
                "8",
                "--model",
                str(model_dir),
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["all_rounds_match_generate"] and report["server"]["all_finished"]
    assert report["server"]["output_tokens"] == report["trace"]["output_tokens"]
    for side in ("server", "llm_generate"):
        assert (
            report[side]["output_tok_s"] > 0 and 0 < report[side]["ttft_p50_s"] <= report[side]["ttft_p99_s"]
        )
        assert 0 < report[side]["itl_p50_s"] <= report[side]["itl_p99_s"]  # one client's decode
        assert report[side]["decode_tok_s_per_client"] > 0
    assert (
        report["server_vs_generate"]
        == report["server"]["output_tok_s"] / report["llm_generate"]["output_tok_s"]
    )
    assert report["blocks_held_after_all_finished"] == 0
    left = report["disconnect"]
    assert left["clients_hung_up"] == left["requests_aborted"] == 2 and left["others_finished"]
    assert left["blocks_held_after"] == left["requests_left"] == 0


@pytest.mark.slow  # a minillm serve child (10-30 s)
def test_bench_serve_http_turns_reach_a_child_with_the_prefix_cache_on(capsys, model_dir):
    """The child runs at serve's defaults, the prefix cache on: turn 2 finds turn 1's prompt there."""
    flags = ["--turns", "2", "--clients", "2", "--max-tokens", "4", "--threads", "1", "--kv-cache-mb", "8"]
    assert main(["bench", "serve-http", "--json", *flags, "--model", str(model_dir)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "--prefix-caching" in report["serve_args"] and report["answers_tokenized_again"] == 0
    assert report["rounds"][0]["all_finished"] and report["answers"] == 4
    first_prompts = 2 * report["by_turn"]["1"]["prompt_tokens"]  # the mean of the 2 clients'
    assert report["prefix_cache"]["hits"] >= first_prompts - 2 * 16  # all but a part block each
