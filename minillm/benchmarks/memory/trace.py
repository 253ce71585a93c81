"""The trace of `minillm bench memory` (the package's docstring tells it whole): N requests of
four kinds in fixed shares, cut from real prose, seeded, arriving over time; each ends with EOS at
exactly its output length (`ScriptedStop`), well before the max_tokens it declares."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from minillm.config import EngineConfig
from minillm.engine import SamplingParams
from minillm.evaluation import DEFAULT_TEXT, read_text
from minillm.tokenizer import Tokenizer

BLOCK_SIZE = EngineConfig.block_size
TUNING_SEED, SEED = 0, 1  # the sizes were chosen on the tuning seed's trace; the default reports another
SECOND_TEXT = DEFAULT_TEXT.parent / "lcet10.txt"  # the system prompts, and the second quality text


@dataclass(frozen=True)
class Kind:
    name: str
    share: float  # of the trace's requests
    prompt_len: tuple[int, int]  # tokens, uniform (a chat's user turn; its system prompt comes on top)
    output_len: int  # tokens it turns out to need (the last is EOS)
    max_tokens: int  # what the request declares: more than it needs, as clients do


KINDS = (  # decode-heavy, as chat traffic is: more tokens out than in, except for documents
    Kind("question", 0.40, (16, 48), 64, 128),
    Kind("chat", 0.35, (8, 24), 96, 192),
    Kind("document", 0.15, (192, 384), 32, 64),
    Kind("long answer", 0.10, (16, 32), 256, 384),
)
SYSTEM_PROMPTS, SYSTEM_TOKENS = 3, 96


@dataclass
class Request:
    kind: str
    prompt_ids: list[int]
    output_len: int
    max_tokens: int
    arrival_s: float  # seconds after the trace starts


class ScriptedStop:
    """A request's sampler: greedy, never EOS before its `output_len`-th token, which is EOS. The
    engine sees an ordinary request that stops on its own before its max_tokens."""

    def __init__(self, output_len: int, eos_token_id: int):
        self.output_len, self.eos_token_id, self.emitted = output_len, eos_token_id, 0

    def __call__(self, logits: torch.Tensor) -> int:
        self.emitted += 1
        if self.emitted == self.output_len:
            return self.eos_token_id
        logits = logits.clone()
        logits[self.eos_token_id] = float("-inf")
        return int(logits.argmax())


def submit(engine, index: int, request: Request, arrival_time: float) -> None:
    """A trace request into the engine, its sampler the script that ends it at its output length."""
    script = ScriptedStop(request.output_len, engine.eos_token_id)
    engine.add_request(
        request.prompt_ids,
        SamplingParams(max_tokens=request.max_tokens),
        request_id=str(index),
        arrival_time=arrival_time,
        sampler=script,
    )


def scaled(length: int, scale: float) -> int:
    return max(1, round(length * scale))


def system_prompts(tokenizer: Tokenizer, scale: float) -> list[str]:
    """Consecutive stretches of the second text (or of the first, far from where prompts are cut,
    if only that one was fetched)."""
    text_ids = tokenizer.encode(read_text(SECOND_TEXT if SECOND_TEXT.is_file() else DEFAULT_TEXT))
    length = scaled(SYSTEM_TOKENS, scale)
    start = 0 if SECOND_TEXT.is_file() else len(text_ids) - SYSTEM_PROMPTS * length
    return [
        tokenizer.decode(text_ids[start + i * length : start + (i + 1) * length])
        for i in range(SYSTEM_PROMPTS)
    ]


def chat_prompt(tokenizer: Tokenizer, system: str, user_ids: list[int]) -> list[int]:
    return tokenizer.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": tokenizer.decode(user_ids)}]
    )


def kind_counts(num_requests: int, kinds=KINDS) -> list[int]:
    """Requests of each kind (anything with a `share`): its share of num_requests, rounded so they
    add up (largest remainder)."""
    exact = [kind.share * num_requests for kind in kinds]
    counts = [int(n) for n in exact]
    by_remainder = sorted(range(len(kinds)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: num_requests - sum(counts)]:
        counts[i] += 1
    return counts


def make_trace(
    tokenizer: Tokenizer, num_requests: int, rate: float, scale: float, seed: int = SEED
) -> list[Request]:
    """The kinds in their shares, in a seeded random order; prompts cut at random offsets."""
    text_ids = tokenizer.encode(read_text())
    systems = system_prompts(tokenizer, scale)
    rng = random.Random(seed)
    kinds = [kind for kind, count in zip(KINDS, kind_counts(num_requests)) for _ in range(count)]
    rng.shuffle(kinds)
    trace, arrival = [], 0.0
    for kind in kinds:
        prompt_len = rng.randint(*(scaled(n, scale) for n in kind.prompt_len))
        start = rng.randrange(len(text_ids) - prompt_len)
        prompt = text_ids[start : start + prompt_len]
        if kind.name == "chat":
            prompt = chat_prompt(tokenizer, systems[rng.randrange(SYSTEM_PROMPTS)], prompt)
        trace.append(
            Request(
                kind.name, prompt, scaled(kind.output_len, scale), scaled(kind.max_tokens, scale), arrival
            )
        )
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
