"""What the benches serve: a *workload*, requests cut from real prose, arriving over time.

Every bench and lesson that replays traffic builds it from these parts, so that two benches on the
same seed and sizes see the same requests:
  - `Request`: a prompt (token ids), the tokens it turns out to need, what it declares, when it
    arrives (seconds after the workload starts), and for a later chat turn the turn it follows;
  - `Kind`s in fixed shares (`kinds_in_order`): a mix of traffic, each kind with its prompt
    lengths and its output length, fixed or lognormal (most answers short, a few long);
  - `Prose`: prompts cut at seeded offsets from the public-domain texts `weights_fetch.py`
    brings, and system prompts from the second text, which prompts are never cut from;
  - arrivals: exponential gaps at `rate` requests per second (a Poisson process), or all at t=0;
  - conversations: ChatML turns, each resending the conversation so far;
  - `uniform_trace`: the simplest workload (prompts U[a, b], outputs U[c, d]);
  - `submit_exact` / `submit_scripted` and `run_trace`: a workload into an engine on the wall
    clock, each request added once its arrival time has passed;
  - `warm_up`: one short request before the first measured row;
  - `blocks_for` / `pool_bytes`: a KV pool sized in tokens.
`scale` multiplies a workload's lengths: `--quick` shrinks them without changing the mix.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass

import torch

from minillm.config import ConfigError, EngineConfig
from minillm.engine import LLM, SamplingParams
from minillm.evaluation import DEFAULT_TEXT, read_text
from minillm.progress import progress_bar
from minillm.tokenizer import Tokenizer

BLOCK_SIZE = EngineConfig.block_size
SECOND_TEXT = DEFAULT_TEXT.parent / "lcet10.txt"  # system prompts (and the second quality text)
THINK_S = 1.0  # a user's mean pause between an answer and the next message of a conversation
CHAT_TURNS = (2, 5)  # turns of a conversation, uniform


@dataclass
class Request:
    kind: str
    prompt_ids: list[int]  # for a later chat turn: just its new user message, in the chat template
    output_len: int  # tokens it turns out to need
    max_tokens: int  # what it declares: for a scripted request more than it needs, as clients do
    arrival_s: float = 0.0  # seconds after the workload starts; for a later chat turn, the think
    #   time after its conversation's previous answer
    follows: int | None = None  # the index of the conversation's previous turn, for a later chat turn


# ----------------------------------------------------------------------------- kinds and their shares


@dataclass(frozen=True)
class Kind:
    name: str
    share: float  # of the workload's arrivals (a conversation counts once, however many turns it has)
    prompt_len: tuple[int, int]  # tokens of prose, uniform
    output_len: int  # tokens a request needs (the last is EOS); with output_sigma, the lognormal's median
    max_tokens: int  # what its requests declare
    output_sigma: float = 0.0  # the lognormal's log-space spread (the tail's weight); 0: always output_len

    def draw_output_len(self, scale: float, rng: random.Random, longest: int) -> int:
        """Tokens one request of this kind turns out to need: output_len, or a lognormal draw
        around it of at least 2 and at most `longest` (and max_tokens)."""
        if not self.output_sigma:
            return scaled(self.output_len, scale)
        drawn = self.output_len * math.exp(self.output_sigma * rng.gauss(0, 1))
        return min(scaled(min(longest, self.max_tokens), scale), max(2, scaled(round(drawn), scale)))


def scaled(length: int, scale: float) -> int:
    return max(1, round(length * scale))


def kind_counts(num_requests: int, kinds) -> list[int]:
    """Requests of each kind (anything with a `share`): its share of num_requests, rounded so they
    add up (largest remainder)."""
    exact = [kind.share * num_requests for kind in kinds]
    counts = [int(n) for n in exact]
    by_remainder = sorted(range(len(kinds)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: num_requests - sum(counts)]:
        counts[i] += 1
    return counts


def kinds_in_order(num_requests: int, kinds, rng: random.Random) -> list[Kind]:
    """The kinds in their shares of num_requests, in a seeded random order."""
    order = [kind for kind, count in zip(kinds, kind_counts(num_requests, kinds)) for _ in range(count)]
    rng.shuffle(order)
    return order


# ----------------------------------------------------------------------------- prompts from prose


class Prose:
    """Token stretches cut at seeded offsets from the public-domain text `weights_fetch.py` brings."""

    def __init__(self, tokenizer: Tokenizer):
        self.text_ids = tokenizer.encode(read_text())

    def cut(self, length: int, rng: random.Random) -> list[int]:
        start = rng.randrange(len(self.text_ids) - length)
        return self.text_ids[start : start + length]


def system_prompts(tokenizer: Tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` system prompts of `length` tokens: consecutive stretches of the second text (or of
    the first, far from where prompts are cut, if only that one was fetched)."""
    text_ids = tokenizer.encode(read_text(SECOND_TEXT if SECOND_TEXT.is_file() else DEFAULT_TEXT))
    start = 0 if SECOND_TEXT.is_file() else len(text_ids) - count * length
    return [text_ids[start + i * length : start + (i + 1) * length] for i in range(count)]


