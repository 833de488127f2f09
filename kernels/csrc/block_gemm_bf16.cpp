// y = x @ W.T over the same 32-wide int8 blocks as block_gemm.cpp, multiplied in bfloat16: each block of
// W is rebuilt in float32 (q * scale + offset, one fused multiply-add, as there) and rounded to bfloat16,
// x is rounded to bfloat16 once per call, and AVX512-BF16's dot-product instruction accumulates their
// products in float32, 32 per instruction where float32 FMAs do 8 (16 with AVX-512). The rounding is
// that of a bfloat16 copy of the weight (round to nearest even, as torch's .to(torch.bfloat16)), so
// the result matches oneDNN's bfloat16 product up to the order of the float32 sums.
//
// It pays where a step multiplies enough rows to be bound by arithmetic rather than by the bytes of the
// weight: decode batches of several requests. The functions carry their own target attribute, so the
// library builds anywhere; the operator refuses to run on a CPU without AVX512-BF16.
// Registered as torch.ops.tandem.block_gemm_bf16.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>

#include "block_weights.h"

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

TANDEM_BF16_TARGET inline __m512bh rebuild(const int8_t* qb, float scale, float offset) {
  const __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(offset);
  const __m128i* p = reinterpret_cast<const __m128i*>(qb);
  const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), s, o);
  const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), s, o);
  return _mm512_cvtne2ps_pbh(hi, lo);  // 32 bfloat16 in k order: lo's 16, then hi's
}

// Rows [0, MT) of x (bfloat16) against weight rows [n0, n1), eight weight rows at a time: each row of x
// keeps one accumulator per weight row, folded to 8 lanes, and the group's sums are reduced together
// (one horizontal sum per weight row per row of x would cost a quarter of the arithmetic).
template <int MT>
TANDEM_BF16_TARGET void tile(const uint16_t* x, int64_t K, const int8_t* q, const float* scale, const float* offset,
                             float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / kBlock;
  for (int64_t g = n0; g < n1; g += kGroup) {
    const int64_t size = std::min(kGroup, n1 - g);
    __m256 folded[MT][kGroup];
    for (int64_t t = 0; t < kGroup; ++t) {
      const int64_t n = g + std::min(t, size - 1);  // past the end: repeat the last row, not stored
      __m512 acc[MT];
      for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m512bh w = rebuild(q + n * K + b * kBlock, scale[n * nb + b], offset[n * nb + b]);
        for (int m = 0; m < MT; ++m) {
          const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + m * K + b * kBlock));
          acc[m] = _mm512_dpbf16_ps(acc[m], w, xb);
        }
      }
      for (int m = 0; m < MT; ++m)
        folded[m][t] = _mm256_add_ps(_mm512_castps512_ps256(acc[m]), _mm512_extractf32x8_ps(acc[m], 1));
    }
    for (int m = 0; m < MT; ++m) {
      alignas(32) float sums[kGroup];
      _mm256_store_ps(sums, lane_sums(folded[m]));
      std::copy(sums, sums + size, y + m * N + g);
    }
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const int8_t*, const float*, const float*, float*, int64_t, int64_t,
                        int64_t);
constexpr TileFn kTiles[kMaxTile + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

}  // namespace

at::Tensor block_gemm_bf16(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                           const at::Tensor& offset, int64_t tile_rows) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "block_gemm_bf16 needs a CPU with AVX512-BF16");
  tandem_blocks::check(x_in, q, scale, offset);
  const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
  return tandem_blocks::multiply(x, reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), q, scale, offset,
                                 kTiles, tile_rows);
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("block_gemm_bf16(Tensor x, Tensor q, Tensor scale, Tensor offset, int tile_rows=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("block_gemm_bf16", &block_gemm_bf16);
}
