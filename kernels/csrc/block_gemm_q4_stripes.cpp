// y = x @ W.T for GGUF's 4-bit blocks (Q4_0, Q4_1) regrouped in stripes of 16 weight rows:
// block_linear.py's NibbleStripes.
//
// block_gemm_q4.cpp's kernels walk each weight row along K and rebuild every weight in float32
// (scale * nibble + offset) before its product: about one instruction a weight, which, not the
// weight's bytes, bounded them (SmolLM2's layers at one row took as long with the weight in L2 as
// streamed from memory). Here a vector holds rows of a stripe side by side, so the 4-bit values
// themselves are the operands and the block's scale and offset are applied once per block and row
// of x, to its sums:
//
//   sum_k x_k (scale n_k + offset) = scale * sum_k x_k n_k + offset * sum_k x_k
//
// Every weight keeps its 4-bit value. Three forms:
// - float32 with AVX-512 (F, BW; `tile_f32`), a whole stripe to a vector, and with AVX2 (`tile_avx2`),
//   half a stripe: a row's word of four nibbles is widened to its 32-bit lane, each nibble masked
//   where it lies and converted (n << 4f, exact), and multiplied with x's column scaled by 2^-4f
//   (`scaled_columns`, once a call; exact, a power of two), so no field is shifted down: each x * n
//   is float32's, summed in float32. About 13 instructions a quad of 16 (AVX-512) or 8 (AVX2) rows.
//   An x scaled out of float32's normal range (|x| < ~5e-35) loses bits there.
// - bfloat16 with AVX512-BF16 (`exact` false; `tile_bf16`): x rounded to bfloat16 once (nearest
//   even), a nibble n turned into the bfloat16 of n - 8 (exact) by one word permute, two columns a
//   32-bit lane, AVX512-BF16's dot products (float32 sums); the sums' offset is then offset + 8 scale
//   (0 for Q4_0). The instruction reads denormal x as 0, as the bfloat16 kernels do.
// On a 2-core Zen 5 EPYC, all of SmolLM2's projections streamed (scratch, alternated, ms at 1 / 2 / 4 / 8
// rows): block_gemm_q4's AVX-512 kernel 3.02 / 3.40 / 4.27 / 6.89, float32 here 2.22 / 2.52 / 3.41 /
// 5.54 (AVX2: 2.92 / 3.83 / 5.58 / 9.77), bfloat16 2.34 / 2.42 / 2.65 / 3.81; x split into three
// exact bfloat16 parts for AVX512-BF16's float32 product, this kernel's former float32 form, 2.47 /
// 3.04 / 4.70 / 7.93.
//
// Layout (NibbleStripes.from_nibbles): q [N / 16, K / 32, 8, 32] uint8: for stripe s, block b and
// column quad c (columns 4c..4c+3 of the block), row j's two bytes are (n[4c] | n[4c+2] << 4,
// n[4c+1] | n[4c+3] << 4), so that widening the 32 bytes to 16-bit words puts the word
// n[4c] | n[4c+2] << 4 | n[4c+1] << 8 | n[4c+3] << 12 in word j; scale and offset [N / 16, K / 32, 16]
// float16, row j of the stripe in lane j.
//
// The AVX-512 functions carry their own target attribute, so the library builds anywhere; the
// operator takes them only where they run (tandem_isa), and refuses the bfloat16 form elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>

#include "block_tiles_avx512.h"  // TANDEM_AVX512_TARGET
#include "block_weights.h"
#include "isa_cap.h"

#define TANDEM_BF16_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace {

using tandem_blocks::kBlock;
constexpr int64_t kStripe = 16;                        // weight rows a stripe holds
constexpr int64_t kQuads = kBlock / 4;                 // column quads a block
constexpr int64_t kBlockBytes = kStripe * kBlock / 2;  // one block of a stripe: 256 bytes
constexpr int kMaxRows = 8;                            // rows of x per pass over the weight
// Blocks of each stripe asked for (_mm_prefetch) before the kernel reaches them. All of SmolLM2's
// projections in stripes, streamed (`tandem bench linear --whole-model`, 2-core Zen 5 EPYC), over the
// Nibbles' kernels in the same run, at 1 row (float32) / 8 rows (bfloat16): 4 blocks ahead, the
// nibbles only, 1.07-1.15x / 0.80-0.86x; with the scales and offsets, 8 ahead 0.99x / 0.78x, 16 ahead
// 0.98x / 0.86x, 32 ahead 1.03x / 0.78x; 8 ahead and on into the next stripes (as below, where those
// stopped at the stripe's end) 0.89x / 0.74-0.76x.
constexpr int64_t kAhead = 8;

