"""`minillm bench tiers`: what the KV tiers buy, three questions measured side by side in one run.

1. Preemption: recompute, swap or auto? A seeded trace of N requests (default 64; prompts
   U[16, 96] tokens of real prose, outputs U[8, 40], decoded greedily to exactly that length)
   arrives over time (exponential gaps, --rate requests per second) at an engine whose device KV
   pool is far too small for the requests that run at once, behind a host pool that can hold them
   all. The three rows differ only in what a preemption does: *recompute* throws the victim's KV
   away and prefills it again; *swap* copies its blocks to the host pool and back (the next one to
   run is prefetched behind a forward pass); *auto* asks the measured cost model per victim. All
   three are lossless, so their greedy outputs must be identical — checked, not assumed.
2. Resume: a ~2,000-token chat (turns cut from real prose, in the chat template) answered by a
   fresh engine that prefills the whole history, which then parks the history in a session file;
   a second fresh engine loads it and answers the same turn, prefilling only the new turn.
3. Prefix spill: requests pick among more distinct system prompts than the device pool holds,
   one after another, with the prefix cache on. Without a host tier a prompt pushed out of the
   device LRU is gone; with one it spills there and a later request copies it back.

Idle time in the trace is skipped: when nothing runs and the next request has not arrived yet,
the clock jumps to its arrival, so a run costs only compute and tok/s is over busy time. Beside
it each row reports the CPU seconds the process spent: on a machine shared with other work, wall
time moves with the neighbours' load and CPU time much less. Targets are printed beside the
numbers, never asserted: a timing is a measurement, not a test.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from minillm.benchmarks import cpu_model
from minillm.config import DTYPES, ConfigError, EngineConfig
from minillm.engine import LLM, SamplingParams
from minillm.evaluation import read_text
from minillm.progress import progress_bar
from minillm.report import print_table
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

BLOCK_SIZE = EngineConfig.block_size
PROMPT_LEN, OUTPUT_LEN = (16, 96), (8, 40)  # tokens, uniform; the preemption trace
SEED = 0
TURN_TOKENS = 200  # tokens of prose per turn of the resumed conversation
NEW_TURN = "Thank you. In one sentence, what happened in the last part?"
ANSWER_TOKENS = 16
SPILL_ANSWER_TOKENS = 4


# ----------------------------------------------------------------------------- 1. preemption


@dataclass
class Request:
    prompt_ids: list[int]
    output_len: int
    arrival_s: float  # seconds after the trace starts


def make_trace(tokenizer: Tokenizer, num_requests: int, rate: float) -> list[Request]:
    """Prompts cut at random offsets from real prose; exponential gaps of mean 1/rate seconds."""
    text_ids = tokenizer.encode(read_text())
    rng = random.Random(SEED)
    trace, arrival = [], 0.0
    for _ in range(num_requests):
        prompt_len = rng.randint(*PROMPT_LEN)
        start = rng.randrange(len(text_ids) - prompt_len)
        trace.append(Request(text_ids[start : start + prompt_len], rng.randint(*OUTPUT_LEN), arrival))
        arrival += rng.expovariate(rate)
    return trace


def submit(engine, index: int, request: Request, arrival_time: float) -> None:
    """A trace request into the engine: decoded to exactly its output length, EOS ignored."""
    engine.add_request(
        request.prompt_ids,
        SamplingParams(max_tokens=request.output_len, ignore_eos=True),
        request_id=str(index),
        arrival_time=arrival_time,
    )


def run_trace(
    engine, trace: list, label: str, progress: bool, watch=None, add=submit
) -> tuple[list, float, float]:
    """Step the engine, adding each request once its arrival time has passed (with that time, so
    its TTFT counts the wait). Returns the finished outputs in trace order, the busy seconds, and
    the CPU seconds this process spent (which other work on a shared machine does not inflate).
    `watch(engine)`, if given, is called after every step (a caller's own accounting); `add` puts
    a request in (`submit` by default)."""
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


def percentile(values: list[float], pct: int) -> float:
    """Nearest rank: the smallest value that pct% of the values are <= to (never interpolated)."""
    rank = -(-pct * len(values) // 100)  # ceil(pct n / 100), in integers so no float rounding moves it
    return sorted(values)[rank - 1]


def preemption_row(engine, outputs: list, elapsed: float, cpu_s: float) -> dict:
    memory = engine.snapshot()
    counters = memory.counters
    ttft = [out.ttft for out in outputs if out.ttft is not None]
    hidden = 1 - memory.prefetch_waited / memory.prefetch_seconds if memory.prefetch_seconds else None
    return {
        "output_tok_s": sum(len(out.token_ids) for out in outputs) / elapsed,
        "elapsed_s": elapsed,
        "cpu_s": cpu_s,
        "steps": engine.stats.steps,
        "errors": sum(out.error is not None for out in outputs),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "preemptions": counters["preemptions"],
        "recomputed_tokens": counters["recomputed_tokens"],
        "swapped_out": counters["swapped_out"],
        "swapped_in": counters["swapped_in"],
        "bytes_moved": memory.stats.bytes_moved,
        "prefetched": counters["prefetched"],
        "prefetch_copy_s": memory.prefetch_seconds,
        "prefetch_waited_s": memory.prefetch_waited,
        "prefetch_hidden": hidden,
    }


def bench_preemption(
    model, tokenizer, num_requests: int, rate: float, device_tokens: int, switches: dict, progress: bool
) -> dict:
    trace = make_trace(tokenizer, num_requests, rate)
    longest = max(len(r.prompt_ids) + r.output_len for r in trace)
    if blocks_for(device_tokens) < blocks_for(longest):
        raise ConfigError(
            f"--device-tokens {device_tokens} cannot hold the trace's longest request ({longest} "
            "tokens); raise it."
        )
    device_bytes = pool_bytes(model, device_tokens)
    host_bytes = pool_bytes(
        model, sum(len(r.prompt_ids) + r.output_len + BLOCK_SIZE for r in trace)
    )  # all of it
    rows, outputs = {}, {}
    for preemption in ("recompute", "swap", "auto"):
        llm = LLM(
            model=model,
            tokenizer=tokenizer,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=device_bytes,
            host_cache_bytes=host_bytes,
            preemption=preemption,
            **switches,
        )
        finished, elapsed, cpu_s = run_trace(llm.engine, trace, preemption, progress)
        rows[preemption] = preemption_row(llm.engine, finished, elapsed, cpu_s)
        outputs[preemption] = [out.token_ids for out in finished]
    differing = sum(any(ids != answers[0] for ids in answers) for answers in zip(*outputs.values()))
    return {
        "trace": {
            "requests": num_requests,
            "rate_per_s": rate,
            "seed": SEED,
            "prompt_len": f"U{list(PROMPT_LEN)}",
            "output_len": f"U{list(OUTPUT_LEN)}",
            "prompt_tokens": sum(len(r.prompt_ids) for r in trace),
            "output_tokens": sum(r.output_len for r in trace),
            "last_arrival_s": trace[-1].arrival_s,
        },
        "device_kv_bytes": device_bytes,
        "device_blocks": blocks_for(device_tokens),
        "host_kv_bytes": host_bytes,
        "rows": rows,
        "outputs_identical": differing == 0,
        "requests_differing": differing,
    }


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def pool_bytes(model, num_tokens: int) -> int:
    """kv_cache_bytes that buys whole blocks for `num_tokens` tokens, in the model's dtype."""
    return blocks_for(num_tokens) * BLOCK_SIZE * model.config.kv_bytes_per_token(model.dtype)


# ----------------------------------------------------------------------------- 2. resume


def conversation(tokenizer: Tokenizer, history_tokens: int) -> tuple[list[int], list[int]]:
    """(history, prompt): turns of real prose, user and assistant by turns, at least
    `history_tokens` long in the chat template; the prompt adds one user turn and the cue to answer."""
    text_ids = tokenizer.encode(read_text())
    messages: list[dict[str, str]] = []
    history = tokenizer.encode_chat(messages, add_generation_prompt=False)
    for start in range(0, len(text_ids), TURN_TOKENS):
        if len(history) >= history_tokens:
            break
        role = "user" if len(messages) % 2 == 0 else "assistant"
        messages.append({"role": role, "content": tokenizer.decode(text_ids[start : start + TURN_TOKENS])})
        history = tokenizer.encode_chat(messages, add_generation_prompt=False)
    if len(history) < history_tokens:
        raise ConfigError(
            f"The text holds {len(text_ids)} tokens, too few for a {history_tokens}-token "
            "conversation; lower --history-tokens."
        )
    return history, tokenizer.encode_chat(messages + [{"role": "user", "content": NEW_TURN}])


def answer(llm: LLM, prompt: list[int]) -> tuple[dict, list[int]]:
    """The engine's only request: its TTFT and prefill tokens computed, and the answer's tokens."""
    out = llm.generate([prompt], SamplingParams(max_tokens=ANSWER_TOKENS, ignore_eos=True))[0]
    stats = llm.engine.stats
    return {
        "ttft_s": out.ttft,
        "prefill_tokens_computed": stats.tokens_computed - stats.tokens_generated + 1,
    }, out.token_ids


def bench_resume(model, tokenizer, history_tokens: int, switches: dict) -> dict:
    history, prompt = conversation(tokenizer, history_tokens)
    if len(prompt) + ANSWER_TOKENS > model.config.max_position_embeddings:
        raise ConfigError(
            f"--history-tokens {history_tokens} makes a {len(prompt)}-token prompt, longer than the "
            f"model's context ({model.config.max_position_embeddings}); lower it."
        )
    kv_bytes = pool_bytes(model, len(prompt) + ANSWER_TOKENS)

    def fresh() -> LLM:
        return LLM(
            model=model,
            tokenizer=tokenizer,
            block_size=BLOCK_SIZE,
            prefix_caching=True,
            kv_cache_bytes=kv_bytes,
            **switches,
        )

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "conversation.safetensors"
        parking = fresh()
        recomputed, recomputed_ids = answer(parking, prompt)
        start = time.perf_counter()
        session_tokens = parking.engine.save_session(path, history)
        save_s = time.perf_counter() - start
        resuming = fresh()
        start = time.perf_counter()
        resuming.engine.load_session(path)
        load_s = time.perf_counter() - start
        resumed, resumed_ids = answer(resuming, prompt)
        file_bytes = path.stat().st_size
    return {
        "history_tokens": len(history),
        "prompt_tokens": len(prompt),
        "answer_tokens": ANSWER_TOKENS,
        "session_tokens": session_tokens,
        "session_file_bytes": file_bytes,
        "save_s": save_s,
        "load_s": load_s,
        "recompute": recomputed,
        "resume": resumed,
        "answers_identical": recomputed_ids == resumed_ids,
        "ttft_ratio": recomputed["ttft_s"] / resumed["ttft_s"],
        "ttft_ratio_with_load": recomputed["ttft_s"] / (resumed["ttft_s"] + load_s),
    }


# ----------------------------------------------------------------------------- 3. prefix spill


def spill_prompts(
    tokenizer: Tokenizer, num_systems: int, system_tokens: int, num_requests: int
) -> list[list[int]]:
    """Each request: one of `num_systems` system prompts (consecutive stretches of real prose),
    drawn at random (seeded), and its own short question."""
    text_ids = tokenizer.encode(read_text())
    if num_systems * system_tokens > len(text_ids):
        raise ConfigError(
            f"The text holds {len(text_ids)} tokens, too few for {num_systems} system prompts of "
            f"{system_tokens}; lower --system-prompts or --system-tokens."
        )
    systems = [
        tokenizer.decode(text_ids[i * system_tokens : (i + 1) * system_tokens]) for i in range(num_systems)
    ]
    rng = random.Random(SEED)
    return [
        tokenizer.encode_chat(
            [
                {"role": "system", "content": systems[rng.randrange(num_systems)]},
                {"role": "user", "content": f"Question {i}: what happens next?"},
            ]
        )
        for i in range(num_requests)
    ]


def spill_row(
    model,
    tokenizer,
    prompts: list[list[int]],
    device_bytes: int,
    host_bytes: int,
    switches: dict,
    label: str,
    progress: bool,
) -> tuple[dict, list[list[int]]]:
    """The requests one after another (each arrives when the last has finished)."""
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        block_size=BLOCK_SIZE,
        prefix_caching=True,
        kv_cache_bytes=device_bytes,
        host_cache_bytes=host_bytes,
        **switches,
    )
    params = SamplingParams(max_tokens=SPILL_ANSWER_TOKENS, ignore_eos=True)
    outputs = []
    with progress_bar(f"spill, {label}: requests", len(prompts), enabled=progress) as advance:
        for prompt in prompts:
            outputs += llm.generate([prompt], params)
            advance()
    stats, memory = llm.engine.stats, llm.engine.snapshot()
    row = {
        "ttft_mean_s": statistics.fmean(out.ttft for out in outputs),
        "prefill_tokens_computed": stats.tokens_computed - stats.tokens_generated + len(prompts),
        "spilled": memory.counters["spilled"],
        "spill_hits": memory.counters["spill_hits"],
        "bytes_moved": memory.stats.bytes_moved,
        "prefix_cache": memory.prefix_cache,
    }
    return row, [out.token_ids for out in outputs]


