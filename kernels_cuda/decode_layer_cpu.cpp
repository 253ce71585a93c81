// A decoder layer's dense work for a few rows in two calls, around its attention.
//
// At decode a layer computes little (one row per sequence) but, written as torch operations,
// takes some twenty calls: norm, the fused q|k|v product, split, RoPE, the output product, the
// residual, norm, gate|up, split, SiLU, multiply, down, residual. Each costs microseconds of
// dispatch; thirty layers of them were a quarter of a bf16 step. Here they are two C++ calls:
//
//   attention_in(x)        -> q, k, v        RMSNorm, x @ wqkv.T (GGUF blocks) [+ q|k|v bias],
//                                            [RMSNorm of each q and k head], RoPE of q and k
//   (the attention context stores k, v in the KV pool and attends: model.py's ctx.attend)
//   layer_out(x, attended) -> the next x     x + (attended @ wo.T [+ bias]), RMSNorm, gate|up,
//                                            SiLU(gate) * up, down, + residual
//
// The bracketed steps are the families' switches (model.py's `Attention`): Qwen2's q/k/v biases,
// Llama's and Qwen3's attention_bias (q/k/v and output), Qwen3's per-head q/k norms. Each is an
// optional tensor, None where the model has no such weight.
//
// The attention stays outside so the model still knows nothing of the KV memory: every pool
// format and backend works unchanged. Each step rounds as the torch layer in model.py does (bf16:
// every operation's result rounded to bf16), using the same kernels (rms_norm, rope: dense_cpu.cpp;
// quant_dense: quant_dense_cpu.cpp), so the fused layer matches the unfused one within rounding.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include "kv_rows_cpu.h"

#include <cmath>
#include <optional>
#include <vector>

at::Tensor quant_dense(const at::Tensor& x, const at::Tensor& blocks, int64_t format);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);

namespace {

// sum[i] = T(residual[i] + sum[i]): torch's add in the rows' dtype (fp32 arithmetic, one rounding)
template <typename T>
void add_residual(const at::Tensor& residual, at::Tensor& sum) {
  const T* r = residual.data_ptr<T>();
  T* s = sum.data_ptr<T>();
  for (int64_t i = 0; i < sum.numel(); ++i) s[i] = T(static_cast<float>(r[i]) + static_cast<float>(s[i]));
}

// SiLU(g) = g / (1 + exp(-g)); for g < 0 written g exp(g) / (1 + exp(g)), so that exp's argument is
// never positive: no overflow, and kv_rows' exp, which the compiler vectorizes (a call of std::exp per
// number was ~10 us of a layer's ~100)
inline float silu(float g) {
  const float e = kv_rows::exp_nonpositive(-std::abs(g));
  return g >= 0.f ? g / (1.f + e) : g * e / (1.f + e);
}

// act (N, I) = T(T(silu(gate)) * up), gate and up the two halves of each row of gate_up (N, 2I),
// as model.py's F.silu(gate) * up rounds it
template <typename T>
at::Tensor silu_times_up(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor act = at::empty({rows, width}, gate_up.options());
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up.data_ptr<T>() + r * 2 * width;
    const T* up = gate + width;
    T* out = act.data_ptr<T>() + r * width;
    for (int64_t c = 0; c < width; ++c)
      out[c] = T(static_cast<float>(T(silu(static_cast<float>(gate[c])))) * static_cast<float>(up[c]));
  }
  return act;
}

// rows (N, W) += bias (W,), each sum rounded to the rows' dtype: torch's `product + bias` (matmul.Linear)
template <typename T>
void add_bias_rows(at::Tensor& rows, const at::Tensor& bias) {
  const int64_t width = rows.size(1);
  T* r = rows.data_ptr<T>();
  const T* b = bias.data_ptr<T>();
  for (int64_t i = 0; i < rows.numel(); ++i) r[i] = T(static_cast<float>(r[i]) + static_cast<float>(b[i % width]));
}

