// Decode attention read straight from the paged KV cache: each sequence's one query token against
// its whole KV, page by page, without first gathering the pages into a contiguous tensor (the torch
// backend's gather copies every page of every sequence on every layer). AVX2 + FMA: float32 math
// over a float32 or bfloat16 cache (widened as it is read), the output in the query's dtype.
// Registered as torch.ops.tandem.paged_decode_attention.
//
// The query heads that share a kv head (a GQA group) go together: each key and value row is read
// once for the group, the scores of 8 keys and the weighted sums of 32 dims stay in registers
// (no dependent chain of multiply-adds, no horizontal sum per key), and the next rows are
// prefetched, since a sequence's pages lie anywhere in a pool of gigabytes. Against a version that
// took each query head and key in turn: half the time on KV that sits in cache; 0.88x and 0.85x of
// a whole bfloat16 decode step of 8 and 16 sequences in a model (README, Performance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "exp_nonpositive.h"
#include "isa_cap.h"
#include "vec8.h"

namespace {

using tandem_vec8::dispatch;
using tandem_vec8::float_or_bf16;
using tandem_exp::exp_nonpositive;
using tandem_vec8::load8;

constexpr int64_t kMaxRows = 256;  // query heads per sequence
// Key rows asked for ahead of their scores. 8 sequences of 350 positions over 30 layers of SmolLM2's
// bfloat16 cache (64 MB on scattered pages, 2-core Zen 5 EPYC): 3.1 ms with 8 rows ahead (one tile),
// 2.7 with 16, 2.35-2.8 with 24, 32 and 48; one tile's work takes about 100 ns, too little to hide a
// read from memory.
constexpr int64_t kKeysAhead = 32;

#define TANDEM_AVX512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < D * static_cast<int64_t>(sizeof(T)); offset += 64) _mm_prefetch(p + offset, _MM_HINT_T0);
}

// 8 vectors of partial sums -> one vector of 8 sums, vector j's in lane j.
inline __m256 sums8(const __m256 (&acc)[8]) {
  const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

TANDEM_AVX512_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

TANDEM_AVX512_TARGET inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Scores of `rows` query rows (q, D apart) that share one kv head against 8 keys (k[j]: token j's
// row of that head): scores[r * ld + j] = q_r . k_j * s. Each row keeps 8 sums in flight, one per key, so the
// multiply-adds never wait on each other, and folds them into one vector at the end.
template <typename T>
inline void scores8(const float* q, int64_t rows, const T* const* k, int64_t D, float s, float* scores, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + r * D + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qd, load8(k[j] + d), acc[j]);
    }
    _mm256_storeu_ps(scores + r * ld, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(s)));
  }
}

// The same with AVX-512 (16 dims a vector; D a multiple of 16) for R rows at once, each key's sums
// folded to 8 lanes first. A key's vector is loaded (and a bfloat16 one widened) once for the R rows:
// with one row at a time, widening the keys took as many instructions as the multiply-adds, for
// every row of the group again. Each row's sums are those of the one-row loop, in the same order.
template <typename T, int R>
TANDEM_AVX512_TARGET void scores8_avx512(const float* q, const T* const* k, int64_t D, float s, float* scores,
                                         int64_t ld) {
  __m512 acc[R][8];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 8; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 qd[R];
    for (int r = 0; r < R; ++r) qd[r] = _mm512_loadu_ps(q + r * D + d);
    for (int j = 0; j < 8; ++j) {
      const __m512 kd = load16(k[j] + d);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(qd[r], kd, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 folded[8];
    for (int j = 0; j < 8; ++j)
      folded[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][j]), _mm512_extractf32x8_ps(acc[r][j], 1));
    _mm256_storeu_ps(scores + r * ld, _mm256_mul_ps(sums8(folded), _mm256_set1_ps(s)));
  }
}

