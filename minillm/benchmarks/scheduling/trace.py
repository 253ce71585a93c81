"""The traffic `minillm bench scheduling` replays: seeded, mixed, with the sharing a cache can use.

A trace is a list of requests, each with its arrival time and the tokens it turns out to need.
Five kinds, in fixed shares of the trace, in a seeded order:

  question      a short prompt cut from prose, U[16, 64] tokens;
  system        one of SYSTEM_PROMPTS long system prompts (SYSTEM_TOKENS each, cut from a second
                text) and a user turn U[16, 48]: requests share the system prompt's blocks;
  chat          a conversation of U[2, 5] turns. Turn 1 is a user message; turn k's prompt is the
                whole conversation so far (every earlier prompt and answer) and a new user message,
                as a client sends it, so the cache holds all but the newest message. Turn k is sent
                THINK_S (exponential mean) after turn k - 1 has answered: a conversation is a
                closed loop, its first turn an arrival of the trace;
  document      a long document, U[384, 768] tokens, and a short answer;
  long answer   a short prompt, U[16, 32] tokens, and a long answer.

Arrivals are a Poisson process: exponential gaps at `rate` requests per second (a chat's later
turns are not arrivals; they follow their conversation). Output lengths are heavy-tailed
(lognormal: most answers short, a few long), at most MAX_OUTPUT. Each request declares the
max_tokens its kind of client declares, more than most of its answers need: 256 for questions,
system-prompted requests and chat turns, 128 for a document's summary, 512 for a long answer (a
client that wants an essay leaves room for one). A request ends with EOS at exactly its output
length (`workload.ScriptedStop`): the engine learns lengths only as requests finish, and every policy does
the same work on the same trace.

What a scheduler may know of a request's length is its shape, as in real traffic: the max_tokens
it declares, whether its prompt is raw text, a system prompt and a question, or a conversation
(and how long), and how long its prompt is. Within a kind, lengths are drawn at random: nothing
in a prompt tells one question's answer from another's, so the kind is the only honest signal,
and a perfect guess of each request's kind is the ceiling of any predictor (`kind_ceiling`).

`scale` multiplies every length (prompts, system prompts, outputs): `--quick` halves the default.
"""

from __future__ import annotations

import random

from minillm.benchmarks.stats import percentile
from minillm.benchmarks.workload import (
    CHAT_TURNS,
    Kind,
    Prose,
    Request,
    add_conversation,
    assistant_header,
    chat_message,
    exact_rate,
    kinds_in_order,
    scaled,
    system_prompts,
)
from minillm.tokenizer import Tokenizer

SYSTEM_PROMPTS, SYSTEM_TOKENS = 4, 256
MAX_OUTPUT = 256  # the longest answer drawn (a long answer's tail is cut there)

KINDS = (
    # name, share, prompt tokens U[a, b], output tokens (the lognormal's median), max_tokens, its spread
    Kind("question", 0.35, (16, 64), 24, 256, 0.8),
    Kind("system", 0.25, (16, 48), 24, 256, 0.8),
    Kind("chat", 0.20, (16, 48), 32, 256, 0.8),
    Kind("document", 0.10, (384, 768), 12, 128, 0.5),
    Kind("long answer", 0.10, (16, 32), 192, 512, 0.3),
)
QUESTIONS_ONLY = (
    Kind("question", 1.0, (16, 64), 24, 256, 0.8),
)  # short requests, nothing shared: no policy's case


def arrivals_for(num_requests: int, mix: tuple[Kind, ...] = KINDS) -> int:
    """Arrivals that make about `num_requests` requests, a chat bringing its mean number of turns."""
    chat_share = sum(kind.share for kind in mix if kind.name == "chat")
    mean_turns = sum(CHAT_TURNS) / 2
    return max(1, round(num_requests / (1 + chat_share * (mean_turns - 1))))


def make_trace(
    tokenizer: Tokenizer,
    seed: int,
    num_requests: int,
    rate: float,
    scale: float,
    mix: tuple[Kind, ...] = KINDS,
) -> list[Request]:
    """About `num_requests` requests (a chat's turns each count) of the kinds of `mix` in their
    shares, seeded: the same seed gives the same trace, whatever the rate (the rate only stretches
    the arrival times). The exponential gaps are rescaled so that their mean is exactly 1 / rate:
    every seed's trace then brings the same load at the same rate, and only its bursts differ (left
    as drawn, one seed's 100 arrivals at a nominal 1/s came 26% faster than another's)."""
    rng = random.Random(seed)
    prose = Prose(tokenizer)
    systems = system_prompts(tokenizer, SYSTEM_PROMPTS, scaled(SYSTEM_TOKENS, scale))
    trace: list[Request] = []
    clock = 0.0
    for kind in kinds_in_order(arrivals_for(num_requests, mix), mix, rng):
        text = prose.cut(rng.randint(*(scaled(n, scale) for n in kind.prompt_len)), rng)
        if kind.name == "chat":
            add_conversation(trace, tokenizer, kind, text, clock, prose, rng, scale, MAX_OUTPUT)
        else:
            if kind.name == "system":
                text = [
                    *chat_message(tokenizer, "system", systems[rng.randrange(SYSTEM_PROMPTS)]),
                    *chat_message(tokenizer, "user", text),
                    *assistant_header(tokenizer),
                ]
            needed = kind.draw_output_len(scale, rng, MAX_OUTPUT)
            trace.append(Request(kind.name, text, needed, scaled(kind.max_tokens, scale), clock))
        clock += rng.expovariate(rate)
    exact_rate(trace, rate)
    return trace


def describe_trace(trace: list[Request], seed: int, rate: float, scale: float) -> dict:
    arrivals = [r for r in trace if r.follows is None]
    return {
        "seed": seed,
        "requests": len(trace),
        "arrivals": len(arrivals),
        "rate_per_s": rate,
        "scale": scale,
        "kinds": {kind: sum(r.kind == kind for r in trace) for kind in dict.fromkeys(r.kind for r in trace)},
        "output_tokens": sum(r.output_len for r in trace),
        "output_len_p50_p99": [percentile([r.output_len for r in trace], pct) for pct in (50, 99)],
        "last_arrival_s": max(r.arrival_s for r in arrivals),
    }
