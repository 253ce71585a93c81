"""The checkpoint's own chat template, rendered as transformers renders it, in a sandbox.

A chat model learned one layout of a conversation: Llama 3 heads each turn with
`<|start_header_id|>user<|end_header_id|>`, Qwen and SmolLM2 with `<|im_start|>user`, Qwen3 adds
`<think>` blocks, some add a date or a default system prompt. A checkpoint ships its layout as a
Jinja program (tokenizer_config.json's "chat_template"), and the prompt the model expects is
exactly what transformers' `apply_chat_template` renders from it. So minillm runs that program the
same way: the same Jinja environment (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls),
the same helpers (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), the
same variables (`messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens'
strings such as `bos_token`, and whatever else the caller passes, such as Qwen3's
`enable_thinking`).

A template is code from the internet: it runs in `template_sandbox.py`, which keeps it from
Python's insides and from files and bounds its work; a failure is one line, a `ConfigError` for
the checkpoint's template, a `ValueError` when the template refuses the conversation.

Control tokens. Rendered text becomes ids with each special token's string read as that token,
but only where the template wrote it: a user who types `<|im_end|>` must not end their turn.
As transformers does (`sanitize_control_tokens`), every special-token string in the caller's
data is wrapped in two private-use characters before rendering; the rendered text is then cut
at the wrapped strings (encoded as plain text) and at the bare ones (the tokens).
"""

from __future__ import annotations

import json
import re
from typing import Callable

from minillm.template_sandbox import OUTPUT_CHARS, compile_template, render_bounded

MAX_NESTING = 32  # how deep a caller's template variables may nest lists and objects
# a user's spelling of a special token travels through the template between these two
# characters (Unicode's private-use plane 15: no text means them), as in transformers
_START, _END = "\U000f0000", "\U000f0001"


class ChatTemplate:
    """One checkpoint's template, compiled once. `special_tokens`: every special token's string
    and id; `token_names`: the roles a template reads by name ({"bos_token": "<s>", ...})."""

    def __init__(self, source: str, special_tokens: dict[str, int], token_names: dict[str, str | None]):
        self.template = compile_template(source)
        self.special_tokens = special_tokens
        self.token_names = {name: token for name, token in token_names.items() if token is not None}
        longest_first = sorted(special_tokens, key=len, reverse=True)  # a token before its prefixes
        self.special_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!): none
        self.split_re = re.compile(f"({self.special_re.pattern})")  # keeps the tokens it splits at
        # a wrapped special token (group 1), or a lone marker a string method cut off its token
        self.marked_re = re.compile(f"{_START}({self.special_re.pattern}){_END}|[{_START}{_END}]")

    def render(self, messages: list[dict], /, add_generation_prompt: bool = False, **template_vars) -> str:
        """The conversation as text, as `apply_chat_template(..., tokenize=False)` renders it."""
        return self._render(messages, add_generation_prompt, template_vars)

    def encode(
        self,
        messages: list[dict],
        encode_text: Callable[[str], list[int]],
        /,
        add_generation_prompt: bool = False,
        **template_vars,
    ) -> list[int]:
        """The conversation as ids: the template's special-token strings are those tokens, the
        caller's are text. `encode_text` encodes plain text (special-token strings as text)."""
        marked = self._render(self._marked(messages), add_generation_prompt, self._marked(template_vars))
        pieces = self.marked_re.split(marked)  # [text, a user's token or None, text, ...]
        ids = []
        for index, piece in enumerate(pieces):
            if not piece:
                continue
            if index % 2:  # a special token's string from the caller's data: text
                ids += encode_text(piece)
            else:
                ids += self._encode_with_special_tokens(piece, encode_text)
        return ids

    def _encode_with_special_tokens(self, text: str, encode_text: Callable[[str], list[int]]) -> list[int]:
        pieces = self.split_re.split(text)  # [text, token, text, ...]
        ids = []
        for index, piece in enumerate(pieces):
            if index % 2:
                ids.append(self.special_tokens[piece])
            elif piece:
                ids += encode_text(piece)
        return ids

    def _marked(self, value):
        """`value` (a message, a list of them, template variables) with every special token's
        string in its strings wrapped; markers already there are dropped, so none can be forged.
        Dict keys stay as they are."""
        if isinstance(value, str):
            value = value.replace(_START, "").replace(_END, "")
            return self.special_re.sub(f"{_START}\\g<0>{_END}", value)
        if isinstance(value, dict):
            return {key: self._marked(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._marked(item) for item in value]
        return value

    def _render(self, messages: list[dict], add_generation_prompt: bool, template_vars: dict) -> str:
        if not messages:
            raise ValueError("A chat needs at least one message.")
        variables = {
            **self.token_names,
            "tools": None,
            "documents": None,
            **_plain(template_vars),
            "messages": [_message(message) for message in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        given = _text_chars(variables["messages"]) + _text_chars(template_vars)
        if given > OUTPUT_CHARS:  # the caller's text alone: not the template's fault
            raise ValueError(
                f"The conversation holds {given:,} characters, more than the {OUTPUT_CHARS:,} a chat "
                "template may write; shorten it."
            )
        return render_bounded(self.template, variables)


def template_variables(value) -> dict:
    """A caller's own variables for the template (the CLI's --chat-template-kwargs, the API's
    chat_template_kwargs), checked: a JSON object, without the two variables a chat sets."""
    if not isinstance(value, dict):
        raise ValueError(
            f'must be a JSON object such as {{"enable_thinking": false}}, not {json.dumps(value):.60}'
        )
    if _nested_past(value, MAX_NESTING):  # copying it for the template would recurse past Python's limit
        raise ValueError(f"nests lists or objects more than {MAX_NESTING} deep; give flatter values")
    taken = [name for name in ("messages", "add_generation_prompt") if name in value]
    if taken:
        raise ValueError(
            f"sets {' and '.join(taken)}, which the chat sets itself; give the template's other variables"
        )
    return value


def _nested_past(value, depth: int) -> bool:
    """Whether the lists and objects in `value` nest more than `depth` levels deep."""
    if depth < 0:
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return any(_nested_past(item, depth - 1) for item in items)


def _text_chars(value) -> int:
    """Characters in the strings of a caller's data (plain JSON values, as `_plain` copied them)."""
    if isinstance(value, str):
        return len(value)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(_text_chars(item) for item in items)


def _message(message) -> dict:
    """A message as transformers gives it to a template: a key whose value is None is left out
    (APIs send `"tool_calls": null`; a template tests `is defined`)."""
    if not isinstance(message, dict):
        raise ValueError(f"A chat message is an object with a role and a content, not {message!r}.")
    return {key: value for key, value in _plain(message).items() if value is not None}


def _plain(value):
    """A copy of the caller's data of plain JSON types only, as transformers gives a template:
    nothing with methods the sandbox does not know to be safe."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    raise ValueError(f"A chat template reads JSON values only, not {type(value).__name__}.")