// Rows [0, rows) of q against the 8 keys, three at a time (3 x 8 sums, 3 rows of q and a key: 28 of
// AVX-512's 32 registers).
template <typename T>
TANDEM_AVX512_TARGET void scores8_avx512(const float* q, int64_t rows, const T* const* k, int64_t D, float s,
                                         float* scores, int64_t ld) {
  for (int64_t r0 = 0; r0 < rows; r0 += 3) {
    const float* qr = q + r0 * D;
    float* out = scores + r0 * ld;
    switch (std::min<int64_t>(3, rows - r0)) {
      case 1: scores8_avx512<T, 1>(qr, k, D, s, out, ld); break;
      case 2: scores8_avx512<T, 2>(qr, k, D, s, out, ld); break;
      default: scores8_avx512<T, 3>(qr, k, D, s, out, ld); break;
    }
  }
}

// out[r][d0, d0 + 8C) += sum over tokens t of p[r][t] * v_t[d0, d0 + 8C), for R query rows at once:
// R * C running sums stay in registers while the tokens stream past. A token's R weights are
// broadcast first and its values read a vector at a time, so that 3 rows of 4 vectors fit AVX2's 16
// registers: holding the token's 4 vectors instead left one sum on the stack, each multiply-add of it
// waiting on a store and a load (a quarter of the kernel's samples; the same sums in the same order).
template <typename T, int R, int C>
void weighted_values(const float* p, int64_t ld, const T* const* v, int64_t L, int64_t d0, float* out, int64_t D) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    __m256 pr[R];
    for (int r = 0; r < R; ++r) pr[r] = _mm256_broadcast_ss(p + r * ld + t);
    for (int c = 0; c < C; ++c) {
      const __m256 vt = load8(v[t] + d0 + 8 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(pr[r], vt, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + r * D + d0 + 8 * c, acc[r][c]);
}

// The same with AVX-512: 16 dims a vector, so 3 rows of 64 dims take 12 of its 32 registers.
template <typename T, int R, int C>
TANDEM_AVX512_TARGET void weighted_values_avx512(const float* p, int64_t ld, const T* const* v, int64_t L, int64_t d0,
                                                 float* out, int64_t D) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    __m512 pr[R];
    for (int r = 0; r < R; ++r) pr[r] = _mm512_set1_ps(p[r * ld + t]);
    for (int c = 0; c < C; ++c) {
      const __m512 vt = load16(v[t] + d0 + 16 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(pr[r], vt, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * D + d0 + 16 * c, acc[r][c]);
}

// Rows [0, R) and `chunks` vectors of dims from d0 (8 dims a vector, or 16 where `wide`).
template <typename T, int R>
void weighted_values(const float* p, int64_t ld, const T* const* v, int64_t L, int64_t d0, int64_t chunks, bool wide,
                     float* out, int64_t D) {
  if (wide) {
    switch (chunks) {
      case 1: return weighted_values_avx512<T, R, 1>(p, ld, v, L, d0, out, D);
      case 2: return weighted_values_avx512<T, R, 2>(p, ld, v, L, d0, out, D);
      case 3: return weighted_values_avx512<T, R, 3>(p, ld, v, L, d0, out, D);
      default: return weighted_values_avx512<T, R, 4>(p, ld, v, L, d0, out, D);
    }
  }
  switch (chunks) {
    case 1: return weighted_values<T, R, 1>(p, ld, v, L, d0, out, D);
    case 2: return weighted_values<T, R, 2>(p, ld, v, L, d0, out, D);
    case 3: return weighted_values<T, R, 3>(p, ld, v, L, d0, out, D);
    default: return weighted_values<T, R, 4>(p, ld, v, L, d0, out, D);
  }
}

// The attention of one sequence's query rows that share one kv head (G of them, at q and out),
// against its L keys and values (k[t], v[t]: token t's row of that head). With `stats`, out is left
// unnormalized, sum_t e^(score_t - max) v_t, and stats[2r], stats[2r + 1] get row r's max and sum
// of e^(score_t - max): a part of the sequence's KV, merged with the others by merge_parts.
template <typename T>
void attend_group(const float* q, int64_t G, const T* const* k, const T* const* v, int64_t L, int64_t D, float s,
                  bool wide, float* out, std::vector<float>& scores, float* stats = nullptr) {
  const int64_t Lp = (L + 7) / 8 * 8;  // rows of scores padded to whole vectors
  scores.resize(G * Lp);
  const T* keys[8];
  for (int64_t t0 = 0; t0 < L; t0 += 8) {
    // The rows lie scattered over pages in memory: ask for the keys kKeysAhead rows on (the first
    // tile, all of those), and for this tile's values (read after the softmax), before they are needed.
    for (int64_t t = t0 == 0 ? 8 : t0 + kKeysAhead; t < std::min(L, t0 + kKeysAhead + 8); ++t) prefetch_row(k[t], D);
    for (int64_t t = t0; t < std::min(L, t0 + 8); ++t) prefetch_row(v[t], D);
    for (int j = 0; j < 8; ++j) keys[j] = k[std::min<int64_t>(t0 + j, L - 1)];  // a short tile repeats its last key
    if (wide)
      scores8_avx512(q, G, keys, D, s, scores.data() + t0, Lp);
    else
      scores8(q, G, keys, D, s, scores.data() + t0, Lp);
  }
  // softmax numerators e^(score - max) in place (padding -> exactly 0), each row's 1 / sum
  float inv_sum[kMaxRows];
  for (int64_t r = 0; r < G; ++r) {
    float* sc = scores.data() + r * Lp;
    std::fill(sc + L, sc + Lp, -std::numeric_limits<float>::infinity());
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
      const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(x, m)), _mm256_cmp_ps(x, padding, _CMP_NEQ_OQ));
      _mm256_storeu_ps(sc + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    const float total = hsum(sum);
    inv_sum[r] = 1.f / total;
    if (stats != nullptr) {
      stats[2 * r] = _mm_cvtss_f32(m4);
      stats[2 * r + 1] = total;
    }
  }
  // out_r = sum_t p_r[t] v_t / sum_r: up to 3 rows and 4 vectors of dims at a time (12 sums in registers)
  const int64_t lanes = wide ? 16 : 8;
  for (int64_t r0 = 0; r0 < G; r0 += 3)
    for (int64_t d0 = 0; d0 < D; d0 += 4 * lanes) {
      const int64_t chunks = std::min<int64_t>(4, (D - d0) / lanes);
      const float* p = scores.data() + r0 * Lp;
      float* o = out + r0 * D;
      switch (std::min<int64_t>(3, G - r0)) {
        case 1: weighted_values<T, 1>(p, Lp, v, L, d0, chunks, wide, o, D); break;
        case 2: weighted_values<T, 2>(p, Lp, v, L, d0, chunks, wide, o, D); break;
        default: weighted_values<T, 3>(p, Lp, v, L, d0, chunks, wide, o, D); break;
      }
    }
  if (stats != nullptr) return;
  for (int64_t r = 0; r < G; ++r) {
    const __m256 inv = _mm256_set1_ps(inv_sum[r]);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + r * D + d, _mm256_mul_ps(inv, _mm256_loadu_ps(out + r * D + d)));
  }
}

