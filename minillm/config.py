"""Configuration: what the user says about the engine (and, re-exported, what the checkpoint says).

`EngineConfig` holds the engine's switches: model and precision, paged KV memory and its scheduling,
prefix caching, KV quantization and eviction, the host and disk tiers, so one object describes a run.
`SWITCHES` declares each switch once (its flag, choices, help, lossy or not), and every front end is
made from it: the commands' flags, the chat's /set and /compare, the server's child argv. The model's
own config, `ModelConfig`, is read from config.json in `minillm.model_config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable

import torch

from minillm.model_config import FETCH_HINT as FETCH_HINT
from minillm.model_config import SIZE_FIELDS as SIZE_FIELDS
from minillm.model_config import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from minillm.model_config import ConfigError as ConfigError
from minillm.model_config import ModelConfig as ModelConfig
from minillm.model_config import prompt_problem as prompt_problem

DEFAULT_MODEL_DIR = Path("weights") / "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """A dtype name as given, or for "auto" the fastest precision the device computes natively:
    bfloat16 where it has bf16 matrix units (a GPU that supports it; a CPU with AVX512-BF16 or
    AMX, where `minillm bench decode` and `bench serve` measure it ahead of float32), else float32.
    Every path is exact in its own dtype; float32 is what the HF comparisons use."""
    if name != "auto":
        return name
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if native else "float32"


MAX_LOOKUP = 32  # the longest n-gram speculation may look up (each token indexes one per length)


@dataclass(frozen=True)
class EngineConfig:
    """Every switch of a run: the model, the paged KV memory and its scheduling, KV compression,
    the tiers below the device pool. `SWITCHES` (below) says what each does, how it is spelled and
    what it takes."""

    model_dir: Path = DEFAULT_MODEL_DIR
    dtype: str = "float32"
    device: str = "cpu"
    max_seq_len: int | None = None  # None: the model's context length
    # the serving engine (minillm.engine): paged KV memory and scheduling
    block_size: int = 16
    kv_cache_bytes: int = 512 * 2**20
    scheduling: str = "continuous"
    admission: str = "fcfs"  # "reserve" is the pre-paging baseline
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefix_caching: bool = False
    attention_backend: str = "auto"
    flash_prefill: bool = True
    # KV compression (minillm.memory.quantization, minillm.memory.eviction); both lossy
    kv_dtype: str = "auto"  # int4 packs two per byte; fp8 is e4m3
    kv_key_scales: str = "channel"
    eviction: str = "none"  # h2o: heavy hitters + recent; sinks: first tokens + recent
    kv_budget: int | float | None = None  # int: tokens kept per sequence; float: a fraction of its length
    eviction_trigger: str = "always"
    # tiers (minillm.memory.tiers): where KV goes when it leaves the device pool
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    preemption: str = "auto"  # swap needs a tier
    # speculative decoding (minillm.engine.speculative): lossless
    speculative: str = "none"
    num_speculative_tokens: int = 4  # vLLM's k
    prompt_lookup_min: int = 3  # 3..6 kept the most guesses on the tuning prompts
    prompt_lookup_max: int = 6

    def __post_init__(self):
        self._check_choices()
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))  # "auto": this machine's
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"{name} must be a positive integer, not {value!r}.")
        if self.max_seq_len is not None and not (type(self.max_seq_len) is int and self.max_seq_len >= 2):
            raise ConfigError(
                f"max_seq_len must be a whole number of tokens >= 2 (a prompt token and a new one), "
                f"or None for the model's context, not {self.max_seq_len!r}."
            )
        if self.admission != "fcfs" and self.scheduling == "static":
            raise ConfigError(
                f"admission={self.admission!r} chooses who joins a running batch; static batching "
                "admits a whole batch at a time, in order. Use scheduling='continuous'."
            )
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', not {self.device!r}.")
        if (
            self.attention_backend not in ("torch", "auto")
            and self.attention_backend != self.device.split(":")[0]
        ):
            raise ConfigError(
                f"attention_backend={self.attention_backend!r} cannot read a KV cache on "
                f"device={self.device!r}; use the matching device or attention_backend='torch'."
            )
        self.check_kv_compression()
        self.check_tiers()
        self.check_speculative()
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for but torch sees no CUDA GPU; use --device cpu.")

    def _check_choices(self) -> None:
        """Every choice switch holds one of its choices (`SWITCHES` lists them), every on/off one a bool."""
        for switch in SWITCHES.values():
            value = getattr(self, switch.name)
            if switch.on_off and not isinstance(value, bool):
                raise ConfigError(f"{switch.name} is on or off: True or False, not {value!r}.")
            if switch.choices and value not in switch.choices:
                raise ConfigError(f"{switch.name} must be one of {_either(switch.choices)}, not {value!r}.")

    def check_kv_compression(self) -> None:
        budget = self.kv_budget
        if self.eviction == "none" and budget is not None:
            raise ConfigError("kv_budget only applies with eviction; choose --eviction h2o, sinks or window.")
        if self.eviction == "none" and self.eviction_trigger != "always":
            raise ConfigError(
                "eviction_trigger only applies with eviction; choose --eviction h2o, sinks or window."
            )
        if self.eviction != "none":
            if budget is None:
                raise ConfigError(
                    f"eviction={self.eviction!r} needs kv_budget: tokens kept (e.g. 256) "
                    "or a fraction (e.g. 0.2)."
                )
            fraction_ok = isinstance(budget, float) and 0 < budget <= 1
            tokens_ok = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
            if not (fraction_ok or tokens_ok):
                raise ConfigError(
                    f"kv_budget must be a token count >= 1 or a fraction in (0, 1], not {budget!r}."
                )

    def check_tiers(self) -> None:
        if not (type(self.host_cache_bytes) is int and self.host_cache_bytes >= 0):
            raise ConfigError(
                f"host_cache_bytes must be a whole number of bytes >= 0 (0: no host tier), "
                f"not {self.host_cache_bytes!r}."
            )
        if self.disk_cache_dir is not None and not isinstance(self.disk_cache_dir, (str, Path)):
            raise ConfigError(f"disk_cache_dir must be a folder path or None, not {self.disk_cache_dir!r}.")
        if self.preemption == "swap" and not self.has_tiers:
            raise ConfigError(
                "preemption='swap' needs somewhere to swap to: set host_cache_bytes or disk_cache_dir."
            )

    def check_speculative(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not (type(value) is int and value >= 1):
                raise ConfigError(f"{name} must be a whole number >= 1, not {value!r}.")
        if self.prompt_lookup_max > MAX_LOOKUP:
            raise ConfigError(
                f"prompt_lookup_max must be at most {MAX_LOOKUP}, not {self.prompt_lookup_max}: every "
                "token indexes an n-gram of each length up to it."
            )
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ConfigError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be at least prompt_lookup_min "
                f"({self.prompt_lookup_min}): n-grams from min to max tokens are looked up."
            )

    @property
    def has_tiers(self) -> bool:
        return self.host_cache_bytes > 0 or self.disk_cache_dir is not None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _either(choices: tuple[str, ...]) -> str:
    """('a', 'b', 'c') -> "'a', 'b' or 'c'"."""
    quoted = [repr(choice) for choice in choices]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def parse_kv_budget(text: str) -> int | float:
    """'256' is a number of tokens, '0.2' a fraction of the sequence's full length."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a token count (256) nor a fraction (0.2)") from None


