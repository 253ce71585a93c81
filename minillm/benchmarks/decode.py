"""`minillm bench decode`: batch-1 decode speed beside its physical roof, measured in one run.

Decoding one token reads every weight once (and the KV cache so far) to do about 2 FLOPs per
weight: on a CPU that is a memory-bandwidth problem, not a compute one. So next to tok/s we print
*bandwidth achieved* = bytes read per step x steps per second, and its ratio to two roofs measured
here, now: the read roof (every thread summing a buffer larger than the caches: all a batch-1
step does with its weights) and the copy roof (STREAM's convention: bytes read + written).

Decoders run on the same prompt and thread settings, interleaved so machine drift hits them
alike: naive (no cache), cached (contiguous KV cache), the serving engine with one request (paged
KV, scheduler, sampler: what `minillm serve` runs per token) and HF transformers `generate` in
--dtype, and cached in the other precision (fp32 beside bf16): the same step reads half the bytes
in bf16. Then the engine again with its products reading GGUF blocks (`--weights`, `WEIGHT_ROWS`):
the checkpoint's own Q4_1 blocks, fused into two C++ calls a layer or not, and Q8_0 made here; each
row's bytes are what its step reads. Each row reports the median of the repeats, the best, and
their spread.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from minillm.benchmarks import copy_bandwidth, machine, read_bandwidth
from minillm.decoding import generate
from minillm.engine import LLM
from minillm.evaluation import read_text
from minillm.report import print_table
from minillm.sampling import SamplingParams
from minillm.weights import load_model


def bench_prompt(model_dir: Path, prompt_len: int) -> list[int]:
    from minillm.tokenizer import Tokenizer

    return Tokenizer(model_dir).encode(read_text())[:prompt_len]


def time_minillm(model, prompt_ids: list[int], new_tokens: int, decoder: str) -> float:
    """Decode tokens per second (prefill excluded)."""
    gen = generate(model, prompt_ids, SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True), decoder)
    return new_tokens / gen.decode_s


def time_engine(llm: LLM, prompt_ids: list[int], new_tokens: int) -> float:
    """The engine with one request: decode tokens per second, from its first token to its last."""
    first = None
    for _ in llm.stream(prompt_ids, SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True)):
        first = first or time.perf_counter()
    return new_tokens / (time.perf_counter() - first)


def time_hf(hf_model, prompt_ids: list[int], new_tokens: int) -> float:
    """HF generate, greedy; the prefill-only call is subtracted so only decode is timed."""
    ids = torch.tensor([prompt_ids])

    def run(n: int) -> float:
        start = time.perf_counter()
        hf_model.generate(
            ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
        )
        return time.perf_counter() - start

    return new_tokens / (run(new_tokens + 1) - run(1))


def weight_bytes_read(model) -> int:
    """The weights one decode step reads: each product's matrix, or its GGUF blocks where a decode
    product reads those (the lm_head reads the whole tied embedding), and the norms."""
    matrices = model.state_dict()
    products = sum(product_bytes(matmul, matrices[name]) for name, matmul in model.products().items())
    return products + sum(p.nbytes for p in model.parameters() if p.dim() == 1)


def product_bytes(matmul, matrix: torch.Tensor) -> int:
    """What one decode product reads: its GGUF blocks where it reads those, else its matrix."""
    return matmul.quantized.blocks.nbytes if matmul.quantized is not None else matrix.nbytes


def bytes_per_step(model, prompt_len: int, new_tokens: int, with_kv: bool) -> float:
    """The weights a step reads, plus the KV cache read at the mean context length of the decode steps."""
    mean_context = prompt_len + new_tokens / 2
    kv = model.config.kv_bytes_per_token(model.dtype) * mean_context if with_kv else 0
    return weight_bytes_read(model) + kv


def other_dtype(dtype: str) -> str | None:
    """The precision compared beside --dtype: fp32 (the exact reference) against bf16 (half the
    bytes per step, oneDNN-packed matmuls on a CPU), whichever of the two was not asked for."""
    return {"float32": "bfloat16", "bfloat16": "float32"}.get(dtype)


def summarize(samples: list[float]) -> dict:
    """The median is the headline (one slow run on a shared machine does not move it), the best
    beside it, and the spread (max - min) / median says how far to trust either."""
    median = statistics.median(samples)
    return {
        "tok_s": median,
        "best_tok_s": max(samples),
        "spread": (max(samples) - min(samples)) / median,
        "samples_tok_s": samples,
    }


# the engine's rows with GGUF blocks: name -> (EngineConfig.weights, fused_decode)
WEIGHT_ROWS = {
    "engine_q4_1": ("q4_1", True),
    "engine_q4_1_unfused": ("q4_1", False),
    "engine_int8": ("int8", True),
}


def block_models(model_dir: Path, dtype: str) -> tuple[dict, str | None]:
    """name -> the model of each WEIGHT_ROWS row this machine runs, and why the others are left
    out (no blocks fetched, no C++ kernels, a dtype they do not take), or None."""
    from minillm.config import DTYPES, ConfigError
    from minillm.weights import resolve_weights

    models, reasons = {}, {}  # reason -> the rows it leaves out
    for name, (weights, fused) in WEIGHT_ROWS.items():
        try:
            resolve_weights(weights, model_dir, DTYPES[dtype], "cpu")
            models[name] = load_model(model_dir, DTYPES[dtype], weights=weights, fused=fused)
        except ConfigError as err:
            reasons.setdefault(str(err), []).append(name)
    skipped = [f"{' and '.join(names)} left out: {reason}" for reason, names in reasons.items()]
    return models, " ".join(skipped) or None


def decoder_models(model_dir: Path, dtype: str, include_hf: bool) -> tuple[dict, object]:
    """name -> the model each minillm decoder runs (naive, cached and engine share one; each
    WEIGHT_ROWS engine has its own); HF's model or None."""
    from minillm.config import DTYPES

    model = load_model(model_dir, DTYPES[dtype])
    models = {"naive": model, "cached": model}
    if other_dtype(dtype):
        models[f"cached_{other_dtype(dtype)}"] = load_model(model_dir, DTYPES[other_dtype(dtype)])
    if not include_hf:
        return models, None
    from minillm.benchmarks.hf_baseline import hf_model

    return models, hf_model(model_dir, DTYPES[dtype])


