"""The OpenAI API as vLLM serves it, the way in: request bodies checked and turned into Jobs.

Pure functions and small classes, no web framework: the checks both endpoints share turn a JSON
body into a `Job` (prompts as token ids, `SamplingParams`, stop strings, stream or not), or raise
`APIError` with the status and the message the client reads (OpenAI's error body). Each endpoint's
own body, a completion's prompt or a chat's messages, is read in `endpoints.py` (`parse_completion`,
`parse_chat`); the way out, response bodies and stream chunks, is `responses.py`.

Parameters and where they go:
    max_tokens (max_completion_tokens)  SamplingParams.max_tokens; completions default to 16 (the
                                        OpenAI default), chat to the rest of the context (vLLM's)
    temperature, top_p, seed, n         SamplingParams fields of the same names; temperature
                                        defaults to 1 (OpenAI's), 0 is greedy
    top_k, ignore_eos                   vLLM's extra parameters, the SamplingParams fields
    stop                                a string or a list; found in the text here, the engine
                                        request aborted once every choice has stopped
    stream, stream_options              server-sent events; include_usage adds a last chunk of usage
Anything else that changes the output (logprobs, echo, penalties, logit_bias, tools, ...) gets a
400 that names it; an unknown field a 400 that lists the ones minillm takes.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from minillm.config import prompt_problem
from minillm.sampling import SamplingParams, is_real
from minillm.tokenizer import Tokenizer


class APIError(Exception):
    """A request the server refuses: HTTP `status`, and the body of OpenAI's error shape."""

    TYPES = {
        400: "BadRequestError",
        404: "NotFoundError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

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


# ----------------------------------------------------------------------------- requests

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
)
COMPLETION_FIELDS = ("prompt", *COMMON_FIELDS)
CHAT_FIELDS = ("messages", "max_completion_tokens", *COMMON_FIELDS)
# fields minillm knows but does not implement: refused unless they ask for nothing (their default)
UNSUPPORTED = {
    "echo": (False,),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),
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
    id: str = ""
    created: int = 0

    def __post_init__(self):
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise APIError(400, f"The request body is not valid JSON ({err}).") from None
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, not a JSON {type(body).__name__}.")
    return body


def check_fields(body: dict, known: tuple[str, ...]) -> None:
    for name, value in body.items():
        if name in UNSUPPORTED:
            if value not in UNSUPPORTED[name]:
                raise APIError(400, f"minillm does not support '{name}' (got {value!r}); leave it out.", name)
        elif name not in known:
            raise APIError(400, f"Unknown field '{name}'; minillm takes {', '.join(sorted(known))}.", name)


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
        raise APIError(400, f"'{name}' must be {describe}, not {value!r}.", name)
    return value


def parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, f"'stop' must be a non-empty string or a list of them, not {stop!r}.", "stop")
    return stops


def parse_common(body: dict, tokenizer: Tokenizer | None, default_max_tokens: int | None) -> dict:
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
    return {
        "max_tokens": max_tokens,
        "temperature": typed(body, "temperature", float, 1.0, "a number >= 0"),
        "top_p": typed(body, "top_p", float, 1.0, "a number in (0, 1]"),
        "top_k": 0 if top_k == -1 else top_k,
        "n": typed(body, "n", int, 1, "an integer >= 1"),
        "seed": typed(body, "seed", int, None, "an integer"),
        "ignore_eos": typed(body, "ignore_eos", bool, False, "true or false"),
        "stream": stream,
        "include_usage": bool(typed(options, "include_usage", bool, False, "true or false")),
        "stop": parse_stop(body),
    }


def make_job(
    kind: str, model: str, prompts: list[list[int]], common: dict, context_len: int, vocab_size: int
) -> Job:
    """Check every prompt against the context and the vocabulary, then build SamplingParams."""
    max_tokens = common["max_tokens"]
    for prompt in prompts:
        problem = prompt_problem(prompt, context_len, vocab_size)
        if problem:
            raise APIError(400, problem, "messages" if kind == "chat" else "prompt")
        wanted = max_tokens if max_tokens is not None else context_len - len(prompt)
        if isinstance(wanted, int) and len(prompt) + wanted > context_len:
            where = "messages" if kind == "chat" else "prompt"
            raise APIError(
                400,
                f"This model's maximum context length is {context_len} tokens. However, you requested "
                f"{len(prompt) + wanted} tokens ({len(prompt)} in the {where}, {wanted} in the "
                f"completion). Please reduce the length of the {where} or completion.",
                "max_tokens",
            )
    # chat without max_tokens: the rest of the (shortest prompt's) context, as vLLM does
    if max_tokens is None:
        max_tokens = context_len - max(len(p) for p in prompts)
    try:
        params = SamplingParams(
            temperature=common["temperature"],
            top_k=common["top_k"],
            top_p=common["top_p"],
            max_tokens=max_tokens,
            seed=common["seed"],
            n=common["n"],
            ignore_eos=common["ignore_eos"],
        )
    except ValueError as err:
        raise APIError(400, str(err)) from None
    return Job(kind, model, prompts, params, common["stop"], common["stream"], common["include_usage"])
