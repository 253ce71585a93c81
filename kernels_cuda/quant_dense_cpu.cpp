// Decode's matrix products on weights kept as the GGUF file stores them: out = x @ w.T, with w
// read in llama.cpp's blocks of 32 weights and dequantized in registers.
//
// A Q4_1 block is 20 bytes: a scale d and a minimum m (fp16 each) and 32 four-bit numbers q, two a
// byte (byte i holds weight i in its low nibble and weight i + 16 in its high one); weight i is
// d * q_i + m. A Q4_0 block is 18 bytes: d (fp16) and the same 16 bytes of nibbles; weight i is
// d * (q_i - 8), which is Q4_1's d * q_i + m with m = -8d, so both share one unpacking. A Q8_0
// block is 34 bytes: d (fp16) and 32 int8 q; weight i is d * q_i. d * q_i is exact in fp32 (11 bits
// of d times 4 or 8 bits of q), and so is d * (q_i - 8), so one fused multiply-add rounds exactly
// as the `gguf` package's dequantization does: these products multiply by the very fp32 values of
// the checkpoint weights_fetch.py wrote, and differ from its F.linear only in the order of the sums.
//
// A step reads 0.56 bytes a weight in Q4_0, 0.625 in Q4_1 and 1.06 in Q8_0, against 2 in bf16 and
// 4 in fp32. At
// decode the reading would be the time (dense_cpu.cpp says why), so the same loop as dense_cpu.cpp's
// streams the blocks past the activation rows; but unpacking costs instructions (measured on a
// 2-core Xeon: ~10 GB/s of blocks on two threads, 6 on one, where bf16 streams ~16), so here the
// cores bind, and each block is dequantized as few times as the registers allow:
//
//   for each group of G weight rows (the threads split the groups):
//     for each tile of activation rows:          (the group's blocks stay in L1 after the first tile)
//       for each block b:  w = dequantize(block b of each weight row)   32 fp32 weights in registers
//                          acc[i][j] += x[m+i, 32b : 32b+32] * w[j]
//       out[m+i, n+j] = sum of acc[i][j]'s lanes
//
// The activations come in fp32 or bf16 and are summed in fp32; the result is in their dtype.
// With AVX-512 a block is two vectors of 16 and a tile holds up to 6 activation rows; with AVX2
// four vectors of 8 and one row; without either, plain C++ (the compiler vectorizes what it can).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;                              // weights a block
enum Format : int64_t { kQ4_1 = 0, kQ8_0 = 1, kQ4_0 = 2 };  // minillm/quantized_weights.py's FORMAT_CODES

constexpr int64_t block_bytes(int64_t format) { return format == kQ4_1 ? 20 : format == kQ4_0 ? 18 : 34; }

#if defined(__AVX512F__) && defined(__F16C__)
using Vec = __m512;
constexpr int kLanes = 16;

inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float lane_sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// 16 bytes of nibbles -> the block's 32 weights d * q + m
inline void dequantize_nibbles(const uint8_t* nibbles, Vec d, Vec m, Vec w[2]) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, nibble), high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
  w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), m);   // weights 0..15
  w[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), m);  // weights 16..31
}

inline void dequantize_q4_1(const uint8_t* block, Vec w[2]) {  // d and m converted in one instruction
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(block)));
  dequantize_nibbles(block + 4, _mm512_broadcastss_ps(dm), _mm512_broadcastss_ps(_mm_movehdup_ps(dm)), w);
}

inline void dequantize_q4_0(const uint8_t* block, Vec w[2]) {
  const float d = half(block);
  dequantize_nibbles(block + 2, _mm512_set1_ps(d), _mm512_set1_ps(-8.f * d), w);
}

inline void dequantize_q8_0(const uint8_t* block, Vec w[2]) {
  const Vec d = _mm512_set1_ps(half(block));
  for (int v = 0; v < 2; ++v) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * v));
    w[v] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using Vec = __m256;
constexpr int kLanes = 8;

inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float lane_sum(Vec v) {
  const __m128 half4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half4, _mm_movehl_ps(half4, half4));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}
inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// 16 bytes of nibbles -> the block's 32 weights d * q + m
inline void dequantize_nibbles(const uint8_t* nibbles, Vec d, Vec m, Vec w[4]) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i halves[2] = {_mm_and_si128(packed, nibble), _mm_and_si128(_mm_srli_epi16(packed, 4), nibble)};
  for (int h = 0; h < 2; ++h) {  // weights 16h .. 16h+7, then 16h+8 .. 16h+15
    w[2 * h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(halves[h])), m);
    w[2 * h + 1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(halves[h], 8))), m);
  }
}

