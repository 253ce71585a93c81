"""`minillm bench memory`: the memory system built up one layer at a time, on one trace and one budget.

The seeds' claim: from the same KV bytes, paging, sharing, compression, tiers, memory-aware
admission and a pressure ladder serve more requests at once, faster and within latency targets,
than reserving each request's maximum length; and the lossy layers say what they cost.

The trace (seeded, so every run and commit sees the same one): N requests (default 24) arriving
over time (exponential gaps, --rate per second), of four kinds in fixed shares (40% questions, 35%
chats, 15% documents, 10% long answers) in a seeded order, cut from real prose:
  question     a short question, U[16, 48] tokens, 16 tokens out (max_tokens 128);
  chat         one of 3 system prompts (96 tokens of a second text) and a user turn of U[8, 24]
               tokens, in the chat template, 24 out (max_tokens 128): the prefix cache can share
               the system prompt;
  document     a long document, U[192, 384] tokens, 16 out (max_tokens 64);
  long answer  a short prompt, U[16, 32] tokens, and a long answer, 128 out (max_tokens 256).
Like a client, each request declares a max_tokens larger than what it turns out to need, and
nobody but the trace knows its length: it is decoded greedily and ends with EOS at exactly its
output length (`ScriptedStop`; no EOS before), so every row does the same work and the engine
learns lengths only as requests finish. --quick quarters every length and runs fewer requests.

The budget: one device pool of --kv-tokens tokens of float32 KV (default 640: 40 blocks, under two
documents), given to every row in bytes, so an int8 pool cuts the same bytes into ~3.5x more
blocks. It is short for the float32 rows (first come first served preempts and recomputes); the
int8 rows get enough blocks that memory is barely short, and what limits them is the decode
step (measured 2026-11-30: 0-1 preemptions in rows 4-7). The rows add one layer at a time:
  (1) max-length reservation: each request holds prompt + max_tokens from admission on (the
      contiguous baseline, played on the paged pool, `admission="reserve"`);
  (2) paged: blocks as tokens come, first come first served, preemption by recompute;
  (3) + prefix cache;  (4) + int8 KV;  (5) + a host tier holding the whole trace, preemption
      "auto" (swap or recompute by measured cost);  (6) + memory-aware admission;
  (7) + the pressure ladder's lossy rung: H2O eviction to half of each sequence's length, only
      after a step that had to preempt (a shared prompt prefix stays whole: each sequence evicts
      only from its private part);
  (L) the lossless system: (6) with float32 KV, to compare with (1).
Lossless rows must give row (2)'s greedy tokens: checked and reported, not asserted.

Goodput is the fraction of requests meeting a time-to-first-token and a time-per-output-token
target, both derived from a calibration measured in this run on an idle engine: TTFT within
TTFT_TIMES x the time to prefill the trace's longest prompt alone, TPOT within TPOT_TIMES x a
batch-1 decode step. Quality for the lossy rows is perplexity through the row's cache over the
exact cache, on two public-domain texts of different kinds (a novel, a workshop report).

Two load tests (rows (1), (2), (L), (6)): closed loop, C clients each sending a chat request
when its previous one has answered. (a) At --clients C: p50/p99 latency. (b) The largest C on a
doubling grid whose p99 TTFT meets a target (LOAD_TTFT_TIMES x one such request prefilled alone);
the sweep stops at the first C that misses it.

As in `bench tiers`: idle time in the trace is skipped (the clock jumps to the next arrival), so
tok/s is over busy time, CPU seconds are reported beside wall time, and targets are printed
beside the numbers, never asserted.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import torch

from minillm.benchmarks import cpu_model
from minillm.benchmarks.tiers import blocks_for, percentile, run_trace
from minillm.config import DTYPES, ConfigError, EngineConfig
from minillm.engine import LLM, SamplingParams
from minillm.evaluation import DEFAULT_TEXT, perplexities, read_text
from minillm.progress import progress_bar
from minillm.report import print_table
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

BLOCK_SIZE = EngineConfig.block_size
SEED = 0
SECOND_TEXT = DEFAULT_TEXT.parent / "lcet10.txt"  # the system prompts, and the second quality text


@dataclass(frozen=True)
class Kind:
    name: str
    share: float  # of the trace's requests
    prompt_len: tuple[int, int]  # tokens, uniform (a chat's user turn; its system prompt comes on top)
    output_len: int  # tokens it turns out to need (the last is EOS)
    max_tokens: int  # what the request declares: more than it needs, as clients do


KINDS = (Kind("question", 0.40, (16, 48), 16, 128), Kind("chat", 0.35, (8, 24), 24, 128),
         Kind("document", 0.15, (192, 384), 16, 64), Kind("long answer", 0.10, (16, 32), 128, 256))
SYSTEM_PROMPTS, SYSTEM_TOKENS = 3, 96
EVICTION, EVICTION_BUDGET = "h2o", 0.5  # row (7): H2O keeping half of each sequence's full length
TTFT_TIMES, TPOT_TIMES = 5, 5  # the goodput targets, in multiples of the calibration
LOAD_OUTPUT, LOAD_TTFT_TIMES = 16, 5  # the load tests' requests: a chat, 16 tokens out

SIZES = {  # the defaults; --quick quarters every length and measures less
    "full": {"requests": 24, "rate": 4.0, "kv_tokens": 640, "segment_len": 96, "segments": 2, "clients": 8,
             "load_requests": 2, "grid": (2, 4, 8, 16), "scale": 1.0},
    "quick": {"requests": 12, "rate": 8.0, "kv_tokens": 160, "segment_len": 32, "segments": 1, "clients": 2,
              "load_requests": 1, "grid": (1, 2), "scale": 0.25},
}


# ----------------------------------------------------------------------------- the trace

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
    request_id = engine.add_request(request.prompt_ids, SamplingParams(max_tokens=request.max_tokens),
                                    request_id=str(index), arrival_time=arrival_time)
    engine.requests[request_id][0].sampler = ScriptedStop(request.output_len, engine.eos_token_id)


def scaled(length: int, scale: float) -> int:
    return max(1, round(length * scale))


def system_prompts(tokenizer: Tokenizer, scale: float) -> list[str]:
    """Consecutive stretches of the second text (or of the first, far from where prompts are cut,
    if only that one was fetched)."""
    text_ids = tokenizer.encode(read_text(SECOND_TEXT if SECOND_TEXT.is_file() else DEFAULT_TEXT))
    length = scaled(SYSTEM_TOKENS, scale)
    start = 0 if SECOND_TEXT.is_file() else len(text_ids) - SYSTEM_PROMPTS * length
    return [tokenizer.decode(text_ids[start + i * length:start + (i + 1) * length]) for i in range(SYSTEM_PROMPTS)]


def chat_prompt(tokenizer: Tokenizer, system: str, user_ids: list[int]) -> list[int]:
    return tokenizer.encode_chat([{"role": "system", "content": system},
                                  {"role": "user", "content": tokenizer.decode(user_ids)}])


def kind_counts(num_requests: int) -> list[int]:
    """Requests of each kind: its share of num_requests, rounded so they add up (largest remainder)."""
    exact = [kind.share * num_requests for kind in KINDS]
    counts = [int(n) for n in exact]
    by_remainder = sorted(range(len(KINDS)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[:num_requests - sum(counts)]:
        counts[i] += 1
    return counts


def make_trace(tokenizer: Tokenizer, num_requests: int, rate: float, scale: float) -> list[Request]:
    """The kinds in their shares, in a seeded random order; prompts cut at random offsets."""
    text_ids = tokenizer.encode(read_text())
    systems = system_prompts(tokenizer, scale)
    rng = random.Random(SEED)
    kinds = [kind for kind, count in zip(KINDS, kind_counts(num_requests)) for _ in range(count)]
    rng.shuffle(kinds)
    trace, arrival = [], 0.0
    for kind in kinds:
        prompt_len = rng.randint(*(scaled(n, scale) for n in kind.prompt_len))
        start = rng.randrange(len(text_ids) - prompt_len)
        prompt = text_ids[start:start + prompt_len]
        if kind.name == "chat":
            prompt = chat_prompt(tokenizer, systems[rng.randrange(SYSTEM_PROMPTS)], prompt)
        trace.append(Request(kind.name, prompt, scaled(kind.output_len, scale), scaled(kind.max_tokens, scale),
                             arrival))
        arrival += rng.expovariate(rate)
    return trace


def describe_trace(trace: list[Request], rate: float, scale: float) -> dict:
    kinds = {}
    for kind in KINDS:
        requests = [r for r in trace if r.kind == kind.name]
        kinds[kind.name] = {"requests": len(requests), "prompt_len": [scaled(n, scale) for n in kind.prompt_len],
                            "output_len": scaled(kind.output_len, scale), "max_tokens": scaled(kind.max_tokens, scale)}
    return {"requests": len(trace), "rate_per_s": rate, "seed": SEED, "kinds": kinds,
            "system_prompts": SYSTEM_PROMPTS, "system_tokens": scaled(SYSTEM_TOKENS, scale),
            "prompt_tokens": sum(len(r.prompt_ids) for r in trace), "output_tokens": sum(r.output_len for r in trace),
            "longest_request": max(len(r.prompt_ids) + r.max_tokens for r in trace),
            "last_arrival_s": trace[-1].arrival_s}


# ----------------------------------------------------------------------------- the rows

def row_switches(host_bytes: int) -> dict[str, tuple[str, dict]]:
    """name -> (label, the engine switches): each row adds one layer to the one before."""
    paged = {"admission": "fcfs"}
    prefix = {**paged, "prefix_caching": True}
    int8 = {**prefix, "kv_dtype": "int8"}
    host = {**int8, "host_cache_bytes": host_bytes, "preemption": "auto"}
    memory = {**host, "admission": "memory"}
    ladder = {**memory, "eviction": EVICTION, "kv_budget": EVICTION_BUDGET,
              "eviction_trigger": "pressure"}
    lossless = {**memory, "kv_dtype": "auto"}
    return {"reserve": ("(1) reserve max", {"admission": "reserve"}),
            "paged": ("(2) paged", paged),
            "prefix": ("(3) +prefix", prefix),
            "int8": ("(4) +int8", int8),
            "host": ("(5) +host", host),
            "memory": ("(6) +mem admit", memory),
            "ladder": (f"(7) +{EVICTION} ladder", ladder),
            "lossless": ("(L) lossless", lossless)}


ROWS_LEGEND = ("(1) each request holds prompt + max_tokens from admission; (2) paged blocks, first come first "
               "served, recompute; (3) + prefix cache; (4) + int8 KV; (5) + host tier, preemption auto; (6) + "
               f"memory-aware admission; (7) + {EVICTION} to {EVICTION_BUDGET:g} of each sequence after a step that "
               "preempted (a shared prompt prefix stays whole); (L) = (6) with fp32 KV")


LOSSLESS = ("reserve", "paged", "prefix", "lossless")
LOAD_ROWS = ("reserve", "paged", "lossless", "memory")


def quality_setting(switches: dict) -> tuple[str, dict] | None:
    """The lossy cache a row reads through, named, and its switches (with eviction kept every
    step: the most it can cost), or None for an exact cache."""
    lossy = {key: switches[key] for key in ("kv_dtype", "eviction", "kv_budget") if key in switches}
    if lossy.get("kv_dtype", "auto") == "auto":
        lossy.pop("kv_dtype", None)
    if not lossy:
        return None
    return "+".join(filter(None, (lossy.get("kv_dtype"), lossy.get("eviction")))), lossy


def trace_row(engine, outputs: list, elapsed: float, cpu_s: float, reserved_slot_steps: int,
              targets: dict) -> dict:
    scheduler, stats = engine.scheduler, engine.stats
    ttft = [out.ttft for out in outputs if out.ttft is not None]
    good = sum(out.error is None and out.ttft <= targets["ttft_s"]
               and (out.tpot is None or out.tpot <= targets["tpot_s"]) for out in outputs)
    moved = engine.tiers.moved()
    reserve = engine.config.admission == "reserve"  # what it holds is its reservation, not its blocks
    return {"output_tok_s": sum(len(out.token_ids) for out in outputs) / elapsed, "elapsed_s": elapsed,
            "cpu_s": cpu_s, "steps": stats.steps, "errors": sum(out.error is not None for out in outputs),
            "goodput": good / len(outputs), "goodput_requests": good,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile([out.tpot for out in outputs if out.tpot is not None], 50),
            "peak_seqs": max(map(len, stats.batches)), "preemptions": scheduler.num_preemptions,
            "recomputed_tokens": scheduler.num_recomputed_tokens, "swapped_out": scheduler.num_swapped_out,
            "bytes_moved": moved, "bytes_moved_total": sum(moved.values()),
            "kv_utilization": stats.live_slot_steps / reserved_slot_steps if reserve else stats.kv_utilization(),
            "rungs": dict(stats.rungs), "tokens_evicted": stats.tokens_evicted,
            "device_blocks": engine.block_manager.num_blocks, "kv_bytes_per_token": engine.pool.bytes_per_slot}


def run_row(model, tokenizer, trace: list[Request], switches: dict, kv_bytes: int, common: dict, targets: dict,
            label: str, progress: bool) -> tuple[dict, list[list[int]]]:
    llm = LLM(model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common, **switches)
    reserved = [0]  # slots a max-length reservation holds, summed over steps

    def count_reservations(engine) -> None:
        reserved[0] += sum(blocks_for(seq.max_len) * BLOCK_SIZE for seq in engine.scheduler.running)

    outputs, elapsed, cpu_s = run_trace(llm.engine, trace, label, progress, watch=count_reservations, add=submit)
    return trace_row(llm.engine, outputs, elapsed, cpu_s, reserved[0], targets), [o.token_ids for o in outputs]


# ----------------------------------------------------------------------------- calibration and quality

def calibrate(model, tokenizer, trace: list[Request], common: dict) -> dict:
    """On an idle engine with room to spare: the trace's longest prompt prefilled alone (best of
    two), and a batch-1 decode step (a question's TPOT). The goodput targets are multiples of them."""
    longest = max(trace, key=lambda r: len(r.prompt_ids)).prompt_ids
    llm = LLM(model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE,
              kv_cache_bytes=BLOCK_SIZE * model.config.kv_bytes_per_token(model.dtype) * blocks_for(len(longest) + 64),
              **common)
    prefill_s = min(llm.generate([longest], SamplingParams(max_tokens=1, ignore_eos=True))[0].ttft for _ in range(2))
    decode_s = llm.generate([longest[:32]], SamplingParams(max_tokens=17, ignore_eos=True))[0].tpot
    return {"longest_prompt": len(longest), "prefill_alone_s": prefill_s, "decode_step_s": decode_s,
            "ttft_s": TTFT_TIMES * prefill_s, "tpot_s": TPOT_TIMES * decode_s,
            "how": f"TTFT <= {TTFT_TIMES} x the longest prompt ({len(longest)} tokens) prefilled alone, "
                   f"TPOT <= {TPOT_TIMES} x a batch-1 decode step"}


def quality_texts(tokenizer: Tokenizer) -> tuple[dict[str, list[int]], str]:
    """Two public-domain texts of different kinds, or two distant passages of one if only it was fetched."""
    first = tokenizer.encode(read_text())
    if SECOND_TEXT.is_file():
        return {DEFAULT_TEXT.stem: first, SECOND_TEXT.stem: tokenizer.encode(read_text(SECOND_TEXT))}, \
            "two texts of different kinds: a novel and a workshop report"
    half = len(first) // 2
    return {f"{DEFAULT_TEXT.stem} (first half)": first[:half], f"{DEFAULT_TEXT.stem} (second half)": first[half:]}, \
        f"only {DEFAULT_TEXT.name} was fetched: two passages of it (python weights_fetch.py fetches a second text)"


def measure_quality(model, tokenizer, settings: dict[str, dict], segment_len: int, segments: int, common: dict,
                    progress: bool) -> dict:
    """Perplexity through the exact cache and each lossy setting's, on both texts, and the ratios.
    Eviction keeps its budget every step here: the upper bound of what it costs in the trace, where
    it evicts only after a step that ran short."""
    texts, note = quality_texts(tokenizer)
    segment_bytes = BLOCK_SIZE * model.config.kv_bytes_per_token(model.dtype) * blocks_for(segment_len)
    kv_bytes = segment_bytes * segments * len(texts)
    results = {}
    for name, switches in {"exact": {}, **settings}.items():
        llm = LLM(model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common,
                  **switches)
        results[name] = {text: result.perplexity for text, result in
                         perplexities(llm, texts, segment_len, segments, progress).items()}
    return {"texts": list(texts), "note": note, "segment_len": segment_len, "segments_per_text": segments,
            "perplexity": results,
            "ratio": {name: {text: results[name][text] / results["exact"][text] for text in texts}
                      for name in settings}}


# ----------------------------------------------------------------------------- load tests

def closed_loop(model, tokenizer, prompts: list[list[int]], clients: int, per_client: int, switches: dict,
                kv_bytes: int, common: dict) -> dict:
    """`clients` clients, each sending `per_client` requests one after another (the next as soon as
    the last has answered); client c takes prompts c, c + clients, ... of the list."""
    llm = LLM(model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common, **switches)
    engine, params = llm.engine, SamplingParams(max_tokens=LOAD_OUTPUT, ignore_eos=True)
    sent, arrivals, ttft, latency, errors = [0] * clients, {}, [], [], 0

    def send(client: int) -> None:
        request_id = f"{client}:{sent[client]}"
        arrivals[request_id] = time.perf_counter()
        engine.add_request(prompts[(client + sent[client] * clients) % len(prompts)], params, request_id=request_id,
                           arrival_time=arrivals[request_id])
        sent[client] += 1

    start = time.perf_counter()
    for client in range(clients):
        send(client)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                latency.append(time.perf_counter() - arrivals[out.request_id])
                errors += out.error is not None
                if out.error is None:
                    ttft.append(out.ttft)
                client = int(out.request_id.split(":")[0])
                if sent[client] < per_client:
                    send(client)
    return {"clients": clients, "requests": clients * per_client, "errors": errors,
            "elapsed_s": time.perf_counter() - start,
            "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "peak_seqs": max(map(len, engine.stats.batches)), "preemptions": engine.scheduler.num_preemptions}


def load_tests(model, tokenizer, rows: dict, kv_bytes: int, common: dict, sizes: dict, progress: bool) -> dict:
    scale = sizes["scale"]
    systems = system_prompts(tokenizer, scale)
    text_ids = tokenizer.encode(read_text())
    rng = random.Random(SEED + 1)
    user_len = [scaled(n, scale) for n in KINDS[1].prompt_len]
    prompts = []
    for index in range(max(sizes["grid"] + (sizes["clients"],)) * sizes["load_requests"]):
        length = rng.randint(*user_len)
        start = rng.randrange(len(text_ids) - length)
        prompts.append(chat_prompt(tokenizer, systems[index % SYSTEM_PROMPTS], text_ids[start:start + length]))
    alone = LLM(model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common)
    prefill_s = min(alone.generate([prompts[0]], SamplingParams(max_tokens=1, ignore_eos=True))[0].ttft
                    for _ in range(2))
    target = LOAD_TTFT_TIMES * prefill_s
    results = {}
    with progress_bar("load tests: rows", len(LOAD_ROWS), enabled=progress) as advance:
        for name in LOAD_ROWS:
            label, switches = rows[name]
            measured, sustained = {}, None
            for clients in sizes["grid"]:  # doubling; the first C that misses the target ends the sweep
                run = measured[clients] = closed_loop(model, tokenizer, prompts, clients, sizes["load_requests"],
                                                      switches, kv_bytes, common)
                if run["errors"] or run["ttft_p99_s"] > target:
                    break
                sustained = clients
            fixed = measured.get(sizes["clients"]) or closed_loop(model, tokenizer, prompts, sizes["clients"],
                                                                  sizes["load_requests"], switches, kv_bytes, common)
            results[name] = {"label": label, "fixed": fixed, "max_clients": sustained, "sweep": list(measured.values())}
            advance()
    return {"prompt_tokens_mean": sum(map(len, prompts)) / len(prompts), "output_len": LOAD_OUTPUT,
            "requests_per_client": sizes["load_requests"], "clients": sizes["clients"], "grid": list(sizes["grid"]),
            "prefill_alone_s": prefill_s, "ttft_target_s": target,
            "how": f"p99 TTFT <= {LOAD_TTFT_TIMES} x one request prefilled alone", "rows": results}


# ----------------------------------------------------------------------------- targets

def targets(rows: dict, quality: dict) -> dict:
    """What the memory system should buy, beside what it bought this run (printed, never asserted)."""
    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    fcfs, memory, reserve, lossless = rows["host"], rows["memory"], rows["reserve"], rows["lossless"]
    goodput = ratio(memory["goodput"], fcfs["goodput"])
    concurrency = lossless["peak_seqs"] / reserve["peak_seqs"]
    speed = lossless["output_tok_s"] / reserve["output_tok_s"]
    int8_cost = max(quality["ratio"]["int8"].values())
    int8, prefix = rows["int8"], rows["prefix"]
    return {
        "memory_vs_fcfs_goodput": {"want": ">= 1.3, p99 TTFT no worse", "got": goodput,
                                   "beside": f"(6) {memory['goodput']:.0%} vs (5) {fcfs['goodput']:.0%}; p99 TTFT "
                                             f"{memory['ttft_p99_s']:.1f} vs {fcfs['ttft_p99_s']:.1f} s",
                                   "met": goodput is not None and goodput >= 1.3
                                   and memory["ttft_p99_s"] <= fcfs["ttft_p99_s"]},
        "lossless_vs_reserve_peak_seqs": {"want": ">= 4", "got": concurrency,
                                          "beside": f"(L) {lossless['peak_seqs']} vs (1) {reserve['peak_seqs']}",
                                          "met": concurrency >= 4},
        "lossless_vs_reserve_tok_s": {"want": ">= 2", "got": speed,
                                      "beside": f"(L) {lossless['output_tok_s']:.1f} vs (1) "
                                                f"{reserve['output_tok_s']:.1f} tok/s",
                                      "met": speed >= 2},
        "int8_perplexity_ratio": {"want": "<= 1.01 (worst text)", "got": int8_cost,
                                  "beside": f"for (4) vs (3): x{int8['device_blocks'] / prefix['device_blocks']:.1f} "
                                            f"blocks, x{int8['output_tok_s'] / prefix['output_tok_s']:.2f} tok/s, "
                                            f"goodput {prefix['goodput']:.0%} -> {int8['goodput']:.0%}",
                                  "met": int8_cost <= 1.01},
    }


# ----------------------------------------------------------------------------- the whole run

def bench_memory(model_dir, quick: bool = False, num_requests: int | None = None, rate: float | None = None,
                 kv_tokens: int | None = None, clients: int | None = None, load: bool = True, threads: int = 1,
                 dtype: str = "float32", device: str = "cpu", progress: bool = False) -> dict:
    sizes = dict(SIZES["quick" if quick else "full"])
    for key, value in (("requests", num_requests), ("rate", rate), ("kv_tokens", kv_tokens), ("clients", clients)):
        if value is not None:
            sizes[key] = value
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, tokenizer = load_model(model_dir, DTYPES[dtype], device), Tokenizer(model_dir)
        common = {"dtype": dtype, "device": device}
        trace = make_trace(tokenizer, sizes["requests"], sizes["rate"], sizes["scale"])
        longest = max(len(r.prompt_ids) + r.max_tokens for r in trace)
        if blocks_for(sizes["kv_tokens"]) < blocks_for(longest):
            raise ConfigError(f"--kv-tokens {sizes['kv_tokens']} cannot hold the trace's longest request ({longest} "
                              "tokens); raise it.")
        fp32_token = model.config.kv_bytes_per_token(torch.float32)
        kv_bytes = blocks_for(sizes["kv_tokens"]) * BLOCK_SIZE * fp32_token
        host_bytes = sum(blocks_for(len(r.prompt_ids) + r.output_len) for r in trace) * BLOCK_SIZE * fp32_token
        LLM(model=model, tokenizer=tokenizer, kv_cache_bytes=BLOCK_SIZE * 8 * fp32_token, **common).generate(
            [[1] * 32], SamplingParams(max_tokens=2))  # warm-up, so the first row is not the one paying for it
        calibration = calibrate(model, tokenizer, trace, common)
        switches = row_switches(host_bytes)
        rows, outputs = {}, {}
        for name, (label, row) in switches.items():
            rows[name], outputs[name] = run_row(model, tokenizer, trace, row, kv_bytes, common, calibration, label,
                                                progress)
            rows[name] = {"label": label, "switches": row, **rows[name]}
        settings = dict(filter(None, (quality_setting(row) for _, row in switches.values())))
        quality = measure_quality(model, tokenizer, settings, sizes["segment_len"], sizes["segments"], common,
                                  progress)
        for name, row in rows.items():
            differing = sum(a != b for a, b in zip(outputs[name], outputs["paged"]))
            setting = quality_setting(row["switches"])
            row["outputs_differing_from_paged"] = differing
            row["outputs_equal"] = differing == 0 if name in LOSSLESS else None
            row["quality"] = None if setting is None else {"setting": setting[0],
                                                           "perplexity_ratio": quality["ratio"][setting[0]]}
        load_report = load_tests(model, tokenizer, switches, kv_bytes, common, sizes, progress) if load else None
    finally:
        torch.set_num_threads(default_threads)
    return {"machine": {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "torch_threads": threads,
                        "torch": torch.__version__},
            "model_dir": str(model_dir), "dtype": dtype, "device": device, "block_size": BLOCK_SIZE, "quick": quick,
            "trace": describe_trace(trace, sizes["rate"], sizes["scale"]),
            "budget": {"kv_tokens_fp32": sizes["kv_tokens"], "kv_bytes": kv_bytes, "host_kv_bytes": host_bytes,
                       "eviction": EVICTION, "kv_budget": EVICTION_BUDGET},
            "calibration": calibration, "rows": rows,
            "lossless_outputs_equal": all(rows[name]["outputs_equal"] for name in LOSSLESS),
            "quality": quality, "load": load_report, "targets": targets(rows, quality)}


# ----------------------------------------------------------------------------- the report

def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f}"


def seconds(value: float) -> str:
    return f"{value:.2f} s"


def quality_cell(row: dict) -> str:
    if row["quality"] is None:
        return "exact"
    return "ppl " + " / ".join(f"x{r:.3f}" for r in row["quality"]["perplexity_ratio"].values())


def print_memory_report(report: dict, console) -> None:
    trace, budget, cal, rows = report["trace"], report["budget"], report["calibration"], report["rows"]
    kinds = ", ".join(f"{k['requests']} {name}" for name, k in trace["kinds"].items())
    console.print(f"trace: {trace['requests']} requests ({kinds}) arriving at {trace['rate_per_s']:g}/s, "
                  f"{trace['prompt_tokens']:,} prompt and {trace['output_tokens']:,} output tokens; device KV pool "
                  f"{mib(budget['kv_bytes'])} MiB for every row ({budget['kv_tokens_fp32']:,} fp32 tokens), host tier "
                  f"{mib(budget['host_kv_bytes'])} MiB for rows 5-7 and L")
    console.print(f"goodput targets: TTFT <= {cal['ttft_s']:.2f} s ({TTFT_TIMES} x {cal['prefill_alone_s']:.2f} s, the "
                  f"longest prompt, {cal['longest_prompt']} tokens, prefilled alone), "
                  f"TPOT <= {cal['tpot_s'] * 1e3:.0f} ms "
                  f"({TPOT_TIMES} x {cal['decode_step_s'] * 1e3:.0f} ms, a batch-1 decode step); both measured now")
    console.print(f"rows: {ROWS_LEGEND}")
    print_table(console, "one layer at a time: speed and latency",
                ["row", "output tok/s", "CPU s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50", "quality"],
                [[row["label"], f"{row['output_tok_s']:.1f}", f"{row['cpu_s']:.1f}",
                  f"{row['goodput']:.0%} ({row['goodput_requests']})", seconds(row["ttft_p50_s"]),
                  seconds(row["ttft_p99_s"]), f"{row['tpot_p50_s'] * 1e3:.0f} ms", quality_cell(row)]
                 for row in rows.values()])
    print_table(console, "one layer at a time: memory",
                ["row", "blocks", "peak seqs", "preemptions", "recomputed", "MiB moved", "KV util", "rungs taken",
                 "outputs vs (2)"],
                [[row["label"], row["device_blocks"], row["peak_seqs"], row["preemptions"],
                  f"{row['recomputed_tokens']:,}", mib(row["bytes_moved_total"]), f"{row['kv_utilization']:.0%}",
                  ", ".join(f"{rung} {n:,}" for rung, n in row["rungs"].items()) or "-",
                  ("equal: " + ("yes" if row["outputs_equal"] else "NO")) if row["outputs_equal"] is not None
                  else f"{row['outputs_differing_from_paged']} differ"]
                 for row in rows.values()])
    q = report["quality"]
    console.print(f"quality: perplexity through the row's cache / the exact cache on {' and '.join(q['texts'])} "
                  f"({q['note']}; {q['segments_per_text']} x {q['segment_len']} tokens each; exact "
                  + ", ".join(f"{p:.2f}" for p in q["perplexity"]["exact"].values())
                  + f"); {EVICTION} keeps {EVICTION_BUDGET:.0%} every step there, the most it can cost. KV util of (1) "
                  "is live tokens over its reservations; shared prefix blocks can lift the others above 100%.")
    console.print("lossless rows' greedy outputs equal to (2)'s: "
                  + ", ".join(f"{rows[name]['label'].split()[0]} {'yes' if rows[name]['outputs_equal'] else 'NO'}"
                              for name in LOSSLESS))
    load = report["load"]
    if load:
        grid = load["grid"]
        print_table(console, f"closed loop: chat requests (~{load['prompt_tokens_mean']:.0f} prompt tokens, "
                             f"{load['output_len']} out), {load['requests_per_client']} per client; p99 TTFT target "
                             f"{load['ttft_target_s']:.2f} s ({LOAD_TTFT_TIMES} x "
                             f"{load['prefill_alone_s']:.2f} s alone)",
                    ["row", f"latency p50 / p99 at C={load['clients']}", *[f"TTFT p99 C={c}" for c in grid],
                     "largest C meeting it"],
                    [[r["label"], f"{seconds(r['fixed']['latency_p50_s'])} / {seconds(r['fixed']['latency_p99_s'])}",
                      *[next((seconds(s["ttft_p99_s"]) for s in r["sweep"] if s["clients"] == c), "-") for c in grid],
                      r["max_clients"] or "none"] for r in load["rows"].values()])
    print_table(console, "targets (printed, not asserted)", ["target", "want", "got", "beside it", "met"],
                [[name, t["want"], "n/a" if t["got"] is None else f"{t['got']:.2f}", t["beside"],
                  "yes" if t["met"] else "no"] for name, t in report["targets"].items()])
    m = report["machine"]
    console.print(f"[dim]{m['cpu_model']}, {m['cpus']} CPUs, {m['torch_threads']} torch thread(s), torch {m['torch']}; "
                  "idle gaps in the trace are skipped, so tok/s is over busy time.[/dim]")
