"""A GGUF file opened in place: the model a llama.cpp user already has, run without converting it.

A GGUF is one file: a header (metadata, key -> value, and a table of tensors) and then the tensors,
each a run of bytes at an offset the table names. `GGUFReader` maps the file into memory and
parses the header; the tensors stay in the file until something reads them, and nothing is
written. From the header and the tensors come the three things a checkpoint folder holds:

- the config (`gguf_config`): `{arch}.embedding_length`, `.block_count`, `.attention.head_count`
  and the rest, for the architectures llama, qwen2 and qwen3, become config.json's fields and are
  checked by `ModelConfig.from_dict` as a folder's are; a family's optional parts (q/k/v biases,
  q/k norms) are read off the tensors the file holds;
- the tokenizer (`gguf_tokenizer_files`): `tokenizer.ggml.*` as tokenizer.json and
  tokenizer_config.json would hold it (`gguf_tokenizer.py`), which `Tokenizer` reads as it reads
  a folder's files;
- the tensors, under Hugging Face's names: every one dequantized to fp32 by the `gguf` package
  (`gguf_tensors`, what the dense products read), and each matrix stored in a block format that
  `quant_dense` reads also as its blocks, a view of the mapped file (`gguf_blocks`).

Two traps. llama.cpp stores the rows of W_q and W_k of the *llama* architecture permuted: its RoPE
turns adjacent pairs (x0, x1) while HF Llama turns halves (x_i, x_{i+d/2}); we put them back per
head. Its converter leaves Qwen2 and Qwen3 as they are (llama.cpp turns their halves, "NEOX"), as
transformers' GGUF loader assumes too. And Llama 3.x's rope_scaling is no metadata but a tensor,
`rope_freqs.weight`: the factor each RoPE frequency is divided by, which must be the "llama3"
rule's for minillm to run it.

`open_gguf` is the one place a GGUF is opened: every command and `LLM`, `load_model`, `Tokenizer`
and `ModelConfig` reach the file through it, and it has `gguf_check.py` walk the header against the
file's size before `GGUFReader` trusts it.
"""

from __future__ import annotations

import functools
import reprlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor, dequantize

from minillm.config import ConfigError, ModelConfig
from minillm.gguf_check import check_gguf
from minillm.gguf_tokenizer import tokenizer_json_from_gguf
from minillm.model import rope_frequencies
from minillm.progress import progress_bar
from minillm.quantized_weights import BLOCK_BYTES, QuantizedWeight

