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

A template is code from the internet. Jinja's sandbox keeps it from Python's insides (no
`__class__`, no imports) and, with no loader, from files; this module also bounds its work, which
the sandbox does not: per render at most OUTPUT_CHARS characters written (counted at every output,
in macros too), STEPS loop iterations and calls, RENDER_SECONDS of CPU; `*`, `**`, `%` and a
width-taking call are refused before they build a value past OUTPUT_CHARS, and `+`, `~` and a
call's result are checked after. Whatever fails is one line: a `ConfigError` for the checkpoint's
template, a `ValueError` when the template itself refuses the conversation (`raise_exception`).
What a single operation on two large inputs builds (a long separator joining a long list) is
checked only once built.

Control tokens. Rendered text becomes ids with each special token's string read as that token,
but only where the template wrote it: a user who types `<|im_end|>` must not end their turn.
As transformers does (`sanitize_control_tokens`), every special-token string in the caller's
data is wrapped in two private-use characters before rendering; the rendered text is then cut
at the wrapped strings (encoded as plain text) and at the bare ones (the tokens).
"""

from __future__ import annotations

import json
import re
import time
from contextvars import ContextVar
from datetime import datetime
from functools import wraps
from typing import Callable

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.filters import do_format
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from minillm.config import ConfigError

OUTPUT_CHARS = 1_000_000  # characters a render may write: more than any context minillm runs holds
STEPS = 100_000  # loop iterations and calls (functions, macros, filters) a render may make
RENDER_SECONDS = 0.5  # CPU time a render may take; a real template needs milliseconds
INT_BITS = 1024  # the largest integer `*` or `**` may build, in bits
MAX_NESTING = 32  # how deep a caller's template variables may nest lists and objects
TEMPLATE_HINT = "fix or replace the chat_template in the checkpoint's tokenizer_config.json"
# a user's spelling of a special token travels through the template between these two
# characters (Unicode's private-use plane 15: no text means them), as in transformers
_START, _END = "\U000f0000", "\U000f0001"


class ChatTemplate:
    """One checkpoint's template, compiled once. `special_tokens`: every special token's string
    and id; `token_names`: the roles a template reads by name ({"bos_token": "<s>", ...})."""

    def __init__(self, source: str, special_tokens: dict[str, int], token_names: dict[str, str | None]):
        self.template = _compile(source)
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
        token = _BUDGET.set(_Budget())
        try:
            return self.template.render(variables)
        except _Refused as refusal:
            raise ValueError(f"The chat template refuses this conversation: {_one_line(refusal)}") from None
        except Exception as err:  # the template is code from outside: any failure of its is its own
            raise ConfigError(
                f"The checkpoint's chat template failed: {_what_failed(err)}; {TEMPLATE_HINT}."
            ) from None
        finally:
            _BUDGET.reset(token)


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


# ----------------------------------------------------------------------------- the budget


class _OverBudget(Exception):
    """The render went past one of the bounds."""


class _Refused(Exception):
    """The template's own `raise_exception(message)`: the conversation is not one it lays out."""


class _Budget:
    """What one render may still spend; every hook of the sandbox below draws on it."""

    def __init__(self):
        self.steps_left = STEPS
        self.chars_left = OUTPUT_CHARS
        self.deadline = time.thread_time() + RENDER_SECONDS  # CPU time: a busy machine does not count

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise _OverBudget(f"it made more than {STEPS:,} loop iterations and calls")
        if time.thread_time() > self.deadline:
            raise _OverBudget(f"it ran for more than {RENDER_SECONDS} s of CPU")

    def write(self, chars: int) -> None:
        self.chars_left -= chars
        if self.chars_left < 0:
            raise _OverBudget(f"it wrote more than {OUTPUT_CHARS:,} characters")


# one budget per render; a context variable, so that renders in several threads keep theirs apart
_BUDGET: ContextVar[_Budget] = ContextVar("chat_template_budget")


def _checked_size(value):
    """A value past OUTPUT_CHARS items, counting the characters of a list's strings: `[x] * 2000`
    is small to build and 2000 times x to join."""
    size = len(value) if isinstance(value, (str, list, tuple, dict)) else 0
    if isinstance(value, (list, tuple)):
        size += sum(len(item) for item in value if isinstance(item, str))
    if size > OUTPUT_CHARS:
        raise _OverBudget(f"it built a value of {size:,} items and characters (at most {OUTPUT_CHARS:,})")
    return value


def _check_string_call(method, args) -> None:
    """`str.replace`, `str.expandtabs` and `str.join` can build, in one call, far more than their
    inputs hold: their result's size is known before they run, so it is checked then."""
    text, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(text, str):
        return
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        grows = text.count(args[0]) if args[0] else len(text) + 1
        size = len(text) + grows * max(0, len(args[1]) - len(args[0]))
    elif name == "expandtabs":
        size = len(text) + text.count("\t") * (args[0] if args and isinstance(args[0], int) else 8)
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        size = _checked_size(args[0]) and len(text) * len(args[0]) + sum(map(len, map(str, args[0])))
    else:
        return
    if size > OUTPUT_CHARS:
        raise _OverBudget(f"its {name} would build {size:,} characters (at most {OUTPUT_CHARS:,})")


