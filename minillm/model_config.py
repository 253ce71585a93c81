"""What the checkpoint says about the model: `ModelConfig`, read from a Hugging Face style `config.json`.

It is validated here, so an unsupported architecture fails with one clear line instead of deep inside
a matmul. config.json is outside input: every field that sizes a tensor or turns a switch is checked
for its type before anything is allocated. `ConfigError` (the one error a user can act on) and
`prompt_problem` (the one prompt check) live here too, so this module imports nothing of minillm's
(but `gguf_file.py`, when the model is a GGUF file); `minillm.config` re-exports them all.

Three families load into the one transformer of `model.py`, which differ in a few switches:
- Llama (`LlamaForCausalLM`: SmolLM2, Llama 3.x): plain RoPE or Llama 3's "llama3" rope_scaling;
  `attention_bias` adds a bias to the q, k, v and output projections (false in practice);
- Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): q, k and v always carry a bias, the output projection none;
- Qwen3 (`Qwen3ForCausalLM`): each q and k head RMS-normalized before RoPE, and a head_dim that
  need not be hidden_size / heads (128 when config.json leaves it out, as transformers reads it).

A model may end its answer on any of several tokens: Llama 3.x Instruct's config.json names
`<|end_of_text|>`, `<|eom_id|>` and `<|eot_id|>` as its eos_token_id, and Qwen2.5 Instruct's
generation_config.json adds `<|endoftext|>` to config.json's `<|im_end|>`. `eos_token_ids` holds
them all, config.json's then generation_config.json's, as transformers' `generate` stops at any.
"""

from __future__ import annotations

import json
import numbers
import reprlib
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

# each architecture minillm runs, and the model_type transformers writes beside it
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)
WHAT_LOADS = (
    "minillm runs LlamaForCausalLM (plain RoPE or rope_scaling 'llama3'), Qwen2ForCausalLM and "
    "Qwen3ForCausalLM checkpoints, with SiLU MLPs without bias and full attention in every layer"
)
FETCH_HINT = "run: python weights_fetch.py"
GGUF_SUFFIX = ".gguf"  # a model given as one llama.cpp file, opened in place (`gguf_file.py`)
GENERATION_FILE = "generation_config.json"  # transformers' generate() defaults, eos_token_id among them
DEFAULT_ROPE_THETA = 10000.0  # transformers' default_theta, for a config.json that names none
QWEN3_HEAD_DIM = 128  # Qwen3Config's head_dim when config.json has none (not hidden_size / heads)
# numbers in each RoPE table, max_position_embeddings * head_dim: 1 GiB in fp32, 2x Qwen2.5-1M's
MAX_ROPE_NUMBERS = 1 << 28
MAX_JSON_BYTES = 1 << 20  # the largest config.json read (SmolLM2's is 1 KB; with id2label tables, ~100 KB)
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
class Llama3RopeScaling:
    """Llama 3.x's rope_scaling "llama3": the slow RoPE frequencies divided by `factor`, so a model
    pretrained on `original_max_position_embeddings` tokens reads a longer context; the fast ones
    kept, those between blended (`model.rope_tables`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    eos_token_ids: tuple[int, ...] = ()  # any of them ends a sequence; () when the checkpoint names none
    architecture: str = "LlamaForCausalLM"  # one of MODEL_TYPES
    qkv_bias: bool = False  # Qwen2 (always), Llama and Qwen3 with attention_bias
    o_bias: bool = False  # the output projection's bias: Llama and Qwen3 with attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    rope_scaling: Llama3RopeScaling | None = None  # Llama 3.x; None: plain RoPE

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        architecture = _architecture(raw)
        for name in SIZE_FIELDS:  # a 0 or a quoted "49152" would otherwise fail far from config.json
            if name in raw and not (type(raw[name]) is int and raw[name] >= 1):  # bool is not a size
                raise ConfigError(
                    f"{name}={raw[name]!r} in config.json must be a positive integer; fix config.json or "
                    f"{FETCH_HINT}"
                )
        _refuse_unsupported(raw)
        rope_theta, rope_scaling = _rope(raw)
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads} in config.json."
            )
        qwen2, qwen3 = architecture == "Qwen2ForCausalLM", architecture == "Qwen3ForCausalLM"
        head_dim = raw.get("head_dim") or (QWEN3_HEAD_DIM if qwen3 else raw["hidden_size"] // num_heads)
        _check_rope_size(head_dim, raw.get("max_position_embeddings", 2048))
        attention_bias = _flag(raw, "attention_bias")  # (Qwen2's config has none: its biases are fixed)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rms_norm_eps=_positive_number(raw, "rms_norm_eps", 1e-6),
            tie_word_embeddings=_flag(raw, "tie_word_embeddings"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_token_ids(raw.get("eos_token_id"), raw["vocab_size"], "config.json"),
            architecture=architecture,
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            qk_norm=qwen3,
            rope_scaling=rope_scaling,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """config.json, with the end-of-sequence tokens generation_config.json adds (when there);
        or a GGUF file's metadata."""
        if is_gguf(model_dir):
            from minillm.gguf_file import gguf_config, open_gguf  # (imports this module)

            return gguf_config(open_gguf(model_dir))
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"Weights not found in {model_dir} (no config.json) — {FETCH_HINT}")
        try:
            config = cls.from_dict(_json_object(path))
        except KeyError as err:
            raise ConfigError(
                f"{path} lacks the field {err.args[0]!r}; is it a Llama or Qwen config.json?"
            ) from err
        generation = Path(model_dir) / GENERATION_FILE
        if not generation.is_file():
            return config
        added = _eos_token_ids(
            _json_object(generation).get("eos_token_id"), config.vocab_size, GENERATION_FILE
        )
        return replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + added)))

    def to_hf_dict(self) -> dict:
        """config.json as transformers reads it for this family (and our own reader reads it back)."""
        eos = list(self.eos_token_ids)
        hf = {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES[self.architecture],
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
            "eos_token_id": eos[0] if len(eos) == 1 else eos or None,  # as the Hub writes it
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        hf |= {
            "LlamaForCausalLM": {"attention_bias": self.o_bias, "mlp_bias": False},
            "Qwen2ForCausalLM": {"use_sliding_window": False},  # (its q/k/v biases are not a switch)
            "Qwen3ForCausalLM": {"attention_bias": self.o_bias, "use_sliding_window": False},
        }[self.architecture]
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **asdict(self.rope_scaling)}
        return hf

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