// A sequence's KV of more than kPart positions is cut into equal parts of at most kPart, attended
// apart and merged: a decode step of one sequence has as many tasks as kv heads otherwise (three
// for SmolLM2, on two cores: one waits half the time). The cut depends on the length alone, not on
// the batch or the threads, so a sequence's attention is the same in any step. A one-sequence step
// of SmolLM2 at 350 positions took 0.976-0.988x the time of whole-KV tasks (three runs, both forms
// alternated in one process, 2-core Xeon); at two and eight sequences the same.
constexpr int64_t kPart = 256;

// Rows out[r] (D values) of one sequence's kv head from its parts' unnormalized outputs and
// (max, sum) stats: each part weighted by e^(its max - the overall max), as one softmax would.
inline void merge_parts(const float* part_out, const float* part_stats, int64_t parts, int64_t G, int64_t D,
                        float* out) {
  for (int64_t r = 0; r < G; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, part_stats[(p * G + r) * 2]);
    float total = 0.f;
    float* o = out + r * D;
    std::fill(o, o + D, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float w = std::exp(part_stats[(p * G + r) * 2] - m);
      total += w * part_stats[(p * G + r) * 2 + 1];
      const float* po = part_out + (p * G + r) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * po[d];
    }
    for (int64_t d = 0; d < D; ++d) o[d] /= total;
  }
}

