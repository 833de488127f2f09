// Decode attention read straight from the paged KV cache: each sequence's one query token against
// its whole KV, page by page, without first gathering the pages into a contiguous tensor (the torch
// backend's gather copies every page of every sequence on every layer). AVX2 + FMA: float32 math
// over a float32 or bfloat16 cache (widened as it is read), the output in the query's dtype.
// Registered as torch.ops.tandem.paged_decode_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "vec8.h"

namespace {

using tandem_vec8::load8;

constexpr int64_t kMaxRows = 256;  // query heads per sequence

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (softmax of scores minus their maximum), Cephes' single-precision polynomial:
// within 2 ulp of std::exp, flushing x < -87 to e^-87 (~1e-38, not a denormal).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i < d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

// The attention itself, on checked inputs: q [B, H, D] and out [B, H, D] float32, the caches of T.
template <typename T>
void attend(const float* qp, const T* kp, const T* vp, float* op, const int64_t* table, const int64_t* lens,
            int64_t B, int64_t H, int64_t D, int64_t P, int64_t KVH, int64_t W, float s) {
  const int64_t G = H / KVH;
  // A task is one sequence with all its kv heads (its pages read front to back once), or, when
  // there are too few sequences to keep the threads busy, one sequence and one kv head.
  const int64_t splits = B >= 2 * at::get_num_threads() ? 1 : KVH;
  const int64_t heads_per_task = KVH / splits;
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / splits, h0 = i % splits * heads_per_task, L = lens[b];
      const int64_t Lp = (L + 7) / 8 * 8;  // rows of scores padded to whole vectors
      const int64_t rows = heads_per_task * G;  // query heads of this task: h0 * G onwards
      const int64_t* pages = table + b * W;
      const float* qb = qp + (b * H + h0 * G) * D;
      scores.assign(rows * Lp, -std::numeric_limits<float>::infinity());
      // scores[r][t] = q_r . k_t * scale, page by page
      for (int64_t t0 = 0; t0 < L; t0 += P) {
        const T* k = kp + (pages[t0 / P] * P * KVH + h0) * D;
        for (int64_t t = t0; t < std::min(L, t0 + P); ++t, k += KVH * D)
          for (int64_t r = 0; r < rows; ++r) scores[r * Lp + t] = dot(qb + r * D, k + r / G * D, D) * s;
      }
      // softmax numerators e^(score - max) in place, and each head's 1 / sum
      float inv_sum[kMaxRows];
      for (int64_t r = 0; r < rows; ++r) {
        float* sc = scores.data() + r * Lp;
        __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < Lp; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + t));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(m4));
        const __m256 padding = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < Lp; t += 8) {
          const __m256 x = _mm256_loadu_ps(sc + t);
          // padding (-inf) becomes exactly 0
          const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(x, m)), _mm256_cmp_ps(x, padding, _CMP_NEQ_OQ));
          _mm256_storeu_ps(sc + t, e);
          sum = _mm256_add_ps(sum, e);
        }
        inv_sum[r] = 1.f / hsum(sum);
      }
      // out_r = sum_t p_r[t] v_t / sum_r, page by page
      float* ob = op + (b * H + h0 * G) * D;  // this task's output rows
      std::fill(ob, ob + rows * D, 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += P) {
        const T* v = vp + (pages[t0 / P] * P * KVH + h0) * D;
        for (int64_t t = t0; t < std::min(L, t0 + P); ++t, v += KVH * D)
          for (int64_t r = 0; r < rows; ++r) {
            const __m256 p = _mm256_set1_ps(scores[r * Lp + t]);
            const T* vr = v + r / G * D;
            float* o = ob + r * D;
            for (int64_t d0 = 0; d0 < D; d0 += 8)
              _mm256_storeu_ps(o + d0, _mm256_fmadd_ps(p, load8(vr + d0), _mm256_loadu_ps(o + d0)));
          }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m256 inv = _mm256_set1_ps(inv_sum[r]);
        for (int64_t d0 = 0; d0 < D; d0 += 8)
          _mm256_storeu_ps(ob + r * D + d0, _mm256_mul_ps(inv, _mm256_loadu_ps(ob + r * D + d0)));
      }
    }
  });
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [pages, page_size, KVH, D]; page_table [B, W] (pages of each
// sequence, padded); kv_lens [B] -> [B, H, D] in q's dtype. Query head h reads KV head h / (H / KVH).
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& page_table, const at::Tensor& kv_lens, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16),
              "q must be float32 or bfloat16 [B, H, D]");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && (cache_dtype == at::kFloat || cache_dtype == at::kBFloat16) &&
              k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == cache_dtype &&
              v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous float32 or bfloat16 [pages, page_size, kv_heads, head_dim]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0, "head_dim must match the cache and be a multiple of 8");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == B && page_table.scalar_type() == at::kLong &&
              page_table.is_contiguous(), "page_table must be contiguous int64 [B, W]");
  TORCH_CHECK(kv_lens.numel() == B && kv_lens.scalar_type() == at::kLong && kv_lens.is_contiguous(),
              "kv_lens must be contiguous int64 [B]");
  const int64_t W = page_table.size(1);
  TORCH_CHECK(H <= kMaxRows, "at most ", kMaxRows, " query heads, got ", H);
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] > 0 && lens[b] <= W * P, "kv_lens[", b, "] = ", lens[b], " is outside (0, ", W * P, "]");
  auto out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  if (cache_dtype == at::kBFloat16)
    attend(q.data_ptr<float>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
           out.data_ptr<float>(), table, lens, B, H, D, P, KVH, W, s);
  else
    attend(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>(), table,
           lens, B, H, D, P, KVH, W, s);
  return out.to(q_in.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor kv_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
