// What both CUDA attention kernels share: how the KV pool's layer is read on the GPU, and the checks
// of what they rely on. The layer is stored as kv_rows_cpu.h describes (the query's dtype, int8,
// int4 two per byte or fp8 e4m3 bytes; fp16 (scale, center) pairs per channel of a block or per
// token; staged exact keys of blocks still filling): a stored number x means x * scale + center.
//
// It includes only ATen's tensor (the Python bindings are bindings.cpp's), so the kernels also
// compile against a CPU-only torch.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace kv_rows_cuda {

constexpr int kWarpSize = 32;
enum Format : int64_t { kModelDtype = 0, kInt8 = 1, kInt4 = 2, kFp8 = 3 };

__device__ inline float warp_sum(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffff, value, offset);
  return value;
}

__device__ inline float warp_max(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(0xffffffff, value, offset));
  return value;
}

__device__ inline float fp8_e4m3_to_float(uint8_t bits) {  // 1 sign, 4 exponent (bias 7), 3 mantissa bits
  const int exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
  float magnitude = exponent == 0 ? ldexpf(mantissa / 8.f, -6) : ldexpf(1.f + mantissa / 8.f, exponent - 7);
  if (exponent == 15 && mantissa == 7) magnitude = NAN;
  return bits >> 7 ? -magnitude : magnitude;
}

// number d of a stored row, before its scale and center
template <typename scalar_t, int64_t FORMAT>
__device__ inline float load_number(const char* row, int d) {
  if constexpr (FORMAT == kModelDtype) {
    return static_cast<float>(reinterpret_cast<const scalar_t*>(row)[d]);
  } else if constexpr (FORMAT == kInt8) {
    return static_cast<float>(reinterpret_cast<const int8_t*>(row)[d]);
  } else if constexpr (FORMAT == kInt4) {  // dimension 2i in the low nibble, 2i + 1 in the high one, + 8
    const uint8_t byte = reinterpret_cast<const uint8_t*>(row)[d / 2];
    return static_cast<float>(d % 2 ? byte >> 4 : byte & 0x0F) - 8.f;
  } else {
    return fp8_e4m3_to_float(reinterpret_cast<const uint8_t*>(row)[d]);
  }
}

struct Pool {  // one layer of the KV pool, as the kernels read it
  const char* k;
  const char* v;
  const at::Half* k_scale;  // nullptr for the model's dtype
  const at::Half* v_scale;
  const void* k_staged;
  const int32_t* staged_row;  // nullptr: no block is staged
  bool keys_per_channel;
  int64_t row_bytes;  // bytes of one stored row (head_dim numbers)
  int num_kv_heads, block_size;
};

// The pool's layer as a Pool, after checking what the kernels rely on (one line says what is wrong).
// `indices`: the block tables, lengths and query indices, all int32 on the GPU.
inline Pool pool_of(const at::Tensor& query, const std::vector<at::Tensor>& indices, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& k_scale, const at::Tensor& v_scale,
                    const at::Tensor& k_staged, const at::Tensor& staged_row, int64_t block_size, int64_t kv_format,
                    bool keys_per_channel) {
  TORCH_CHECK(query.is_cuda() && k.is_cuda() && v.is_cuda(), "all tensors must be on the GPU");
  for (const auto& t : {query, k, v, k_scale, v_scale, k_staged, staged_row})
    TORCH_CHECK(t.is_contiguous(), "the query and the pool's tensors must be contiguous");
  for (const auto& t : indices)
    TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == at::kInt,
                "block tables, lengths and indices must be contiguous int32 on the GPU");
  TORCH_CHECK(staged_row.scalar_type() == at::kInt, "staged_row must be int32");
  TORCH_CHECK(kv_format >= kModelDtype && kv_format <= kFp8,
              "kv_format must be 0 (model dtype), 1 (int8), 2 (int4) or 3 (fp8)");
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128, "the CUDA kernels support head_dim 64 and 128 (got ",
              query.size(2), "); use attention_backend='torch'");
  TORCH_CHECK(query.size(1) % k.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k.size(2) * (kv_format == kInt4 ? 2 : 1) == query.size(2), "the cache rows must hold head_dim numbers");
  if (kv_format == kModelDtype) {
    TORCH_CHECK(k.scalar_type() == query.scalar_type(), "a cache in the model's dtype must have the query's dtype");
  } else {
    TORCH_CHECK(k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf && k_scale.numel() > 0 &&
                    v_scale.numel() > 0,
                "a quantized cache needs fp16 k_scale and v_scale");
    TORCH_CHECK(!keys_per_channel || (staged_row.numel() > 0 && k_staged.scalar_type() == query.scalar_type()),
                "keys quantized per channel need staged_row and k_staged in the query's dtype");
  }
  return Pool{static_cast<const char*>(k.data_ptr()),
              static_cast<const char*>(v.data_ptr()),
              kv_format == kModelDtype ? nullptr : k_scale.data_ptr<at::Half>(),
              kv_format == kModelDtype ? nullptr : v_scale.data_ptr<at::Half>(),
              k_staged.numel() > 0 ? k_staged.data_ptr() : nullptr,
              kv_format != kModelDtype && keys_per_channel ? staged_row.data_ptr<int32_t>() : nullptr,
              keys_per_channel,
              k.size(2) * k.element_size(),
              static_cast<int>(k.size(1)),
              static_cast<int>(block_size)};
}

}  // namespace kv_rows_cuda
