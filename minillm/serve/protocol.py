"""The OpenAI API as vLLM serves it, the way in: request bodies checked and turned into Jobs.

Pure functions and small classes, no web framework: the checks both endpoints share turn a JSON
body into a `Job` (prompts as token ids, `SamplingParams`, stop strings, stream or not), or raise
`APIError` with the status and the message the client reads (OpenAI's error body). Each endpoint's
own body, a completion's prompt or a chat's messages, is read in `endpoints.py` (`parse_completion`,
`parse_chat`); the way out, response bodies and stream chunks, is `responses.py`.

Parameters and where they go:
    max_tokens (max_completion_tokens)  SamplingParams.max_tokens; completions default to 16 (the
                                        OpenAI default), chat to None: the rest of the context
                                        (vLLM's), or of the KV pool when that holds less
    temperature, top_p, seed, n         SamplingParams fields of the same names; temperature
                                        defaults to 1 (OpenAI's), 0 is greedy
    top_k, ignore_eos                   vLLM's extra parameters, the SamplingParams fields
    stop                                a string or a list; found in the text here, the engine
                                        request aborted once every choice has stopped
    stream, stream_options              server-sent events; include_usage adds a last chunk of usage
    logprobs (completions: 0-20)        SamplingParams.logprobs: each new token's log-probability and
    logprobs + top_logprobs (chat)      the k most likely; a stream's chunk carries its new tokens'
    echo (completions)                  the prompt first: its text, and with logprobs its tokens'
                                        (SamplingParams.prompt_logprobs); a stream's first chunk
    prompt_logprobs                     vLLM's: each prompt token's {id: {logprob, rank,
                                        decoded_token}} and the k most likely's (not in a stream)
    presence_penalty, frequency_penalty SamplingParams fields of the same names (OpenAI's); logit_bias
    logit_bias                          is {"token id": bias}, as OpenAI sends it
    repetition_penalty, min_tokens,     vLLM's extra parameters, the SamplingParams fields
    stop_token_ids
    response_format, guided_json,       SamplingParams.structured (`parse_structured`): the output
    guided_regex, guided_choice,        must match a JSON schema, any JSON object, a regex, one of
    guided_grammar, structured_outputs  the strings, a Lark grammar (`minillm/structured.py`)
Anything else that changes the output (tools, functions, ...) gets a 400 naming it;
an unknown field a 400 that lists the ones minillm takes.

Whatever JSON a client sends gets a 4xx, never a 500: `parse_json` refuses, before any check reads
the body, nesting deeper than MAX_DEPTH, integers of 2**64 or more (a 401-digit temperature would
overflow float(); one of 5,000 is not even read) and lone surrogates ("\\ud800"
is valid JSON but no UTF-8 can carry it back in an answer). A message names the field and quotes
its value cut short (`shown`), so a 20 MB prompt is not sent back. The sizes a request may ask for
(prompts, tokens, stop strings) are `ServeLimits`' (`limits.py`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import reprlib
import time
import uuid
from dataclasses import dataclass, field

from minillm.config import prompt_problem
from minillm.sampling import MAX_LOGPROBS, SamplingParams, is_real
from minillm.serve.limits import ServeLimits
from minillm.structured import StructuredOutput

MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
MAX_DEPTH = 32  # a chat is 5 levels deep (body, messages, message, content parts, part)
INTEGER_BOUND = 2**64  # no field takes more (a seed is below 2**64); a bigger one is refused unread
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """A request the server refuses: HTTP `status`, and the body of OpenAI's error shape."""

    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        408: "RequestTimeoutError",
        413: "RequestTooLargeError",
        415: "UnsupportedMediaTypeError",
        429: "RateLimitError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}}: what the openai client reads into its exception."""
    return {
        "error": {
            "message": message,
            "type": APIError.TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def shown(value) -> str:
    """`value` as an error message quotes it: its repr, cut short (a few items, a few dozen characters)."""
    return SHORT_REPR.repr(value)


SHORT_REPR = reprlib.Repr()  # Python 3.10's Repr takes no keyword arguments
SHORT_REPR.maxlevel, SHORT_REPR.maxstring, SHORT_REPR.maxother, SHORT_REPR.maxlong = 2, 40, 40, 24
SHORT_REPR.maxlist = SHORT_REPR.maxdict = SHORT_REPR.maxtuple = SHORT_REPR.maxset = 4


# ----------------------------------------------------------------------------- requests

# structured output, as OpenAI asks for it (response_format) and vLLM (the others, each alone)
STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
COMMON_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "user",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    *STRUCTURED_FIELDS,
)
COMPLETION_FIELDS = ("prompt", "echo", *COMMON_FIELDS)
CHAT_FIELDS = ("messages", "max_completion_tokens", "top_logprobs", *COMMON_FIELDS)
# fields minillm knows but does not implement: refused unless they ask for nothing (their default)
UNSUPPORTED = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
}


