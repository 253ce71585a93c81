// What both CPU attention kernels share: how the KV pool's layer is stored and read.
//
// One layer of the pool, as paged_attention_cpu.cpp (decode) and flash_prefill_cpu.cpp (prefill
// chunks) receive it from minillm/memory (`KVLayer`):
//   k, v         (num_slots, num_kv_heads, head_dim / P)   the numbers as stored: the query's dtype
//                (kv_format 0), int8 (1), int4 two per byte (2, P = 2) or fp8 e4m3 bytes (3)
//   k_scale      fp16 (scale, center) pairs: (num_blocks, kv_heads, head_dim, 2) when keys are
//                quantized per channel of a block, else (num_slots, kv_heads, 1, 2); empty for 0
//   v_scale      (num_slots, kv_heads, 1, 2) fp16: values are quantized per token
//   k_staged     (rows, block_size, kv_heads, head_dim) query's dtype: exact keys of blocks still filling
//   staged_row   (num_blocks,) int32: a block's row in k_staged, -1 once its keys are quantized
// A stored number x means x * scale + center. Slot of cache index t: block_table[t / bs] * bs + t % bs.
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace kv_rows {

enum Format : int64_t { kModelDtype = 0, kInt8 = 1, kInt4 = 2, kFp8 = 3 };

inline const float* fp8_table() {  // every e4m3 byte's value, computed once
  static const std::vector<float> table = [] {
    std::vector<float> values(256);
    for (int bits = 0; bits < 256; ++bits)
      values[bits] =
          static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
    return values;
  }();
  return table.data();
}

// head_dim stored numbers of one row -> floats, before their scale and center
template <typename scalar_t, int64_t FORMAT>
inline void load_row(const void* row, int64_t head_dim, float* __restrict out) {
  if constexpr (FORMAT == kModelDtype) {
    const scalar_t* x = static_cast<const scalar_t*>(row);
    for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<float>(x[d]);
  } else if constexpr (FORMAT == kInt8) {
    const int8_t* x = static_cast<const int8_t*>(row);
    for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<float>(x[d]);
  } else if constexpr (FORMAT == kInt4) {  // dimension 2i in the low nibble, 2i + 1 in the high one, + 8
    const uint8_t* x = static_cast<const uint8_t*>(row);
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      out[2 * i] = static_cast<float>(x[i] & 0x0F) - 8.f;
      out[2 * i + 1] = static_cast<float>(x[i] >> 4) - 8.f;
    }
  } else {
    const uint8_t* x = static_cast<const uint8_t*>(row);
    const float* table = fp8_table();
    for (int64_t d = 0; d < head_dim; ++d) out[d] = table[x[d]];
  }
}

// exp(x) for x <= 0 (a score minus the running maximum), written so the compiler vectorizes a loop
// of them: exp(x) = 2^k * 2^f with k = round(x * log2 e) and |f| <= 1/2, 2^f by a degree-6
// polynomial (relative error < 2e-7), 2^k by writing k into the float's exponent bits.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.44269504f;  // x * log2(e); below -87 the result is ~0
  const float k = std::nearbyint(t), f = t - k;
  float p = 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return p * two_k;
}

struct Pool {  // one layer of the KV pool, as the kernel reads it
  const void* k;
  const void* v;
  const at::Half* k_scale;  // nullptr for the model's dtype
  const at::Half* v_scale;
  const void* k_staged;
  const int32_t* staged_row;  // nullptr: no block is staged
  bool keys_per_channel;
  int64_t row_bytes;  // bytes of one stored row (head_dim numbers)
  int64_t num_kv_heads, head_dim, block_size;
};

// The pool's layer as a Pool, after checking what the kernels rely on (one line says what is wrong).
inline Pool pool_of(const at::Tensor& query, const std::vector<at::Tensor>& indices, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& k_scale, const at::Tensor& v_scale,
                    const at::Tensor& k_staged, const at::Tensor& staged_row, int64_t block_size, int64_t kv_format,
                    bool keys_per_channel) {
  for (const auto& t : {query, k, v, k_scale, v_scale, k_staged, staged_row})
    TORCH_CHECK(t.is_contiguous(), "the query and the pool's tensors must be contiguous");
  for (const auto& t : indices)
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kInt,
                "block tables, lengths and indices must be contiguous int32");
  TORCH_CHECK(staged_row.scalar_type() == at::kInt, "staged_row must be int32");
  TORCH_CHECK(kv_format >= kModelDtype && kv_format <= kFp8,
              "kv_format must be 0 (model dtype), 1 (int8), 2 (int4) or 3 (fp8)");
  TORCH_CHECK(query.size(1) % k.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t head_dim = query.size(2), per_byte = kv_format == kInt4 ? 2 : 1;
  TORCH_CHECK(k.size(2) * per_byte == head_dim, "the cache rows must hold head_dim numbers");
  if (kv_format == kModelDtype) {
    TORCH_CHECK(k.scalar_type() == query.scalar_type(), "a cache in the model's dtype must have the query's dtype");
  } else {
    TORCH_CHECK(k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf && k_scale.numel() > 0 &&
                    v_scale.numel() > 0,
                "a quantized cache needs fp16 k_scale and v_scale");
    TORCH_CHECK(!keys_per_channel || (staged_row.numel() > 0 && k_staged.scalar_type() == query.scalar_type()),
                "keys quantized per channel need staged_row and k_staged in the query's dtype");
  }
  return Pool{k.data_ptr(),
              v.data_ptr(),
              kv_format == kModelDtype ? nullptr : k_scale.data_ptr<at::Half>(),
              kv_format == kModelDtype ? nullptr : v_scale.data_ptr<at::Half>(),
              k_staged.numel() > 0 ? k_staged.data_ptr() : nullptr,
              kv_format != kModelDtype && keys_per_channel ? staged_row.data_ptr<int32_t>() : nullptr,
              keys_per_channel,
              k.size(2) * k.element_size(),
              k.size(1),
              head_dim,
              block_size};
}

// f(scalar_t{}) for the query's dtype: float, half or bfloat16 (the model's dtypes)
template <typename F>
inline void with_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(at::Half{});
      break;
    case at::kBFloat16:
      f(at::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, "the query must be float32, float16 or bfloat16");
  }
}

// f(std::integral_constant<int64_t, FORMAT>{}) for the runtime kv_format: each format its own compiled code
template <typename F>
inline void with_format(int64_t kv_format, F&& f) {
  switch (kv_format) {
    case kInt8:
      f(std::integral_constant<int64_t, kInt8>{});
      break;
    case kInt4:
      f(std::integral_constant<int64_t, kInt4>{});
      break;
    case kFp8:
      f(std::integral_constant<int64_t, kFp8>{});
      break;
    default:
      f(std::integral_constant<int64_t, kModelDtype>{});
  }
}

}  // namespace kv_rows
