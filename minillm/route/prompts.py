"""A request's prompt as the engine will see it: token ids, tokenized in the router.

The router loads the same checkpoint's tokenizer and chat template as its engines and renders a
request as `serve/endpoints.py` does: a chat's messages through the chat template (with its
chat_template_kwargs), a completion's prompt string inside the tokenizer's added tokens, token ids
as they are. A batch of completion prompts is routed by its first. A body the router cannot read
gives None: it is forwarded anyway (round-robin) and the engine answers it, with its own 400 if
it is wrong.
"""

from __future__ import annotations

import json

from minillm.serve.endpoints import message_text
from minillm.serve.errors import APIError
from minillm.serve.fields import parse_chat_template_kwargs
from minillm.tokenizer import Tokenizer


def prompt_ids(raw: bytes, chat: bool, tokenizer: Tokenizer) -> list[int] | None:
    """The first prompt's token ids, or None for a body that is not a request the router can read."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            return None
        return _chat_ids(body, tokenizer) if chat else _completion_ids(body.get("prompt"), tokenizer)
    except (ValueError, APIError, RecursionError):  # ValueError: bad JSON, or text the template refuses
        return None


def _chat_ids(body: dict, tokenizer: Tokenizer) -> list[int] | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    conversation = [message_text(message, i) for i, message in enumerate(messages)]
    return tokenizer.encode_chat(conversation, **parse_chat_template_kwargs(body))


def _completion_ids(prompt, tokenizer: Tokenizer) -> list[int] | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, str):
        return tokenizer.encode_prompt(prompt)
    if isinstance(prompt, list) and prompt and all(type(token) is int for token in prompt):
        return prompt
    return None
