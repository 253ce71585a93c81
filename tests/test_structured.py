"""Structured output: every answer matches its grammar, and the mask is the grammar's, exactly.

The engine runs a tiny random Llama with the real vocabulary: a model that knows no JSON, so
every valid output is the mask's doing. The schemas bound every string, number and list, so
that even a random model must finish inside max_tokens. Each output is checked by an
independent validator (jsonschema, re, the list of choices). Greedy outputs must also equal a
reference: the naive decoder (no cache) with the grammar library's own mask applied. That
reference has none of the engine's batching, paging, preemption or speculation, and none of
its bit unpacking.
"""

import json
import re

import jsonschema
import llguidance
import llguidance.numpy
import pytest
import torch
from helpers import tiny_with_real_tokenizer

from minillm.config import EngineConfig
from minillm.decoding.naive import sequence_logits
from minillm.engine import LLMEngine
from minillm.engine.llm import LLM
from minillm.sampling import SamplingParams
from minillm.serve.errors import APIError
from minillm.serve.fields import parse_structured
from minillm.structured import Grammars, StructuredOutput, unpack_bits

WORD = {"type": "string", "maxLength": 6}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMAS = [
    {"type": "boolean"},
    {"type": "null"},
    SMALL,
    {"type": "integer", "minimum": -5, "maximum": 5},
    WORD,
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {"type": "array", "items": SMALL, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"name": WORD, "age": SMALL},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"a": SMALL, "b": WORD},
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"point": {"type": "array", "items": SMALL, "minItems": 2, "maxItems": 2}},
        "required": ["point"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": SMALL, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {"anyOf": [SMALL, {"type": "boolean"}]},
    {"oneOf": [{"type": "string", "enum": ["x"]}, {"type": "null"}]},
    {"type": ["integer", "null"], "minimum": 1, "maximum": 9},
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "enum": ["p", "q"]}},
            "required": ["k"],
            "additionalProperties": False,
        },
        "maxItems": 2,
    },
    {
        "$defs": {"flag": {"type": "boolean"}},
        "type": "array",
        "items": {"$ref": "#/$defs/flag"},
        "maxItems": 3,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": WORD, "maxItems": 2}, "n": SMALL},
        "required": ["tags", "n"],
        "additionalProperties": False,
    },
    {"type": "string", "format": "date"},
]
OTHERS = [  # (spec, does the text match?)
    (StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}"), lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
    (
        StructuredOutput(choice=("yes", "no", 'naïve "quote"')),
        lambda text: text in ("yes", "no", 'naïve "quote"'),
    ),
    (StructuredOutput(grammar='start: "A" | "B" ("C")~1..3'), lambda text: re.fullmatch("A|BC{1,3}", text)),
]
PROMPTS = ["Answer in JSON.", "The quick brown fox", "1, 2, 3,", "Alice was beginning"]


@pytest.fixture(scope="module")
def model_dir(real_dir, tmp_path_factory):
    return tiny_with_real_tokenizer(tmp_path_factory.mktemp("structured-model"), real_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_num_seqs=32)


