// y = x @ W.T for GGUF's 4-bit blocks (Q4_0, Q4_1) regrouped in stripes of 16 weight rows, multiplied
// with AVX512-BF16's dot-product instruction, or in float32 with AVX2 (below, `tile_avx2`): block_linear.py's
// NibbleStripes.
//
// block_gemm_bf16.cpp's kernel walks each weight row along K and rebuilds every block as 32 float32
// values (scale * nibble + offset) before rounding them to bfloat16: that rebuild, not the weight's
// bytes, bounded it (SmolLM2's layers at one row took as long with the weight in L2 as streamed from
// memory). Here a vector holds 16 weight rows side by side, two columns each, so the 4-bit values
// themselves are the bfloat16 operands: a nibble n becomes the bfloat16 of n - 8 (exact) by one word
// permute, and the block's scale and offset are applied once per block and row of x, to its sums:
//
//   sum_k x_k (scale n_k + offset) = scale * sum_k x_k (n_k - 8) + (offset + 8 scale) * sum_k x_k
//
// (offset + 8 scale is 0 for Q4_0). Every weight keeps its 4-bit value; only x is rounded. Two forms:
// - bfloat16 (`exact` false): x rounded to bfloat16 once (nearest even);
// - float32 (`exact` true): x split into three bfloat16 parts whose sum is x exactly (8 + 8 + 8
//   significant bits), each product of a part and a 4-bit value exact in float32 and summed in
//   float32: float32's product, at three dot products a column pair where the bfloat16 form takes one.
// The instructions read denormal inputs as 0 (a part below ~1e-38, of an x below ~1e-33), as the
// bfloat16 kernels do.
//
// Layout (NibbleStripes.from_nibbles): q [N / 16, K / 32, 8, 32] uint8: for stripe s, block b and
// column quad c (columns 4c..4c+3 of the block), row j's two bytes are (n[4c] | n[4c+2] << 4,
// n[4c+1] | n[4c+3] << 4), so that widening the 32 bytes to 16-bit words puts columns 4c and 4c+1 of
// row j in the low and high word of 32-bit lane j, and shifting each word right by 4, columns 4c+2
// and 4c+3; scale and offset [N / 16, K / 32, 16] float16, row j of the stripe in lane j.
//
// The AVX512-BF16 functions carry their own target attribute, so the library builds anywhere; the
// operator takes them only where they run, and refuses the bfloat16 form elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>

#include "block_weights.h"
#include "isa_cap.h"

#define TANDEM_BF16_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace {

using tandem_blocks::kBlock;
constexpr int64_t kStripe = 16;                        // weight rows a vector holds
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

// x's rows as the kernel reads them: `parts` bfloat16 copies [parts][M][K] summing to x (one: x
// rounded; three: x exactly), and each block's sum of x (of the rounded x for one part) [M][K / 32].
struct Operand {
  at::Tensor parts, sums;
};

TANDEM_BF16_TARGET inline __m256i round16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
TANDEM_BF16_TARGET inline __m512 widen16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TANDEM_BF16_TARGET Operand split(const at::Tensor& x, int parts) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  Operand out{at::empty({parts, M, K}, x.options().dtype(at::kBFloat16)), at::empty({M, nb}, x.options())};
  const float* src = x.data_ptr<float>();
  auto* dst = reinterpret_cast<__m256i*>(out.parts.data_ptr<at::BFloat16>());
  float* sums = out.sums.data_ptr<float>();
  const int64_t plane = M * K / 16;  // __m256i (16 bfloat16) a part
  for (int64_t i = 0; i < M * nb; ++i) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t at = 2 * i + half;
      const __m512 v = _mm512_loadu_ps(src + 16 * at);
      const __m256i hi = round16(v);
      _mm256_storeu_si256(dst + at, hi);
      if (parts == 1) {
        sum = _mm512_add_ps(sum, widen16(hi));
        continue;
      }
      sum = _mm512_add_ps(sum, v);
      const __m512 rest = _mm512_sub_ps(v, widen16(hi));  // exact: v and hi share their leading bits
      const __m256i mid = round16(rest);
      _mm256_storeu_si256(dst + plane + at, mid);
      _mm256_storeu_si256(dst + 2 * plane + at, round16(_mm512_sub_ps(rest, widen16(mid))));  // the last 8 bits
    }
    sums[i] = _mm512_reduce_add_ps(sum);
  }
  return out;
}

