"""`minillm bench serve`: one request trace, three servers, measured side by side.

The trace (seeded, so every run and commit sees the same one): N requests (default 64), all
arriving at t=0 (an offline batch). Prompt lengths are uniform in [16, 320] tokens, cut at random
offsets from real prose ("Alice's Adventures in Wonderland", fetched by weights_fetch.py); output
lengths are uniform in [8, 160] tokens, decoded greedily to exactly that length (EOS ignored), so
every server does the same work.

Servers, all with the same batch size (`max_num_seqs`):
  - minillm continuous: iteration-level scheduling over paged KV memory;
  - minillm static: the same engine, but a new batch starts only when the last one has finished;
  - HF transformers static (`hf_baseline.py`): `generate` on left-padded batches; a batch runs
    until its longest request is done, and only each request's own tokens count as output.

Beside output tok/s, each server's *achieved GFLOP/s*: the model FLOPs of the trace's useful work
(every prompt token and every output token but the last goes through the layers once, each output
token needs one row of logits; padding and recomputation after preemption do not count) divided by
its elapsed time, and its ratio to a matmul of the model's own shape measured in this run, in the
same dtype and through the same kernel: how much of the machine's compute the server turns into
model work.

On the continuous run we also replay memory: at every step, the paged pool's reserved slots vs
what a contiguous allocator would reserve for the same running requests (prompt + max_tokens
each), and a block-size sweep: wasted slots, block-table entries, speed.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from minillm.benchmarks.hf_baseline import hf_model, hf_static
from minillm.benchmarks.stats import percentile
from minillm.benchmarks.workload import Request, submit_exact, uniform_trace
from minillm.config import DTYPES, ConfigError, ModelConfig
from minillm.engine import LLM
from minillm.report import print_table
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

PROMPT_LEN, OUTPUT_LEN = (16, 320), (8, 160)  # tokens, uniform: the trace's requests


def trace_flops(config: ModelConfig, trace: list[Request]) -> float:
    """The model FLOPs of serving `trace` once, 2 per multiply-add: the layers' matmuls for every
    computed token, attention (q.k and p.v over the token's history), and the lm_head for each
    output token's logits row."""
    hidden, heads, kv_heads, head_dim = (
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    attention_params = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden  # wqkv, wo
    mlp_params = 3 * hidden * config.intermediate_size  # gate, up, down
    layer_params = attention_params + mlp_params
    flops = 0.0
    for request in trace:
        # the last output token is sampled, never fed back
        computed = len(request.prompt_ids) + request.output_len - 1
        flops += 2 * config.num_layers * layer_params * computed
        # attention: token p reads p + 1 keys
        flops += 2 * 2 * config.num_layers * heads * head_dim * computed * (computed + 1) / 2
        flops += 2 * config.vocab_size * hidden * request.output_len
    return flops


def matmul_gflops(model, rows: int = 256, repeats: int = 5) -> float:
    """GFLOP/s of the model's own largest layer matmul (the SwiGLU gate|up projection) on `rows`
    tokens at once, best of `repeats`: the compute roof of this dtype and kernel, measured now."""
    layer = model.layers[0].mlp.w_gate_up
    x = torch.randn(rows, layer.in_features, dtype=model.dtype, device=model.device)
    with torch.inference_mode():
        layer(x)  # warm-up (and, for bf16 on a CPU, the packed copy)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            layer(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    return 2 * rows * layer.in_features * layer.out_features / best / 1e9


def latency_summary(name: str, values: list[float]) -> dict:
    """Mean and p90 (nearest rank: with 2 values the larger, with 10 the 9th)."""
    return {f"{name}_mean_s": statistics.fmean(values), f"{name}_p90_s": percentile(values, 90)}


def run_minillm(
    model, tokenizer, trace, scheduling: str, block_size: int, max_num_seqs: int, attention_backend: str
) -> dict:
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        scheduling=scheduling,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        attention_backend=attention_backend,
    )
    engine = llm.engine
    start = time.perf_counter()
    for index, request in enumerate(trace):
        submit_exact(engine, index, request, arrival_time=None)
    live = paged = arena = table_entries = running_samples = 0
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
        running = engine.snapshot().running()  # static batching holds members whose prefill has not begun
        tables = [seq.table for seq in running]
        live += sum(seq.num_computed for seq in running)
        paged += sum(map(len, tables)) * block_size
        arena += sum(seq.max_len for seq in running)  # a contiguous allocator reserves the maximum
        table_entries += sum(map(len, tables))
        running_samples += len(running)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(out.token_ids) for out in finished)
    return {
        "output_tok_s": output_tokens / elapsed,
        "elapsed_s": elapsed,
        "steps": engine.stats.steps,
        "preemptions": engine.num_preemptions,
        **latency_summary("ttft", [out.ttft for out in finished]),
        **latency_summary("tpot", [out.tpot for out in finished if out.tpot is not None]),
        "kv_utilization_paged": live / paged if paged else 1.0,
        "kv_utilization_contiguous": live / arena if arena else 1.0,
        "wasted_slots_per_step": (paged - live) / engine.stats.steps,
        "block_table_entries_per_seq": table_entries / max(running_samples, 1),
    }


