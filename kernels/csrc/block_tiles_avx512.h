// The AVX-512 loop that block_gemm_q4.cpp and block_gemm_q8.cpp share: rows [0, MT) of x against
// weight rows [n0, n1) of blocks kept as GGUF keeps them (a float16 scale per 32-wide block, and for
// Q4 a float16 offset). `Block` (Nibbles or Bytes, below) says how one block's 32 weights come back
// as float32 in two registers (Block::rebuild) and how many bytes a block's values take (Block::kBytes); the loop
// widens the scales and offsets 16 blocks at a time, not one by one, and multiplies. With one or
// two rows of x, blocks alternate between two pairs of sums, so that a block's multiply-adds wait on
// the block before last, not the last (the sums' latency, not the loads, bounded the loop).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "block_weights.h"
#include "isa_cap.h"

#define TANDEM_AVX512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))

namespace tandem_blocks {

// The two forms GGUF files keep blocks in, rebuilt in float32 for the loop below (and for the
// bfloat16 tiles, block_tiles_bf16.h, which round what these give).

// Q4_0 and Q4_1 (block_gemm_q4.cpp): 16 bytes a block, element j in byte j's low nibble and 16 + j in
// its high one. Both halves are looked up in a register of the block's 16 possible values (i * scale +
// offset for i in 0..15, one fused multiply-add: rounded as the AVX2 way rounds), one permute each
// (vpermps reads only the low 4 bits of each index, so neither needs a mask; the high half's are
// shifted down first).
struct Nibbles {
  using Value = uint8_t;
  static constexpr int64_t kBytes = kBlock / 2;
  // Weight rows block_gemm_bf16.cpp's tile multiplies side by side. SmolLM2's projections at 8 rows
  // (`tandem bench linear --whole-model`, 2-core Zen 5), against the float32 4-bit kernel in the same
  // run: 0.72-0.77x the time two at a time, 0.80x one at a time; the 8-bit blocks two at a time took
  // 0.87x the float32 8-bit kernel's time, 0.76x one at a time (their values take twice the work to
  // rebuild), so they stay one at a time.
  static constexpr int kBfloat16Rows = 2;

  TANDEM_AVX512_TARGET static void rebuild(const uint8_t* qb, float scale, float offset, __m512& w0, __m512& w1) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(values, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)));
    w0 = _mm512_permutexvar_ps(bytes, table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
};

// Q8_0 (block_gemm_q8.cpp): 32 int8 values a block, no offset.
struct Bytes {
  using Value = int8_t;
  static constexpr int64_t kBytes = kBlock;
  static constexpr int kBfloat16Rows = 1;

  TANDEM_AVX512_TARGET static void rebuild(const int8_t* qb, float scale, float, __m512& w0, __m512& w1) {
    const __m512 s = _mm512_set1_ps(scale);
    const __m128i* p = reinterpret_cast<const __m128i*>(qb);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), s);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), s);
  }
};

// offset: nullptr where the blocks have none (Block::rebuild then gets 0).
template <int MT, typename Block>
TANDEM_AVX512_TARGET void tile_avx512(const float* x, int64_t K, const typename Block::Value* q, const uint16_t* scale,
                                      const uint16_t* offset, float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int64_t kWidth = 32;
  constexpr int P = MT <= 2 ? 2 : 1;  // pairs of sums per row of x
  constexpr int64_t kGroup = 16;      // blocks whose scales and offsets are widened together
  const int64_t nb = K / kWidth;
  alignas(64) float s[kGroup], o[kGroup] = {};
  for (int64_t n = n0; n < n1; ++n) {
    const typename Block::Value* qn = q + n * (nb * Block::kBytes);
    prefetch_ahead(q, nb * Block::kBytes * static_cast<int64_t>(sizeof(typename Block::Value)), n, N);
    prefetch_ahead(scale, nb * 2, n, N);
    if (offset != nullptr) prefetch_ahead(offset, nb * 2, n, N);
    __m512 acc[MT][P][2];
    for (int m = 0; m < MT; ++m)
      for (int p = 0; p < P; ++p) acc[m][p][0] = acc[m][p][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += kGroup) {
      const int64_t size = std::min(kGroup, nb - g);
      const __mmask16 valid = static_cast<__mmask16>((1u << size) - 1);
      _mm512_store_ps(s, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, scale + n * nb + g)));
      if (offset != nullptr) _mm512_store_ps(o, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, offset + n * nb + g)));
      int64_t i = 0;
      for (; i + P <= size; i += P) {
        for (int p = 0; p < P; ++p) {
          const int64_t b = g + i + p;
          __m512 w0, w1;
          Block::rebuild(qn + b * Block::kBytes, s[i + p], o[i + p], w0, w1);
          for (int m = 0; m < MT; ++m) {
            const float* xb = x + m * K + b * kWidth;
            acc[m][p][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[m][p][0]);
            acc[m][p][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[m][p][1]);
          }
        }
      }
      for (; i < size; ++i) {  // an odd block at the end of a group
        const int64_t b = g + i;
        __m512 w0, w1;
        Block::rebuild(qn + b * Block::kBytes, s[i], o[i], w0, w1);
        for (int m = 0; m < MT; ++m) {
          const float* xb = x + m * K + b * kWidth;
          acc[m][0][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[m][0][0]);
          acc[m][0][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[m][0][1]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      __m512 t = _mm512_add_ps(acc[m][0][0], acc[m][0][1]);
      if (P > 1) t = _mm512_add_ps(t, _mm512_add_ps(acc[m][P - 1][0], acc[m][P - 1][1]));
      y[m * N + n] = _mm512_reduce_add_ps(t);
    }
  }
}

// What block_gemm_q4 and block_gemm_q8 do once their operands are checked: y [M, N] = x @ W.T for x
// contiguous float32 and a weight of N rows whose scales (and offsets; nullptr where it has none) are
// float16, with the AVX-512 tiles where `avx512` asks for them (-1: where the CPU has them; 0:
// never; 1: always, refused by `name` where the CPU lacks them), else the AVX2 ones.
template <typename Value, typename TileFn>
at::Tensor multiply_f16(const char* name, const at::Tensor& x, const Value* q, int64_t N, const at::Tensor& scale,
                        const at::Tensor* offset, const TileFn* avx2_tiles, const TileFn* avx512_tiles,
                        int64_t tile_rows_asked, int64_t avx512) {
  TORCH_CHECK(avx512 != 1 || tandem_isa::avx512_runs(), name,
              ": avx512=1 on a CPU without AVX-512 F and BW, or with TANDEM_CPU_ISA=avx2");
  const TileFn* tiles = (avx512 == 1 || (avx512 == -1 && tandem_isa::avx512_runs())) ? avx512_tiles : avx2_tiles;
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const auto* op = offset == nullptr ? nullptr : reinterpret_cast<const uint16_t*>(offset->data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int64_t rows_per_tile = tile_rows(tile_rows_asked, K, sizeof(float));
  for_each_tile(M, N, rows_per_tile, [&](int64_t m0, int64_t rows, int64_t n0, int64_t n1) {
    tiles[rows](xp + m0 * K, K, q, sp, op, yp + m0 * N, N, n0, n1);
  });
  return y;
}

}  // namespace tandem_blocks