inline void dequantize_q4_1(const uint8_t* block, Vec w[4]) {
  dequantize_nibbles(block + 4, _mm256_set1_ps(half(block)), _mm256_set1_ps(half(block + 2)), w);
}

inline void dequantize_q4_0(const uint8_t* block, Vec w[4]) {
  const float d = half(block);
  dequantize_nibbles(block + 2, _mm256_set1_ps(d), _mm256_set1_ps(-8.f * d), w);
}

inline void dequantize_q8_0(const uint8_t* block, Vec w[4]) {
  const Vec d = _mm256_set1_ps(half(block));
  for (int v = 0; v < 4; ++v) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * v));
    w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
  }
}
#else
using Vec = float;
constexpr int kLanes = 1;

inline Vec load(const float* p) { return *p; }
inline Vec zero() { return 0.f; }
inline Vec fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float lane_sum(Vec v) { return v; }
inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// 16 bytes of nibbles -> the block's 32 weights d * q + m
inline void dequantize_nibbles(const uint8_t* nibbles, float d, float m, Vec w[kBlock]) {
  for (int i = 0; i < 16; ++i) {
    w[i] = d * static_cast<float>(nibbles[i] & 0x0F) + m;
    w[i + 16] = d * static_cast<float>(nibbles[i] >> 4) + m;
  }
}

inline void dequantize_q4_1(const uint8_t* block, Vec w[kBlock]) {
  dequantize_nibbles(block + 4, half(block), half(block + 2), w);
}

inline void dequantize_q4_0(const uint8_t* block, Vec w[kBlock]) {
  const float d = half(block);
  dequantize_nibbles(block + 2, d, -8.f * d, w);
}

inline void dequantize_q8_0(const uint8_t* block, Vec w[kBlock]) {
  const float d = half(block);
  for (int i = 0; i < kBlock; ++i) w[i] = d * static_cast<float>(static_cast<int8_t>(block[2 + i]));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 activations against four-bit blocks, by the bf16 dot product (vdpbf16ps: 32 multiply-adds an
// instruction, where the fp32 path above takes a zero-extension, a conversion and a multiply-add per
// 16 weights). The 32 nibbles of a block become the bf16 numbers 0..15 by one table lookup (vpermw):
// exact, as is every product of one with a bf16 activation. The block's scale and minimum come
// out of the sum: sum_k x_k (d q_k + m) = d (sum_k x_k q_k) + m (sum_k x_k), with each activation
// row's sum per block computed once a call. The same weights and products as the fp32 path, summed
// in another order: bf16 results within their rounding, not bit for bit the fp32 path's.
constexpr bool kBf16Dot = true;

// lane i: the bf16 bits of the number i (0..15), what vpermw looks each nibble up in; lanes 16..31
// unused (a nibble never indexes them)
alignas(64) constexpr uint16_t kNibbleBf16[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                                  0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

// 16 bytes of nibbles -> the block's 32 numbers q as bf16, weight order (low nibbles, then high)
inline __m512bh nibbles_as_bf16(const uint8_t* nibbles, __m512i table) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles)));
  const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), high = _mm256_srli_epi16(bytes, 4);
  const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(q, table));
}

// a four-bit block's scale d and minimum m (Q4_0: m = -8d) and where its nibbles start
template <int64_t F>
inline const uint8_t* scale_and_minimum(const uint8_t* block, float& d, float& m) {
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(block)));
  d = _mm_cvtss_f32(dm);
  m = F == kQ4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(dm)) : -8.f * d;
  return block + (F == kQ4_1 ? 4 : 2);
}

// dot_rows<F, MR, G>: group_rows' twin for bf16 rows x (M, K) and four-bit blocks; sums[i][b]:
// row i's sum over block b
template <int64_t F, int MR, int64_t G>
inline void dot_rows(const at::BFloat16* x, const float* sums, const uint8_t* w, at::BFloat16* out, int64_t K,
                     int64_t N, int64_t m0, int64_t n0, bool prefetch_next) {
  const int64_t blocks = K / kBlock, row_bytes = blocks * block_bytes(F);
  const __m512i table = _mm512_load_si512(kNibbleBf16);
  __m512 acc[MR][G];
  float minimums[MR][G] = {};
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < G; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512bh xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + (m0 + i) * K + b * kBlock));
    for (int j = 0; j < G; ++j) {
      const uint8_t* block = w + (n0 + j) * row_bytes + b * block_bytes(F);
      if (prefetch_next) _mm_prefetch(reinterpret_cast<const char*>(block + G * row_bytes), _MM_HINT_T0);
      float d, m;
      const __m512bh q = nibbles_as_bf16(scale_and_minimum<F>(block, d, m), table);
      for (int i = 0; i < MR; ++i) {
        acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv[i], q), _mm512_set1_ps(d), acc[i][j]);
        minimums[i][j] += m * sums[(m0 + i) * blocks + b];
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < G; ++j)
      out[(m0 + i) * N + n0 + j] = at::BFloat16(_mm512_reduce_add_ps(acc[i][j]) + minimums[i][j]);
}
#else
constexpr bool kBf16Dot = false;
#endif

