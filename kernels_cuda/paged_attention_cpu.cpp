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
// One task per sequence, or per 128 tokens of a longer one (`kPartitionTokens`), spread over threads
// with at::parallel_for: a single long conversation is then attended by every thread, each task's
// partial softmax merged at the end (`merge`). A task walks its stretch block by block through the
// block table, asking for the next block before it works on this one (blocks lie scattered, so
// the hardware prefetcher cannot guess them). A block's slots hold every KV head's row side by
// side, so the task serves all heads from a block while it is in cache, and each KV head serves
// its whole GQA group of query heads: every K and V byte is read from memory once. (A task per
// (sequence, KV head) read each cache line once per head: int8 rows are 64 bytes, and the
// neighbouring heads' rows in the same lines were fetched and thrown away.)
// Per block it converts the block's stored keys to floats in a small tile (16 x head_dim: it
// stays in L1, nothing full-precision goes back to memory) and scores them, folding the scales
// and centres into the query and the scores instead of applying them number by number; it keeps
// an *online softmax* per query head: the running maximum m, the running sum l of exp(score - m)
// and the running weighted sum of values acc, rescaled by exp(m_old - m_new) when a block raises
// the maximum. Then it converts the block's values into the tile and adds them,
// their per-token scales folded into the softmax weights. One pass over the task's stretch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include "kv_rows_cpu.h"

#include <immintrin.h>

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
inline void dot_rows_plain(const float* __restrict q, const float* __restrict rows, float* __restrict scores, int64_t n,
                           int64_t head_dim) {
  const int64_t dim = HEAD_DIM ? HEAD_DIM : head_dim;
  for (int64_t j = 0; j < n; ++j) {
    float dot = 0.f;
    for (int64_t d = 0; d < dim; ++d) dot += q[d] * rows[j * dim + d];
    scores[j] = dot;
  }
}

#if defined(__AVX512F__)
// lane j of the result = the sum of v[j]'s 16 lanes: a tree of shuffles and adds (45 instructions for
// the 16 sums, where a horizontal sum of each vector takes ~8)
inline __m512 lane_sums(const __m512 v[16]) {
  __m512 pairs[8], quads[4];
  for (int k = 0; k < 8; ++k)  // per 128 bits: v[2k]'s and v[2k+1]'s sums of two, alternating
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128 bits: v[4k .. 4k+3]'s sums of that 128-bit stretch
    quads[k] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * k], pairs[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * k], pairs[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // the four 128-bit stretches of each quad added: 0x88 takes stretches 0 and 2 of each, 0xDD 1 and 3
  const __m512 halves01 =
      _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 halves23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves01, halves23, 0x88), _mm512_shuffle_f32x4(halves01, halves23, 0xDD));
}

// dot_rows_plain with AVX-512 and head_dim a multiple of 16: 16 rows at a time, each row's products
// kept as a vector and the 16 vectors summed lane-wise at once (`lane_sums`)
template <int64_t HEAD_DIM>
inline void dot_rows(const float* __restrict q, const float* __restrict rows, float* __restrict scores, int64_t n,
                     int64_t head_dim) {
  if constexpr (HEAD_DIM == 0 || HEAD_DIM % 16 != 0) {
    dot_rows_plain<HEAD_DIM>(q, rows, scores, n, head_dim);
  } else {
    __m512 qv[HEAD_DIM / 16];
    for (int64_t c = 0; c < HEAD_DIM / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t first = 0; first < n; first += 16) {
      const int64_t count = std::min<int64_t>(16, n - first);
      __m512 products[16];
      for (int64_t j = 0; j < 16; ++j) {
        products[j] = _mm512_setzero_ps();
        if (j < count)
          for (int64_t c = 0; c < HEAD_DIM / 16; ++c)
            products[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows + (first + j) * HEAD_DIM + 16 * c), products[j]);
      }
      _mm512_mask_storeu_ps(scores + first, static_cast<__mmask16>((1u << count) - 1), lane_sums(products));
    }
  }
}
#else
template <int64_t HEAD_DIM>
inline void dot_rows(const float* __restrict q, const float* __restrict rows, float* __restrict scores, int64_t n,
                     int64_t head_dim) {
  dot_rows_plain<HEAD_DIM>(q, rows, scores, n, head_dim);
}
#endif

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

// A stretch of one sequence's history, attended as one task: up to kPartitionTokens of it.
struct Task {
  int64_t seq, first, last;  // cache indices [first, last) of sequence seq
};

// One long sequence is split into partitions of this many tokens (whole blocks), so that two
// threads share a single conversation's attention (flash-decoding's split). The split depends only
// on the context length, never on the thread count or the batch: a row's result is the same
// whoever runs beside it. A history of one partition or less is one pass, as before the split.
// Measured (2026-12-07, 2-core AMD EPYC, one SmolLM2 conversation at 128-256 tokens, bf16): 128-token
// partitions took the step's attention from ~1.15 to ~0.9 ms against 512-token ones.
constexpr int64_t kPartitionTokens = 128;

std::vector<Task> tasks_of(const int32_t* lens, int64_t num_seqs, int64_t block_size) {
  const int64_t span = std::max<int64_t>(1, kPartitionTokens / block_size) * block_size;
  std::vector<Task> tasks;
  for (int64_t seq = 0; seq < num_seqs; ++seq)
    for (int64_t first = 0; first < lens[seq]; first += span)
      tasks.push_back({seq, first, std::min<int64_t>(first + span, lens[seq])});
  return tasks;
}

