// y = x @ W.T over 32-wide blocks multiplied in bfloat16, for each form the float32 kernels read:
// block_gemm.cpp's int8 blocks (block_gemm_bf16), GGUF's 4-bit Q4_0/Q4_1 (block_gemm_q4_bf16) and its
// Q8_0 (block_gemm_q8_bf16). Each block of W is rebuilt in float32 as the float32 kernels rebuild it
// (the file's dequantized values, exactly) and rounded to bfloat16; x is rounded to bfloat16 once per
// call, and AVX512-BF16's dot-product instruction accumulates their products in float32, 32 per
// instruction where float32 FMAs do 16. The rounding is that of a bfloat16 copy of the dequantized
// weight (round to nearest even, as torch's .to(torch.bfloat16)), so the result matches a bfloat16
// product over that copy (oneDNN's) up to the order of the float32 sums.
//
// It pays where a step multiplies enough rows to be bound by arithmetic rather than by the bytes of the
// weight: decode batches of several requests. The functions carry their own target attribute, so the
// library builds anywhere; the operators refuse to run on a CPU without AVX512-BF16.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>

#include "block_tiles_avx512.h"
#include "block_weights.h"
#include "isa_cap.h"

#define TANDEM_BF16_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace {

using tandem_blocks::kBlock;
using tandem_blocks::kMaxTile;
constexpr int64_t kGroup = 8;    // weight rows whose sums are reduced together

// Lane sums of eight vectors, as one vector: [sum(f[0]), ..., sum(f[7])].
TANDEM_BF16_TARGET inline __m256 lane_sums(const __m256* f) {
  const __m256 a = _mm256_hadd_ps(f[0], f[1]), b = _mm256_hadd_ps(f[2], f[3]);
  const __m256 c = _mm256_hadd_ps(f[4], f[5]), d = _mm256_hadd_ps(f[6], f[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// block_gemm.cpp's int8 blocks (float32 scale and offset), rebuilt as block_gemm rebuilds them.
struct Int8Blocks {
  using Value = int8_t;
  static constexpr int64_t kBytes = kBlock;
  static constexpr int kBfloat16Rows = 1;  // weight rows multiplied side by side (tile, below)

  TANDEM_BF16_TARGET static void rebuild(const int8_t* qb, float scale, float offset, __m512& w0, __m512& w1) {
    const __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(offset);
    const __m128i* p = reinterpret_cast<const __m128i*>(qb);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), s, o);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), s, o);
  }
};

// Sixteen scales (or offsets) from p as float32, those past `valid` zero.
TANDEM_BF16_TARGET inline __m512 widen16(const float* p, __mmask16 valid) { return _mm512_maskz_loadu_ps(valid, p); }

TANDEM_BF16_TARGET inline __m512 widen16(const uint16_t* p, __mmask16 valid) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, p));
}

// Rows [0, MT) of x (bfloat16) against weight rows [n0, n1) of blocks in `Block`'s form (Int8Blocks,
// or block_tiles_avx512.h's Nibbles and Bytes) with scales and offsets of type `Scale` (offset nullptr
// where there are none), eight weight rows at a time: each row of x keeps one accumulator per weight
// row, folded to 8 lanes, and the group's sums are reduced together (one horizontal sum per weight
// row per row of x would cost a quarter of the arithmetic). Block::kBfloat16Rows weight rows go
// through the blocks side by side, each vector of x loaded serving them all, and their scales and
// offsets are widened 16 blocks at a time.
template <int MT, typename Block, typename Scale>
TANDEM_BF16_TARGET void tile(const uint16_t* x, int64_t K, const typename Block::Value* q, const Scale* scale,
                             const Scale* offset, float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int64_t kWiden = 16;  // blocks whose scales and offsets are widened together
  constexpr int WR = Block::kBfloat16Rows;  // weight rows side by side
  static_assert(kGroup % WR == 0);
  const int64_t nb = K / kBlock, row_values = nb * Block::kBytes;
  alignas(64) float s[WR][kWiden], o[WR][kWiden] = {};
  for (int64_t g = n0; g < n1; g += kGroup) {
    const int64_t size = std::min(kGroup, n1 - g);
    __m256 folded[MT][kGroup];
    for (int64_t t = 0; t < kGroup; t += WR) {
      int64_t n[WR];
      for (int r = 0; r < WR; ++r) n[r] = g + std::min(t + r, size - 1);  // past the end: the last row, not stored
      for (int64_t r : n) {
        tandem_blocks::prefetch_ahead(q, row_values * static_cast<int64_t>(sizeof(typename Block::Value)), r, N);
        tandem_blocks::prefetch_ahead(scale, nb * static_cast<int64_t>(sizeof(Scale)), r, N);
        if (offset != nullptr) tandem_blocks::prefetch_ahead(offset, nb * static_cast<int64_t>(sizeof(Scale)), r, N);
      }
      __m512 acc[WR][MT];
      for (int r = 0; r < WR; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
      for (int64_t b0 = 0; b0 < nb; b0 += kWiden) {
        const int64_t count = std::min(kWiden, nb - b0);
        const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
        for (int r = 0; r < WR; ++r) {
          _mm512_store_ps(s[r], widen16(scale + n[r] * nb + b0, valid));
          if (offset != nullptr) _mm512_store_ps(o[r], widen16(offset + n[r] * nb + b0, valid));
        }
        for (int64_t i = 0; i < count; ++i) {
          const int64_t b = b0 + i;
          __m512bh w[WR];
          for (int r = 0; r < WR; ++r) {
            __m512 w0, w1;
            Block::rebuild(q + n[r] * row_values + b * Block::kBytes, s[r][i], o[r][i], w0, w1);
            w[r] = _mm512_cvtne2ps_pbh(w1, w0);  // 32 bfloat16 in k order: w0's 16, then w1's
          }
          for (int m = 0; m < MT; ++m) {
            const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + m * K + b * kBlock));
            for (int r = 0; r < WR; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w[r], xb);
          }
        }
      }
      for (int r = 0; r < WR; ++r)
        for (int m = 0; m < MT; ++m)
          folded[m][t + r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][m]), _mm512_extractf32x8_ps(acc[r][m], 1));
    }
    for (int m = 0; m < MT; ++m) {
      alignas(32) float sums[kGroup];
      _mm256_store_ps(sums, lane_sums(folded[m]));
      std::copy(sums, sums + size, y + m * N + g);
    }
  }
}