def bench_spill(
    model,
    tokenizer,
    num_systems: int,
    system_tokens: int,
    num_requests: int,
    pool_prompts: float,
    switches: dict,
    progress: bool,
) -> dict:
    prompts = spill_prompts(tokenizer, num_systems, system_tokens, num_requests)
    request_tokens = max(map(len, prompts)) + SPILL_ANSWER_TOKENS
    device_tokens = max(round(pool_prompts * request_tokens), request_tokens)
    device_bytes = pool_bytes(model, device_tokens)
    host_bytes = pool_bytes(model, num_systems * (request_tokens + BLOCK_SIZE))  # every system prompt fits
    without, without_ids = spill_row(
        model, tokenizer, prompts, device_bytes, 0, switches, "no host tier", progress
    )
    with_host, with_ids = spill_row(
        model, tokenizer, prompts, device_bytes, host_bytes, switches, "host tier", progress
    )
    saved = [row["prefix_cache"]["prefill_tokens_saved"] for row in (without, with_host)]
    return {
        "requests": num_requests,
        "system_prompts": num_systems,
        "system_tokens": system_tokens,
        "prompt_tokens_mean": statistics.fmean(map(len, prompts)),
        "device_kv_bytes": device_bytes,
        "device_blocks": blocks_for(device_tokens),
        "host_kv_bytes": host_bytes,
        "without_host": without,
        "with_host": with_host,
        "answers_identical": without_ids == with_ids,
        "prefill_saved_ratio": saved[1] / saved[0] if saved[0] else None,
    }


