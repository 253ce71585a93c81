"""Tiers, the whole run: the four parts on one loaded model, and the targets beside them."""

from __future__ import annotations

from pathlib import Path

from minillm.benchmarks import machine, torch_threads
from minillm.benchmarks.tiers.preemption import bench_preemption
from minillm.benchmarks.tiers.sessions import bench_resume, bench_spill
from minillm.benchmarks.tiers.spill_rule import TUNING_SEED, bench_spill_rule
from minillm.benchmarks.workload import BLOCK_SIZE, warm_up
from minillm.config import DTYPES, ConfigError
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model


def targets(preemption: dict, resume: dict, spill: dict, spill_rule: dict) -> dict:
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
        "spill_rule_fewer_bytes": {
            "want": ">= 2 (median over the seeds), block hit rate no lower",
            "got": spill_rule["spilled_bytes_all_over_reused"]["median"],
            "met": spill_rule["spilled_bytes_all_over_reused"]["median"] >= 2
            and spill_rule["hit_rate_reused_minus_all"]["median"] >= 0,
        },
    }


def check_sizes(rate: float, spill_pool_prompts: float, spill_rule_seeds: tuple[int, ...]) -> None:
    """A one-line error, before any model is loaded, for sizes no part can run with."""
    if rate <= 0 or spill_pool_prompts <= 0:
        raise ConfigError(
            f"--rate ({rate}) and --spill-pool-prompts ({spill_pool_prompts}) must be above 0; raise them."
        )
    if TUNING_SEED in spill_rule_seeds:
        raise ConfigError(f"seed {TUNING_SEED} is the spill rule's tuning seed; report on others (1,2,3).")


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
    spill_rule_seeds: tuple[int, ...] = (1, 2, 3),
    spill_rule_requests: int = 60,
    threads: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    progress: bool = False,
) -> dict:
    check_sizes(rate, spill_pool_prompts, spill_rule_seeds)
    with torch_threads(threads):
        model, tokenizer = load_model(model_dir, DTYPES[dtype], device), Tokenizer(model_dir)
        switches = {"dtype": dtype, "device": device}
        warm_up(model, tokenizer, switches)
        preemption = bench_preemption(model, tokenizer, num_requests, rate, device_tokens, switches, progress)
        resume = bench_resume(model, tokenizer, history_tokens, switches)
        spill_sizes = (system_prompts, system_tokens, spill_requests, spill_pool_prompts)
        spill = bench_spill(model, tokenizer, *spill_sizes, switches, progress)
        rule_sizes = (spill_rule_seeds, spill_rule_requests)
        spill_rule = bench_spill_rule(model, tokenizer, *rule_sizes, switches, progress)
    return {
        "machine": machine(threads),
        "model_dir": str(model_dir),
        "dtype": dtype,
        "device": device,
        "block_size": BLOCK_SIZE,
        "preemption": preemption,
        "resume": resume,
        "prefix_spill": spill,
        "spill_rule": spill_rule,
        "targets": targets(preemption, resume, spill, spill_rule),
    }
