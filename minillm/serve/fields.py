"""The request fields both endpoints share, each read and checked into what the engine takes.

`typed` reads one field of a kind or refuses it with a 400 that says what it must be; the
`parse_*` functions read the fields with a shape of their own (stop strings, logit_bias, logprobs'
two shapes, structured output's several spellings), and `parse_common` reads them all into the
keyword arguments `protocol.make_job` builds SamplingParams from. Every refusal is an `APIError`
naming its field (`errors.py`).
"""

from __future__ import annotations

import dataclasses
import json

from minillm.chat_template import template_variables
from minillm.sampling import MAX_LOGPROBS, is_real
from minillm.serve.errors import APIError, shown
from minillm.serve.limits import ServeLimits
from minillm.structured import StructuredOutput

MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
# structured output, as OpenAI asks for it (response_format) and vLLM (the others, each alone)
STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def typed(body: dict, name: str, kind, default, describe: str):
    """body[name] if it is of `kind` (None means the default), else a 400 that says what it must be."""
    value = body.get(name)
    if value is None:
        return default
    ok = (
        is_real(value)
        if kind is float
        else isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    )
    if not ok:
        raise APIError(400, f"'{name}' must be {describe}, not {shown(value)}.", name)
    return value


def parse_chat_template_kwargs(body: dict) -> dict:
    """chat_template_kwargs, as vLLM and SGLang take it: the chat template's own variables
    ({"enable_thinking": false} for Qwen3), passed to it as they are."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    try:
        return template_variables(value)
    except ValueError as err:
        raise APIError(400, f"'chat_template_kwargs' {err}.", "chat_template_kwargs") from None


def parse_stop(body: dict, limits: ServeLimits) -> list[str]:
    """At most `max_stop_strings` of at most `max_stop_chars` each: what bounds the search for
    them in every new piece of text (`responses.ChoiceText`)."""
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(
            400, f"'stop' must be a non-empty string or a list of them, not {shown(stop)}.", "stop"
        )
    if len(stops) > limits.max_stop_strings or max(map(len, stops)) > limits.max_stop_chars:
        raise APIError(
            400,
            f"'stop' takes at most {limits.max_stop_strings} strings of at most {limits.max_stop_chars} "
            f"characters each, not {len(stops)} of up to {max(map(len, stops))}.",
            "stop",
        )
    return stops


def parse_common(body: dict, default_max_tokens: int | None, limits: ServeLimits, chat: bool) -> dict:
    """The fields both endpoints share, checked; max_tokens is None when the context decides it."""
    options = typed(body, "stream_options", dict, {}, 'an object like {"include_usage": true}')
    if set(options) - {"include_usage"}:
        raise APIError(
            400,
            f"stream_options takes only include_usage, not {sorted(set(options) - {'include_usage'})}.",
            "stream_options",
        )
    stream = typed(body, "stream", bool, False, "true or false")
    if options and not stream:
        raise APIError(400, "stream_options is only allowed with stream: true.", "stream_options")
    top_k = typed(body, "top_k", int, 0, "an integer (0 or -1 turns it off)")
    max_tokens = typed(body, "max_tokens", int, default_max_tokens, "an integer >= 1")
    if body.get("max_completion_tokens") is not None:
        max_tokens = typed(body, "max_completion_tokens", int, None, "an integer >= 1")
    logprobs = parse_logprobs(body, chat)
    prompt_logprobs = typed(body, "prompt_logprobs", int, None, f"an integer in [0, {MAX_LOGPROBS}]")
    if prompt_logprobs is not None and stream:  # as vLLM: a prompt's logprobs come in one body
        raise APIError(400, "prompt_logprobs is not sent in a stream; leave out stream.", "prompt_logprobs")
    return {
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "presence_penalty": typed(body, "presence_penalty", float, 0.0, "a number in [-2, 2]"),
        "frequency_penalty": typed(body, "frequency_penalty", float, 0.0, "a number in [-2, 2]"),
        "repetition_penalty": typed(body, "repetition_penalty", float, 1.0, "a number > 0 (1 is off)"),
        "logit_bias": parse_logit_bias(body),
        "min_tokens": typed(body, "min_tokens", int, 0, "an integer >= 0"),
        "stop_token_ids": parse_stop_token_ids(body, limits),
        "max_tokens": max_tokens,
        "temperature": typed(body, "temperature", float, 1.0, "a number >= 0"),
        "top_p": typed(body, "top_p", float, 1.0, "a number in (0, 1]"),
        "top_k": 0 if top_k == -1 else top_k,
        "n": typed(body, "n", int, 1, "an integer >= 1"),
        "seed": typed(body, "seed", int, None, "an integer"),
        "ignore_eos": typed(body, "ignore_eos", bool, False, "true or false"),
        "return_token_ids": typed(body, "return_token_ids", bool, False, "true or false"),
        "stream": stream,
        "include_usage": bool(typed(options, "include_usage", bool, False, "true or false")),
        "stop": parse_stop(body, limits),
        "structured": parse_structured(body),
    }


def parse_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (keys are strings in JSON), at most MAX_LOGIT_BIAS of them."""
    bias = typed(body, "logit_bias", dict, {}, 'an object like {"50256": -100}')
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(
            400, f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens, not {len(bias)}.", "logit_bias"
        )
    pairs = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 9) or not is_real(value):
            raise APIError(
                400,
                f"'logit_bias' maps token ids to numbers, not {shown(key)}: {shown(value)}.",
                "logit_bias",
            )
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def parse_stop_token_ids(body: dict, limits: ServeLimits) -> tuple[int, ...]:
    ids = typed(body, "stop_token_ids", list, [], "a list of token ids")
    if len(ids) > limits.max_stop_strings or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise APIError(
            400,
            f"'stop_token_ids' must be at most {limits.max_stop_strings} token ids, not {shown(ids)}.",
            "stop_token_ids",
        )
    return tuple(ids)