# ----------------------------------------------------------------------------- the whole run


def targets(preemption: dict, resume: dict, spill: dict) -> dict:
    """What the tiers should buy, beside what they bought this run (printed, never asserted)."""
    rows = preemption["rows"]
    best = max(rows["recompute"]["output_tok_s"], rows["swap"]["output_tok_s"])
    hidden = rows["swap"]["prefetch_hidden"]
    saved = [spill[row]["prefix_cache"]["prefill_tokens_saved"] for row in ("without_host", "with_host")]
    return {
        "auto_vs_best_tok_s": {
            "want": ">= 1.0",
            "got": rows["auto"]["output_tok_s"] / best,
            "met": rows["auto"]["output_tok_s"] >= best,
        },
        "swap_recomputed_tokens": {
            "want": "0",
            "got": rows["swap"]["recomputed_tokens"],
            "met": rows["swap"]["recomputed_tokens"] == 0,
        },
        "swap_prefetch_hidden": {
            "want": ">= 0.5",
            "got": hidden,
            "met": hidden is not None and hidden >= 0.5,
        },
        "resume_ttft_ratio": {
            "want": ">= 10",
            "got": resume["ttft_ratio"],
            "met": resume["ttft_ratio"] >= 10,
        },
        "spill_prefill_saved_ratio": {
            "want": ">= 2",
            "got": spill["prefill_saved_ratio"],
            "met": saved[1] > 0 and saved[1] >= 2 * saved[0],
        },
    }