def run_hf(hf_model, trace, batch_size: int) -> dict:
    requests, elapsed = hf_static(hf_model, trace, batch_size)
    return {
        "output_tok_s": sum(len(r["token_ids"]) for r in requests) / elapsed,
        "elapsed_s": elapsed,
        **latency_summary("ttft", [r["ttft"] for r in requests]),
        **latency_summary("tpot", [r["tpot"] for r in requests if r["tpot"] is not None]),
    }


def run_servers(
    model_dir: Path,
    model,
    tokenizer,
    trace,
    max_num_seqs: int,
    attention_backend: str,
    include_hf: bool,
    dtype: str,
) -> dict:
    """The trace served by minillm continuous and static (blocks of 16), and by HF transformers."""
    servers = {
        "minillm_continuous": run_minillm(
            model, tokenizer, trace, "continuous", 16, max_num_seqs, attention_backend
        ),
        "minillm_static": run_minillm(model, tokenizer, trace, "static", 16, max_num_seqs, attention_backend),
    }
    if include_hf:
        servers["hf_transformers_static"] = run_hf(hf_model(model_dir, DTYPES[dtype]), trace, max_num_seqs)
    return servers


def sweep_row(run: dict) -> dict:
    """What the block-size sweep keeps of a continuous run."""
    return {
        key: run[key]
        for key in (
            "output_tok_s",
            "kv_utilization_paged",
            "wasted_slots_per_step",
            "block_table_entries_per_seq",
        )
    }


def describe_trace(trace, max_num_seqs: int, attention_backend: str, work: float) -> dict:
    return {
        "requests": len(trace),
        "prompt_tokens": sum(len(r.prompt_ids) for r in trace),
        "output_tokens": sum(r.output_len for r in trace),
        "prompt_len": f"U{list(PROMPT_LEN)}",
        "output_len": f"U{list(OUTPUT_LEN)}",
        "seed": 0,
        "max_num_seqs": max_num_seqs,
        "attention_backend": attention_backend,
        "model_GFLOP": work / 1e9,
    }


