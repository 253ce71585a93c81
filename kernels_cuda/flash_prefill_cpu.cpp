// Flash attention for prefill chunks over the paged KV pool, on the CPU.
//
// Contract (the torch reference is paged_prefill_attention in minillm/attention/reference.py):
//   query        (num_queries, num_heads, head_dim)  every prefill chunk of the step, end to end
//   k ... staged_row                                 one layer of the pool as stored (kv_rows_cpu.h)
//   block_tables (num_seqs, max_blocks) int32;  cu_seqlens (num_seqs + 1,) int32: the queries of
//                sequence s are rows cu_seqlens[s] .. cu_seqlens[s + 1] - 1
//   q_indices    (num_queries,) int32: each query's cache index; it sees the entries 0..q_index
//                (the causal mask in cache indices, so it holds after eviction too)
//   context_lens (num_seqs,) int32: entries of each sequence's cache, its chunk included
//   returns      {out (num_queries, num_heads, head_dim) in the query's dtype; mass (num_seqs,
//                kv_heads, longest context) fp32 when with_mass: the attention each entry got,
//                summed over the chunk's queries and its KV head's query heads, else empty}
//
// FlashAttention's algorithm (Dao et al., 2022), in the shape of a CPU: the score matrix is never
// materialized. A task takes one sequence, one KV head and a tile of up to 16 of its queries; with
// GQA the group's query heads ride along, so the tile has 16 x group rows that share every key and
// value read. It walks the history through the block table in tiles of 16 entries, only as far as
// its last query sees (the causal skip: a chunk's early queries never touch its late keys). Each
// key tile is read where it lies, dequantized into a small float tile in L1 (exact staged keys for
// blocks still filling) and transposed, so a row's 16 scores are one 16-wide vector of multiply-adds
// per dimension. Then the online softmax: per row the running maximum m, the running sum l of
// exp(score - m) and the running weighted sum of values acc, rescaled by exp(m_old - m_new) when
// a tile raises the maximum. Tasks are handed out dynamically: later queries see more history.
// With mass (H2O), a task takes all of a sequence's queries for its KV head (tiles in order, so no
// two tasks add into the same entries) and, once a tile's m and l are final, walks its keys a
// second time to add each entry's probability.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_rows_cpu.h"

namespace {

using namespace kv_rows;

constexpr int64_t kTile = 16;  // queries per task, and entries per key tile

struct Work {  // one task: a sequence's queries first..last-1 (its rows), for one KV head
  int64_t seq, kv_head, first, last;
};

// entry t's slot, through the sequence's block table
inline int64_t slot_of(const int32_t* table, int64_t t, int64_t bs) { return table[t / bs] * bs + t % bs; }

// The key of (slot, kv_head) as floats: the staged exact key while its block fills, else the stored
// numbers times their scale plus their center (per channel of the block, or per token).
template <typename scalar_t, int64_t FORMAT>
inline void key_row(const Pool& pool, int64_t slot, int64_t kv_head, float* __restrict out) {
  const int64_t row = slot * pool.num_kv_heads + kv_head, hd = pool.head_dim, block = slot / pool.block_size;
  const char* stored = static_cast<const char*>(pool.k) + row * pool.row_bytes;
  if constexpr (FORMAT == kModelDtype) {
    load_row<scalar_t, kModelDtype>(stored, hd, out);
  } else {
    const int32_t staged = pool.staged_row ? pool.staged_row[block] : -1;
    if (staged >= 0) {
      const int64_t staged_slot = staged * pool.block_size + slot % pool.block_size;
      load_row<scalar_t, kModelDtype>(
          static_cast<const scalar_t*>(pool.k_staged) + (staged_slot * pool.num_kv_heads + kv_head) * hd, hd, out);
      return;
    }
    load_row<scalar_t, FORMAT>(stored, hd, out);
    if (pool.keys_per_channel) {
      const at::Half* pairs = pool.k_scale + (block * pool.num_kv_heads + kv_head) * hd * 2;
      for (int64_t d = 0; d < hd; ++d)
        out[d] = out[d] * static_cast<float>(pairs[2 * d]) + static_cast<float>(pairs[2 * d + 1]);
    } else {
      const float scale = static_cast<float>(pool.k_scale[2 * row]),
                  center = static_cast<float>(pool.k_scale[2 * row + 1]);
      for (int64_t d = 0; d < hd; ++d) out[d] = out[d] * scale + center;
    }
  }
}

// The value of (slot, kv_head) as floats (values are quantized per token).
template <typename scalar_t, int64_t FORMAT>
inline void value_row(const Pool& pool, int64_t slot, int64_t kv_head, float* __restrict out) {
  const int64_t row = slot * pool.num_kv_heads + kv_head, hd = pool.head_dim;
  load_row<scalar_t, FORMAT>(static_cast<const char*>(pool.v) + row * pool.row_bytes, hd, out);
  if constexpr (FORMAT != kModelDtype) {
    const float scale = static_cast<float>(pool.v_scale[2 * row]),
                center = static_cast<float>(pool.v_scale[2 * row + 1]);
    for (int64_t d = 0; d < hd; ++d) out[d] = out[d] * scale + center;
  }
}

// One task's state: its query rows (token i of the tile, query head h of the group: row i * group + h)
template <int64_t HEAD_DIM>
struct Tile {
  int64_t rows, head_dim;
  std::vector<float> q, acc, m, l, scores, probs;  // q, acc (rows, head_dim); m, l (rows); scores, probs (rows, kTile)
  std::vector<float> keys_t, values;  // the key tile transposed (head_dim, kTile); values (kTile, head_dim)
  Tile(int64_t max_rows, int64_t hd)
      : rows(0),
        head_dim(HEAD_DIM ? HEAD_DIM : hd),
        q(max_rows * head_dim),
        acc(max_rows * head_dim),
        m(max_rows),
        l(max_rows),
        scores(max_rows * kTile),
        probs(max_rows * kTile),
        keys_t(head_dim * kTile),
        values(kTile * head_dim) {}

