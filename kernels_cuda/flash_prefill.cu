// Flash attention for prefill chunks over the paged KV pool, on a CUDA GPU.
//
// Contract (flash_prefill_cpu.cpp, its C++ twin, states it in full; the torch reference is
// paged_prefill_attention in minillm/attention/reference.py): query (num_queries, num_heads,
// head_dim), every prefill chunk of the step end to end, sequence s owning rows cu_seqlens[s] ..
// cu_seqlens[s + 1] - 1; one layer of the KV pool as stored (kv_rows_cuda.h); block_tables;
// q_indices, each query's cache index (it sees the entries 0..q_index); context_lens. Returns
// {out, mass}: mass is (num_seqs, num_kv_heads, longest context) fp32 when with_mass, the attention
// each entry got summed over the chunk's queries and its KV head's query heads; else empty.
// head_dim 64 or 128; fp32, fp16 or bf16 queries.
//
// FlashAttention-2's work split (Dao, 2023), in plain fp32 (no tensor cores): the score matrix is
// never materialized.
//   - A thread block (4 warps of 32 threads) takes one KV head of one sequence and a tile of 32
//     query rows. With GQA a row is (query, query head of the group), so the group's heads share
//     every key and value the block reads. Each sequence's tiles are numbered from its last, which
//     sees the most history, so the longest tiles start first.
//   - The block walks the history through the block table in tiles of 32 entries, only as far as
//     its last query sees (the causal skip: a chunk's early queries never touch its late keys).
//     All 128 threads read a tile into shared memory (the keys, then the values in the same
//     buffer), dequantizing in registers on the way (x * scale + center; the staged exact key of
//     a block still filling). The rows are padded by one float, so lanes reading a column of the
//     tile hit 32 different banks.
//   - Warp w owns rows 8w .. 8w + 7, and lane j the tile's entry j: it computes its entry's
//     score against the warp's 8 queries (each read once from shared memory by all lanes), masked
//     where the entry lies past the row's q_index (the causal mask in cache indices).
//   - The online softmax, per row: the warp's max of the 32 scores updates the running maximum m,
//     the warp's sum of exp(score - m) the running sum l; the probabilities go to the warp's tile
//     in shared memory. Then lane i owns dimensions i, i + 32, ... of the running weighted sum of
//     values acc, rescaled by exp(m_old - m_new) when the maximum rises, and adds p . V.
//   - At the end out = acc / l, in the query's dtype.
//   - With mass, once m and l are final, the block walks the key tiles a second time: lane j
//     sums its entry's probability over the warp's rows and adds it into mass atomically (the
//     block's warps, and the sequence's other query tiles, share entries).
//
// Like paged_attention.cu it launches on the default stream and includes only the ATen headers it
// uses and kv_rows_cuda.h, so it compiles against a CPU-only torch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <type_traits>
#include <vector>

#include "kv_rows_cuda.h"