// kAhead blocks on from block b of stripes [s, s + G), in the order a tile reads them: past the
// stripes' last block, the next G stripes' first ones (beyond a thread's range it asks for bytes it
// does not read; past the weight's end, for none). Inlined by force: GCC kept it a call from the
// target-attributed tiles, one a block, and the whole model took 1.2-1.6x the time.
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* q, const uint16_t* scale,
                                                          const uint16_t* offset, int64_t nb, int64_t s, int64_t G,
                                                          int64_t b) {
  if (tandem_blocks::prefetch_rows == 0) return;
  const int64_t ahead = b + kAhead < nb ? (s * nb + b + kAhead) : ((s + G) * nb + b + kAhead - nb);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t at = ahead + g * nb;  // stripe-block index
    for (int64_t line = 0; line < kBlockBytes; line += 64) _mm_prefetch(q + at * kBlockBytes + line, _MM_HINT_T0);
    if (at % 2 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(scale + at * kStripe), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(offset + at * kStripe), _MM_HINT_T0);
    }
  }
}

// The operands of one call: the weight's arrays, x's rows as a tile reads them (T), each block's sum
// of x [M][K / 32], and y [M, N].
template <typename T>
struct Operands {
  const T* x;
  const float* sums;
  int64_t K;
  const uint8_t* q;
  const uint16_t *scale, *offset;
  float* y;
  int64_t N;
};

template <typename T>
using TileFn = void (*)(const Operands<T>&, int64_t m0, int64_t s0, int64_t s1);

// Threads take pairs of stripes (a lone last stripe goes one at a time), 64 weight rows at least;
// rows of x in passes of kMaxRows. pairs[r] takes r rows two stripes at a time, one[r] one at a time;
// from `one_stripe_rows` rows, one[r] takes the thread's whole range.
template <typename T>
void for_each_pass(const Operands<T>& ops, int64_t M, int64_t one_stripe_rows, const TileFn<T>* pairs,
                   const TileFn<T>* one) {
  const int64_t stripes = ops.N / kStripe;
  at::parallel_for(0, (stripes + 1) / 2, 2, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
      if (rows >= one_stripe_rows) {
        one[rows](ops, m0, 2 * begin, std::min(2 * end, stripes));
        continue;
      }
      const int64_t pairs_end = std::min(end, stripes / 2);
      if (begin < pairs_end) pairs[rows](ops, m0, 2 * begin, 2 * pairs_end);
      if (end > stripes / 2 && stripes % 2 == 1) one[rows](ops, m0, stripes - 1, stripes);
    }
  });
}

// What the two AVX-512 tiles (float32, bfloat16) do around a block of G stripes: its sums start at 0,
// and end scaled by the block's scales, plus its offsets (and `Shift` times its scales: the bfloat16
// form's nibbles are n - Shift) times each row's sum of x, added into the totals (inlined into both).
template <int N>
TANDEM_AVX512_TARGET __attribute__((always_inline)) inline void zero(__m512* v) {
  for (int i = 0; i < N; ++i) v[i] = _mm512_setzero_ps();
}

template <int Shift, int G, int MT, int P>
TANDEM_AVX512_TARGET __attribute__((always_inline)) inline void add_block(const uint16_t* scale, const uint16_t* offset,
                                                                          const float* sums, int64_t nb, int64_t s,
                                                                          int64_t b, const __m512 (&dot)[G][MT][P],
                                                                          __m512 (&total)[G][MT]) {
  for (int g = 0; g < G; ++g) {
    const int64_t at = ((s + g) * nb + b) * kStripe;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + at)));
    __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + at)));
    if (Shift != 0) o = _mm512_fmadd_ps(_mm512_set1_ps(Shift), d, o);
    for (int m = 0; m < MT; ++m) {
      __m512 sum = dot[g][m][0];
      for (int p = 1; p < P; ++p) sum = _mm512_add_ps(sum, dot[g][m][p]);
      total[g][m] = _mm512_fmadd_ps(d, sum, total[g][m]);
      total[g][m] = _mm512_fmadd_ps(o, _mm512_set1_ps(sums[m * nb + b]), total[g][m]);
    }
  }
}