constexpr int kVecs = kBlock / kLanes;  // vectors a block fills

// group_rows<F, MR, G>: out[m0 .. m0+MR, n0 .. n0+G), MR activation rows against a group of G
// weight rows, each block dequantized once for all MR rows. Every sum is the same sequence of
// instructions whatever MR and G are, so a row's result does not depend on the rows beside it.
template <int64_t F, int MR, int64_t G, typename Out>
inline void group_rows(const float* x, const uint8_t* w, Out* out, int64_t K, int64_t N, int64_t m0, int64_t n0,
                       bool prefetch_next) {
  const int64_t row_bytes = K / kBlock * block_bytes(F);
  Vec acc[MR][G];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < G; ++j) acc[i][j] = zero();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    Vec xv[MR][kVecs];
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < kVecs; ++v) xv[i][v] = load(x + (m0 + i) * K + b * kBlock + v * kLanes);
    for (int j = 0; j < G; ++j) {
      const uint8_t* block = w + (n0 + j) * row_bytes + b * block_bytes(F);
      if (prefetch_next) _mm_prefetch(reinterpret_cast<const char*>(block + G * row_bytes), _MM_HINT_T0);
      Vec wv[kVecs];
      if constexpr (F == kQ4_0)
        dequantize_q4_0(block, wv);
      else if constexpr (F == kQ4_1)
        dequantize_q4_1(block, wv);
      else
        dequantize_q8_0(block, wv);
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < kVecs; ++v) acc[i][j] = fma(xv[i][v], wv[v], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < G; ++j) out[(m0 + i) * N + n0 + j] = Out(lane_sum(acc[i][j]));
}

// The activation rows as a product reads them: converted to fp32 (group_rows), or as given in bf16
// with each row's sum over each block (dot_rows, where the CPU has the bf16 dot product).
struct Rows {
  const float* fp32;
  const at::BFloat16* bf16;
  const float* block_sums;
};

template <int64_t F, bool Dot, int MR, int64_t G, typename Out>
inline void tile(const Rows& x, const uint8_t* w, Out* out, int64_t K, int64_t N, int64_t m0, int64_t n0,
                 bool prefetch_next) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (Dot) return dot_rows<F, MR, G>(x.bf16, x.block_sums, w, out, K, N, m0, n0, prefetch_next);
#endif
  if constexpr (!Dot) group_rows<F, MR, G, Out>(x.fp32, w, out, K, N, m0, n0, prefetch_next);
}

// Every activation row against one group of G weight rows, in passes of `Tile` rows (what is left
// over, one row at a time); the first pass prefetches the next group.
template <int64_t F, bool Dot, int64_t G, int Tile, typename Out>
void group(const Rows& x, const uint8_t* w, Out* out, int64_t M, int64_t K, int64_t N, int64_t n0, bool prefetch_next) {
  int64_t m = 0;
  for (; M - m >= Tile; m += Tile, prefetch_next = false)
    tile<F, Dot, Tile, G, Out>(x, w, out, K, N, m, n0, prefetch_next);
  for (; m < M; ++m, prefetch_next = false) tile<F, Dot, 1, G, Out>(x, w, out, K, N, m, n0, prefetch_next);
}

// All of out's columns: whole groups of G on the threads, then the last N % G weight rows one by one.
template <int64_t F, bool Dot, int64_t G, int Tile, typename Out>
void products(const Rows& x, const uint8_t* w, Out* out, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N / G, 16, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) group<F, Dot, G, Tile, Out>(x, w, out, M, K, N, g * G, g + 1 < last);
  });
  for (int64_t n = N - N % G; n < N; ++n) group<F, Dot, 1, Tile, Out>(x, w, out, M, K, N, n, false);
}

