// y = x @ W.T for a weight kept as GGUF keeps Q4_0 and Q4_1: 32-wide blocks of 4-bit values, two to a
// byte, with a float16 scale and offset per block: W[n, 32b + i] = nib(n, b, i) * scale[n, b] + offset[n, b].
// Byte j of a block holds element j in its low nibble and element 16 + j in its high one. A weight
// streams 0.625 bytes here against block_gemm's 1.25 (int8 + two float32 per block) and float32's 4:
// decoding one sequence reads its weights once per step, so the bytes are the time.
//
// Each weight is rebuilt in float32 in registers as block_gemm rebuilds it (the float16 scale and
// offset widen exactly; nib * scale is exact; one rounding for the add), so it equals the GGUF file's
// dequantized value bit for bit, and the products are float32's. Two ways to rebuild:
// - AVX2: widen 8 nibbles to 8 int32, convert, one fused multiply-add with scale and offset;
// - AVX-512: both halves looked up in a register of the block's 16 possible values (i * scale +
//   offset for i in 0..15, one fused multiply-add: rounded as the AVX2 way rounds), one permute
//   each. On a 2-core Xeon (AVX512-BF16, AMX) a pass over all of SmolLM2's projections took
//   0.94-0.96x the time of the former way (the high half widened and converted as with AVX2) at
//   one row, the same at 4 and 8 (three runs alternating both in one process, two threads). The
//   former way had measured better in cache on one thread (0.86-0.94x the int8 kernel's time,
//   against 0.95-0.99x): what a decode step streams decides.
// The AVX-512 functions carry their own target attribute; the operator picks them where the CPU has
// AVX-512 (F and BW), or as asked. Registered as torch.ops.tandem.block_gemm_q4.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>

#include "block_tiles_avx512.h"
#include "block_weights.h"

namespace {

using tandem_blocks::kBlock;
using tandem_blocks::kMaxTile;
constexpr int64_t kBlockBytes = kBlock / 2;

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

inline __m256 widen8(__m128i nibbles) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles)); }

// Rows [0, MT) of x against weight rows [n0, n1), AVX2. As in block_gemm.cpp, each row of x keeps
// A partial sums so that one row's multiply-adds do not wait on each other.
template <int MT>
void tile_avx2(const float* x, int64_t K, const uint8_t* q, const uint16_t* scale, const uint16_t* offset,
               float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int A = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
  const int64_t nb = K / kBlock;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * (K / 2);
    tandem_blocks::prefetch_ahead(q, K / 2, n, N);
    tandem_blocks::prefetch_ahead(scale, nb * 2, n, N);
    tandem_blocks::prefetch_ahead(offset, nb * 2, n, N);
    __m256 acc[MT][A];
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 s = _mm256_set1_ps(half_to_float(scale[n * nb + b]));
      const __m256 o = _mm256_set1_ps(half_to_float(offset[n * nb + b]));
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + b * kBlockBytes));
      const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
      __m256 w[4];
      w[0] = _mm256_fmadd_ps(widen8(lo), s, o);
      w[1] = _mm256_fmadd_ps(widen8(_mm_srli_si128(lo, 8)), s, o);
      w[2] = _mm256_fmadd_ps(widen8(hi), s, o);
      w[3] = _mm256_fmadd_ps(widen8(_mm_srli_si128(hi, 8)), s, o);
      tandem_blocks::accumulate_block<MT, A>(w, x, K, b, acc);
    }
    tandem_blocks::store_sums<MT, A>(acc, y, N, n);
  }
}

// The same with AVX-512: block_tiles_avx512.h's loop over its Nibbles.
template <int MT>
TANDEM_AVX512_TARGET void tile_avx512(const float* x, int64_t K, const uint8_t* q, const uint16_t* scale,
                                      const uint16_t* offset, float* y, int64_t N, int64_t n0, int64_t n1) {
  tandem_blocks::tile_avx512<MT, tandem_blocks::Nibbles>(x, K, q, scale, offset, y, N, n0, n1);
}

using TileFn = void (*)(const float*, int64_t, const uint8_t*, const uint16_t*, const uint16_t*, float*, int64_t,
                        int64_t, int64_t);
constexpr TileFn kAvx2[kMaxTile + 1] = {nullptr, tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>,
                                        tile_avx2<5>, tile_avx2<6>, tile_avx2<7>, tile_avx2<8>};
constexpr TileFn kAvx512[kMaxTile + 1] = {nullptr, tile_avx512<1>, tile_avx512<2>, tile_avx512<3>, tile_avx512<4>,
                                          tile_avx512<5>, tile_avx512<6>, tile_avx512<7>, tile_avx512<8>};

}  // namespace

// `avx512`: -1 where the CPU has it, 0 never (AVX2), 1 always (refused where the CPU lacks it).
at::Tensor block_gemm_q4(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                         const at::Tensor& offset, int64_t tile_rows, int64_t avx512) {
  tandem_blocks::check_nibbles(x_in, q, scale, offset);
  const at::Tensor x = x_in.contiguous();
  const int64_t N = q.size(0);
  return tandem_blocks::multiply_f16("block_gemm_q4", x, q.data_ptr<uint8_t>(), N, scale, &offset, kAvx2, kAvx512,
                                     tile_rows, avx512);
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("block_gemm_q4(Tensor x, Tensor q, Tensor scale, Tensor offset, int tile_rows=0, int avx512=-1) -> Tensor",
        &block_gemm_q4);
}