# general.architecture -> the Hugging Face architecture it is
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# llama.cpp's tensor names (blk.N.<part>.weight) -> Hugging Face's
GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# the GGUF block types `quant_dense` reads, by the name minillm gives them ("Q4_1" -> "q4_1")
PACKED_TYPES = {fmt.upper(): fmt for fmt in BLOCK_BYTES}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x's rope_scaling, as llama.cpp's converter writes it
# what llama.cpp's converter assumes of "llama3" rope_scaling besides the factor (its defaults)
LLAMA3_RULE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def open_gguf(path: str | Path) -> GGUFReader:
    """The GGUF file at `path`, its header parsed and its tensors mapped (copy-on-write: nothing is
    ever written back). Parsed once while the file is unchanged: a 128k-token vocabulary takes
    seconds, and the config, the tokenizer and the weights each ask for the file."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ConfigError(f"No GGUF file at {path}; give the path of a .gguf file or a checkpoint folder.")
    stat = path.stat()
    return _parsed(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _parsed(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    check_gguf(path)  # GGUFReader trusts every count and offset in the file: each is checked first
    try:
        return GGUFReader(path, "c")
    except (ValueError, OSError, IndexError, KeyError, TypeError, OverflowError) as err:
        raise ConfigError(f"{path} is not a GGUF file minillm can read ({reprlib.repr(str(err))}).") from None


def gguf_config(reader: GGUFReader) -> ModelConfig:
    """The model's config from the file's metadata, checked as a config.json is."""
    arch = _value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{reader.data.filename} holds a {reprlib.repr(arch)} model; minillm opens GGUF files of the "
            f"architectures {', '.join(ARCHITECTURES)}."
        )
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:  # llama.cpp's vocabulary files hold the tokenizer alone
        raise ConfigError(
            f"{reader.data.filename} holds no model (no token_embd.weight tensor): a vocabulary-only "
            "file? Give the GGUF of a whole model."
        )
    raw = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": _rows(reader, "token_embd.weight"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,  # (Qwen2's biases are no switch)
        "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id"),
        # llama.cpp stops at every end-of-generation token it names: eos, end of turn, end of message
        "eos_token_id": [
            token
            for token in (_value(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom"))
            if token is not None
        ],
    } | _sizes(reader, arch)
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if rope_freqs is not None:
        original = _value(reader, f"{arch}.rope.scaling.original_context_length")
        factor = float(np.max(rope_freqs.data))
        raw["rope_scaling"] = {"rope_type": "llama3", **LLAMA3_RULE, "factor": factor} | (
            {"original_max_position_embeddings": original} if original else {}
        )
    try:
        config = ModelConfig.from_dict(raw)
    except KeyError as err:
        raise ConfigError(f"{reader.data.filename} lacks the metadata for {err.args[0]!r}.") from None
    except ConfigError as err:
        raise ConfigError(f"{reader.data.filename} (its metadata as config.json): {err}") from None
    if rope_freqs is not None:
        _check_llama3_rule(config, np.asarray(rope_freqs.data, dtype=np.float32), reader.data.filename)
    return config


def _sizes(reader: GGUFReader, arch: str) -> dict:
    """config.json's size fields from `{arch}.*`; a missing one is refused by ModelConfig."""

    def key(name: str, default=None):
        return _value(reader, f"{arch}.{name}", default)

    eps = key("attention.layer_norm_rms_epsilon")
    sizes = {
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv", key("attention.head_count")),
        # Qwen3's head_dim is its own (key_length); llama's is the rotated dimensions
        "head_dim": key("attention.key_length", key("rope.dimension_count") if arch == "llama" else None),
        "max_position_embeddings": key("context_length"),
        "rope_theta": key("rope.freq_base", 10000.0),
        # stored as float32 (9.9999997e-06 for a config.json's 1e-05)
        "rms_norm_eps": float(f"{eps:.7g}") if isinstance(eps, float) else eps,
    }
    return {name: value for name, value in sizes.items() if value is not None}


def _check_llama3_rule(config: ModelConfig, factors: np.ndarray, where: str) -> None:
    """rope_freqs.weight (head_dim/2,) must be the factors the "llama3" rule gives: minillm computes
    the frequencies from the rule, so a file whose factors follow another rule is refused."""
    plain = rope_frequencies(replace(config, rope_scaling=None))
    ours = (plain / rope_frequencies(config)).numpy()
    if factors.shape != ours.shape or not np.allclose(factors, ours, rtol=1e-4):
        raise ConfigError(
            f"{where}: its {ROPE_FREQS} is not Llama 3's rope scaling (factor {config.rope_scaling.factor}, "
            "low_freq_factor 1, high_freq_factor 4); minillm cannot run its RoPE."
        )


def gguf_tokenizer_files(reader: GGUFReader) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) as dicts, from the file's tokenizer metadata."""
    fields = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    try:
        return tokenizer_json_from_gguf(fields)
    except ConfigError as err:
        raise ConfigError(f"{reader.data.filename}: {err}") from None


def gguf_tensors(reader: GGUFReader) -> dict[str, torch.Tensor]:
    """Every tensor as fp32 under its Hugging Face name, dequantized by the `gguf` package (an F32
    tensor stays a view of the file); llama's q and k rows put back in HF's order."""
    config = gguf_config(reader)
    tensors = {}
    with progress_bar("dequantize", len(reader.tensors)) as advance:
        for tensor in reader.tensors:
            if tensor.name != ROPE_FREQS:  # (read into the config)
                weight = _unpermuted(tensor, _dequantized(tensor), config)  # (out_features, in_features)
                tensors[hf_name(tensor.name)] = torch.from_numpy(weight)
            advance()
    return tensors


