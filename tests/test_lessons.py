"""Every lesson runs as a user runs it (`python lessons/X.py --quick --out DIR`, into a fresh folder),
saves its plot and its headline numbers, and its claim points the way its closing sentence says.

--quick keeps each lesson short (short generations, short text; the README lists the times); the
claims checked hold exactly (token ids, counts, bytes) or by a wide margin (a 3x speed-up), never by
a tight timing."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LESSONS = Path(__file__).parent.parent / "lessons"
NO_REDIS = "lesson 16 runs a real Redis server: apt-get install redis-server (CI installs it)"


def run_lesson(name: str, out: Path) -> dict:
    """Run lessons/<name>.py --quick --out `out`; return the numbers it saved."""
    result = subprocess.run(
        [sys.executable, str(LESSONS / f"{name}.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "What it means" in result.stdout
    return json.loads((out / f"{name}.json").read_text())


def check_kv_cache_math(numbers):
    assert numbers["tensor_bytes"] == numbers["formula_bytes"]
    assert numbers["smol_gqa_saving"] == numbers["smol_query_heads_per_kv_head"] == 3
    assert numbers["llama2_7b_cache_4k_x_32_over_weights"] > 1  # the cache outgrows the weights


def check_naive_vs_cached(numbers):
    assert numbers["identical_tokens"]
    # ~3x at --quick; the per-step growth is too noisy
    assert numbers["cached_seconds"] < numbers["naive_seconds"]


def check_bandwidth_wall(numbers):
    assert numbers["tokens_per_s_largest_batch"] > 1.5 * numbers["tokens_per_s_batch_1"]
    # a step cannot read its weights faster than the machine reads at all (the caches hold a tenth)
    assert 0 < numbers["read_roof_fraction_batch_1"] < 1.2
    # the checkpoint's Q4_1 blocks (fetched with the real model) are read in a quarter of the bytes
    by_weights = numbers["batch_1_by_weights"]
    dense, q4_1 = by_weights["dense, in the model's dtype"], by_weights["Q4_1 blocks, fused layers"]
    assert q4_1["mb_per_step"] < dense["mb_per_step"] / 2 and set(by_weights) >= {"Q4_1 blocks, unfused"}
    # int8 KV: a byte a number and its scales, against two bytes (bf16) or four; a context 8x longer
    # reads 8x the KV a step (attention's share of the step is timed over 8 steps: too noisy to hold)
    by_context = numbers["batch_1_by_context"]
    assert list(by_context) == [numbers["dtype"], "int8"]
    for rows in by_context.values():
        shortest, longest = rows[min(rows, key=int)], rows[max(rows, key=int)]
        assert longest["kv_mb_per_step"] > 4 * shortest["kv_mb_per_step"]
        assert 0 < shortest["attention_share"] < 1 and 0 < longest["attention_share"] < 1
    last = max(by_context["int8"], key=int)
    assert (
        by_context["int8"][last]["kv_bytes_per_token"]
        < by_context[numbers["dtype"]][last]["kv_bytes_per_token"]
    )


def check_fragmentation(numbers):
    assert numbers["free_slots"] >= numbers["new_request_slots"] > numbers["largest_hole"]
    assert not numbers["arena_fits"] and numbers["paged_fits"]
    assert numbers["paged_utilization"] > numbers["arena_utilization"]
    assert numbers["paged_refused"] < numbers["arena_refused"]


def check_paged_attention(numbers):
    assert numbers["identical_to_naive"]
    assert numbers["waste_block_1"] < numbers["waste_block_16"] < numbers["waste_block_256"]
    assert (
        numbers["table_entries_block_1"]
        > numbers["table_entries_block_16"]
        > numbers["table_entries_block_256"]
    )


def check_prefix_sharing(numbers):
    assert numbers["same_prompt_prefill_saved"] > 0
    assert numbers["timestamp_first_prefill_saved"] < numbers["same_prompt_prefill_saved"]
    assert numbers["timestamp_in_turn_prefill_saved"] > numbers["timestamp_first_prefill_saved"]


def check_kv_quantization(numbers):
    assert numbers["int8_channel_perplexity_delta"] < numbers["int4_channel_perplexity_delta"]
    assert numbers["int8_channel_bytes_per_token"] < numbers["fp32_channel_bytes_per_token"]
    assert numbers["int4_channel_bytes_per_token"] < numbers["int8_channel_bytes_per_token"]


def check_eviction(numbers):
    assert numbers["h2o_10pct_perplexity"] < numbers["window_10pct_perplexity"]


def check_continuous_batching(numbers):
    assert numbers["identical_outputs"]
    assert numbers["continuous_steps"] < numbers["static_steps"]
    assert numbers["continuous_mean_start_step"] < numbers["static_mean_start_step"]


def check_preemption(numbers):
    assert numbers["identical_outputs"]  # how a victim gives its blocks back never changes a token
    assert numbers["recompute_recomputed_tokens"] > 0 and numbers["recompute_bytes_moved"] == 0
    assert numbers["swap_recomputed_tokens"] == 0 and numbers["swap_bytes_moved"] > 0
    assert numbers["auto_decisions"] == numbers["auto_chose_swap"] + numbers["auto_chose_recompute"] > 0
    # on a CPU a prefill costs far more than a memory copy of its KV (~100x and up; 2x would do)
    assert numbers["cost_recompute_seconds"][-1] > 2 * numbers["cost_swap_seconds_block_64"][-1]


def check_tiers(numbers):
    assert numbers["none_spilled"] == 0 and numbers["host_spill_hits"] > 0
    assert numbers["host_resumed_turns"] > numbers["none_resumed_turns"]
    assert numbers["host_prefill_saved"] > numbers["none_prefill_saved"]
    assert 0 < numbers["swap_prefetched"] <= numbers["swap_swapped_in"]
    assert 0 <= numbers["swap_hidden_share"] <= 1
    assert numbers["session_resumed_computed"] < numbers["session_recomputed_computed"]
    # ~10x less prefill at --quick
    assert numbers["session_resumed_ttft"] < numbers["session_recomputed_ttft"]


def check_kernel(numbers):
    assert numbers["kernel_max_error"] <= 1e-5
    assert numbers["online_softmax_max_error"] <= 1e-6


def check_memory_system(numbers):
    assert numbers["reserve_peak_seqs"] < numbers["paged_peak_seqs"]  # the same bytes, more requests at once
    assert numbers["int8_bytes_per_token"] * 3 < numbers["fp32_bytes_per_token"]
    assert numbers["busy_device_shared_bytes"] > 0 and numbers["busy_full_precision_bytes"] > 0
    assert numbers["old_paged_top1_is_answer"] and numbers["old_paged_kl"] == 0
    assert numbers["old_swapped_p_answer"] == numbers["old_paged_p_answer"]  # a swap loses nothing
    # int8 keeps the password, a recent window drops it
    assert numbers["old_int8_kl"] < numbers["old_window_kl"]
    assert numbers["old_window_p_answer"] < numbers["old_paged_p_answer"]
    assert numbers["old_h2o_remedy_seconds"] > numbers["old_swapped_remedy_seconds"]  # recompute > copy
    goodputs = {key: value for key, value in numbers.items() if key.startswith("sched_")}
    policies = ("fcfs", "lpm", "memory", "memory_no_TTFT_target")
    assert {f"sched_mixed_{p}_goodput" for p in policies} <= set(goodputs)
    assert all(0 <= share <= 1 for share in goodputs.values())


def check_speculation(numbers):
    # greedy guessing never changes a token, and a quoted passage is guessed right
    assert numbers["quote_identical"] and numbers["sky_identical"]
    assert numbers["quote_acceptance"] > 0.5 and numbers["quote_tokens_per_pass"] > 1.5
    # the rejected guesses' blocks went back, and the prefix cache vouches for no rejected token
    assert numbers["rollback_kept"] < numbers["rollback_guesses"]
    assert numbers["rollback_blocks_freed"] > 0 and numbers["rollback_freed_blocks_free"]
    assert numbers["rollback_stale_prefix_entries"] == 0
    assert numbers["rollback_probe_hit_tokens"] <= numbers["rollback_kept_entries"]
    rates = numbers["break_even_batch_1"] + numbers["break_even_batch_16"]
    assert all(rate is None or 0 <= rate <= 1 for rate in rates)


def check_life_of_a_block(numbers):
    summary, trap = numbers["summary"], numbers["trap"]
    assert summary["steps"] == numbers["run"]["steps"] and summary["requests"] == numbers["run"]["requests"]
    # the system prompt's blocks serve several requests; the pool was short: spills and a swap
    assert summary["reuse"]["requests_per_hit_block"]["max"] >= 2
    assert summary["spills"]["spilled"] > 0 and summary["swaps"]["round_trips"] > 0
    # spilling only the blocks a prompt read again copies fewer of them
    rules = numbers["spill_rules"]
    assert 0 < rules["reused"]["spilled"] < rules["all"]["spilled"]
    # the timestamp parts every prompt inside the system prompt's first blocks; normalized, it hits
    trapped, fixed = trap["trapped"], trap["normalized"]
    assert trapped["cause"] == "diverged" and trapped["diverged_at"] < 32
    assert trapped["cached_tokens"] < fixed["cached_tokens"]
    assert fixed["diverged_at"] > trapped["diverged_at"]


def check_memory_across_processes(numbers):
    store, runs = numbers["store"], numbers["runs"]
    # the store's bytes are the pool's: the same greedy tokens; reading beats recomputing, home beats both
    assert store["identical"] and store["bytes_read"] > 0
    assert store["home_s"]["median"] < store["store_s"]["median"] < store["recompute_s"]["median"]
    assert runs["kv"]["errors"] == runs["round-robin"]["errors"] == 0
    assert runs["kv"]["prefix_hit_rate"] >= runs["round-robin"]["prefix_hit_rate"]
    assert len(numbers["pictures"]["kv"]["seconds"]) > 1


@pytest.mark.parametrize(
    "name, makes_plot, check",
    [
        ("01_kv_cache_math", True, check_kv_cache_math),
        ("02_naive_vs_cached", True, check_naive_vs_cached),
        ("03_bandwidth_wall", True, check_bandwidth_wall),
        ("04_fragmentation", True, check_fragmentation),
        ("05_paged_attention", True, check_paged_attention),
        ("06_prefix_sharing", True, check_prefix_sharing),
        ("07_kv_quantization", True, check_kv_quantization),
        ("08_eviction", True, check_eviction),
        ("09_continuous_batching", True, check_continuous_batching),
        ("10_preemption", True, check_preemption),
        ("11_tiers", True, check_tiers),
        ("12_kernel", True, check_kernel),
        ("13_memory_system", True, check_memory_system),
        ("14_speculation", True, check_speculation),
        ("15_life_of_a_block", True, check_life_of_a_block),
        pytest.param(
            "16_memory_across_processes",
            True,
            check_memory_across_processes,
            marks=pytest.mark.skipif(not shutil.which("redis-server"), reason=NO_REDIS),
        ),
    ],
)
def test_lesson_runs_saves_and_its_claim_holds(name, makes_plot, check, real_dir, tmp_path):
    numbers = run_lesson(name, tmp_path)
    assert (tmp_path / f"{name}.png").is_file() == makes_plot
    check(numbers)
