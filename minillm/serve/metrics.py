"""`GET /metrics`: the engine's numbers in Prometheus' text format, named as vLLM names its own.

`metric_values` reads them on the engine thread between two steps: the memory system's snapshot
(`LLMEngine.snapshot`: KV blocks per state and tier, prefix-cache hits, the remote KV store's
counters, requests running and waiting) and the engine loop's counters (tokens, finish reasons,
aborts, tokens/s). `prometheus` writes them out, every name prefixed `minillm:`; `parse_metrics`
reads them back, for the tests and the benchmark.
"""

from __future__ import annotations

from collections import Counter

from minillm.memory.remote_values import REFUSALS
from minillm.serve.engine_loop import EngineLoop


def metric_values(engine_loop: EngineLoop) -> dict:
    """What /metrics shows, read on the engine thread between two steps."""
    engine = engine_loop.engine
    finished = Counter()
    for reason, count in engine_loop.finished.items():
        finished[{"eos": "stop"}.get(reason, reason)] += count
    memory = engine.snapshot()
    return {
        **_memory_values(memory),
        **_remote_values(memory.remote),
        "prompt_tokens_total": engine_loop.prompt_tokens,
        "generation_tokens_total": engine.stats.tokens_generated,
        "generation_tokens_per_second": engine_loop.tokens_per_second(),
        "num_preemptions_total": engine.num_preemptions,
        "request_success_total": dict(finished),
        "requests_aborted_total": engine_loop.aborted,
        "engine_steps_total": engine.stats.steps,
        **_speculation_values(engine.stats.speculation(), engine.config),
    }


REMOTE_COUNTERS = (  # RemoteKV.stats() -> /metrics (memory/remote.py)
    "blocks_written",
    "bytes_written",
    "blocks_read",
    "bytes_read",
    "fetches",
    "hit_blocks",
    "late_fetches",
    "dropped_writes",
    "store_errors",
)


def _remote_values(stats: dict | None) -> dict:
    """The remote KV store's counters (0 without a store)."""
    values = {f"remote_kv_{name}_total": stats[name] if stats else 0 for name in REMOTE_COUNTERS}
    refused = stats["refused"] if stats else {}
    values["remote_kv_refused_total"] = {reason: refused.get(reason, 0) for reason in REFUSALS}
    return values


def _speculation_values(numbers: dict, config) -> dict:
    """Speculative decoding's counters as vLLM names them (0 without speculation; one position
    per guess a sequence may make)."""
    positions = config.num_speculative_tokens if config.speculative != "none" else 0
    per_position = numbers["accepted_per_position"]
    per_position += [0] * (positions - len(per_position))
    return {
        "spec_decode_num_drafts_total": numbers["drafts"],
        "spec_decode_num_draft_tokens_total": numbers["draft_tokens"],
        "spec_decode_num_accepted_tokens_total": numbers["accepted_tokens"],
        "spec_decode_num_accepted_tokens_per_pos_total": dict(enumerate(per_position)),
    }


