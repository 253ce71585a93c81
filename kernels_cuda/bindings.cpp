// The kernels' Python bindings, for both builds of minillm/attention/kernels.py: with
// paged_attention_cpu.cpp (decode), flash_prefill_cpu.cpp (prefill), kv_write_cpu.cpp (the
// quantized pool's write), dense_cpu.cpp and quant_dense_cpu.cpp (decode's matrix products) and
// decode_layer_cpu.cpp (a layer in two calls) for the CPU (the CPU build defines MINILLM_CPU_BUILD
// for these four), and with
// paged_attention.cu and flash_prefill.cu for a CUDA GPU; each file its own translation unit, so
// they compile side by side.
#include <torch/extension.h>

#include <vector>

std::vector<torch::Tensor> paged_attention_decode(torch::Tensor query, torch::Tensor k, torch::Tensor v,
                                                  torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor k_staged,
                                                  torch::Tensor staged_row, torch::Tensor block_tables,
                                                  torch::Tensor context_lens, int64_t block_size, int64_t kv_format,
                                                  bool keys_per_channel, bool with_mass);

std::vector<torch::Tensor> paged_attention_prefill(torch::Tensor query, torch::Tensor k, torch::Tensor v,
                                                   torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor k_staged,
                                                   torch::Tensor staged_row, torch::Tensor block_tables,
                                                   torch::Tensor cu_seqlens, torch::Tensor q_indices,
                                                   torch::Tensor context_lens, int64_t block_size, int64_t kv_format,
                                                   bool keys_per_channel, bool with_mass);

#ifdef MINILLM_CPU_BUILD
void quantize_write(torch::Tensor k_data, torch::Tensor v_data, torch::Tensor k_scale, torch::Tensor v_scale,
                    torch::Tensor k_staged, torch::Tensor staged_row, torch::Tensor slots, torch::Tensor k,
                    torch::Tensor v, int64_t block_size, int64_t kv_format, bool keys_per_channel);
bool dense_fits(int64_t K, int64_t N);
at::Tensor dense(const at::Tensor& x, const at::Tensor& w);
at::Tensor quant_dense(const at::Tensor& x, const at::Tensor& blocks, int64_t format);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> attention_in(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                     const at::Tensor& wqkv, int64_t wqkv_format,
                                     const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& q_norm,
                                     const std::optional<at::Tensor>& k_norm, const at::Tensor& cos,
                                     const at::Tensor& signed_sin, int64_t num_heads, int64_t num_kv_heads);
at::Tensor layer_out(const at::Tensor& x, const at::Tensor& attended, const at::Tensor& wo, int64_t wo_format,
                     const std::optional<at::Tensor>& wo_bias, const at::Tensor& norm_weight, double eps,
                     const at::Tensor& gate_up, int64_t gate_up_format, const at::Tensor& down, int64_t down_format);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);
int64_t read_bytes(const at::Tensor& t);
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without Python's lock, as torch's own operations do: the server's HTTP thread
  // reads requests and writes tokens while a step computes, instead of waiting for it to end.
  const auto free = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention_decode", &paged_attention_decode, free, "decode attention over the paged KV pool");
  m.def("paged_attention_prefill", &paged_attention_prefill, free,
        "flash attention for prefill chunks over the paged KV pool");
#ifdef MINILLM_CPU_BUILD
  m.def("quantize_write", &quantize_write, free, "one layer's new keys and values into a quantized KV pool");
  m.def("dense_fits", &dense_fits, "whether dense takes a (K inputs, N outputs) weight");
  m.def("dense", &dense, free, "x @ w.T for a few rows of bf16, streaming the weight (decode's products)");
  m.def("quant_dense", &quant_dense, free, "x @ w.T for a few rows, w in GGUF blocks (Q4_1, Q8_0) read as stored");
  m.def("rms_norm", &rms_norm, free, "RMSNorm of fp32 or bf16 rows times the weight, in one call");
  m.def("rope", &rope, free, "RoPE of fp32 or bf16 heads, in one call");
  m.def("attention_in", &attention_in, free,
        "a decode layer's norm, q|k|v product (and bias, q/k norms) and RoPE, in one call");
  m.def("layer_out", &layer_out, free, "a decode layer's output product, residual and MLP, in one call");
  m.def("read_bytes", &read_bytes, "sum a tensor's bytes on every thread: the read roof's probe");
#endif
}