namespace {

using namespace kv_rows_cuda;

constexpr int kNumWarps = 4;
constexpr int kRowsPerWarp = 8;
constexpr int kRows = kNumWarps * kRowsPerWarp;  // query rows per block: (query, query head) pairs
constexpr int kEntries = kWarpSize;              // entries per key / value tile: one per lane

struct Ragged {                 // the step's queries, and where each sequence's history lies
  const int32_t* block_tables;  // (num_seqs, max_blocks)
  const int32_t* cu_seqlens;    // (num_seqs + 1,)
  const int32_t* q_indices;     // (num_queries,)
  int num_seqs, max_blocks, num_heads, group;
};

// tiles of kRows rows for one KV head of sequence seq: its queries times the group's query heads
__device__ inline int tiles_of(const Ragged& r, int seq) {
  return ((r.cu_seqlens[seq + 1] - r.cu_seqlens[seq]) * r.group + kRows - 1) / kRows;
}

// Entries first .. first + n - 1 of a sequence (its block table `table`), KV head kv_head, as
// floats into tile[j * (HEAD_DIM + 1) + d]: its keys (KEYS) or its values.
template <typename scalar_t, int64_t FORMAT, int HEAD_DIM, bool KEYS>
__device__ void load_tile(float* tile, const Pool& pool, const int32_t* table, int kv_head, int first, int n) {
  const int bs = pool.block_size;
  for (int e = threadIdx.x; e < n * HEAD_DIM; e += blockDim.x) {  // consecutive threads: one row's numbers
    const int j = e / HEAD_DIM, d = e % HEAD_DIM, t = first + j;
    const int64_t block = table[t / bs], row = (block * bs + t % bs) * pool.num_kv_heads + kv_head;
    const int staged = KEYS && pool.staged_row ? pool.staged_row[block] : -1;
    float x;
    if (staged >= 0) {  // a block still filling: its exact keys
      const int64_t staged_slot = static_cast<int64_t>(staged) * bs + t % bs;
      x = static_cast<float>(
          static_cast<const scalar_t*>(pool.k_staged)[(staged_slot * pool.num_kv_heads + kv_head) * HEAD_DIM + d]);
    } else {
      x = load_number<scalar_t, FORMAT>((KEYS ? pool.k : pool.v) + row * pool.row_bytes, d);
      if constexpr (FORMAT != kModelDtype) {  // keys per channel of their block, or per token; values per token
        const at::Half* pair = KEYS && pool.keys_per_channel
                                   ? pool.k_scale + ((block * pool.num_kv_heads + kv_head) * HEAD_DIM + d) * 2
                                   : (KEYS ? pool.k_scale : pool.v_scale) + row * 2;
        x = x * static_cast<float>(pair[0]) + static_cast<float>(pair[1]);
      }
    }
    tile[j * (HEAD_DIM + 1) + d] = x;
  }
}

// s[i]: the score of the lane's entry (first + lane) for the warp's row i (q pre-scaled), -inf
// where that row may not see it, or past the tile's n entries. Rows past the chunk have q_index -1.
template <int HEAD_DIM>
__device__ inline void score(float (&s)[kRowsPerWarp], const float* q_rows, const float* keys,
                             const int (&q_index)[kRowsPerWarp], int first, int n, int lane) {
  for (int i = 0; i < kRowsPerWarp; ++i) s[i] = 0.f;
  const float* key = keys + lane * (HEAD_DIM + 1);
  for (int d = 0; d < HEAD_DIM; ++d) {
    const float k = key[d];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) s[i] += q_rows[i * HEAD_DIM + d] * k;
  }
  for (int i = 0; i < kRowsPerWarp; ++i)
    if (lane >= n || first + lane > q_index[i]) s[i] = -INFINITY;
}

