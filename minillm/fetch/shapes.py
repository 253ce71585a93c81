"""Named shapes: the real config of a 0.6-1.5B model, with random weights, for speed and memory only.

A decode step reads every weight once and does the same arithmetic whatever the weights hold, so a
step's time and a cache's size depend on the model's *shape* (layers, widths, heads, vocabulary),
never on its values. `--shape qwen3-0.6b` on a benchmark or lesson 01/03 writes (once) a checkpoint
folder with that model's published config.json and random weights, and runs on it: the bandwidth
wall and a KV budget that binds by itself show at 1B scale on a learner's machine, without a
download. Its text is meaningless, and every table that runs on it says "random weights".

The folder also gets the default checkpoint's tokenizer, so the benchmarks' prompts encode as usual;
its ids fit every shape's larger vocabulary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from minillm.config import ModelConfig
from minillm.progress import progress_bar

RANDOM_SUFFIX = "-random-weights"  # in the folder's name, which the tables print
# The published config.json of each (the fields minillm reads), as on the Hugging Face hub.
SHAPES = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


def random_tensors(
    config: dict, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names for the config.json `config`, scaled so activations
    stay O(1): each matrix's entries have variance 1/fan_in, each norm's weight is near 1. Qwen2's
    q/k/v biases and Qwen3's q/k norms come after the Llama tensors, so a Llama's values do not
    depend on which family code wrote them."""
    generator = torch.Generator().manual_seed(seed)
    shapes = _tensor_shapes(config)
    with progress_bar("random weights", len(shapes), enabled=len(shapes) > 100) as advance:
        tensors = {}
        for name, shape in shapes.items():
            tensors[name] = _random(shape, name, generator).to(dtype)
            advance()
    return tensors


def shape_checkpoint(name: str, weights_root: Path, tokenizer_from: Path) -> Path:
    """`weights_root/<name>-random-weights/`: written on first use (bf16 weights, the tokenizer files
    of `tokenizer_from`), then reused."""
    folder = weights_root / f"{name}{RANDOM_SUFFIX}"
    if (folder / "model.safetensors").is_file():
        return folder
    config = SHAPES[name]
    ModelConfig.from_dict(config)  # the shape must be one minillm runs
    scratch = weights_root / f".{name}{RANDOM_SUFFIX}.part"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    (scratch / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2))
    save_file(random_tensors(config, dtype=torch.bfloat16), scratch / "model.safetensors")
    for tokenizer_file in sorted(tokenizer_from.glob("tokenizer*")):
        shutil.copy(tokenizer_file, scratch)
    scratch.rename(folder)  # whole or not at all
    return folder


def _tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        if config["architectures"][0] == "Qwen2ForCausalLM":  # Qwen2: q, k and v carry a bias
            shapes |= {p + "q_proj.bias": (heads * head_dim,), p + "k_proj.bias": (kv_heads * head_dim,)}
            shapes |= {p + "v_proj.bias": (kv_heads * head_dim,)}
        if config["architectures"][0] == "Qwen3ForCausalLM":  # Qwen3: RMSNorm on each q and k head
            shapes |= {p + "q_norm.weight": (head_dim,), p + "k_norm.weight": (head_dim,)}
    return shapes


def _random(shape: tuple[int, ...], name: str, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1 + torch.randn(*shape, generator=generator) * 0.1
    if name == "model.embed_tokens.weight":
        return torch.randn(*shape, generator=generator)
    if name.endswith(".bias"):
        return torch.randn(*shape, generator=generator) * 0.1
    return torch.randn(*shape, generator=generator) * shape[-1] ** -0.5
