// The kernels' Python bindings, for both builds of minillm/attention/kernels.py: with
// paged_attention_cpu.cpp (decode), flash_prefill_cpu.cpp (prefill), kv_write_cpu.cpp (the
// quantized pool's write) and dense_cpu.cpp (decode's matrix products; the CPU build defines
// MINILLM_CPU_BUILD for these two) for the CPU, and with
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
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);
int64_t read_bytes(const at::Tensor& t);
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode, "decode attention over the paged KV pool");
  m.def("paged_attention_prefill", &paged_attention_prefill,
        "flash attention for prefill chunks over the paged KV pool");
#ifdef MINILLM_CPU_BUILD
  m.def("quantize_write", &quantize_write, "one layer's new keys and values into a quantized KV pool");
  m.def("dense_fits", &dense_fits, "whether dense takes a (K inputs, N outputs) weight");
  m.def("dense", &dense, "x @ w.T for a few rows of bf16, streaming the weight (decode's products)");
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows times the weight, in one call");
  m.def("rope", &rope, "RoPE of bf16 heads, in one call");
  m.def("read_bytes", &read_bytes, "sum a tensor's bytes on every thread: the read roof's probe");
#endif
}
