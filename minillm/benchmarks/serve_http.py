"""`minillm bench serve-http`: what the HTTP server costs, against `LLM.generate` on the same prompts.

The prompts are `bench serve`'s seeded trace (prompts U[16, 320] tokens of real prose, or exactly
--prompt-tokens; outputs U[8, 160] tokens, or --max-tokens, decoded greedily to exactly that
length, EOS ignored), one per client, so both sides do the same work:
  1. `LLM.generate` on all of them in this process (no HTTP): output tok/s, time to first token;
  2. `minillm serve` in a child process (`serve_child.py`) with the same engine switches, and N
     streaming clients (default 32) sending their requests at once to /v1/completions: aggregate
     output tok/s (all clients' tokens over the time from the first request sent to the last
     [DONE]), p50 and p99 time to first token (request sent -> first text chunk), and whether
     every client got `LLM.generate`'s text; then /metrics, once idle: the KV blocks still held
     (must be 0);
  3. the same clients again, every other one disconnecting after a few chunks: the server must
     abort those (requests_aborted_total) and hold no block once the rest have finished.

Beside the aggregate, what one client sees once its first token has come, on both sides: the
inter-token latency (the rest of its tokens over the time they took) p50/p99 over the clients,
and their mean decode tok/s. The aggregate is the server's throughput; this is how fast a
single stream reads while it shares each batched step with the others.

The clients are `http_client`'s plain asyncio sockets, so that they take as little CPU as
possible from the server they measure on a small machine; `serve_http_url` sends the same load to
any OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import torch

from minillm.benchmarks.http_client import (
    Endpoint,
    completion_body,
    inter_token_s,
    model_name,
    stream_completion,
)
from minillm.benchmarks.serve import OUTPUT_LEN, PROMPT_LEN
from minillm.benchmarks.serve_child import blocks_held, metrics, minillm_serve, wait_idle
from minillm.benchmarks.stats import tails
from minillm.benchmarks.workload import Request, uniform_trace
from minillm.engine import LLM, SamplingParams
from minillm.report import print_table
from minillm.tokenizer import Tokenizer


def decode_speeds(inter_token: list[float | None]) -> dict:
    """Each client's decode once its first token has come: the inter-token latency p50/p99 over
    the clients, and the mean of their tok/s (1 / their inter-token latency)."""
    inter_token = [s for s in inter_token if s]  # a request of one token has none
    mean_tok_s = sum(1 / s for s in inter_token) / len(inter_token) if inter_token else None
    return {**tails("itl", inter_token), "decode_tok_s_per_client": mean_tok_s}


# ----------------------------------------------------------------------------- the clients


def client_trace(
    tokenizer: Tokenizer,
    clients: int,
    max_tokens: int | None = None,
    prompt_tokens: int | None = None,
    seed: int = 0,
) -> list[Request]:
    """bench serve's seeded trace, one request per client; with `max_tokens`, every output that
    long; with `prompt_tokens`, every prompt that long (a ConfigError if the text is shorter)."""
    prompt_len = (prompt_tokens, prompt_tokens) if prompt_tokens else PROMPT_LEN
    trace = uniform_trace(tokenizer, clients, prompt_len, OUTPUT_LEN, seed)
    return [replace(r, output_len=max_tokens, max_tokens=max_tokens) for r in trace] if max_tokens else trace


async def run_clients(
    server: Endpoint, model: str, trace, disconnect_after: int | None = None
) -> tuple[list[dict], float]:
    """Every request at once, one client each; every other client hangs up after
    `disconnect_after` chunks when given. Returns the results and the elapsed seconds."""
    start = time.perf_counter()
    results = await asyncio.gather(
        *[
            stream_completion(
                server,
                completion_body(model, request.prompt_ids, request.output_len),
                disconnect_after if disconnect_after is not None and i % 2 else None,
            )
            for i, request in enumerate(trace)
        ]
    )
    return results, max(r["end"] for r in results) - start


def clients_summary(results: list[dict], elapsed: float) -> dict:
    """One round of clients: aggregate output tok/s, TTFT p50/p99, each client's decode speed, and
    where the token counts came from (the server's usage, or the chunks with text)."""
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft_s"] for r in results]
    return {
        "output_tok_s": tokens / elapsed,
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        **tails("ttft", ttfts),
        **decode_speeds([inter_token_s(r) for r in results]),
        "tokens_from": " and ".join(sorted({r["tokens_from"] for r in results})),
        "all_finished": all(r["done"] and r["status"] == 200 for r in results),
    }


# ----------------------------------------------------------------------------- against LLM.generate


def run_generate(llm: LLM, trace, params) -> tuple[dict, list[str]]:
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_ids for r in trace], params)
    elapsed = time.perf_counter() - start
    ttfts = [out.ttft for out in outputs]
    return (
        {
            "output_tok_s": sum(len(out.token_ids) for out in outputs) / elapsed,
            "elapsed_s": elapsed,
            **tails("ttft", ttfts),
            **decode_speeds([out.tpot for out in outputs]),  # the same measure: the engine's clock
        },
        [out.text for out in outputs],
    )


