"""The run of `minillm bench memory`: the rows, one layer added each, served on the trace; the
calibration the goodput targets come from; quality through the lossy caches; the load tests; and
the targets, printed beside what the run measured."""

from __future__ import annotations

import os
import random
import time

import torch

from minillm.benchmarks import cpu_model
from minillm.benchmarks.memory.trace import (
    BLOCK_SIZE,
    KINDS,
    SECOND_TEXT,
    SEED,
    SYSTEM_PROMPTS,
    Request,
    chat_prompt,
    describe_trace,
    make_trace,
    scaled,
    submit,
    system_prompts,
)
from minillm.benchmarks.tiers import blocks_for, percentile, run_trace
from minillm.config import DTYPES, ConfigError
from minillm.engine import LLM, SamplingParams
from minillm.evaluation import DEFAULT_TEXT, perplexities, read_text
from minillm.progress import progress_bar
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

EVICTION, EVICTION_BUDGET = "h2o", 0.5  # row (7): H2O keeping half of each sequence's full length
TTFT_TIMES, TPOT_TIMES = 5, 5  # the goodput targets, in multiples of the calibration
LOAD_OUTPUT, LOAD_TTFT_TIMES = 16, 5  # the load tests' requests: a chat, 16 tokens out

SIZES = {  # the defaults; --quick quarters every length and measures less
    "full": {
        "requests": 24,
        "rate": 4.0,
        "kv_tokens": 640,
        "segment_len": 96,
        "segments": 2,
        "clients": 8,
        "load_requests": 2,
        "grid": (2, 4, 8, 16),
        "scale": 1.0,
    },
    "quick": {
        "requests": 12,
        "rate": 8.0,
        "kv_tokens": 160,
        "segment_len": 32,
        "segments": 1,
        "clients": 2,
        "load_requests": 1,
        "grid": (1, 2),
        "scale": 0.25,
    },
}


# ----------------------------------------------------------------------------- the rows


def row_switches(host_bytes: int) -> dict[str, tuple[str, dict]]:
    """name -> (label, the engine switches): each row adds one layer to the one before."""
    paged = {"admission": "fcfs"}
    prefix = {**paged, "prefix_caching": True}
    int8 = {**prefix, "kv_dtype": "int8"}
    host = {**int8, "host_cache_bytes": host_bytes, "preemption": "auto"}
    memory = {**host, "admission": "memory"}
    ladder = {**memory, "eviction": EVICTION, "kv_budget": EVICTION_BUDGET, "eviction_trigger": "pressure"}
    lossless = {**memory, "kv_dtype": "auto"}
    return {
        "reserve": ("(1) reserve max", {"admission": "reserve"}),
        "paged": ("(2) paged", paged),
        "prefix": ("(3) +prefix", prefix),
        "int8": ("(4) +int8", int8),
        "host": ("(5) +host", host),
        "memory": ("(6) +mem admit", memory),
        "ladder": (f"(7) +{EVICTION} ladder", ladder),
        "lossless": ("(L) lossless", lossless),
    }


ROWS_LEGEND = (
    "(1) each request holds prompt + max_tokens from admission; (2) paged blocks, first "
    "come first served, recompute; (3) + prefix cache; (4) + int8 KV; (5) + host tier, "
    f"preemption auto; (6) + memory-aware admission; (7) + {EVICTION} to {EVICTION_BUDGET:g} of "
    "each sequence after a step that preempted (a shared prompt prefix stays whole); (L) = (6) "
    "with fp32 KV"
)


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


