// Paged attention for decode, on a CUDA GPU.
//
// Contract (shared with paged_attention_cpu.cpp and minillm/attention/reference.py):
//   query        (num_seqs, num_heads, head_dim)        float32 / float16 / bfloat16
//   key_cache    (num_slots, num_kv_heads, head_dim)    same dtype as query, or int8
//   value_cache  (num_slots, num_kv_heads, head_dim)    like key_cache
//   block_tables (num_seqs, max_blocks) int32           physical block of each logical block
//   context_lens (num_seqs,) int32                      tokens in each sequence's history
//   k_scales, v_scales (num_slots, num_kv_heads) float32, only for int8 caches (else empty)
//   returns      (num_seqs, num_heads, head_dim)        query's dtype; scores scaled by 1/sqrt(head_dim)
//
// Work split: one thread block per (sequence, query head), 4 warps of 32 threads.
//   - Warp w walks positions w, w + 4, w + 8, ... of the sequence, each through the block table.
//   - Within a warp, lane i owns dimensions i, i + 32, ... of the head (2 for head_dim 64, 4 for
//     128): the 32 lanes read one K row as consecutive addresses (one coalesced 128-byte load per
//     32 numbers), multiply by their q values, and sum the partial dot products with shuffles.
//   - Each warp keeps an online softmax (running max m, running sum l, running weighted sum of
//     values acc), so K and V are read exactly once and no score array is stored.
//   - At the end the 4 warps merge their (m, l, acc) in shared memory, rescaling each by
//     exp(m_warp - m_max), and warp 0 writes the output.
// Memory traffic: the K and V rows of the sequence's history for one KV head, read once per
// query head (the GQA group re-reads them, mostly from L2); everything else is registers.
//
// It launches on the default CUDA stream and includes only torch/extension.h, so the file also
// compiles against a CPU-only torch (the test suite runs nvcc on it on machines without a GPU).
#include <torch/extension.h>

namespace {

constexpr int kWarpSize = 32;
constexpr int kNumWarps = 4;

__device__ inline float warp_sum(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffff, value, offset);
  return value;
}

template <typename scalar_t, typename cache_t, int HEAD_DIM>
__global__ void paged_attention_decode_kernel(
    scalar_t* __restrict__ out, const scalar_t* __restrict__ query, const cache_t* __restrict__ key_cache,
    const cache_t* __restrict__ value_cache, const float* __restrict__ k_scales, const float* __restrict__ v_scales,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ context_lens, int max_blocks,
    int block_size, int num_heads, int num_kv_heads, float scale) {
  constexpr int kDimsPerLane = HEAD_DIM / kWarpSize;
  const int seq = blockIdx.x, head = blockIdx.y;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int context_len = context_lens[seq];

  float q[kDimsPerLane], acc[kDimsPerLane];
  const scalar_t* q_row = query + (static_cast<int64_t>(seq) * num_heads + head) * HEAD_DIM;
  for (int i = 0; i < kDimsPerLane; ++i) {
    q[i] = static_cast<float>(q_row[lane + i * kWarpSize]) * scale;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;

  for (int t = warp; t < context_len; t += kNumWarps) {
    const int64_t block = block_tables[static_cast<int64_t>(seq) * max_blocks + t / block_size];
    const int64_t row = (block * block_size + t % block_size) * num_kv_heads + kv_head;
    const float k_scale = k_scales ? k_scales[row] : 1.f, v_scale = v_scales ? v_scales[row] : 1.f;
    const cache_t* k = key_cache + row * HEAD_DIM;
    const cache_t* v = value_cache + row * HEAD_DIM;

    float partial = 0.f;
    for (int i = 0; i < kDimsPerLane; ++i) partial += q[i] * static_cast<float>(k[lane + i * kWarpSize]);
    const float score = warp_sum(partial) * k_scale;  // every lane now holds the full dot product
    const float m_new = fmaxf(m, score);
    const float correction = __expf(m - m_new);  // 0 on the warp's first position (m = -inf)
    const float p = __expf(score - m_new);
    l = l * correction + p;
    for (int i = 0; i < kDimsPerLane; ++i)
      acc[i] = acc[i] * correction + p * static_cast<float>(v[lane + i * kWarpSize]) * v_scale;
    m = m_new;
  }

  __shared__ float warp_m[kNumWarps], warp_l[kNumWarps];
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
  }
}

template <typename scalar_t, typename cache_t>
void launch(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const float* k_scales, const float* v_scales,
            const torch::Tensor& block_tables, const torch::Tensor& context_lens, int block_size) {
  const int num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const dim3 grid(num_seqs, num_heads), threads(kNumWarps * kWarpSize);
  const float scale = 1.f / sqrtf(static_cast<float>(head_dim));
#define MINILLM_LAUNCH(HEAD_DIM)                                                                          \
  paged_attention_decode_kernel<scalar_t, cache_t, HEAD_DIM><<<grid, threads>>>(                       \
      out.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(), key_cache.data_ptr<cache_t>(),              \
      value_cache.data_ptr<cache_t>(), k_scales, v_scales, block_tables.data_ptr<int32_t>(),            \
      context_lens.data_ptr<int32_t>(), block_tables.size(1), block_size, num_heads, key_cache.size(1), \
      scale)
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

torch::Tensor paged_attention_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     torch::Tensor k_scales, torch::Tensor v_scales) {
  TORCH_CHECK(query.is_cuda() && key_cache.is_cuda() && block_tables.is_cuda(), "all tensors must be on the GPU");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "query and caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128, "the CUDA kernel supports head_dim 64 and 128");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  const bool int8 = key_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(int8 || key_cache.scalar_type() == query.scalar_type(), "cache dtype must be query's dtype or int8");
  TORCH_CHECK(!int8 || (k_scales.numel() > 0 && v_scales.numel() > 0), "int8 caches need k_scales and v_scales");
  const float* ks = int8 ? k_scales.data_ptr<float>() : nullptr;
  const float* vs = int8 ? v_scales.data_ptr<float>() : nullptr;
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_decode", [&] {
    if (int8) {
      launch<scalar_t, int8_t>(out, query, key_cache, value_cache, ks, vs, block_tables, context_lens, block_size);
    } else {
      launch<scalar_t, scalar_t>(out, query, key_cache, value_cache, ks, vs, block_tables, context_lens, block_size);
    }
  });
  return out;
}