def _check_arguments(args, kwargs) -> None:
    """An integer argument past OUTPUT_CHARS is a size no chat needs, and as a width, a count
    or a range's end it would build a value that big: refused before the call runs."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and abs(value) > OUTPUT_CHARS:
            raise _OverBudget(
                f"it passes {value:,} to a call, a size past any a chat needs ({OUTPUT_CHARS:,})"
            )


def _check_format(format_string: str) -> None:
    """A width or precision inside a format string ('%9999999999s', '{:>9999999999}')."""
    if any(int(number) > OUTPUT_CHARS for number in re.findall(r"\d+", format_string)):
        raise _OverBudget(f"a format string asks for more than {OUTPUT_CHARS:,} characters")


def _check_binop(operator: str, left, right) -> None:
    """`*` repeats and `**` raises: both can ask for a huge value from two small ones."""
    if operator == "*":
        for sized, count in ((left, right), (right, left)):
            if isinstance(sized, (str, list, tuple)) and isinstance(count, int):
                if len(sized) * count > OUTPUT_CHARS:
                    raise _OverBudget(
                        f"it repeats a value into {len(sized) * count:,} items (at most {OUTPUT_CHARS:,})"
                    )
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > INT_BITS:
                raise _OverBudget(f"it multiplied integers past {INT_BITS} bits")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1 and left.bit_length() * right > INT_BITS:
            raise _OverBudget(f"it raised an integer past {INT_BITS} bits")
    elif operator == "%" and isinstance(left, str):
        _check_format(left)
        _check_arguments(right if isinstance(right, tuple) else (right,), {})


def _bounded(function):
    """A filter as the template calls it: one step, its integer arguments and result checked."""

    @wraps(function)  # keeps Jinja's pass_context/pass_environment mark
    def bounded(*args, **kwargs):
        _BUDGET.get().step()
        _check_arguments(args, kwargs)
        return _checked_size(function(*args, **kwargs))

    return bounded


@jinja2.pass_context  # a context-taking filter is never run at compile time (constant folding)
def _counted(context, iterable):
    """A loop's iterable, one step per item."""
    budget = _BUDGET.get()
    for item in iterable:
        budget.step()
        yield item


@jinja2.pass_context
def _written(context, value):
    """One output (literal text or `{{ ... }}`), counted where it is written, in a macro too."""
    _BUDGET.get().write(len(str(value)))
    return value


def _checked_format(value, *args, **kwargs):
    _check_format(str(value))
    return do_format(value, *args, **kwargs)


# ----------------------------------------------------------------------------- the environment


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, as transformers configures it, with the budget's hooks: every
    call, the operators that can build a huge value, `str.format`; an unsafe attribute fails
    instead of rendering as nothing."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call(self, context, obj, /, *args, **kwargs):
        _BUDGET.get().step()
        _check_arguments(args, kwargs)
        _check_string_call(obj, args)
        if isinstance(obj, LoopContext) and args:  # loop(children) in a recursive for: count it too
            args = (_counted(context, args[0]), *args[1:])
        return _checked_size(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        _check_binop(operator, left, right)
        return _checked_size(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format(value.__self__)
        return wrapper

    def unsafe_undefined(self, obj, attribute):
        raise jinja2.exceptions.SecurityError(
            f"it reads {attribute!r} of a {type(obj).__name__}, which the sandbox forbids"
        )


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's text for
    training masks with it; rendering, it is its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Namespace(Namespace):
    """namespace() as transformers gives it: no attribute whose name starts with "_"."""

    def __init__(*args, **kwargs):  # Jinja's signature: `self` may be an attribute's name
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _Namespace._check_name(name)
        Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _TemplateDict:
    """dict() as transformers gives it: calling it and fromkeys, nothing of the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise _Refused(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: Jinja's escapes HTML characters, which a prompt must keep."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_string):
    return datetime.now().strftime(format_string)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.filters["format"] = _checked_format
    env.filters = {name: _bounded(function) for name, function in env.filters.items()}
    env.filters.update(_counted=_counted, _written=_written, _sized=_checked_size)  # _Instrument's
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_Namespace,
    )
    del env.globals["lipsum"]  # random text of any length in one call: no template lays out a chat with it
    for slow in (
        "wordwrap",
        "slice",
        "urlize",
    ):  # seconds of CPU in one call on a long text; no chat uses them
        del env.filters[slow]
    return env


class _Instrument(NodeTransformer):
    """Puts the budget's counters into a parsed template: every loop's iterable through
    `_counted`, every output and every `~` through `_written`/a size check."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_counted", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        self.generic_visit(node)
        node.nodes = [nodes.Filter(n, "_written", [], [], None, None, lineno=n.lineno) for n in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return nodes.Filter(node, "_sized", [], [], None, None, lineno=node.lineno)


def _compile(source: str) -> jinja2.Template:
    """The template, instrumented and compiled: a syntax error or a reach for other files is
    reported here, at load, not in the middle of a chat."""
    env = _environment()
    try:  # a syntax error, or (when compiled) a filter this sandbox does not have
        tree = env.parse(source)
        for reach in tree.find_all((nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport)):
            raise ConfigError(
                f"The checkpoint's chat template reads another template (line {reach.lineno}), which a "
                f"chat template may not; {TEMPLATE_HINT}."
            )
        tree = _Instrument().visit(tree)
        tree.set_environment(env)  # the nodes _Instrument made, too
        return env.from_string(tree)
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(
            f"The checkpoint's chat template does not parse (line {err.lineno}: {_one_line(err.message)}); "
            f"{TEMPLATE_HINT}."
        ) from None


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _what_failed(err: BaseException) -> str:
    if isinstance(err, RecursionError):
        return "it recursed too deep"
    if isinstance(err, MemoryError):
        return "it ran out of memory"
    if isinstance(err, _OverBudget):
        return str(err)
    return f"{type(err).__name__}: {_one_line(err)}"
