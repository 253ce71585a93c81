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
length (`ScriptedStop`): the engine learns lengths only as requests finish, and every policy does
the same work on the same trace.

What a scheduler may know of a request's length is its shape, as in real traffic: the max_tokens
it declares, whether its prompt is raw text, a system prompt and a question, or a conversation
(and how long), and how long its prompt is. Within a kind, lengths are drawn at random: nothing
in a prompt tells one question's answer from another's, so the kind is the only honest signal,
and a perfect guess of each request's kind is the ceiling of any predictor (`kind_ceiling`).

`scale` multiplies every length (prompts, system prompts, outputs): `--quick` halves the default.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from minillm.benchmarks.memory.trace import SECOND_TEXT, kind_counts
from minillm.benchmarks.stats import percentile
from minillm.evaluation import read_text
from minillm.tokenizer import Tokenizer

SYSTEM_PROMPTS, SYSTEM_TOKENS = 4, 256
THINK_S = 1.0  # a user's mean pause between an answer and the next message of a conversation
MAX_OUTPUT = 256  # the longest answer drawn (a long answer's tail is cut there)


@dataclass(frozen=True)
class Kind:
    name: str
    share: float  # of the trace's arrivals (a chat counts once, however many turns it has)
    prompt_len: tuple[int, int]  # tokens of prose, uniform (a user message, for system and chat)
    output_median: int  # lognormal output length: its median, in tokens
    output_sigma: float  # and its log-space spread (the tail's weight)
    max_tokens: int  # what its requests declare


KINDS = (
    Kind("question", 0.35, (16, 64), 24, 0.8, 256),
    Kind("system", 0.25, (16, 48), 24, 0.8, 256),
    Kind("chat", 0.20, (16, 48), 32, 0.8, 256),
    Kind("document", 0.10, (384, 768), 12, 0.5, 128),
    Kind("long answer", 0.10, (16, 32), 192, 0.3, 512),
)
CHAT_TURNS = (2, 5)
QUESTIONS_ONLY = (
    Kind("question", 1.0, (16, 64), 24, 0.8, 256),
)  # short requests, nothing shared: no policy's case


@dataclass
class TraceRequest:
    """One request. A chat turn's prompt is known only once its conversation's last turn has
    answered: `prompt_ids` then holds just its new user message, in the chat template."""

    kind: str
    prompt_ids: list[int]
    output_len: int  # tokens it turns out to need (the last is EOS)
    max_tokens: int  # what it declares (its kind's)
    arrival_s: float  # seconds after the trace starts; for a later chat turn, the think time after its
    #   conversation's previous answer
    follows: int | None = None  # the index of the conversation's previous turn, for a later chat turn


def _scaled(length: int, scale: float) -> int:
    return max(1, round(length * scale))


def _output_len(kind: Kind, scale: float, rng: random.Random) -> int:
    drawn = kind.output_median * math.exp(kind.output_sigma * rng.gauss(0, 1))
    return min(_scaled(min(MAX_OUTPUT, kind.max_tokens), scale), max(2, _scaled(round(drawn), scale)))


class _Prose:
    """Token stretches cut at seeded offsets from the public-domain texts `weights_fetch.py` brings."""

    def __init__(self, tokenizer: Tokenizer, scale: float):
        self.text_ids = tokenizer.encode(read_text())
        second = read_text(SECOND_TEXT) if SECOND_TEXT.is_file() else read_text()
        second_ids = tokenizer.encode(second)
        length = _scaled(SYSTEM_TOKENS, scale)
        self.system_ids = [second_ids[i * length : (i + 1) * length] for i in range(SYSTEM_PROMPTS)]

    def cut(self, length: int, rng: random.Random) -> list[int]:
        start = rng.randrange(len(self.text_ids) - length)
        return self.text_ids[start : start + length]