template <typename scalar_t, int64_t FORMAT, int HEAD_DIM>
__global__ void __launch_bounds__(kNumWarps* kWarpSize)
    flash_prefill_kernel(scalar_t* __restrict__ out, float* __restrict__ mass, int mass_width,
                         const scalar_t* __restrict__ query, const Pool pool, const Ragged ragged, float scale) {
  constexpr int kDimsPerLane = HEAD_DIM / kWarpSize;
  const int kv_head = blockIdx.y, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int group = ragged.group, num_heads = ragged.num_heads;

  int seq = 0, tile = blockIdx.x;  // this block: tile `tile` of sequence `seq`
  while (seq < ragged.num_seqs && tile >= tiles_of(ragged, seq)) tile -= tiles_of(ragged, seq++);
  if (seq == ragged.num_seqs) return;  // the grid counts an upper bound of the tiles
  const int first_query = ragged.cu_seqlens[seq], rows = (ragged.cu_seqlens[seq + 1] - first_query) * group;
  const int row0 = (tiles_of(ragged, seq) - 1 - tile) * kRows;  // counted from the sequence's last tile
  const int32_t* table = ragged.block_tables + static_cast<int64_t>(seq) * ragged.max_blocks;
  // row r of the sequence: query first_query + r / group, query head kv_head * group + r % group
  auto offset_of = [&](int r) {
    return (static_cast<int64_t>(first_query + r / group) * num_heads + kv_head * group + r % group) * HEAD_DIM;
  };

  __shared__ float q_tile[kRows * HEAD_DIM];            // the block's queries, times 1 / sqrt(head_dim)
  __shared__ float kv_tile[kEntries * (HEAD_DIM + 1)];  // a key tile, then a value tile
  __shared__ float p_tile[kRows * kEntries];            // each row's probabilities for the tile's entries
  for (int e = threadIdx.x; e < kRows * HEAD_DIM; e += blockDim.x) {
    const int r = row0 + e / HEAD_DIM;
    q_tile[e] = r < rows ? static_cast<float>(query[offset_of(r) + e % HEAD_DIM]) * scale : 0.f;
  }
  int q_index[kRowsPerWarp];  // the warp's rows' cache indices; -1 past the chunk
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kDimsPerLane], s[kRowsPerWarp];
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = row0 + warp * kRowsPerWarp + i;
    q_index[i] = r < rows ? ragged.q_indices[first_query + r / group] : -1;
    m[i] = -INFINITY;
    l[i] = 0.f;
    for (int c = 0; c < kDimsPerLane; ++c) acc[i][c] = 0.f;
  }
  const int last_row = min(row0 + kRows, rows) - 1;
  const int seen = ragged.q_indices[first_query + last_row / group] + 1;  // entries the tile's last query sees
  const float* q_rows = q_tile + warp * kRowsPerWarp * HEAD_DIM;
  float* p_rows = p_tile + warp * kRowsPerWarp * kEntries;

  for (int first = 0; first < seen; first += kEntries) {
    const int n = min(kEntries, seen - first);
    __syncthreads();  // every warp is done with the last tile's values
    load_tile<scalar_t, FORMAT, HEAD_DIM, true>(kv_tile, pool, table, kv_head, first, n);
    __syncthreads();
    score<HEAD_DIM>(s, q_rows, kv_tile, q_index, first, n, lane);
    for (int i = 0; i < kRowsPerWarp; ++i) {  // the online softmax, row by row (m_new is the warp's)
      const float m_new = fmaxf(m[i], warp_max(s[i]));
      float p = 0.f, correction = 1.f;
      if (m_new != -INFINITY) {           // else the row sees nothing (yet): a row past the chunk
        correction = expf(m[i] - m_new);  // 0 on the row's first tile (m = -inf)
        p = s[i] == -INFINITY ? 0.f : expf(s[i] - m_new);
        l[i] = l[i] * correction + warp_sum(p);
        m[i] = m_new;
      }
      p_rows[i * kEntries + lane] = p;
      for (int c = 0; c < kDimsPerLane; ++c) acc[i][c] *= correction;
    }
    __syncthreads();  // every warp is done with the keys (and its probabilities are in p_tile)
    load_tile<scalar_t, FORMAT, HEAD_DIM, false>(kv_tile, pool, table, kv_head, first, n);
    __syncthreads();
    for (int j = 0; j < n; ++j) {  // acc += p . V, for the lane's dimensions
      float v[kDimsPerLane];
      for (int c = 0; c < kDimsPerLane; ++c) v[c] = kv_tile[j * (HEAD_DIM + 1) + lane + c * kWarpSize];
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const float p = p_rows[i * kEntries + j];
        for (int c = 0; c < kDimsPerLane; ++c) acc[i][c] += p * v[c];
      }
    }
  }
  for (int i = 0; i < kRowsPerWarp; ++i) {
    if (q_index[i] < 0) continue;
    scalar_t* out_row = out + offset_of(row0 + warp * kRowsPerWarp + i);
    for (int c = 0; c < kDimsPerLane; ++c) out_row[lane + c * kWarpSize] = static_cast<scalar_t>(acc[i][c] / l[i]);
  }

  if (mass) {  // second walk: each entry's probability, now that m and l are final, summed over rows
    float* mass_row = mass + (static_cast<int64_t>(seq) * pool.num_kv_heads + kv_head) * mass_width;
    for (int first = 0; first < seen; first += kEntries) {
      const int n = min(kEntries, seen - first);
      __syncthreads();  // every warp is done with the last tile
      load_tile<scalar_t, FORMAT, HEAD_DIM, true>(kv_tile, pool, table, kv_head, first, n);
      __syncthreads();
      score<HEAD_DIM>(s, q_rows, kv_tile, q_index, first, n, lane);
      float sum = 0.f;
      for (int i = 0; i < kRowsPerWarp; ++i)
        if (s[i] != -INFINITY) sum += expf(s[i] - m[i]) / l[i];
      if (lane < n) atomicAdd(&mass_row[first + lane], sum);
    }
  }
}

