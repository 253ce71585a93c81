"""The rows of `minillm bench memory`, one layer added each, served on the trace; the calibration
the goodput targets come from; and quality (perplexity) through the lossy caches."""

from __future__ import annotations

from minillm.benchmarks.stats import tails
from minillm.benchmarks.workload import (
    BLOCK_SIZE,
    SECOND_TEXT,
    Request,
    blocks_for,
    pool_bytes,
    run_trace,
    submit_scripted,
)
from minillm.engine import LLM, SamplingParams
from minillm.evaluation import DEFAULT_TEXT, perplexities, read_text
from minillm.tokenizer import Tokenizer

EVICTION, EVICTION_BUDGET = "h2o", 0.5  # row (7): H2O keeping half of each sequence's full length
TTFT_TIMES, TPOT_TIMES = 5, 5  # the goodput targets, in multiples of the calibration


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
        **tails("ttft", ttft),
        **tails("tpot", [out.tpot for out in outputs if out.tpot is not None]),
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
        llm.engine, trace, label, progress, watch=count_reservations, add=submit_scripted
    )
    row = trace_row(llm.engine, outputs, elapsed, cpu_s, reserved[0], targets)
    return row, [out.token_ids for out in outputs]


# ----------------------------------------------------------------------------- calibration and quality


def calibrate(model, tokenizer, trace: list[Request], common: dict) -> dict:
    """On an idle engine with room to spare: the trace's longest prompt prefilled alone (best of
    two), and a batch-1 decode step (a question's TPOT). The goodput targets are multiples of them."""
    longest = max(trace, key=lambda r: len(r.prompt_ids)).prompt_ids
    kv_bytes = pool_bytes(model, len(longest) + 64)
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
    segment_bytes = pool_bytes(model, segment_len)
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