// Rows [0, MT) of x (S parts, `plane` elements apart) against stripes [s0, s1), G stripes at a time
// (each vector of x then serves G weight vectors, and the dot products' chains are G times as many).
template <int MT, int S, int G>
TANDEM_BF16_TARGET void tile(const uint16_t* x, int64_t plane, const float* sums, int64_t K, const uint8_t* q,
                             const uint16_t* scale, const uint16_t* offset, float* y, int64_t N, int64_t s0,
                             int64_t s1) {
  const int64_t nb = K / kBlock;
  // Partial sums per dot product: enough independent chains of dot products (~12) to keep the
  // instruction's latency hidden where there are few rows, few enough to stay in registers.
  constexpr int P = G * MT * S >= 10 ? 1 : G * MT * S >= 4 ? 2 : 4;
  const __m512 eight = _mm512_set1_ps(8.0f);
  // bfloat16 of n - 8 at word n, and again at n + 16: the permute reads 5 bits of each word.
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i table = _mm512_broadcast_i64x4(round16(_mm512_sub_ps(values, eight)));
  for (int64_t s = s0; s < s1; s += G) {
    __m512 total[G][MT];
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MT; ++m) total[g][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 dot[G][MT][S][P];
      for (int g = 0; g < G; ++g)
        for (int m = 0; m < MT; ++m)
          for (int p = 0; p < S; ++p)
            for (int h = 0; h < P; ++h) dot[g][m][p][h] = _mm512_setzero_ps();
      const uint8_t* qb[G];
      for (int g = 0; g < G; ++g) qb[g] = q + ((s + g) * nb + b) * kBlockBytes;
      if (tandem_blocks::prefetch_rows > 0) {
        // kAhead blocks on in the order this thread reads them: past the stripes' last block, the
        // next G stripes' first ones (beyond the thread's range it asks for bytes it does not read).
        const int64_t ahead = b + kAhead < nb ? (s * nb + b + kAhead) : ((s + G) * nb + b + kAhead - nb);
        for (int g = 0; g < G; ++g) {
          const int64_t at = ahead + g * nb;  // stripe-block index
          for (int64_t line = 0; line < kBlockBytes; line += 64) _mm_prefetch(q + at * kBlockBytes + line, _MM_HINT_T0);
          if (at % 2 == 0) {
            _mm_prefetch(reinterpret_cast<const char*>(scale + at * kStripe), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(offset + at * kStripe), _MM_HINT_T0);
          }
        }
      }
#pragma GCC unroll 8
      for (int64_t c = 0; c < kQuads; ++c) {
        for (int g = 0; g < G; ++g) {
          const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb[g] + 32 * c)));
          const __m512bh w01 = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(words, table));
          const __m512bh w23 = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table));
          for (int m = 0; m < MT; ++m)
            for (int p = 0; p < S; ++p) {
              const auto* pair = reinterpret_cast<const int32_t*>(x + p * plane + m * K + b * kBlock + 4 * c);
              __m512& acc = dot[g][m][p][c % P];
              acc = _mm512_dpbf16_ps(acc, w01, reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[0])));
              acc = _mm512_dpbf16_ps(acc, w23, reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[1])));
            }
        }
      }
      for (int g = 0; g < G; ++g) {
        const int64_t at = ((s + g) * nb + b) * kStripe;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + at)));
        const __m512 o = _mm512_fmadd_ps(eight, d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + at))));
        for (int m = 0; m < MT; ++m) {
          __m512 sum = _mm512_setzero_ps();
          for (int p = 0; p < S; ++p)
            for (int h = 0; h < P; ++h) sum = _mm512_add_ps(sum, dot[g][m][p][h]);
          total[g][m] = _mm512_fmadd_ps(d, sum, total[g][m]);
          total[g][m] = _mm512_fmadd_ps(o, _mm512_set1_ps(sums[m * nb + b]), total[g][m]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MT; ++m) _mm512_storeu_ps(y + m * N + (s + g) * kStripe, total[g][m]);
  }
}

