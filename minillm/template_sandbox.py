"""The sandbox a chat template runs in: Jinja's, with the work a render may do bounded.

A template is code from the internet. Jinja's sandbox keeps it from Python's insides (no
`__class__`, no imports) and, with no loader, from files; this module also bounds its work, which
the sandbox does not: per render at most OUTPUT_CHARS characters written (counted at every output,
in macros too), STEPS loop iterations and calls, RENDER_SECONDS of CPU; `*`, `**`, `%` and a
width-taking call are refused before they build a value past OUTPUT_CHARS, and `+`, `~` and a
call's result are checked after. Whatever fails is one line: a `ConfigError` for the checkpoint's
template, a `ValueError` when the template itself refuses the conversation (`raise_exception`).
What a single operation on two large inputs builds (a long separator joining a long list) is
checked only once built.

`compile_template` parses and instruments a template once, at load; `render_bounded` renders it
with a fresh budget (`chat_template.py` lays the conversation out with them).
"""

from __future__ import annotations

import json
import re
import time
from contextvars import ContextVar
from datetime import datetime
from functools import wraps

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
TEMPLATE_HINT = "fix or replace the chat_template in the checkpoint's tokenizer_config.json"


def render_bounded(template: jinja2.Template, variables: dict) -> str:
    """`template` rendered with `variables` within one render's budget; any failure is one line."""
    token = _BUDGET.set(_Budget())
    try:
        return template.render(variables)
    except _Refused as refusal:
        raise ValueError(f"The chat template refuses this conversation: {_one_line(refusal)}") from None
    except Exception as err:  # the template is code from outside: any failure of its is its own
        raise ConfigError(
            f"The checkpoint's chat template failed: {_what_failed(err)}; {TEMPLATE_HINT}."
        ) from None
    finally:
        _BUDGET.reset(token)


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


def compile_template(source: str) -> jinja2.Template:
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
