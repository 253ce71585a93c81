// Quantize-and-write for the CPU: one layer's new keys and values into a quantized KV pool, in one
// call. It is `QuantizedKVPool`'s torch write (minillm/memory/quantized_pool.py) with the same
// numbers: the torch version costs some thirty small tensor operations per layer, and at decode a
// step writes one token per sequence in every layer, so those operations, not the bytes, were a
// fifth of an int8 decode step.
//
// A group of numbers that share a scale (quantization.py's chapter has why and which):
//   center = fp16((max + min) / 2),  scale = fp16(max((max - min) / 2 / qmax, fp16's tiny))
//   stored = clamp(round((x - center) / scale), -qmax, qmax)   int8 / int4 (round half to even)
//          = e4m3((x - center) / scale)                         fp8 (c10's conversion, as torch's)
// computed in fp32 from the model-dtype inputs, each step as the torch version rounds it, so the
// stored bytes are the same.
//
// Values are quantized per (token, head); keys per (token, head) too when `keys_per_channel` is
// false. Keys scaled per channel go to their block's staging row (the pool gives a block its row
// before the write), and a block whose last slot this write fills is quantized from its staging
// row, one scale per (head, channel) over its block_size tokens; the pool then gives the row back.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kv_rows_cpu.h"

namespace {

using kv_rows::kFp8;
using kv_rows::kInt4;
using kv_rows::kInt8;

constexpr float kHalfTiny = 6.103515625e-05f;  // torch.finfo(torch.float16).tiny: the smallest scale

float qmax_of(int64_t kv_format) { return kv_format == kInt8 ? 127.f : kv_format == kInt4 ? 7.f : 448.f; }

// The (scale, center) of numbers in [low, high], rounded to fp16 as they are stored.
void scale_and_center(float low, float high, float qmax, at::Half* out) {
  out[0] = at::Half(std::max((high - low) / 2.f / qmax, kHalfTiny));
  out[1] = at::Half((high + low) / 2.f);
}

// One stored number for x, given its group's stored (scale, center).
inline float scaled(float x, const at::Half* scale_center) {
  return (x - static_cast<float>(scale_center[1])) / static_cast<float>(scale_center[0]);
}

// The stored byte of one scaled number: int8 and fp8 a byte each, int4 a nibble as value + 8.
inline uint8_t stored_byte(float s, float qmax, int64_t kv_format) {
  if (kv_format == kFp8) return c10::Float8_e4m3fn(s).x;
  const float q = std::min(std::max(std::nearbyint(s), -qmax), qmax);
  return kv_format == kInt8 ? static_cast<uint8_t>(static_cast<int8_t>(q)) : static_cast<uint8_t>(q + 8.f);
}

// Put dimension d's byte into its stored row: int4 packs dimension 2i in the low nibble of byte
// i and 2i + 1 in the high one (the low one is written first).
inline void put(uint8_t* row, int64_t d, uint8_t byte, int64_t kv_format) {
  if (kv_format != kInt4) {
    row[d] = byte;
  } else if (d % 2 == 0) {
    row[d / 2] = byte;
  } else {
    row[d / 2] = static_cast<uint8_t>(row[d / 2] | (byte << 4));
  }
}

// head_dim numbers of one (token, head), quantized together: the stored row and its (scale, center).
void quantize_row(const float* x, int64_t head_dim, float qmax, int64_t kv_format, uint8_t* row,
                  at::Half* scale_center) {
  const auto [low, high] = std::minmax_element(x, x + head_dim);
  scale_and_center(*low, *high, qmax, scale_center);
  for (int64_t d = 0; d < head_dim; ++d)
    put(row, d, stored_byte(scaled(x[d], scale_center), qmax, kv_format), kv_format);
}

template <typename scalar_t>
void to_floats(const scalar_t* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

// Quantize a full block's staged keys (block_size, heads, head_dim) per (head, channel).
template <typename scalar_t>
void quantize_block(const scalar_t* staged, int64_t block, int64_t block_size, int64_t heads, int64_t head_dim,
                    float qmax, int64_t kv_format, uint8_t* k_data, int64_t row_bytes, at::Half* k_scale) {
  std::vector<float> keys(block_size * heads * head_dim);
  to_floats(staged, static_cast<int64_t>(keys.size()), keys.data());
  const int64_t token_stride = heads * head_dim;
  for (int64_t h = 0; h < heads; ++h) {
    uint8_t* block_rows = k_data + (block * block_size * heads + h) * row_bytes;  // token 0, head h
    for (int64_t c = 0; c < head_dim; ++c) {
      const float* channel = keys.data() + h * head_dim + c;  // token t at channel[t * token_stride]
      float low = channel[0], high = channel[0];
      for (int64_t t = 1; t < block_size; ++t) {
        low = std::min(low, channel[t * token_stride]);
        high = std::max(high, channel[t * token_stride]);
      }
      at::Half* scale_center = k_scale + ((block * heads + h) * head_dim + c) * 2;
      scale_and_center(low, high, qmax, scale_center);
      for (int64_t t = 0; t < block_size; ++t)
        put(block_rows + t * heads * row_bytes, c,
            stored_byte(scaled(channel[t * token_stride], scale_center), qmax, kv_format), kv_format);
    }
  }
}

template <typename scalar_t>
void write_layer(const at::Tensor& k_data, const at::Tensor& v_data, const at::Tensor& k_scale,
                 const at::Tensor& v_scale, const at::Tensor& k_staged, const at::Tensor& staged_row,
                 const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v, int64_t block_size,
                 int64_t kv_format, bool keys_per_channel) {
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2), row_bytes = v_data.size(2);
  const float qmax = qmax_of(kv_format);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const scalar_t* keys = k.data_ptr<scalar_t>();
  const scalar_t* values = v.data_ptr<scalar_t>();
  auto* v_out = reinterpret_cast<uint8_t*>(v_data.data_ptr());
  auto* k_out = reinterpret_cast<uint8_t*>(k_data.data_ptr());
  at::Half* v_scales = v_scale.data_ptr<at::Half>();
  at::Half* k_scales = k_scale.data_ptr<at::Half>();
  const int32_t* rows = keys_per_channel ? staged_row.data_ptr<int32_t>() : nullptr;
  scalar_t* staged = keys_per_channel ? k_staged.data_ptr<scalar_t>() : nullptr;
  const int64_t staged_row_size = block_size * heads * head_dim;

  at::parallel_for(0, tokens * heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / heads, h = task % heads, at_slot = slot[i] * heads + h;
      to_floats(values + task * head_dim, head_dim, x.data());
      quantize_row(x.data(), head_dim, qmax, kv_format, v_out + at_slot * row_bytes, v_scales + at_slot * 2);
      if (!keys_per_channel) {
        to_floats(keys + task * head_dim, head_dim, x.data());
        quantize_row(x.data(), head_dim, qmax, kv_format, k_out + at_slot * row_bytes, k_scales + at_slot * 2);
      } else {
        const int64_t block = slot[i] / block_size, offset = slot[i] % block_size;
        scalar_t* into = staged + rows[block] * staged_row_size + (offset * heads + h) * head_dim;
        std::copy(keys + task * head_dim, keys + (task + 1) * head_dim, into);
      }
    }
  });
  if (!keys_per_channel) return;
  std::vector<int64_t> filled;  // blocks whose last slot this write filled, after every key is staged
  for (int64_t i = 0; i < tokens; ++i)
    if (slot[i] % block_size == block_size - 1) filled.push_back(slot[i] / block_size);
  at::parallel_for(0, static_cast<int64_t>(filled.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t f = begin; f < end; ++f)
      quantize_block(staged + rows[filled[f]] * staged_row_size, filled[f], block_size, heads, head_dim, qmax,
                     kv_format, k_out, row_bytes, k_scales);
  });
}

}  // namespace