def parse_structured(body: dict) -> StructuredOutput | None:
    """What the output must match, from whichever one field asks: OpenAI's response_format
    ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}), vLLM's
    guided_json / guided_regex / guided_choice / guided_grammar, or its structured_outputs
    object ({"json" | "regex" | "choice" | "grammar" | "json_object": ...})."""
    asked = [name for name in STRUCTURED_FIELDS if body.get(name) is not None]
    asked = [name for name in asked if not (name == "response_format" and body[name] == {"type": "text"})]
    if len(asked) > 1:
        raise APIError(400, f"Ask for one structured output, not {' and '.join(asked)}.", asked[1])
    if not asked:
        return None
    name = asked[0]
    try:
        return _response_format(body[name]) if name == "response_format" else _structured(name, body[name])
    except ValueError as err:
        raise APIError(400, f"'{name}': {err}.", name) from None


def _structured(name: str, value) -> StructuredOutput:
    """vLLM's guided_<kind>: value, or structured_outputs: {kind: value}; a schema may be JSON
    text or an object, choices come as a JSON list."""
    if name != "structured_outputs":
        value = {name.removeprefix("guided_"): value}
    elif not isinstance(value, dict) or not value:
        raise ValueError(f'give an object like {{"regex": "[0-9]+"}}, not {shown(value)}')
    takes = [f.name for f in dataclasses.fields(StructuredOutput)]
    if set(value) - set(takes):
        raise ValueError(f"takes {', '.join(takes)}, not {shown(sorted(set(value) - set(takes)))}")
    spec = dict(value)
    if "json" in spec:
        spec["json"] = _schema_text(spec["json"])
    if isinstance(spec.get("choice"), list):
        spec["choice"] = tuple(spec["choice"])
    return StructuredOutput(**spec)


def _response_format(value) -> StructuredOutput:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError('json_schema needs {"name": ..., "schema": {...}}')
        return StructuredOutput(json=_schema_text(spec["schema"]))
    raise ValueError(f'type must be "text", "json_object" or "json_schema", not {shown(kind or value)}')


def _schema_text(schema) -> str:
    """A JSON schema given as an object or as its JSON text, as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise ValueError("the schema is not valid JSON") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, not {shown(schema)}")
    return json.dumps(schema)


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """The most likely tokens to report per position, or None for no logprobs. Completions say
    `logprobs: k`; chat says `logprobs: true` and `top_logprobs: k` (OpenAI's two shapes)."""
    if not chat:
        return typed(body, "logprobs", int, None, f"an integer in [0, {MAX_LOGPROBS}]")
    wanted = typed(body, "logprobs", bool, False, "true or false")
    top = typed(body, "top_logprobs", int, None, f"an integer in [0, {MAX_LOGPROBS}]")
    if top is not None and not wanted:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    return (top or 0) if wanted else None