def run_server_round(server: Endpoint, model: str, trace, expected: list[str]) -> dict:
    results, elapsed = asyncio.run(run_clients(server, model, trace))
    after = wait_idle(server)
    return {
        **clients_summary(results, elapsed),
        "outputs_match_generate": [r["text"] for r in results] == expected,
        "blocks_held_after": blocks_held(after),
    }


def best(rounds: list[dict]) -> dict:
    """The round with the most output tok/s: the machine's quietest moment (it is shared)."""
    return max(rounds, key=lambda run: run["output_tok_s"])


def trace_lengths(max_tokens: int | None = None, prompt_tokens: int | None = None) -> dict:
    """The trace's prompt and output lengths, as the reports write them."""
    return {
        "prompt_len": str(prompt_tokens) if prompt_tokens else f"U{list(PROMPT_LEN)}",
        "output_len": str(max_tokens) if max_tokens else f"U{list(OUTPUT_LEN)}",
    }


def describe_trace(trace, max_tokens: int | None = None, prompt_tokens: int | None = None) -> dict:
    """One trace sent every round, seed 0."""
    return {
        "prompt_tokens": sum(len(r.prompt_ids) for r in trace),
        "output_tokens": sum(r.output_len for r in trace),
        **trace_lengths(max_tokens, prompt_tokens),
        "seed": 0,
    }


def disconnect_summary(left: list[dict], clients: int, after_disconnect: dict, aborted_before: float) -> dict:
    """The round where some clients hang up: were their requests aborted, did the others finish,
    and what the server held once idle."""
    hung_up = sum(1 for r in left if not r["done"])
    return {
        "clients_hung_up": hung_up,
        "requests_aborted": after_disconnect["requests_aborted_total"] - aborted_before,
        "others_finished": sum(1 for r in left if r["done"]) == clients - hung_up,
        "blocks_held_after": blocks_held(after_disconnect),
        "requests_left": after_disconnect["num_requests_running"] + after_disconnect["num_requests_waiting"],
    }