// The float32 form with AVX2 (and FMA, F16C), for CPUs without AVX512-BF16: a vector holds 8 rows of a
// stripe, so a quad's 32 bytes make two. Row j's two bytes widen to the 32-bit lane j as the word
// n[4c] | n[4c+2] << 4 | n[4c+1] << 8 | n[4c+3] << 12; each field is masked where it lies and
// converted (n << 4f, exact), and multiplied with x's column scaled by 2^-4f, which
// `scaled_columns` prepares once a call (exact: a power of two), so no field is shifted down. Each
// product x * n is float32's, summed in float32, and a block's sums are scaled once:
//
//   sum_k x_k (scale n_k + offset) = scale * sum_k x_k n_k + offset * sum_k x_k.
//
// ~13 instructions a quad of 8 rows (one widening load, 4 masks, 4 conversions, 4 multiply-adds),
// where block_gemm_q4.cpp's AVX2 kernel rebuilds each float32 weight first (~1 instruction a weight).
// An x scaled below float32's normal range (|x| < ~5e-35) loses bits there.
constexpr int kFields = 4;
constexpr int kFieldColumn[kFields] = {0, 2, 1, 3};  // the column of a quad each field of a row's word holds
constexpr float kFieldScale[kFields] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f};  // 2^-4f

// x [M, K] as the AVX2 tile reads it: per quad its 4 columns in field order, field f scaled by 2^-4f;
// and each block's sum of x [M][K / 32].
struct ScaledColumns {
  at::Tensor columns, sums;
};

ScaledColumns scaled_columns(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  ScaledColumns out{at::empty({M, K}, x.options()), at::empty({M, nb}, x.options())};
  const float* src = x.data_ptr<float>();
  float* dst = out.columns.data_ptr<float>();
  float* sums = out.sums.data_ptr<float>();
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = src + i * kBlock;
    float sum = 0.0f;
    for (int64_t k = 0; k < kBlock; ++k) sum += xb[k];
    sums[i] = sum;
    for (int64_t c = 0; c < kQuads; ++c)
      for (int f = 0; f < kFields; ++f)
        dst[i * kBlock + 4 * c + f] = xb[4 * c + kFieldColumn[f]] * kFieldScale[f];
  }
  return out;
}

// Rows [0, MT) of x (scaled columns) against half-stripes (8 weight rows) [h0, h1), U at a time.
template <int MT, int U>
void tile_avx2(const float* x, const float* sums, int64_t K, const uint8_t* q, const uint16_t* scale,
               const uint16_t* offset, float* y, int64_t N, int64_t h0, int64_t h1) {
  const int64_t nb = K / kBlock;
  // independent chains of multiply-adds: ~8 in all hide their latency
  constexpr int P = U * MT >= 8 ? 1 : U * MT >= 4 ? 2 : 4;
  const __m256i masks[kFields] = {_mm256_set1_epi32(0xF), _mm256_set1_epi32(0xF0), _mm256_set1_epi32(0xF00),
                                  _mm256_set1_epi32(0xF000)};
  for (int64_t hs = h0; hs < h1; hs += U) {
    alignas(32) float total[U * MT * 8] = {};  // each row's sums so far, beside the registers
    for (int64_t b = 0; b < nb; ++b) {
      __m256 dot[U][MT][P];
      for (int u = 0; u < U; ++u)
        for (int m = 0; m < MT; ++m)
          for (int p = 0; p < P; ++p) dot[u][m][p] = _mm256_setzero_ps();
      const uint8_t* qb[U];
      for (int u = 0; u < U; ++u) qb[u] = q + ((hs + u) / 2 * nb + b) * kBlockBytes + 16 * ((hs + u) % 2);
      if (tandem_blocks::prefetch_rows > 0 && hs % 2 == 0) {
        // as the AVX-512 tiles ask: kAhead blocks on, into the next stripe past this one's last block
        const int64_t at = hs / 2 * nb + b + kAhead;  // stripe-block index
        for (int64_t line = 0; line < kBlockBytes; line += 64) _mm_prefetch(q + at * kBlockBytes + line, _MM_HINT_T0);
        if (at % 2 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(scale + at * kStripe), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(offset + at * kStripe), _MM_HINT_T0);
        }
      }
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
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + at)));
        const __m256 o = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offset + at)));
        for (int m = 0; m < MT; ++m) {
          __m256 sum = dot[u][m][0];
          for (int p = 1; p < P; ++p) sum = _mm256_add_ps(sum, dot[u][m][p]);
          float* t = total + (u * MT + m) * 8;
          __m256 acc = _mm256_fmadd_ps(d, sum, _mm256_load_ps(t));
          _mm256_store_ps(t, _mm256_fmadd_ps(o, _mm256_set1_ps(sums[m * nb + b]), acc));
        }
      }
    }
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MT; ++m) _mm256_storeu_ps(y + m * N + (hs + u) * 8, _mm256_load_ps(total + (u * MT + m) * 8));
  }
}