void add_bias(at::Tensor& rows, const std::optional<at::Tensor>& bias) {
  if (!bias) return;
  TORCH_CHECK(bias->scalar_type() == rows.scalar_type() && bias->is_contiguous() && bias->numel() == rows.size(1),
              "a bias in the rows' dtype, one number per output");
  if (rows.scalar_type() == at::kFloat)
    add_bias_rows<float>(rows, *bias);
  else
    add_bias_rows<at::BFloat16>(rows, *bias);
}

// heads (N, H, head_dim), a view into the q|k|v rows: each head RMS-normalized over head_dim, in
// place (Qwen3's q_norm and k_norm: model.py's Attention._norm_heads, with the same rms_norm kernel)
void norm_heads(const at::Tensor& heads, const std::optional<at::Tensor>& weight, double eps) {
  if (!weight) return;
  heads.copy_(rms_norm(heads.reshape({-1, heads.size(2)}), *weight, eps).view(heads.sizes()));
}

template <typename T>
at::Tensor layer_out_rows(const at::Tensor& x, const at::Tensor& attended, const at::Tensor& wo, int64_t wo_format,
                          const std::optional<at::Tensor>& wo_bias, const at::Tensor& norm_weight, double eps,
                          const at::Tensor& gate_up, int64_t gate_up_format, const at::Tensor& down,
                          int64_t down_format) {
  at::Tensor h = quant_dense(attended.reshape({x.size(0), -1}), wo, wo_format);  // (N, hidden)
  add_bias(h, wo_bias);
  add_residual<T>(x, h);
  at::Tensor act = silu_times_up<T>(quant_dense(rms_norm(h, norm_weight, eps), gate_up, gate_up_format));
  at::Tensor out = quant_dense(act, down, down_format);  // (N, hidden)
  add_residual<T>(h, out);
  return out;
}

}  // namespace

// x (N, hidden) -> q (N, heads, head_dim), k and v (N, kv_heads, head_dim): views of one buffer.
std::vector<at::Tensor> attention_in(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                     const at::Tensor& wqkv, int64_t wqkv_format,
                                     const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& q_norm,
                                     const std::optional<at::Tensor>& k_norm, const at::Tensor& cos,
                                     const at::Tensor& signed_sin, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "attention_in: contiguous x (rows, hidden)");
  const int64_t rows = x.size(0), heads = num_heads + 2 * num_kv_heads;
  at::Tensor qkv = quant_dense(rms_norm(x, norm_weight, eps), wqkv, wqkv_format);  // (N, heads * head_dim)
  TORCH_CHECK(qkv.size(1) % heads == 0, "attention_in: wqkv's outputs are not q, k and v heads");
  add_bias(qkv, qkv_bias);
  const at::Tensor by_head = qkv.view({rows, heads, qkv.size(1) / heads});
  norm_heads(by_head.narrow(1, 0, num_heads), q_norm, eps);
  norm_heads(by_head.narrow(1, num_heads, num_kv_heads), k_norm, eps);
  const at::Tensor qk = rope(by_head.narrow(1, 0, num_heads + num_kv_heads), cos, signed_sin);  // q and k turn alike
  return {qk.narrow(1, 0, num_heads), qk.narrow(1, num_heads, num_kv_heads),
          by_head.narrow(1, num_heads + num_kv_heads, num_kv_heads)};
}

// x (N, hidden) and the attention's output (N, heads, head_dim) -> the layer's output (N, hidden).
at::Tensor layer_out(const at::Tensor& x, const at::Tensor& attended, const at::Tensor& wo, int64_t wo_format,
                     const std::optional<at::Tensor>& wo_bias, const at::Tensor& norm_weight, double eps,
                     const at::Tensor& gate_up, int64_t gate_up_format, const at::Tensor& down, int64_t down_format) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && attended.scalar_type() == x.scalar_type(),
              "layer_out: contiguous x (rows, hidden) and the attention's output in its dtype");
  if (x.scalar_type() == at::kFloat)
    return layer_out_rows<float>(x, attended, wo, wo_format, wo_bias, norm_weight, eps, gate_up, gate_up_format, down,
                                 down_format);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "layer_out: fp32 or bf16 rows");
  return layer_out_rows<at::BFloat16>(x, attended, wo, wo_format, wo_bias, norm_weight, eps, gate_up, gate_up_format,
                                      down, down_format);
}
