"""Configuration: what the user says about the engine (and, re-exported, what the checkpoint says).

`EngineConfig` holds the engine's switches: model and precision, paged KV memory and its scheduling,
prefix caching, KV quantization and eviction, the host and disk tiers, so one object describes a run.
`SWITCHES` declares each switch once (its flag, choices, help, lossy or not: `minillm.switches`,
each default the field's here), and every front end is made from it: the commands' flags, the chat's
/set and /compare, the server's child argv. The model's own config, `ModelConfig`, is read from
config.json in `minillm.model_config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from minillm.model_config import FETCH_HINT as FETCH_HINT
from minillm.model_config import GENERATION_FILE as GENERATION_FILE
from minillm.model_config import SIZE_FIELDS as SIZE_FIELDS
from minillm.model_config import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from minillm.model_config import ConfigError as ConfigError
from minillm.model_config import ModelConfig as ModelConfig
from minillm.model_config import is_gguf as is_gguf
from minillm.model_config import prompt_problem as prompt_problem
from minillm.switches import DTYPES as DTYPES
from minillm.switches import declared_switches, parse_redis_url

DEFAULT_MODEL_DIR = Path("weights") / "SmolLM2-135M-Instruct"


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
    the tiers below the device pool. `SWITCHES` (`switches.py`) says what each does, how it is
    spelled and what it takes."""

    model_dir: Path = DEFAULT_MODEL_DIR
    dtype: str = "float32"
    weights: str = "model"  # "auto" in the commands that serve a user (minillm.quantized_weights)
    fused_decode: bool = True  # with GGUF blocks: a decode layer in two C++ calls
    device: str = "cpu"
    max_seq_len: int | None = None  # None: the model's context length
    # the serving engine (minillm.engine): paged KV memory and scheduling
    block_size: int = 16
    kv_cache_bytes: int = 512 * 2**20
    scheduling: str = "continuous"
    admission: str = "fcfs"  # "reserve" is the pre-paging baseline
    ttft_target: float | None = None  # seconds; memory-aware admission serves who can still meet it first
    refuse_late: bool = (
        False  # with ttft_target: a request that can no longer meet it is refused, not served late
    )
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
    spill: str = "all"  # which cached prefix blocks leaving the device are copied to the host
    remote_kv: str | None = None  # redis://HOST:PORT[/DB]: a store shared by engines (memory/remote.py)
    remote_kv_ttl: int = 3600  # seconds a block written there lives
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
        self.check_ttft_target()
        self.check_refuse_late()
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

    def check_ttft_target(self) -> None:
        slo = self.ttft_target
        if slo is None:
            return
        if isinstance(slo, bool) or not isinstance(slo, (int, float)) or not 0 < slo < float("inf"):
            raise ConfigError(f"ttft_target is a positive number of seconds, not {slo!r}.")
        if self.admission != "memory":
            raise ConfigError(
                f"ttft_target is what memory-aware admission serves first; admission={self.admission!r} "
                "ignores it. Use admission='memory'."
            )

    def check_refuse_late(self) -> None:
        if self.refuse_late and self.ttft_target is None:
            raise ConfigError(
                "refuse_late refuses the requests that can no longer meet the TTFT target; give "
                "ttft_target (and admission='memory')."
            )

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
        self.check_remote_kv()

    def check_remote_kv(self) -> None:
        if not (type(self.remote_kv_ttl) is int and self.remote_kv_ttl >= 1):
            raise ConfigError(
                f"remote_kv_ttl must be a whole number of seconds >= 1, not {self.remote_kv_ttl!r}."
            )
        if self.remote_kv is None:
            return
        if not isinstance(self.remote_kv, str):
            raise ConfigError(
                f"remote_kv must be a redis://HOST:PORT[/DB] URL or None, not {self.remote_kv!r}."
            )
        try:
            parse_redis_url(self.remote_kv)
        except ValueError as err:
            raise ConfigError(f"remote_kv: {err}.") from None
        if not self.prefix_caching:
            raise ConfigError(
                "remote_kv shares full prefix blocks, found through the prefix cache; set "
                "prefix_caching=True (--prefix-caching)."
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


SWITCHES = declared_switches({field.name: field.default for field in fields(EngineConfig)})
