"""The transformer of the Llama family, Qwen2 and Qwen3: RMSNorm, RoPE, grouped-query attention,
SwiGLU, tied or untied embeddings.

The model knows nothing about memory. Each attention layer projects q, k, v, rotates q and k by
their positions, and hands them to `ctx.attend(layer_idx, q, k, v)`. The context object owns the
KV cache — none at all (naive decoding), one contiguous tensor (cached decoding), or blocks of a
paged pool, quantized or not (the engine's `attention/paged.py`) — so new memory systems plug in
without touching this file.

Tokens are a flat list, not a (batch, time) grid: `forward(token_ids (N,), positions (N,), ctx)`.
A batch of ragged sequences is just their tokens laid end to end, and the context knows which
token belongs to which sequence. This is the layout continuous batching needs.

The three families are one model with a few switches of `ModelConfig` (`model_config.py`), each
read where it acts: `qkv_bias` and `o_bias` (Qwen2's q/k/v biases; Llama's and Qwen3's
attention_bias), `qk_norm` (Qwen3's RMSNorm of each q and k head) in `Attention`, and
`rope_scaling` (Llama 3.x's longer context) in `rope_tables`.

Two projections are fused for speed, as nano-vllm and gpt-fast do: q, k and v are one matmul
(`wqkv`), and the SwiGLU gate and up projections are another (`w_gate_up`). `weights.py`
concatenates the checkpoint's separate matrices (and q, k, v's biases) into them. Every matmul goes
through `Matmul` (`matmul.py`: torch's F.linear, or for decode-sized bf16 products on a CPU a
faster kernel); bf16 norms and RoPE on a CPU take one C++ call each (`kernels_cuda/dense_cpu.cpp`).
When the weights carry GGUF blocks (`--weights q4_1`, `quantized_weights.py`), a decode-sized batch
runs each layer as two C++ calls around its attention (`Block.forward_fused`), switches and all;
the torch layer stays the reference.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minillm.config import ModelConfig
from minillm.matmul import QUANT_MAX_ROWS, Linear, Matmul, bf16_kernel, dense_kernel
from minillm.model_config import Llama3RopeScaling


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (N, num_heads, head_dim); k, v: (N, num_kv_heads, head_dim) for this step's tokens.
        Stores k, v wherever this context keeps its cache, attends over each token's history,
        and returns (N, num_heads, head_dim)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 even for bf16 models: the mean of squares loses too much in bf16.
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one call instead of four, and gives HF's
        # bits; the weight multiplies after rounding back to the model's dtype, as in HF. bf16 on
        # a CPU does the same in one C++ call (`dense_cpu.cpp`): torch's version is seven small
        # operations, ~40 us a row at decode, a tenth of a bf16 step.
        kernel = bf16_kernel(self.weight)
        if kernel is not None and x.dim() == 2:
            return kernel.rms_norm(x.contiguous(), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_tables(config: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for every position: (max_len, head_dim) each.

    RoPE turns pair i of a head (dimension i with i + head_dim/2, the "rotate half" layout of HF
    Llama) by the angle position * theta^(-2i/head_dim): fast for early dims, slow for late ones.
    The sin table carries the rotation's sign (-sin for the first half), see `apply_rope`.
    """
    inv_freq = rope_frequencies(config)  # (head_dim/2,)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (max_len, head_dim/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)  # (max_len, head_dim)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    return cos, signed_sin


