"""The rows of `minillm bench staircase`: the budget, HF transformers' static batches, the three
minillm engines, each row against the one before (ratios, greedy tokens), and each number's
median over the seeds with its min and max."""

from __future__ import annotations

from statistics import median

from minillm.benchmarks.hf_baseline import hf_model, hf_static
from minillm.benchmarks.stats import tails
from minillm.benchmarks.workload import BLOCK_SIZE, Request, blocks_for, run_trace, warm_up
from minillm.config import DTYPES, ConfigError
from minillm.engine import LLM

ROWS = {  # name -> (label, minillm's switches beside the budget and the backend; None: HF's own cache)
    "hf": ("(1) HF transformers, static", None),
    "paged": ("(2) paged + continuous, memory-aware", {"admission": "memory", "flash_prefill": False}),
    "int8": ("(3) + int8 KV", {"admission": "memory", "kv_dtype": "int8", "flash_prefill": False}),
    "flash": ("(4) + flash prefill", {"admission": "memory", "kv_dtype": "int8", "flash_prefill": True}),
}
# row -> (the row its greedy tokens are compared with, whether that step is lossless)
COMPARED_WITH = {"paged": ("hf", True), "int8": ("paged", False), "flash": ("int8", True)}


def worst_case(prompt_len: tuple[int, int], output_len: tuple[int, int]) -> int:
    """Tokens a static server must hold per request, sized before it sees the traffic: the longest
    prompt it accepts plus the longest output (a batch is padded to its longest prompt and runs
    until its longest output is done)."""
    return prompt_len[1] + output_len[1]


def kv_budget(worst: int, kv_tokens: int, kv_bytes_per_token: int) -> dict:
    """The one budget every row gets: `kv_tokens` of KV in the model's dtype, in whole blocks, and
    the HF batch size it pays for."""
    kv_bytes = blocks_for(kv_tokens) * BLOCK_SIZE * kv_bytes_per_token
    hf_batch = kv_bytes // (worst * kv_bytes_per_token)
    if hf_batch < 1:
        raise ConfigError(
            f"--kv-tokens {kv_tokens} cannot hold the trace's worst case, its longest prompt plus its "
            f"longest output ({worst} tokens); raise it."
        )
    return {
        "kv_tokens": kv_tokens,
        "kv_bytes": kv_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "hf_batch_size": hf_batch,
        "hf_batch_how": f"kv_bytes // (({worst} tokens: longest prompt + longest output) x "
        f"{kv_bytes_per_token} KV bytes per token)",
    }


def latencies(requests: list[dict], elapsed: float) -> dict:
    """Output tok/s, and TTFT and TPOT at p50 and p99 (nearest rank), from each request's
    `token_ids`, `ttft` and `tpot` (None for a single token)."""
    ttft = [r["ttft"] for r in requests]
    tpot = [r["tpot"] for r in requests if r["tpot"] is not None]
    return {
        "output_tok_s": sum(len(r["token_ids"]) for r in requests) / elapsed,
        "elapsed_s": elapsed,
        **tails("ttft", ttft),
        **tails("tpot", tpot),
    }


def run_hf_row(model_dir, trace, budget: dict, dtype: str, device: str) -> tuple[dict, list[list[int]]]:
    hf = hf_model(model_dir, DTYPES[dtype]).to(device)
    hf_static(
        hf, [Request("warm-up", trace[0].prompt_ids[:32], 2, 2)], 1
    )  # warm-up, so the row does not pay for it
    batch = budget["hf_batch_size"]
    requests, elapsed = hf_static(hf, trace, batch)
    batches = [trace[first : first + batch] for first in range(0, len(trace), batch)]
    # a batch's cache ends holding every row's padded prompt and the longest output (less its last token)
    peak_tokens = max(
        len(b) * (max(len(r.prompt_ids) for r in b) + max(r.output_len for r in b) - 1) for b in batches
    )
    return {
        **latencies(requests, elapsed),
        "kv_bytes_peak": peak_tokens * budget["kv_bytes_per_token"],
        "peak_seqs": max(map(len, batches)),
        "preemptions": 0,
        "recomputed_tokens": 0,
    }, [r["token_ids"] for r in requests]


