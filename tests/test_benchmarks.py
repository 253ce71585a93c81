"""Every `--json` command prints ONE strict JSON object (no NaN, no Infinity) whose numbers are
finite and agree with each other: a rate is its count over its seconds, a ratio is the quotient of
the two numbers it compares, counts add up, utilizations lie in (0, 1].

The benchmarks need real text (a tokenizer), not real weights: they run on the tiny random Llama
widened to the real tokenizer's vocabulary, at the smallest sizes the CLI takes. `generate`, `info`
and `eval ppl` run on the real checkpoint, whose numbers (46,080 KV bytes per token) are known.
"""

import datetime
import json
import math
import os
import shutil
import statistics
import sys
from pathlib import Path

import pytest
import torch
from helpers import REAL_MODEL_DIR, run_json, strict_json, tiny_with_real_tokenizer

from minillm.benchmarks import cpu_model
from minillm.benchmarks.all import BENCHMARKS, SIZES
from minillm.benchmarks.decode import WEIGHT_ROWS
from minillm.benchmarks.serve import OUTPUT_LEN, PROMPT_LEN, latency_summary, trace_flops
from minillm.benchmarks.staircase import rows as staircase_rows
from minillm.benchmarks.staircase.tables import verdict
from minillm.benchmarks.stats import percentile, spread, tails
from minillm.benchmarks.workload import Request, uniform_trace
from minillm.cli import main
from minillm.config import ModelConfig
from minillm.quantized_weights import PACKED_FILE, read_packed
from minillm.report import print_json
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

ALICE = REAL_MODEL_DIR.parent / "texts" / "alice29.txt"  # fetched by `python weights_fetch.py`


def approx(value):
    return pytest.approx(value, rel=1e-9)


def kv_bytes_per_token(model_dir) -> int:
    """2 (K and V) x layers x KV heads x head_dim x 4 bytes (float32), from config.json alone."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """On a CPU shared with other work, torch's threads wait for each other and a tiny model runs
    ~50x slower with 2 threads than with 1. These runs check numbers, not speed; bench decode
    still times every thread count itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vocab_dir(real_dir, tmp_path_factory):
    """The tiny random Llama with the real tokenizer (and so the real vocabulary), and a context
    long enough for the serve trace (prompts up to 320 tokens, outputs up to 160)."""
    return tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("tiny-real-vocab"),
        real_dir,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )


# ----------------------------------------------------------------------------- the strict-JSON rule


def test_strict_json_refuses_what_python_json_accepts():
    for text in ('{"rate": NaN}\n', '{"rate": Infinity}\n', '{"rate": 1e999}\n', '{"a": 1}\n{"b": 2}\n'):
        with pytest.raises(ValueError):
            strict_json(text)


def test_a_non_finite_number_in_json_output_is_a_bug_not_a_line_of_output(capsys, monkeypatch):
    with pytest.raises(RuntimeError, match="not strict JSON"):
        print_json({"tok_s": float("nan")})
    # through the CLI: a traceback, not main's one-line user error (exit 2) and nothing on stdout
    monkeypatch.setattr("minillm.benchmarks.attention.bench_attention", lambda *args: {"GBs": float("inf")})
    with pytest.raises(RuntimeError):
        main(["bench", "attention", "--json"])
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------------- generate, info, eval


def test_generate_json_rate_is_tokens_after_the_first_over_decode_seconds(capsys, real_dir, real_tokenizer):
    report = run_json(
        capsys,
        "generate",
        "The capital of France is",
        "--json",
        "--max-tokens",
        4,
        "--model",
        real_dir,
        "--dtype",
        "float32",  # the formula below is float32's; the default precision's bytes: test_bad_input
    )
    generated, timings = report["generated_ids"], report["timings"]
    assert report["finish_reason"] == "length" and len(generated) == 4  # greedy: no EOS this early
    assert report["prompt_ids"] == real_tokenizer.encode("The capital of France is")
    assert report["text"] == real_tokenizer.decode(generated)
    assert timings["prefill_s"] > 0 and timings["decode_s"] > 0
    assert timings["decode_tok_s"] == approx((len(generated) - 1) / timings["decode_s"])
    # the contiguous cache is allocated for prompt + max_tokens up front
    assert report["kv_bytes_allocated"] == kv_bytes_per_token(real_dir) * (len(report["prompt_ids"]) + 4)


def test_generate_json_with_one_token_reports_no_decode_rate(capsys, real_dir):
    """One token is all prefill: decode time 0, so the rate is null (it was NaN, which is not JSON)."""
    report = run_json(
        capsys, "generate", "Hi", "--json", "--max-tokens", 1, "--decoder", "naive", "--model", real_dir
    )
    assert len(report["generated_ids"]) == 1 and report["decoder"] == "naive"
    assert report["timings"]["prefill_s"] > 0 and report["timings"]["decode_s"] == 0
    assert report["timings"]["decode_tok_s"] is None


def test_generate_with_one_token_prints_no_decode_rate(capsys, real_dir):
    assert main(["generate", "Hi", "--max-tokens", "1", "--model", str(real_dir)]) == 0
    assert "decode n/a" in capsys.readouterr().err


def test_info_json_kv_bytes_formula_equals_the_allocated_cache(capsys, real_dir):
    info = run_json(capsys, "info", "--json", "--model", real_dir)
    per_token = 2 * info["layers"] * info["kv_heads"] * info["head_dim"] * 4  # float32
    assert info["kv_bytes_per_token_formula"] == info["kv_bytes_per_token_allocated"] == per_token == 46080
    assert info["weight_bytes"] == 4 * info["parameters"]
    assert info["query_heads"] % info["kv_heads"] == 0 and info["dtype"] == "float32"


def test_eval_ppl_json_perplexity_is_exp_of_the_scored_nll(capsys, real_dir):
    report = run_json(
        capsys,
        "eval",
        "ppl",
        "--json",
        "--segments",
        2,
        "--segment-len",
        8,
        "--text",
        ALICE,
        "--model",
        real_dir,
    )
    assert report["tokens_scored"] == report["segments"] * (report["segment_len"] - 1) == 2 * 7
    assert report["perplexity"] == approx(math.exp(report["nll"])) and report["nll"] > 0
    assert report["seconds"] > 0 and report["tokens_evicted"] == 0
    assert report["kv_bytes_per_token"] == kv_bytes_per_token(real_dir)
    assert report["eviction"] == "none" and report["kv_budget"] is None


# ----------------------------------------------------------------------------- bench decode


def block_weight_bytes(model_dir: Path) -> dict[str, int]:
    """What a step reads through GGUF blocks, counted apart from the benchmark: Q8_0 made here is
    34 bytes per 32 weights of every product; Q4_1 is the packed file's blocks. Norms in fp32."""
    model = load_model(model_dir)
    matrices = {name: model.state_dict()[name] for name in model.products()}
    norms = sum(p.nbytes for p in model.parameters() if p.dim() == 1)
    counts = {"q8_0 fused": sum(m.numel() for m in matrices.values()) * 34 // 32 + norms}
    if (model_dir / PACKED_FILE).is_file():
        blocks = sum(w.blocks.nbytes for w in read_packed(model_dir).values())
        counts["q4_1+q8_0 fused"] = counts["q4_1+q8_0"] = blocks + norms
    return counts


def check_decoder_rows(report: dict, weight_bytes: int, kv_per_token: int, blocks: dict[str, int]) -> None:
    roof_GBs = report["copy_bandwidth_GBs"]
    assert roof_GBs > 0 and report["read_bandwidth_GBs"] > 0  # the CPU kernels build here
    for name, row in report["decoders"].items():
        tokens = report["naive_tokens"] if name == "naive" else report["new_tokens"]
        kv_read = 0 if name == "naive" else kv_per_token * (report["prompt_len"] + tokens / 2)
        scale = 0.5 if row["dtype"] == "bfloat16" else 1  # the tiny and real models load as float32
        if row["weights"] in blocks:  # products through GGUF blocks, in fp32
            assert row["bytes_per_step"] == approx(blocks[row["weights"]] + kv_read), name
        else:
            assert row["weights"] == row["dtype"]
            assert row["bytes_per_step"] == approx((weight_bytes + kv_read) * scale), name
        samples = row["samples_tok_s"]
        assert len(samples) == report["repeats"] and row["tok_s"] == statistics.median(samples) > 0, name
        assert row["best_tok_s"] == max(samples) and row["spread"] == approx(
            (max(samples) - min(samples)) / row["tok_s"]
        )
        assert row["ms_per_token"] == approx(1000 / row["tok_s"]), name
        assert row["bandwidth_GBs"] == approx(row["bytes_per_step"] * row["tok_s"] / 1e9), name
        assert row["roof_fraction"] == approx(row["bandwidth_GBs"] / roof_GBs) and row["roof_fraction"] > 0, (
            name
        )
        assert row["read_roof_fraction"] == approx(row["bandwidth_GBs"] / report["read_bandwidth_GBs"]), name
    decoders = report["decoders"]
    assert report["engine_vs_cached"] == approx(decoders["engine"]["tok_s"] / decoders["cached"]["tok_s"])
    assert report["cached_bfloat16_vs_cached"] == approx(
        decoders["cached_bfloat16"]["tok_s"] / decoders["cached"]["tok_s"]
    )
    assert report["cached_vs_naive"] == approx(decoders["cached"]["tok_s"] / decoders["naive"]["tok_s"])
    threads = report["cached_tok_s_by_threads"]  # JSON keys are strings
    assert list(threads) == [str(n) for n in range(1, os.cpu_count() + 1)] and min(threads.values()) > 0
    assert (
        report["machine"]["cpus"] == os.cpu_count()
        and report["machine"]["torch_threads"] == torch.get_num_threads()
    )


def test_bench_decode_json_with_hf_rates_ratios_and_bandwidth_agree(capsys, vocab_dir):
    report = run_json(
        capsys,
        "bench",
        "decode",
        "--json",
        "--tokens",
        16,
        "--naive-tokens",
        4,
        "--prompt-len",
        8,
        "--model",
        vocab_dir,
    )
    assert (report["prompt_len"], report["new_tokens"], report["naive_tokens"]) == (8, 16, 4)
    assert set(report["decoders"]) == {
        "naive",
        "cached",
        "engine",
        "cached_bfloat16",
        "hf_transformers",
        "engine_int8",  # no Q4_1 blocks were fetched for the tiny model: its rows are left out, saying why
    }
    assert "weights_fetch.py" in report["left_out"]
    weight_bytes = sum(p.nbytes for p in load_model(vocab_dir).parameters())
    check_decoder_rows(report, weight_bytes, kv_bytes_per_token(vocab_dir), block_weight_bytes(vocab_dir))
    decoders = report["decoders"]
    assert report["cached_vs_hf"] == approx(
        decoders["cached"]["tok_s"] / decoders["hf_transformers"]["tok_s"]
    )


def test_bench_decode_json_on_the_real_model_without_hf(capsys, real_dir, real_model):
    report = run_json(
        capsys,
        "bench",
        "decode",
        "--json",
        "--tokens",
        2,
        "--naive-tokens",
        1,
        "--prompt-len",
        4,
        "--repeats",
        2,
        "--no-hf",
        "--model",
        real_dir,
    )
    assert set(report["decoders"]) == {"naive", "cached", "engine", "cached_bfloat16", *WEIGHT_ROWS}
    assert "cached_vs_hf" not in report and report["left_out"] is None
    assert report["decoders"]["engine_q4_1_unfused"]["weights"] == "q4_1+q8_0"
    for name in WEIGHT_ROWS:
        assert report[f"{name}_vs_engine"] == approx(
            report["decoders"][name]["tok_s"] / report["decoders"]["engine"]["tok_s"]
        )
    blocks = block_weight_bytes(real_dir)
    assert blocks["q4_1+q8_0"] < sum(p.nbytes for p in real_model.parameters()) / 5  # 4 and 8 bits, not 32
    check_decoder_rows(report, sum(p.nbytes for p in real_model.parameters()), 46080, blocks)


# ----------------------------------------------------------------------------- bench serve


def check_server(run: dict, output_tokens: int, report: dict) -> None:
    # every server decodes each request to exactly its trace length (EOS ignored)
    assert run["output_tok_s"] * run["elapsed_s"] == approx(output_tokens)
    # the same useful work for every server, over its own time, against the matmul measured in the run
    assert run["achieved_GFLOPs"] == approx(report["trace"]["model_GFLOP"] / run["elapsed_s"])
    assert (
        run["matmul_fraction"] == approx(run["achieved_GFLOPs"] / report["matmul_GFLOPs"])
        and report["matmul_GFLOPs"] > 0
    )
    for latency in ("ttft", "tpot"):
        assert (
            0 < run[f"{latency}_mean_s"] <= run["elapsed_s"]
            and 0 < run[f"{latency}_p90_s"] <= run["elapsed_s"]
        )


def check_paged_memory(run: dict) -> None:
    assert 0 < run["kv_utilization_paged"] <= 1
    assert run["wasted_slots_per_step"] >= 0 and run["block_table_entries_per_seq"] > 0


def test_bench_speculative_json_counts_and_ratios_agree(capsys, vocab_dir):
    report = run_json(
        capsys,
        *("bench", "speculative", "--json", "--max-tokens", 12, "--repeats", 2, "--batch", 3),
        *("--model", vocab_dir),
    )
    assert set(report["sets"]) == {"input-grounded", "open-ended"} and report["dtype"] == "float32"
    guessed = 0
    for runs in report["sets"].values():
        one, many = runs["batch_1"], runs["batched"]
        assert one["identical"] and many["identical"]  # float32: speculation changes no token
        assert len(one["prompts"]) == 4 and many["sequences"] == 3
        for run in (one, many):
            guessed += run["draft_tokens"]
            if run["drafts"]:
                assert run["acceptance_rate"] == approx(run["accepted_tokens"] / run["draft_tokens"])
                assert run["tokens_per_pass"] == approx(1 + run["accepted_tokens"] / run["drafts"])
            low, high = run["speedup_range"]
            assert 0 < low <= run["speedup"] <= high
    assert guessed > 0


def test_bench_structured_json_sides_and_mask_agree(capsys, vocab_dir):
    report = run_json(
        capsys,
        *("bench", "structured", "--json", "--batch", 3, "--max-tokens", 8, "--repeats", 2),
        *("--model", vocab_dir),
    )
    sides = report["sides"]
    assert list(sides) == ["free", "regex", "json"] and report["batch"] == 3
    assert sides["free"]["tokens_per_sequence"] == sides["regex"]["tokens_per_sequence"] == 8  # same work
    assert 1 <= sides["json"]["tokens_per_sequence"] <= 8
    for side in sides.values():
        low, high = side["decode_tok_s_range"]
        assert 0 < low <= side["decode_tok_s"] <= high and side["ratio"] > 0
    assert sides["free"]["ratio"] == 1 and sides["free"]["mask_ms"] is None
    for name in ("regex", "json"):
        assert 0 < sides[name]["mask_ms"] <= sides[name]["mask_max_ms"]
    assert report["free_step_ms"] == approx(1e3 * 3 / sides["free"]["decode_tok_s"])


def test_bench_serve_json_with_hf_rates_ratios_and_sweep_agree(capsys, vocab_dir):
    report = run_json(
        capsys,
        "bench",
        "serve",
        "--json",
        "--requests",
        3,
        "--max-num-seqs",
        2,
        "--block-sizes",
        8,
        16,
        "--model",
        vocab_dir,
    )
    trace = uniform_trace(Tokenizer(vocab_dir), 3, PROMPT_LEN, OUTPUT_LEN)
    assert report["trace"]["requests"] == 3 and report["trace"]["max_num_seqs"] == 2
    assert report["trace"]["prompt_tokens"] == sum(len(r.prompt_ids) for r in trace)
    assert report["trace"]["output_tokens"] == sum(r.output_len for r in trace)
    servers = report["servers"]
    assert set(servers) == {"minillm_continuous", "minillm_static", "hf_transformers_static"}
    for run in servers.values():
        check_server(run, report["trace"]["output_tokens"], report)
    for name in ("minillm_continuous", "minillm_static"):
        check_paged_memory(servers[name])
        assert 0 < servers[name]["kv_utilization_contiguous"] <= 1
        # one decode step adds at most one token per request, so the longest output sets a floor
        assert (
            servers[name]["steps"] >= max(r.output_len for r in trace) and servers[name]["preemptions"] >= 0
        )
    continuous, static, hf = (
        servers[name] for name in ("minillm_continuous", "minillm_static", "hf_transformers_static")
    )
    assert report["continuous_vs_static"] == approx(continuous["output_tok_s"] / static["output_tok_s"])
    assert report["continuous_vs_hf"] == approx(continuous["output_tok_s"] / hf["output_tok_s"])

    sweep = report["block_size_sweep"]
    assert list(sweep) == ["8", "16"]  # JSON keys are strings
    assert sweep["16"] == {key: continuous[key] for key in sweep["16"]}  # the continuous run itself
    for run in sweep.values():
        check_paged_memory(run)
    # same schedule, finer blocks: less of each sequence's last block is reserved but empty
    assert sweep["8"]["wasted_slots_per_step"] < sweep["16"]["wasted_slots_per_step"]
    assert sweep["8"]["kv_utilization_paged"] > sweep["16"]["kv_utilization_paged"]
    assert sweep["8"]["block_table_entries_per_seq"] > sweep["16"]["block_table_entries_per_seq"]


def test_bench_serve_json_one_request_p90_is_that_request(capsys, vocab_dir):
    report = run_json(
        capsys,
        "bench",
        "serve",
        "--json",
        "--requests",
        1,
        "--max-num-seqs",
        1,
        "--block-sizes",
        "--no-hf",
        "--model",
        vocab_dir,
    )
    assert (
        set(report["servers"]) == {"minillm_continuous", "minillm_static"}
        and "continuous_vs_hf" not in report
    )
    assert report["block_size_sweep"] == {}
    for run in report["servers"].values():
        check_server(run, report["trace"]["output_tokens"], report)
        assert run["ttft_p90_s"] == run["ttft_mean_s"] and run["tpot_p90_s"] == run["tpot_mean_s"]


def test_trace_flops_by_hand():
    """One layer, hidden 4, 2 heads and 1 KV head of dim 2, intermediate 8, vocab 10: a layer holds
    4*(2+2)*2 (wqkv) + 4*4 (wo) + 3*4*8 (gate, up, down) = 144 weights. A 3-token prompt with 2
    outputs computes 4 tokens (288 FLOPs each), attends over 1+2+3+4 keys (16 FLOPs a key: q.k and
    p.v for 2 heads of dim 2), and computes 2 logits rows (80 FLOPs each)."""
    config = ModelConfig(
        vocab_size=10,
        hidden_size=4,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
        max_position_embeddings=16,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    assert trace_flops(config, [Request("prose", [1, 2, 3], 2, 2)]) == 4 * 288 + 10 * 16 + 2 * 80


def test_latency_summary_mean_and_nearest_rank_p90_by_hand():
    ten = [0.7, 0.2, 1.0, 0.5, 0.9, 0.1, 0.4, 0.8, 0.3, 0.6]  # 0.1 .. 1.0, shuffled
    assert latency_summary("ttft", ten) == {"ttft_mean_s": approx(0.55), "ttft_p90_s": 0.9}  # 9th of 10
    # p90 is the ceil(0.9 n)-th smallest: the largest of 2 and of 5, the 18th of 20
    assert latency_summary("x", [3.0, 1.0]) == {"x_mean_s": 2.0, "x_p90_s": 3.0}
    assert latency_summary("x", [5.0, 1.0, 4.0, 2.0, 3.0]) == {"x_mean_s": 3.0, "x_p90_s": 5.0}
    assert latency_summary("x", [float(v) for v in range(20, 0, -1)])["x_p90_s"] == 18.0
    assert latency_summary("x", [0.25]) == {"x_mean_s": 0.25, "x_p90_s": 0.25}


# ----------------------------------------------------------------------------- bench prefix


def test_bench_prefix_json_cached_and_computed_prefill_add_up(capsys, vocab_dir):
    report = run_json(
        capsys, "bench", "prefix", "--json", "--requests", 3, "--system-tokens", 40, "--model", vocab_dir
    )
    without, with_cache = report["without_cache"], report["with_cache"]
    cache = with_cache["prefix_cache"]
    prompt_tokens = round(report["requests"] * report["prompt_tokens_mean"])
    assert report["requests"] == 3 and "prefix_cache" not in without
    assert without["prefill_tokens_computed"] == prompt_tokens == cache["prompt_tokens"]
    assert with_cache["prefill_tokens_computed"] + cache["prefill_tokens_saved"] == prompt_tokens
    assert cache["hit_blocks"] >= 2 * 2  # requests 2 and 3 each find the 40-token system prompt's blocks
    assert cache["block_hit_rate"] == approx(cache["hit_blocks"] / cache["queried_blocks"])
    assert report["prefill_tokens_ratio"] == approx(
        without["prefill_tokens_computed"] / with_cache["prefill_tokens_computed"]
    )
    assert report["prefill_tokens_ratio"] > 1
    assert report["ttft_speedup_after_first"] == approx(
        without["ttft_rest_mean_s"] / with_cache["ttft_rest_mean_s"]
    )
    for run in (without, with_cache):
        assert run["ttft_first_s"] > 0 and run["ttft_rest_mean_s"] > 0 and run["max_shared_bytes"] >= 0
    for name in ("parallel_sampling_n4", "beam_search_width4"):
        sharing = report[name]
        shared, unshared = sharing["mean_reserved_bytes_shared"], sharing["mean_reserved_bytes_unshared"]
        assert 0 < shared < unshared, name  # four outputs over one prompt share at least its full blocks
        assert (
            sharing["memory_saved"] == approx(1 - shared / unshared) and sharing["copy_on_write_copies"] >= 0
        )


# ----------------------------------------------------------------------------- bench tiers


def test_bench_tiers_json_rows_agree_on_outputs_and_count_what_moved(capsys, vocab_dir):
    """Exact facts only: a rate of 1e9/s puts the whole trace in the queue before the first step,
    so every row sees the same schedule pressure; a 160-token device pool forces preemption."""
    report = run_json(
        capsys,
        "bench",
        "tiers",
        "--json",
        "--requests",
        8,
        "--rate",
        "1e9",
        "--device-tokens",
        160,
        "--history-tokens",
        200,
        "--system-prompts",
        4,
        "--system-tokens",
        48,
        "--spill-requests",
        12,
        "--spill-rule-requests",
        12,
        "--spill-rule-seeds",
        "1,2",
        "--model",
        vocab_dir,
    )
    assert report["machine"]["cpu_model"] and report["machine"]["torch_threads"] == 1

    preemption = report["preemption"]
    rows = preemption["rows"]
    assert list(rows) == ["recompute", "swap", "auto"]
    assert preemption["outputs_identical"] and preemption["requests_differing"] == 0  # all three are lossless
    for name, row in rows.items():
        assert row["errors"] == 0 and row["preemptions"] > 0, name
        assert row["output_tok_s"] * row["elapsed_s"] == approx(preemption["trace"]["output_tokens"]), name
        assert row["cpu_s"] > 0, name
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"], name
        assert (row["prefetch_hidden"] is None) == (row["prefetch_copy_s"] == 0), name
    assert rows["recompute"]["recomputed_tokens"] > 0 and rows["recompute"]["swapped_out"] == 0
    swap = rows["swap"]
    assert swap["recomputed_tokens"] == 0 and swap["swapped_out"] > 0
    assert swap["swap_copies_saved"] > 0  # the system prompt's blocks, left by holders at different steps
    assert set(swap["bytes_moved"]) == {"device->host", "host->device"}  # nothing overflows to disk

    resume = report["resume"]
    assert resume["answers_identical"]
    assert resume["session_tokens"] == resume["history_tokens"] // 16 * 16  # every full block of the history
    assert resume["recompute"]["prefill_tokens_computed"] == resume["prompt_tokens"]
    assert resume["resume"]["prefill_tokens_computed"] == resume["prompt_tokens"] - resume["session_tokens"]
    assert resume["session_file_bytes"] > resume["session_tokens"] * kv_bytes_per_token(vocab_dir)
    assert resume["ttft_ratio"] == approx(resume["recompute"]["ttft_s"] / resume["resume"]["ttft_s"])

    spill = report["prefix_spill"]
    without, with_host = spill["without_host"], spill["with_host"]
    assert spill["answers_identical"]
    assert without["spilled"] == without["spill_hits"] == 0 and without["bytes_moved"] == {}
    assert with_host["spilled"] > 0 and with_host["spill_hits"] > 0
    prompt_tokens = round(spill["requests"] * spill["prompt_tokens_mean"])
    for row in (without, with_host):
        assert row["prefill_tokens_computed"] + row["prefix_cache"]["prefill_tokens_saved"] == prompt_tokens
    assert with_host["prefix_cache"]["prefill_tokens_saved"] > without["prefix_cache"]["prefill_tokens_saved"]

    rule = report["spill_rule"]
    assert (
        list(rule["runs"]) == ["all", "reused"] and rule["outputs_differing"] == 0
    )  # a spill changes no token
    for runs in rule["runs"].values():
        assert [run["seed"] for run in runs] == [1, 2]
        for run in runs:
            assert run["spilled_bytes"] == run["spilled_blocks"] * 16 * kv_bytes_per_token(vocab_dir)
            assert 0 <= run["spill_hits"] <= run["spilled_blocks"] and 0 <= run["block_hit_rate"] <= 1
    fewer = [a["spilled_blocks"] / max(r["spilled_blocks"], 1) for a, r in zip(*rule["runs"].values())]
    assert rule["spilled_bytes_all_over_reused"]["median"] == approx(
        sorted(fewer)[0] / 2 + sorted(fewer)[1] / 2
    )

    targets = report["targets"]
    assert set(targets) == {
        "auto_vs_best_tok_s",
        "swap_recomputed_tokens",
        "swap_prefetch_hidden",
        "resume_ttft_ratio",
        "spill_prefill_saved_ratio",
        "spill_rule_fewer_bytes",
    }
    assert targets["swap_recomputed_tokens"] == {"want": "0", "got": 0, "met": True}


def test_percentile_is_the_nearest_rank_by_hand():
    ten = [0.7, 0.2, 1.0, 0.5, 0.9, 0.1, 0.4, 0.8, 0.3, 0.6]  # 0.1 .. 1.0, shuffled
    assert percentile(ten, 50) == 0.5 and percentile(ten, 99) == 1.0  # the 5th and the 10th of 10
    assert percentile([float(v) for v in range(100, 0, -1)], 99) == 99.0
    assert percentile([2.0, 1.0], 50) == 1.0 and percentile([0.25], 99) == 0.25


def test_tails_are_none_without_values_and_spread_is_median_min_max():
    assert tails("tpot", []) == {"tpot_p50_s": None, "tpot_p99_s": None}
    assert tails("ttft", [3.0, 1.0, 2.0]) == {"ttft_p50_s": 2.0, "ttft_p99_s": 3.0}
    assert spread([4.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 4.0}


# ----------------------------------------------------------------------------- bench memory


def test_bench_memory_json_rows_keep_their_promises(capsys, vocab_dir):
    """Facts that hold whatever the timings: lossless rows give the paged row's greedy tokens, a
    max-length reservation never preempts and runs no more sequences at once than paging, the ladder
    takes only the rungs it has, and every lossy row says what it costs."""
    report = run_json(
        capsys,
        "bench",
        "memory",
        "--json",
        "--quick",
        "--requests",
        16,
        "--rate",
        "1e9",
        "--kv-tokens",
        128,
        "--model",
        vocab_dir,
    )
    assert report["machine"]["cpu_model"] and report["machine"]["torch_threads"] == 1 and report["quick"]
    trace, budget, rows = report["trace"], report["budget"], report["rows"]
    assert list(rows) == ["reserve", "paged", "prefix", "int8", "host", "memory", "ladder", "lossless"]
    assert sum(kind["requests"] for kind in trace["kinds"].values()) == trace["requests"] == 16
    assert all(kind["requests"] > 0 for kind in trace["kinds"].values())
    assert budget["kv_bytes"] == 128 * kv_bytes_per_token(vocab_dir)  # 8 blocks of float32 KV, for every row

    assert report["lossless_outputs_equal"]
    for name, row in rows.items():
        assert row["errors"] == 0, name
        assert row["output_tok_s"] * row["elapsed_s"] == approx(trace["output_tokens"]), name
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and row["cpu_s"] > 0, name
        assert 0 <= row["goodput"] <= 1 and row["goodput"] * trace["requests"] == approx(
            row["goodput_requests"]
        ), name
        assert set(row["rungs"]) <= {"reclaim", "preempt", "evict"}, name
        assert row["bytes_moved_total"] == sum(row["bytes_moved"].values()), name
        assert row["kv_utilization"] > 0 and row["peak_seqs"] >= 1, name
        lossless = name in ("reserve", "paged", "prefix", "lossless")
        assert (row["outputs_equal"] is True) if lossless else (row["outputs_equal"] is None), name
        assert (row["quality"] is None) == lossless, name
        if not lossless:
            ratios = row["quality"]["perplexity_ratio"]
            assert len(ratios) == 2 and all(ratio > 0 for ratio in ratios.values()), name
    assert rows["reserve"]["preemptions"] == 0 and rows["reserve"]["peak_seqs"] <= rows["paged"]["peak_seqs"]
    assert rows["ladder"]["quality"]["setting"] == "int8+h2o" and rows["int8"]["quality"]["setting"] == "int8"
    fp32_blocks = {rows[name]["device_blocks"] for name in ("reserve", "paged", "prefix", "lossless")}
    assert fp32_blocks == {8} and rows["int8"]["device_blocks"] > 8  # the same bytes buy more int8 blocks
    assert rows["paged"]["bytes_moved"] == {} and rows["lossless"]["rungs"].get("evict", 0) == 0

    quality = report["quality"]
    assert set(quality["perplexity"]) == {"exact", "int8", "int8+h2o"} and len(quality["texts"]) == 2
    load = report["load"]
    assert list(load["rows"]) == ["reserve", "paged", "lossless", "memory"]
    for name, row in load["rows"].items():
        swept = [run["clients"] for run in row["sweep"]]
        assert swept == load["grid"][: len(swept)] and row["fixed"]["clients"] == load["clients"], name
        assert row["max_clients"] is None or row["max_clients"] in swept, name
        for run in row["sweep"]:
            assert run["errors"] == 0 and run["latency_p50_s"] <= run["latency_p99_s"], name
    assert set(report["targets"]) == {
        "memory_vs_fcfs_goodput",
        "lossless_vs_reserve_peak_seqs",
        "lossless_vs_reserve_tok_s",
        "int8_perplexity_ratio",
    }


# ----------------------------------------------------------------------------- bench staircase


def test_bench_staircase_json_rows_ratios_and_greedy_tokens_agree(capsys, monkeypatch, vocab_dir):
    """One KV budget for four rows, on one trace per seed; each row's ratios are its numbers over
    the row before's, seed by seed, the summary their medians, and "greedy identical" counts
    requests whose tokens match over every seed: row (3)'s first request is given one wrong token
    here in each seed, so row (4), exact against (3) otherwise, must count one request fewer each."""
    run_minillm_row = staircase_rows.run_minillm_row

    def one_wrong_token_in_row_3(*args, **kwargs):
        measured, tokens = run_minillm_row(*args, **kwargs)
        if args[3] == staircase_rows.ROWS["int8"][1]:  # row (3)'s switches
            tokens[0] = tokens[0][:-1] + [tokens[0][-1] + 1]
        return measured, tokens

    monkeypatch.setattr(staircase_rows, "run_minillm_row", one_wrong_token_in_row_3)
    report = run_json(
        capsys,
        "bench",
        "staircase",
        "--json",
        "--requests",
        3,
        "--prompt-len",
        40,
        80,
        "--output-len",
        4,
        8,
        "--seeds",
        1,
        2,
        "--dtype",
        "float32",
        "--threads",
        1,
        "--attention-context",
        256,
        "--attention-chunk",
        64,
        "--attention-repeats",
        1,
        "--model",
        vocab_dir,
    )
    traces = [uniform_trace(Tokenizer(vocab_dir), 3, (40, 80), (4, 8), seed) for seed in (1, 2)]
    worst = 80 + 8  # the longest prompt and output the ranges allow: what a static server sizes for
    assert [run["seed"] for run in report["runs"]] == report["trace"]["seeds"] == [1, 2]
    for run, trace in zip(report["runs"], traces):
        assert run["trace"]["output_tokens"] == sum(r.output_len for r in trace)
    assert report["trace"]["worst_case_tokens"] == worst and report["machine"]["torch_threads"] == 1
    budget, per_token = report["budget"], kv_bytes_per_token(vocab_dir)
    assert budget["kv_tokens"] == 3 * worst and budget["kv_bytes"] == -(-3 * worst // 16) * 16 * per_token
    assert budget["hf_batch_size"] == budget["kv_bytes"] // (worst * per_token) == 3

    for run in report["runs"]:
        rows = run["rows"]
        assert list(rows) == ["hf", "paged", "int8", "flash"]
        for name, row in rows.items():
            assert row["output_tok_s"] * row["elapsed_s"] == approx(run["trace"]["output_tokens"]), name
            assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] <= row["elapsed_s"], name
            assert 0 < row["tpot_p50_s"] <= row["tpot_p99_s"], name
            assert 0 < row["kv_bytes_peak"] <= budget["kv_bytes"] and 1 <= row["peak_seqs"] <= 3, name
            assert (row["preemptions"] == 0) == (row["recomputed_tokens"] == 0), name
        for before, row in zip(rows.values(), list(rows.values())[1:]):
            for key in ("output_tok_s", "ttft_p50_s", "tpot_p50_s"):
                assert row[f"{key}_vs_before"] == approx(row[key] / before[key]), (row["label"], key)
        assert rows["paged"]["switches"]["admission"] == "memory"

    rows = report["rows"]  # the summary: medians over the seeds, min and max beside them
    for name, row in rows.items():
        for key in ("output_tok_s", "output_tok_s_vs_before", "ttft_p50_s", "peak_seqs"):
            seen = [run["rows"][name][key] for run in report["runs"]]
            if None in seen:
                assert row[key] is None, (name, key)
                continue
            assert row[key] == approx(sum(seen) / 2) and row["spread"][key] == [min(seen), max(seen)]
    assert rows["hf"]["output_tok_s_vs_before"] is None and rows["hf"]["compared_with"] is None
    # the same bytes: whole fp32 blocks, ~3x as many int8 ones (the tiny model's scales weigh more)
    assert rows["paged"]["blocks"] == budget["kv_bytes"] // (16 * per_token)
    assert rows["int8"]["blocks"] == rows["flash"]["blocks"] > 2.5 * rows["paged"]["blocks"]

    assert [(rows[n]["compared_with"], rows[n]["lossless_step"]) for n in ("paged", "int8", "flash")] == [
        ("hf", True),
        ("paged", False),
        ("int8", True),
    ]
    assert rows["paged"]["requests_identical"] == rows["paged"]["requests_compared"] == 6
    assert rows["paged"]["greedy_identical"] == 1.0
    assert rows["flash"]["requests_identical"] == 4 and rows["flash"]["greedy_identical"] == approx(4 / 6)
    said = " ".join(report["what_it_means"])
    assert "(4) gave (3)'s greedy tokens for 4 of 6 requests (a lossless step; each difference" in said
    assert "(2) gave (1)'s greedy tokens for 6 of 6 requests (a lossless step)." in said
    assert f"x{rows['flash']['output_tok_s_vs_before']:.2f} output tok/s" in said
    assert ("ran short of blocks" in said) == any(row["preemptions"] for row in rows.values())

    prefill = report["prefill_attention"]
    assert (prefill["context"], prefill["chunk"]) == (256, 64)
    assert [r["kv_dtype"] for r in prefill["rows"]] == ["auto", "int8"]
    for r in prefill["rows"]:
        assert r["speedup"] == approx(r["torch_reference_ms"] / r["cpu_kernel_ms"]) and r["speedup"] > 0
        assert r["max_abs_diff"] < 1e-4  # the kernel computes the reference's attention


def test_staircase_verdict_names_what_a_step_bought_beyond_noise():
    def step(tok_s, ttft):
        return verdict({"output_tok_s_vs_before": tok_s, "ttft_p50_s_vs_before": ttft})

    assert step(1.5, 0.5) == "paid in tok/s and TTFT"
    assert step(1.5, 1.2) == "paid in tok/s, cost TTFT"
    assert step(0.7, 0.9) == "paid in TTFT, cost tok/s"
    assert step(0.7, 1.2) == "did not pay, cost tok/s and TTFT"
    assert step(1.02, 0.98) == "did not pay (both within 5%)"


# ----------------------------------------------------------------------------- bench attention


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
        ),
    ],
)
def test_bench_attention_json_bandwidth_is_bytes_read_over_time(capsys, device):
    report = run_json(
        capsys,
        "bench",
        "attention",
        "--json",
        "--batches",
        1,
        2,
        "--contexts",
        16,
        40,
        "--device",
        device,
        "--kv-dtype",
        "auto",
        "int8",
        "int4",
    )
    expected_backends = (
        ["torch_reference", "cpu_kernel"]
        if device == "cpu"
        else ["torch_reference", "cuda_kernel", "sdpa_gathered"]
    )
    assert report["backends"] == expected_backends and report["dtype"] == "float32"
    shape = report["shape"]
    cases = [(1, 16), (1, 40), (2, 16), (2, 40)]
    assert [(row["kv_dtype"], row["batch"], row["context"]) for row in report["rows"]] == [
        (kv, *case) for kv in ("auto", "int8", "int4") for case in cases
    ]
    heads = shape["num_kv_heads"]
    per_token = {
        "auto": 2 * heads * shape["head_dim"] * 4,  # K and V in fp32
        # int8: numbers, a (scale, center) fp16 pair per value row, one per key channel per 16-token block
        "int8": 2 * heads * shape["head_dim"] + heads * 4 + heads * shape["head_dim"] * 4 / 16,
        "int4": heads * shape["head_dim"] + heads * 4 + heads * shape["head_dim"] * 4 / 16,
    }
    for row in report["rows"]:
        assert row["kv_bytes"] == row["batch"] * row["context"] * math.ceil(per_token[row["kv_dtype"]])
        for name in report["backends"]:
            if row["kv_dtype"] != "auto" and name == "sdpa_gathered":
                continue
            seconds = row[f"{name}_us"] / 1e6
            assert seconds > 0
            assert row[f"{name}_GBs"] == approx(row["kv_bytes"] / seconds / 1e9)
            assert row[f"{name}_roof_fraction"] == approx(row[f"{name}_GBs"] / report["copy_bandwidth_GBs"])
            assert row[f"{name}_roof_fraction"] > 0
    kernel = report["kernel"]
    by_case = {(row["kv_dtype"], row["batch"], row["context"]): row for row in report["rows"]}
    for speedup in report["speedups"]:
        full, small = (
            by_case[("auto", speedup["batch"], speedup["context"])],
            by_case[(speedup["kv_dtype"], speedup["batch"], speedup["context"])],
        )
        assert speedup["speedup"] == approx(full[f"{kernel}_us"] / small[f"{kernel}_us"])
        assert speedup["bytes_ratio"] == approx(full["kv_bytes"] / small["kv_bytes"])


# ----------------------------------------------------------------------------- bench all

TINY_SIZES = {  # every benchmark at the sizes of its own test above, for the tiny model: seconds in all
    "decode": {"prompt_len": 8, "new_tokens": 4, "naive_tokens": 2, "repeats": 1, "include_hf": False},
    "attention": {"batches": (1,), "contexts": (16,), "kv_dtypes": ("auto", "int8")},
    "serve": {"num_requests": 2, "max_num_seqs": 2, "block_sizes": (), "include_hf": False},
    "prefix": {"num_requests": 2, "system_tokens": 40},
    "tiers": {
        "num_requests": 8,
        "rate": 1e9,
        "device_tokens": 160,
        "history_tokens": 200,
        "system_prompts": 4,
        "system_tokens": 48,
        "spill_requests": 12,
        "spill_rule_requests": 12,
        "spill_rule_seeds": (1,),
    },
    "memory": {"quick": True, "num_requests": 16, "rate": 1e9, "kv_tokens": 128, "load": False},
    "staircase": {
        "seeds": (1,),
        "num_requests": 2,
        "prompt_len": (40, 80),
        "output_len": (4, 8),
        "include_hf": False,
        "attention_context": 128,
        "attention_chunk": 32,
        "attention_repeats": 1,
    },
    "ppl": {"kv_dtypes": ("auto", "int8"), "segment_len": 16, "num_segments": 1},
}


