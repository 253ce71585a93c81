"""`minillm bench serve-http --workload`: `bench scheduling`'s traffic, sent to a `minillm serve` over HTTP.

The in-process replay (`benchmarks/scheduling/replay.py`) steps an engine through the trace; this
sends the same trace to a server as its clients would, so what a scheduling policy buys is seen
from outside, through HTTP, tokenization of answers and the event loop:

  1. `minillm serve` in a child process with the bench's engine flags (--admission among them);
     memory-aware admission without a --ttft-target is told the TTFT SLO as its target, as
     `bench scheduling` tells it (step 2 then runs on a server of its own first);
  2. on the idle server, the SLOs (unless given): 5 x the time to prefill the trace's longest
     prompt alone (a request of 1 token), and 5 x the time per output token of one request decoding
     alone, each the smaller of 2 tries. The probes are those prompts reversed (and rotated), so the
     prefix cache neither helps a probe nor warms the trace;
  3. every request sent at its arrival time, a chat turn THINK_S after its conversation's previous
     answer, as one streaming request to /v1/completions with the prompt as token ids, and
     `max_tokens=output_len` with `ignore_eos`, so it makes exactly the tokens the trace says. A
     chat turn's prompt is the conversation so far, the previous answer as the server made it: its
     token ids (`return_token_ids`), so the server's prefix cache holds the whole conversation, as
     in the in-process replay. A server that sends no ids gets the answer's text tokenized again,
     which may part from the ids the server cached (an EOS made under `ignore_eos` has no text; a
     word may split otherwise): how many answers would have, is counted. A failed turn's answer is
     empty;
  4. per request, from the stream: TTFT (sent -> first chunk) and TPOT (the rest of the tokens over
     the time they took); goodput is the share of requests with TTFT <= the TTFT SLO and TPOT <=
     the TPOT SLO, a failed request counting as a miss.

Unlike the in-process replay, nothing skips the server's idle time: a run lasts at least until the
last arrival. The server's connection and queue limits are raised to the trace's size, so that
every request reaches the scheduler (the in-process replay has no such limits).

With --url, the same replay against a server already running, any OpenAI-compatible one: steps 2
to 4 as above (the prompts are token ids of --model's tokenizer), but no child and none of its
flags, and no KV blocks counted at the end (/metrics is minillm's). --max-tokens makes every
request decode that many tokens instead of its own length.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from minillm.benchmarks.http_client import (
    Endpoint,
    completion_body,
    inter_token_s,
    model_name,
    parse_url,
    stream_completion,
)
from minillm.benchmarks.scheduling.trace import describe_trace, make_trace
from minillm.benchmarks.serve_child import blocks_held, metrics, minillm_serve, wait_idle
from minillm.benchmarks.serve_http import duration
from minillm.benchmarks.stats import tails
from minillm.benchmarks.workload import Request, answer_ids, next_turn_prompt
from minillm.config import ConfigError
from minillm.progress import progress_bar
from minillm.report import print_table
from minillm.tokenizer import Tokenizer

SEED, REQUESTS, RATE, SCALE = 1, 150, 1.0, 0.5  # the trace's defaults (flags of the command)
SLO_FACTOR = 5  # an SLO is this many times what a request takes on the idle server
PROBE_TRIES = 2  # each idle measurement is the smallest of this many
DECODE_PROBE_TOKENS = 32  # output tokens of the batch-1 decode probe
# the engine switches the report names (all of them are in its serve_args)
SHOWN_SWITCHES = ("admission", "ttft_target", "preemption", "prefix_caching", "max_num_seqs")


@dataclass
class Answered:
    """What one request got over HTTP."""

    kind: str
    prompt_len: int
    text: str
    token_ids: list[int] | None  # as the server made them, if it sent them
    tokens: int
    ttft_s: float | None  # request sent -> first chunk
    tpot_s: float | None  # (last chunk - first chunk) / (tokens - 1)
    error: str | None


async def send(
    server: Endpoint, model: str, prompt_ids: list[int], max_tokens: int, kind: str = ""
) -> Answered:
    """One streaming completion of exactly `max_tokens` tokens; whatever goes wrong is its error."""
    try:
        body = completion_body(model, prompt_ids, max_tokens, token_ids=True)
        result = await stream_completion(server, body)
    except (OSError, EOFError, RuntimeError, ValueError, IndexError) as err:  # refused, cut, an error event
        return Answered(kind, len(prompt_ids), "", None, 0, None, None, f"{type(err).__name__}: {err}"[:200])
    error = result["error"]  # an answer other than 200: its status and the start of its body
    if error is None and (not result["done"] or result["tokens"] != max_tokens):
        error = f"the stream ended after {result['tokens']} of {max_tokens} tokens"
    tokens, ttft, tpot = result["tokens"], result["ttft_s"], inter_token_s(result)
    return Answered(kind, len(prompt_ids), result["text"], result["token_ids"], tokens, ttft, tpot, error)


# ----------------------------------------------------------------------------- the SLOs, on the idle server


def probe_prompt(prompt_ids: list[int], turn: int) -> list[int]:
    """`prompt_ids` reversed and rotated by `turn`: as long, and sharing no KV block with it or with
    another turn's probe (their first tokens differ, and a block's key chains every token before it)."""
    backwards = prompt_ids[::-1]
    return backwards[turn:] + backwards[:turn]


async def warm_up(server: Endpoint, model: str, trace: list[Request]) -> None:
    """One short request first: a server's first calls are slow."""
    shortest = min((r.prompt_ids for r in trace if r.follows is None), key=len)
    await send(server, model, probe_prompt(shortest, len(shortest) // 2), 2)


async def idle_timings(server: Endpoint, model: str, trace: list[Request]) -> dict:
    """The prefill of the longest prompt the trace knows before it runs (a later chat turn may be
    longer), and a batch-1 decode step, each the smallest of PROBE_TRIES tries."""
    known = [r.prompt_ids for r in trace if r.follows is None]
    longest, shortest = max(known, key=len), min(known, key=len)
    await warm_up(server, model, trace)
    prefills, decodes = [], []
    for turn in range(PROBE_TRIES):
        prefills.append(await send(server, model, probe_prompt(longest, turn), 1))
        decodes.append(await send(server, model, probe_prompt(shortest, turn), DECODE_PROBE_TOKENS))
    failed = [a.error for a in prefills + decodes if a.error]
    if failed:
        raise ConfigError(f"The idle server failed a probe request: {failed[0]}")
    return {
        "longest_prompt_tokens": len(longest),
        "prefill_s": min(a.ttft_s for a in prefills),
        "decode_prompt_tokens": len(shortest),
        "decode_tpot_s": min(a.tpot_s for a in decodes),
    }


def slos(idle: dict, ttft_slo: float | None, tpot_slo: float | None) -> dict:
    """The SLOs given, else SLO_FACTOR x the idle server's timings."""
    return {
        "ttft_s": ttft_slo if ttft_slo is not None else SLO_FACTOR * idle["prefill_s"],
        "tpot_s": tpot_slo if tpot_slo is not None else SLO_FACTOR * idle["decode_tpot_s"],
        "ttft_from": "--ttft-slo" if ttft_slo is not None else f"{SLO_FACTOR} x the longest prompt's prefill",
        "tpot_from": "--tpot-slo" if tpot_slo is not None else f"{SLO_FACTOR} x a batch-1 decode step",
    }


# ----------------------------------------------------------------------------- the replay


async def replay_http(
    server: Endpoint, model: str, tokenizer: Tokenizer, trace: list[Request], progress: bool
):
    """Each arrival at its time, each chat turn THINK_S (its `arrival_s`) after its previous turn's
    answer. Returns what each request got, in trace order, and the wall seconds."""
    followers = {r.follows: index for index, r in enumerate(trace) if r.follows is not None}
    answered: list[Answered | None] = [None] * len(trace)
    start = time.perf_counter()

    async def conversation(index: int, advance) -> None:
        """One arrival, and the chat turns that follow it (a closed loop: each waits for the last)."""
        prompt, send_at = trace[index].prompt_ids, trace[index].arrival_s
        while True:
            await asyncio.sleep(max(0.0, send_at - (time.perf_counter() - start)))
            request = trace[index]
            answered[index] = await send(server, model, prompt, request.output_len, request.kind)
            advance()
            if index not in followers:
                return
            answer = resent_answer(tokenizer, answered[index])
            index = followers[index]
            prompt = next_turn_prompt(tokenizer, prompt, answer, trace[index].prompt_ids)
            send_at = time.perf_counter() - start + trace[index].arrival_s

    with progress_bar("workload over HTTP: requests", len(trace), enabled=progress) as advance:
        await asyncio.gather(
            *(conversation(index, advance) for index, r in enumerate(trace) if r.follows is None)
        )
    return answered, time.perf_counter() - start


def resent_answer(tokenizer: Tokenizer, answered: Answered) -> list[int]:
    """What a chat's next turn resends of this answer: the server's token ids, else its text
    tokenized again; nothing if it failed."""
    return [] if answered.error is not None else answer_ids(tokenizer, answered.text, answered.token_ids)


def retokenized_apart(tokenizer: Tokenizer, answered: list[Answered]) -> int:
    """Answers whose text, tokenized again, differs from the token ids the server made: each would
    have cut its conversation's cached prefix short had the client resent text."""
    return sum(
        a.token_ids is not None and tokenizer.encode(a.text) != a.token_ids
        for a in answered
        if a.error is None
    )


def served_summary(answered: list[Answered], slo: dict, wall_s: float) -> dict:
    """The table's numbers: requests, errors, goodput, TTFT and TPOT p50/p99 (of the requests
    answered), wall time."""
    ok = [a for a in answered if a.error is None]
    good = [a for a in ok if a.ttft_s <= slo["ttft_s"] and (a.tpot_s is None or a.tpot_s <= slo["tpot_s"])]
    ttfts, tpots = [a.ttft_s for a in ok], [a.tpot_s for a in ok if a.tpot_s is not None]
    return {
        "requests": len(answered),
        "errors": len(answered) - len(ok),
        "output_tokens": sum(a.tokens for a in answered),
        "goodput": len(good) / len(answered),
        **tails("ttft", ttfts),
        **tails("tpot", tpots),
        "wall_s": wall_s,
        "first_errors": sorted({a.error for a in answered if a.error})[:3],
    }


def idle_on_a_server_of_its_own(serve_args: list[str], trace) -> dict:
    """The idle timings, on a server started for them alone: memory-aware admission must be told
    the TTFT SLO they set when its server starts."""
    with minillm_serve(serve_args) as server:
        return asyncio.run(idle_timings(server, model_name(server), trace))


def limits_for(trace: list[Request]) -> list[str]:
    """Server flags that let every request of the trace in at once (the in-process replay has no
    connection or queue limit)."""
    room = str(len(trace) + 8)  # + the probes, and a margin
    return ["--max-connections", room, "--max-waiting-requests", room]


def bench_serve_http_workload(
    model_dir: Path,
    serve_args: list[str],
    switches: dict,
    seed: int = SEED,
    num_requests: int = REQUESTS,
    rate: float = RATE,
    scale: float = SCALE,
    ttft_slo: float | None = None,
    tpot_slo: float | None = None,
    progress: bool = False,
    url: str | None = None,
    max_tokens: int | None = None,
) -> dict:
    tokenizer = Tokenizer(model_dir)
    trace = make_trace(tokenizer, seed, num_requests, rate, scale)
    if max_tokens:
        trace = [replace(r, output_len=max_tokens, max_tokens=max_tokens) for r in trace]
    serve_args, idle = [*serve_args, *limits_for(trace)], None
    if not url and switches.get("admission") == "memory" and switches.get("ttft_target") is None:
        serve_args, switches, idle = told_the_target(serve_args, switches, trace, ttft_slo, tpot_slo)
    serving = nullcontext(parse_url(url)) if url else minillm_serve(serve_args)
    with serving as server:
        model = model_name(server)
        if idle is None:
            idle = asyncio.run(idle_timings(server, model, trace))
        else:
            asyncio.run(warm_up(server, model, trace))
        slo = slos(idle, ttft_slo, tpot_slo)
        before = None if url else metrics(server)
        answered, wall_s = asyncio.run(replay_http(server, model, tokenizer, trace, progress))
        after = None if url else wait_idle(server)
    ids = [a for a in answered if a.error is None and a.token_ids is not None]
    return {
        "mode": "workload",
        "url": server.url if url else None,
        "model": model,
        "serve_args": [] if url else serve_args,
        "engine": {} if url else {name: switches[name] for name in SHOWN_SWITCHES if name in switches},
        "workload": describe_trace(trace, seed, rate, scale),
        "idle": idle,
        "slo": slo,
        "served": served_summary(answered, slo, wall_s),
        "answers_with_token_ids": len(ids),
        "answers_retokenized_apart": retokenized_apart(tokenizer, answered),
        "prefix_hit_rate": None if url else replay_hit_rate(before, after),
        "blocks_held_after": None if url else blocks_held(after),
    }


def told_the_target(
    serve_args: list[str], switches: dict, trace: list, ttft_slo: float | None, tpot_slo: float | None
) -> tuple[list[str], dict, dict]:
    """Memory-aware admission without a target is told the TTFT SLO, measured first on an idle
    server of its own: the server's arguments and switches with it, and those idle timings."""
    idle = idle_on_a_server_of_its_own(serve_args, trace)
    target = slos(idle, ttft_slo, tpot_slo)["ttft_s"]
    return [*serve_args, "--ttft-target", repr(target)], {**switches, "ttft_target": target}, idle


def replay_hit_rate(before: dict, after: dict) -> float | None:
    """The prefix cache's token hit rate over the replay alone (/metrics' counters, less the probes')."""
    queried = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    return hits / queried if queried else None


def print_serve_http_workload_report(report: dict, console) -> None:
    workload, slo, idle, served = report["workload"], report["slo"], report["idle"], report["served"]
    console.print(
        f"idle server: the longest prompt ({idle['longest_prompt_tokens']} tokens) prefills in "
        f"{duration(idle['prefill_s'])}, a batch-1 decode step takes {duration(idle['decode_tpot_s'])}; "
        f"SLOs: TTFT <= {duration(slo['ttft_s'])} ({slo['ttft_from']}), TPOT <= {duration(slo['tpot_s'])} "
        f"({slo['tpot_from']})"
    )
    print_table(
        console,
        f"bench scheduling's workload over HTTP: seed {workload['seed']}, "
        f"{workload['rate_per_s']:g} arrivals/s, scale {workload['scale']:g}",
        ["requests", "errors", "goodput", "TTFT p50", "p99", "TPOT p50", "p99", "wall"],
        [
            [
                served["requests"],
                served["errors"],
                f"{served['goodput']:.0%}",
                *(duration(served[f"{name}_s"]) for name in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")),
                f"{served['wall_s']:.1f} s",
            ]
        ],
    )
    if report["url"]:
        console.print(f"the server at {report['url']}, serving {report['model']}")
    else:
        engine = ", ".join(f"{name} {value}" for name, value in report["engine"].items())
        console.print(
            f"minillm serve with {engine}; prefix cache hit rate over the replay (/metrics): "
            f"{_share(report['prefix_hit_rate'])}; KV blocks held once idle: {report['blocks_held_after']}"
        )
    console.print(
        f"answers resent as the server's token ids: {report['answers_with_token_ids']} of "
        f"{served['requests']}; answers whose text tokenizes to other ids: "
        f"{report['answers_retokenized_apart']}"
    )
    for error in served["first_errors"]:
        console.print(f"error: {error}")


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"
