"""The trace of `minillm bench memory` (the package's docstring tells it whole): N requests of
four kinds in fixed shares, cut from real prose, seeded, arriving over time; each ends with EOS at
exactly its output length (`workload.ScriptedStop`), well before the max_tokens it declares."""

from __future__ import annotations

import random

from minillm.benchmarks.workload import (
    Kind,
    Prose,
    Request,
    kinds_in_order,
    scaled,
    system_prompts,
)
from minillm.tokenizer import Tokenizer

TUNING_SEED, SEED = 0, 1  # the sizes were chosen on the tuning seed's trace; the default reports another
KINDS = (  # decode-heavy, as chat traffic is: more tokens out than in, except for documents
    # name, share, prompt tokens U[a, b] (a chat's user turn; its system prompt comes on top),
    # output tokens it needs (the last is EOS), max_tokens it declares (more, as clients do)
    Kind("question", 0.40, (16, 48), 64, 128),
    Kind("chat", 0.35, (8, 24), 96, 192),
    Kind("document", 0.15, (192, 384), 32, 64),
    Kind("long answer", 0.10, (16, 32), 256, 384),
)
SYSTEM_PROMPTS, SYSTEM_TOKENS = 3, 96


def chat_systems(tokenizer: Tokenizer, scale: float) -> list[str]:
    """The chats' system prompts, as text."""
    return [
        tokenizer.decode(ids)
        for ids in system_prompts(tokenizer, SYSTEM_PROMPTS, scaled(SYSTEM_TOKENS, scale))
    ]


def chat_prompt(tokenizer: Tokenizer, system: str, user_ids: list[int]) -> list[int]:
    return tokenizer.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": tokenizer.decode(user_ids)}]
    )


def make_trace(
    tokenizer: Tokenizer, num_requests: int, rate: float, scale: float, seed: int = SEED
) -> list[Request]:
    """The kinds in their shares, in a seeded random order; prompts cut at random offsets."""
    prose = Prose(tokenizer)
    systems = chat_systems(tokenizer, scale)
    rng = random.Random(seed)
    trace, arrival = [], 0.0
    for kind in kinds_in_order(num_requests, KINDS, rng):
        prompt = prose.cut(rng.randint(*(scaled(n, scale) for n in kind.prompt_len)), rng)
        if kind.name == "chat":
            prompt = chat_prompt(tokenizer, systems[rng.randrange(SYSTEM_PROMPTS)], prompt)
        needed, declared = scaled(kind.output_len, scale), scaled(kind.max_tokens, scale)
        trace.append(Request(kind.name, prompt, needed, declared, arrival))
        arrival += rng.expovariate(rate)
    return trace


def describe_trace(trace: list[Request], rate: float, scale: float, seed: int = SEED) -> dict:
    kinds = {}
    for kind in KINDS:
        requests = [r for r in trace if r.kind == kind.name]
        kinds[kind.name] = {
            "requests": len(requests),
            "prompt_len": [scaled(n, scale) for n in kind.prompt_len],
            "output_len": scaled(kind.output_len, scale),
            "max_tokens": scaled(kind.max_tokens, scale),
        }
    return {
        "requests": len(trace),
        "rate_per_s": rate,
        "seed": seed,
        "kinds": kinds,
        "system_prompts": SYSTEM_PROMPTS,
        "system_tokens": scaled(SYSTEM_TOKENS, scale),
        "prompt_tokens": sum(len(r.prompt_ids) for r in trace),
        "output_tokens": sum(r.output_len for r in trace),
        "longest_request": max(len(r.prompt_ids) + r.max_tokens for r in trace),
        "last_arrival_s": trace[-1].arrival_s,
    }
