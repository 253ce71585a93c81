"""`minillm bench serve-http`: what the HTTP server costs, against `LLM.generate` on the same prompts.

The prompts are `bench serve`'s seeded trace (prompts U[16, 320] tokens of real prose, outputs
U[8, 160] tokens decoded greedily to exactly that length, EOS ignored), one per client, so both
sides do the same work:
  1. `LLM.generate` on all of them in this process (no HTTP): output tok/s, time to first token;
  2. `minillm serve` in a child process with the same engine switches, and N streaming clients
     (default 32) sending their requests at once to /v1/completions: aggregate output tok/s (all
     clients' tokens over the time from the first request sent to the last [DONE]), p50 and p99
     time to first token (request sent -> first text chunk), and whether every client got
     `LLM.generate`'s text; then /metrics, once idle: the KV blocks still held (must be 0);
  3. the same clients again, every other one disconnecting after a few chunks: the server must
     abort those (requests_aborted_total) and hold no block once the rest have finished.

The clients are plain asyncio sockets (HTTP/1.1, server-sent events read by hand), so that they
take as little CPU as possible from the server they measure on a small machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from minillm.benchmarks.serve import make_trace
from minillm.config import ConfigError
from minillm.engine import LLM, SamplingParams
from minillm.report import print_table
from minillm.tokenizer import Tokenizer


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value that at least q% of the values are <= to."""
    values = sorted(values)
    return values[max(0, -(-len(values) * q // 100) - 1)]


async def post_stream(port: int, body: dict) -> tuple:
    """POST body to /v1/completions on 127.0.0.1 and read the status line and headers. Returns
    (reader, writer, the moment it was sent, the status, whether the body is chunked)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(payload), payload)
    )
    sent = time.perf_counter()
    status = (await reader.readline()).split(b" ")[1]
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
    return reader, writer, sent, int(status), chunked


async def stream_completion(port: int, body: dict, disconnect_after: int | None = None) -> dict:
    """POST body (with "stream": true) to /v1/completions on 127.0.0.1 and read the events; with
    `disconnect_after`, hang up after that many text chunks. Returns text, tokens, timings."""
    reader, writer, sent, status, chunked = await post_stream(port, body)
    result = {
        "status": status,
        "text": "",
        "tokens": 0,
        "ttft_s": None,
        "chunks": 0,
        "done": False,
        "sent": sent,
    }
    buffer = b""
    try:
        while not result["done"]:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                buffer += await reader.readexactly(size)
                await reader.readline()
            else:
                data = await reader.read(65536)
                if not data:
                    break
                buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    result["done"] = True
                    break
                message = json.loads(data)
                if "error" in message:
                    raise RuntimeError(message["error"]["message"])
                if message.get("usage"):
                    result["tokens"] = message["usage"]["completion_tokens"]
                for choice in message["choices"]:
                    # the first chunk: the first token's text, or the end of an answer without text
                    if result["ttft_s"] is None:
                        result["ttft_s"] = time.perf_counter() - sent
                    result["text"] += choice["text"]
                    result["chunks"] += 1
                if disconnect_after is not None and result["chunks"] >= disconnect_after:
                    return result
    finally:
        result["end"] = time.perf_counter()
        writer.close()
    return result


def get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as response:
        return response.read()


def metrics(port: int) -> dict:
    from minillm.serve.metrics import parse_metrics

    return parse_metrics(get(port, "/metrics").decode())


def wait_idle(port: int, timeout: float = 120) -> dict:
    """/metrics once nothing runs or waits (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(port)
        if (
            values["num_requests_running"] == values["num_requests_waiting"] == 0
            or time.monotonic() > deadline
        ):
            return values
        time.sleep(0.1)


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def start_server(serve_args: list[str], port: int) -> subprocess.Popen:
    """`minillm serve` in a child process; returns once /health answers."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minillm.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *serve_args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ},
    )
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            raise ConfigError(f"minillm serve exited: {server.stderr.read().decode().strip()[-500:]}")
        try:
            get(port, "/health")
            return server
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise ConfigError("minillm serve did not answer /health within 300 s.") from None
            time.sleep(0.2)


def blocks_held(values: dict) -> int:
    return values["kv_blocks"]["private"] + values["kv_blocks"]["shared"]


async def run_clients(
    port: int, model: str, trace, disconnect_after: int | None = None
) -> tuple[list[dict], float]:
    """Every request at once, one client each; every other client hangs up after
    `disconnect_after` chunks when given. Returns the results and the elapsed seconds."""
    start = time.perf_counter()
    results = await asyncio.gather(
        *[
            stream_completion(
                port,
                {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": n,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
                disconnect_after if disconnect_after is not None and i % 2 else None,
            )
            for i, (prompt, n) in enumerate(trace)
        ]
    )
    return results, max(r["end"] for r in results) - start


def run_generate(llm: LLM, trace, params) -> tuple[dict, list[str]]:
    start = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in trace], params)
    elapsed = time.perf_counter() - start
    ttfts = [out.ttft for out in outputs]
    return (
        {
            "output_tok_s": sum(len(out.token_ids) for out in outputs) / elapsed,
            "elapsed_s": elapsed,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
        },
        [out.text for out in outputs],
    )


def run_server_round(port: int, model: str, trace, expected: list[str]) -> dict:
    results, elapsed = asyncio.run(run_clients(port, model, trace))
    after = wait_idle(port)
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft_s"] for r in results]
    return {
        "output_tok_s": tokens / elapsed,
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "all_finished": all(r["done"] and r["status"] == 200 for r in results),
        "outputs_match_generate": [r["text"] for r in results] == expected,
        "blocks_held_after": blocks_held(after),
    }


def best(rounds: list[dict]) -> dict:
    """The round with the most output tok/s: the machine's quietest moment (it is shared)."""
    return max(rounds, key=lambda run: run["output_tok_s"])


def describe_trace(trace) -> dict:
    return {
        "prompt_tokens": sum(len(p) for p, _ in trace),
        "output_tokens": sum(n for _, n in trace),
        "prompt_len": "U[16, 320]",
        "output_len": "U[8, 160]",
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
) -> dict:
    tokenizer = Tokenizer(model_dir)
    trace = make_trace(tokenizer, clients)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in trace]
    llm = LLM(model_dir, **switches)
    llm.generate([trace[0][0]], SamplingParams(max_tokens=4))  # warm-up
    port = free_port()
    server = start_server(serve_args, port)
    generate_rounds, server_rounds = [], []
    try:
        model = json.loads(get(port, "/v1/models"))["data"][0]["id"]
        asyncio.run(run_clients(port, model, trace[:1]))  # warm-up
        for _ in range(repeats):  # interleaved, so a busy moment on a shared machine hits both sides alike
            generate, expected = run_generate(llm, trace, params)  # the server is idle meanwhile
            generate_rounds.append(generate)
            server_rounds.append(run_server_round(port, model, trace, expected))
        aborted_before = metrics(port)["requests_aborted_total"]
        left, _ = asyncio.run(run_clients(port, model, trace, disconnect_after))
        after_disconnect = wait_idle(port)
    finally:
        server.terminate()
        server.wait(timeout=60)
    generate, served = best(generate_rounds), best(server_rounds)
    matched = all(run["outputs_match_generate"] and run["all_finished"] for run in server_rounds)
    return {
        "clients": clients,
        "model": model,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "trace": describe_trace(trace),
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


def print_serve_http_report(report: dict, console) -> None:
    trace, gen, srv = report["trace"], report["llm_generate"], report["server"]
    print_table(
        console,
        f"{report['clients']} streaming clients at once (prompts {trace['prompt_len']}, "
        f"outputs {trace['output_len']} tokens, greedy), {report['torch_threads']} torch "
        f"thread(s), best of {report['repeats']} interleaved rounds",
        ["", "output tok/s", "elapsed", "TTFT p50", "TTFT p99"],
        [
            [
                "LLM.generate (one process)",
                f"{gen['output_tok_s']:.1f}",
                f"{gen['elapsed_s']:.1f} s",
                f"{gen['ttft_p50_s']:.2f} s",
                f"{gen['ttft_p99_s']:.2f} s",
            ],
            [
                "minillm serve + HTTP clients",
                f"{srv['output_tok_s']:.1f}",
                f"{srv['elapsed_s']:.1f} s",
                f"{srv['ttft_p50_s']:.2f} s",
                f"{srv['ttft_p99_s']:.2f} s",
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