// What one task leaves for the merge, per query head h: the running maximum m[h], the sum l[h] of
// exp(score - m), and acc[h] (head_dim) and center_acc[h], the weighted sums of the values; all
// but m start at zero, as a vector's floats do.
struct Partials {
  std::vector<float> m, l, center_acc, acc;
  Partials(int64_t tasks, int64_t heads, int64_t head_dim)
      : m(tasks * heads), l(tasks * heads), center_acc(tasks * heads), acc(tasks * heads * head_dim) {}
};

// Each sequence's partitions into its output, in order: with M the largest of their maxima, a
// partition's sums count exp(m - M) times (flash-decoding's reduction). For a sequence of one
// partition the factor is exp(0) = 1: the one-pass result, bit for bit. Then, with H2O, each
// entry's probability under every query head of a KV head's group, summed.
template <typename scalar_t>
void merge(const std::vector<Task>& tasks, const Partials& parts, const int32_t* lens, int64_t num_seqs,
           int64_t num_heads, int64_t head_dim, int64_t group, int64_t num_kv_heads, scalar_t* out_all,
           const std::vector<float>& raw_scores, float* mass, int64_t mass_width) {
  // sequence seq's tasks are first_task[seq] .. first_task[seq + 1] (none for an empty history)
  std::vector<int64_t> first_task(num_seqs + 1, static_cast<int64_t>(tasks.size()));
  for (int64_t t = static_cast<int64_t>(tasks.size()) - 1; t >= 0; --t) first_task[tasks[t].seq] = t;
  for (int64_t seq = num_seqs - 1; seq >= 0; --seq) first_task[seq] = std::min(first_task[seq], first_task[seq + 1]);
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(head_dim);
    for (int64_t seq = begin; seq < end; ++seq) {
      for (int64_t h = 0; h < num_heads; ++h) {
        float top = -std::numeric_limits<float>::infinity(), l = 0.f, center = 0.f;
        for (int64_t t = first_task[seq]; t < first_task[seq + 1]; ++t) top = std::max(top, parts.m[t * num_heads + h]);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = first_task[seq]; t < first_task[seq + 1]; ++t) {
          const int64_t i = t * num_heads + h;
          const float weight = std::exp(parts.m[i] - top);
          l += parts.l[i] * weight;
          center += parts.center_acc[i] * weight;
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += parts.acc[i * head_dim + d] * weight;
        }
        scalar_t* out_row = out_all + (seq * num_heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d)
          out_row[d] = static_cast<scalar_t>(l > 0.f ? (acc[d] + center) / l : 0.f);
        if (mass) {
          const float* scores = &raw_scores[(seq * num_heads + h) * mass_width];
          float* row = mass + (seq * num_kv_heads + h / group) * mass_width;
          for (int64_t t = 0; t < lens[seq]; ++t) row[t] += exp_nonpositive(scores[t] - top) / l;
        }
      }
    }
  });
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
  const char* k_bytes = static_cast<const char*>(pool.k);
  const char* v_bytes = static_cast<const char*>(pool.v);
  const scalar_t* staged = static_cast<const scalar_t*>(pool.k_staged);
  const std::vector<Task> tasks = tasks_of(lens, num_seqs, bs);
  Partials parts(static_cast<int64_t>(tasks.size()), num_heads, head_dim);
  // with H2O, every query head's raw score of every entry: (num_seqs, num_heads, mass_width)
  std::vector<float> raw_scores(mass ? num_seqs * num_heads * mass_width : 0);

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    // per query head h: q[h] and sum(q[h]), the block's scores; tile: one KV head's keys or values of
    // a block; row_scale, row_center, weight: per token of the block
    std::vector<float> q(num_heads * head_dim), q_sum(num_heads), scores(num_heads * bs), tile(bs * head_dim);
    std::vector<float> channel_scale(head_dim), channel_center(head_dim), q_folded(head_dim);
    std::vector<float> row_scale(bs), row_center(bs), weight(bs);
    for (int64_t t = begin; t < end; ++t) {
      const auto [seq, task_first, task_last] = tasks[t];
      float* m = &parts.m[t * num_heads];
      float* l = &parts.l[t * num_heads];
      float* center_acc = &parts.center_acc[t * num_heads];
      float* acc = &parts.acc[t * num_heads * head_dim];
      const scalar_t* q_rows = q_all + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = static_cast<float>(q_rows[i]) * scale;
      for (int64_t h = 0; h < num_heads; ++h) q_sum[h] = std::accumulate(&q[h * head_dim], &q[(h + 1) * head_dim], 0.f);
      std::fill(m, m + num_heads, -std::numeric_limits<float>::infinity());
      float* seq_scores = mass ? &raw_scores[seq * num_heads * mass_width] : nullptr;
      const int64_t context_len = lens[seq];

      for (int64_t first = task_first; first < task_last; first += bs) {
        const int64_t block = tables[seq * max_blocks + first / bs];
        const int64_t n = std::min(bs, context_len - first);  // tokens in this block
        const int32_t staged_row = pool.staged_row ? pool.staged_row[block] : -1;
        if (first + bs < task_last) {  // the next block lies elsewhere in the pool: ask for it now
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
            if (mass) std::copy(sh, sh + n, &seq_scores[h * mass_width + first]);
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
    }
  });
  merge(tasks, parts, lens, num_seqs, num_heads, head_dim, group, num_kv_heads, out.data_ptr<scalar_t>(), raw_scores,
        mass, mass_width);
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
  // the longest context: the width of the mass H2O asks for
  int64_t width = 0;
  if (with_mass)
    for (int64_t seq = 0; seq < context_lens.numel(); ++seq)
      width = std::max<int64_t>(width, context_lens.data_ptr<int32_t>()[seq]);
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
