"""`minillm bench serve-http --url`: bench serve-http's clients against any OpenAI-compatible server.

`vllm bench serve` measures whatever server a URL names; this does the same with bench
serve-http's load, so that minillm and another engine (llama.cpp's server, vLLM, a `minillm
serve` started by hand) are compared with one command each, on the same machine and the same
requests: bench serve's seeded trace, one prompt per client (U[16, 320] tokens of prose, or
exactly --prompt-tokens), sent at once as token ids of --model's tokenizer (the server should
serve the same model, or one with its vocabulary), each decoding exactly its output length
(`ignore_eos`), or --max-tokens.

Both servers keep prompts: minillm's prefix cache, llama.cpp's slots. A round that resent an
earlier round's prompts would time a cache hit, not a prefill, so every round draws its own: the
warm-up the trace of seed 0, round i (from 1) that of seed i. Every server gets the same ones.

Per round: aggregate output tok/s, TTFT p50/p99, and per client the inter-token latency p50/p99
and mean decode tok/s. On a shared machine one round is noisy, so with --repeats every round is
kept and the report gives each number's median and its min-max over the rounds.

What needs a minillm server is left out: no `LLM.generate` to compare texts with, no /metrics (KV
blocks held, requests aborted), so no round of clients hanging up either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path

from minillm.benchmarks.http_client import Endpoint, model_name, parse_url
from minillm.benchmarks.serve_http import (
    PER_CLIENT_COLUMNS,
    client_trace,
    clients_summary,
    duration,
    run_clients,
    trace_lengths,
)
from minillm.benchmarks.stats import spread
from minillm.config import ConfigError
from minillm.report import print_table
from minillm.tokenizer import Tokenizer

# a round's numbers, each with how the table writes it; the report gives their median and min-max
ROUND_NUMBERS = {
    "output_tok_s": "{:.1f}".format,
    "elapsed_s": duration,
    "ttft_p50_s": duration,
    "ttft_p99_s": duration,
    "itl_p50_s": duration,
    "itl_p99_s": duration,
    "decode_tok_s_per_client": "{:.1f}".format,
}


def run_checked(server: Endpoint, clients: Coroutine) -> tuple[list[dict], float]:
    """Run `clients` (a coroutine giving every request's result and the elapsed seconds); a request
    that fails stops the benchmark with what the server said."""
    try:
        results, elapsed = asyncio.run(clients)
    except (OSError, EOFError, RuntimeError, ValueError, IndexError) as err:  # refused, cut, an error event
        raise ConfigError(
            f"a request to {server.url}/v1/completions failed: {type(err).__name__}: {err}"
        ) from None
    failed = [r for r in results if r["error"] or not r["done"]]
    if failed:
        raise ConfigError(
            f"{len(failed)} of {len(results)} requests to {server.url}/v1/completions failed, the first: "
            + (failed[0]["error"] or "its stream ended before [DONE]")
        )
    return results, elapsed


def run_round(server: Endpoint, model: str, trace) -> dict:
    """Every client at once."""
    return {
        **clients_summary(*run_checked(server, run_clients(server, model, trace))),
        "prompt_tokens": sum(len(r.prompt_ids) for r in trace),
        "output_tokens_asked": sum(r.output_len for r in trace),
    }


def over_rounds(rounds: list[dict], name: str) -> dict | None:
    """One number's median, min and max over the rounds (None where a round has none)."""
    values = [run[name] for run in rounds]
    return None if None in values else spread(values)


def bench_serve_http_url(
    model_dir: Path,
    url: str,
    clients: int = 32,
    max_tokens: int | None = None,
    repeats: int = 1,
    prompt_tokens: int | None = None,
) -> dict:
    server = parse_url(url)
    tokenizer = Tokenizer(model_dir)
    warm_up = client_trace(tokenizer, 1, max_tokens, prompt_tokens, seed=0)
    seeds = list(range(1, repeats + 1))  # a round's own prompts: none is cached by an earlier one
    traces = [client_trace(tokenizer, clients, max_tokens, prompt_tokens, seed) for seed in seeds]
    model = model_name(server)
    run_round(server, model, warm_up)
    rounds = [run_round(server, model, trace) for trace in traces]
    return {
        "mode": "url",
        "url": server.url,
        "model": model,
        "clients": clients,
        "repeats": repeats,
        "trace": {**trace_lengths(max_tokens, prompt_tokens), "seeds": {"warm_up": 0, "rounds": seeds}},
        "tokens_from": " and ".join(sorted({run["tokens_from"] for run in rounds})),
        "spread": {name: over_rounds(rounds, name) for name in ROUND_NUMBERS},
        "rounds": rounds,
    }


def row(spreads: dict, pick: str) -> list[str]:
    """The table's cells: every number's median, min or max over the rounds."""
    return [show(spreads[name][pick]) if spreads[name] else "-" for name, show in ROUND_NUMBERS.items()]


def print_rounds_table(console, title: str, report: dict) -> None:
    """The round's numbers (ROUND_NUMBERS): their median, and with --repeats their min and max."""
    repeats = report["repeats"]
    rows = [[f"median of {repeats} rounds" if repeats > 1 else "1 round", *row(report["spread"], "median")]]
    if repeats > 1:
        rows += [[pick, *row(report["spread"], pick)] for pick in ("min", "max")]
    print_table(
        console, title, ["", "output tok/s", "elapsed", "TTFT p50", "TTFT p99", *PER_CLIENT_COLUMNS], rows
    )


def print_serve_http_url_report(report: dict, console) -> None:
    trace = report["trace"]
    print_rounds_table(
        console,
        f"{report['clients']} streaming clients at once to {report['url']} ({report['model']}): prompts "
        f"{trace['prompt_len']}, outputs {trace['output_len']} tokens, greedy, EOS ignored",
        report,
    )
    print_tokens_counted(report, console)


def print_tokens_counted(report: dict, console) -> None:
    """How many output tokens each round got, and where the count came from."""
    counted = {
        "usage": "from the server's usage",
        "chunks": "as the chunks with text (the server sent no usage; one token a chunk)",
    }.get(report["tokens_from"], "from usage where the server sent it, else the chunks with text")
    got = [f"{run['output_tokens']} of {run['output_tokens_asked']}" for run in report["rounds"]]
    console.print(f"output tokens per round: {', '.join(got)} asked, counted {counted}")