template <int G, int MT>
TANDEM_AVX512_TARGET __attribute__((always_inline)) inline void store_totals(float* y, int64_t N, int64_t s,
                                                                             const __m512 (&total)[G][MT]) {
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MT; ++m) _mm512_storeu_ps(y + m * N + (s + g) * kStripe, total[g][m]);
}

// ---- float32: x's columns scaled to meet each nibble where it lies

constexpr int kFields = 4;
constexpr int kFieldColumn[kFields] = {0, 2, 1, 3};  // the column of a quad each field of a row's word holds
constexpr float kFieldScale[kFields] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f};  // 2^-4f

// x's rows as a tile reads them, and each block's sum of those values [M][K / 32].
struct Prepared {
  at::Tensor x, sums;
};

// x [M, K] as the float32 tiles read it: per quad its 4 columns in field order, field f scaled by 2^-4f.
Prepared scaled_columns(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  Prepared out{at::empty({M, K}, x.options()), at::empty({M, nb}, x.options())};
  const float* src = x.data_ptr<float>();
  float* dst = out.x.data_ptr<float>();
  float* sums = out.sums.data_ptr<float>();
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = src + i * kBlock;
    float sum = 0.0f;
    for (int64_t k = 0; k < kBlock; ++k) sum += xb[k];
    sums[i] = sum;
    for (int64_t c = 0; c < kQuads; ++c)
      for (int f = 0; f < kFields; ++f) dst[i * kBlock + 4 * c + f] = xb[4 * c + kFieldColumn[f]] * kFieldScale[f];
  }
  return out;
}

// Rows [m0, m0 + MT) of x against stripes [s0, s1), G at a time, a stripe to a vector (AVX-512).
template <int MT, int G>
TANDEM_AVX512_TARGET void tile_f32(const Operands<float>& ops, int64_t m0, int64_t s0, int64_t s1) {
  const int64_t K = ops.K, nb = K / kBlock;
  const float* x = ops.x + m0 * K;
  const float* sums = ops.sums + m0 * nb;
  // independent chains of multiply-adds: ~8 in all hide their latency
  constexpr int P = G * MT >= 8 ? 1 : G * MT >= 4 ? 2 : 4;
  const __m512i masks[kFields] = {_mm512_set1_epi32(0xF), _mm512_set1_epi32(0xF0), _mm512_set1_epi32(0xF00),
                                  _mm512_set1_epi32(0xF000)};
  for (int64_t s = s0; s < s1; s += G) {
    __m512 total[G][MT];
    zero<G * MT>(&total[0][0]);
    for (int64_t b = 0; b < nb; ++b) {
      __m512 dot[G][MT][P];
      zero<G * MT * P>(&dot[0][0][0]);
      const uint8_t* qb[G];
      for (int g = 0; g < G; ++g) qb[g] = ops.q + ((s + g) * nb + b) * kBlockBytes;
      prefetch_ahead(ops.q, ops.scale, ops.offset, nb, s, G, b);
#pragma GCC unroll 8
      for (int64_t c = 0; c < kQuads; ++c) {
        __m512i words[G];
        for (int g = 0; g < G; ++g)
          words[g] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb[g] + 32 * c)));
        for (int f = 0; f < kFields; ++f) {
          __m512 w[G];
          for (int g = 0; g < G; ++g) w[g] = _mm512_cvtepi32_ps(_mm512_and_si512(words[g], masks[f]));
          for (int m = 0; m < MT; ++m) {
            const __m512 xv = _mm512_set1_ps(x[m * K + b * kBlock + 4 * c + f]);
            for (int g = 0; g < G; ++g) {
              __m512& acc = dot[g][m][(c * kFields + f) % P];
              acc = _mm512_fmadd_ps(w[g], xv, acc);
            }
          }
        }
      }
      add_block<0>(ops.scale, ops.offset, sums, nb, s, b, dot, total);
    }
    store_totals(ops.y + m0 * ops.N, ops.N, s, total);
  }
}