def uniform_trace(
    tokenizer: Tokenizer,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    rate: float | None = None,
    shared_len: int = 0,
) -> list[Request]:
    """Prompts of U[prompt_len] tokens of prose cut at random offsets (after the text's first
    `shared_len` tokens, a system prompt they all share), outputs U[output_len] (both ranges
    inclusive), each declaring just what it needs; all at t=0, or exponential gaps of mean 1/rate."""
    prose = Prose(tokenizer)
    if prompt_len[1] >= len(prose.text_ids):
        raise ConfigError(
            f"prompts of up to {prompt_len[1]} tokens cannot be cut from a text of {len(prose.text_ids)}; "
            "ask for shorter ones."
        )
    shared = prose.text_ids[:shared_len]
    rng = random.Random(seed)
    trace, arrival = [], 0.0
    for _ in range(num_requests):
        prompt = shared + prose.cut(rng.randint(*prompt_len), rng)
        needed = rng.randint(*output_len)
        trace.append(Request("prose", prompt, needed, needed, arrival))
        if rate:
            arrival += rng.expovariate(rate)
    return trace


def exact_rate(trace: list[Request], rate: float) -> None:
    """Stretch the arrival times (not the think times) so the last comes (arrivals - 1) / rate after
    the first: a mean gap of exactly 1 / rate, so every seed brings the same load at the same rate
    and only its bursts differ."""
    arrivals = [r for r in trace if r.follows is None]
    last = max(r.arrival_s for r in arrivals)
    if len(arrivals) < 2 or last <= 0:
        return
    stretch = (len(arrivals) - 1) / rate / last
    for request in arrivals:
        request.arrival_s *= stretch


# ----------------------------------------------------------------------------- conversations


def chat_message(tokenizer: Tokenizer, role: str, content_ids: list[int]) -> list[int]:
    """One ChatML message from token ids: <|im_start|>role\\n content <|im_end|>\\n."""
    start, end = _chatml(tokenizer, "<|im_start|>"), _chatml(tokenizer, "<|im_end|>")
    return [start, *tokenizer.encode(f"{role}\n"), *content_ids, end, *tokenizer.encode("\n")]


def assistant_header(tokenizer: Tokenizer) -> list[int]:
    return [_chatml(tokenizer, "<|im_start|>"), *tokenizer.encode("assistant\n")]


def _chatml(tokenizer: Tokenizer, token: str) -> int:
    """The id of a ChatML control token: the workload's turns are laid out in token ids, in the
    layout SmolLM2 and Qwen share, not rendered through each checkpoint's template."""
    if token not in tokenizer.special_tokens:
        raise ConfigError(
            f"The benches' conversations are ChatML turns, and this tokenizer has no {token} (Llama 3's has "
            "none): bench a ChatML model (SmolLM2, Qwen), or its size with --shape."
        )
    return tokenizer.special_tokens[token]


def next_turn_prompt(tokenizer: Tokenizer, previous_prompt: list[int], answer: list[int], message: list[int]):
    """A conversation's next prompt: the last prompt, the answer it got (ending with its EOS, which
    closes the assistant's message), a newline, and the new message with the assistant's header."""
    end = _chatml(tokenizer, "<|im_end|>")
    closed = answer if answer and answer[-1] == end else [*answer, end]
    return [*previous_prompt, *closed, *tokenizer.encode("\n"), *message]


def answer_ids(tokenizer: Tokenizer, text: str, token_ids: list[int] | None) -> list[int]:
    """What a client resends of an answer: the token ids the server made, else its text tokenized
    again, which may part from them (an EOS made under `ignore_eos` has no text; a word may split
    otherwise): the server's cache then holds the history only up to there."""
    return token_ids if token_ids is not None else tokenizer.encode(text)