def tok_s_by_threads(run_cached) -> dict[int, float]:
    """Cached decode speed (median of 3) at every torch thread count up to the CPUs (restored after)."""
    threads, default_threads = {}, torch.get_num_threads()
    for n in range(1, (os.cpu_count() or 1) + 1):
        torch.set_num_threads(n)
        threads[n] = statistics.median(run_cached() for _ in range(3))
    torch.set_num_threads(default_threads)
    return threads


def weights_read(model) -> str:
    """What a decode step's products read: "q4_1 fused", "q8_0", or the dense dtype's name."""
    blocks = {m.quantized.format for m in model.products().values() if m.quantized is not None}
    if not blocks:
        return str(model.dtype).removeprefix("torch.")
    return "+".join(sorted(blocks)) + (" fused" if model.layers[0].fused else "")


def decoder_row(
    samples: list[float], model, prompt_len: int, new_tokens: int, naive: bool, roofs: dict
) -> dict:
    """One decoder's speed beside the bytes its steps read, the copy roof and the read roof."""
    row = summarize(samples)
    step_bytes = bytes_per_step(model, prompt_len, new_tokens, with_kv=not naive)
    read = roofs["read"]
    return {
        "dtype": str(model.dtype).removeprefix("torch."),
        "weights": weights_read(model),
        **row,
        "ms_per_token": 1000 / row["tok_s"],
        "bytes_per_step": step_bytes,
        "bandwidth_GBs": step_bytes * row["tok_s"] / 1e9,
        "roof_fraction": step_bytes * row["tok_s"] / roofs["copy"],
        "best_roof_fraction": step_bytes * row["best_tok_s"] / roofs["copy"],
        "read_roof_fraction": step_bytes * row["tok_s"] / read if read else None,
        "best_read_roof_fraction": step_bytes * row["best_tok_s"] / read if read else None,
    }


