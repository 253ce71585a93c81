"""Checkpoint -> model: read `model.safetensors` (Hugging Face names), check it, load it.

Everything that can be wrong with a checkpoint is caught here and reported in one line that says
what to do: a missing folder or file, a truncated or corrupt file, a missing or misshapen tensor,
NaNs. The separate q/k/v and gate/up matrices of the checkpoint (and q/k/v's biases, in Qwen2)
are concatenated into the fused projections of `model.py`. With `weights="q4_1"` or `"int8"` each
projection also gets its GGUF blocks (`quantized_weights.py`), which decode-sized products read
instead of the dense matrix.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from minillm.config import FETCH_HINT, ConfigError, EngineConfig, ModelConfig, is_gguf
from minillm.matmul import dense_kernel
from minillm.model import Transformer
from minillm.quantized_weights import (
    BLOCK,
    BLOCK_BYTES,
    BLOCK_TYPES,
    PACKED_FILE,
    QuantizedWeight,
    quantize_q8_0,
    read_packed,
)
from minillm.safetensors_check import check_safetensors

WEIGHTS_FILE = "model.safetensors"


def read_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of `model_dir/model.safetensors`, or of a GGUF file dequantized, by their
    Hugging Face names."""
    if is_gguf(model_dir):
        from minillm.gguf_file import gguf_tensors, open_gguf

        return gguf_tensors(open_gguf(model_dir))
    path = Path(model_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise ConfigError(f"Weights not found: {path} is missing — {FETCH_HINT}")
    check_safetensors(path)
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise ConfigError(
            f"{path} is truncated or corrupt ({err}) — delete {Path(model_dir)} and {FETCH_HINT}"
        ) from err


def hf_to_minillm(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename checkpoint tensors to this model's names, fusing q|k|v (weights and biases) and gate|up."""
    _check_layer_count(tensors, config)
    return _gather(tensors, _vector_sources(config)) | stack_matrices(tensors, config)


def _check_layer_count(tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """The layers config.json names are the checkpoint's, checked before a name is made for each
    (a num_hidden_layers of 10**9 would otherwise build names and modules without end)."""
    layers = {name.split(".")[2] for name in tensors if name.startswith("model.layers.")}
    if len(layers) != config.num_layers:
        raise ConfigError(
            f"config.json says num_hidden_layers={config.num_layers} but the checkpoint holds "
            f"{len(layers)} layers; the weights and config.json disagree."
        )


def _vector_sources(config: ModelConfig) -> dict[str, list[str]]:
    """This model's vectors (norm weights, biases) -> the checkpoint tensors each is made of; the
    family's switches (`ModelConfig`) say which a layer has."""
    sources = {"norm.weight": ["model.norm.weight"]}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        sources[ours + "attn_norm.weight"] = [hf + "input_layernorm.weight"]
        sources[ours + "mlp_norm.weight"] = [hf + "post_attention_layernorm.weight"]
        if config.qkv_bias:  # stacked in the order of the q|k|v rows they add to
            sources[ours + "attn.wqkv.bias"] = [hf + f"self_attn.{p}_proj.bias" for p in ("q", "k", "v")]
        if config.o_bias:
            sources[ours + "attn.wo.bias"] = [hf + "self_attn.o_proj.bias"]
        if config.qk_norm:
            sources[ours + "attn.q_norm.weight"] = [hf + "self_attn.q_norm.weight"]
            sources[ours + "attn.k_norm.weight"] = [hf + "self_attn.k_norm.weight"]
    return sources


def stack_matrices(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's matrices under this model's names, q|k|v and gate|up stacked row after row
    (a row is one output's weights, so GGUF blocks stack the same way as numbers)."""
    return _gather(tensors, _matrix_sources(config))


def _matrix_sources(config: ModelConfig) -> dict[str, list[str]]:
    """This model's matrices -> the checkpoint matrices each is stacked from."""
    sources = {"embed.weight": ["model.embed_tokens.weight"]}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        sources[ours + "attn.wqkv.weight"] = [hf + f"self_attn.{p}_proj.weight" for p in ("q", "k", "v")]
        sources[ours + "attn.wo.weight"] = [hf + "self_attn.o_proj.weight"]
        sources[ours + "mlp.w_gate_up.weight"] = [hf + f"mlp.{p}_proj.weight" for p in ("gate", "up")]
        sources[ours + "mlp.w_down.weight"] = [hf + "mlp.down_proj.weight"]
    return sources


def _gather(tensors: dict[str, torch.Tensor], sources: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Each of our names -> its checkpoint tensors, stacked along the first dimension."""
    gathered = {}
    for ours, names in sources.items():
        parts = [_take(tensors, name) for name in names]
        if len({part.shape[1:] for part in parts}) > 1:
            raise ConfigError(
                f"The checkpoint's {', '.join(names)} differ in width; they cannot form {ours}."
            )
        gathered[ours] = _stack_rows(parts)
    return gathered


def _stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' rows one after another: a view where they already lie so in one storage (the
    gate and up blocks of a GGUF file, one after the other in it), else a copy."""
    first = parts[0]
    if len(parts) == 1:
        return first
    adjacent = all(
        before.is_contiguous()
        and after.is_contiguous()
        and after.shape[1:] == first.shape[1:]
        and after.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and after.data_ptr() == before.data_ptr() + before.nbytes
        for before, after in zip(parts, parts[1:])
    )
    if not adjacent:
        return torch.cat(parts)
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ConfigError(
            f"The checkpoint lacks tensor {name!r}; it is not a complete checkpoint of config.json's "
            "architecture."
        )
    return tensors[name]


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


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    weights: str = "model",
    fused: bool = True,
) -> Transformer:
    """The checkpoint as a model in `dtype` on `device`; `weights` (`EngineConfig.weights`) says
    what decode-sized products read: the dense weights, or GGUF blocks beside them, and with `fused`
    (`EngineConfig.fused_decode`) a decode layer over blocks runs in two C++ calls."""
    config = ModelConfig.from_dir(model_dir)
    state = hf_to_minillm(read_checkpoint(model_dir), config)
    with torch.device("meta"):
        model = Transformer(config)  # shapes only; the real tensors come from the checkpoint
    check_state(model, state)
    model.load_state_dict(
        {name: t.to(device=device, dtype=dtype) for name, t in state.items()}, assign=True, strict=True
    )
    model.init_rope()
    weights = resolve_weights(weights, Path(model_dir), dtype, device)
    if weights != "model":
        _attach_blocks(model, state, weights, Path(model_dir))
        model.fuse_layers(fused and all(m.quantized is not None for m in model.products().values()))
    return model.eval()


def _attach_blocks(
    model: Transformer, state: dict[str, torch.Tensor], weights: str, model_path: Path
) -> None:
    """Give each product its GGUF blocks: the checkpoint's own ("q4_1": the packed file beside a
    folder's weights, or a GGUF file's, read in place), or its matrix quantized to Q8_0 here
    ("int8"; a matrix whose rows are not whole blocks keeps only its dense weight)."""
    if weights == "int8":
        for name, matmul in model.products().items():
            matmul.quantized = quantize_q8_0(state[name]) if state[name].shape[1] % BLOCK == 0 else None
        return
    packed, sources = _checkpoint_blocks(model_path), _matrix_sources(model.config)
    for name, matmul in model.products().items():
        matmul.quantized = _blocks_for(name, [packed.get(source) for source in sources[name]], state[name])
    dense = [name for name, matmul in model.products().items() if matmul.quantized is None]
    if dense:  # said, not silent: these products run at the dense weights' speed
        kinds = sorted({re.sub(r"^layers\.\d+\.", "layers.*.", name) for name in dense})
        print(
            f"weights: {len(dense)} of {len(model.products())} products read the dense weights, not "
            f"blocks (their matrices are not all in one of {BLOCK_TYPES}): "
            f"{', '.join(kinds)}",
            file=sys.stderr,
        )


def _checkpoint_blocks(model_path: Path) -> dict[str, QuantizedWeight]:
    """The checkpoint's own blocks by Hugging Face name: a GGUF file's, or the packed file's."""
    if is_gguf(model_path):
        from minillm.gguf_file import gguf_blocks, open_gguf

        return gguf_blocks(open_gguf(model_path))
    return read_packed(model_path)


def _has_blocks(model_path: Path) -> bool:
    if is_gguf(model_path):
        from minillm.gguf_file import has_blocks, open_gguf

        return has_blocks(open_gguf(model_path))
    return (model_path / PACKED_FILE).is_file()


def load_model_for(config: EngineConfig) -> Transformer:
    """The model a run's switches ask for (`EngineConfig`: dtype, device, weights, fused_decode)."""
    return load_model(
        config.model_dir, config.torch_dtype, config.device, config.weights, config.fused_decode
    )


def resolve_weights(weights: str, model_dir: Path, dtype: torch.dtype, device: str) -> str:
    """`weights` as asked, or for "auto" the checkpoint's own blocks where this machine can read
    them (a CPU whose kernels build, fp32 or bf16, the blocks fetched), else the dense weights. A
    GGUF file's blocks not read under "auto" are said in one line: that model runs slower."""
    if weights == "model":
        return "model"
    if not _has_blocks(model_dir):
        if weights == "q4_1" and is_gguf(model_dir):
            raise ConfigError(
                f"weights='q4_1' reads the GGUF's own blocks ({BLOCK_TYPES}), and {model_dir} stores none; "
                "use --weights int8 or model."
            )
        if weights == "auto":
            _say_dense(model_dir, f"it stores no matrix in {BLOCK_TYPES}")
            return "model"
    problem = _blocks_problem(dtype, device)  # (builds the C++ kernels, the first time on a machine)
    if weights == "auto":
        if problem is not None:
            _say_dense(model_dir, f"weights='q4_1' {problem}")
        return "q4_1" if problem is None else "model"
    if problem is not None:
        raise ConfigError(f"weights={weights!r} {problem}; use --weights model.")
    return weights


def _say_dense(model_path: Path, why: str) -> None:
    """One line on stderr when a GGUF file's products all read the dense weights under "auto"."""
    if is_gguf(model_path):
        print(f"weights: every product of {model_path.name} reads the dense weights: {why}", file=sys.stderr)


def _blocks_problem(dtype: torch.dtype, device: str) -> str | None:
    """Why GGUF blocks cannot be read here, or None."""
    if device != "cpu":
        return "is read by a CPU kernel only"
    if dtype not in (torch.float32, torch.bfloat16):
        return "multiplies float32 or bfloat16 activations only"
    if dense_kernel() is None:
        return "needs the C++ kernels, which did not build here"
    return None


def _blocks_for(
    name: str, parts: list[QuantizedWeight | None], dense: torch.Tensor
) -> QuantizedWeight | None:
    """One product's blocks, its checkpoint matrices' stacked, checked against its dense weight's
    shape; None where a matrix has no blocks or they differ in format (a GGUF may mix types)."""
    if any(part is None for part in parts) or len({part.format for part in parts}) > 1:
        return None
    blocks, fmt = _stack_rows([part.blocks for part in parts]), parts[0].format
    rows, columns = dense.shape
    if blocks.shape != (rows, columns // BLOCK * BLOCK_BYTES[fmt]) or columns % BLOCK:
        raise ConfigError(
            f"{name}'s blocks {tuple(blocks.shape)} do not hold a {rows} x {columns} weight in "
            f"{fmt.upper()} — {FETCH_HINT}"
        )
    return QuantizedWeight(blocks, fmt)


def model_fingerprint(model: Transformer) -> str:
    """A short id of the model's config and weights (a strided sample of every tensor): KV written
    by one model is meaningless to another, and a session file records whose it is."""
    digest = hashlib.sha256(json.dumps(model.config.to_hf_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 256)][:256].float().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}".encode() + sample.numpy().tobytes())
    return digest.hexdigest()[:16]