def bench_serve(
    model_dir: Path,
    num_requests: int = 64,
    max_num_seqs: int = 16,
    block_sizes: tuple[int, ...] = (8, 16, 32, 64, 128),
    include_hf: bool = True,
    attention_backend: str = "torch",
    dtype: str = "float32",
) -> dict:
    if num_requests < 1:
        raise ConfigError(f"bench serve needs at least 1 request (--requests {num_requests}); raise it.")
    model, tokenizer = load_model(model_dir, DTYPES[dtype]), Tokenizer(model_dir)
    trace = uniform_trace(tokenizer, num_requests, PROMPT_LEN, OUTPUT_LEN)
    matmul_before = matmul_gflops(model)
    servers = run_servers(
        model_dir, model, tokenizer, trace, max_num_seqs, attention_backend, include_hf, dtype
    )
    # the roof is measured before and after the servers, and the better taken, so that a busy
    # moment on a shared machine does not make the servers look closer to it than they are
    matmul = max(matmul_before, matmul_gflops(model))
    work = trace_flops(model.config, trace)
    for run in servers.values():
        run["achieved_GFLOPs"] = work / run["elapsed_s"] / 1e9
        run["matmul_fraction"] = run["achieved_GFLOPs"] / matmul
    sweep = {
        size: servers["minillm_continuous"]
        if size == 16
        else run_minillm(model, tokenizer, trace, "continuous", size, max_num_seqs, attention_backend)
        for size in block_sizes
    }
    report = {
        "trace": describe_trace(trace, max_num_seqs, attention_backend, work),
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "matmul_GFLOPs": matmul,
        "servers": servers,
        "continuous_vs_static": servers["minillm_continuous"]["output_tok_s"]
        / servers["minillm_static"]["output_tok_s"],
        "block_size_sweep": {size: sweep_row(run) for size, run in sweep.items()},
    }
    if include_hf:
        report["continuous_vs_hf"] = (
            servers["minillm_continuous"]["output_tok_s"] / servers["hf_transformers_static"]["output_tok_s"]
        )
    return report


def print_serve_report(report: dict, console) -> None:
    trace = report["trace"]
    print_table(
        console,
        f"{trace['requests']} requests (prompts {trace['prompt_len']}, outputs {trace['output_len']}), "
        f"batch {trace['max_num_seqs']}, {report['dtype']}, {report['torch_threads']} threads",
        ["server", "output tok/s", "GFLOP/s", "of matmul", "TTFT mean", "TTFT p90", "TPOT mean", "TPOT p90"],
        [
            [
                name,
                f"{run['output_tok_s']:.1f}",
                f"{run['achieved_GFLOPs']:.1f}",
                f"{run['matmul_fraction']:.0%}",
                f"{run['ttft_mean_s']:.1f} s",
                f"{run['ttft_p90_s']:.1f} s",
                f"{run['tpot_mean_s'] * 1e3:.0f} ms",
                f"{run['tpot_p90_s'] * 1e3:.0f} ms",
            ]
            for name, run in report["servers"].items()
        ],
    )
    console.print(
        f"GFLOP/s: the trace's {trace['model_GFLOP']:.0f} GFLOP of model work over each server's time, "
        f"against {report['matmul_GFLOPs']:.0f} GFLOP/s of the model's gate|up matmul on 256 rows, "
        f"{report['dtype']}, measured in this run"
    )
    cont = report["servers"]["minillm_continuous"]
    console.print(
        f"continuous is {report['continuous_vs_static']:.2f}x static"
        + (f" and {report['continuous_vs_hf']:.2f}x HF transformers" if "continuous_vs_hf" in report else "")
    )
    console.print(
        f"KV utilization on this trace: paged {cont['kv_utilization_paged']:.1%}, "
        f"contiguous max-length reservation {cont['kv_utilization_contiguous']:.1%}; "
        f"{cont['preemptions']} preemptions"
    )
    print_block_size_sweep(report["block_size_sweep"], console)


def print_block_size_sweep(sweep: dict, console) -> None:
    print_table(
        console,
        "block-size sweep (continuous)",
        ["block size", "output tok/s", "KV utilization", "wasted slots/step", "table entries/seq"],
        [
            [
                size,
                f"{run['output_tok_s']:.1f}",
                f"{run['kv_utilization_paged']:.1%}",
                f"{run['wasted_slots_per_step']:.0f}",
                f"{run['block_table_entries_per_seq']:.1f}",
            ]
            for size, run in sweep.items()
        ],
    )