using Avx2TileFn = void (*)(const float*, const float*, int64_t, const uint8_t*, const uint16_t*, const uint16_t*,
                            float*, int64_t, int64_t, int64_t);
// Up to 8 rows of x in one pass, a half-stripe at a time; one row two half-stripes at a time (a whole
// stripe: 8 chains of multiply-adds). All of SmolLM2's projections and its LM head as 4-bit blocks
// (`TANDEM_CPU_ISA=avx2 tandem bench linear --whole-model`, 2-core Zen 5 EPYC), block_gemm_q4's AVX2
// kernel against this: 4.95 / 3.31 ms at 1 row, 5.66 / 4.44 at 2, 7.11 / 6.45 at 4, 11.89 / 11.37 at
// 8. Other plans measured (scratch, alternated): 4 rows a pass, or whole stripes at every row count,
// or 2 rows of whole stripes, were as fast or slower at every row count, the last by 1.5x from 4 rows
// (two passes where one would do).
template <int MT>
constexpr int kAvx2Halves = MT == 1 ? 2 : 1;
constexpr Avx2TileFn kAvx2Tiles[kMaxRows + 1] = {
    nullptr, tile_avx2<1, kAvx2Halves<1>>, tile_avx2<2, kAvx2Halves<2>>, tile_avx2<3, kAvx2Halves<3>>,
    tile_avx2<4, kAvx2Halves<4>>, tile_avx2<5, kAvx2Halves<5>>, tile_avx2<6, kAvx2Halves<6>>,
    tile_avx2<7, kAvx2Halves<7>>, tile_avx2<8, kAvx2Halves<8>>};

void multiply_avx2(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                   at::Tensor& y) {
  const int64_t M = y.size(0), N = y.size(1), K = x.size(1), stripes = N / kStripe, nb = K / kBlock;
  const ScaledColumns scaled = scaled_columns(x);
  const float* xp = scaled.columns.data_ptr<float>();
  const float* sums = scaled.sums.data_ptr<float>();
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const auto* op = reinterpret_cast<const uint16_t*>(offset.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  // Threads take stripes, 4 at least (64 weight rows); each stripe is multiplied by every pass of rows
  // while it is in cache.
  at::parallel_for(0, stripes, 4, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, M - m0), halves = rows == 1 ? kAvx2Halves<1> : 1;
        for (int64_t h = 2 * s; h < 2 * s + 2; h += halves)
          kAvx2Tiles[rows](xp + m0 * K, sums + m0 * nb, K, qp, sp, op, yp + m0 * N, N, h, h + halves);
      }
  });
}

using TileFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint8_t*, const uint16_t*,
                        const uint16_t*, float*, int64_t, int64_t, int64_t);

template <int S, int G>
constexpr TileFn kTiles[kMaxRows + 1] = {nullptr, tile<1, S, G>, tile<2, S, G>, tile<3, S, G>, tile<4, S, G>,
                                         tile<5, S, G>, tile<6, S, G>, tile<7, S, G>, tile<8, S, G>};