  // scores[r][j] = q[r] . key j for the tile's keys (the ones past n score 0 and are masked later).
  // Four rows at a time: each load of a transposed key row feeds four rows' 16-wide sums, which
  // stay in vector registers.
  void score() {
    const int64_t hd = HEAD_DIM ? HEAD_DIM : head_dim;
    const float* __restrict kt = keys_t.data();
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float* __restrict q0 = &q[r * hd];
      float s0[kTile] = {}, s1[kTile] = {}, s2[kTile] = {}, s3[kTile] = {};
      for (int64_t d = 0; d < hd; ++d) {
        const float a = q0[d], b = q0[hd + d], c = q0[2 * hd + d], e = q0[3 * hd + d];
        for (int64_t j = 0; j < kTile; ++j) {
          const float key = kt[d * kTile + j];
          s0[j] += a * key;
          s1[j] += b * key;
          s2[j] += c * key;
          s3[j] += e * key;
        }
      }
      std::copy(s0, s0 + kTile, &scores[r * kTile]);
      std::copy(s1, s1 + kTile, &scores[(r + 1) * kTile]);
      std::copy(s2, s2 + kTile, &scores[(r + 2) * kTile]);
      std::copy(s3, s3 + kTile, &scores[(r + 3) * kTile]);
    }
    for (; r < rows; ++r) {
      const float* __restrict qr = &q[r * hd];
      float s0[kTile] = {};
      for (int64_t d = 0; d < hd; ++d)
        for (int64_t j = 0; j < kTile; ++j) s0[j] += qr[d] * kt[d * kTile + j];
      std::copy(s0, s0 + kTile, &scores[r * kTile]);
    }
  }

  // acc[r] += sum_j p[r][j] * value j for the tile's n values (acc already rescaled). Four rows at a
  // time, their sums in registers (with HEAD_DIM known), so each value row loaded feeds four rows.
  void add_values(int64_t n) {
    const int64_t hd = HEAD_DIM ? HEAD_DIM : head_dim;
    const float* __restrict vals = values.data();
    int64_t r = 0;
    if constexpr (HEAD_DIM > 0) {
      for (; r + 4 <= rows; r += 4) {
        float sum[4][HEAD_DIM];
        for (int64_t i = 0; i < 4; ++i) std::copy(&acc[(r + i) * hd], &acc[(r + i + 1) * hd], sum[i]);
        for (int64_t j = 0; j < n; ++j) {
          const float w[4] = {probs[r * kTile + j], probs[(r + 1) * kTile + j], probs[(r + 2) * kTile + j],
                              probs[(r + 3) * kTile + j]};
          for (int64_t d = 0; d < HEAD_DIM; ++d) {
            const float value = vals[j * HEAD_DIM + d];
            for (int64_t i = 0; i < 4; ++i) sum[i][d] += w[i] * value;
          }
        }
        for (int64_t i = 0; i < 4; ++i) std::copy(sum[i], sum[i] + hd, &acc[(r + i) * hd]);
      }
    }
    for (; r < rows; ++r) {
      float* __restrict a0 = &acc[r * hd];
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < hd; ++d) a0[d] += probs[r * kTile + j] * vals[j * hd + d];
    }
  }
};