# ----------------------------------------------------------------------------- the switches, declared once


@dataclass(frozen=True)
class Switch:
    """How one EngineConfig field is spelled and what it takes, declared once. From this table come
    EngineConfig's check of the choices, the flags of every command (`cli/flags.py`), the chat's
    `/set` and `/compare` (`chat/switches.py`) and the server's child argv (`cli/flags.engine_argv`).
    Its default is the field's."""

    name: str  # the EngineConfig field
    help: str  # what it does, the flag's --help; argparse writes %(default)s as the default
    choices: tuple[str, ...] = ()  # a choice switch takes one of these
    minimum: int | None = None  # a whole-number switch takes this or more (in the flag's unit)
    parse: Callable[[str], object] | None = None  # text -> value for the rest; ValueError says why
    flag: str = ""  # the flag's name (and the chat's), when it is not the field's
    scale: int = 1  # the flag's value times this is the field's (MiB -> bytes)
    lossy: bool = False  # changes what the weights or the KV hold, so the tokens may differ
    group: str = ""  # its flag group in cli/flags.py (its key in `_TABLE`); "" for none

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
        value = _FIELD_DEFAULTS[self.name]
        return value // self.scale if self.scale > 1 else value

    @property
    def on_off(self) -> bool:
        return isinstance(self.default, bool)

    def field_value(self, value):
        """A flag's value as the field holds it."""
        return value * self.scale if self.scale > 1 else value


_FIELD_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}
_TABLE = {
    "model": (  # which checkpoint, in which precision, where
        Switch(
            "model_dir",
            "checkpoint folder written by weights_fetch.py (default: %(default)s)",
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
            "share the KV of full prompt blocks computed for earlier requests (default: off)",
        ),
        Switch(
            "attention_backend",
            "attention: the C++ (cpu) or CUDA kernel, the torch reference, or auto: the kernel for "
            "the device if it builds, else torch (default: %(default)s)",
            choices=("auto", "torch", "cpu", "cuda"),
        ),
        Switch(
            "flash_prefill",
            "with a kernel backend, attend prefill chunks with its flash kernel, not torch (default: on)",
        ),
        Switch(
            "scheduling",
            "iteration-level batching, or a new batch only when the last has finished (default: %(default)s)",
            choices=("continuous", "static"),
        ),
        Switch(
            "admission",
            "who joins the batch first: fcfs (arrival order), lpm (longest cached prefix first), "
            "memory (benefit per KV cost, keeping headroom to grow), memory+lpm (lpm's order, "
            "memory's headroom), or reserve (fcfs, each request holding its maximum length) "
            "(default: %(default)s)",
            choices=("fcfs", "lpm", "memory", "memory+lpm", "reserve"),
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
SWITCHES = {
    switch.name: replace(switch, group=group) for group, switches in _TABLE.items() for switch in switches
}
