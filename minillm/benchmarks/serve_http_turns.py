"""`minillm bench serve-http --turns N`: conversations whose every turn resends the whole history.

A chat client sends the conversation so far with each turn, so a server's time to first token on
turn 2 and later is what it keeps of the history: vLLM's and minillm's prefix cache, llama.cpp's
slot, which holds its last prompt. Each of the --clients holds a conversation of N turns, all at
once, each a closed loop (its next turn goes out as soon as its last answer has ended):

  turn 1 sends a prompt of bench serve's seeded trace (as bench serve-http's clients do; with
  --prompt-tokens, that many tokens);
  turn k+1 sends turn k's prompt, the answer's token ids, then a new user message: a stretch of
  the same prose, MESSAGE_LEN tokens long (seeded). No chat template wraps the turns: the trace's
  prompts are plain text too, so any tokenizer serves.

Every request is bench serve-http's: token ids of --model's tokenizer, greedy, `ignore_eos`, the
output length of the conversation's first request (or --max-tokens) on every turn. The answer's ids
are the server's (`return_token_ids`, which minillm and vLLM send); from a server that sends none
(llama.cpp's) they are its streamed text tokenized again with --model's tokenizer, which may part
from the ids it made; the report counts those answers.

Each round draws new conversations, so that turn 1 finds nothing cached from an earlier round, and
every server measured gets the same ones. Per round, the TTFT p50 and p99 over the clients of each
turn, and of turns 2-N together; over the --repeats rounds, each as its median and min-max, beside
the load's numbers (`serve_http_url`'s). Against the `minillm serve` child (no --url), also the
prefix cache's counters over the rounds (/metrics): how much of the resent history it found.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from minillm.benchmarks.http_client import (
    Endpoint,
    completion_body,
    model_name,
    parse_url,
    stream_completion,
)
from minillm.benchmarks.serve_child import metrics, minillm_serve, wait_idle
from minillm.benchmarks.serve_http import client_trace, clients_summary, describe_trace, duration
from minillm.benchmarks.serve_http_url import (
    ROUND_NUMBERS,
    over_rounds,
    print_rounds_table,
    print_tokens_counted,
    run_checked,
)
from minillm.benchmarks.stats import tails
from minillm.benchmarks.workload import Prose, Request, answer_ids
from minillm.report import print_table
from minillm.tokenizer import Tokenizer

MESSAGE_LEN = (16, 64)  # tokens of a user's later message, uniform: a follow-up question
MESSAGE_SEED = 1  # the messages' seed (the first prompts are the trace's, seed 0)


@dataclass(frozen=True)
class Conversation:
    first: Request  # turn 1's prompt, and every turn's output length
    messages: list[list[int]]  # the user's messages of turns 2..N, token ids


def conversations(
    tokenizer: Tokenizer, count: int, turns: int, max_tokens: int | None, prompt_tokens: int | None
) -> list[Conversation]:
    """`count` conversations of `turns` turns: first prompts from bench serve's seeded trace, later
    messages cut from the same prose at seeded lengths and offsets."""
    prose, rng = Prose(tokenizer), random.Random(MESSAGE_SEED)
    return [
        Conversation(request, [prose.cut(rng.randint(*MESSAGE_LEN), rng) for _ in range(turns - 1)])
        for request in client_trace(tokenizer, count, max_tokens, prompt_tokens)
    ]


async def converse(
    server: Endpoint, model: str, tokenizer: Tokenizer, conversation: Conversation
) -> list[dict]:
    """One conversation, each turn sent once the last answer has ended; it stops at a failed turn.
    Each turn's result is `stream_completion`'s, with its turn (from 1) and prompt length."""
    prompt, results = conversation.first.prompt_ids, []
    for turn in range(1, len(conversation.messages) + 2):
        if turn > 1:
            answer = answer_ids(tokenizer, results[-1]["text"], results[-1]["token_ids"])
            prompt = [*prompt, *answer, *conversation.messages[turn - 2]]
        body = completion_body(model, prompt, conversation.first.output_len, token_ids=True)
        result = await stream_completion(server, body)
        results.append({**result, "turn": turn, "prompt_tokens": len(prompt)})
        if result["error"] or not result["done"]:
            break
    return results


async def run_conversations(
    server: Endpoint, model: str, tokenizer: Tokenizer, talks: list[Conversation]
) -> tuple[list[dict], float]:
    """Every conversation at once. Returns every turn's result and the elapsed seconds."""
    start = time.perf_counter()
    done = await asyncio.gather(*(converse(server, model, tokenizer, talk) for talk in talks))
    return [result for results in done for result in results], time.perf_counter() - start


def by_turn(results: list[dict], turns: int) -> dict:
    """Per turn ("1", "2", ...) and for turns 2-N together: the TTFT p50/p99 over its requests and
    their mean prompt length."""
    groups = {str(turn): [r for r in results if r["turn"] == turn] for turn in range(1, turns + 1)}
    if turns > 1:
        groups[f"2-{turns}"] = [r for r in results if r["turn"] > 1]
    return {
        name: {
            **tails("ttft", [r["ttft_s"] for r in group]),
            "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in group),
        }
        for name, group in groups.items()
    }


