"""The two endpoints' request bodies: POST /v1/completions and POST /v1/chat/completions.

`parse_completion` reads a prompt in any of the OpenAI API's four shapes, `parse_chat` a list of
messages rendered by the checkpoint's chat template; both then share `protocol.py`'s checks
(`check_fields`, `parse_common`) and its `make_job`, which checks every prompt against the context.
Both run in a worker thread (`app.py`): tokenizing a long prompt must not stall every stream.
"""

from __future__ import annotations

import dataclasses

from minillm.serve.errors import APIError, shown
from minillm.serve.fields import parse_chat_template_kwargs, parse_common, typed
from minillm.serve.limits import ServeLimits
from minillm.serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS, Job, check_fields, make_job
from minillm.tokenizer import Tokenizer


def parse_completion(
    body: dict,
    tokenizer: Tokenizer | None,
    model: str,
    context_len: int,
    vocab_size: int,
    limits: ServeLimits,
) -> Job:
    """POST /v1/completions: prompt is a string, a list of strings, a list of token ids, or a list
    of lists of token ids (a batch: one choice per prompt, n each, at most
    `max_prompts_per_request`, counted before any is tokenized). `echo` puts the prompt first."""
    check_fields(body, COMPLETION_FIELDS)
    ids = _completion_prompts(body.get("prompt"), tokenizer, limits)
    common = parse_common(body, 16, limits, chat=False)
    echo = typed(body, "echo", bool, False, "true or false")
    job = make_job("completion", model, ids, common, context_len, vocab_size, limits)
    if echo:  # with logprobs, the prompt's tokens are scored too (every one computed: no prefix hit)
        job.echo = True
        if job.params.prompt_logprobs is None:
            job.params = dataclasses.replace(job.params, prompt_logprobs=job.params.logprobs)
    return job


def _completion_prompts(prompt, tokenizer: Tokenizer | None, limits: ServeLimits) -> list[list[int]]:
    """A completion's prompt (a string, token ids, or a list of either) as token-id lists."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
    ):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise APIError(
            400,
            "'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
            f"of token ids, not {shown(prompt)}."
            if prompt is not None
            else "'prompt' is required.",
            "prompt",
        )
    if len(prompts) > limits.max_prompts_per_request:
        raise APIError(
            400,
            f"This request has {len(prompts)} prompts; this server takes at most "
            f"{limits.max_prompts_per_request} per request (--max-prompts-per-request).",
            "prompt",
        )
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise APIError(400, "This model has no tokenizer; send prompts as token ids.", "prompt")
            try:
                ids.append(tokenizer.encode_prompt(p))
            except ValueError as err:  # text the tokenizer's regex gives up on
                raise APIError(400, str(err), "prompt") from None
        else:
            ids.append(list(p))
    return ids


def message_text(message, index: int) -> dict[str, str]:
    """A chat message as {"role", "content"}; content given as parts must be text parts."""
    if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
        raise APIError(
            400,
            f"messages[{index}] must be an object with role system, user or assistant and a "
            f"content, not {shown(message)}.",
            "messages",
        )
    content = message.get("content")
    if isinstance(content, list):
        if not all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content
        ):
            raise APIError(
                400,
                f"messages[{index}].content: minillm reads only text parts "
                '({"type": "text", "text": ...}).',
                "messages",
            )
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{index}].content must be a string, not {shown(content)}.", "messages")
    extra = set(message) - {"role", "content", "name"}
    if extra:
        raise APIError(
            400, f"messages[{index}] has fields minillm does not support: {shown(sorted(extra))}.", "messages"
        )
    return {"role": message["role"], "content": content}


def parse_chat(
    body: dict,
    tokenizer: Tokenizer | None,
    model: str,
    context_len: int,
    vocab_size: int,
    limits: ServeLimits,
) -> Job:
    """POST /v1/chat/completions: the conversation is rendered by the checkpoint's chat template,
    with chat_template_kwargs as the template's own variables."""
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(
            400, '\'messages\' must be a non-empty list of {"role", "content"} objects.', "messages"
        )
    conversation = [message_text(m, i) for i, m in enumerate(messages)]
    if tokenizer is None:
        raise APIError(
            400, "This model has no tokenizer, so no chat template; use /v1/completions with token ids."
        )
    template_vars = parse_chat_template_kwargs(body)
    try:
        prompt = tokenizer.encode_chat(conversation, **template_vars)
    except ValueError as err:  # ConfigError too: no chat template, or it fails on this conversation
        raise APIError(400, str(err)) from None
    common = parse_common(body, None, limits, chat=True)
    return make_job("chat", model, [prompt], common, context_len, vocab_size, limits)