def add_conversation(trace, tokenizer, kind: Kind, first_message, clock, prose, rng, scale, longest) -> None:
    """A conversation of CHAT_TURNS turns: the first at `clock`, each later one THINK_S (exponential
    mean) after the previous answer: a closed loop, whose later prompts are known only as it runs."""
    turns = rng.randint(*CHAT_TURNS)
    previous = None
    for turn in range(turns):
        length = rng.randint(*(scaled(n, scale) for n in kind.prompt_len))
        message = first_message if turn == 0 else prose.cut(length, rng)
        ids = [*chat_message(tokenizer, "user", message), *assistant_header(tokenizer)]
        arrival = clock if turn == 0 else rng.expovariate(1 / THINK_S)
        needed, declared = kind.draw_output_len(scale, rng, longest), scaled(kind.max_tokens, scale)
        trace.append(Request(kind.name, ids, needed, declared, arrival, previous))
        previous = len(trace) - 1


# ----------------------------------------------------------------------------- into an engine


class ScriptedStop:
    """A request's sampler: greedy, never EOS before its `output_len`-th token, which is EOS (the
    lowest of the model's end-of-sequence tokens). The engine sees an ordinary request that stops
    on its own before its max_tokens."""

    def __init__(self, output_len: int, eos_token_ids: frozenset[int]):
        self.output_len, self.eos_token_ids, self.emitted = output_len, sorted(eos_token_ids), 0

    def __call__(self, logits: torch.Tensor) -> int:
        self.emitted += 1
        if self.emitted == self.output_len:
            return self.eos_token_ids[0]
        logits = logits.clone()
        logits[self.eos_token_ids] = float("-inf")
        return int(logits.argmax())


def submit_scripted(
    engine, index: int, request: Request, arrival_time: float | None, prompt_ids=None
) -> None:
    """A request that declares its max_tokens and ends with EOS at its output length (`ScriptedStop`);
    `prompt_ids` for a chat turn whose prompt the conversation so far makes."""
    engine.add_request(
        request.prompt_ids if prompt_ids is None else prompt_ids,
        SamplingParams(max_tokens=request.max_tokens),
        request_id=str(index),
        arrival_time=arrival_time,
        sampler=ScriptedStop(request.output_len, engine.eos_token_ids),
    )


def submit_exact(engine, index: int, request: Request, arrival_time: float) -> None:
    """A request decoded greedily to exactly its output length, EOS ignored."""
    engine.add_request(
        request.prompt_ids,
        SamplingParams(max_tokens=request.output_len, ignore_eos=True),
        request_id=str(index),
        arrival_time=arrival_time,
    )


def run_trace(
    engine, trace: list, label: str, progress: bool, watch=None, add=submit_exact
) -> tuple[list, float, float]:
    """Step the engine, adding each request once its arrival time has passed (with that time, so
    its TTFT counts the wait). Returns the finished outputs in trace order, the busy seconds, and
    the CPU seconds this process spent (which other work on a shared machine does not inflate).
    `watch(engine)`, if given, is called after every step (a caller's own accounting); `add` puts
    a request in (`submit_exact` by default). Idle time is skipped: when nothing runs, the clock
    jumps to the next arrival."""
    pending = deque(enumerate(trace))
    finished = {}
    cpu_start = time.process_time()
    start = origin = time.perf_counter()  # origin: the perf_counter moment of trace time 0
    with progress_bar(f"{label}: requests", len(trace), enabled=progress) as advance:
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter()
            if not engine.has_unfinished_requests() and origin + pending[0][1].arrival_s > now:
                origin = now - pending[0][1].arrival_s  # idle: the clock jumps to the next arrival
            while pending and origin + pending[0][1].arrival_s <= now:
                index, request = pending.popleft()
                add(engine, index, request, origin + request.arrival_s)
            for out in engine.step():
                if out.finished:
                    finished[int(out.request_id)] = out
                    advance()
            if watch:
                watch(engine)
    return (
        [finished[index] for index in range(len(trace))],
        time.perf_counter() - start,
        time.process_time() - cpu_start,
    )


def warm_up(model, tokenizer, switches: dict) -> None:
    """One short request on an engine of `switches` (its kernels built on first use), so that the
    first row a bench measures is not the one paying for it."""
    llm = LLM(model=model, tokenizer=tokenizer, kv_cache_bytes=pool_bytes(model, 64), **switches)
    llm.generate([[1] * 32], SamplingParams(max_tokens=2, ignore_eos=True))


def blocks_for(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


def pool_bytes(model, num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """kv_cache_bytes that buys whole blocks for `num_tokens` tokens, in the model's dtype."""
    return blocks_for(num_tokens, block_size) * block_size * model.config.kv_bytes_per_token(model.dtype)
