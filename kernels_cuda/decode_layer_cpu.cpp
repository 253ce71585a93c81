// A decoder layer's dense work for a few rows in two calls, around its attention.
//
// At decode a layer computes little (one row per sequence) but, written as torch operations,
// takes some twenty calls: norm, the fused q|k|v product, split, RoPE, the output product, the
// residual, norm, gate|up, split, SiLU, multiply, down, residual. Each costs microseconds of
// dispatch; thirty layers of them were a quarter of a bf16 step. Here they are two C++ calls:
//
//   attention_in(x)        -> q, k, v        RMSNorm, x @ wqkv.T (GGUF blocks), RoPE of q and k
//   (the attention context stores k, v in the KV pool and attends: model.py's ctx.attend)
//   layer_out(x, attended) -> the next x     x + attended @ wo.T, RMSNorm, gate|up, SiLU(gate) * up,
//                                            down, + residual
//
// The attention stays outside so the model still knows nothing of the KV memory: every pool
// format and backend works unchanged. Each step rounds as the torch layer in model.py does (bf16:
// every operation's result rounded to bf16), using the same kernels (rms_norm, rope: dense_cpu.cpp;
// quant_dense: quant_dense_cpu.cpp), so the fused layer matches the unfused one within rounding.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cmath>
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

// act (N, I) = T(T(silu(gate)) * up), gate and up the two halves of each row of gate_up (N, 2I),
// as model.py's F.silu(gate) * up rounds it
template <typename T>
at::Tensor silu_times_up(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor act = at::empty({rows, width}, gate_up.options());
  const T* gu = gate_up.data_ptr<T>();
  T* out = act.data_ptr<T>();
  at::parallel_for(0, rows * width, 4096, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t r = i / width, c = i % width;
      const float gate = static_cast<float>(gu[r * 2 * width + c]), up = static_cast<float>(gu[r * 2 * width + width + c]);
      const float silu = static_cast<float>(T(gate / (1.f + std::exp(-gate))));
      out[i] = T(silu * up);
    }
  });
  return act;
}

template <typename T>
at::Tensor layer_out_rows(const at::Tensor& x, const at::Tensor& attended, const at::Tensor& wo, int64_t wo_format,
                          const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up, int64_t gate_up_format,
                          const at::Tensor& down, int64_t down_format) {
  at::Tensor h = quant_dense(attended.reshape({x.size(0), -1}), wo, wo_format);  // (N, hidden)
  add_residual<T>(x, h);
  at::Tensor act = silu_times_up<T>(quant_dense(rms_norm(h, norm_weight, eps), gate_up, gate_up_format));
  at::Tensor out = quant_dense(act, down, down_format);  // (N, hidden)
  add_residual<T>(h, out);
  return out;
}

}  // namespace

// x (N, hidden) -> q (N, heads, head_dim), k and v (N, kv_heads, head_dim): views of one buffer.
std::vector<at::Tensor> attention_in(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                     const at::Tensor& wqkv, int64_t wqkv_format, const at::Tensor& cos,
                                     const at::Tensor& signed_sin, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "attention_in: contiguous x (rows, hidden)");
  const int64_t rows = x.size(0), heads = num_heads + 2 * num_kv_heads;
  const at::Tensor qkv = quant_dense(rms_norm(x, norm_weight, eps), wqkv, wqkv_format);  // (N, heads * head_dim)
  TORCH_CHECK(qkv.size(1) % heads == 0, "attention_in: wqkv's outputs are not q, k and v heads");
  const at::Tensor by_head = qkv.view({rows, heads, qkv.size(1) / heads});
  const at::Tensor qk = rope(by_head.narrow(1, 0, num_heads + num_kv_heads), cos, signed_sin);  // q and k turn alike
  return {qk.narrow(1, 0, num_heads), qk.narrow(1, num_heads, num_kv_heads),
          by_head.narrow(1, num_heads + num_kv_heads, num_kv_heads)};
}

// x (N, hidden) and the attention's output (N, heads, head_dim) -> the layer's output (N, hidden).
at::Tensor layer_out(const at::Tensor& x, const at::Tensor& attended, const at::Tensor& wo, int64_t wo_format,
                     const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up, int64_t gate_up_format,
                     const at::Tensor& down, int64_t down_format) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && attended.scalar_type() == x.scalar_type(),
              "layer_out: contiguous x (rows, hidden) and the attention's output in its dtype");
  if (x.scalar_type() == at::kFloat)
    return layer_out_rows<float>(x, attended, wo, wo_format, norm_weight, eps, gate_up, gate_up_format, down,
                                 down_format);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "layer_out: fp32 or bf16 rows");
  return layer_out_rows<at::BFloat16>(x, attended, wo, wo_format, norm_weight, eps, gate_up, gate_up_format, down,
                                      down_format);
}
