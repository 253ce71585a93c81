"""Tiers, parts 2 and 3: a conversation parked in a session file and resumed by a fresh engine,
and system prompts spilled to a host tier and copied back."""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

from minillm.benchmarks.tiers.preemption import SEED
from minillm.benchmarks.workload import BLOCK_SIZE, blocks_for, pool_bytes
from minillm.config import ConfigError
from minillm.engine import LLM, SamplingParams
from minillm.evaluation import read_text
from minillm.progress import progress_bar
from minillm.tokenizer import Tokenizer

TURN_TOKENS = 200  # tokens of prose per turn of the resumed conversation
NEW_TURN = "Thank you. In one sentence, what happened in the last part?"
ANSWER_TOKENS = 16
SPILL_ANSWER_TOKENS = 4


# ----------------------------------------------------------------------------- 2. resume


def conversation(tokenizer: Tokenizer, history_tokens: int) -> tuple[list[int], list[int]]:
    """(history, prompt): turns of real prose, user and assistant by turns, at least
    `history_tokens` long in the chat template; the prompt adds one user turn and the cue to answer."""
    text_ids = tokenizer.encode(read_text())
    messages: list[dict[str, str]] = []
    history: list[int] = []
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