def trace_row(
    engine, outputs: list, elapsed: float, cpu_s: float, reserved_slot_steps: int, targets: dict
) -> dict:
    stats, memory = engine.stats, engine.snapshot()
    counters, moved = memory.counters, memory.stats.bytes_moved
    ttft = [out.ttft for out in outputs if out.ttft is not None]
    good = sum(
        out.error is None
        and out.ttft <= targets["ttft_s"]
        and (out.tpot is None or out.tpot <= targets["tpot_s"])
        for out in outputs
    )
    reserve = engine.config.admission == "reserve"  # what it holds is its reservation, not its blocks
    return {
        "output_tok_s": sum(len(out.token_ids) for out in outputs) / elapsed,
        "elapsed_s": elapsed,
        "cpu_s": cpu_s,
        "steps": stats.steps,
        "errors": sum(out.error is not None for out in outputs),
        "goodput": good / len(outputs),
        "goodput_requests": good,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile([out.tpot for out in outputs if out.tpot is not None], 50),
        "peak_seqs": max(map(len, stats.batches)),
        "preemptions": counters["preemptions"],
        "recomputed_tokens": counters["recomputed_tokens"],
        "swapped_out": counters["swapped_out"],
        "bytes_moved": moved,
        "bytes_moved_total": sum(moved.values()),
        "kv_utilization": (
            stats.live_slot_steps / reserved_slot_steps if reserve else stats.kv_utilization()
        ),
        "rungs": dict(stats.rungs),
        "tokens_evicted": stats.tokens_evicted,
        "device_blocks": memory.num_blocks,
        "kv_bytes_per_token": memory.bytes_per_token,
    }


def run_row(
    model,
    tokenizer,
    trace: list[Request],
    switches: dict,
    kv_bytes: int,
    common: dict,
    targets: dict,
    label: str,
    progress: bool,
) -> tuple[dict, list[list[int]]]:
    llm = LLM(
        model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common, **switches
    )
    reserved = [0]  # slots a max-length reservation holds, summed over steps

    def count_reservations(engine) -> None:
        reserved[0] += sum(blocks_for(seq.max_len) * BLOCK_SIZE for seq in engine.snapshot().running())

    outputs, elapsed, cpu_s = run_trace(
        llm.engine, trace, label, progress, watch=count_reservations, add=submit
    )
    row = trace_row(llm.engine, outputs, elapsed, cpu_s, reserved[0], targets)
    return row, [out.token_ids for out in outputs]


# ----------------------------------------------------------------------------- calibration and quality


def calibrate(model, tokenizer, trace: list[Request], common: dict) -> dict:
    """On an idle engine with room to spare: the trace's longest prompt prefilled alone (best of
    two), and a batch-1 decode step (a question's TPOT). The goodput targets are multiples of them."""
    longest = max(trace, key=lambda r: len(r.prompt_ids)).prompt_ids
    kv_bytes = BLOCK_SIZE * model.config.kv_bytes_per_token(model.dtype) * blocks_for(len(longest) + 64)
    llm = LLM(model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common)
    prefill = SamplingParams(max_tokens=1, ignore_eos=True)
    prefill_s = min(llm.generate([longest], prefill)[0].ttft for _ in range(2))
    decode_s = llm.generate([longest[:32]], SamplingParams(max_tokens=17, ignore_eos=True))[0].tpot
    return {
        "longest_prompt": len(longest),
        "prefill_alone_s": prefill_s,
        "decode_step_s": decode_s,
        "ttft_s": TTFT_TIMES * prefill_s,
        "tpot_s": TPOT_TIMES * decode_s,
        "how": f"TTFT <= {TTFT_TIMES} x the longest prompt ({len(longest)} tokens) prefilled alone, "
        f"TPOT <= {TPOT_TIMES} x a batch-1 decode step",
    }


def quality_texts(tokenizer: Tokenizer) -> tuple[dict[str, list[int]], str]:
    """Two public-domain texts of different kinds, or two distant passages of one if only it was fetched."""
    first = tokenizer.encode(read_text())
    if SECOND_TEXT.is_file():
        return {
            DEFAULT_TEXT.stem: first,
            SECOND_TEXT.stem: tokenizer.encode(read_text(SECOND_TEXT)),
        }, "two texts of different kinds: a novel and a workshop report"
    half = len(first) // 2
    halves = {
        f"{DEFAULT_TEXT.stem} (first half)": first[:half],
        f"{DEFAULT_TEXT.stem} (second half)": first[half:],
    }
    return halves, (
        f"only {DEFAULT_TEXT.name} was fetched: two passages of it (python weights_fetch.py "
        "fetches a second text)"
    )


