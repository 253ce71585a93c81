"""Checkpoint -> model: read `model.safetensors` (Hugging Face Llama names), check it, load it.

Everything that can be wrong with a checkpoint is caught here and reported in one line that says
what to do: a missing folder or file, a truncated or corrupt file, a missing or misshapen tensor,
NaNs. The separate q/k/v and gate/up matrices of the checkpoint are concatenated into the fused
projections of `model.py`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from minillm.config import FETCH_HINT, ConfigError, ModelConfig
from minillm.model import Transformer

WEIGHTS_FILE = "model.safetensors"


def read_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of `model_dir/model.safetensors`, by their Hugging Face names."""
    path = Path(model_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise ConfigError(f"Weights not found: {path} is missing — {FETCH_HINT}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise ConfigError(
            f"{path} is truncated or corrupt ({err}) — delete {Path(model_dir)} and {FETCH_HINT}"
        ) from err


def hf_to_minillm(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename checkpoint tensors to this model's names, fusing q|k|v and gate|up."""

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(f"The checkpoint lacks tensor {name!r}; it is not a complete Llama checkpoint.")
        return tensors[name]

    state = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        state[ours + "attn_norm.weight"] = take(hf + "input_layernorm.weight")
        state[ours + "mlp_norm.weight"] = take(hf + "post_attention_layernorm.weight")
        state[ours + "attn.wqkv.weight"] = torch.cat(
            [take(hf + f"self_attn.{p}_proj.weight") for p in ("q", "k", "v")]
        )
        state[ours + "attn.wo.weight"] = take(hf + "self_attn.o_proj.weight")
        state[ours + "mlp.w_gate_up.weight"] = torch.cat(
            [take(hf + f"mlp.{p}_proj.weight") for p in ("gate", "up")]
        )
        state[ours + "mlp.w_down.weight"] = take(hf + "mlp.down_proj.weight")
    return state


def check_state(model: Transformer, state: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConfigError(
                f"Tensor {name} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(expected[name].shape)}; the weights and config.json disagree."
            )
        if not torch.isfinite(tensor).all():
            raise ConfigError(
                f"Tensor {name} holds NaN or inf values; the checkpoint is corrupt — {FETCH_HINT}"
            )


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Transformer:
    config = ModelConfig.from_dir(model_dir)
    state = hf_to_minillm(read_checkpoint(model_dir), config)
    with torch.device("meta"):
        model = Transformer(config)  # shapes only; the real tensors come from the checkpoint
    check_state(model, state)
    model.load_state_dict(
        {name: t.to(device=device, dtype=dtype) for name, t in state.items()}, assign=True, strict=True
    )
    model.init_rope()
    return model.eval()


def model_fingerprint(model: Transformer) -> str:
    """A short id of the model's config and weights (a strided sample of every tensor): KV written
    by one model is meaningless to another, and a session file records whose it is."""
    digest = hashlib.sha256(json.dumps(model.config.to_hf_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 256)][:256].float().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}".encode() + sample.numpy().tobytes())
    return digest.hexdigest()[:16]