def turns_round(
    server: Endpoint, model: str, tokenizer: Tokenizer, talks: list[Conversation], turns: int
) -> dict:
    results, elapsed = run_checked(server, run_conversations(server, model, tokenizer, talks))
    return {
        **clients_summary(results, elapsed),
        "by_turn": by_turn(results, turns),
        "answers": len(results),
        "answers_tokenized_again": sum(r["token_ids"] is None for r in results),
        "output_tokens_asked": turns * sum(talk.first.output_len for talk in talks),
    }


def bench_serve_http_turns(
    model_dir: Path,
    serve_args: list[str],
    url: str | None = None,
    clients: int = 32,
    turns: int = 4,
    max_tokens: int | None = None,
    repeats: int = 1,
    prompt_tokens: int | None = None,
) -> dict:
    tokenizer = Tokenizer(model_dir)
    drawn = conversations(tokenizer, clients * repeats + 1, turns, max_tokens, prompt_tokens)
    rounds_of = [drawn[i * clients : (i + 1) * clients] for i in range(repeats)]
    warm_up = Conversation(drawn[-1].first, [])  # one request, cached by no round
    with nullcontext(parse_url(url)) if url else minillm_serve(serve_args) as server:
        model = model_name(server)
        run_checked(server, run_conversations(server, model, tokenizer, [warm_up]))
        before = None if url else metrics(server)
        rounds = [turns_round(server, model, tokenizer, talks, turns) for talks in rounds_of]
        after = None if url else wait_idle(server)
    first = [talk.first for talk in rounds_of[0]]
    return {
        "mode": "turns",
        "url": server.url if url else None,
        "model": model,
        "serve_args": [] if url else serve_args,
        "clients": clients,
        "turns": turns,
        "repeats": repeats,
        "trace": {**describe_trace(first, max_tokens, prompt_tokens), "message_len": f"U{list(MESSAGE_LEN)}"},
        "tokens_from": " and ".join(sorted({run["tokens_from"] for run in rounds})),
        "answers": sum(run["answers"] for run in rounds),
        "answers_tokenized_again": sum(run["answers_tokenized_again"] for run in rounds),
        "spread": {name: over_rounds(rounds, name) for name in ROUND_NUMBERS},
        "by_turn": {name: turn_spread(rounds, name) for name in rounds[0]["by_turn"]},
        "prefix_cache": None if url else cache_counters(before, after),
        "rounds": rounds,
    }


def turn_spread(rounds: list[dict], name: str) -> dict:
    """One turn's TTFT p50 and p99, each as its median and min-max over the rounds, and its mean
    prompt length."""
    turn = [run["by_turn"][name] for run in rounds]
    return {
        "ttft_p50_s": over_rounds(turn, "ttft_p50_s"),
        "ttft_p99_s": over_rounds(turn, "ttft_p99_s"),
        "prompt_tokens": statistics.mean(t["prompt_tokens"] for t in turn),
    }


def cache_counters(before: dict, after: dict) -> dict:
    """The prefix cache over the rounds (/metrics): prompt tokens in full blocks looked up, and found."""
    return {
        name: after[f"prefix_cache_{name}_total"] - before[f"prefix_cache_{name}_total"]
        for name in ("queries", "hits")
    }


def print_serve_http_turns_report(report: dict, console) -> None:
    trace, where = report["trace"], report["url"] or "a minillm serve child"
    print_table(
        console,
        f"{report['clients']} conversations of {report['turns']} turns at once to {where} "
        f"({report['model']}): turn 1 a prompt of {trace['prompt_len']} tokens, each later turn the "
        f"history, its answer and a message of {trace['message_len']}; outputs {trace['output_len']} "
        f"tokens, greedy, EOS ignored; TTFT over the clients, its median and min-max over "
        f"{report['repeats']} round(s)",
        ["turn", "prompt tokens", "TTFT p50", "min-max", "TTFT p99", "min-max"],
        [
            [name, f"{turn['prompt_tokens']:.0f}", *ttft_cells(turn)]
            for name, turn in report["by_turn"].items()
        ],
    )
    print_rounds_table(console, "every turn's requests together", report)
    print_tokens_counted(report, console)
    console.print(
        f"answers resent as their text tokenized again (the server sent no token ids): "
        f"{report['answers_tokenized_again']} of {report['answers']}"
    )
    cache = report["prefix_cache"]
    if cache is not None:
        console.print(
            f"minillm serve {' '.join(report['serve_args'])}: over the rounds its prefix cache found "
            f"{cache['hits']} of the {cache['queries']} prompt tokens in full blocks it looked up (/metrics)"
        )


def ttft_cells(turn: dict) -> list[str]:
    """A turn's TTFT p50 and p99 cells: the median, then min-max."""
    cells = []
    for stat in ("ttft_p50_s", "ttft_p99_s"):
        over = turn[stat]
        cells += [duration(over["median"]), f"{duration(over['min'])} - {duration(over['max'])}"]
    return cells