def run_minillm_row(
    model, tokenizer, trace, switches: dict, kv_bytes: int, common: dict, label: str, progress: bool
) -> tuple[dict, list[list[int]]]:
    llm = LLM(
        model=model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, **common, **switches
    )
    outputs, elapsed, _ = run_trace(llm.engine, trace, label, progress)
    stats, memory = llm.engine.stats, llm.engine.snapshot()
    requests = [{"token_ids": out.token_ids, "ttft": out.ttft, "tpot": out.tpot} for out in outputs]
    return {
        **latencies(requests, elapsed),
        "kv_bytes_peak": max(step.reserved_slots for step in stats.memory) * memory.bytes_per_token,
        "peak_seqs": max(map(len, stats.batches)),
        "preemptions": memory.counters["preemptions"],
        "recomputed_tokens": memory.counters["recomputed_tokens"],
        "blocks": memory.num_blocks,
        "kv_bytes_per_token": memory.bytes_per_token,
    }, [out.token_ids for out in outputs]


def compare(rows: dict, tokens: dict) -> None:
    """Each row against the one before: tok/s, TTFT p50 and TPOT p50 as this / before (tok/s
    above 1 and latency below 1 are better), and its greedy tokens against its reference row's."""
    names = list(rows)
    for before, name in zip([None] + names, names):
        row = rows[name]
        for key in ("output_tok_s", "ttft_p50_s", "tpot_p50_s"):
            ok = before is not None and row[key] is not None and rows[before][key]
            row[f"{key}_vs_before"] = row[key] / rows[before][key] if ok else None
        reference, lossless = COMPARED_WITH.get(name, (None, None))
        if reference not in tokens:
            row.update(
                compared_with=None,
                lossless_step=None,
                requests_identical=None,
                requests_compared=None,
                greedy_identical=None,
            )
            continue
        same = sum(a == b for a, b in zip(tokens[name], tokens[reference]))
        row.update(
            compared_with=reference,
            lossless_step=lossless,
            requests_identical=same,
            requests_compared=len(tokens[name]),
            greedy_identical=same / len(tokens[name]),
        )


def run_rows(
    model_dir, model, tokenizer, trace, budget: dict, common: dict, include_hf: bool, progress: bool
):
    """Every row on the trace, in order, with its label, switches and comparisons."""
    warm_up(model, tokenizer, {**common, "kv_dtype": "int8"})  # the int8 kernels built too
    rows, tokens = {}, {}
    for name, (label, switches) in ROWS.items():
        if switches is None:
            if not include_hf:
                continue
            measured, tokens[name] = run_hf_row(model_dir, trace, budget, common["dtype"], common["device"])
        else:
            measured, tokens[name] = run_minillm_row(
                model, tokenizer, trace, switches, budget["kv_bytes"], common, label, progress
            )
        rows[name] = {"step": label.split()[0], "label": label, "switches": switches, **measured}
    compare(rows, tokens)
    return rows


SUMMED = ("requests_identical", "requests_compared")  # counts over every seed's requests
SAME = ("step", "label", "switches", "blocks", "kv_bytes_per_token", "compared_with", "lossless_step")


def summarize(runs: list[dict]) -> dict:
    """One row per name over the seeds' runs: each number its median (`spread`: [min, max]), the
    greedy comparisons summed over every seed's requests."""
    summary = {}
    for name, first in runs[0].items():
        seen = [run[name] for run in runs]
        row = {key: first[key] for key in SAME if key in first}
        row["spread"] = {}
        for key in first.keys() - {*SAME, *SUMMED, "greedy_identical"}:
            values = [each[key] for each in seen]
            if None in values:
                row[key] = None
                continue
            row[key] = median(values)
            row["spread"][key] = [min(values), max(values)]
        if first.get("compared_with") is not None:
            row.update({key: sum(each[key] for each in seen) for key in SUMMED})
            row["greedy_identical"] = row["requests_identical"] / row["requests_compared"]
        else:
            row.update(requests_identical=None, requests_compared=None, greedy_identical=None)
        summary[name] = row
    return summary