template <typename scalar_t, int64_t FORMAT>
void launch(at::Tensor& out, float* mass, int mass_width, const at::Tensor& query, const Pool& pool,
            const Ragged& ragged) {
  const int num_queries = query.size(0), head_dim = query.size(2);
  // an upper bound of the tiles: sum over sequences of ceil(queries * group / kRows)
  const dim3 grid((num_queries * ragged.group + kRows - 1) / kRows + ragged.num_seqs, pool.num_kv_heads);
  const dim3 threads(kNumWarps * kWarpSize);
  const float scale = 1.f / sqrtf(static_cast<float>(head_dim));
  if (head_dim == 64) {
    flash_prefill_kernel<scalar_t, FORMAT, 64><<<grid, threads>>>(out.data_ptr<scalar_t>(), mass, mass_width,
                                                                  query.data_ptr<scalar_t>(), pool, ragged, scale);
  } else {
    flash_prefill_kernel<scalar_t, FORMAT, 128><<<grid, threads>>>(out.data_ptr<scalar_t>(), mass, mass_width,
                                                                   query.data_ptr<scalar_t>(), pool, ragged, scale);
  }
  const cudaError_t status = cudaGetLastError();
  TORCH_CHECK(status == cudaSuccess, "paged_attention_prefill launch failed: ", cudaGetErrorString(status));
}

}  // namespace

std::vector<at::Tensor> paged_attention_prefill(at::Tensor query, at::Tensor k, at::Tensor v, at::Tensor k_scale,
                                                at::Tensor v_scale, at::Tensor k_staged, at::Tensor staged_row,
                                                at::Tensor block_tables, at::Tensor cu_seqlens, at::Tensor q_indices,
                                                at::Tensor context_lens, int64_t block_size, int64_t kv_format,
                                                bool keys_per_channel, bool with_mass) {
  const Pool pool = pool_of(query, {block_tables, cu_seqlens, q_indices, context_lens}, k, v, k_scale, v_scale,
                            k_staged, staged_row, block_size, kv_format, keys_per_channel);
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "the query must be float32, float16 or bfloat16");
  const int64_t num_seqs = context_lens.numel();
  TORCH_CHECK(
      cu_seqlens.numel() == num_seqs + 1 && q_indices.numel() == query.size(0) && block_tables.size(0) == num_seqs,
      "cu_seqlens, q_indices and block_tables must match the queries");
  auto out = at::empty_like(query);
  const int64_t width = num_seqs > 0 ? context_lens.max().item<int32_t>() : 0;
  const auto fp32 = query.options().dtype(at::kFloat);
  auto mass = with_mass ? at::zeros({num_seqs, k.size(1), width}, fp32) : at::empty({0}, fp32);
  if (query.size(0) == 0) return {out, mass};  // no queries: nothing to launch
  const Ragged ragged{block_tables.data_ptr<int32_t>(),
                      cu_seqlens.data_ptr<int32_t>(),
                      q_indices.data_ptr<int32_t>(),
                      static_cast<int>(num_seqs),
                      static_cast<int>(block_tables.size(1)),
                      static_cast<int>(query.size(1)),
                      static_cast<int>(query.size(1) / k.size(1))};
  float* mass_ptr = with_mass ? mass.data_ptr<float>() : nullptr;
  auto by_format = [&](auto dtype_tag) {
    using scalar_t = decltype(dtype_tag);
    switch (kv_format) {
      case kInt8:
        launch<scalar_t, kInt8>(out, mass_ptr, width, query, pool, ragged);
        break;
      case kInt4:
        launch<scalar_t, kInt4>(out, mass_ptr, width, query, pool, ragged);
        break;
      case kFp8:
        launch<scalar_t, kFp8>(out, mass_ptr, width, query, pool, ragged);
        break;
      default:
        launch<scalar_t, kModelDtype>(out, mass_ptr, width, query, pool, ragged);
    }
  };
  if (dtype == at::kFloat)
    by_format(float{});
  else if (dtype == at::kHalf)
    by_format(at::Half{});
  else
    by_format(at::BFloat16{});
  return {out, mass};
}
