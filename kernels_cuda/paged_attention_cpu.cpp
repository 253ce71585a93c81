// Paged attention for decode, on the CPU: the C++ twin of paged_attention.cu.
//
// It reads the KV pool where it lies, in whatever format the pool stores (the contract below is
// the one minillm/attention/reference.py states in torch and both kernels are tested against):
//   query        (num_seqs, num_heads, head_dim)           float32 / float16 / bfloat16
//   k ... staged_row                                       one layer of the pool as stored (kv_rows_cpu.h)
//   block_tables (num_seqs, max_blocks) int32;  context_lens (num_seqs,) int32
//   returns      {out (num_seqs, num_heads, head_dim) in the query's dtype, scores scaled by
//                1/sqrt(head_dim); mass (num_seqs, kv_heads, longest context) fp32 when with_mass:
//                the attention each entry got, summed over its KV head's query heads (what H2O
//                accumulates), else empty}
//
// One task per sequence, spread over threads with at::parallel_for. It walks the history block by
// block through the block table, asking for the next block before it works on this one (blocks
// lie scattered, so the hardware prefetcher cannot guess them). A block's slots hold every KV
// head's row side by side, so the task serves all heads from a block while it is in cache, and
// each KV head serves its whole GQA group of query heads: every K and V byte is read from memory
// once. (A task per (sequence, KV head) read each cache line once per head: int8 rows are 64
// bytes, and the neighbouring heads' rows in the same lines were fetched and thrown away.)
// Per block it converts the block's stored keys to floats in a small tile (16 x head_dim:
// it stays in L1, nothing full-precision goes back to memory) and scores them, folding the
// scales and centres into the query and the scores instead of applying them number by number;
// it keeps an *online softmax* per query head: the running maximum m, the running sum l of
// exp(score - m) and the running weighted sum of values acc, rescaled by exp(m_old - m_new) when
// a block raises the maximum. Then it converts the block's values into the tile and adds them,
// their per-token scales folded into the softmax weights. One pass over the history.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include "kv_rows_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using namespace kv_rows;

// scores[j] = q . rows[j] for the n rows of a tile (restrict: nothing aliases, so q stays in registers)
template <int64_t HEAD_DIM>
inline void dot_rows(const float* __restrict q, const float* __restrict rows, float* __restrict scores, int64_t n,
                     int64_t head_dim) {
  const int64_t dim = HEAD_DIM ? HEAD_DIM : head_dim;
  for (int64_t j = 0; j < n; ++j) {
    float dot = 0.f;
    for (int64_t d = 0; d < dim; ++d) dot += q[d] * rows[j * dim + d];
    scores[j] = dot;
  }
}

// acc[d] = acc[d] * correction + sum_j p[j] * rows[j][d]; with HEAD_DIM known, acc lives in registers
template <int64_t HEAD_DIM>
inline void add_weighted_rows(float* __restrict acc, float correction, const float* __restrict p,
                              const float* __restrict rows, int64_t n, int64_t head_dim) {
  if constexpr (HEAD_DIM > 0) {
    float sum[HEAD_DIM];
    for (int64_t d = 0; d < HEAD_DIM; ++d) sum[d] = acc[d] * correction;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < HEAD_DIM; ++d) sum[d] += p[j] * rows[j * HEAD_DIM + d];
    for (int64_t d = 0; d < HEAD_DIM; ++d) acc[d] = sum[d];
  } else {
    for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += p[j] * rows[j * head_dim + d];
  }
}