def is_gguf(model_path: str | Path) -> bool:
    """Whether the model is a GGUF file rather than a checkpoint folder: the one test every
    reader of a model (config, tokenizer, weights) branches on."""
    path = Path(model_path)
    return path.suffix.lower() == GGUF_SUFFIX and not path.is_dir()  # (a missing file: said on opening)


def _architecture(raw: dict) -> str:
    architectures = raw.get("architectures") or [raw.get("model_type", "unknown")]
    architecture = architectures[0] if isinstance(architectures, list) else architectures
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"Unsupported architecture {reprlib.repr(architecture)} in config.json; "
            f"minillm runs {', '.join(SUPPORTED_ARCHITECTURES)} checkpoints."
        )
    return architecture


def _check_rope_size(head_dim: int, max_position_embeddings: int) -> None:
    """RoPE turns a head's dimensions in pairs, and its tables (`model.rope_tables`) hold a row of
    head_dim numbers for every position: checked before they are computed."""
    if head_dim < 2 or head_dim % 2:
        raise ConfigError(
            f"head_dim={head_dim} (hidden_size // num_attention_heads where config.json has no head_dim) "
            "must be an even number >= 2: RoPE turns a head's dimensions in pairs; fix config.json."
        )
    if head_dim * max_position_embeddings > MAX_ROPE_NUMBERS:
        raise ConfigError(
            f"max_position_embeddings={max_position_embeddings} positions of head_dim={head_dim} make "
            f"RoPE tables past the {MAX_ROPE_NUMBERS:,} numbers minillm computes; lower "
            "max_position_embeddings in config.json."
        )


def _json_object(path: Path) -> dict:
    """A checkpoint's JSON file that must hold an object (config.json, generation_config.json)."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ConfigError(
            f"{path} is {size:,} bytes, more than a config holds ({MAX_JSON_BYTES:,}) — delete it and "
            f"{FETCH_HINT}"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # bad UTF-8 or JSON; too deep; an int of 5,000 digits
        raise ConfigError(f"{path} is not valid JSON ({err}) — delete it and {FETCH_HINT}") from err
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path} holds a JSON {type(raw).__name__}, not an object — delete it and {FETCH_HINT}"
        )
    return raw


def _eos_token_ids(value, vocab_size: int, file: str) -> tuple[int, ...]:
    """eos_token_id as `file` writes it: absent, one token id, or a list of them (Llama 3.x
    Instruct: end_of_text, eom_id and eot_id); each must be a token of the vocabulary, which a
    quoted id or one past the logits could never be."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(type(token) is int and 0 <= token < vocab_size for token in ids):
        raise ConfigError(
            f"eos_token_id={reprlib.repr(value)} in {file} must be a token id in [0, {vocab_size}) or a "
            f"list of them; fix {file} or {FETCH_HINT}"
        )
    return tuple(dict.fromkeys(ids))  # in the file's order, each once


