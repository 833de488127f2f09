// What the block kernels share: the layouts of a weight held as 32-wide blocks (block_gemm.cpp's int8
// blocks: q [N, K] int8, scale and offset [N, K / 32] float32; and GGUF's own 4-bit and 8-bit forms),
// their checks, and the loop that splits the weight's rows between threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace tandem_blocks {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxTile = 8;  // rows of x per pass over the weight
// A tile of x is read again for every weight row, so it has to stay in L1 (32 KiB on the CPUs
// measured) beside the weight streaming through: 8 rows of K = 576 float32 do (18 KiB), 8 of
// K = 1536 (48 KiB) do not, and SmolLM2's down projection at 8 rows took 8.3 ms as one tile of 8
// against 5.2 as two of 4 (2-core AVX2 EPYC, all 30 layers).
constexpr int64_t kTileBytes = 24 * 1024;

// Each weight row is asked for (_mm_prefetch) `prefetch_rows` rows before the kernels reach it: a
// decode step streams every weight from memory once, and the hardware's own prefetcher, following
// each core's rows, left the kernels waiting. SmolLM2's LM head (30 MB, one row of x, caches flushed
// before each product) took 0.71-0.73x the time with 4 rows ahead, the same with 8, 0.79x with 16;
// its 4-bit layers 0.88x (AVX-512) and 0.94x (AVX2), on a 2-core Xeon. 0 turns it off
// (set_weight_prefetch, for `tandem bench step --compare weight-prefetch`).
inline int64_t prefetch_rows = 4;

// Row n + prefetch_rows of an array of [N, row_bytes] (q, a scale or an offset), toward L1.
inline void prefetch_ahead(const void* base, int64_t row_bytes, int64_t n, int64_t N) {
  if (prefetch_rows == 0 || n + prefetch_rows >= N) return;
  const char* row = static_cast<const char*>(base) + (n + prefetch_rows) * row_bytes;
  for (int64_t offset = 0; offset < row_bytes; offset += 64) _mm_prefetch(row + offset, _MM_HINT_T0);
}

// Rows of x per tile: `asked` (1 to kMaxTile; benchmarks compare), or for 0 as many rows of K
// elements of `element_size` bytes as fit kTileBytes.
inline int64_t tile_rows(int64_t asked, int64_t K, int64_t element_size) {
  TORCH_CHECK(asked >= 0 && asked <= kMaxTile, "tile_rows must be 0 (as many as fit L1) or 1-", kMaxTile,
              ", got ", asked);
  return asked > 0 ? asked : std::clamp<int64_t>(kTileBytes / (K * element_size), 1, kMaxTile);
}

// x [M, K] float32 against the blocks of an [N, K] weight: what each kernel checks before it runs.
inline void check(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  const int64_t K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && K % kBlock == 0, "q must be [N, K] with K = x.size(1), a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && offset.scalar_type() == at::kFloat &&
              scale.is_contiguous() && offset.is_contiguous() && scale.numel() == N * (K / kBlock) &&
              offset.numel() == N * (K / kBlock), "scale and offset must be contiguous float32 [N, K / 32]");
}

// The same for 4-bit blocks as GGUF keeps Q4_0 and Q4_1 (block_gemm_q4.cpp): q [N, K / 2] uint8, scale and
// offset [N, K / 32] float16.
inline void check_nibbles(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous() && K % kBlock == 0 &&
              q.size(1) == K / 2, "q must be contiguous uint8 [N, K / 2] with K = x.size(1), a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && offset.scalar_type() == at::kHalf && scale.is_contiguous() &&
              offset.is_contiguous() && scale.numel() == N * (K / kBlock) && offset.numel() == N * (K / kBlock),
              "scale and offset must be contiguous float16 [N, K / 32]");
}

// And for int8 blocks with a float16 scale, as GGUF keeps Q8_0 (block_gemm_q8.cpp): q [N, K] int8,
// scale [N, K / 32] float16.
inline void check_bytes(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && K % kBlock == 0 && q.size(1) == K,
              "q must be contiguous int8 [N, K] with K = x.size(1), a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.numel() == N * (K / kBlock),
              "scale must be contiguous float16 [N, K / 32]");
}

// Threads split the weight's N rows; each streams its rows once per tile of up to `rows_per_tile`
// rows of x, in chunks small enough to stay in cache between tiles: tile(m0, rows, n0, n1).
template <typename Tile>
void for_each_tile(int64_t M, int64_t N, int64_t rows_per_tile, const Tile& tile) {
  constexpr int64_t kChunk = 64;  // weight rows per task
  at::parallel_for(0, N, kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kChunk) {
      const int64_t n1 = std::min(end, n0 + kChunk);
      for (int64_t m0 = 0; m0 < M; m0 += rows_per_tile) tile(m0, std::min(rows_per_tile, M - m0), n0, n1);
    }
  });
}

// y [M, N] float32 = x @ W.T, with x [M, K] already in the element type the tiles read (T) and
// contiguous; tiles[r] multiplies r rows of x against weight rows [n0, n1); rows per tile as
// `tile_rows` says.
template <typename T, typename TileFn>
at::Tensor multiply(const at::Tensor& x, const T* xp, const at::Tensor& q, const at::Tensor& scale,
                    const at::Tensor& offset, const TileFn* tiles, int64_t asked_tile_rows) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const int8_t* qp = q.data_ptr<int8_t>();
  const float *sp = scale.data_ptr<float>(), *op = offset.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t rows_per_tile = tile_rows(asked_tile_rows, K, sizeof(T));
  for_each_tile(M, N, rows_per_tile, [&](int64_t m0, int64_t rows, int64_t n0, int64_t n1) {
    tiles[rows](xp + m0 * K, K, qp, sp, op, yp + m0 * N, N, n0, n1);
  });
  return y;
}

// The AVX2 float32 kernels' inner steps (block_gemm.cpp, block_gemm_q4.cpp): one block's 32 rebuilt
// weights `w` (4 x 8) times rows [0, MT) of x, each row's products spread over its A sums...
template <int MT, int A>
inline void accumulate_block(const __m256 (&w)[4], const float* x, int64_t K, int64_t b, __m256 (&acc)[MT][A]) {
  for (int m = 0; m < MT; ++m) {
    const float* xb = x + m * K + b * kBlock;
    for (int j = 0; j < 4; ++j) acc[m][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[m][j % A]);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ...and, after the last block, each row's sums added into y[m, n].
template <int MT, int A>
inline void store_sums(const __m256 (&acc)[MT][A], float* y, int64_t N, int64_t n) {
  for (int m = 0; m < MT; ++m) {
    __m256 t = acc[m][0];
    for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[m][a]);
    y[m * N + n] = hsum(t);
  }
}

}  // namespace tandem_blocks
