"""Prefill attention alone, the step (4) of `bench staircase` changes: one layer of SmolLM2-shaped
attention for a chunk of queries at the end of a long context, read through a block table from
a pool of scattered blocks (`bench attention`'s `make_case`), by the torch reference (the whole
queries x entries score matrix) and by the C++ flash kernel (tiles of keys, online softmax)."""

from __future__ import annotations

import time

import torch

from minillm.attention.kernels import kernel_backend
from minillm.attention.reference import paged_prefill_attention
from minillm.benchmarks.attention import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, make_case
from minillm.config import ConfigError

KV_DTYPES = ("auto", "int8")  # the pools of rows (2) and (3)-(4)


def best_of(fn, repeats: int) -> tuple[float, torch.Tensor]:
    """The fastest of `repeats` calls after one warm-up (on a shared machine the others' load only
    ever adds time), and the output of the last call."""
    out, _ = fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out, _ = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def prefill_case(context: int, chunk: int, dtype: torch.dtype, kv_dtype: str, seed: int = 0) -> dict:
    """`paged_prefill_attention`'s arguments: one sequence of `context` entries in a pool of
    `kv_dtype`, whose last `chunk` entries are the queries of this prefill chunk."""
    case = make_case(1, context, "cpu", dtype, kv_dtype, seed)
    query = torch.randn(chunk, NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1))
    return {
        "query": query.to(dtype),  # (chunk, num_heads, head_dim)
        "pool": case["pool"],
        "layer": 0,
        "block_tables": case["block_tables"],
        "cu_seqlens": torch.tensor([0, chunk], dtype=torch.int32),
        "q_indices": torch.arange(context - chunk, context, dtype=torch.int32),  # each query sees 0..itself
        "context_lens": case["context_lens"],
    }


def prefill_attention(context: int, chunk: int, repeats: int, dtype: torch.dtype) -> dict:
    if not 1 <= chunk <= context:
        raise ConfigError(
            f"the prefill chunk ({chunk} queries) must lie within its context ({context} entries); "
            "give --attention-chunk <= --attention-context."
        )
    flash = kernel_backend("cpu").prefill
    rows = []
    for kv_dtype in KV_DTYPES:
        case = prefill_case(context, chunk, dtype, kv_dtype)
        reference_s, expected = best_of(lambda: paged_prefill_attention(**case), repeats)
        kernel_s, got = best_of(lambda: flash(**case), repeats)
        rows.append(
            {
                "kv_dtype": kv_dtype,
                "torch_reference_ms": 1e3 * reference_s,
                "cpu_kernel_ms": 1e3 * kernel_s,
                "speedup": reference_s / kernel_s,
                "max_abs_diff": float((got.float() - expected.float()).abs().max()),
            }
        )
    return {
        "context": context,
        "chunk": chunk,
        "repeats": repeats,
        "dtype": str(dtype).replace("torch.", ""),
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "rows": rows,
    }