// The same with AVX2, half a stripe (8 rows) to a vector: rows [m0, m0 + MT) against half-stripes
// [h0, h1), U at a time. One row takes a whole stripe at a time (U = 2: 8 chains of multiply-adds),
// more a half (U = 1); the sums so far wait in memory, beside the 16 registers.
template <int MT, int U>
void tile_avx2_halves(const Operands<float>& ops, int64_t m0, int64_t h0, int64_t h1) {
  const int64_t K = ops.K, nb = K / kBlock;
  const float* x = ops.x + m0 * K;
  const float* sums = ops.sums + m0 * nb;
  constexpr int P = U * MT >= 8 ? 1 : U * MT >= 4 ? 2 : 4;
  const __m256i masks[kFields] = {_mm256_set1_epi32(0xF), _mm256_set1_epi32(0xF0), _mm256_set1_epi32(0xF00),
                                  _mm256_set1_epi32(0xF000)};
  for (int64_t hs = h0; hs < h1; hs += U) {
    alignas(32) float total[U * MT * 8] = {};
    for (int64_t b = 0; b < nb; ++b) {
      __m256 dot[U][MT][P];
      for (int u = 0; u < U; ++u)
        for (int m = 0; m < MT; ++m)
          for (int p = 0; p < P; ++p) dot[u][m][p] = _mm256_setzero_ps();
      const uint8_t* qb[U];
      for (int u = 0; u < U; ++u) qb[u] = ops.q + ((hs + u) / 2 * nb + b) * kBlockBytes + 16 * ((hs + u) % 2);
      if (hs % 2 == 0) prefetch_ahead(ops.q, ops.scale, ops.offset, nb, hs / 2, 1, b);  // a half reads whole lines
#pragma GCC unroll 8
      for (int64_t c = 0; c < kQuads; ++c) {
        __m256i words[U];
        for (int u = 0; u < U; ++u)
          words[u] = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb[u] + 32 * c)));
        for (int f = 0; f < kFields; ++f) {
          __m256 w[U];
          for (int u = 0; u < U; ++u) w[u] = _mm256_cvtepi32_ps(_mm256_and_si256(words[u], masks[f]));
          for (int m = 0; m < MT; ++m) {
            const __m256 xv = _mm256_broadcast_ss(x + m * K + b * kBlock + 4 * c + f);
            for (int u = 0; u < U; ++u) {
              __m256& acc = dot[u][m][(c * kFields + f) % P];
              acc = _mm256_fmadd_ps(w[u], xv, acc);
            }
          }
        }
      }
      for (int u = 0; u < U; ++u) {
        const int64_t at = ((hs + u) / 2 * nb + b) * kStripe + 8 * ((hs + u) % 2);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ops.scale + at)));
        const __m256 o = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ops.offset + at)));
        for (int m = 0; m < MT; ++m) {
          __m256 sum = dot[u][m][0];
          for (int p = 1; p < P; ++p) sum = _mm256_add_ps(sum, dot[u][m][p]);
          float* t = total + (u * MT + m) * 8;
          const __m256 acc = _mm256_fmadd_ps(d, sum, _mm256_load_ps(t));
          _mm256_store_ps(t, _mm256_fmadd_ps(o, _mm256_set1_ps(sums[m * nb + b]), acc));
        }
      }
    }
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MT; ++m)
        _mm256_storeu_ps(ops.y + (m0 + m) * ops.N + (hs + u) * 8, _mm256_load_ps(total + (u * MT + m) * 8));
  }
}

// Stripes [s0, s1) for tile_avx2_halves. All of SmolLM2's projections and LM head as 4-bit blocks
// (`TANDEM_CPU_ISA=avx2 tandem bench linear --whole-model`, 2-core Zen 5 EPYC), block_gemm_q4's AVX2
// kernel against this: 4.95 / 3.31 ms at 1 row, 5.66 / 4.44 at 2, 7.11 / 6.45 at 4, 11.89 / 11.37 at 8.
// Other plans measured (scratch, alternated): 4 rows a pass, or whole stripes at every row count, or
// 2 rows of whole stripes, were as fast or slower at every row count, the last by 1.5x from 4 rows.
template <int MT>
void tile_avx2(const Operands<float>& ops, int64_t m0, int64_t s0, int64_t s1) {
  constexpr int U = MT == 1 ? 2 : 1;
  tile_avx2_halves<MT, U>(ops, m0, 2 * s0, 2 * s1);
}