def bench_tiers(
    model_dir: Path,
    num_requests: int = 64,
    rate: float = 8.0,
    device_tokens: int = 512,
    history_tokens: int = 2000,
    system_prompts: int = 8,
    system_tokens: int = 256,
    spill_requests: int = 24,
    spill_pool_prompts: float = 2.5,
    threads: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    progress: bool = False,
) -> dict:
    if rate <= 0 or spill_pool_prompts <= 0:
        raise ConfigError(
            f"--rate ({rate}) and --spill-pool-prompts ({spill_pool_prompts}) must be above 0; raise them."
        )
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, tokenizer = load_model(model_dir, DTYPES[dtype], device), Tokenizer(model_dir)
        switches = {"dtype": dtype, "device": device}
        LLM(model=model, tokenizer=tokenizer, kv_cache_bytes=pool_bytes(model, 64), **switches).generate(
            [[1] * 32], SamplingParams(max_tokens=2)
        )  # warm-up, so the first row is not the one paying for it
        preemption = bench_preemption(model, tokenizer, num_requests, rate, device_tokens, switches, progress)
        resume = bench_resume(model, tokenizer, history_tokens, switches)
        spill = bench_spill(
            model,
            tokenizer,
            system_prompts,
            system_tokens,
            spill_requests,
            spill_pool_prompts,
            switches,
            progress,
        )
    finally:
        torch.set_num_threads(default_threads)
    return {
        "machine": {
            "cpu_model": cpu_model(),
            "cpus": os.cpu_count(),
            "torch_threads": threads,
            "torch": torch.__version__,
        },
        "model_dir": str(model_dir),
        "dtype": dtype,
        "device": device,
        "block_size": BLOCK_SIZE,
        "preemption": preemption,
        "resume": resume,
        "prefix_spill": spill,
        "targets": targets(preemption, resume, spill),
    }