template <typename scalar_t, int64_t FORMAT, int64_t HEAD_DIM>
void decode(const at::Tensor& query, const Pool& pool, const at::Tensor& block_tables, const at::Tensor& context_lens,
            at::Tensor& out, float* mass, int64_t mass_width) {
  // HEAD_DIM known at compile time (64, 128) lets the compiler unroll the row loops into a few vector
  // registers; 0 reads it from the pool (any other head_dim)
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = HEAD_DIM ? HEAD_DIM : pool.head_dim;
  const int64_t num_kv_heads = pool.num_kv_heads, group = num_heads / num_kv_heads, bs = pool.block_size;
  const int64_t max_blocks = block_tables.size(1);
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  const scalar_t* q_all = query.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  scalar_t* out_all = out.data_ptr<scalar_t>();
  const char* k_bytes = static_cast<const char*>(pool.k);
  const char* v_bytes = static_cast<const char*>(pool.v);
  const scalar_t* staged = static_cast<const scalar_t*>(pool.k_staged);

  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    // per query head h: q[h] and sum(q[h]), the block's scores, m[h], l[h], acc[h] and center_acc[h];
    // tile: one KV head's keys or values of a block; row_scale, row_center, weight: per token of the block
    std::vector<float> q(num_heads * head_dim), q_sum(num_heads), scores(num_heads * bs), acc(num_heads * head_dim);
    std::vector<float> m(num_heads), l(num_heads), center_acc(num_heads), tile(bs * head_dim), raw_scores;
    std::vector<float> channel_scale(head_dim), channel_center(head_dim), q_folded(head_dim);
    std::vector<float> row_scale(bs), row_center(bs), weight(bs);
    for (int64_t seq = begin; seq < end; ++seq) {
      const scalar_t* q_rows = q_all + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = static_cast<float>(q_rows[i]) * scale;
      for (int64_t h = 0; h < num_heads; ++h) q_sum[h] = std::accumulate(&q[h * head_dim], &q[(h + 1) * head_dim], 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(center_acc.begin(), center_acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t context_len = lens[seq];
      if (mass) raw_scores.resize(num_heads * context_len);

      for (int64_t first = 0; first < context_len; first += bs) {
        const int64_t block = tables[seq * max_blocks + first / bs];
        const int64_t n = std::min(bs, context_len - first);  // tokens in this block
        const int32_t staged_row = pool.staged_row ? pool.staged_row[block] : -1;
        if (first + bs < context_len) {  // the next block lies elsewhere in the pool: ask for it now
          const int64_t next = tables[seq * max_blocks + first / bs + 1] * bs * num_kv_heads * pool.row_bytes;
          for (int64_t offset = 0; offset < bs * num_kv_heads * pool.row_bytes; offset += 64) {
            __builtin_prefetch(k_bytes + next + offset);
            __builtin_prefetch(v_bytes + next + offset);
          }
        }
        for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
          const int64_t row0 = block * bs * num_kv_heads + kv_head;  // (slot, kv_head) row of the block's first token
          // 1. the block's keys into the tile: exact ones if the block is still filling, else as stored
          //    (their scales and centres are folded into the scores below, not applied number by number)
          const bool exact = FORMAT == kModelDtype || staged_row >= 0;
          if (staged_row >= 0) {
            for (int64_t j = 0; j < n; ++j)
              load_row<scalar_t, kModelDtype>(staged + ((staged_row * bs + j) * num_kv_heads + kv_head) * head_dim,
                                              head_dim, &tile[j * head_dim]);
          } else {
            for (int64_t j = 0; j < n; ++j)
              load_row<scalar_t, FORMAT>(k_bytes + (row0 + j * num_kv_heads) * pool.row_bytes, head_dim,
                                         &tile[j * head_dim]);
          }
          if (!exact && pool.keys_per_channel) {  // one (scale, center) per channel of the block
            const at::Half* pairs = pool.k_scale + (block * num_kv_heads + kv_head) * head_dim * 2;
            for (int64_t d = 0; d < head_dim; ++d) {
              channel_scale[d] = static_cast<float>(pairs[2 * d]);
              channel_center[d] = static_cast<float>(pairs[2 * d + 1]);
            }
          } else if (!exact) {  // one (scale, center) per token
            for (int64_t j = 0; j < n; ++j) {
              const int64_t row = row0 + j * num_kv_heads;
              row_scale[j] = static_cast<float>(pool.k_scale[2 * row]);
              row_center[j] = static_cast<float>(pool.k_scale[2 * row + 1]);
            }
          }
          // 2. scores of this block's tokens for every query head of the group. With key = x * s + c:
          //    per channel, q . key = (q * s) . x + q . c; per token, q . key = s (q . x) + c sum(q)
          for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
            const float* qh = &q[h * head_dim];
            float* sh = &scores[h * bs];
            if (exact) {
              dot_rows<HEAD_DIM>(qh, tile.data(), sh, n, head_dim);
            } else if (pool.keys_per_channel) {
              float bias = 0.f;
              for (int64_t d = 0; d < head_dim; ++d) {
                q_folded[d] = qh[d] * channel_scale[d];
                bias += qh[d] * channel_center[d];
              }
              dot_rows<HEAD_DIM>(q_folded.data(), tile.data(), sh, n, head_dim);
              for (int64_t j = 0; j < n; ++j) sh[j] += bias;
            } else {
              dot_rows<HEAD_DIM>(qh, tile.data(), sh, n, head_dim);
              for (int64_t j = 0; j < n; ++j) sh[j] = sh[j] * row_scale[j] + row_center[j] * q_sum[h];
            }
            if (mass) std::copy(sh, sh + n, &raw_scores[h * context_len + first]);
          }
          // 3. the block's values into the tile, as stored; value = x * s + c per token, so
          //    sum_j p_j value_j = sum_j (p_j s_j) x_j + sum_j p_j c_j: the scale goes into the weight,
          //    the centre into one number per head (center_acc)
          for (int64_t j = 0; j < n; ++j) {
            const int64_t row = row0 + j * num_kv_heads;
            load_row<scalar_t, FORMAT>(v_bytes + row * pool.row_bytes, head_dim, &tile[j * head_dim]);
            row_scale[j] = FORMAT == kModelDtype ? 1.f : static_cast<float>(pool.v_scale[2 * row]);
            row_center[j] = FORMAT == kModelDtype ? 0.f : static_cast<float>(pool.v_scale[2 * row + 1]);
          }
          // 4. online softmax: rescale what we have if the maximum grew, then add the block's values
          for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
            float* sh = &scores[h * bs];
            const float m_new = std::max(m[h], *std::max_element(sh, sh + n));
            const float correction = std::exp(m[h] - m_new);  // 0 on the first block (m = -inf)
            float block_sum = 0.f, center_sum = 0.f;
            for (int64_t j = 0; j < n; ++j) {
              const float p = exp_nonpositive(sh[j] - m_new);  // the unnormalized probability
              block_sum += p;
              center_sum += p * row_center[j];
              weight[j] = p * row_scale[j];
            }
            l[h] = l[h] * correction + block_sum;
            center_acc[h] = center_acc[h] * correction + center_sum;
            add_weighted_rows<HEAD_DIM>(&acc[h * head_dim], correction, weight.data(), tile.data(), n, head_dim);
            m[h] = m_new;
          }
        }
      }
      scalar_t* out_rows = out_all + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
          out_rows[h * head_dim + d] =
              static_cast<scalar_t>(l[h] > 0.f ? (acc[h * head_dim + d] + center_acc[h]) / l[h] : 0.f);
      if (mass) {  // each entry's probability under every query head of a KV head's group, summed
        for (int64_t h = 0; h < num_heads; ++h) {
          float* row = mass + (seq * num_kv_heads + h / group) * mass_width;
          for (int64_t t = 0; t < context_len; ++t)
            row[t] += exp_nonpositive(raw_scores[h * context_len + t] - m[h]) / l[h];
        }
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> paged_attention_decode(at::Tensor query, at::Tensor k, at::Tensor v, at::Tensor k_scale,
                                               at::Tensor v_scale, at::Tensor k_staged, at::Tensor staged_row,
                                               at::Tensor block_tables, at::Tensor context_lens, int64_t block_size,
                                               int64_t kv_format, bool keys_per_channel, bool with_mass) {
  const Pool pool = pool_of(query, {block_tables, context_lens}, k, v, k_scale, v_scale, k_staged, staged_row,
                            block_size, kv_format, keys_per_channel);
  const int64_t head_dim = query.size(2);
  auto out = at::empty_like(query);
  const int64_t width = context_lens.numel() > 0 ? context_lens.max().item<int32_t>() : 0;
  auto mass = with_mass ? at::zeros({query.size(0), k.size(1), width}, query.options().dtype(at::kFloat))
                        : at::empty({0}, query.options().dtype(at::kFloat));
  float* mass_ptr = with_mass ? mass.data_ptr<float>() : nullptr;
  with_dtype(query.scalar_type(), [&](auto dtype) {
    using scalar_t = decltype(dtype);
    auto run = [&](auto format) {
      constexpr int64_t FORMAT = decltype(format)::value;
      if (head_dim == 64)
        decode<scalar_t, FORMAT, 64>(query, pool, block_tables, context_lens, out, mass_ptr, width);
      else if (head_dim == 128)
        decode<scalar_t, FORMAT, 128>(query, pool, block_tables, context_lens, out, mass_ptr, width);
      else
        decode<scalar_t, FORMAT, 0>(query, pool, block_tables, context_lens, out, mass_ptr, width);
    };
    with_format(kv_format, run);
  });
  return {out, mass};
}
