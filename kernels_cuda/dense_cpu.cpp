// Decode's matrix products on a CPU: out = x @ w.T for a few rows of bf16 activations.
//
// At decode a step multiplies one row per sequence by every weight matrix, so the product reads
// each weight once and does two FLOPs per weight read: the memory's read speed, not the vector
// units, sets its time (lesson 03). A general GEMM library lays its work out for the opposite
// case (many rows, the weight reused from cache) and reaches about half the read roof here; this
// kernel only streams the weight rows past the activation rows:
//
//   for each group of kGroup weight rows (the threads split the groups):
//     for each tile of up to 3 activation rows:   (the group stays in L1 after the first tile)
//       acc[i][j] += x[m+i, k:k+32] . w[n+j, k:k+32]   for k in steps of 32, j < kGroup
//       out[m+i, n+j] = bf16(sum of acc[i][j]'s lanes)
//
// while prefetching the next group's lines, so the loads of one group overlap the sums of the
// last. With AVX-512 BF16 one instruction (vdpbf16ps) multiplies 32 bf16 pairs into 16 fp32 sums;
// with AVX2 the bf16 numbers are widened to fp32 (a bf16 is the top half of an fp32) and fused-
// multiply-added, 8 at a time. Sums are fp32 and rounded to bf16 once, as torch's bf16 matmul
// does; only their order differs, so the results agree within bf16 rounding (tests/test_dense.py).
//
// `rms_norm` and `rope` are a layer's other dense operations, each in one call instead of torch's
// seven and five small ones (at decode each costs more in dispatch than in arithmetic); they take
// fp32 too, for the fused decode layer (decode_layer_cpu.cpp). `read_bytes`
// is the read roof the benchmarks put beside the products: the same threads summing a buffer.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

constexpr int64_t kGroup = 8;  // weight rows streamed together: 8 sums in flight per activation row

// group_rows<MR>: out[m0 .. m0+MR, n0 .. n0+kGroup), MR activation rows against one group of weight
// rows, each weight vector loaded once for all MR rows. Every sum is the same sequence of
// instructions whatever MR is, so a row's result does not depend on the rows beside it.
#if defined(__AVX512BF16__)
constexpr int64_t kStep = 32;    // bf16 numbers per instruction
constexpr int kMaxTileRows = 3;  // 3 x 8 sums + 3 activation vectors + 1 weight vector: 28 of 32 registers

template <int MR>
inline void group_rows(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* out, int64_t K, int64_t N,
                       int64_t m0, int64_t n0, bool prefetch_next) {
  __m512 acc[MR][kGroup];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kGroup; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kStep) {
    __m512bh xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * K + k);
    for (int j = 0; j < kGroup; ++j) {
      const at::BFloat16* w_row = w + (n0 + j) * K;
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w_row + k);
      if (prefetch_next) _mm_prefetch(reinterpret_cast<const char*>(w_row + kGroup * K + k), _MM_HINT_T0);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kGroup; ++j) out[(m0 + i) * N + n0 + j] = at::BFloat16(_mm512_reduce_add_ps(acc[i][j]));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kStep = 8;     // fp32 lanes per instruction
constexpr int kMaxTileRows = 1;  // 16 ymm registers: 8 sums per row already take half

inline __m256 widened(const at::BFloat16* p) {  // 8 bf16 -> 8 fp32: each becomes the top half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float lane_sum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}

template <int MR>  // one row at a time (kMaxTileRows is 1 here)
inline void group_rows(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* out, int64_t K, int64_t N,
                       int64_t m0, int64_t n0, bool prefetch_next) {
  for (int64_t m = m0; m < m0 + MR; ++m, prefetch_next = false) {
    __m256 acc[kGroup];
    for (int j = 0; j < kGroup; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += kStep) {
      const __m256 xv = widened(x + m * K + k);
      for (int j = 0; j < kGroup; ++j) {
        const at::BFloat16* w_row = w + (n0 + j) * K;
        acc[j] = _mm256_fmadd_ps(xv, widened(w_row + k), acc[j]);
        if (prefetch_next && k % 32 == 0)  // one prefetch per 64-byte line
          _mm_prefetch(reinterpret_cast<const char*>(w_row + kGroup * K + k), _MM_HINT_T0);
      }
    }
    for (int j = 0; j < kGroup; ++j) out[m * N + n0 + j] = at::BFloat16(lane_sum(acc[j]));
  }
}
#else
constexpr int64_t kStep = 1;
constexpr int kMaxTileRows = 1;

template <int MR>
inline void group_rows(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* out, int64_t K, int64_t N,
                       int64_t m0, int64_t n0, bool) {
  for (int64_t m = m0; m < m0 + MR; ++m)
    for (int j = 0; j < kGroup; ++j) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += static_cast<float>(x[m * K + k]) * static_cast<float>(w[(n0 + j) * K + k]);
      out[m * N + n0 + j] = at::BFloat16(sum);
    }
}
#endif

