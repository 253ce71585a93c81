// Paged attention for decode, on a CUDA GPU.
//
// Contract (shared with paged_attention_cpu.cpp, which states it in full, and with the torch
// reference minillm/attention/reference.py): the query (num_seqs, num_heads, head_dim); one layer
// of the KV pool as stored — k, v in the query's dtype (kv_format 0), int8 (1), int4 two per
// byte (2) or fp8 e4m3 bytes (3), with fp16 (scale, center) pairs k_scale (per channel of a
// block, or per token) and v_scale (per token), and the staged exact keys of blocks still
// filling (k_staged, staged_row); block_tables, context_lens. Returns {out, mass}: mass is
// (num_seqs, num_kv_heads, longest context) fp32, the attention each entry got summed over its
// KV head's query heads, when with_mass; else empty. head_dim 64 or 128.
//
// Work split: one thread block per (sequence, query head), 4 warps of 32 threads.
//   - Warp w walks positions w, w + 4, w + 8, ... of the sequence, each through the block table.
//   - Within a warp, lane i owns dimensions i, i + 32, ... of the head (2 for head_dim 64, 4 for
//     128): the 32 lanes read one K row as consecutive addresses, dequantize their numbers in
//     registers (x * scale + center), multiply by their q values, and sum the partial dot
//     products with shuffles.
//   - Each warp keeps an online softmax (running max m, running sum l, running weighted sum of
//     values acc), so K and V are read exactly once and no score array is needed.
//   - At the end the 4 warps merge their (m, l, acc) in shared memory, rescaling each by
//     exp(m_warp - m_max), and warp 0 writes the output.
//   - With mass, each position's raw score also goes to a scratch array; once m and l are final,
//     the block turns them into probabilities and adds them (atomically: the group's query heads
//     share a KV head) into mass.
//
// It launches on the default CUDA stream and includes only the ATen headers it uses (the tensor
// and the three ops it calls: ATen/ATen.h took a third longer to compile, torch/extension.h, which
// bindings.cpp needs, three times) and kv_rows_cuda.h (what it shares with flash_prefill.cu), so
// the file also compiles against a CPU-only torch (the test suite runs nvcc on it on machines
// without a GPU).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <vector>

#include "kv_rows_cuda.h"

namespace {

using namespace kv_rows_cuda;

constexpr int kNumWarps = 4;

template <typename scalar_t, int64_t FORMAT, int HEAD_DIM>
__global__ void paged_attention_decode_kernel(scalar_t* __restrict__ out, float* __restrict__ mass,
                                              float* __restrict__ raw_scores, int mass_width,
                                              const scalar_t* __restrict__ query, const Pool pool,
                                              const int32_t* __restrict__ block_tables,
                                              const int32_t* __restrict__ context_lens, int max_blocks, int num_heads,
                                              float scale) {
  constexpr int kDimsPerLane = HEAD_DIM / kWarpSize;
  const int seq = blockIdx.x, head = blockIdx.y, num_kv_heads = pool.num_kv_heads, bs = pool.block_size;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int context_len = context_lens[seq];
  const scalar_t* staged = static_cast<const scalar_t*>(pool.k_staged);
  float* scores_row = raw_scores ? raw_scores + (static_cast<int64_t>(seq) * num_heads + head) * mass_width : nullptr;

  float q[kDimsPerLane], acc[kDimsPerLane];
  const scalar_t* q_row = query + (static_cast<int64_t>(seq) * num_heads + head) * HEAD_DIM;
  for (int i = 0; i < kDimsPerLane; ++i) {
    q[i] = static_cast<float>(q_row[lane + i * kWarpSize]) * scale;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;

  for (int t = warp; t < context_len; t += kNumWarps) {
    const int64_t block = block_tables[static_cast<int64_t>(seq) * max_blocks + t / bs];
    const int64_t row = (block * bs + t % bs) * num_kv_heads + kv_head;
    const int staged_row = pool.staged_row ? pool.staged_row[block] : -1;

    float partial = 0.f;
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + i * kWarpSize;
      float k;
      if (staged_row >= 0) {  // a block still filling: its exact keys
        k = static_cast<float>(
            staged[((static_cast<int64_t>(staged_row) * bs + t % bs) * num_kv_heads + kv_head) * HEAD_DIM + d]);
      } else {
        k = load_number<scalar_t, FORMAT>(pool.k + row * pool.row_bytes, d);
        if (FORMAT != kModelDtype) {
          const at::Half* pair = pool.keys_per_channel
                                     ? pool.k_scale + ((block * num_kv_heads + kv_head) * HEAD_DIM + d) * 2
                                     : pool.k_scale + row * 2;
          k = k * static_cast<float>(pair[0]) + static_cast<float>(pair[1]);
        }
      }
      partial += q[i] * k;
    }
    const float score = warp_sum(partial);  // every lane now holds the full dot product
    if (scores_row && lane == 0) scores_row[t] = score;
    const float m_new = fmaxf(m, score);
    const float correction = __expf(m - m_new);  // 0 on the warp's first position (m = -inf)
    const float p = __expf(score - m_new);
    float v_scale = 1.f, v_center = 0.f;
    if (FORMAT != kModelDtype) {
      v_scale = static_cast<float>(pool.v_scale[row * 2]);
      v_center = static_cast<float>(pool.v_scale[row * 2 + 1]);
    }
    l = l * correction + p;
    for (int i = 0; i < kDimsPerLane; ++i) {
      const float v = load_number<scalar_t, FORMAT>(pool.v + row * pool.row_bytes, lane + i * kWarpSize);
      acc[i] = acc[i] * correction + p * (v * v_scale + v_center);
    }
    m = m_new;
  }

  __shared__ float warp_m[kNumWarps], warp_l[kNumWarps], final_m, final_l;
  __shared__ float warp_acc[kNumWarps][HEAD_DIM];
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
  for (int i = 0; i < kDimsPerLane; ++i) warp_acc[warp][lane + i * kWarpSize] = acc[i];
  __syncthreads();

  if (warp == 0) {
    float m_max = -INFINITY;
    for (int w = 0; w < kNumWarps; ++w) m_max = fmaxf(m_max, warp_m[w]);
    float l_total = 0.f;
    float weight[kNumWarps];
    for (int w = 0; w < kNumWarps; ++w) {
      weight[w] = warp_l[w] > 0.f ? __expf(warp_m[w] - m_max) : 0.f;  // a warp with no positions adds nothing
      l_total += warp_l[w] * weight[w];
    }
    scalar_t* out_row = out + (static_cast<int64_t>(seq) * num_heads + head) * HEAD_DIM;
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + i * kWarpSize;
      float value = 0.f;
      for (int w = 0; w < kNumWarps; ++w) value += warp_acc[w][d] * weight[w];
      out_row[d] = static_cast<scalar_t>(l_total > 0.f ? value / l_total : 0.f);
    }
    if (lane == 0) {
      final_m = m_max;
      final_l = l_total;
    }
  }
  if (mass) {  // this head's probabilities, added into its KV head's row
    __syncthreads();
    float* mass_row = mass + (static_cast<int64_t>(seq) * num_kv_heads + kv_head) * mass_width;
    for (int t = threadIdx.x; t < context_len; t += kNumWarps * kWarpSize)
      atomicAdd(&mass_row[t], __expf(scores_row[t] - final_m) / final_l);
  }
}

