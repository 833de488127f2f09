// Causal attention of one sequence's prompt piece, read from the paged KV cache (float32 or bfloat16) where it lies
// and multiplied in bfloat16 with AVX512-BF16's dot products (float32 sums), for a float32 model
// whose prompt products run in bfloat16 (`--prefill-dtype bfloat16`). It replaces, for that case,
// a gather of the sequence's pages, their conversion to bfloat16 and torch's CPU flash attention,
// which ran at ~75 GFLOP/s on a 2-core Zen 5 (1.34 ms a layer for a 300-token prompt of SmolLM2):
// most of a prefill's time besides the projections. Registered as torch.ops.tandem.prompt_attention_bf16.
//
// Rounding: q, K and V are rounded to bfloat16 (nearest even, as torch rounds), the scores summed in
// float32, the softmax in float32 (e^x within 2 ulp), its weights rounded to bfloat16 for the sum
// over V and the result divided by their float32 sum. So it is a bfloat16 attention, within the
// same tolerance as SDPA over bfloat16 operands (tests/unit/test_prompt_attention.py), not float32's.
//
// Layout: the sequence's K and V of each kv head are packed once per call, K as blocks of 16 keys
// whose dims go in pairs ([block][dim / 2][key][2]: one vector is 16 keys' values of two dims, so a
// dot product over a query's dim pair scores 16 keys at once), V as pairs of keys ([key / 2][dim][2]:
// one vector is two keys' values of 16 dims, weighted by the two keys' softmax weights). Four query
// rows go together, so each K or V vector loaded serves four rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "exp_nonpositive.h"
#include "isa_cap.h"
#include "vec8.h"

#define TANDEM_BF16_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace {

constexpr int64_t kKeys = 16;  // keys scored per vector
constexpr int64_t kRows = 4;   // query rows that share each K and V vector loaded
constexpr int64_t kSlice = 64;  // dims of the output summed per pass over V (four vectors)

using tandem_exp::exp_nonpositive;

// A cache value as bfloat16 bits: float32 rounded to nearest even (c10::BFloat16's rounding, as
// torch's .to(torch.bfloat16)); bfloat16 as it is.
inline uint16_t to_bf16(float f) { return c10::BFloat16(f).x; }
inline uint16_t to_bf16(c10::BFloat16 b) { return b.x; }

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

struct Packed {
  int64_t blocks;            // of kKeys keys; both K and V cover blocks * kKeys keys (zeros past the end)
  std::vector<uint16_t> k;   // [KVH][blocks][D / 2][kKeys][2]
  std::vector<uint16_t> v;   // [KVH][blocks * kKeys / 2][D][2]
};

// The sequence's first L keys and values of every kv head (a float32 or bfloat16 cache), packed as above.
template <typename T>
Packed pack(const T* k_cache, const T* v_cache, const int64_t* pages, int64_t L, int64_t P, int64_t KVH,
            int64_t D) {
  Packed out;
  out.blocks = (L + kKeys - 1) / kKeys;
  const int64_t per_head = out.blocks * kKeys * D;
  out.k.assign(KVH * per_head, 0);
  out.v.assign(KVH * per_head, 0);
  at::parallel_for(0, KVH * out.blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / out.blocks, b = task % out.blocks;
      uint16_t* kb = out.k.data() + g * per_head + b * kKeys * D;
      uint16_t* vb = out.v.data() + g * per_head + b * kKeys * D;  // the block's kKeys / 2 pairs
      for (int64_t j = 0; j < kKeys && b * kKeys + j < L; ++j) {
        const int64_t pos = b * kKeys + j;
        const int64_t row = ((pages[pos / P] * P + pos % P) * KVH + g) * D;
        for (int64_t d = 0; d < D; ++d) {
          kb[((d / 2) * kKeys + j) * 2 + d % 2] = to_bf16(k_cache[row + d]);
          vb[((j / 2) * D + d) * 2 + j % 2] = to_bf16(v_cache[row + d]);
        }
      }
    }
  });
  return out;
}

