// y = x @ W.T for a weight stored in 32-wide blocks: W[n, 32b + i] = q[n, 32b + i] * scale[n, b] + offset[n, b]
// with q an int8. GGUF's Q8_0 (offset 0), Q4_0 and Q4_1 are such blocks: holding them as int8 streams a
// quarter of float32's bytes. Each weight is rebuilt in float32 with one fused multiply-add, which
// reproduces the dequantized value bit for bit (q * scale is exact for a 16-bit scale and |q| < 2^8),
// and multiplied in float32. Built for AVX2 + FMA; the Python side uses it only on CPUs with both.
// Registered as the operator torch.ops.tandem.block_gemm (no Python headers needed to build it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxTile = 8;  // rows of x per pass over the weight: 8 accumulators + 4 weight registers

inline __m256 load_q8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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
    __m256 acc[MT][A];
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 s = _mm256_set1_ps(sn[b]);
      const __m256 o = _mm256_set1_ps(on[b]);
      const int8_t* qb = qn + b * kBlock;
      __m256 w[4];
      for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(load_q8(qb + 8 * j), s, o);
      for (int m = 0; m < MT; ++m) {
        const float* xb = x + m * K + b * kBlock;
        for (int j = 0; j < 4; ++j) acc[m][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[m][j % A]);
      }
    }
    for (int m = 0; m < MT; ++m) {
      __m256 t = acc[m][0];
      for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[m][a]);
      y[m * N + n] = hsum(t);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const int8_t*, const float*, const float*, float*, int64_t, int64_t, int64_t);
constexpr TileFn kTiles[kMaxTile + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

}  // namespace

at::Tensor block_gemm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && K % kBlock == 0, "q must be [N, K] with K = x.size(1), a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && offset.scalar_type() == at::kFloat &&
              scale.is_contiguous() && offset.is_contiguous() && scale.numel() == N * (K / kBlock) &&
              offset.numel() == N * (K / kBlock), "scale and offset must be contiguous float32 [N, K / 32]");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float *sp = scale.data_ptr<float>(), *op = offset.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Threads split the weight's rows; each streams its rows once per tile of up to 8 rows of x,
  // in chunks small enough to stay in cache between tiles.
  constexpr int64_t kChunk = 64;
  at::parallel_for(0, N, kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kChunk) {
      const int64_t n1 = std::min(end, n0 + kChunk);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
        const int64_t mt = std::min(kMaxTile, M - m0);
        kTiles[mt](xp + m0 * K, K, qp, sp, op, yp + m0 * N, N, n0, n1);
      }
    }
  });
  return y;
}

TORCH_LIBRARY(tandem, m) {
  m.def("block_gemm(Tensor x, Tensor q, Tensor scale, Tensor offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("block_gemm", &block_gemm);
}