def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """Each pair's angle per position, theta^(-2i/head_dim): (head_dim/2,), as rope_scaling sets them."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float32) * 2 / config.head_dim))
    if config.rope_scaling is not None:  # Llama 3.x
        inv_freq = _llama3_frequencies(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """inv_freq (head_dim/2,) as Llama 3.x's rope_scaling "llama3" rewrites it (transformers'
    `_compute_llama3_parameters`, the same float32 operations): a pair that turns fewer than once
    in the pretraining context (wavelength > original / low_freq_factor) slows down `factor` times,
    so it still turns less than once in the longer context; a fast pair (wavelength < original /
    high_freq_factor) already saw every angle and stays; those between are blended linearly."""
    original = scaling.original_max_position_embeddings
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # (head_dim/2,) positions per full turn
    slowed = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * slowed / scaling.factor + smooth * slowed
    between = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(between, blended, slowed)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, head_dim); cos, signed_sin: (N, head_dim).
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with x1, x2 the two halves of each head.
    bf16 on a CPU: the same arithmetic, the same bits, in one C++ call (`dense_cpu.cpp`)."""
    kernel = bf16_kernel(x)
    if kernel is not None:
        return kernel.rope(x, cos, signed_sin)
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # (x2, x1)
    return x * cos[:, None, :] + swapped * signed_sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.kv_width = self.num_kv_heads * self.head_dim
        self.qk_width = self.num_heads * self.head_dim + self.kv_width
        # q, k and v add a bias in Qwen2 (as in Qwen-1 and GPT-2); Llama's attention_bias adds them
        # and the output's, a switch the released models leave off
        self.wqkv = Linear(config.hidden_size, self.qk_width + self.kv_width, bias=config.qkv_bias)
        self.wo = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)
        # Qwen3 dropped those biases and instead RMS-normalizes each q and k head (its own weights,
        # over head_dim) before RoPE: q.k then cannot grow with the activations, which keeps the
        # attention logits, and training, stable
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        n_tokens = x.shape[0]
        qk, v = self.wqkv(x).split([self.qk_width, self.kv_width], dim=-1)
        qk = qk.view(n_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = self._norm_heads(qk)
        qk = apply_rope(qk, cos, sin)  # q and k heads turn by the same angles: one RoPE call rotates both
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (N, num_heads | num_kv_heads, head_dim)
        v = v.view(n_tokens, self.num_kv_heads, self.head_dim)  # (N, num_kv_heads, head_dim)
        out = ctx.attend(self.layer_idx, q, k, v)  # (N, num_heads, head_dim)
        return self.wo(out.reshape(n_tokens, self.num_heads * self.head_dim))

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """qk (N, num_heads + num_kv_heads, head_dim): each q head through q_norm, each k head
        through k_norm, as rows of head_dim (the norm's bf16 kernel takes rows)."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return torch.cat([q, k], dim=1)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_gate_up = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.w_down = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # (N, intermediate) each
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)
        self.fused = False  # decode-sized batches in two C++ calls (load_model turns it on)

    def forward(self, x, cos, sin, ctx):
        if self.fused and x.shape[0] <= QUANT_MAX_ROWS:
            return self.forward_fused(x, cos, sin, ctx)
        x = x + self.attn(self.attn_norm(x), cos, sin, ctx)
        return x + self.mlp(self.mlp_norm(x))

    def fuse(self, on: bool) -> None:
        """Decode-sized batches through `forward_fused` (or not). The two C++ calls' weight
        arguments are gathered here once, not looked up on every call of every step."""
        self.fused = on
        if not on:
            return
        attn, mlp, eps = self.attn, self.mlp, self.attn_norm.eps
        q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
        # None where the family has no such weight (biases, q/k norms)
        self._weights_in = (self.attn_norm.weight, eps, *attn.wqkv.blocks(), attn.wqkv.bias, q_norm, k_norm)
        self._weights_out = (
            *attn.wo.blocks(),
            attn.wo.bias,
            self.mlp_norm.weight,
            eps,
            *mlp.w_gate_up.blocks(),
            *mlp.w_down.blocks(),
        )

    def forward_fused(self, x, cos, sin, ctx):
        """The same layer, its weights read as GGUF blocks, in two C++ calls around the attention
        (`kernels_cuda/decode_layer_cpu.cpp`): at decode, torch's twenty-odd small operations cost
        more in dispatch than in arithmetic."""
        kernel, attn = dense_kernel(), self.attn
        q, k, v = kernel.attention_in(
            x.contiguous(), *self._weights_in, cos, sin, attn.num_heads, attn.num_kv_heads
        )
        attended = ctx.attend(attn.layer_idx, q, k, v)  # (N, num_heads, head_dim)
        return kernel.layer_out(x, attended, *self._weights_out)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        self.tied_head = Matmul()  # the tied embedding read as the output projection
        self.init_rope()

    def init_rope(self):
        """(Re)compute the RoPE tables; called after weights are loaded onto their device."""
        device = self.embed.weight.device
        cos, sin = rope_tables(self.config, self.config.max_position_embeddings)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """token_ids, positions: (N,). Returns the final hidden states (N, hidden_size);
        `logits` turns the ones you need into scores, so prefill can skip all but the last."""
        dtype = self.embed.weight.dtype
        cos = self.rope_cos[positions].to(dtype)  # (N, head_dim)
        sin = self.rope_sin[positions].to(dtype)
        x = self.embed(token_ids)  # (N, hidden_size)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden_size) -> (N, vocab_size), in fp32 for sampling."""
        scores = self.tied_head(hidden, self.embed.weight) if self.lm_head is None else self.lm_head(hidden)
        return scores.float()

    def fuse_layers(self, on: bool) -> None:
        """Decode-sized batches through `Block.forward_fused` (every product must have GGUF blocks)."""
        for layer in self.layers:
            layer.fuse(on)

    def products(self) -> dict[str, Matmul]:
        """Each weight matrix's name (as in the state dict) -> the Matmul that multiplies by it."""
        products = (
            {"embed.weight": self.tied_head}
            if self.lm_head is None
            else {"lm_head.weight": self.lm_head.matmul}
        )
        for name, module in self.named_modules():
            if isinstance(module, Linear) and name != "lm_head":
                products[f"{name}.weight"] = module.matmul
        return products

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype
