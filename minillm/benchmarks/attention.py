"""`minillm bench attention`: decode attention alone, every backend, every KV format, one grid of shapes.

Decode attention reads each sequence's whole K and V history to produce one output row per head,
so, like decode itself, it is bound by memory bandwidth. For each (KV format, batch, context) we
time one layer of SmolLM2-shaped decode attention (9 query heads, 3 KV heads, head_dim 64,
16-token blocks scattered at random through a real KV pool) and report bandwidth achieved =
bytes read / time, beside a copy bandwidth measured on the same device in the same run.

Bytes read are the format's real size: the pool's bytes per slot (numbers, scales and centres)
times the tokens read. A compressed format that is read in place should be faster by about the
ratio of its bytes (int8 3.5x fewer than fp32 for SmolLM2's shapes); one that is dequantized
into a full-precision copy first is not.

Backends: the torch reference (gathers and dequantizes each sequence's K/V, then batched math),
the C++ CPU kernel, and on a GPU the CUDA kernel and `F.scaled_dot_product_attention` over
already-gathered K/V (model dtype only).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from minillm.attention.kernels import kernel_backend
from minillm.attention.reference import paged_decode_attention
from minillm.benchmarks import copy_bandwidth
from minillm.config import SWITCHES, ConfigError, ModelConfig
from minillm.memory.pool import bytes_per_slot, make_pool
from minillm.report import print_table

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
ONE_LAYER = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1,
    "hidden_size": NUM_HEADS * HEAD_DIM,
    "intermediate_size": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": NUM_HEADS,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": 1 << 20,
}


def make_case(
    batch: int, context: int, device: str, dtype: torch.dtype, kv_dtype: str = "auto", seed: int = 0
) -> dict:
    """One layer of a KV pool in `kv_dtype`, filled with random keys and values for `batch`
    sequences of `context` tokens whose blocks lie scattered through it; the arguments of
    `paged_decode_attention` (and of the kernels)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    config = ModelConfig.from_dict(ONE_LAYER)
    per_block = bytes_per_slot(config, kv_dtype, "channel", BLOCK_SIZE, dtype) * BLOCK_SIZE
    pool = make_pool(config, num_blocks * per_block, BLOCK_SIZE, kv_dtype, "channel", dtype, device)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).int().to(device)
    positions = torch.arange(context, device=device)
    slots = (tables[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE).flatten()
    kv_shape = (len(slots), NUM_KV_HEADS, HEAD_DIM)
    # keys with a few large channels, as real keys have (what per-channel scales are for)
    channel_size = 1 + 4 * torch.rand(NUM_KV_HEADS, HEAD_DIM, generator=gen)
    keys = torch.randn(kv_shape, generator=gen) * channel_size
    pool.write(0, slots, keys.to(device, dtype), torch.randn(kv_shape, generator=gen).to(device, dtype))
    return {
        "query": torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(device, dtype),
        "pool": pool,
        "layer": 0,
        "block_tables": tables,
        "context_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
    }


def sdpa_over_gathered(case: dict):
    """What a framework without paged attention does: gather K/V contiguous first (not timed),
    then call its fused attention. Returns the timed function."""
    context = int(case["context_lens"][0])
    positions = torch.arange(context, device=case["query"].device)
    slots = case["block_tables"][:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    keys, values = case["pool"].read(0, slots)
    k, v = keys.transpose(1, 2), values.transpose(1, 2)  # (batch, kv_heads, context, head_dim)
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


def measure_case(
    backends: dict, batch: int, context: int, device: str, dtype: torch.dtype, kv_dtype: str, roof: float
) -> dict:
    """One shape in one KV format: each backend's time, and the bandwidth it reached against the roof."""
    case = make_case(batch, context, device, dtype, kv_dtype)
    # K and V, scales included (one layer)
    kv_bytes = batch * context * case["pool"].bytes_per_slot
    timings = {name: time_call(lambda fn=fn: fn(**case), device) for name, fn in backends.items()}
    if device == "cuda" and kv_dtype == "auto":
        timings["sdpa_gathered"] = time_call(sdpa_over_gathered(case), device)
    return {
        "kv_dtype": kv_dtype,
        "batch": batch,
        "context": context,
        "kv_bytes": kv_bytes,
        **{f"{name}_us": t * 1e6 for name, t in timings.items()},
        **{f"{name}_GBs": kv_bytes / t / 1e9 for name, t in timings.items()},
        **{f"{name}_roof_fraction": kv_bytes / t / roof for name, t in timings.items()},
    }


def bench_attention(
    batches=(1, 4, 16, 64),
    contexts=(128, 512, 1024, 4096),
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_dtypes=SWITCHES["kv_dtype"].choices,
) -> dict:
    if min(batches) < 1 or min(contexts) < 1:  # an empty case reads no bytes: its bandwidth means nothing
        raise ConfigError(
            f"bench attention needs batches and contexts >= 1 (got {list(batches)} and {list(contexts)})."
        )
    backends = {"torch_reference": paged_decode_attention}
    kernel = "cpu_kernel" if device == "cpu" else "cuda_kernel"
    backends[kernel] = kernel_backend("cpu" if device == "cpu" else "cuda").decode
    roof = copy_bandwidth(device)
    rows = []
    for kv_dtype in kv_dtypes:
        for batch in batches:
            for context in contexts:
                rows.append(measure_case(backends, batch, context, device, dtype, kv_dtype, roof))
    return {
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "dtype": str(dtype).replace("torch.", ""),
        "copy_bandwidth_GBs": roof / 1e9,
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
        },
        "backends": list(backends) + (["sdpa_gathered"] if device == "cuda" else []),
        "kernel": kernel,
        "kv_dtypes": list(kv_dtypes),
        "speedups": format_speedups(rows, kernel),
        "rows": rows,
    }


def format_speedups(rows: list[dict], kernel: str) -> list[dict]:
    """For each compressed format and shape: the kernel's time in the model's dtype over its time
    in the format, beside the ratio of bytes read (what reading in place should win)."""
    full = {(r["batch"], r["context"]): r for r in rows if r["kv_dtype"] == "auto"}
    return [
        {
            "kv_dtype": r["kv_dtype"],
            "batch": r["batch"],
            "context": r["context"],
            "speedup": base[f"{kernel}_us"] / r[f"{kernel}_us"],
            "bytes_ratio": base["kv_bytes"] / r["kv_bytes"],
        }
        for r in rows
        if r["kv_dtype"] != "auto" and (base := full.get((r["batch"], r["context"])))
    ]


def print_attention_report(report: dict, console) -> None:
    names = [name for name in report["backends"] if any(f"{name}_us" in row for row in report["rows"])]
    print_table(
        console,
        f"decode attention, one layer, {report['device']} {report['dtype']} "
        f"(copy roof {report['copy_bandwidth_GBs']:.0f} GB/s)",
        ["kv", "batch", "context", "MB read", *[f"{name} µs (GB/s, roof)" for name in names]],
        [
            [
                row["kv_dtype"],
                row["batch"],
                row["context"],
                f"{row['kv_bytes'] / 1e6:.1f}",
                *[
                    f"{row[f'{n}_us']:.0f} ({row[f'{n}_GBs']:.1f}, {row[f'{n}_roof_fraction']:.0%})"
                    if f"{n}_us" in row
                    else ""
                    for n in names
                ],
            ]
            for row in report["rows"]
        ],
    )
    kernel, largest = report["kernel"], report["rows"][-1]
    console.print(
        f"{kernel} at the largest shape ({largest['kv_dtype']}, {largest['batch']} x {largest['context']}): "
        f"{largest[f'{kernel}_roof_fraction']:.0%} of the copy bandwidth."
    )
    if report["speedups"]:
        print_table(
            console,
            f"{kernel}: time in the model's dtype / time in the format",
            ["kv", "batch", "context", "speedup", "fewer bytes"],
            [
                [r["kv_dtype"], r["batch"], r["context"], f"{r['speedup']:.2f}x", f"{r['bytes_ratio']:.2f}x"]
                for r in report["speedups"]
            ],
        )
