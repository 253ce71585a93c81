"""The switches, declared once: how each EngineConfig field is spelled, what it takes, what it does.

`_TABLE` lists every switch of `EngineConfig` (`config.py`) in its flag group, with its help
written once. From it come EngineConfig's check of the choices, the flags of every command
(`cli/flags.py`), the chat's /set and /compare (`chat/switches.py`) and the server's child argv
(`cli/flags.engine_argv`). A switch's default is never written here: it is its field's, bound
when `config.py` builds `SWITCHES` (`declared_switches`), so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_FORMATS = ("auto", "q4_1", "int8", "model")  # minillm.quantized_weights


def parse_kv_budget(text: str) -> int | float:
    """'256' is a number of tokens, '0.2' a fraction of the sequence's full length."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a token count (256) nor a fraction (0.2)") from None


def parse_seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds") from None
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{text!r} is not a positive, finite number of seconds")
    return seconds


def parse_redis_url(text: str) -> str:
    """redis://HOST:PORT or redis://HOST:PORT/DB, as given; anything else says what it takes."""
    from urllib.parse import urlsplit

    wanted = f"give redis://HOST:PORT[/DB], not {text[:60]!r}"
    try:
        url = urlsplit(text)
        port = url.port
    except ValueError:  # a port that is not a number, or out of 0..65535
        raise ValueError(f"the remote KV store's port must be 1 to 65535; {wanted}") from None
    if url.scheme != "redis" or not url.hostname or port is None:
        raise ValueError(f"the remote KV store is a Redis server; {wanted}")
    if port == 0:
        raise ValueError(f"the remote KV store's port must be 1 to 65535; {wanted}")
    if (url.path not in ("", "/") and not url.path[1:].isdigit()) or url.query or url.fragment:
        raise ValueError(f"the remote KV store's database is a number; {wanted}")
    return text


@dataclass(frozen=True)
class Switch:
    """How one EngineConfig field is spelled and what it takes. Its default is the field's."""

    name: str  # the EngineConfig field
    help: str  # what it does, the flag's --help; argparse writes %(default)s as the default (an
    # on/off switch's names none: `cli/flags.add_switch` adds on or off, as each command has it)
    choices: tuple[str, ...] = ()  # a choice switch takes one of these
    minimum: int | None = None  # a whole-number switch takes this or more (in the flag's unit)
    parse: Callable[[str], object] | None = None  # text -> value for the rest; ValueError says why
    flag: str = ""  # the flag's name (and the chat's), when it is not the field's
    scale: int = 1  # the flag's value times this is the field's (MiB -> bytes)
    lossy: bool = False  # changes what the weights or the KV hold, so the tokens may differ
    group: str = ""  # its flag group in cli/flags.py (its key in `_TABLE`); "" for none
    field_default: object = None  # the EngineConfig field's default, bound by `declared_switches`

    @property
    def dest(self) -> str:
        """The flag's name with underscores: the argparse attribute, the word /set takes."""
        return self.flag or self.name

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def default(self):
        """The field's default, in the flag's unit."""
        value = self.field_default
        return value // self.scale if self.scale > 1 else value

    @property
    def on_off(self) -> bool:
        return isinstance(self.default, bool)

    def field_value(self, value):
        """A flag's value as the field holds it."""
        return value * self.scale if self.scale > 1 else value