def chat_message(tokenizer: Tokenizer, role: str, content_ids: list[int]) -> list[int]:
    """One ChatML message from token ids: <|im_start|>role\\n content <|im_end|>\\n."""
    start, end = tokenizer.special_tokens["<|im_start|>"], tokenizer.special_tokens["<|im_end|>"]
    return [start, *tokenizer.encode(f"{role}\n"), *content_ids, end, *tokenizer.encode("\n")]


def assistant_header(tokenizer: Tokenizer) -> list[int]:
    return [tokenizer.special_tokens["<|im_start|>"], *tokenizer.encode("assistant\n")]


def next_turn_prompt(tokenizer: Tokenizer, previous_prompt: list[int], answer: list[int], message: list[int]):
    """A conversation's next prompt: the last prompt, the answer it got (ending with its EOS, which
    closes the assistant's message), a newline, and the new message with the assistant's header."""
    end = tokenizer.special_tokens["<|im_end|>"]
    closed = answer if answer and answer[-1] == end else [*answer, end]
    return [*previous_prompt, *closed, *tokenizer.encode("\n"), *message]


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
):
    """About `num_requests` requests (a chat's turns each count) of the kinds of `mix` in their
    shares, seeded: the same seed gives the same trace, whatever the rate (the rate only stretches
    the arrival times). The exponential gaps are rescaled so that their mean is exactly 1 / rate:
    every seed's trace then brings the same load at the same rate, and only its bursts differ (left
    as drawn, one seed's 100 arrivals at a nominal 1/s came 26% faster than another's)."""
    rng = random.Random(seed)
    prose = _Prose(tokenizer, scale)
    num_arrivals = arrivals_for(num_requests, mix)
    kinds = [kind for kind, count in zip(mix, kind_counts(num_arrivals, mix)) for _ in range(count)]
    rng.shuffle(kinds)
    trace: list[TraceRequest] = []
    clock = 0.0
    for kind in kinds:
        length = rng.randint(*(_scaled(n, scale) for n in kind.prompt_len))
        text = prose.cut(length, rng)
        if kind.name == "chat":
            _add_conversation(trace, tokenizer, kind, text, clock, prose, rng, scale)
        else:
            if kind.name == "system":
                system = prose.system_ids[rng.randrange(SYSTEM_PROMPTS)]
                text = [
                    *chat_message(tokenizer, "system", system),
                    *chat_message(tokenizer, "user", text),
                    *assistant_header(tokenizer),
                ]
            output_len = _output_len(kind, scale, rng)
            trace.append(TraceRequest(kind.name, text, output_len, _scaled(kind.max_tokens, scale), clock))
        clock += rng.expovariate(rate)
    _exact_rate(trace, rate)
    return trace


def _exact_rate(trace: list[TraceRequest], rate: float) -> None:
    """Stretch the arrival times (not the think times) so the last comes (arrivals - 1) / rate after
    the first: a mean gap of exactly 1 / rate."""
    arrivals = [r for r in trace if r.follows is None]
    last = max(r.arrival_s for r in arrivals)
    if len(arrivals) < 2 or last <= 0:
        return
    stretch = (len(arrivals) - 1) / rate / last
    for request in arrivals:
        request.arrival_s *= stretch


def _add_conversation(trace, tokenizer, kind, first_message, clock, prose, rng, scale) -> None:
    """A chat's turns: the first at its arrival, each later one THINK_S after the previous answer."""
    turns = rng.randint(*CHAT_TURNS)
    previous = None
    for turn in range(turns):
        length = rng.randint(*(_scaled(n, scale) for n in kind.prompt_len))
        message = first_message if turn == 0 else prose.cut(length, rng)
        ids = [*chat_message(tokenizer, "user", message), *assistant_header(tokenizer)]
        arrival = clock if turn == 0 else rng.expovariate(1 / THINK_S)
        output_len, max_tokens = _output_len(kind, scale, rng), _scaled(kind.max_tokens, scale)
        trace.append(TraceRequest("chat", ids, output_len, max_tokens, arrival, previous))
        previous = len(trace) - 1


def describe_trace(trace: list[TraceRequest], seed: int, rate: float, scale: float) -> dict:
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