// Query rows [t0, t0 + R) of head h (positions start + t) against the packed K and V of its kv head,
// into out rows (H * D apart). qb: the piece's queries in bfloat16, [T][H][D]; scratch: R rows of
// scores, then of weights.
template <int R>
TANDEM_BF16_TARGET void attend_rows(const uint16_t* qb, const Packed& kv, int64_t g, int64_t h, int64_t t0,
                                    int64_t start, int64_t H, int64_t D, float scale, float* out,
                                    std::vector<float>& scores, std::vector<uint16_t>& weights) {
  const int64_t last = start + t0 + R - 1;  // the last row's position: keys [0, last] are read
  const int64_t blocks = last / kKeys + 1, width = blocks * kKeys;
  const int64_t per_head = kv.blocks * kKeys * D;
  const uint16_t* kp = kv.k.data() + g * per_head;
  const uint16_t* vp = kv.v.data() + g * per_head;
  scores.resize(R * width);
  weights.resize(R * width);
  const uint32_t* q32[R];
  for (int r = 0; r < R; ++r) q32[r] = reinterpret_cast<const uint32_t*>(qb + ((t0 + r) * H + h) * D);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint16_t* kb = kp + b * kKeys * D;
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512bh keys = as_bh(_mm512_loadu_si512(kb + p * kKeys * 2));
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], keys, as_bh(_mm512_set1_epi32(static_cast<int>(q32[r][p]))));
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores.data() + r * width + b * kKeys, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
  }
  float sums[R];
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int r = 0; r < R; ++r) {
    const int64_t seen = start + t0 + r + 1;  // keys [0, seen)
    float* s = scores.data() + r * width;
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < width; j += kKeys) {
      const __mmask16 valid = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j))),
                                                      _mm512_set1_epi32(static_cast<int>(seen)));
      m = _mm512_mask_max_ps(m, valid, m, _mm512_loadu_ps(s + j));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 total = _mm512_setzero_ps();
    uint16_t* w = weights.data() + r * width;
    for (int64_t j = 0; j < width; j += kKeys) {
      const __mmask16 valid = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j))),
                                                      _mm512_set1_epi32(static_cast<int>(seen)));
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), top)));
      total = _mm512_add_ps(total, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    }
    sums[r] = _mm512_reduce_add_ps(total);
  }
  for (int64_t d0 = 0; d0 < D; d0 += kSlice) {
    __m512 o[R][kSlice / 16];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kSlice / 16; ++c) o[r][c] = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < width / 2; ++pair) {
      const uint16_t* vrow = vp + (pair * D + d0) * 2;
      __m512bh values[kSlice / 16];
      for (int c = 0; c < kSlice / 16; ++c) values[c] = as_bh(_mm512_loadu_si512(vrow + c * 32));
      for (int r = 0; r < R; ++r) {
        uint32_t two;
        std::memcpy(&two, weights.data() + r * width + pair * 2, 4);
        const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(two)));
        for (int c = 0; c < kSlice / 16; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], values[c], p);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
      float* row = out + ((t0 + r) * H + h) * D + d0;
      for (int c = 0; c < kSlice / 16; ++c) _mm512_storeu_ps(row + c * 16, _mm512_mul_ps(o[r][c], inv));
    }
  }
}

}  // namespace

// q [T, H, D] float32: a prompt piece's queries, row t at position kv_len - T + t; k_cache, v_cache
// [pages, page_size, KVH, D] float32 or bfloat16 holding the sequence's first kv_len positions (these rows'
// keys and values written already) in `pages` [n]; each row attends to positions [0, its own].
// -> [T, H, D] float32. Query head h reads kv head h / (H / KVH).
at::Tensor prompt_attention_bf16(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& pages, int64_t kv_len, double scale) {
  TORCH_CHECK(tandem_isa::avx512_bf16_runs(),
              "prompt_attention_bf16 needs a CPU with AVX512-BF16, not capped by TANDEM_CPU_ISA=avx2");
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "q must be float32 [T, H, D]");
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && tandem_vec8::float_or_bf16(cache_dtype) &&
              k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == cache_dtype &&
              v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous float32 or bfloat16 [pages, page_size, kv_heads, head_dim]");
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t P = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % kSlice == 0, "head_dim must match the cache and be a multiple of ", kSlice,
              ", got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads (", H, ") must be a multiple of kv heads (", KVH, ")");
  TORCH_CHECK(pages.dim() == 1 && pages.scalar_type() == at::kLong && pages.is_contiguous(),
              "pages must be contiguous int64 [n]");
  TORCH_CHECK(T >= 1 && kv_len >= T && kv_len <= pages.numel() * P, "kv_len = ", kv_len, " must hold the ", T,
              " query rows and fit the ", pages.numel(), " pages of ", P);
  const int64_t* pp = pages.data_ptr<int64_t>();
  for (int64_t i = 0; i < (kv_len + P - 1) / P; ++i)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < k_cache.size(0), "pages[", i, "] = ", pp[i], " is outside the cache's ",
                k_cache.size(0));
  const at::Tensor qb = q_in.contiguous().to(at::kBFloat16);
  Packed kv;
  tandem_vec8::dispatch(cache_dtype, [&]<typename C>() {
    kv = pack(k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), pp, kv_len, P, KVH, D);
  });
  auto out = at::empty({T, H, D}, q_in.options());
  const int64_t groups = (T + kRows - 1) / kRows, G = H / KVH, start = kv_len - T;
  const auto* q16 = reinterpret_cast<const uint16_t*>(qb.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // Later rows read more keys: tasks go in the order first, last, second, second to last, ..., so
  // that the contiguous ranges the threads take cost about the same.
  at::parallel_for(0, groups * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<uint16_t> weights;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / H, h = task % H;
      const int64_t group = i % 2 == 0 ? i / 2 : groups - 1 - i / 2;
      const int64_t t0 = group * kRows, rows = std::min(kRows, T - t0);
      switch (rows) {
        case 4: attend_rows<4>(q16, kv, h / G, h, t0, start, H, D, s, op, scores, weights); break;
        case 3: attend_rows<3>(q16, kv, h / G, h, t0, start, H, D, s, op, scores, weights); break;
        case 2: attend_rows<2>(q16, kv, h / G, h, t0, start, H, D, s, op, scores, weights); break;
        default: attend_rows<1>(q16, kv, h / G, h, t0, start, H, D, s, op, scores, weights); break;
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("prompt_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor pages, int kv_len, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("prompt_attention_bf16", &prompt_attention_bf16);
}