def time_decoders(
    model_dir: Path,
    models: dict,
    hf_model,
    prompt_ids: list[int],
    tokens: dict[str, int],
    new_tokens: int,
    repeats: int,
) -> tuple[dict[str, list[float]], dict[int, float]]:
    """Each decoder's seconds over `repeats` interleaved runs, and the cached one's tok/s by threads.
    `models` names the model of every minillm decoder; those whose name starts with "engine" run
    in the serving engine."""
    engines = {
        name: LLM(model_dir, model=model, dtype=str(model.dtype).removeprefix("torch."), max_num_seqs=1)
        for name, model in models.items()
        if name.startswith("engine")
    }

    def run_once(name: str, n: int | None = None) -> float:
        if name == "hf_transformers":
            return time_hf(hf_model, prompt_ids, new_tokens)
        if name in engines:
            return time_engine(engines[name], prompt_ids, n or new_tokens)
        decoder = "naive" if name == "naive" else "cached"
        return time_minillm(models[name], prompt_ids, n or tokens[name], decoder)

    names = list(models) + (["hf_transformers"] if hf_model is not None else [])
    runs: dict[str, list[float]] = {name: [] for name in names}
    with torch.inference_mode():
        for name in names:  # warm-up: first calls allocate, build kernels and pack bf16 weights
            if name not in ("naive", "hf_transformers"):
                run_once(name, 4)
        for _ in range(repeats):  # interleaved, so machine drift hits every decoder alike
            for name in names:
                runs[name].append(run_once(name))
        threads = tok_s_by_threads(lambda: run_once("cached"))
    return runs, threads


def speedups(decoders: dict, dtype: str) -> dict:
    """Cached over naive, the engine and the other dtype over cached, and cached over HF
    transformers where it ran."""
    ratios = {
        "cached_vs_naive": decoders["cached"]["tok_s"] / decoders["naive"]["tok_s"],
        "engine_vs_cached": decoders["engine"]["tok_s"] / decoders["cached"]["tok_s"],
    }
    if other_dtype(dtype):
        ratios[f"cached_{other_dtype(dtype)}_vs_cached"] = (
            decoders[f"cached_{other_dtype(dtype)}"]["tok_s"] / decoders["cached"]["tok_s"]
        )
    if "hf_transformers" in decoders:
        ratios["cached_vs_hf"] = decoders["cached"]["tok_s"] / decoders["hf_transformers"]["tok_s"]
    for name in WEIGHT_ROWS:
        if name in decoders:
            ratios[f"{name}_vs_engine"] = decoders[name]["tok_s"] / decoders["engine"]["tok_s"]
    return ratios


def bench_decode(
    model_dir: Path,
    prompt_len: int = 64,
    new_tokens: int = 128,
    naive_tokens: int = 16,
    include_hf: bool = True,
    dtype: str = "float32",
    repeats: int = 5,
) -> dict:
    from minillm.config import ConfigError

    if new_tokens < 1 or naive_tokens < 1:  # a rate needs at least one timed decode step
        raise ConfigError(
            f"bench decode times at least 1 new token per decoder (--tokens {new_tokens}, "
            f"--naive-tokens {naive_tokens}); raise them."
        )
    prompt_ids = bench_prompt(model_dir, prompt_len)  # a missing text fails here, before any model loads
    models, hf_model = decoder_models(model_dir, dtype, include_hf)
    with_blocks, skipped = block_models(model_dir, dtype)
    models |= {"engine": models["cached"], **with_blocks}
    tokens = {name: naive_tokens if name == "naive" else new_tokens for name in models}
    runs, threads = time_decoders(model_dir, models, hf_model, prompt_ids, tokens, new_tokens, repeats)
    roofs = {"copy": copy_bandwidth(), "read": read_bandwidth()}
    decoders = {
        name: decoder_row(
            samples,
            models.get(name, models["cached"]),
            prompt_len,
            tokens.get(name, new_tokens),
            name == "naive",
            roofs,
        )
        for name, samples in runs.items()
    }
    return {
        "machine": machine(),
        "model_dir": str(model_dir),
        "dtype": dtype,
        "prompt_len": len(prompt_ids),
        "new_tokens": new_tokens,
        "naive_tokens": naive_tokens,
        "repeats": repeats,
        "copy_bandwidth_GBs": roofs["copy"] / 1e9,
        "read_bandwidth_GBs": roofs["read"] / 1e9 if roofs["read"] else None,
        "decoders": decoders,
        "left_out": skipped,
        "cached_tok_s_by_threads": threads,
        **speedups(decoders, dtype),
    }


