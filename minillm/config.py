"""Configuration: what the checkpoint says about the model, and what the user says about the engine.

`ModelConfig` is read from a Hugging Face style `config.json` and validated, so an unsupported
architecture fails here with one clear line instead of deep inside a matmul. `EngineConfig` holds
the engine's switches; every later optimization (paging, prefix sharing, quantization, ...) adds
its switch here, so one object describes a run.
"""

from __future__ import annotations

import json
import numbers
import re
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
DEFAULT_MODEL_DIR = Path("weights") / "SmolLM2-135M-Instruct"
FETCH_HINT = "run: python weights_fetch.py"
# config.json fields that size a tensor: each must be a positive integer where present
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")


class ConfigError(ValueError):
    """A checkpoint or a setting that minillm cannot use; the message says what to do."""


def prompt_problem(prompt_ids: list, context_len: int, vocab_size: int) -> str | None:
    """Why a prompt cannot run in a context of `context_len` tokens, or None. The one prompt check,
    shared by the single-sequence decoders and the engine's admission."""
    if not prompt_ids:
        return "The prompt is empty; give at least one token."
    for index, token in enumerate(prompt_ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < vocab_size:
            return (f"Token {index} of the prompt is {token!r}; token ids are integers in [0, {vocab_size}) "
                    "for this model's vocabulary.")
    if len(prompt_ids) >= context_len:
        return (f"The prompt has {len(prompt_ids)} tokens but the context holds {context_len} "
                "(and needs room for one new token); shorten the prompt.")
    return None


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int  # d_model
    intermediate_size: int  # SwiGLU hidden width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: num_heads is a multiple of it)
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        architectures = raw.get("architectures") or [raw.get("model_type", "unknown")]
        if architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"Unsupported architecture {architectures[0]!r} in config.json; "
                f"minillm runs {', '.join(SUPPORTED_ARCHITECTURES)} checkpoints."
            )
        for name in SIZE_FIELDS:  # a 0 or a quoted "49152" would otherwise fail far from config.json
            if name in raw and not (type(raw[name]) is int and raw[name] >= 1):  # bool is not a size
                raise ConfigError(f"{name}={raw[name]!r} in config.json must be a positive integer; fix config.json or "
                                  f"{FETCH_HINT}")
        if raw.get("rope_scaling"):
            raise ConfigError("config.json asks for rope_scaling, which minillm does not implement; "
                              "use a Llama checkpoint with plain RoPE.")
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_attention_heads={num_heads} is not a multiple of "
                              f"num_key_value_heads={num_kv_heads} in config.json.")
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"Weights not found in {model_dir} (no config.json) — {FETCH_HINT}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path} is not valid JSON ({err}) — delete it and {FETCH_HINT}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object — delete it and {FETCH_HINT}")
        try:
            return cls.from_dict(raw)
        except KeyError as err:
            raise ConfigError(f"{path} lacks the field {err.args[0]!r}; is it a Llama config.json?") from err

    def to_hf_dict(self) -> dict:
        """The config.json fields transformers' LlamaForCausalLM reads (our own reader too)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }

    def context_len(self, max_seq_len: int | None) -> int:
        """Tokens one sequence may hold: the user's max_seq_len, or the model's own context when unset.
        The RoPE tables end at max_position_embeddings, so a longer max_seq_len is refused here,
        not by an IndexError once a sequence gets that far."""
        if max_seq_len is None:
            return self.max_position_embeddings
        if max_seq_len > self.max_position_embeddings:
            raise ConfigError(f"max_seq_len={max_seq_len} is longer than the model's context "
                              f"({self.max_position_embeddings} tokens, max_position_embeddings); lower it.")
        return max_seq_len

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """The KV cache formula: K and V, for every layer and KV head, head_dim numbers each."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = ("auto", "int8", "int4", "fp8")
EVICTION_POLICIES = ("none", "h2o", "sinks", "window")