def table_rows(markdown: str) -> list[list[str]]:
    """The cells of a markdown table's body rows."""
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]  # rows[0] is the header


def test_bench_all_writes_every_report_a_plot_each_and_a_table_equal_to_the_json(
    capsys, monkeypatch, tmp_path, vocab_dir
):
    monkeypatch.setitem(SIZES, "quick", TINY_SIZES)
    report = run_json(capsys, "bench", "all", "--quick", "--json", "--out", tmp_path, "--model", vocab_dir)
    assert json.loads((tmp_path / "results.json").read_text()) == report
    assert report["command"] == "minillm bench all --quick" and report["failed"] == []
    machine = report["machine"]
    assert machine["cpu_model"] == cpu_model() and machine["torch"] == torch.__version__
    assert machine["torch_threads"] == 1 and machine["cpus"] == os.cpu_count()
    when = datetime.datetime.fromisoformat(report["date"])
    assert abs(datetime.datetime.now(datetime.timezone.utc) - when) < datetime.timedelta(minutes=10)

    benchmarks = report["benchmarks"]
    assert list(benchmarks) == [bench.name for bench in BENCHMARKS] == list(TINY_SIZES)
    for name, result in benchmarks.items():
        assert result["status"] == "ok" and result["seconds"] > 0 and result["headlines"], name
        assert (
            result["plot"] == f"{name}.png" and (tmp_path / result["plot"]).read_bytes()[:4] == b"\x89PNG"
        ), name
    # headlines are the reports' own numbers, rounded to 3 significant digits
    decode, ppl = benchmarks["decode"], benchmarks["ppl"]["report"]["kv_dtypes"]
    assert decode["headlines"][1] == {
        "measurement": "cached (float32), median of 1",
        "unit": "tok/s",
        "value": float(f"{decode['report']['decoders']['cached']['tok_s']:.3g}"),
    }
    int8_cost = next(
        h["value"]
        for h in benchmarks["ppl"]["headlines"]
        if h["measurement"] == "int8 KV: perplexity above the model's dtype"
    )
    assert int8_cost == float(f"{100 * (ppl['int8']['perplexity'] / ppl['auto']['perplexity'] - 1):.3g}")

    markdown = (tmp_path / "results.md").read_text()
    assert (
        machine["cpu_model"] in markdown.splitlines()[0] and report["date"][:10] in markdown.splitlines()[0]
    )
    rows = table_rows(markdown)
    headlines = [(name, h) for name, result in benchmarks.items() for h in result["headlines"]]
    assert len(rows) == len(headlines)
    for (bench, measurement, value, unit), (name, h) in zip(rows, headlines):
        assert (bench, measurement, unit) == (name, h["measurement"], h["unit"])
        if h["value"] is None:
            assert value == "n/a", (name, h)
        else:
            assert float(value) == h["value"], (name, h)