template <int S>
void multiply(const Operand& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset, at::Tensor& y) {
  const int64_t M = y.size(0), N = y.size(1), K = x.parts.size(2), stripes = N / kStripe;
  // Rows of x per pass: the float32 form's three parts take three times the registers.
  constexpr int64_t kRows = S == 1 ? kMaxRows : 2;
  // From this many rows, one stripe at a time: two would not fit the registers. All of SmolLM2's
  // projections in stripes (scratch, the bfloat16 form, the two builds alternated): one stripe from
  // 5 rows 1.06x the time of pairs at 5 and 6 rows, 1.05x at 7, 0.955x at 8; from 8, 0.956x and
  // 0.962x at 8.
  constexpr int64_t kOneStripeRows = 8;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.parts.data_ptr<at::BFloat16>());
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const auto* op = reinterpret_cast<const uint16_t*>(offset.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const float* sums = x.sums.data_ptr<float>();
  // Threads take pairs of stripes (a lone last stripe goes one at a time), 64 weight rows at least.
  at::parallel_for(0, (stripes + 1) / 2, 2, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = std::min(kRows, M - m0);
      const uint16_t* xm = xp + m0 * K;
      const float* sm = sums + m0 * (K / kBlock);
      if (rows >= kOneStripeRows) {
        kTiles<S, 1>[rows](xm, M * K, sm, K, qp, sp, op, yp + m0 * N, N, 2 * begin, std::min(2 * end, stripes));
        continue;
      }
      const int64_t pairs_end = std::min(end, stripes / 2);
      if (begin < pairs_end)
        kTiles<S, 2>[rows](xm, M * K, sm, K, qp, sp, op, yp + m0 * N, N, 2 * begin, 2 * pairs_end);
      if (end > stripes / 2 && stripes % 2 == 1)
        kTiles<S, 1>[rows](xm, M * K, sm, K, qp, sp, op, yp + m0 * N, N, stripes - 1, stripes);
    }
  });
}


}  // namespace

// x [M, K] float32 @ W.T -> [M, N] float32 for W's 4-bit blocks in stripes (q [N / 16, K / 32, 8, 32]
// uint8, scale and offset [N / 16, K / 32, 16] float16): float32's product where `exact`, else x
// rounded to bfloat16 (the weights exact either way). `avx512`: -1 the AVX512-BF16 forms where they
// run, else the AVX2 float32 form; 0 the AVX2 form (float32 only); 1 the AVX512-BF16 forms (refused
// where they do not run).
at::Tensor block_gemm_q4_stripes(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                 const at::Tensor& offset, bool exact, int64_t avx512) {
  TORCH_CHECK(avx512 >= -1 && avx512 <= 1, "avx512 must be -1 (where it runs), 0 or 1, got ", avx512);
  const bool bf16 = avx512 == 1 || (avx512 == -1 && tandem_isa::avx512_bf16_runs());
  TORCH_CHECK(!bf16 || tandem_isa::avx512_bf16_runs(),
              "block_gemm_q4_stripes' AVX512-BF16 forms need a CPU with AVX512-BF16, not capped by TANDEM_CPU_ISA=avx2");
  TORCH_CHECK(bf16 || exact,
              "block_gemm_q4_stripes' bfloat16 form (exact=false) needs a CPU with AVX512-BF16, not capped by "
              "TANDEM_CPU_ISA=avx2; its AVX2 form is float32's (exact=true)");
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
  if (!bf16) {
    multiply_avx2(x.contiguous(), q, scale, offset, y);
    return y;
  }
  const Operand operand = split(x.contiguous(), exact ? 3 : 1);
  if (exact)
    multiply<3>(operand, q, scale, offset, y);
  else
    multiply<1>(operand, q, scale, offset, y);
  return y;
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("block_gemm_q4_stripes(Tensor x, Tensor q, Tensor scale, Tensor offset, bool exact, int avx512=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("block_gemm_q4_stripes", &block_gemm_q4_stripes); }
