// The kernels' Python bindings, for both builds of minillm/attention/kernels.py: with
// paged_attention_cpu.cpp (decode) and flash_prefill_cpu.cpp (prefill) for the CPU, and with
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode, "decode attention over the paged KV pool");
  m.def("paged_attention_prefill", &paged_attention_prefill, "flash attention for prefill chunks over the paged KV pool");
}
