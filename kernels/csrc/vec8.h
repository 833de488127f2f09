// Eight values in an AVX2 register, whatever a tensor stores them as: float32 as they are, bfloat16
// widened to float32 on load and rounded back (to nearest, ties to even, as torch rounds) on store.
// Kernels do their math in float32 and call round8<T> where the torch code they replace would have
// rounded an intermediate result to T.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace tandem_vec8 {

// The tensor dtypes these helpers read and write.
inline bool float_or_bf16(c10::ScalarType dtype) { return dtype == c10::kFloat || dtype == c10::kBFloat16; }

// Calls fn.template operator()<T>() with T the C++ type of `dtype`, one of those two.
template <typename Fn>
void dispatch(c10::ScalarType dtype, Fn&& fn) {
  if (dtype == c10::kBFloat16)
    fn.template operator()<c10::BFloat16>();
  else
    fn.template operator()<float>();
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The bfloat16 bits of v (in the low half of each 32-bit lane): round to nearest even; NaN stays
// a quiet NaN (c10::BFloat16's rounding).
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = bf16_bits(v);  // each below 2^16: packing saturates nothing
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// v rounded to T's precision, kept in float32.
template <typename T>
inline __m256 round8(__m256 v) {
  return v;
}

template <>
inline __m256 round8<c10::BFloat16>(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}

}  // namespace tandem_vec8