// y [M, N] float32 = x @ W.T for x [M, K] float32 (rounded to bfloat16 here) and the N weight rows of
// blocks at q, with their scales and offsets (nullptr where none).
template <typename Block, typename Scale>
at::Tensor multiply(const char* name, const at::Tensor& x_in, const typename Block::Value* q, int64_t N,
                    const Scale* scale, const Scale* offset, int64_t tile_rows_asked) {
  TORCH_CHECK(tandem_isa::avx512_bf16_runs(), name, " needs a CPU with AVX512-BF16, not capped by TANDEM_CPU_ISA=avx2");
  using TileFn = void (*)(const uint16_t*, int64_t, const typename Block::Value*, const Scale*, const Scale*, float*,
                          int64_t, int64_t, int64_t);
  static constexpr TileFn kTiles[kMaxTile + 1] = {
      nullptr, tile<1, Block, Scale>, tile<2, Block, Scale>, tile<3, Block, Scale>, tile<4, Block, Scale>,
      tile<5, Block, Scale>, tile<6, Block, Scale>, tile<7, Block, Scale>, tile<8, Block, Scale>};
  const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t rows_per_tile = tandem_blocks::tile_rows(tile_rows_asked, K, sizeof(uint16_t));
  tandem_blocks::for_each_tile(M, N, rows_per_tile, [&](int64_t m0, int64_t rows, int64_t n0, int64_t n1) {
    kTiles[rows](xp + m0 * K, K, q, scale, offset, yp + m0 * N, N, n0, n1);
  });
  return y;
}

const uint16_t* halves(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }

}  // namespace

at::Tensor block_gemm_bf16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                           int64_t tile_rows) {
  tandem_blocks::check(x, q, scale, offset);
  return multiply<Int8Blocks>("block_gemm_bf16", x, q.data_ptr<int8_t>(), q.size(0), scale.data_ptr<float>(),
                              offset.data_ptr<float>(), tile_rows);
}

at::Tensor block_gemm_q4_bf16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                              const at::Tensor& offset, int64_t tile_rows) {
  tandem_blocks::check_nibbles(x, q, scale, offset);
  return multiply<tandem_blocks::Nibbles>("block_gemm_q4_bf16", x, q.data_ptr<uint8_t>(), q.size(0), halves(scale),
                                          halves(offset), tile_rows);
}

at::Tensor block_gemm_q8_bf16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t tile_rows) {
  tandem_blocks::check_bytes(x, q, scale);
  return multiply<tandem_blocks::Bytes>("block_gemm_q8_bf16", x, q.data_ptr<int8_t>(), q.size(0), halves(scale),
                                        static_cast<const uint16_t*>(nullptr), tile_rows);
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("block_gemm_bf16(Tensor x, Tensor q, Tensor scale, Tensor offset, int tile_rows=0) -> Tensor");
  m.def("block_gemm_q4_bf16(Tensor x, Tensor q, Tensor scale, Tensor offset, int tile_rows=0) -> Tensor");
  m.def("block_gemm_q8_bf16(Tensor x, Tensor q, Tensor scale, int tile_rows=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("block_gemm_bf16", &block_gemm_bf16);
  m.impl("block_gemm_q4_bf16", &block_gemm_q4_bf16);
  m.impl("block_gemm_q8_bf16", &block_gemm_q8_bf16);
}
