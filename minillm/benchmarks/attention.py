"""`minillm bench attention`: decode attention alone, every backend, one grid of shapes.

Decode attention reads each sequence's whole K and V history to produce one output row per head,
so, like decode itself, it is bound by memory bandwidth. For each (batch, context) we time one
layer of SmolLM2-shaped decode attention (9 query heads, 3 KV heads, head_dim 64, 16-token blocks
scattered at random through the pool) and report bandwidth achieved = K and V bytes read / time,
beside a copy bandwidth measured on the same device in the same run.

Backends: the torch reference (gathers each sequence's K/V, then plain math), the C++ CPU kernel,
and on a GPU the CUDA kernel and `F.scaled_dot_product_attention` over already-gathered K/V.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from minillm.attention.kernels import decode_backend
from minillm.benchmarks import copy_bandwidth
from minillm.attention.reference import paged_decode_attention
from minillm.config import ConfigError
from minillm.report import print_table

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_case(batch: int, context: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).int()
    cache_shape = (num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return {
        "query": torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(device, dtype),
        "key_cache": torch.randn(cache_shape, generator=gen).to(device, dtype),
        "value_cache": torch.randn(cache_shape, generator=gen).to(device, dtype),
        "block_tables": tables.to(device),
        "context_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "block_size": BLOCK_SIZE,
    }


def sdpa_over_gathered(case: dict):
    """What a framework without paged attention does: gather K/V contiguous first (not timed),
    then call its fused attention. Returns the timed function."""
    context = int(case["context_lens"][0])
    positions = torch.arange(context, device=case["query"].device)
    slots = (case["block_tables"][:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE)
    k = case["key_cache"][slots].transpose(1, 2)  # (batch, kv_heads, context, head_dim)
    v = case["value_cache"][slots].transpose(1, 2)
    q = case["query"][:, :, None, :]  # (batch, heads, 1, head_dim)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def time_call(fn, device: str, min_time: float = 0.2) -> float:
    """Median seconds per call over enough repeats to fill `min_time`."""
    fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-6)
    samples = []
    for _ in range(max(3, min(50, int(min_time / once)))):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def bench_attention(batches=(1, 4, 16, 64), contexts=(128, 512, 1024, 4096), device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> dict:
    if min(batches) < 1 or min(contexts) < 1:  # an empty case reads no bytes: its bandwidth means nothing
        raise ConfigError(f"bench attention needs batches and contexts >= 1 (got {list(batches)} and "
                          f"{list(contexts)}).")
    backends = {"torch_reference": paged_decode_attention}
    if device == "cpu":
        backends["cpu_kernel"] = decode_backend("cpu")
    else:
        backends["cuda_kernel"] = decode_backend("cuda")
    roof = copy_bandwidth(device)
    rows = []
    for batch in batches:
        for context in contexts:
            case = make_case(batch, context, device, dtype)
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * case["key_cache"].element_size()
            timings = {name: time_call(lambda fn=fn: fn(**case), device) for name, fn in backends.items()}
            if device == "cuda":
                timings["sdpa_gathered"] = time_call(sdpa_over_gathered(case), device)
            rows.append({"batch": batch, "context": context, "kv_bytes": kv_bytes,
                         **{f"{name}_us": t * 1e6 for name, t in timings.items()},
                         **{f"{name}_GBs": kv_bytes / t / 1e9 for name, t in timings.items()},
                         **{f"{name}_roof_fraction": kv_bytes / t / roof for name, t in timings.items()}})
    return {"device": device if device == "cpu" else torch.cuda.get_device_name(),
            "dtype": str(dtype).replace("torch.", ""), "copy_bandwidth_GBs": roof / 1e9,
            "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                      "block_size": BLOCK_SIZE},
            "backends": list(backends) + (["sdpa_gathered"] if device == "cuda" else []), "rows": rows}


def print_attention_report(report: dict, console) -> None:
    names = report["backends"]
    print_table(console, f"decode attention, one layer, {report['device']} {report['dtype']} "
                         f"(copy roof {report['copy_bandwidth_GBs']:.0f} GB/s)",
                ["batch", "context", *[f"{name} µs (GB/s)" for name in names]],
                [[row["batch"], row["context"], *[f"{row[f'{n}_us']:.0f} ({row[f'{n}_GBs']:.1f})" for n in names]]
                 for row in report["rows"]])
    first, last = report["backends"][0], report["backends"][1]
    speedups = [row[f"{first}_us"] / row[f"{last}_us"] for row in report["rows"]]
    console.print(f"{last} is {min(speedups):.1f}x to {max(speedups):.1f}x faster than {first}; at the largest "
                  f"shape it reaches {report['rows'][-1][f'{last}_roof_fraction']:.0%} of the copy bandwidth.")