void quantize_write(at::Tensor k_data, at::Tensor v_data, at::Tensor k_scale, at::Tensor v_scale, at::Tensor k_staged,
                    at::Tensor staged_row, at::Tensor slots, at::Tensor k, at::Tensor v, int64_t block_size,
                    int64_t kv_format, bool keys_per_channel) {
  for (const auto& t : {k_data, v_data, k_scale, v_scale, k_staged, staged_row, slots, k, v})
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "quantize_write takes contiguous CPU tensors");
  TORCH_CHECK(kv_format == kInt8 || kv_format == kInt4 || kv_format == kFp8,
              "quantize_write writes int8 (1), int4 (2) or fp8 (3)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0), "slots must be int64, one per token");
  TORCH_CHECK(k.sizes() == v.sizes() && k.dim() == 3 && k.scalar_type() == v.scalar_type(),
              "k and v must be (tokens, kv_heads, head_dim) of one dtype");
  TORCH_CHECK(k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf, "scales are fp16");
  TORCH_CHECK(!keys_per_channel || (staged_row.scalar_type() == at::kInt && k_staged.scalar_type() == k.scalar_type()),
              "keys per channel need int32 staged_row and k_staged in the keys' dtype");
  if (keys_per_channel) {  // every written block has its staging row (the pool gave it one)
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int32_t* rows = staged_row.data_ptr<int32_t>();
    for (int64_t i = 0; i < slots.numel(); ++i)
      TORCH_CHECK(rows[slot[i] / block_size] >= 0, "quantize_write: block ", slot[i] / block_size,
                  " has no staging row");
  }
  kv_rows::with_dtype(k.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    write_layer<scalar_t>(k_data, v_data, k_scale, v_scale, k_staged, staged_row, slots, k, v, block_size, kv_format,
                          keys_per_channel);
  });
}