def _unsupported(what: str) -> ConfigError:
    return ConfigError(f"config.json asks for {what}, which minillm does not implement; {WHAT_LOADS}.")


def _flag(table: dict, name: str, default: bool = False) -> bool:
    """A true/false field: a quoted "false" would otherwise read as true."""
    value = table.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(
            f"{name}={reprlib.repr(value)} in config.json must be true or false; fix config.json or "
            f"{FETCH_HINT}"
        )
    return value


def _positive_number(table: dict, name: str, default: float | None, where: str = "") -> float:
    """A positive finite number (an int or a float; not a bool, a string, NaN or 1e999); None as the
    default makes the field required."""
    value = table.get(name, default)
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (number and 0 < value <= sys.float_info.max):
        raise ConfigError(
            f"{where}{name}={reprlib.repr(value)} in config.json must be a positive number; fix config.json "
            f"or {FETCH_HINT}"
        )
    return float(value)


def _refuse_unsupported(raw: dict) -> None:
    """The switches of these families that minillm's one transformer does not have."""
    if raw.get("hidden_act", "silu") != "silu":
        raise _unsupported(
            f"hidden_act={reprlib.repr(raw['hidden_act'])} (an MLP activation other than SiLU)"
        )
    if _flag(raw, "mlp_bias"):
        raise _unsupported("mlp_bias=true (biases in the MLP)")
    sliding = _sliding_layers(raw)
    if sliding:  # (reprlib shows 6 layers and "...": 7 are enough to show, of a range of 10**12)
        raise _unsupported(f"sliding-window attention in layers {reprlib.repr(list(sliding[:7]))}")


def _sliding_layers(raw: dict) -> Sequence[int]:
    """The layers transformers gives sliding-window attention (Qwen2, Qwen3): those config.json's
    `layer_types` does not mark "full_attention", or without that list, with `use_sliding_window`
    and a `sliding_window`, every layer from `max_window_layers` on."""
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ConfigError(
                f"layer_types={reprlib.repr(layer_types)} in config.json must be a list; fix config.json."
            )
        return [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if not _flag(raw, "use_sliding_window") or raw.get("sliding_window") is None:
        return []
    first = raw.get("max_window_layers", 28)  # Qwen2Config's and Qwen3Config's default
    if type(first) is not int:
        raise ConfigError(
            f"max_window_layers={reprlib.repr(first)} in config.json must be an integer; fix config.json."
        )
    return range(max(first, 0), raw["num_hidden_layers"])  # not a list: it may end at 10**12


def _rope(raw: dict) -> tuple[float, Llama3RopeScaling | None]:
    """rope_theta and the RoPE scaling, found where transformers finds them: a Hub config.json has
    `rope_scaling` and `rope_theta` side by side; transformers 5 writes both into `rope_parameters`
    (`rope_scaling` wins where both are, as in transformers)."""
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    rope = raw.get(field) or {}
    if not isinstance(rope, dict):
        raise ConfigError(
            f"{field}={reprlib.repr(rope)} in config.json must be an object or null; fix config.json."
        )
    theta = _positive_number(rope, "rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    if theta <= 1:  # theta^(-2i/head_dim) would grow, past float32 for a tiny theta: NaN angles
        raise ConfigError(f"rope_theta={theta} in config.json must be above 1; fix config.json.")
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor")) not in (None, 1.0):
        raise _unsupported("partial_rotary_factor (RoPE on part of each head)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise _unsupported(f"{field} of type {reprlib.repr(kind)}")
    return theta, _llama3_scaling(rope, f"{field}'s ", raw.get("max_position_embeddings", 2048))


def _llama3_scaling(rope: dict, where: str, max_position_embeddings: int) -> Llama3RopeScaling:
    """rope_type "llama3"'s fields, checked (transformers only warns, then divides by zero)."""
    original = rope.get("original_max_position_embeddings", max_position_embeddings)
    if type(original) is not int or original < 1:
        raise ConfigError(
            f"{where}original_max_position_embeddings={reprlib.repr(original)} in config.json must be "
            "a positive integer; fix config.json."
        )
    scaling = Llama3RopeScaling(
        factor=_positive_number(rope, "factor", None, where),
        low_freq_factor=_positive_number(rope, "low_freq_factor", None, where),
        high_freq_factor=_positive_number(rope, "high_freq_factor", None, where),
        original_max_position_embeddings=original,
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(
            f"{where}high_freq_factor={scaling.high_freq_factor} must exceed its low_freq_factor="
            f"{scaling.low_freq_factor} (they bound the blended frequencies); fix config.json."
        )
    return scaling