@dataclass
class Job:
    """One HTTP request, checked: what the engine runs and how the answer is shaped."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[list[int]]  # one engine request each (a completion may batch several prompts)
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False  # completions: the prompt's text (and with logprobs its logprobs) first
    id: str = ""
    created: int = 0

    def __post_init__(self):
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())


class LongNumber(int):
    """An integer literal of more digits than 2**64 has, kept unread: reading one of 5,000 digits
    takes quadratic time, and Python refuses past 4,300. `check_values` refuses it by its field."""


def read_integer(literal: str) -> int:
    return int(literal) if len(literal) <= 21 else LongNumber(INTEGER_BOUND)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object whose every value the checks can read (`check_values`)."""
    try:
        body = json.loads(raw, parse_int=read_integer)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise APIError(400, f"The request body is not valid JSON ({err}).") from None
    except RecursionError:
        raise APIError(400, f"The request body nests deeper than {MAX_DEPTH} levels; flatten it.") from None
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, not a JSON {type(body).__name__}.")
    check_values(body)
    return body


def check_values(body: dict) -> None:
    """Nesting, integers and strings anywhere in the body, checked without recursion (a deep body
    would overflow the stack of a recursive walk); the error names the top-level field."""
    stack = [(name, 1, name) for name in body] + [(value, 2, name) for name, value in body.items()]
    while stack:
        value, depth, name = stack.pop()
        if depth > MAX_DEPTH:
            raise value_error(name, f"nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack += [(item, depth + 1, name) for item in (*value.keys(), *value.values())]
        elif isinstance(value, list):
            stack += [(item, depth + 1, name) for item in value]
        elif isinstance(value, str) and LONE_SURROGATE.search(value):
            raise value_error(name, "holds a lone surrogate (\\ud800-\\udfff, unpaired): not Unicode text")
        elif isinstance(value, int) and not -INTEGER_BOUND < value < INTEGER_BOUND:
            raise value_error(name, "holds a number of 2**64 or more; no field takes one")


def value_error(name: str, problem: str) -> APIError:
    """A 400 for field `name`, its name made printable (it may hold the lone surrogate itself)."""
    printable = LONE_SURROGATE.sub("\ufffd", name)
    return APIError(400, f"{shown(printable)} {problem}.", printable if len(printable) <= 64 else None)


def check_fields(body: dict, known: tuple[str, ...]) -> None:
    for name, value in body.items():
        if name in UNSUPPORTED:
            if value not in UNSUPPORTED[name]:
                raise APIError(
                    400, f"minillm does not support '{name}' (got {shown(value)}); leave it out.", name
                )
        elif name not in known:
            raise APIError(
                400, f"Unknown field {shown(name)}; minillm takes {', '.join(sorted(known))}.", name[:64]
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


def make_job(
    kind: str,
    model: str,
    prompts: list[list[int]],
    common: dict,
    context_len: int,
    vocab_size: int,
    limits: ServeLimits,
) -> Job:
    """Check every prompt against the context and the vocabulary, the whole request against
    `max_request_tokens`, then build SamplingParams."""
    max_tokens = common["max_tokens"]
    for prompt in prompts:
        problem = prompt_problem(prompt, context_len, vocab_size)
        if problem:
            raise APIError(400, problem, "messages" if kind == "chat" else "prompt")
        if isinstance(max_tokens, int) and len(prompt) + max_tokens > context_len:
            where = "messages" if kind == "chat" else "prompt"
            raise APIError(
                400,
                f"This model's maximum context length is {context_len} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the {where}, {max_tokens} in the "
                f"completion). Please reduce the length of the {where} or completion.",
                "max_tokens",
            )
    # chat without max_tokens (None) may run to the rest of the context, as vLLM's does (the
    # engine stops it sooner if its KV pool holds less): that is what it may make the server hold
    most_new = max_tokens if max_tokens is not None else context_len - max(len(p) for p in prompts)
    check_request_tokens(prompts, common["n"], most_new, limits)
    try:
        params = SamplingParams(
            temperature=common["temperature"],
            top_k=common["top_k"],
            top_p=common["top_p"],
            max_tokens=max_tokens,
            seed=common["seed"],
            n=common["n"],
            ignore_eos=common["ignore_eos"],
            logprobs=common["logprobs"],
            prompt_logprobs=common["prompt_logprobs"],
            presence_penalty=common["presence_penalty"],
            frequency_penalty=common["frequency_penalty"],
            repetition_penalty=common["repetition_penalty"],
            logit_bias=common["logit_bias"],
            min_tokens=common["min_tokens"],
            stop_token_ids=common["stop_token_ids"],
            structured=common["structured"],
        )
    except ValueError as err:
        raise APIError(400, str(err)) from None
    named = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
    if any(t >= vocab_size for t in named):
        raise APIError(
            400, f"logit_bias and stop_token_ids take token ids in [0, {vocab_size}), got {max(named)}."
        )
    return Job(kind, model, prompts, params, common["stop"], common["stream"], common["include_usage"])


def check_request_tokens(prompts: list[list[int]], n: int, max_tokens: int, limits: ServeLimits) -> None:
    """Every token the request may make the server hold: its prompts, and n completions of up to
    max_tokens for each (4,000 prompts with n=16 would queue 64,000 sequences)."""
    if not isinstance(n, int) or not isinstance(max_tokens, int):
        return  # SamplingParams says what is wrong with them
    total = sum(len(p) for p in prompts) + len(prompts) * max(n, 1) * max(max_tokens, 1)
    if total > limits.max_request_tokens:
        raise APIError(
            400,
            f"This request asks for up to {total} tokens ({sum(map(len, prompts))} in its prompts, "
            f"{len(prompts) * n} completions of up to {max_tokens}); this server takes at most "
            f"{limits.max_request_tokens} per request (--max-request-tokens): send fewer prompts, "
            "or lower n or max_tokens.",
            "max_tokens",
        )