// Each block is dequantized once per pass over the rows, so up to 6 rows take one pass (speculation
// checks k + 1 = 5): the more rows, the fewer weight rows a group holds, to keep the sums, the
// activations and the block in registers (AVX-512: G x Tile sums + 2 x Tile activation vectors + 4
// <= 32). Measured (2-core Xeon, all of SmolLM2's products): 5 rows in one pass take 0.73x the time
// of a pass of 4 and one of 1.
template <int64_t F, bool Dot, typename Out>
void products_for_rows(const Rows& x, const uint8_t* w, Out* out, int64_t M, int64_t K, int64_t N) {
#if defined(__AVX512F__) && defined(__F16C__)
  switch (M) {
    case 1:
      return products<F, Dot, 8, 1, Out>(x, w, out, M, K, N);
    case 2:
      return products<F, Dot, 8, 2, Out>(x, w, out, M, K, N);
    case 3:
      return products<F, Dot, 4, 3, Out>(x, w, out, M, K, N);
    case 4:
      return products<F, Dot, 4, 4, Out>(x, w, out, M, K, N);
    case 5:
      return products<F, Dot, 2, 5, Out>(x, w, out, M, K, N);
    case 6:
      return products<F, Dot, 2, 6, Out>(x, w, out, M, K, N);
    default:
      return products<F, Dot, 4, 4, Out>(x, w, out, M, K, N);  // one weight row a group streams worse
  }
#else
  products<F, Dot, 4, 1, Out>(x, w, out, M, K, N);  // AVX2: 4 sums + 4 activation vectors + 4 of 16
#endif
}

// bf16 rows against four-bit blocks by the bf16 dot product: each row's sum over each block first
at::Tensor dot_products(const at::Tensor& x, const uint8_t* w, int64_t format, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock;
  const at::BFloat16* rows = x.data_ptr<at::BFloat16>();
  std::vector<float> sums(M * blocks, 0.f);
  for (int64_t i = 0; i < M * blocks; ++i)
    for (int64_t k = 0; k < kBlock; ++k) sums[i] += static_cast<float>(rows[i * kBlock + k]);
  at::Tensor out = at::empty({M, N}, x.options());
  const Rows activations{nullptr, rows, sums.data()};
  if (format == kQ4_1)
    products_for_rows<kQ4_1, true>(activations, w, out.data_ptr<at::BFloat16>(), M, K, N);
  else
    products_for_rows<kQ4_0, true>(activations, w, out.data_ptr<at::BFloat16>(), M, K, N);
  return out;
}

}  // namespace

// x (M, K) fp32 or bf16 @ the (N, K) weight held as `blocks` (N, K / 32 * block bytes) uint8, in
// `format` (0: Q4_1, 1: Q8_0, 2: Q4_0) -> (M, N) in x's dtype.
at::Tensor quant_dense(const at::Tensor& x, const at::Tensor& blocks, int64_t format) {
  TORCH_CHECK(format == kQ4_1 || format == kQ8_0 || format == kQ4_0,
              "quant_dense: format 0 (Q4_1), 1 (Q8_0) or 2 (Q4_0)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant_dense: fp32 or bf16 rows");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "quant_dense: contiguous uint8 blocks (N, bytes a row)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "quant_dense: x (M, K) with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(blocks.size(1) == K / kBlock * block_bytes(format), "quant_dense: blocks (N, K / 32 * block bytes)");
  const at::Tensor x_rows = x.contiguous();
  const uint8_t* w_data = blocks.data_ptr<uint8_t>();
  if (kBf16Dot && x.scalar_type() == at::kBFloat16 && format != kQ8_0) return dot_products(x_rows, w_data, format, N);
  // the activation rows in fp32, converted once here (a few KB) rather than in every sum
  std::vector<float> rows(M * K);
  if (x.scalar_type() == at::kFloat)
    std::memcpy(rows.data(), x_rows.data_ptr<float>(), M * K * sizeof(float));
  else
    std::copy_n(x_rows.data_ptr<at::BFloat16>(), M * K, rows.begin());  // bf16 -> fp32, exact
  const Rows activations{rows.data(), nullptr, nullptr};
  at::Tensor out = at::empty({M, N}, x.options());
  auto run = [&](auto* out_data) {  // fp32 or bf16 results
    using Out = std::remove_pointer_t<decltype(out_data)>;
    if (format == kQ4_0)
      products_for_rows<kQ4_0, false, Out>(activations, w_data, out_data, M, K, N);
    else if (format == kQ4_1)
      products_for_rows<kQ4_1, false, Out>(activations, w_data, out_data, M, K, N);
    else
      products_for_rows<kQ8_0, false, Out>(activations, w_data, out_data, M, K, N);
  };
  if (x.scalar_type() == at::kFloat)
    run(out.data_ptr<float>());
  else
    run(out.data_ptr<at::BFloat16>());
  return out;
}
