"""What the chat's `/set` and `/compare` can change: engine switches, sampling, the view.

Each switch has a name a user types, a parser that turns the typed value into the fields it
changes (an `EngineConfig` field, a `SamplingParams` field, or the chat's own view), and whether
it is lossy: a lossless switch (block size, prefix caching, pool size, attention backend) must
give the very tokens it gave before, a lossy one (KV quantization, eviction, bf16, sampling) may
not, and `/compare` shows where they part. A value that cannot be parsed raises `ValueError`
with one line that says what would be accepted; the engine checks the combination
(`EngineConfig`), so a switch that needs another ("eviction needs a budget") fails there, also
in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from minillm.config import DTYPES, EVICTION_POLICIES, KV_DTYPES


@dataclass(frozen=True)
class Switch:
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


def budget(text: str) -> int | float:
    """'256' is tokens kept, '0.2' a fraction of the sequence (EngineConfig checks the range)."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a token count (256) nor a fraction (0.2)") from None


def eviction(text: str) -> dict:
    """'none', or a policy and its budget: 'h2o 256'."""
    policy, _, kept = text.partition(" ")
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"give none, or one of {', '.join(EVICTION_POLICIES[1:])} and a budget, like h2o 256")
    if policy == "none":
        return {"eviction": "none", "kv_budget": None, "eviction_trigger": "always"}
    if not kept:
        raise ValueError(f"{policy} keeps a budget of entries: /set eviction {policy} 256 (tokens) or 0.5 (a fraction)")
    return {"eviction": policy, "kv_budget": budget(kept.strip())}


SWITCHES = {s.name: s for s in [
    Switch("kv_dtype", "engine", True, choice("kv_dtype", KV_DTYPES), "|".join(KV_DTYPES)),
    Switch("kv_key_scales", "engine", True, choice("kv_key_scales", ("channel", "token")), "channel|token"),
    Switch("eviction", "engine", True, eviction, "none | h2o|sinks|window BUDGET"),
    Switch("kv_budget", "engine", True, lambda text: {"kv_budget": budget(text)}, "tokens (256) or a fraction (0.2)"),
    Switch("dtype", "engine", True, choice("dtype", tuple(DTYPES)), "|".join(DTYPES)),
    Switch("block_size", "engine", False, number("block_size", int, 1), "tokens per block"),
    Switch("prefix_caching", "engine", False, on_off("prefix_caching"), "on|off"),
    Switch("attention_backend", "engine", False, choice("attention_backend", ("torch", "cpu", "cuda")),
           "torch|cpu|cuda"),
    Switch("kv_cache_mb", "engine", False, number("kv_cache_bytes", int, 1, 2**20), "device pool MiB"),
    Switch("host_cache_mb", "engine", False, number("host_cache_bytes", int, 0, 2**20), "host pool MiB, 0 = none"),
    Switch("temperature", "sampling", True, number("temperature", float, 0), "0 (greedy) or more"),
    Switch("top_k", "sampling", True, number("top_k", int, 0), "0 (off) or more"),
    Switch("top_p", "sampling", True, number("top_p", float, 0), "(0, 1]"),
    Switch("seed", "sampling", True, number("seed", int, 0), "a whole number"),
    Switch("max_tokens", "sampling", True, number("max_tokens", int, 1), "new tokens at most"),
    Switch("live", "view", False, on_off("live"), "on|off (the panel, in a terminal)"),
]}


def parse_switch(words: str) -> tuple[Switch, dict]:
    """'kv_dtype int8' -> (its Switch, {"kv_dtype": "int8"}); a mistake raises one-line ValueError."""
    name, _, value = words.strip().partition(" ")
    if name not in SWITCHES:
        raise ValueError(f"no switch {name!r}; the switches are {', '.join(SWITCHES)}" if name else
                         f"say which switch and its value, like kv_dtype int8; the switches are {', '.join(SWITCHES)}")
    switch = SWITCHES[name]
    if not value.strip():
        raise ValueError(f"{name} needs a value: {switch.accepts}")
    try:
        return switch, switch.parse(value.strip())
    except ValueError as err:
        raise ValueError(f"{name} {value.strip()!r}: {err}") from None