_TABLE = {
    "model": (  # which checkpoint, in which precision, where
        Switch(
            "model_dir",
            "checkpoint folder (weights_fetch.py writes one) or a llama.cpp .gguf file, opened in place "
            "(default: %(default)s)",
            parse=Path,
            flag="model",
        ),
        Switch(
            "dtype",
            "weights and KV dtype; auto: bfloat16 where the device computes it natively, else float32 "
            "(default: %(default)s)",
            choices=("auto", *DTYPES),
            lossy=True,
        ),
        Switch(
            "weights",
            "what decode's products read: q4_1, the GGUF blocks the default checkpoint came from, or a "
            ".gguf --model's Q4_1/Q8_0 blocks (lossless); int8, every matrix quantized to Q8_0 here "
            "(lossy); model, the weights in --dtype; auto: q4_1 where there are blocks and the CPU "
            "kernels build, else model "
            "(default: %(default)s)",
            choices=WEIGHT_FORMATS,
            lossy=True,
        ),
        Switch(
            "fused_decode",
            "with --weights q4_1 or int8, a decode layer's dense work in two C++ calls around its "
            "attention instead of some twenty torch operations",
        ),
        Switch("device", "cpu or cuda (default: %(default)s)"),
    ),
    "engine": (  # paged KV memory and scheduling
        Switch(
            "kv_cache_bytes",
            "the device KV pool in MiB (default: %(default)s)",
            minimum=1,
            flag="kv_cache_mb",
            scale=2**20,
        ),
        Switch("block_size", "token slots per KV block (default: %(default)s)", minimum=1),
        Switch("max_num_seqs", "sequences running at once (default: %(default)s)", minimum=1),
        Switch(
            "max_num_batched_tokens",
            "tokens computed per step; a longer prefill is chunked (default: %(default)s)",
            minimum=1,
        ),
        Switch("max_seq_len", "tokens one sequence may hold (default: the model's context)", minimum=2),
        Switch(
            "prefix_caching",
            "share the KV of full prompt blocks computed for earlier requests",
        ),
        Switch(
            "attention_backend",
            "attention: the C++ (cpu) or CUDA kernel, the torch reference, or auto: the kernel for "
            "the device if it builds, else torch (default: %(default)s)",
            choices=("auto", "torch", "cpu", "cuda"),
        ),
        Switch(
            "flash_prefill",
            "with a kernel backend, attend prefill chunks with its flash kernel, not torch",
        ),
        Switch(
            "scheduling",
            "iteration-level batching, or a new batch only when the last has finished (default: %(default)s)",
            choices=("continuous", "static"),
        ),
        Switch(
            "admission",
            "who joins the batch first: fcfs (arrival order), lpm (longest cached prefix first), "
            "memory (least KV over its predicted life first, keeping headroom to grow; with "
            "--ttft-target, those that can still meet it first), or reserve (fcfs, each request "
            "holding its maximum length) (default: %(default)s)",
            choices=("fcfs", "lpm", "memory", "reserve"),
        ),
        Switch(
            "ttft_target",
            "with --admission memory: the time to first token requests should get, in seconds; one "
            "close to missing it goes first, one that can no longer meet it yields to those that "
            "can (default: none)",
            parse=parse_seconds,
        ),
        Switch(
            "refuse_late",
            "with --ttft-target: refuse a request that can no longer meet it, so its client can retry "
            "elsewhere (the server answers 503 with Retry-After), instead of serving it late",
        ),
    ),
    "kv_quantization": (  # minillm.memory.quantization
        Switch(
            "kv_dtype",
            "store the KV cache as int8, int4 or fp8 with scales (default: %(default)s, the model dtype)",
            choices=("auto", "int8", "int4", "fp8"),
            lossy=True,
        ),
        Switch(
            "kv_key_scales",
            "quantized keys share a scale per channel of a block, or per token (default: %(default)s)",
            choices=("channel", "token"),
            lossy=True,
        ),
    ),
    "eviction": (  # minillm.memory.eviction
        Switch(
            "eviction",
            "drop KV entries beyond --kv-budget: h2o, sinks or window (default: %(default)s)",
            choices=("none", "h2o", "sinks", "window"),
            lossy=True,
        ),
        Switch(
            "kv_budget",
            "with --eviction: entries kept per sequence, as tokens (256) or a fraction (0.2)",
            parse=parse_kv_budget,
            lossy=True,
        ),
    ),
    "": (  # in no shared flag group: the chat adds it itself (cli/commands.py)
        Switch(
            "eviction_trigger",
            "with --eviction: keep every sequence within --kv-budget always, or only after a step "
            "in which the KV pool ran short (the pressure ladder's last rung, after reclaiming cached "
            "blocks and preempting) (default: %(default)s)",
            choices=("always", "pressure"),
            lossy=True,
        ),
    ),
    "tiers": (  # minillm.memory.tiers
        Switch(
            "host_cache_bytes",
            "a host pool (MiB) for swapped-out and spilled KV blocks; 0 is none (default: %(default)s)",
            minimum=0,
            flag="host_cache_mb",
            scale=2**20,
        ),
        Switch("disk_cache_dir", "a folder for KV block files once the host pool is full (default: none)"),
        Switch(
            "preemption",
            "when KV blocks run out: recompute the victim, swap its blocks out, or "
            "pick by measured cost (default: %(default)s; recompute without a tier)",
            choices=("recompute", "swap", "auto"),
        ),
        Switch(
            "spill",
            "with a host tier: which cached prefix blocks leaving the device are copied there: all, "
            "or only those a prompt read again (or that extend one) (default: %(default)s)",
            choices=("all", "reused"),
        ),
        Switch(
            "remote_kv",
            "a Redis server shared by engines, redis://HOST:PORT[/DB]: full prefix blocks computed "
            "here are written to it, and a prompt's blocks missing locally are read from it instead "
            "of recomputed; its size is the server's maxmemory (with maxmemory-policy allkeys-lru); "
            "needs the prefix cache (default: none)",
            parse=parse_redis_url,
        ),
        Switch(
            "remote_kv_ttl",
            "with --remote-kv: seconds each block written there lives (default: %(default)s)",
            minimum=1,
        ),
    ),
    "speculative": (  # minillm.engine.speculative
        Switch(
            "speculative",
            "ngram: guess the next tokens from the prompt and output (n-gram lookup) and check "
            "them in one forward pass; greedy output is unchanged (default: %(default)s)",
            choices=("none", "ngram"),
        ),
        Switch(
            "num_speculative_tokens",
            "with --speculative: guesses per sequence per step, at most (default: %(default)s)",
            minimum=1,
        ),
        Switch(
            "prompt_lookup_min",
            "with --speculative ngram: the shortest n-gram looked up (default: %(default)s)",
            minimum=1,
        ),
        Switch(
            "prompt_lookup_max",
            "with --speculative ngram: the longest n-gram looked up (default: %(default)s)",
            minimum=1,
        ),
    ),
}


def declared_switches(field_defaults: dict[str, object]) -> dict[str, Switch]:
    """Every switch by its field's name, knowing its flag group and its field's default."""
    return {
        switch.name: replace(switch, group=group, field_default=field_defaults[switch.name])
        for group, switches in _TABLE.items()
        for switch in switches
    }
