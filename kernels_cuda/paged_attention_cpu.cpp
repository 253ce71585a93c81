// Paged attention for decode, on the CPU: the C++ twin of paged_attention.cu.
//
// Contract (shared with the CUDA kernel and checked against minillm/attention/reference.py):
//   query        (num_seqs, num_heads, head_dim)        float32 / float16 / bfloat16
//   key_cache    (num_slots, num_kv_heads, head_dim)    same dtype as query, or int8
//   value_cache  (num_slots, num_kv_heads, head_dim)    like key_cache
//   block_tables (num_seqs, max_blocks) int32           physical block of each logical block
//   context_lens (num_seqs,) int32                      tokens in each sequence's history
//   k_scales, v_scales (num_slots, num_kv_heads) float32, only for int8 caches (else empty)
//   returns      (num_seqs, num_heads, head_dim)        query's dtype; scores scaled by 1/sqrt(head_dim)
// Slot of position t: block_tables[s][t / block_size] * block_size + t % block_size.
//
// One task per (sequence, KV head), spread over threads with at::parallel_for: the task serves
// the whole GQA group of query heads that share this KV head, so each K and V row is read from
// memory once, not once per query head. It walks the sequence's history block by block through
// the block table and keeps an *online softmax* per query head: the running maximum m, the
// running sum l of exp(score - m) and the running weighted sum of values acc. Per block it
// computes the block's scores, and if the block raises the maximum it rescales l and acc by
// exp(m_old - m_new) once — one pass, no score array longer than a block.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t, typename cache_t>
void decode(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
            const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t block_size,
            const float* k_scales, const float* v_scales, torch::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  const scalar_t* q_all = query.data_ptr<scalar_t>();
  const cache_t* k_all = key_cache.data_ptr<cache_t>();
  const cache_t* v_all = value_cache.data_ptr<cache_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  scalar_t* out_all = out.data_ptr<scalar_t>();

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    // per query head g of the group: q[g], scores of the current block, m[g], l[g], acc[g]
    std::vector<float> q(group * head_dim), scores(group * block_size), acc(group * head_dim), k_row(head_dim);
    std::vector<float> m(group), l(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const scalar_t* q_rows = q_all + (seq * num_heads + kv_head * group) * head_dim;  // the group's heads
      for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(q_rows[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);

      const int64_t context_len = lens[seq];
      for (int64_t first = 0; first < context_len; first += block_size) {
        const int64_t block = tables[seq * max_blocks + first / block_size];
        const int64_t n = std::min(block_size, context_len - first);  // tokens in this block
        // 1. scores of this block's tokens for every query head of the group
        for (int64_t j = 0; j < n; ++j) {
          const int64_t row = (block * block_size + j) * num_kv_heads + kv_head;
          const cache_t* k = k_all + row * head_dim;
          const float k_scale = k_scales ? k_scales[row] : 1.f;
          for (int64_t d = 0; d < head_dim; ++d) k_row[d] = static_cast<float>(k[d]) * k_scale;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = &q[g * head_dim];
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k_row[d];
            scores[g * block_size + j] = dot;
          }
        }
        // 2. online softmax: rescale what we have if the maximum grew, then add the block's values
        for (int64_t g = 0; g < group; ++g) {
          float* s = &scores[g * block_size];
          float* a = &acc[g * head_dim];
          const float m_new = std::max(m[g], *std::max_element(s, s + n));
          const float correction = std::exp(m[g] - m_new);  // 0 on the first block (m = -inf)
          l[g] *= correction;
          for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
          for (int64_t j = 0; j < n; ++j) {
            const int64_t row = (block * block_size + j) * num_kv_heads + kv_head;
            const cache_t* v = v_all + row * head_dim;
            const float p = std::exp(s[j] - m_new) * (v_scales ? v_scales[row] : 1.f);
            l[g] += std::exp(s[j] - m_new);
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(v[d]);
          }
          m[g] = m_new;
        }
      }
      scalar_t* out_rows = out_all + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out_rows[g * head_dim + d] = static_cast<scalar_t>(l[g] > 0.f ? acc[g * head_dim + d] / l[g] : 0.f);
    }
  });
}

}  // namespace

torch::Tensor paged_attention_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     torch::Tensor k_scales, torch::Tensor v_scales) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "query and caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  auto out = torch::empty_like(query);
  const bool int8 = key_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(int8 || key_cache.scalar_type() == query.scalar_type(), "cache dtype must be query's dtype or int8");
  TORCH_CHECK(!int8 || (k_scales.numel() > 0 && v_scales.numel() > 0), "int8 caches need k_scales and v_scales");
  const float* ks = int8 ? k_scales.data_ptr<float>() : nullptr;
  const float* vs = int8 ? v_scales.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_decode", [&] {
    if (int8) {
      decode<scalar_t, int8_t>(query, key_cache, value_cache, block_tables, context_lens, block_size, ks, vs, out);
    } else {
      decode<scalar_t, scalar_t>(query, key_cache, value_cache, block_tables, context_lens, block_size, ks, vs, out);
    }
  });
  return out;
}
