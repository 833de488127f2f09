// y = x @ W.T for a weight stored in 32-wide blocks: W[n, 32b + i] = q[n, 32b + i] * scale[n, b] + offset[n, b]
// with q an int8. GGUF's Q8_0 (offset 0), Q4_0 and Q4_1 are such blocks: holding them as int8 streams a
// quarter of float32's bytes. Each weight is rebuilt in float32 with one fused multiply-add, which
// reproduces the dequantized value bit for bit (q * scale is exact for a 16-bit scale and |q| < 2^8),
// and multiplied in float32. Built for AVX2 + FMA; the Python side uses it only on CPUs with both.
// Registered as the operator torch.ops.tandem.block_gemm (no Python headers needed to build it).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <utility>

#include "block_weights.h"

namespace {

using tandem_blocks::kBlock;
using tandem_blocks::kMaxTile;  // 8 accumulators + 4 weight registers

inline __m256 load_q8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Rows [0, MT) of x against weight rows [n0, n1). Each row of x keeps A partial sums so that the
// multiply-adds of one block do not wait on each other (at one row, a single sum would make the
// kernel latency-bound instead of bandwidth-bound).
template <int MT>
void tile(const float* x, int64_t K, const int8_t* q, const float* scale, const float* offset,
          float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int A = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qn = q + n * K;
    const float* sn = scale + n * nb;
    const float* on = offset + n * nb;
    tandem_blocks::prefetch_ahead(q, K, n, N);
    tandem_blocks::prefetch_ahead(scale, nb * 4, n, N);
    tandem_blocks::prefetch_ahead(offset, nb * 4, n, N);
    __m256 acc[MT][A];
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 s = _mm256_set1_ps(sn[b]);
      const __m256 o = _mm256_set1_ps(on[b]);
      const int8_t* qb = qn + b * kBlock;
      __m256 w[4];
      for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(load_q8(qb + 8 * j), s, o);
      tandem_blocks::accumulate_block<MT, A>(w, x, K, b, acc);
    }
    tandem_blocks::store_sums<MT, A>(acc, y, N, n);
  }
}

using TileFn = void (*)(const float*, int64_t, const int8_t*, const float*, const float*, float*, int64_t, int64_t, int64_t);
constexpr TileFn kTiles[kMaxTile + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

}  // namespace

at::Tensor block_gemm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                      int64_t tile_rows) {
  tandem_blocks::check(x_in, q, scale, offset);
  const at::Tensor x = x_in.contiguous();
  return tandem_blocks::multiply(x, x.data_ptr<float>(), q, scale, offset, kTiles, tile_rows);
}

// How many rows ahead the block kernels prefetch weights (block_weights.h); set returns the former value.
int64_t weight_prefetch() { return tandem_blocks::prefetch_rows; }

int64_t set_weight_prefetch(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= 64, "rows must be 0 (off) to 64, got ", rows);
  return std::exchange(tandem_blocks::prefetch_rows, rows);
}

TORCH_LIBRARY(tandem, m) {
  m.def("block_gemm(Tensor x, Tensor q, Tensor scale, Tensor offset, int tile_rows=0) -> Tensor");
  m.def("weight_prefetch() -> int", &weight_prefetch);
  m.def("set_weight_prefetch(int rows) -> int", &set_weight_prefetch);
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("block_gemm", &block_gemm);
}