// Every activation row against one group: in tiles of as many rows as the registers hold, the
// first tile prefetching the next group.
inline void group(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* out, int64_t M, int64_t K, int64_t N,
                  int64_t n0, bool prefetch_next) {
  int64_t m = 0;
  if constexpr (kMaxTileRows >= 3)
    for (; M - m >= 3; m += 3, prefetch_next = false) group_rows<3>(x, w, out, K, N, m, n0, prefetch_next);
  if constexpr (kMaxTileRows >= 2)
    for (; M - m >= 2; m += 2, prefetch_next = false) group_rows<2>(x, w, out, K, N, m, n0, prefetch_next);
  for (; m < M; ++m, prefetch_next = false) group_rows<1>(x, w, out, K, N, m, n0, prefetch_next);
}

}  // namespace

// Whether `dense` takes a product of this shape: bf16, contiguous, K a whole number of vector
// steps and N of weight groups (every SmolLM2 and Llama projection is).
bool dense_fits(int64_t K, int64_t N) { return K % kStep == 0 && N % kGroup == 0; }

// x (M, K) bf16 @ w (N, K) bf16 -> (M, N) bf16.
at::Tensor dense(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "dense: bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dense: x (M, K) and w (N, K)");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "dense: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(dense_fits(K, N), "dense: K must be a multiple of ", kStep, " and N of ", kGroup);
  at::Tensor out = at::empty({M, N}, x.options());
  const at::BFloat16* x_data = x.data_ptr<at::BFloat16>();
  const at::BFloat16* w_data = w.data_ptr<at::BFloat16>();
  at::BFloat16* out_data = out.data_ptr<at::BFloat16>();
  const int64_t groups = N / kGroup;
  at::parallel_for(0, groups, 16, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) group(x_data, w_data, out_data, M, K, N, g * kGroup, g + 1 < last);
  });
  return out;
}

// RMSNorm of fp32 or bf16 rows, as model.py's torch version computes it: in fp32 each row times
// 1 / sqrt(mean of its squares + eps), rounded to the rows' dtype, then times the weight, rounded
// again (in fp32 the roundings do nothing, and the sum's order differs from torch's).
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* row = x + r * dim;
      float squares = 0.f;
      for (int64_t d = 0; d < dim; ++d) squares += static_cast<float>(row[d]) * static_cast<float>(row[d]);
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
      for (int64_t d = 0; d < dim; ++d) {
        const float normed = static_cast<float>(T(static_cast<float>(row[d]) * scale));
        out[r * dim + d] = T(normed * static_cast<float>(weight[d]));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && weight.scalar_type() == dtype,
              "rms_norm: fp32 or bf16 rows and weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: contiguous x (rows, dim) and weight (dim,)");
  at::Tensor out = at::empty_like(x);
  if (dtype == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), eps);
  else
    rms_norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                  x.size(0), x.size(1), eps);
  return out;
}

// RoPE of fp32 or bf16 heads, as model.py's `apply_rope` computes it with torch's operations (each
// rounds its result): out = T(T(x * cos) + T(rotate_half(x) * signed_sin)); in bf16 the same bits.
// x (N, heads, head_dim) with its heads side by side in each row (a row may be part of a wider one:
// the q and k columns of the fused projection); cos, signed_sin (N, head_dim).
template <typename T>
void rope_heads(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t head_dim,
                int64_t row_stride) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const T* head = x + t * row_stride + h * head_dim;
        T* result = out + (t * heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          const float turned = static_cast<float>(head[d]) * static_cast<float>(cos[t * head_dim + d]);
          const float swapped = static_cast<float>(head[(d + half) % head_dim]);
          const float moved = swapped * static_cast<float>(sin[t * head_dim + d]);
          result[d] = T(static_cast<float>(T(turned)) + static_cast<float>(T(moved)));
        }
      }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && cos.scalar_type() == dtype &&
                  signed_sin.scalar_type() == dtype,
              "rope: fp32 or bf16 heads and tables");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == head_dim, "rope: heads side by side in a row");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.size(0) == tokens && cos.size(1) == head_dim,
              "rope: cos and sin (N, head_dim)");
  at::Tensor out = at::empty({tokens, heads, head_dim}, x.options());
  if (dtype == at::kFloat)
    rope_heads(x.data_ptr<float>(), cos.data_ptr<float>(), signed_sin.data_ptr<float>(), out.data_ptr<float>(), tokens,
               heads, head_dim, x.stride(0));
  else
    rope_heads(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), signed_sin.data_ptr<at::BFloat16>(),
               out.data_ptr<at::BFloat16>(), tokens, heads, head_dim, x.stride(0));
  return out;
}

// Sums `t`'s bytes as 64-bit integers on every torch thread (the compiler vectorizes the loop);
// the benchmarks time it over a buffer larger than the caches: the fastest this machine reads.
int64_t read_bytes(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.nbytes() % 8 == 0, "read_bytes: a contiguous tensor of whole 8-byte words");
  const int64_t* words = static_cast<const int64_t*>(t.data_ptr());
  const int64_t n = t.nbytes() / 8;
  std::vector<int64_t> partial(at::get_num_threads(), 0);
  at::parallel_for(0, n, 1 << 16, [&](int64_t first, int64_t last) {
    int64_t sum = 0;
    for (int64_t i = first; i < last; ++i) sum += words[i];
    partial[at::get_thread_num()] += sum;
  });
  int64_t total = 0;
  for (int64_t s : partial) total += s;
  return total;
}