// One task per sequence, kv head and part of its KV: the head's G query heads read that head's rows
// of the part's positions, out of the last `window` positions where window > 0 (a sliding-window
// layer), else all.
template <typename T>
void attend(const float* qp, const T* kp, const T* vp, float* op, const int64_t* table, const int64_t* lens,
            int64_t B, int64_t H, int64_t D, int64_t P, int64_t KVH, int64_t W, int64_t window, float s, bool wide) {
  const int64_t G = H / KVH;
  std::vector<int64_t> first_task(B + 1, 0), parts(B), first_pos(B), part_len(B), first_split(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    first_pos[b] = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    const int64_t L = lens[b] - first_pos[b];
    parts[b] = (L + kPart - 1) / kPart;
    part_len[b] = (L + parts[b] - 1) / parts[b];
    first_task[b + 1] = first_task[b] + KVH * parts[b];
    first_split[b + 1] = first_split[b] + (parts[b] > 1 ? KVH * parts[b] : 0);
  }
  // the parts' unnormalized outputs and stats, for the sequences cut into more than one
  std::vector<float> part_out(first_split[B] * G * D), part_stats(first_split[B] * G * 2);
  at::parallel_for(0, first_task[B], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const T*> k, v;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = std::upper_bound(first_task.begin(), first_task.end(), i) - first_task.begin() - 1;
      const int64_t j = i - first_task[b], h = j / parts[b], part = j % parts[b];
      const int64_t start = first_pos[b] + part * part_len[b];
      const int64_t L = std::min(part_len[b], lens[b] - start);
      const int64_t* pages = table + b * W;
      k.resize(L);
      v.resize(L);
      for (int64_t t = 0; t < L;) {  // a page's rows at a time (a division per row took a tenth of the call)
        const int64_t pos = start + t, in_page = pos % P, n = std::min(P - in_page, L - t);
        const int64_t first = ((pages[pos / P] * P + in_page) * KVH + h) * D;
        for (int64_t i = 0; i < n; ++i, ++t) {
          k[t] = kp + first + i * KVH * D;
          v[t] = vp + first + i * KVH * D;
        }
      }
      const float* q = qp + (b * H + h * G) * D;
      if (parts[b] == 1) {
        attend_group(q, G, k.data(), v.data(), L, D, s, wide, op + (b * H + h * G) * D, scores);
      } else {
        const int64_t slot = first_split[b] + j;  // (h, part) of this sequence's split tasks
        attend_group(q, G, k.data(), v.data(), L, D, s, wide, part_out.data() + slot * G * D, scores,
                     part_stats.data() + slot * G * 2);
      }
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    if (parts[b] == 1) continue;
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t slot = first_split[b] + h * parts[b];
      merge_parts(part_out.data() + slot * G * D, part_stats.data() + slot * G * 2, parts[b], G, D,
                  op + (b * H + h * G) * D);
    }
  }
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [pages, page_size, KVH, D]; page_table [B, W] (pages of each
// sequence, padded); kv_lens [B] -> [B, H, D] in q's dtype. Query head h reads KV head h / (H / KVH).
// window > 0: each query sees only its sequence's last `window` positions (its own included).
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& page_table, const at::Tensor& kv_lens, double scale,
                                  int64_t window, int64_t avx512) {
  TORCH_CHECK(q_in.dim() == 3 && float_or_bf16(q_in.scalar_type()),
              "q must be float32 or bfloat16 [B, H, D]");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && float_or_bf16(cache_dtype) &&
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
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no window), got ", window);
  TORCH_CHECK(avx512 != 1 || (tandem_isa::avx512_runs() && D % 16 == 0),
              "paged_decode_attention: avx512=1 needs AVX-512 F and BW and a head_dim that is a multiple of 16 "
              "(and no TANDEM_CPU_ISA=avx2)");
  const bool wide = avx512 != 0 && tandem_isa::avx512_runs() && D % 16 == 0;
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] > 0 && lens[b] <= W * P, "kv_lens[", b, "] = ", lens[b], " is outside (0, ", W * P, "]");
  auto out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  dispatch(cache_dtype, [&]<typename T>() {
    attend(q.data_ptr<float>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), out.data_ptr<float>(), table, lens, B, H,
           D, P, KVH, W, window, s, wide);
  });
  return out.to(q_in.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor kv_lens, float scale, int window=0, int avx512=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