def test_bench_all_records_a_failing_benchmark_and_runs_the_others(capsys, monkeypatch, tmp_path, vocab_dir):
    """One request is too few for bench prefix (a ConfigError); the benchmarks around it still run."""
    monkeypatch.setitem(
        SIZES,
        "full",
        {
            "attention": TINY_SIZES["attention"],
            "prefix": {**TINY_SIZES["prefix"], "num_requests": 1},
            "ppl": TINY_SIZES["ppl"],
        },
    )
    code = main(["bench", "all", "--out", str(tmp_path), "--model", str(vocab_dir)])
    out, err = capsys.readouterr()
    assert code == 1 and len(err.strip().splitlines()) == 1 and "prefix" in err, err
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["failed"] == ["prefix"]
    failed = results["benchmarks"]["prefix"]
    assert failed["status"] == "failed" and failed["error"].startswith("ConfigError: ")
    assert "--requests 1" in failed["error"]
    assert (
        "Traceback" in failed["traceback"]
        and "report" not in failed
        and not (tmp_path / "prefix.png").exists()
    )
    for name in ("attention", "ppl"):
        assert results["benchmarks"][name]["status"] == "ok" and (tmp_path / f"{name}.png").is_file(), name
    assert ["prefix", f"FAILED: {failed['error']}", "", ""] in table_rows(
        (tmp_path / "results.md").read_text()
    )
    assert "FAILED" in out and "perplexity through the cache" in out  # each report printed as it finished


