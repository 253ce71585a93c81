"""What the chat's `/set` and `/compare` can change: engine switches, sampling, the view.

Each switch has a name a user types, a parser that turns the typed value into the fields it
changes (an `EngineConfig` field, a `SamplingParams` field, or the chat's own view), and whether
it is lossy: a lossless switch (block size, prefix caching, pool size, attention backend,
admission, preemption, speculative decoding) must give the very tokens it gave before, a lossy
one (KV quantization, eviction and its trigger, bf16, sampling) may not, and `/compare` shows
where they part. The
engine switches are `config.SWITCHES`' own (their choices, minimum, parser, lossy or not); this
module says which the chat offers. A value that cannot be parsed raises `ValueError` with one line
that says what would be accepted; the engine checks the combination (`EngineConfig`), so a switch
that needs another ("eviction needs a budget") fails there, also in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from minillm.config import SWITCHES
from minillm.switches import Switch, parse_kv_budget


@dataclass(frozen=True)
class Setting:
    """One thing /set and /compare can change."""

    name: str
    where: str  # "engine" (the engine is rebuilt), "sampling" (the next reply's SamplingParams), "view"
    lossy: bool
    parse: Callable[[str], dict]  # typed value -> the fields it sets
    accepts: str  # for /help and errors


def choice(field: str, options) -> Callable[[str], dict]:
    def parse(text: str) -> dict:
        if text not in options:
            raise ValueError(f"give one of {', '.join(options)}")
        return {field: text}

    return parse


def on_off(field: str) -> Callable[[str], dict]:
    def parse(text: str) -> dict:
        if text not in ("on", "off"):
            raise ValueError("give on or off")
        return {field: text == "on"}

    return parse


def number(field: str, kind: type, minimum: float, scale: int = 1) -> Callable[[str], dict]:
    """A number >= `minimum`, times `scale` (MiB -> bytes)."""

    def parse(text: str) -> dict:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not value >= minimum:
            raise ValueError(f"give a number >= {minimum}")
        return {field: value * scale}

    return parse


_OFF, *_POLICIES = SWITCHES["eviction"].choices  # "none", and the policies that keep a budget


def eviction(text: str) -> dict:
    """'none', or a policy and its budget: 'h2o 256'."""
    policy, _, kept = text.partition(" ")
    if policy not in SWITCHES["eviction"].choices:
        raise ValueError(f"give {_OFF}, or one of {', '.join(_POLICIES)} and a budget, like h2o 256")
    if policy == _OFF:
        return {"eviction": _OFF, "kv_budget": None, "eviction_trigger": SWITCHES["eviction_trigger"].default}
    if not kept:
        raise ValueError(
            f"{policy} keeps a budget of entries: /set eviction {policy} 256 (tokens) or 0.5 (a fraction)"
        )
    return {"eviction": policy, "kv_budget": parse_kv_budget(kept.strip())}


def engine_setting(switch: Switch, hint: str) -> Setting:
    """/set's form of an engine switch: its parser and what it accepts come from `config.SWITCHES`."""
    if switch.choices:
        parse, hint = choice(switch.name, switch.choices), hint or "|".join(switch.choices)
    elif switch.on_off:
        parse, hint = on_off(switch.name), "on|off"
    elif switch.minimum is not None:
        parse = number(switch.name, int, switch.minimum, switch.scale)
    else:
        parse = lambda text: {switch.name: switch.parse(text)}  # noqa: E731
    return Setting(switch.dest, "engine", switch.lossy, parse, hint)


EVICTION = Setting("eviction", "engine", True, eviction, f"{_OFF} | {'|'.join(_POLICIES)} BUDGET")
# the engine switches /set offers, by the name it takes, and what a value means where the switch
# does not say (choices and on|off say it themselves)
ENGINE_SETTINGS = {
    "kv_dtype": "",
    "kv_key_scales": "",
    "eviction": "",
    "kv_budget": "tokens (256) or a fraction (0.2)",
    "dtype": "",
    "weights": "",
    "fused_decode": "",
    "block_size": "tokens per block",
    "prefix_caching": "",
    "attention_backend": "",
    "flash_prefill": "",
    "kv_cache_mb": "device pool MiB",
    "host_cache_mb": "host pool MiB, 0 = none",
    "admission": "",
    "eviction_trigger": "",
    "preemption": "",
    "speculative": "",
    "num_speculative_tokens": "guesses per step, at most",
}


def _engine_settings() -> list[Setting]:
    by_dest = {switch.dest: switch for switch in SWITCHES.values()}
    return [
        EVICTION if name == "eviction" else engine_setting(by_dest[name], hint)
        for name, hint in ENGINE_SETTINGS.items()
    ]


SETTINGS = {
    s.name: s
    for s in [
        *_engine_settings(),
        Setting("temperature", "sampling", True, number("temperature", float, 0), "0 (greedy) or more"),
        Setting("top_k", "sampling", True, number("top_k", int, 0), "0 (off) or more"),
        Setting("top_p", "sampling", True, number("top_p", float, 0), "(0, 1]"),
        Setting("seed", "sampling", True, number("seed", int, 0), "a whole number"),
        Setting("max_tokens", "sampling", True, number("max_tokens", int, 1), "new tokens at most"),
        Setting("live", "view", False, on_off("live"), "on|off (the panel, in a terminal)"),
    ]
}


def parse_setting(words: str) -> tuple[Setting, dict]:
    """'kv_dtype int8' -> (its Setting, {"kv_dtype": "int8"}); a mistake raises one-line ValueError."""
    name, _, value = words.strip().partition(" ")
    if name not in SETTINGS:
        names = ", ".join(SETTINGS)
        raise ValueError(
            f"no switch {name!r}; the switches are {names}"
            if name
            else f"say which switch and its value, like kv_dtype int8; the switches are {names}"
        )
    setting = SETTINGS[name]
    if not value.strip():
        raise ValueError(f"{name} needs a value: {setting.accepts}")
    try:
        return setting, setting.parse(value.strip())
    except ValueError as err:
        raise ValueError(f"{name} {value.strip()!r}: {err}") from None