template <typename scalar_t, int64_t FORMAT, int64_t HEAD_DIM>
void prefill(const at::Tensor& query, const Pool& pool, const at::Tensor& block_tables, const at::Tensor& q_indices,
             const std::vector<Work>& work, at::Tensor& out, float* mass, int64_t mass_width) {
  const int64_t num_heads = query.size(1), hd = HEAD_DIM ? HEAD_DIM : pool.head_dim;
  const int64_t group = num_heads / pool.num_kv_heads, bs = pool.block_size, max_blocks = block_tables.size(1);
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const scalar_t* q_all = query.data_ptr<scalar_t>();
  scalar_t* out_all = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* indices = q_indices.data_ptr<int32_t>();
  const int64_t num_work = static_cast<int64_t>(work.size());
  const float neg_inf = -std::numeric_limits<float>::infinity();

#pragma omp parallel num_threads(at::get_num_threads())
  {
    Tile<HEAD_DIM> tile(kTile * group, hd);
    // the keys (and values) of entries first..first+n-1 into the tile, read through the table
    auto load_keys = [&](const int32_t* table, int64_t kv_head, int64_t first, int64_t n) {
      float row[HEAD_DIM ? HEAD_DIM : 512];
      for (int64_t j = 0; j < kTile; ++j) {
        if (j < n) key_row<scalar_t, FORMAT>(pool, slot_of(table, first + j, bs), kv_head, row);
        for (int64_t d = 0; d < hd; ++d) tile.keys_t[d * kTile + j] = j < n ? row[d] : 0.f;
      }
    };
    // scores of the key tile, masked: row r (query i) sees entry first + j iff first + j <= its index
    auto masked_scores = [&](const int32_t* q_index, int64_t first, int64_t n) {
      tile.score();
      for (int64_t r = 0; r < tile.rows; ++r) {
        const int64_t visible = std::min<int64_t>(n, q_index[r / group] - first + 1);  // entries it may see
        for (int64_t j = std::max<int64_t>(visible, 0); j < kTile; ++j) tile.scores[r * kTile + j] = neg_inf;
      }
    };

#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < num_work; ++w) {
      const Work& task = work[w];
      const int32_t* table = tables + task.seq * max_blocks;
      for (int64_t tile_first = task.first; tile_first < task.last; tile_first += kTile) {  // query tiles, in order
        const int64_t tokens = std::min(kTile, task.last - tile_first);
        const int32_t* q_index = indices + tile_first;
        tile.rows = tokens * group;
        for (int64_t i = 0; i < tokens; ++i)
          for (int64_t h = 0; h < group; ++h) {
            const scalar_t* src = q_all + ((tile_first + i) * num_heads + task.kv_head * group + h) * hd;
            for (int64_t d = 0; d < hd; ++d) tile.q[(i * group + h) * hd + d] = static_cast<float>(src[d]) * scale;
          }
        std::fill(tile.acc.begin(), tile.acc.end(), 0.f);
        std::fill(tile.m.begin(), tile.m.end(), neg_inf);
        std::fill(tile.l.begin(), tile.l.end(), 0.f);
        const int64_t seen = q_index[tokens - 1] + 1;  // entries the tile's last query sees: the rest are skipped

        for (int64_t first = 0; first < seen; first += kTile) {
          const int64_t n = std::min(kTile, seen - first);
          load_keys(table, task.kv_head, first, n);
          for (int64_t j = 0; j < n; ++j)
            value_row<scalar_t, FORMAT>(pool, slot_of(table, first + j, bs), task.kv_head, &tile.values[j * hd]);
          masked_scores(q_index, first, n);
          for (int64_t r = 0; r < tile.rows; ++r) {  // the online softmax, row by row
            const float* s = &tile.scores[r * kTile];
            float* p = &tile.probs[r * kTile];
            const float m_new = std::max(tile.m[r], *std::max_element(s, s + n));
            if (m_new == neg_inf) {  // nothing visible yet
              std::fill(p, p + kTile, 0.f);
              continue;
            }
            const float correction = exp_nonpositive(tile.m[r] - m_new);  // 0 on the first visible tile
            float block_sum = 0.f;
            for (int64_t j = 0; j < kTile; ++j) {
              p[j] = j < n && s[j] != neg_inf ? exp_nonpositive(s[j] - m_new) : 0.f;
              block_sum += p[j];
            }
            tile.l[r] = tile.l[r] * correction + block_sum;
            tile.m[r] = m_new;
            for (int64_t d = 0; d < hd; ++d) tile.acc[r * hd + d] *= correction;
          }
          tile.add_values(n);
        }
        for (int64_t i = 0; i < tokens; ++i)
          for (int64_t h = 0; h < group; ++h) {
            const int64_t r = i * group + h;
            scalar_t* dst = out_all + ((tile_first + i) * num_heads + task.kv_head * group + h) * hd;
            for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<scalar_t>(tile.acc[r * hd + d] / tile.l[r]);
          }
        if (mass) {  // second walk: each entry's probability, now that m and l are final, summed over rows
          float* entries = mass + (task.seq * pool.num_kv_heads + task.kv_head) * mass_width;
          for (int64_t first = 0; first < seen; first += kTile) {
            const int64_t n = std::min(kTile, seen - first);
            load_keys(table, task.kv_head, first, n);
            masked_scores(q_index, first, n);
            for (int64_t r = 0; r < tile.rows; ++r)
              for (int64_t j = 0; j < n; ++j) {
                const float s = tile.scores[r * kTile + j];
                if (s != neg_inf) entries[first + j] += exp_nonpositive(s - tile.m[r]) / tile.l[r];
              }
          }
        }
      }
    }
  }
}

