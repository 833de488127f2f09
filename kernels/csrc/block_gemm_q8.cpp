// y = x @ W.T for a weight kept as GGUF keeps Q8_0: 32-wide blocks of int8 values with a float16
// scale per block and no offset: W[n, 32b + i] = q[n, 32b + i] * scale[n, b]. A weight streams 1.0625
// bytes here against block_gemm's 1.25 (its float32 scale and offset per block); GGUF files keep
// embeddings and LM heads in this form (SmolLM2's Q4_1 file: its 28M-weight tied LM head, the
// largest single product of a decode step).
//
// Each weight is rebuilt in float32 as block_gemm rebuilds it (the float16 scale widens exactly and
// q * scale is exact, |q| < 2^8), so it equals the file's dequantized value bit for bit, and the
// products are float32's. AVX2: 8 values widened, converted and scaled at a time, summed as
// block_gemm sums them (its products bit for bit); AVX-512 (block_tiles_avx512.h): 16 at a time,
// where the CPU has it (F and BW), or as asked. Registered as torch.ops.tandem.block_gemm_q8.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>

#include "block_tiles_avx512.h"
#include "block_weights.h"

namespace {

using tandem_blocks::kBlock;
using tandem_blocks::kMaxTile;

template <int MT>
void tile_avx2(const float* x, int64_t K, const int8_t* q, const uint16_t* scale, const uint16_t*, float* y,
               int64_t N, int64_t n0, int64_t n1) {
  constexpr int A = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    tandem_blocks::prefetch_ahead(q, K, n, N);
    tandem_blocks::prefetch_ahead(scale, nb * 2, n, N);
    __m256 acc[MT][A];
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 s = _mm256_set1_ps(_cvtsh_ss(scale[n * nb + b]));
      const int8_t* qb = q + n * K + b * kBlock;
      __m256 w[4];
      for (int j = 0; j < 4; ++j) {
        const __m128i values = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * j));
        w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values)), s);
      }
      tandem_blocks::accumulate_block<MT, A>(w, x, K, b, acc);
    }
    tandem_blocks::store_sums<MT, A>(acc, y, N, n);
  }
}

template <int MT>
TANDEM_AVX512_TARGET void tile_avx512(const float* x, int64_t K, const int8_t* q, const uint16_t* scale,
                                      const uint16_t*, float* y, int64_t N, int64_t n0, int64_t n1) {
  tandem_blocks::tile_avx512<MT, tandem_blocks::Bytes>(x, K, q, scale, nullptr, y, N, n0, n1);
}

using TileFn = void (*)(const float*, int64_t, const int8_t*, const uint16_t*, const uint16_t*, float*, int64_t,
                        int64_t, int64_t);
constexpr TileFn kAvx2[kMaxTile + 1] = {nullptr, tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>,
                                        tile_avx2<5>, tile_avx2<6>, tile_avx2<7>, tile_avx2<8>};
constexpr TileFn kAvx512[kMaxTile + 1] = {nullptr, tile_avx512<1>, tile_avx512<2>, tile_avx512<3>, tile_avx512<4>,
                                          tile_avx512<5>, tile_avx512<6>, tile_avx512<7>, tile_avx512<8>};

}  // namespace

// `avx512`: -1 where the CPU has it, 0 never (AVX2), 1 always (refused where the CPU lacks it).
at::Tensor block_gemm_q8(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale, int64_t tile_rows,
                         int64_t avx512) {
  tandem_blocks::check_bytes(x_in, q, scale);
  const at::Tensor x = x_in.contiguous();
  const int64_t N = q.size(0);
  return tandem_blocks::multiply_f16("block_gemm_q8", x, q.data_ptr<int8_t>(), N, scale, nullptr, kAvx2, kAvx512,
                                     tile_rows, avx512);
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("block_gemm_q8(Tensor x, Tensor q, Tensor scale, int tile_rows=0, int avx512=-1) -> Tensor", &block_gemm_q8);
}