def gguf_blocks(reader: GGUFReader) -> dict[str, QuantizedWeight]:
    """The matrices stored in a type `quant_dense` reads (PACKED_TYPES), as their blocks by Hugging
    Face name: (out_features, bytes a row) uint8 views of the mapped file, never copied, except
    llama's q and k, whose rows are put back in order. The other tensors are not here."""
    config = gguf_config(reader)
    file_bytes = torch.from_numpy(reader.data)  # the whole file, one storage (weights.py stacks in it)
    blocks = {}
    for tensor in reader.tensors:
        kind = PACKED_TYPES.get(tensor.tensor_type.name)
        if kind is None or tensor.data.ndim != 2:
            continue
        rows = file_bytes[tensor.data_offset : tensor.data_offset + tensor.n_bytes].view(tensor.data.shape)
        if _rope_heads(tensor.name, config):
            rows = torch.from_numpy(_unpermuted(tensor, tensor.data, config))
        blocks[hf_name(tensor.name)] = QuantizedWeight(rows, kind)
    return blocks


def has_blocks(reader: GGUFReader) -> bool:
    """Whether any matrix of the file is stored in a type `quant_dense` reads."""
    return any(t.tensor_type.name in PACKED_TYPES and t.data.ndim == 2 for t in reader.tensors)


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = gguf_name.split(".")
    block = parts[0] == "blk" and len(parts) == 4
    part = parts[2] if block else parts[0]
    if part not in GGUF_TO_HF or len(parts) != (4 if block else 2):
        raise ConfigError(
            f"The GGUF holds the tensor {reprlib.repr(gguf_name)}, which is no part of a Llama, Qwen2 "
            "or Qwen3 model minillm runs."
        )
    if block:
        return f"model.layers.{parts[1]}.{GGUF_TO_HF[part]}.{parts[3]}"
    return f"{GGUF_TO_HF[part]}.{parts[1]}"


def undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp reorders each head's rows from halves (HF: row i pairs with row i + d/2) to
    interleaved pairs (row 2i pairs with row 2i+1). Put them back: (heads, d/2, 2) -> (heads, 2, d/2).
    A bias is one number a row: it moves with its row."""
    rows = weight.shape[0]
    halves = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
    return halves.reshape(weight.shape)


def _rope_heads(gguf_name: str, config: ModelConfig) -> int:
    """The heads whose rows llama.cpp permuted in this tensor (llama's q: the query heads, k: the
    KV heads), or 0 for any other tensor and for Qwen's."""
    if config.architecture != "LlamaForCausalLM":
        return 0
    if ".attn_q." in gguf_name:
        return config.num_heads
    return config.num_kv_heads if ".attn_k." in gguf_name else 0


def _unpermuted(tensor: ReaderTensor, values: np.ndarray, config: ModelConfig) -> np.ndarray:
    """`values` (rows of `tensor`, numbers or blocks) in Hugging Face's row order, contiguous."""
    heads = _rope_heads(tensor.name, config)
    return np.ascontiguousarray(undo_rope_permutation(values, heads) if heads else values)


def _dequantized(tensor: ReaderTensor) -> np.ndarray:
    """The tensor's numbers as float32, whatever type the file stores it in."""
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ConfigError(
            f"The GGUF stores {tensor.name} as {tensor.tensor_type.name}, which the gguf package cannot "
            "dequantize; requantize the file (llama.cpp's llama-quantize) to a common type such as Q8_0."
        ) from None
    return values.astype(np.float32, copy=False)


def _value(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _rows(reader: GGUFReader, name: str) -> int | None:
    tensor = next((t for t in reader.tensors if t.name == name), None)
    return None if tensor is None else int(tensor.data.shape[0])