def measure_quality(
    model, tokenizer, settings: dict[str, dict], segment_len: int, segments: int, common: dict, progress: bool
) -> dict:
    """Perplexity through the exact cache and each lossy setting's, on both texts, and the ratios.
    Eviction keeps its budget every step here: the upper bound of what it costs in the trace, where
    it evicts only after a step that ran short."""
    texts, note = quality_texts(tokenizer)
    segment_bytes = BLOCK_SIZE * model.config.kv_bytes_per_token(model.dtype) * blocks_for(segment_len)
    kv_bytes = segment_bytes * segments * len(texts)
    results = {}
    for name, switches in {"exact": {}, **settings}.items():
        llm = LLM(
            model=model,
            tokenizer=tokenizer,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=kv_bytes,
            **common,
            **switches,
        )
        results[name] = {
            text: result.perplexity
            for text, result in perplexities(llm, texts, segment_len, segments, progress).items()
        }
    return {
        "texts": list(texts),
        "note": note,
        "segment_len": segment_len,
        "segments_per_text": segments,
        "perplexity": results,
        "ratio": {
            name: {text: results[name][text] / results["exact"][text] for text in texts} for name in settings
        },
    }


# ----------------------------------------------------------------------------- load tests


def closed_loop(
    model,
    tokenizer,
    prompts: list[list[int]],
    clients: int,
    per_client: int,
    switches: dict,
    kv_bytes: int,
    common: dict,
) -> dict:
    """`clients` clients, each sending `per_client` requests one after another (the next as soon as
    the last has answered); client c takes prompts c, c + clients, ... of the list."""
    llm = LLM(
        model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common, **switches
    )
    engine, params = llm.engine, SamplingParams(max_tokens=LOAD_OUTPUT, ignore_eos=True)
    sent, arrivals, ttft, latency, errors = [0] * clients, {}, [], [], 0

    def send(client: int) -> None:
        request_id = f"{client}:{sent[client]}"
        arrivals[request_id] = time.perf_counter()
        prompt = prompts[(client + sent[client] * clients) % len(prompts)]
        engine.add_request(prompt, params, request_id=request_id, arrival_time=arrivals[request_id])
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
    return {
        "clients": clients,
        "requests": clients * per_client,
        "errors": errors,
        "elapsed_s": time.perf_counter() - start,
        "latency_p50_s": percentile(latency, 50),
        "latency_p99_s": percentile(latency, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "peak_seqs": max(map(len, engine.stats.batches)),
        "preemptions": engine.num_preemptions,
    }


def load_tests(
    model, tokenizer, rows: dict, kv_bytes: int, common: dict, sizes: dict, progress: bool
) -> dict:
    scale = sizes["scale"]
    systems = system_prompts(tokenizer, scale)
    text_ids = tokenizer.encode(read_text())
    rng = random.Random(SEED + 1)
    user_len = [scaled(n, scale) for n in KINDS[1].prompt_len]
    prompts = []
    for index in range(max(sizes["grid"] + (sizes["clients"],)) * sizes["load_requests"]):
        length = rng.randint(*user_len)
        start = rng.randrange(len(text_ids) - length)
        user_ids = text_ids[start : start + length]
        prompts.append(chat_prompt(tokenizer, systems[index % SYSTEM_PROMPTS], user_ids))
    alone = LLM(model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common)
    prefill_s = min(
        alone.generate([prompts[0]], SamplingParams(max_tokens=1, ignore_eos=True))[0].ttft for _ in range(2)
    )
    target = LOAD_TTFT_TIMES * prefill_s
    results = {}
    with progress_bar("load tests: rows", len(LOAD_ROWS), enabled=progress) as advance:
        for name in LOAD_ROWS:
            label, switches = rows[name]
            measured, sustained = {}, None

            def serve(clients: int) -> dict:
                return closed_loop(
                    model, tokenizer, prompts, clients, sizes["load_requests"], switches, kv_bytes, common
                )

            for clients in sizes["grid"]:  # doubling; the first C that misses the target ends the sweep
                run = measured[clients] = serve(clients)
                if run["errors"] or run["ttft_p99_s"] > target:
                    break
                sustained = clients
            fixed = measured.get(sizes["clients"]) or serve(sizes["clients"])
            results[name] = {
                "label": label,
                "fixed": fixed,
                "max_clients": sustained,
                "sweep": list(measured.values()),
            }
            advance()
    return {
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "output_len": LOAD_OUTPUT,
        "requests_per_client": sizes["load_requests"],
        "clients": sizes["clients"],
        "grid": list(sizes["grid"]),
        "prefill_alone_s": prefill_s,
        "ttft_target_s": target,
        "how": f"p99 TTFT <= {LOAD_TTFT_TIMES} x one request prefilled alone",
        "rows": results,
    }


# ----------------------------------------------------------------------------- targets


def targets(rows: dict, quality: dict) -> dict:
    """What the memory system should buy, beside what it bought this run (printed, never asserted)."""

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    def target(want: str, got: float | None, beside: str, met: bool) -> dict:
        return {"want": want, "got": got, "beside": beside, "met": met}

    fcfs, memory, reserve, lossless = rows["host"], rows["memory"], rows["reserve"], rows["lossless"]
    goodput = ratio(memory["goodput"], fcfs["goodput"])
    concurrency = lossless["peak_seqs"] / reserve["peak_seqs"]
    speed = lossless["output_tok_s"] / reserve["output_tok_s"]
    int8_cost = max(quality["ratio"]["int8"].values())
    int8, prefix = rows["int8"], rows["prefix"]
    return {
        "memory_vs_fcfs_goodput": target(
            ">= 1.3, p99 TTFT no worse",
            goodput,
            f"(6) {memory['goodput']:.0%} vs (5) {fcfs['goodput']:.0%}; p99 TTFT "
            f"{memory['ttft_p99_s']:.1f} vs {fcfs['ttft_p99_s']:.1f} s",
            goodput is not None and goodput >= 1.3 and memory["ttft_p99_s"] <= fcfs["ttft_p99_s"],
        ),
        "lossless_vs_reserve_peak_seqs": target(
            ">= 4",
            concurrency,
            f"(L) {lossless['peak_seqs']} vs (1) {reserve['peak_seqs']}",
            concurrency >= 4,
        ),
        "lossless_vs_reserve_tok_s": target(
            ">= 2",
            speed,
            f"(L) {lossless['output_tok_s']:.1f} vs (1) {reserve['output_tok_s']:.1f} tok/s",
            speed >= 2,
        ),
        "int8_perplexity_ratio": target(
            "<= 1.01 (worst text)",
            int8_cost,
            f"for (4) vs (3): x{int8['device_blocks'] / prefix['device_blocks']:.1f} blocks, "
            f"x{int8['output_tok_s'] / prefix['output_tok_s']:.2f} tok/s, "
            f"goodput {prefix['goodput']:.0%} -> {int8['goodput']:.0%}",
            int8_cost <= 1.01,
        ),
    }


# ----------------------------------------------------------------------------- the whole run


def kv_budgets(model, trace: list[Request], kv_tokens: int) -> tuple[int, int]:
    """(device, host) KV bytes: --kv-tokens of float32 KV in whole blocks for the device pool, and a
    host tier that holds every request of the trace at once."""
    longest = max(len(r.prompt_ids) + r.max_tokens for r in trace)
    if blocks_for(kv_tokens) < blocks_for(longest):
        raise ConfigError(
            f"--kv-tokens {kv_tokens} cannot hold the trace's longest request ({longest} tokens); raise it."
        )
    fp32_token = model.config.kv_bytes_per_token(torch.float32)
    host_blocks = sum(blocks_for(len(r.prompt_ids) + r.output_len) for r in trace)
    return blocks_for(kv_tokens) * BLOCK_SIZE * fp32_token, host_blocks * BLOCK_SIZE * fp32_token


def run_rows(
    model,
    tokenizer,
    trace: list[Request],
    switches: dict,
    kv_bytes: int,
    common: dict,
    calibration: dict,
    progress: bool,
) -> tuple[dict, dict]:
    """Every row on the trace: name -> its report (label and switches first), name -> its outputs' tokens."""
    rows, outputs = {}, {}
    for name, (label, row) in switches.items():
        measured, outputs[name] = run_row(
            model, tokenizer, trace, row, kv_bytes, common, calibration, label, progress
        )
        rows[name] = {"label": label, "switches": row, **measured}
    return rows, outputs


def compare_rows(rows: dict, outputs: dict, quality: dict) -> None:
    """Each row's greedy outputs against row (2)'s, and the perplexity ratio of the cache it reads through."""
    for name, row in rows.items():
        differing = sum(a != b for a, b in zip(outputs[name], outputs["paged"]))
        setting = quality_setting(row["switches"])
        row["outputs_differing_from_paged"] = differing
        row["outputs_equal"] = differing == 0 if name in LOSSLESS else None
        row["quality"] = (
            None
            if setting is None
            else {"setting": setting[0], "perplexity_ratio": quality["ratio"][setting[0]]}
        )


def bench_memory(
    model_dir,
    quick: bool = False,
    num_requests: int | None = None,
    rate: float | None = None,
    kv_tokens: int | None = None,
    clients: int | None = None,
    load: bool = True,
    threads: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    progress: bool = False,
) -> dict:
    sizes = dict(SIZES["quick" if quick else "full"])
    given = {"requests": num_requests, "rate": rate, "kv_tokens": kv_tokens, "clients": clients}
    sizes.update({key: value for key, value in given.items() if value is not None})
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, tokenizer = load_model(model_dir, DTYPES[dtype], device), Tokenizer(model_dir)
        common = {"dtype": dtype, "device": device}
        trace = make_trace(tokenizer, sizes["requests"], sizes["rate"], sizes["scale"])
        kv_bytes, host_bytes = kv_budgets(model, trace, sizes["kv_tokens"])
        warm_up = LLM(
            model=model,
            tokenizer=tokenizer,
            kv_cache_bytes=8 * BLOCK_SIZE * model.config.kv_bytes_per_token(torch.float32),
            **common,
        )
        warm_up.generate([[1] * 32], SamplingParams(max_tokens=2))  # so the first row does not pay for it
        calibration = calibrate(model, tokenizer, trace, common)
        switches = row_switches(host_bytes)
        rows, outputs = run_rows(model, tokenizer, trace, switches, kv_bytes, common, calibration, progress)
        settings = dict(filter(None, (quality_setting(row) for _, row in switches.values())))
        quality = measure_quality(
            model, tokenizer, settings, sizes["segment_len"], sizes["segments"], common, progress
        )
        compare_rows(rows, outputs, quality)
        load_report = (
            load_tests(model, tokenizer, switches, kv_bytes, common, sizes, progress) if load else None
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
        "quick": quick,
        "trace": describe_trace(trace, sizes["rate"], sizes["scale"]),
        "budget": {
            "kv_tokens_fp32": sizes["kv_tokens"],
            "kv_bytes": kv_bytes,
            "host_kv_bytes": host_bytes,
            "eviction": EVICTION,
            "kv_budget": EVICTION_BUDGET,
        },
        "calibration": calibration,
        "rows": rows,
        "lossless_outputs_equal": all(rows[name]["outputs_equal"] for name in LOSSLESS),
        "quality": quality,
        "load": load_report,
        "targets": targets(rows, quality),
    }