METRIC_HELP = {
    "num_requests_running": ("gauge", "Requests with sequences in the running batch."),
    "num_requests_waiting": ("gauge", "Requests waiting to be scheduled (the queue)."),
    "kv_blocks_total": ("gauge", "KV blocks in the device pool."),
    "kv_blocks": (
        "gauge",
        "Device KV blocks by state: free, cached (free, findable by prefix), private, shared.",
    ),
    "kv_cache_usage_perc": ("gauge", "Fraction of device KV blocks held by sequences (1 = full)."),
    "kv_utilization": (
        "gauge",
        "Live token slots / slots in held blocks (the rest is the last blocks' tails).",
    ),
    "kv_bytes_per_token": ("gauge", "Bytes of KV per token slot, all layers, K and V, scales included."),
    "kv_block_size": ("gauge", "Token slots per KV block."),
    "host_blocks_total": ("gauge", "Blocks in the host tier (0: no host tier)."),
    "host_blocks_used": ("gauge", "Host-tier blocks in use (swapped-out sequences, spilled prefixes)."),
    "disk_blocks_used": ("gauge", "Disk-tier blocks in use."),
    "prefix_cache_queries_total": ("counter", "Prompt tokens in full blocks looked up in the prefix cache."),
    "prefix_cache_hits_total": ("counter", "Of those, tokens found (not computed again)."),
    "prefix_cache_hit_rate": ("gauge", "prefix_cache_hits_total / prefix_cache_queries_total."),
    "prefix_cache_lookups_total": (
        "counter",
        "Prompt lookups by why their hit ended there: hit (every full block), diverged (the prompt "
        "parts from a cached or recent one), evicted (blocks a recent prompt shared are gone), new.",
    ),
    "remote_kv_blocks_written_total": ("counter", "KV blocks written to the remote store (--remote-kv)."),
    "remote_kv_bytes_written_total": ("counter", "Bytes of those blocks, headers included."),
    "remote_kv_blocks_read_total": ("counter", "KV blocks read back from the remote store and checked."),
    "remote_kv_bytes_read_total": ("counter", "Bytes of those blocks, headers included."),
    "remote_kv_fetches_total": ("counter", "Prompts whose missing blocks were asked of the remote store."),
    "remote_kv_hit_blocks_total": (
        "counter",
        "Blocks from the remote store installed as cached prefix blocks (prefill not computed).",
    ),
    "remote_kv_late_fetches_total": (
        "counter",
        "Fetches given up: recomputing was quicker than waiting for them any longer.",
    ),
    "remote_kv_dropped_writes_total": (
        "counter",
        "Blocks not written: the write queue was full, or the store failed before their turn.",
    ),
    "remote_kv_store_errors_total": (
        "counter",
        "Commands the remote store failed (refused, timed out, full); each outage is one warning.",
    ),
    "remote_kv_refused_total": (
        "counter",
        "Blocks read from the remote store and refused, by what did not match: malformed, namespace "
        "(another model or format), tokens, parent, checksum, layout.",
    ),
    "prompt_tokens_total": ("counter", "Prompt tokens of the requests accepted."),
    "generation_tokens_total": ("counter", "Tokens generated."),
    "generation_tokens_per_second": ("gauge", "Tokens generated per second over the last 10 s."),
    "num_preemptions_total": ("counter", "Sequences preempted when KV blocks ran out."),
    "request_success_total": ("counter", "Requests finished, by finish reason."),
    "requests_aborted_total": ("counter", "Requests aborted because their client disconnected."),
    "engine_steps_total": ("counter", "Engine steps (one batched forward pass each)."),
    "spec_decode_num_drafts_total": ("counter", "Speculation: times a sequence guessed tokens to check."),
    "spec_decode_num_draft_tokens_total": ("counter", "Speculation: tokens guessed."),
    "spec_decode_num_accepted_tokens_total": ("counter", "Speculation: guessed tokens the model kept."),
    "spec_decode_num_accepted_tokens_per_pos_total": (
        "counter",
        "Speculation: guessed tokens kept, by position in the guess (0 is the first).",
    ),
}
MISS_CAUSES = ("hit", "diverged", "evicted", "new")
LABELS = {
    "kv_blocks": "state",
    "request_success_total": "finished_reason",
    "spec_decode_num_accepted_tokens_per_pos_total": "position",
    "prefix_cache_lookups_total": "cause",
    "remote_kv_refused_total": "reason",
}


def _memory_values(memory) -> dict:
    """/metrics' gauges of a MemorySnapshot: requests, KV blocks per state and tier, prefix hits."""
    device, host = memory.count("device"), memory.count("host")
    cache, block_size = memory.prefix_cache, memory.block_size
    return {
        "num_requests_running": len({seq.request_id for seq in memory.running()}),
        "num_requests_waiting": len({seq.request_id for seq in memory.waiting()}),
        "kv_blocks_total": memory.num_blocks,
        # a filling block (keys still in full precision) is one sequence's alone: private
        "kv_blocks": {
            "free": device["free"],
            "cached": device["cached"],
            "private": device["private"] + device["filling"],
            "shared": device["shared"],
        },
        "kv_cache_usage_perc": (memory.num_blocks - memory.num_free_blocks) / memory.num_blocks,
        "kv_utilization": memory.stats.utilization,
        "kv_bytes_per_token": memory.bytes_per_token,
        "kv_block_size": block_size,
        "host_blocks_total": memory.num_host_blocks,
        "host_blocks_used": host["private"] + host["shared"],
        "disk_blocks_used": len(memory.blocks.get("disk", ())),
        "prefix_cache_queries_total": cache["queried_blocks"] * block_size if cache else 0,
        "prefix_cache_hits_total": cache["hit_blocks"] * block_size if cache else 0,
        "prefix_cache_hit_rate": cache["hit_rate"] if cache else 0.0,
        "prefix_cache_lookups_total": {
            cause: (cache["lookups"].get(cause, 0) if cache else 0) for cause in MISS_CAUSES
        },
    }


def prometheus(values: dict) -> str:
    """The values in Prometheus' text format, every name prefixed `minillm:` (vLLM's are `vllm:`)."""
    lines = []
    for name, value in values.items():
        kind, help_text = METRIC_HELP[name]
        lines += [f"# HELP minillm:{name} {help_text}", f"# TYPE minillm:{name} {kind}"]
        if isinstance(value, dict):
            lines += [
                f'minillm:{name}{{{LABELS[name]}="{label}"}} {number}' for label, number in value.items()
            ]
        else:
            lines.append(f"minillm:{name} {float(value) if isinstance(value, float) else value}")
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict:
    """The other way, for tests and the benchmark:
    {"kv_blocks": {"free": 12, ...}, "kv_blocks_total": 16, ...}."""
    values: dict = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, number = line.rsplit(" ", 1)
        key = key.removeprefix("minillm:")
        value = float(number) if any(c in number for c in ".en") else int(number)
        if "{" in key:
            name, label = key[:-1].split("{", 1)
            values.setdefault(name, {})[label.split("=", 1)[1].strip('"')] = value
        else:
            values[key] = value
    return values