// Up to 4 rows two stripes at a time, from 5 one (two would not fit the 32 registers).
constexpr TileFn<float> kF32Pairs[kMaxRows + 1] = {nullptr, tile_f32<1, 2>, tile_f32<2, 2>, tile_f32<3, 2>,
                                                   tile_f32<4, 2>, nullptr, nullptr, nullptr, nullptr};
constexpr TileFn<float> kF32One[kMaxRows + 1] = {nullptr, tile_f32<1, 1>, tile_f32<2, 1>, tile_f32<3, 1>,
                                                 tile_f32<4, 1>, tile_f32<5, 1>, tile_f32<6, 1>, tile_f32<7, 1>,
                                                 tile_f32<8, 1>};
constexpr TileFn<float> kAvx2[kMaxRows + 1] = {nullptr, tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>,
                                               tile_avx2<5>, tile_avx2<6>, tile_avx2<7>, tile_avx2<8>};

// ---- bfloat16: x rounded, the nibbles turned into bfloat16 by a permute

TANDEM_BF16_TARGET inline __m256i round16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }

// x rounded to bfloat16 [M, K] and each block's sum of the rounded x [M][K / 32].
TANDEM_BF16_TARGET Prepared rounded(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  Prepared out{at::empty({M, K}, x.options().dtype(at::kBFloat16)), at::empty({M, nb}, x.options())};
  const float* src = x.data_ptr<float>();
  auto* dst = reinterpret_cast<__m256i*>(out.x.data_ptr<at::BFloat16>());
  float* sums = out.sums.data_ptr<float>();
  for (int64_t i = 0; i < M * nb; ++i) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t half = 0; half < 2; ++half) {
      const __m256i h = round16(_mm512_loadu_ps(src + 16 * (2 * i + half)));
      _mm256_storeu_si256(dst + 2 * i + half, h);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    sums[i] = _mm512_reduce_add_ps(sum);
  }
  return out;
}

// Rows [m0, m0 + MT) of x against stripes [s0, s1), G at a time (each vector of x then serves G weight
// vectors, and the dot products' chains are G times as many).
template <int MT, int G>
TANDEM_BF16_TARGET void tile_bf16(const Operands<uint16_t>& ops, int64_t m0, int64_t s0, int64_t s1) {
  const int64_t K = ops.K, nb = K / kBlock;
  const uint16_t* x = ops.x + m0 * K;
  const float* sums = ops.sums + m0 * nb;
  // Partial sums per dot product: enough independent chains of dot products (~12) to keep the
  // instruction's latency hidden where there are few rows, few enough to stay in registers.
  constexpr int P = G * MT >= 10 ? 1 : G * MT >= 4 ? 2 : 4;
  const __m512 eight = _mm512_set1_ps(8.0f);
  // bfloat16 of n - 8 at word n, and again at n + 16: the permute reads 5 bits of each word.
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i table = _mm512_broadcast_i64x4(round16(_mm512_sub_ps(values, eight)));
  for (int64_t s = s0; s < s1; s += G) {
    __m512 total[G][MT];
    zero<G * MT>(&total[0][0]);
    for (int64_t b = 0; b < nb; ++b) {
      __m512 dot[G][MT][P];
      zero<G * MT * P>(&dot[0][0][0]);
      const uint8_t* qb[G];
      for (int g = 0; g < G; ++g) qb[g] = ops.q + ((s + g) * nb + b) * kBlockBytes;
      prefetch_ahead(ops.q, ops.scale, ops.offset, nb, s, G, b);
#pragma GCC unroll 8
      for (int64_t c = 0; c < kQuads; ++c) {
        for (int g = 0; g < G; ++g) {
          const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb[g] + 32 * c)));
          const __m512bh w01 = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(words, table));
          const __m512bh w23 = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table));
          for (int m = 0; m < MT; ++m) {
            const auto* pair = reinterpret_cast<const int32_t*>(x + m * K + b * kBlock + 4 * c);
            __m512& acc = dot[g][m][c % P];
            acc = _mm512_dpbf16_ps(acc, w01, reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[0])));
            acc = _mm512_dpbf16_ps(acc, w23, reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[1])));
          }
        }
      }
      add_block<8>(ops.scale, ops.offset, sums, nb, s, b, dot, total);  // the nibbles were n - 8
    }
    store_totals(ops.y + m0 * ops.N, ops.N, s, total);
  }
}