def check_json(schema: dict, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def requests(temperature: float):
    """Every spec, each behind a prompt of its own: (prompt, params, check)."""
    specs = [(StructuredOutput.of_schema(s), lambda text, s=s: check_json(s, text)) for s in SCHEMAS]
    specs += [(spec, lambda text, match=match: assert_true(match(text))) for spec, match in OTHERS]
    specs.append(
        (StructuredOutput(json_object=True), lambda text: assert_true(isinstance(json.loads(text), dict)))
    )
    return [
        (
            PROMPTS[i % len(PROMPTS)],
            SamplingParams(max_tokens=64, temperature=temperature, seed=i, structured=spec),
            check,
        )
        for i, (spec, check) in enumerate(specs)
    ]


def assert_true(value) -> None:
    assert value


def test_the_test_set_has_twenty_schemas_each_with_a_valid_and_an_invalid_text(model_dir):
    """The validator is not vacuous: every schema refuses something the grammar refuses too."""
    assert len(SCHEMAS) >= 20
    with pytest.raises(jsonschema.ValidationError):
        check_json(SCHEMAS[2], "100")
    with pytest.raises(jsonschema.ValidationError):
        check_json(SCHEMAS[11], '{"name":"Alice","age":7,"x":1}')


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_output_of_a_batch_is_valid(llm, temperature):
    batch = requests(temperature)
    outputs = llm.generate([p for p, _, _ in batch], [params for _, params, _ in batch])
    for (_, params, check), out in zip(batch, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (params.structured, completion.text)
        check(completion.text)


def naive_structured(
    model, grammars: Grammars, prompt_ids: list[int], spec, max_tokens: int, eos_token_ids: frozenset[int]
):
    """The reference: no cache, the whole sequence each step, and the mask straight from the
    library as a float bias (its own `compute_logit_bias`, not our bitmask unpacking)."""
    matcher = llguidance.LLMatcher(grammars._tokenizer, spec.llguidance_grammar(), log_level=0)
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = sequence_logits(model, ids)[-1].float()
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[
            : logits.numel()
        ]
        token = int(logits.masked_fill(allowed == 0, float("-inf")).argmax())
        assert matcher.consume_token(token)
        ids.append(token)
        if token in eos_token_ids:
            break
    return ids[len(prompt_ids) :]


@pytest.mark.parametrize(
    "switches",
    [
        {"kv_cache_bytes": 80 * 768, "block_size": 8, "max_num_seqs": 8},  # 10 blocks: preempts
        {"speculative": "ngram", "num_speculative_tokens": 3},
    ],
    ids=["preemption", "speculation"],
)
def test_greedy_structured_output_equals_the_naive_decoder_with_the_librarys_mask(model_dir, switches):
    engine_llm = LLM(model_dir, **switches)
    engine = engine_llm.engine
    batch = requests(0.0)
    outputs = engine_llm.generate([p for p, _, _ in batch], [params for _, params, _ in batch])
    if "kv_cache_bytes" in switches:
        assert engine.num_preemptions > 0, "the pool was meant to be too small for the batch"
    tokenizer, eos_token_ids = engine.tokenizer, engine.eos_token_ids
    for (prompt, params, check), out in zip(batch, outputs):
        expected = naive_structured(
            engine.model, engine.grammars(), tokenizer.encode(prompt), params.structured, 64, eos_token_ids
        )
        assert out.outputs[0].token_ids == expected, params.structured
        check(out.outputs[0].text)


def test_n_samples_each_follow_their_own_grammar_state(llm):
    schema = {"type": "array", "items": SMALL, "maxItems": 4}
    params = SamplingParams(
        max_tokens=60, temperature=1.5, seed=3, n=4, structured=StructuredOutput.of_schema(schema)
    )
    texts = [c.text for c in llm.generate(["Numbers:"], params)[0].outputs]
    for text in texts:
        check_json(schema, text)
    assert len(set(texts)) > 1, "four samples at temperature 1.5 were meant to differ"


def test_unpacked_bits_are_the_librarys_mask(model_dir, llm):
    grammars = llm.engine.grammars()
    state = grammars.start(StructuredOutput.of_schema(SCHEMAS[11]))
    bitmask = torch.from_numpy(llguidance.numpy.allocate_token_bitmask(1, grammars.vocab_size))
    llguidance.numpy.fill_next_token_bitmask(state.matcher, bitmask.numpy(), 0)
    bias = torch.frombuffer(bytearray(state.matcher.compute_logit_bias()), dtype=torch.uint8)
    assert torch.equal(unpack_bits(bitmask, grammars.vocab_size)[0], bias[: grammars.vocab_size] > 0)
    # a model's vocabulary padded past the tokens
    padded = Grammars(llm.engine.tokenizer, grammars.vocab_size + 64, llm.engine.eos_token_ids)
    logits = torch.zeros(2, padded.vocab_size)
    padded.mask_logits(logits, [padded.start(StructuredOutput(regex="[a-z]+")), None])
    assert torch.isinf(logits[0, grammars.vocab_size :]).all() and torch.isfinite(logits[0]).any()
    assert torch.isfinite(logits[1]).all(), "a row without a grammar keeps every token"


def test_a_grammar_that_cannot_compile_fails_its_request_alone_in_one_line(llm):
    with pytest.raises(ValueError, match="invalid regex") as caught:
        llm.engine.add_request("Hi", SamplingParams(structured=StructuredOutput(regex="[a-")))
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput(json="{}", regex="a")
    with pytest.raises(ValueError, match="not beams"):
        SamplingParams(beam_width=2, structured=StructuredOutput(regex="a"))
    banned = SamplingParams(min_tokens=5, structured=StructuredOutput(choice=("a",)), max_tokens=8)
    outputs = llm.generate(["Hi", "Hi"], [banned, SamplingParams(max_tokens=4)])
    assert outputs[0].outputs[0].finish_reason == "error" and "no token is left" in outputs[0].error
    assert outputs[1].outputs[0].finish_reason == "length"


def test_a_complete_grammar_allows_every_eos_token_and_only_those(llm):
    """A model that ends on either of two tokens (Qwen2.5 Instruct: <|im_end|>, <|endoftext|>)
    may end a finished grammar on either; one that names none cannot end one, and says so."""
    tokenizer = llm.engine.tokenizer
    ends = frozenset(tokenizer.special_tokens[name] for name in ("<|im_end|>", "<|endoftext|>"))
    grammars = Grammars(tokenizer, llm.engine.model.config.vocab_size, ends)
    state = grammars.start(StructuredOutput(choice=("yes",)))
    for token in tokenizer.encode("yes"):
        state.advance(token)
    logits = torch.zeros(1, grammars.vocab_size)
    grammars.mask_logits(logits, [state])
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == ends
    with pytest.raises(ValueError, match="names no EOS token"):
        Grammars(tokenizer, grammars.vocab_size, frozenset())


def test_an_engine_without_a_tokenizer_says_structured_output_needs_one(tiny_model, tiny_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_dir), model=tiny_model)
    with pytest.raises(ValueError, match="needs the checkpoint's tokenizer"):
        engine.add_request([5, 6], SamplingParams(structured=StructuredOutput(regex="a")))


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "null"}},
                }
            },
            StructuredOutput(json='{"type": "null"}'),
        ),
        ({"guided_json": '{"type": "null"}'}, StructuredOutput(json='{"type": "null"}')),
        ({"guided_regex": "a+"}, StructuredOutput(regex="a+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutput(choice=("a", "b"))),
        ({"guided_grammar": 'start: "a"'}, StructuredOutput(grammar='start: "a"')),
        ({"structured_outputs": {"choice": ["a"]}}, StructuredOutput(choice=("a",))),
    ],
)
def test_the_server_reads_openais_and_vllms_ways_of_asking(body, expected):
    assert parse_structured(body) == expected


@pytest.mark.parametrize(
    "body, message",
    [
        ({"response_format": {"type": "xml"}}, "type must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "json_schema needs"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_json": [1]}, "is an object"),
        ({"guided_choice": []}, "choice must be"),
        ({"guided_regex": 5}, "must be a non-empty string"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured output"),
        ({"structured_outputs": {"bogus": 1}}, "takes json, json_object, regex, choice, grammar"),
    ],
)
def test_bad_structured_output_requests_get_a_400_naming_the_field(body, message):
    with pytest.raises(APIError) as caught:
        parse_structured(body)
    assert caught.value.status == 400 and message in caught.value.message and caught.value.param in body