@dataclass(frozen=True)
class EngineConfig:
    """Every switch of a run. Later chapters add theirs (block size, prefix cache, kv dtype...)."""

    model_dir: Path = DEFAULT_MODEL_DIR
    dtype: str = "float32"
    device: str = "cpu"
    max_seq_len: int | None = None  # defaults to the model's context length
    # --- the serving engine (minillm.engine): paged KV memory and scheduling
    block_size: int = 16  # token slots per KV block
    kv_cache_bytes: int = 512 * 2**20  # the KV pool's budget; it is cut into blocks
    scheduling: str = "continuous"  # "continuous" (iteration-level) or "static" (batch at a time)
    admission: str = "fcfs"  # who joins first: "fcfs" (arrival order), "memory" (benefit / KV cost, aged),
    #   or "reserve" (fcfs, each request holding its maximum length: the pre-paging baseline)
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 512  # tokens computed per step; a longer prefill is chunked
    prefix_caching: bool = False  # share the KV of full prompt blocks computed for earlier requests
    attention_backend: str = "torch"  # decode attention: "torch" (reference), "cpu" (C++), "cuda" kernel
    # --- KV compression (minillm.memory.quantization, minillm.memory.eviction); both lossy
    kv_dtype: str = "auto"  # "auto" (the model's dtype), "int8", "int4" (two per byte) or "fp8" (e4m3)
    kv_key_scales: str = "channel"  # quantized keys share a scale per "channel" of a block, or per "token"
    eviction: str = "none"  # "none", "h2o" (heavy hitters + recent), "sinks" (first tokens + recent), "window"
    kv_budget: int | float | None = None  # with eviction: entries kept per sequence (int) or fraction (float)
    eviction_trigger: str = "always"  # with eviction: keep the budget "always", or only under "pressure"
    #   (the pressure ladder's last rung, after a step that ran short of blocks)
    # --- tiers (minillm.memory.tiers): where KV goes when it leaves the device pool
    host_cache_bytes: int = 0  # a host pool for swapped-out blocks and spilled prefix blocks; 0 = none
    disk_cache_dir: str | None = None  # a folder for block files once the host pool is full; None = none
    preemption: str = "auto"  # "recompute", "swap" (needs a tier) or "auto" (measured cost; recompute without a tier)

    def __post_init__(self):
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"{name} must be a positive integer, not {value!r}.")
        if self.max_seq_len is not None and not (type(self.max_seq_len) is int and self.max_seq_len >= 2):
            raise ConfigError(f"max_seq_len must be a whole number of tokens >= 2 (a prompt token and a new one), "
                              f"or None for the model's context, not {self.max_seq_len!r}.")
        if self.scheduling not in ("continuous", "static"):
            raise ConfigError(f"scheduling must be 'continuous' or 'static', not {self.scheduling!r}.")
        if self.admission not in ("fcfs", "memory", "reserve"):
            raise ConfigError(f"admission must be 'fcfs', 'memory' or 'reserve', not {self.admission!r}.")
        if self.admission != "fcfs" and self.scheduling == "static":
            raise ConfigError(f"admission={self.admission!r} chooses who joins a running batch; static batching "
                              "admits a whole batch at a time, in order. Use scheduling='continuous'.")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}.")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', not {self.device!r}.")
        if self.attention_backend not in ("torch", "cpu", "cuda"):
            raise ConfigError(f"attention_backend must be 'torch', 'cpu' or 'cuda', not {self.attention_backend!r}.")
        if self.attention_backend != "torch" and self.attention_backend != self.device.split(":")[0]:
            raise ConfigError(f"attention_backend={self.attention_backend!r} cannot read a KV cache on "
                              f"device={self.device!r}; use the matching device or attention_backend='torch'.")
        self.check_kv_compression()
        self.check_tiers()
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for but torch sees no CUDA GPU; use --device cpu.")

    def check_kv_compression(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {self.kv_dtype!r}.")
        if self.kv_key_scales not in ("channel", "token"):
            raise ConfigError(f"kv_key_scales must be 'channel' or 'token', not {self.kv_key_scales!r}.")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, not {self.eviction!r}.")
        budget = self.kv_budget
        if self.eviction == "none" and budget is not None:
            raise ConfigError("kv_budget only applies with eviction; choose --eviction h2o, sinks or window.")
        if self.eviction_trigger not in ("always", "pressure"):
            raise ConfigError(f"eviction_trigger must be 'always' or 'pressure', not {self.eviction_trigger!r}.")
        if self.eviction == "none" and self.eviction_trigger != "always":
            raise ConfigError("eviction_trigger only applies with eviction; choose --eviction h2o, sinks or window.")
        if self.eviction != "none":
            if budget is None:
                raise ConfigError(f"eviction={self.eviction!r} needs kv_budget: tokens kept (e.g. 256) or a fraction (e.g. 0.2).")
            fraction_ok = isinstance(budget, float) and 0 < budget <= 1
            tokens_ok = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
            if not (fraction_ok or tokens_ok):
                raise ConfigError(f"kv_budget must be a token count >= 1 or a fraction in (0, 1], not {budget!r}.")

    def check_tiers(self) -> None:
        if not (type(self.host_cache_bytes) is int and self.host_cache_bytes >= 0):
            raise ConfigError(f"host_cache_bytes must be a whole number of bytes >= 0 (0: no host tier), "
                              f"not {self.host_cache_bytes!r}.")
        if self.disk_cache_dir is not None and not isinstance(self.disk_cache_dir, (str, Path)):
            raise ConfigError(f"disk_cache_dir must be a folder path or None, not {self.disk_cache_dir!r}.")
        if self.preemption not in ("recompute", "swap", "auto"):
            raise ConfigError(f"preemption must be 'recompute', 'swap' or 'auto', not {self.preemption!r}.")
        if self.preemption == "swap" and not self.has_tiers:
            raise ConfigError("preemption='swap' needs somewhere to swap to: set host_cache_bytes or disk_cache_dir.")

    @property
    def has_tiers(self) -> bool:
        return self.host_cache_bytes > 0 or self.disk_cache_dir is not None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