def test_bench_all_without_matplotlib_is_one_line(capsys, monkeypatch, tmp_path, vocab_dir):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    code = main(["bench", "all", "--quick", "--out", str(tmp_path), "--model", str(vocab_dir)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "pip install" in err, err
    assert not (tmp_path / "results.json").exists()


# ----------------------------------------------------------------------------- sizes with nothing to measure


@pytest.mark.parametrize(
    "argv, option",
    [
        (["bench", "decode", "--tokens", "0"], "--tokens"),
        (["bench", "decode", "--naive-tokens", "0"], "--naive-tokens"),
        (["bench", "serve", "--requests", "0"], "--requests"),
        (["bench", "prefix", "--requests", "1"], "--requests"),
        (["bench", "tiers", "--rate", "0"], "--rate"),
        (["bench", "tiers", "--device-tokens", "16"], "--device-tokens"),
        (["bench", "memory", "--rate", "0"], "--rate"),
        (["bench", "memory", "--requests", "0"], "--requests"),
        (["bench", "memory", "--clients", "0"], "--clients"),
        (["bench", "memory", "--kv-tokens", "16"], "--kv-tokens"),
        (["bench", "staircase", "--requests", "0"], "--requests"),
        (["bench", "staircase", "--prompt-len", "9", "8"], "--prompt-len"),
        (["bench", "staircase", "--kv-tokens", "16"], "--kv-tokens"),
        (["bench", "attention", "--contexts", "0"], "contexts"),
    ],
)
def test_a_size_with_nothing_to_measure_is_one_clear_line(capsys, real_dir, argv, option):
    code = main(argv + ["--json"] + (["--model", str(real_dir)] if argv[1] != "attention" else []))
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and option in err, err


# ----------------------------------------------------------------------------- --trace


def test_trace_flag_writes_one_replayable_run_per_engine(capsys, vocab_dir, tmp_path):
    """`--trace FILE` on a bench that builds several engines: one run each, every run starting
    from its Snapshot and replaying to an empty pool (every request ended), with Step events."""
    from minillm.memory.events import Step
    from minillm.memory.replay import Replayer
    from minillm.tracing import read_trace

    path = tmp_path / "prefix.jsonl"
    argv = [
        "bench",
        "prefix",
        "--json",
        "--requests",
        "3",
        "--system-tokens",
        "40",
        "--model",
        str(vocab_dir),
    ]
    assert main([*argv, "--trace", str(path)]) == 0
    capsys.readouterr()
    runs = read_trace(path)
    assert len(runs) >= 2  # without and with the prefix cache, at least
    for run in runs.values():
        replayer = Replayer()
        for _, _, event in run:
            replayer.apply(event)
        assert not replayer.tables and not replayer.refcounts
        assert any(isinstance(event, Step) for _, _, event in run)
    generate = ["generate", "Hi", "--decoder", "paged", "--max-tokens", "3", "--model", str(vocab_dir)]
    assert main([*generate, "--trace", str(tmp_path / "generate.jsonl")]) == 0
    assert len(read_trace(tmp_path / "generate.jsonl")) == 1
    assert main([*generate, "--trace", str(tmp_path / "no-such-folder" / "x.jsonl")]) == 2
    assert "Cannot write the trace" in capsys.readouterr().err


def test_generate_json_logprobs_are_the_greedy_tokens_and_the_most_likely(capsys, vocab_dir):
    report = run_json(
        capsys, "generate", "Hi", "--decoder", "paged", "--json", "--max-tokens", 4, "--logprobs", 3,
        "--model", vocab_dir,
    )  # fmt: skip
    logprobs = report["logprobs"]
    assert [lp["token_id"] for lp in logprobs] == report["generated_ids"]
    for lp in logprobs:  # greedy: the chosen token is the most likely one
        assert len(lp["top"]) == 3 and lp["top"][0]["token_id"] == lp["token_id"]
        assert lp["logprob"] == lp["top"][0]["logprob"] <= 0
        assert [t["logprob"] for t in lp["top"]] == sorted((t["logprob"] for t in lp["top"]), reverse=True)


def test_a_tokenizer_without_chatml_is_refused_by_the_workload_in_one_line(tmp_path):
    """The benches lay conversations out as ChatML token ids; Llama 3's tokenizer has no
    <|im_start|>, which must read as one line, not a KeyError."""
    from helpers import tiny_gpt2_tokenizer_json

    from minillm.benchmarks.workload import chat_message
    from minillm.config import ConfigError
    from minillm.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_text(json.dumps(tiny_gpt2_tokenizer_json()))
    with pytest.raises(ConfigError, match=r"this tokenizer has no <\|im_start\|>") as refused:
        chat_message(Tokenizer(tmp_path), "user", [1, 2])
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_bench_open_times_the_folder_and_its_gguf_in_fresh_processes(capsys, real_dir):
    """Both forms open and give a token in their own processes; the numbers are what a process
    can report (positive seconds, a peak memory at least the folder's fp32 weights)."""
    from minillm.benchmarks.open import DEFAULT_GGUF, FORMS

    report = run_json(capsys, "bench", "open", "--repeats", "1", "--json")
    assert set(report["rows"]) == set(FORMS) and report["paths"][FORMS[1]] == str(DEFAULT_GGUF)
    weights_bytes = (real_dir / "model.safetensors").stat().st_size
    for row in report["rows"].values():
        assert row["open_s"]["min"] > 0 and row["first_token_s"]["min"] > 0
        assert row["peak_rss_bytes"]["min"] > weights_bytes / 2  # the dense weights are held


def test_bench_open_names_a_missing_gguf_in_one_line(capsys, tmp_path):
    from minillm.cli import main

    assert main(["bench", "open", "--gguf", str(tmp_path / "none.gguf")]) == 2
    err = capsys.readouterr().err
    assert "none.gguf is not there" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(
    not shutil.which("redis-server"), reason="bench fleet runs redis-server: apt-get install redis-server"
)
def test_bench_fleet_times_the_step_beside_a_slow_store(capsys, real_dir):
    """Part 2 of `bench fleet` alone, at --quick: decode steps counted on both sides, a finite ratio."""
    report = run_json(capsys, "bench", "fleet", "--parts", "step", "--quick", "--json", "--model", real_dir)
    step = report["step"]
    assert set(report) >= {"step", "sizes"} and "store" not in report and "router" not in report
    assert all(count > 0 for count in step["steps"].values()) and len(step["steps"]) == 2
    assert 0 < step["slow_over_none"] < 10 and step["delay_s"] == 0.05


def test_bench_fleet_refuses_to_record_a_quick_run(capsys):
    assert main(["bench", "fleet", "--quick", "--record"]) != 0
    assert "--record" in capsys.readouterr().err