constexpr TileFn<uint16_t> kBf16Pairs[kMaxRows + 1] = {nullptr, tile_bf16<1, 2>, tile_bf16<2, 2>, tile_bf16<3, 2>,
                                                       tile_bf16<4, 2>, tile_bf16<5, 2>, tile_bf16<6, 2>,
                                                       tile_bf16<7, 2>, tile_bf16<8, 2>};
constexpr TileFn<uint16_t> kBf16One[kMaxRows + 1] = {nullptr, tile_bf16<1, 1>, tile_bf16<2, 1>, tile_bf16<3, 1>,
                                                     tile_bf16<4, 1>, tile_bf16<5, 1>, tile_bf16<6, 1>,
                                                     tile_bf16<7, 1>, tile_bf16<8, 1>};

}  // namespace

// x [M, K] float32 @ W.T -> [M, N] float32 for W's 4-bit blocks in stripes (q [N / 16, K / 32, 8, 32]
// uint8, scale and offset [N / 16, K / 32, 16] float16): float32's product where `exact`, else x
// rounded to bfloat16 (AVX512-BF16; the weights exact either way). `avx512`: -1 the AVX-512 forms
// where they run, else AVX2's; 0 AVX2's (float32 only); 1 the AVX-512 ones (refused where they do not
// run).
at::Tensor block_gemm_q4_stripes(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                 const at::Tensor& offset, bool exact, int64_t avx512) {
  TORCH_CHECK(avx512 >= -1 && avx512 <= 1, "avx512 must be -1 (where it runs), 0 or 1, got ", avx512);
  TORCH_CHECK(exact || (avx512 != 0 && tandem_isa::avx512_bf16_runs()),
              "block_gemm_q4_stripes' bfloat16 form (exact=false) needs a CPU with AVX512-BF16, not capped by "
              "TANDEM_CPU_ISA=avx2, and avx512 -1 or 1; its float32 form (exact=true) runs anywhere");
  TORCH_CHECK(avx512 != 1 || tandem_isa::avx512_runs(),
              "block_gemm_q4_stripes' AVX-512 forms (avx512=1) need a CPU with AVX-512 (F, BW), not capped by "
              "TANDEM_CPU_ISA=avx2");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kByte && q.is_contiguous() && K % kBlock == 0 &&
              q.size(1) == nb && q.size(2) == kQuads && q.size(3) == 2 * kStripe,
              "q must be contiguous uint8 [N / 16, K / 32, 8, 32] with K = x.size(1), a multiple of 32");
  const int64_t stripes = q.size(0);
  for (const at::Tensor* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == stripes &&
                t->size(1) == nb && t->size(2) == kStripe, "scale and offset must be contiguous float16 [N / 16, K / 32, 16]");
  auto y = at::empty({M, stripes * kStripe}, x.options());
  if (M == 0) return y;
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const auto* op = reinterpret_cast<const uint16_t*>(offset.data_ptr<at::Half>());
  const int64_t N = stripes * kStripe;
  if (!exact) {
    const Prepared r = rounded(x.contiguous());
    const Operands<uint16_t> ops{reinterpret_cast<const uint16_t*>(r.x.data_ptr<at::BFloat16>()),
                                 r.sums.data_ptr<float>(), K, qp, sp, op, y.data_ptr<float>(), N};
    // From 8 rows one stripe at a time: two would not fit the registers. All of SmolLM2's projections
    // in stripes (scratch, the two builds alternated): one stripe from 5 rows 1.06x the time of pairs at
    // 5 and 6 rows, 1.05x at 7, 0.955x at 8; from 8, 0.956x and 0.962x at 8.
    for_each_pass(ops, M, 8, kBf16Pairs, kBf16One);
    return y;
  }
  const Prepared c = scaled_columns(x.contiguous());
  const Operands<float> ops{c.x.data_ptr<float>(), c.sums.data_ptr<float>(), K, qp, sp, op, y.data_ptr<float>(), N};
  if (avx512 == 1 || (avx512 == -1 && tandem_isa::avx512_runs()))
    for_each_pass(ops, M, 5, kF32Pairs, kF32One);
  else
    for_each_pass(ops, M, 1, kAvx2, kAvx2);  // tile_avx2 picks its own halves
  return y;
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("block_gemm_q4_stripes(Tensor x, Tensor q, Tensor scale, Tensor offset, bool exact, int avx512=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("block_gemm_q4_stripes", &block_gemm_q4_stripes); }