def bench_serve_http(
    model_dir: Path,
    serve_args: list[str],
    switches: dict,
    clients: int = 32,
    disconnect_after: int = 4,
    repeats: int = 1,
    max_tokens: int | None = None,
    prompt_tokens: int | None = None,
) -> dict:
    trace = client_trace(Tokenizer(model_dir), clients, max_tokens, prompt_tokens)
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in trace]
    llm = LLM(model_dir, **switches)
    llm.generate([trace[0].prompt_ids], SamplingParams(max_tokens=4))  # warm-up
    generate_rounds, server_rounds = [], []
    with minillm_serve(serve_args) as server:
        model = model_name(server)
        asyncio.run(run_clients(server, model, trace[:1]))  # warm-up
        for _ in range(repeats):  # interleaved, so a busy moment on a shared machine hits both sides alike
            generate, expected = run_generate(llm, trace, params)  # the server is idle meanwhile
            generate_rounds.append(generate)
            server_rounds.append(run_server_round(server, model, trace, expected))
        aborted_before = metrics(server)["requests_aborted_total"]
        left, _ = asyncio.run(run_clients(server, model, trace, disconnect_after))
        after_disconnect = wait_idle(server)
    generate, served = best(generate_rounds), best(server_rounds)
    matched = all(run["outputs_match_generate"] and run["all_finished"] for run in server_rounds)
    return {
        "clients": clients,
        "model": model,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "trace": describe_trace(trace, max_tokens, prompt_tokens),
        "serve_args": serve_args,
        "llm_generate": generate,
        "server": served,
        "server_vs_generate": served["output_tok_s"] / generate["output_tok_s"],
        "rounds": {
            "llm_generate_tok_s": [run["output_tok_s"] for run in generate_rounds],
            "server_tok_s": [run["output_tok_s"] for run in server_rounds],
        },
        "all_rounds_match_generate": matched,
        "blocks_held_after_all_finished": max(run["blocks_held_after"] for run in server_rounds),
        "disconnect": disconnect_summary(left, clients, after_disconnect, aborted_before),
        "blocks_total": after_disconnect["kv_blocks_total"],
    }


def duration(seconds: float | None) -> str:
    """3 significant digits, in ms below a second; "-" for none."""
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def per_client(side: dict) -> list[str]:
    """A row's last cells: what one client saw once its first token had come."""
    tok_s = side["decode_tok_s_per_client"]
    return [
        duration(side["itl_p50_s"]),
        duration(side["itl_p99_s"]),
        "-" if tok_s is None else f"{tok_s:.1f}",
    ]


PER_CLIENT_COLUMNS = ["ITL p50", "ITL p99", "tok/s per client"]


def print_serve_http_report(report: dict, console) -> None:
    trace, gen, srv = report["trace"], report["llm_generate"], report["server"]
    print_table(
        console,
        f"{report['clients']} streaming clients at once (prompts {trace['prompt_len']}, "
        f"outputs {trace['output_len']} tokens, greedy), {report['torch_threads']} torch "
        f"thread(s), best of {report['repeats']} interleaved rounds",
        ["", "output tok/s", "elapsed", "TTFT p50", "TTFT p99", *PER_CLIENT_COLUMNS],
        [
            [
                "LLM.generate (one process)",
                f"{gen['output_tok_s']:.1f}",
                f"{gen['elapsed_s']:.1f} s",
                f"{gen['ttft_p50_s']:.2f} s",
                f"{gen['ttft_p99_s']:.2f} s",
                *per_client(gen),
            ],
            [
                "minillm serve + HTTP clients",
                f"{srv['output_tok_s']:.1f}",
                f"{srv['elapsed_s']:.1f} s",
                f"{srv['ttft_p50_s']:.2f} s",
                f"{srv['ttft_p99_s']:.2f} s",
                *per_client(srv),
            ],
        ],
    )
    console.print(
        f"server / LLM.generate: {report['server_vs_generate']:.0%} (target >= 80%); every client got "
        f"LLM.generate's text: {report['all_rounds_match_generate']}; KV blocks held after all finished: "
        f"{report['blocks_held_after_all_finished']} of {report['blocks_total']}"
    )
    rounds = report["rounds"]
    console.print(
        "every round's tok/s: LLM.generate "
        + ", ".join(f"{x:.1f}" for x in rounds["llm_generate_tok_s"])
        + "; server "
        + ", ".join(f"{x:.1f}" for x in rounds["server_tok_s"])
    )
    left = report["disconnect"]
    console.print(
        f"{left['clients_hung_up']} clients hung up mid-stream: {left['requests_aborted']} requests aborted, "
        f"the others finished: {left['others_finished']}; KV blocks held after: "
        f"{left['blocks_held_after']}, requests left: {left['requests_left']}"
    )
