"""The OpenAI API as vLLM serves it, the way in: which fields a request takes, and its Job.

A JSON body (`errors.parse_json`) has its fields checked against the table below (`check_fields`),
read (`fields.parse_common`) and turned into a `Job` (prompts as token ids, `SamplingParams`, stop
strings, stream or not) by `make_job`, or refused with an `APIError` (OpenAI's error body). Each
endpoint's own body, a completion's prompt or a chat's messages, is read in `endpoints.py`
(`parse_completion`, `parse_chat`); the way out, response bodies and stream chunks, is
`responses.py`.

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
    return_token_ids                    vLLM's: each choice's token ids (every token the engine made,
                                        EOS included) beside its text, a chunk's new ones in a stream;
                                        a client resends them, not its text tokenized again
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
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from minillm.config import prompt_problem
from minillm.sampling import SamplingParams
from minillm.serve.errors import APIError, shown
from minillm.serve.fields import STRUCTURED_FIELDS
from minillm.serve.limits import ServeLimits

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
    "return_token_ids",
    *STRUCTURED_FIELDS,
)
COMPLETION_FIELDS = ("prompt", "echo", *COMMON_FIELDS)
CHAT_FIELDS = ("messages", "chat_template_kwargs", "max_completion_tokens", "top_logprobs", *COMMON_FIELDS)
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
    return_token_ids: bool = False  # each choice's token ids beside its text (vLLM's extension)
    id: str = ""
    created: int = 0

    def __post_init__(self):
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())


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
    _check_prompts(kind, prompts, max_tokens, context_len, vocab_size)
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
    shape = {name: common[name] for name in ("stop", "stream", "include_usage", "return_token_ids")}
    return Job(kind, model, prompts, params, **shape)


def _check_prompts(
    kind: str, prompts: list[list[int]], max_tokens, context_len: int, vocab_size: int
) -> None:
    """Each prompt's ids in the vocabulary, and prompt + max_tokens within the context (OpenAI's words)."""
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
