"""`minillm bench prefix`: 32 requests that share a ~500-token system prompt, with and without
the prefix cache.

The system prompt is real prose (the start of "Alice's Adventures in Wonderland") in the chat
template; each request adds its own short user question. Requests run one after another (each
arrives when the previous one has finished), so time to first token (TTFT) is pure prefill:
without the cache every request prefills ~530 tokens, with it every request after the first finds
the system prompt's full blocks cached and prefills only its own tail.

Then the memory that sharing saves within one request: 4 parallel samples, and a beam search of
width 4, over the first prompt, against the blocks the same outputs would need unshared.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from minillm.config import ConfigError
from minillm.engine import LLM, SamplingParams
from minillm.evaluation import read_text
from minillm.report import print_table
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model


def shared_prompts(tokenizer: Tokenizer, num_requests: int, system_tokens: int) -> list[list[int]]:
    system = tokenizer.decode(tokenizer.encode(read_text())[:system_tokens])
    return [
        tokenizer.encode_chat(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"In one sentence, what does section {i} say?"},
            ]
        )
        for i in range(num_requests)
    ]


def run(model, tokenizer, prompts, prefix_caching: bool, attention_backend: str) -> dict:
    llm = LLM(
        model=model, tokenizer=tokenizer, prefix_caching=prefix_caching, attention_backend=attention_backend
    )
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ttft = [llm.generate([prompt], params)[0].ttft for prompt in prompts]
    stats = llm.engine.stats
    report = {
        "ttft_first_s": ttft[0],
        "ttft_rest_mean_s": statistics.fmean(ttft[1:]),
        "prefill_tokens_computed": stats.tokens_computed - stats.tokens_generated + len(prompts),
        "max_shared_bytes": max(m.shared_slots * m.bytes_per_slot for m in stats.memory),
    }
    if prefix_caching:
        report["prefix_cache"] = llm.engine.snapshot().prefix_cache
    return report


def sharing_memory(
    model, tokenizer, prompt: list[int], params: SamplingParams, attention_backend: str
) -> dict:
    """KV memory of one request with several outputs (samples or beams): what the shared blocks
    take, against what the same outputs would take each in blocks of its own (reserved + shared),
    averaged over the steps of the run."""
    llm = LLM(model=model, tokenizer=tokenizer, block_size=16, attention_backend=attention_backend)
    llm.generate([prompt], params)
    steps = [m for m in llm.engine.stats.memory if m.reserved_slots]
    shared = sum(m.reserved_slots for m in steps)
    unshared = sum(m.reserved_slots + m.shared_slots for m in steps)
    return {
        "mean_reserved_bytes_shared": shared / len(steps) * steps[0].bytes_per_slot,
        "mean_reserved_bytes_unshared": unshared / len(steps) * steps[0].bytes_per_slot,
        "memory_saved": 1 - shared / unshared,
        "copy_on_write_copies": llm.engine.snapshot().counters["copy_on_write"],
    }


def bench_prefix(
    model_dir: Path, num_requests: int = 32, system_tokens: int = 500, attention_backend: str = "torch"
) -> dict:
    if num_requests < 2:  # TTFT after the first is the measurement; one request has none
        raise ConfigError(
            f"bench prefix needs at least 2 requests (--requests {num_requests}): the first fills "
            f"the cache, the others hit it; raise it."
        )
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)
    prompts = shared_prompts(tokenizer, num_requests, system_tokens)
    without = run(model, tokenizer, prompts, False, attention_backend)
    with_cache = run(model, tokenizer, prompts, True, attention_backend)
    sampling = SamplingParams(n=4, temperature=0.8, seed=0, max_tokens=64, ignore_eos=True)
    beams = SamplingParams(beam_width=4, max_tokens=64, ignore_eos=True)
    return {
        "requests": num_requests,
        "prompt_tokens_mean": statistics.fmean(map(len, prompts)),
        "without_cache": without,
        "with_cache": with_cache,
        "ttft_speedup_after_first": without["ttft_rest_mean_s"] / with_cache["ttft_rest_mean_s"],
        "prefill_tokens_ratio": without["prefill_tokens_computed"] / with_cache["prefill_tokens_computed"],
        "parallel_sampling_n4": sharing_memory(model, tokenizer, prompts[0], sampling, attention_backend),
        "beam_search_width4": sharing_memory(model, tokenizer, prompts[0], beams, attention_backend),
    }


def print_prefix_report(report: dict, console) -> None:
    print_table(
        console,
        f"{report['requests']} requests sharing a system prompt "
        f"(prompts ~{report['prompt_tokens_mean']:.0f} tokens), one after another",
        ["prefix cache", "TTFT first", "TTFT after (mean)", "prefill tokens computed"],
        [
            [
                name,
                f"{run_report['ttft_first_s'] * 1e3:.0f} ms",
                f"{run_report['ttft_rest_mean_s'] * 1e3:.0f} ms",
                f"{run_report['prefill_tokens_computed']:,}",
            ]
            for name, run_report in (("off", report["without_cache"]), ("on", report["with_cache"]))
        ],
    )
    for name, title in (
        ("parallel_sampling_n4", "parallel sampling, n=4"),
        ("beam_search_width4", "beam search, width 4"),
    ):
        m = report[name]
        console.print(
            f"{title}, 64 new tokens: KV reserved {m['mean_reserved_bytes_shared'] / 2**20:.1f} MiB shared "
            f"vs {m['mean_reserved_bytes_unshared'] / 2**20:.1f} MiB unshared on average "
            f"({m['memory_saved']:.0%} saved, {m['copy_on_write_copies']} copy-on-write copies)"
        )
    cache = report["with_cache"]["prefix_cache"]
    console.print(
        f"after the first request TTFT is {report['ttft_speedup_after_first']:.1f}x lower; "
        f"{report['prefill_tokens_ratio']:.1f}x fewer prefill tokens; block hit rate "
        f"{cache['block_hit_rate']:.0%}, {cache['prefill_tokens_saved']:,} prefill tokens saved"
    )
