"""What the checkpoint says about the model: `ModelConfig`, read from a Hugging Face style `config.json`.

It is validated here, so an unsupported architecture fails with one clear line instead of deep inside
a matmul. `ConfigError` (the one error a user can act on) and `prompt_problem` (the one prompt check)
live here too, so this module imports nothing of minillm's; `minillm.config` re-exports them all.
"""

from __future__ import annotations

import json
import numbers
import reprlib
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
FETCH_HINT = "run: python weights_fetch.py"
# config.json fields that size a tensor: each must be a positive integer where present
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


class ConfigError(ValueError):
    """A checkpoint or a setting that minillm cannot use; the message says what to do."""


def prompt_problem(prompt_ids: list, context_len: int, vocab_size: int) -> str | None:
    """Why a prompt cannot run in a context of `context_len` tokens, or None. The one prompt check,
    shared by the single-sequence decoders and the engine's admission."""
    if not prompt_ids:
        return "The prompt is empty; give at least one token."
    for index, token in enumerate(prompt_ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < vocab_size:
            return (
                f"Token {index} of the prompt is {reprlib.repr(token)}; token ids are integers in "
                f"[0, {vocab_size}) for this model's vocabulary."
            )
    if len(prompt_ids) >= context_len:
        return (
            f"The prompt has {len(prompt_ids)} tokens but the context holds {context_len} "
            "(and needs room for one new token); shorten the prompt."
        )
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
                raise ConfigError(
                    f"{name}={raw[name]!r} in config.json must be a positive integer; fix config.json or "
                    f"{FETCH_HINT}"
                )
        if raw.get("rope_scaling"):
            raise ConfigError(
                "config.json asks for rope_scaling, which minillm does not implement; "
                "use a Llama checkpoint with plain RoPE."
            )
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads} in config.json."
            )
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
            raise ConfigError(
                f"{path} holds a JSON {type(raw).__name__}, not an object — delete it and {FETCH_HINT}"
            )
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
            raise ConfigError(
                f"max_seq_len={max_seq_len} is longer than the model's context "
                f"({self.max_position_embeddings} tokens, max_position_embeddings); lower it."
            )
        return max_seq_len

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """The KV cache formula: K and V, for every layer and KV head, head_dim numbers each."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size