DECODER_COLUMNS = [
    "decoder",
    "dtype",
    "weights read",
    "tok/s median",
    "best",
    "spread",
    "ms/token",
    "MB read/step",
    "GB/s achieved",
    "of read roof (best)",
    "of copy roof (best)",
]


def decoder_cells(name: str, d: dict) -> list[str]:
    """One decoder's row of the table, in DECODER_COLUMNS' order."""
    read_roof = (
        f"{d['read_roof_fraction']:.0%} ({d['best_read_roof_fraction']:.0%})"
        if d["read_roof_fraction"]
        else "-"
    )
    return [
        name,
        d["dtype"],
        d["weights"],
        f"{d['tok_s']:.1f}",
        f"{d['best_tok_s']:.1f}",
        f"{d['spread']:.0%}",
        f"{d['ms_per_token']:.1f}",
        f"{d['bytes_per_step'] / 1e6:.0f}",
        f"{d['bandwidth_GBs']:.1f}",
        read_roof,
        f"{d['roof_fraction']:.0%} ({d['best_roof_fraction']:.0%})",
    ]


def print_decode_report(report: dict, console) -> None:
    print_table(
        console,
        f"batch-1 decode, prompt {report['prompt_len']} tokens, {report['new_tokens']} new "
        f"(naive {report['naive_tokens']}), {report['repeats']} interleaved runs, "
        f"{report['machine']['torch_threads']} threads",
        DECODER_COLUMNS,
        [decoder_cells(name, d) for name, d in report["decoders"].items()],
    )
    read = report["read_bandwidth_GBs"]
    read_roof = f"read {read:.1f} GB/s (every thread summing a buffer), " if read else ""
    console.print(f"measured now: {read_roof}copy {report['copy_bandwidth_GBs']:.1f} GB/s (read + write)")
    console.print(
        "cached decode by torch threads (median of 3): "
        + ", ".join(f"{n}: {v:.1f} tok/s" for n, v in report["cached_tok_s_by_threads"].items())
    )
    console.print(
        f"cached is {report['cached_vs_naive']:.1f}x naive, "
        f"the engine {report['engine_vs_cached']:.2f}x cached"
        + (f" and {report['cached_vs_hf']:.2f}x HF transformers" if "cached_vs_hf" in report else "")
        + "".join(
            f"; {key.removesuffix('_vs_cached').replace('_', ' ')} is {value:.2f}x cached {report['dtype']}"
            for key, value in report.items()
            if key.startswith("cached_") and key.endswith("_vs_cached")
        )
    )
    blocks = [name for name in WEIGHT_ROWS if f"{name}_vs_engine" in report]
    if blocks:
        console.print(
            "through GGUF blocks: "
            + ", ".join(f"{name} {report[f'{name}_vs_engine']:.2f}x" for name in blocks)
            + " the engine on dense weights"
        )
    if report["left_out"]:
        console.print(report["left_out"])
    console.print(
        "[dim]naive's bandwidth is not its limit: it recomputes the whole sequence, so it is "
        "compute bound and its GB/s only counts the weights once per step.[/dim]"
    )