template <typename scalar_t, int64_t FORMAT>
void launch(at::Tensor& out, float* mass, float* raw_scores, int mass_width, const at::Tensor& query, const Pool& pool,
            const at::Tensor& block_tables, const at::Tensor& context_lens) {
  const int num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const dim3 grid(num_seqs, num_heads), threads(kNumWarps * kWarpSize);
  const float scale = 1.f / sqrtf(static_cast<float>(head_dim));
#define MINILLM_LAUNCH(HEAD_DIM)                                                                \
  paged_attention_decode_kernel<scalar_t, FORMAT, HEAD_DIM><<<grid, threads>>>(                 \
      out.data_ptr<scalar_t>(), mass, raw_scores, mass_width, query.data_ptr<scalar_t>(), pool, \
      block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), block_tables.size(1), num_heads, scale)
  if (head_dim == 64) {
    MINILLM_LAUNCH(64);
  } else {
    MINILLM_LAUNCH(128);
  }
#undef MINILLM_LAUNCH
  const cudaError_t status = cudaGetLastError();
  TORCH_CHECK(status == cudaSuccess, "paged_attention_decode launch failed: ", cudaGetErrorString(status));
}

}  // namespace

std::vector<at::Tensor> paged_attention_decode(at::Tensor query, at::Tensor k, at::Tensor v, at::Tensor k_scale,
                                               at::Tensor v_scale, at::Tensor k_staged, at::Tensor staged_row,
                                               at::Tensor block_tables, at::Tensor context_lens, int64_t block_size,
                                               int64_t kv_format, bool keys_per_channel, bool with_mass) {
  const Pool pool = pool_of(query, {block_tables, context_lens}, k, v, k_scale, v_scale, k_staged, staged_row,
                            block_size, kv_format, keys_per_channel);
  auto out = at::empty_like(query);
  const int64_t width = context_lens.numel() > 0 ? context_lens.max().item<int32_t>() : 0;
  const auto fp32 = query.options().dtype(at::kFloat);
  auto mass = with_mass ? at::zeros({query.size(0), k.size(1), width}, fp32) : at::empty({0}, fp32);
  auto raw_scores = with_mass ? at::empty({query.size(0), query.size(1), width}, fp32) : at::empty({0}, fp32);
  float* mass_ptr = with_mass ? mass.data_ptr<float>() : nullptr;
  float* scores_ptr = with_mass ? raw_scores.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_decode", [&] {
    switch (kv_format) {
      case kInt8:
        launch<scalar_t, kInt8>(out, mass_ptr, scores_ptr, width, query, pool, block_tables, context_lens);
        break;
      case kInt4:
        launch<scalar_t, kInt4>(out, mass_ptr, scores_ptr, width, query, pool, block_tables, context_lens);
        break;
      case kFp8:
        launch<scalar_t, kFp8>(out, mass_ptr, scores_ptr, width, query, pool, block_tables, context_lens);
        break;
      default:
        launch<scalar_t, kModelDtype>(out, mass_ptr, scores_ptr, width, query, pool, block_tables, context_lens);
    }
  });
  return {out, mass};
}