# ----------------------------------------------------------------------------- the report


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f}"


def bytes_out(row: dict) -> int:
    return sum(n for way, n in row["bytes_moved"].items() if way.startswith("device->"))


def bytes_in(row: dict) -> int:
    return sum(n for way, n in row["bytes_moved"].items() if way.endswith("->device"))


def print_tiers_report(report: dict, console) -> None:
    p, trace = report["preemption"], report["preemption"]["trace"]
    print_table(
        console,
        f"preemption: {trace['requests']} requests arriving at {trace['rate_per_s']:g}/s, device pool "
        f"{p['device_blocks']} blocks ({mib(p['device_kv_bytes'])} MiB)",
        ["preemption", "output tok/s", "CPU s", "TTFT p50", "TTFT p99", "preemptions", "tokens recomputed"],
        [
            [
                name,
                f"{row['output_tok_s']:.1f}",
                f"{row['cpu_s']:.1f}",
                f"{row['ttft_p50_s']:.2f} s",
                f"{row['ttft_p99_s']:.2f} s",
                row["preemptions"],
                f"{row['recomputed_tokens']:,}",
            ]
            for name, row in p["rows"].items()
        ],
    )
    print_table(
        console,
        f"KV traffic (host pool {mib(p['host_kv_bytes'])} MiB)",
        ["preemption", "MiB out", "MiB in", "swapped out", "prefetched", "prefetch hidden"],
        [
            [
                name,
                mib(bytes_out(row)),
                mib(bytes_in(row)),
                row["swapped_out"],
                row["prefetched"],
                "n/a" if row["prefetch_hidden"] is None else f"{row['prefetch_hidden']:.0%}",
            ]
            for name, row in p["rows"].items()
        ],
    )
    console.print(
        "greedy outputs identical across the three rows: "
        + ("yes" if p["outputs_identical"] else f"NO, {p['requests_differing']} requests differ")
    )

    r = report["resume"]
    print_table(
        console,
        f"resume a {r['history_tokens']:,}-token conversation and answer a new turn "
        f"({r['prompt_tokens']:,} tokens in all)",
        ["fresh engine", "TTFT", "prefill tokens computed"],
        [
            [name, f"{r[key]['ttft_s'] * 1e3:.0f} ms", f"{r[key]['prefill_tokens_computed']:,}"]
            for name, key in (("recomputes the history", "recompute"), ("loads the session", "resume"))
        ],
    )
    console.print(
        f"session file {mib(r['session_file_bytes'])} MiB ({r['session_tokens']:,} tokens), saved in "
        f"{r['save_s'] * 1e3:.0f} ms, loaded in {r['load_s'] * 1e3:.0f} ms; TTFT {r['ttft_ratio']:.1f}x lower "
        f"({r['ttft_ratio_with_load']:.1f}x counting the load); answers identical: "
        f"{'yes' if r['answers_identical'] else 'NO'}"
    )

    s = report["prefix_spill"]
    print_table(
        console,
        f"prefix spill: {s['requests']} requests over {s['system_prompts']} system prompts of "
        f"{s['system_tokens']} tokens, device pool {s['device_blocks']} blocks",
        [
            "tiers",
            "block hit rate",
            "prefill tokens saved",
            "prefill tokens computed",
            "spilled",
            "spill hits",
            "TTFT mean",
        ],
        [
            [
                name,
                f"{row['prefix_cache']['block_hit_rate']:.0%}",
                f"{row['prefix_cache']['prefill_tokens_saved']:,}",
                f"{row['prefill_tokens_computed']:,}",
                row["spilled"],
                row["spill_hits"],
                f"{row['ttft_mean_s'] * 1e3:.0f} ms",
            ]
            for name, row in (("device only", s["without_host"]), ("device + host", s["with_host"]))
        ],
    )

    print_table(
        console,
        "targets (printed, not asserted)",
        ["target", "want", "got", "met"],
        [
            [
                name,
                t["want"],
                "n/a" if t["got"] is None else f"{t['got']:.2f}" if isinstance(t["got"], float) else t["got"],
                "yes" if t["met"] else "no",
            ]
            for name, t in report["targets"].items()
        ],
    )
    m = report["machine"]
    console.print(
        f"[dim]{m['cpu_model']}, {m['cpus']} CPUs, {m['torch_threads']} torch thread(s), "
        f"torch {m['torch']}; idle gaps in the trace are skipped, so tok/s is over busy time.[/dim]"
    )
