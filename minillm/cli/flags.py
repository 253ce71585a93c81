"""The switches several `minillm` commands share, each group defined once: which model, how to
sample, how the KV cache is compressed. A command adds the groups it takes beside its own flags.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from minillm.config import DEFAULT_MODEL_DIR, DTYPES, EVICTION_POLICIES, KV_DTYPES


def whole_number(minimum: int, name: str):
    """An argparse type: a whole number >= `minimum`; anything else is argparse's one-line error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give {minimum} or more") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not {name}; give {minimum} or more")
        return value
    parse.__name__ = name.replace(" ", "_")
    return parse


positive_int = whole_number(1, "a positive count")  # every count flag: tokens, requests, segments...
non_negative_int = whole_number(0, "a size >= 0")  # a size that may be 0 (off)


def positive_float(text: str) -> float:
    """The type of every rate or fraction flag that must be a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one above 0") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0; give one above 0")
    return value


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                        help=f"checkpoint folder written by weights_fetch.py (default: {DEFAULT_MODEL_DIR})")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="weights and KV dtype (default: float32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=positive_int, default=max_tokens, help=f"new tokens at most (default: {max_tokens})")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 is off (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 is off (default: 1)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def sampling_from(args):
    from minillm.sampling import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.seed)


def add_kv_quantization_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                        help="store the KV cache as int8, int4 or fp8 with scales (default: auto, the model dtype)")
    parser.add_argument("--kv-key-scales", choices=["channel", "token"], default="channel",
                        help="quantized keys share a scale per channel of a block, or per token (default: channel)")


def kv_budget(text: str) -> int | float:
    """'256' is a number of tokens, '0.2' a fraction of the sequence's full length."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a token count (256) nor a fraction (0.2)") from None


def add_tier_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host-cache-mb", type=non_negative_int, default=0,
                        help="a host pool (MiB) for swapped-out and spilled KV blocks; 0 is none (default: 0)")
    parser.add_argument("--disk-cache-dir", default=None,
                        help="a folder for KV block files once the host pool is full (default: none)")
    parser.add_argument("--preemption", choices=["recompute", "swap", "auto"], default="auto",
                        help="when KV blocks run out: recompute the victim, swap its blocks out, or pick by "
                             "measured cost (default: auto; recompute without a tier)")


def tier_switches(args) -> dict:
    """The EngineConfig switches of add_tier_args' flags."""
    return {"host_cache_bytes": args.host_cache_mb * 2**20, "disk_cache_dir": args.disk_cache_dir,
            "preemption": args.preemption}


def add_eviction_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eviction", choices=EVICTION_POLICIES, default="none",
                        help="drop KV entries beyond --kv-budget: h2o, sinks or window (default: none)")
    parser.add_argument("--kv-budget", type=kv_budget, default=None,
                        help="with --eviction: entries kept per sequence, as tokens (256) or a fraction (0.2)")


def add_engine_args(parser: argparse.ArgumentParser, max_num_seqs: int = 64) -> None:
    """The serving engine's own switches (EngineConfig fields of the same names, dashed), for the
    commands that run one engine for many requests (serve, bench serve-http)."""
    group = parser.add_argument_group("engine (EngineConfig switches)")
    group.add_argument("--kv-cache-mb", type=positive_int, default=512, help="the device KV pool in MiB (default: 512)")
    group.add_argument("--block-size", type=positive_int, default=16, help="token slots per KV block (default: 16)")
    group.add_argument("--max-num-seqs", type=positive_int, default=max_num_seqs,
                       help=f"sequences running at once (default: {max_num_seqs})")
    group.add_argument("--max-num-batched-tokens", type=positive_int, default=512,
                       help="tokens computed per step; a longer prefill is chunked (default: 512)")
    group.add_argument("--max-seq-len", type=whole_number(2, "a context of 2 tokens or more"), default=None,
                       help="tokens one sequence may hold (default: the model's context)")
    group.add_argument("--prefix-caching", action="store_true",
                       help="share the KV of full prompt blocks computed for earlier requests (default: off)")
    group.add_argument("--attention-backend", choices=["torch", "cpu", "cuda"], default="torch",
                       help="decode attention: torch reference, C++ or CUDA kernel (default: torch)")
    group.add_argument("--scheduling", choices=["continuous", "static"], default="continuous",
                       help="iteration-level batching, or a new batch only when the last has finished "
                            "(default: continuous)")
    group.add_argument("--admission", choices=["fcfs", "memory", "reserve"], default="fcfs",
                       help="who joins the batch first: arrival order, benefit per KV cost, or fcfs reserving "
                            "each request's maximum length (default: fcfs)")


def engine_switches(args) -> dict:
    """Every EngineConfig switch of add_model_args, add_engine_args, add_kv_quantization_args,
    add_eviction_args and add_tier_args."""
    return {"model_dir": args.model, "dtype": args.dtype, "device": args.device,
            "kv_cache_bytes": args.kv_cache_mb * 2**20, "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_seq_len": args.max_seq_len, "prefix_caching": args.prefix_caching,
            "attention_backend": args.attention_backend, "scheduling": args.scheduling, "admission": args.admission,
            "kv_dtype": args.kv_dtype, "kv_key_scales": args.kv_key_scales, "eviction": args.eviction,
            "kv_budget": args.kv_budget, **tier_switches(args)}


def engine_argv(args) -> list[str]:
    """engine_switches(args) as flags again, for a child `minillm serve` run with the same engine."""
    argv = []
    for flag in ("model", "dtype", "device", "kv_cache_mb", "block_size", "max_num_seqs", "max_num_batched_tokens",
                 "max_seq_len", "attention_backend", "scheduling", "admission", "kv_dtype", "kv_key_scales",
                 "eviction", "kv_budget", "host_cache_mb", "disk_cache_dir", "preemption"):
        value = getattr(args, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    return argv + (["--prefix-caching"] if args.prefix_caching else [])