// The step's tasks, longest first: (sequence, KV head, tile of queries), or with mass (sequence, KV head)
std::vector<Work> plan(const at::Tensor& cu_seqlens, const at::Tensor& q_indices, int64_t num_kv_heads,
                       bool with_mass) {
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int32_t* indices = q_indices.data_ptr<int32_t>();
  std::vector<std::pair<int64_t, Work>> sized;  // (entries its last query sees, task)
  for (int64_t s = 0; s + 1 < cu_seqlens.numel(); ++s)
    for (int64_t first = cu[s]; first < cu[s + 1]; first += with_mass ? cu[s + 1] - cu[s] : kTile) {
      const int64_t last = with_mass ? cu[s + 1] : std::min<int64_t>(first + kTile, cu[s + 1]);
      for (int64_t g = 0; g < num_kv_heads; ++g) sized.push_back({indices[last - 1], Work{s, g, first, last}});
    }
  std::stable_sort(sized.begin(), sized.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<Work> work;
  for (const auto& item : sized) work.push_back(item.second);
  return work;
}

}  // namespace

std::vector<at::Tensor> paged_attention_prefill(at::Tensor query, at::Tensor k, at::Tensor v, at::Tensor k_scale,
                                                at::Tensor v_scale, at::Tensor k_staged, at::Tensor staged_row,
                                                at::Tensor block_tables, at::Tensor cu_seqlens, at::Tensor q_indices,
                                                at::Tensor context_lens, int64_t block_size, int64_t kv_format,
                                                bool keys_per_channel, bool with_mass) {
  const Pool pool = pool_of(query, {block_tables, cu_seqlens, q_indices, context_lens}, k, v, k_scale, v_scale,
                            k_staged, staged_row, block_size, kv_format, keys_per_channel);
  const int64_t head_dim = query.size(2), num_seqs = context_lens.numel();
  TORCH_CHECK(
      cu_seqlens.numel() == num_seqs + 1 && q_indices.numel() == query.size(0) && block_tables.size(0) == num_seqs,
      "cu_seqlens, q_indices and block_tables must match the queries");
  TORCH_CHECK(head_dim <= 512, "head_dim must be at most 512");
  auto out = at::empty_like(query);
  const int64_t width = num_seqs > 0 ? context_lens.max().item<int32_t>() : 0;
  auto mass = with_mass ? at::zeros({num_seqs, k.size(1), width}, query.options().dtype(at::kFloat))
                        : at::empty({0}, query.options().dtype(at::kFloat));
  float* mass_ptr = with_mass ? mass.data_ptr<float>() : nullptr;
  const std::vector<Work> work = plan(cu_seqlens, q_indices, pool.num_kv_heads, with_mass);
  with_dtype(query.scalar_type(), [&](auto dtype) {
    using scalar_t = decltype(dtype);
    auto run = [&](auto format) {
      constexpr int64_t FORMAT = decltype(format)::value;
      if (head_dim == 64)
        prefill<scalar_t, FORMAT, 64>(query, pool, block_tables, q_indices, work, out, mass_ptr, width);
      else if (head_dim == 128)
        prefill<scalar_t, FORMAT, 128>(query, pool, block_tables, q_indices, work, out, mass_ptr, width);
      else
        prefill<scalar_t, FORMAT, 0>(query, pool, block_tables, q_indices, work, out, mass_ptr, width);
    };
    with_format(kv_format, run);
  });
  return {out, mass};
}
