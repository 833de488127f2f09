// The small steps of a decoder layer between its projections, one call each where torch takes five
// to eight ops: at a decode step's few rows, each torch op costs more to dispatch than to compute.
// Float32 or bfloat16 tensors, AVX2. Registered as torch.ops.tandem.{rms_norm, add_rms_norm_, rope_,
// silu_mul}.
//
// Each computes what the torch code it replaces computes (tandem/kernels/layer_ops.py), rounding
// for rounding: separate multiplies and adds (the library is built with -ffp-contract=off, so the
// compiler never fuses them into FMAs), 1 / sqrt for rsqrt, and SLEEF's exp, which torch's own
// vectorized silu calls. On bfloat16 tensors torch does each op's math in float32 and rounds its
// result to bfloat16; these kernels round (round8<T>) at the same points. The one difference is
// the order in which RMSNorm sums its squares.
//
// Between the bfloat16 products of a float32 model's prompt pieces (`Linear`'s prefill_dtype), the
// calls also hand bfloat16 to each other: a norm's float32 result rounded once to `out_dtype` (what
// `.to(torch.bfloat16)` of it gives), a bfloat16 delta added to a float32 residual stream (widened,
// which is exact), and SiLU products computed in float32 from bfloat16 values and rounded once: the
// roundings the float32 tensors got on their way into each product, without the copies.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sleef.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "vec8.h"

namespace {

using tandem_vec8::dispatch;
using tandem_vec8::float_or_bf16;
using tandem_vec8::load8;
using tandem_vec8::round8;
using tandem_vec8::store8;

// Rows per task: enough work per thread to be worth waking it.
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

const char* dtype_name(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16 ? "bfloat16" : "float32"; }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && float_or_bf16(x.scalar_type()) && x.stride(1) == 1, name,
              " must be float32 or bfloat16 [rows, n] with contiguous rows");
}

// The rows a norm reads and its weight: rows of n, a multiple of 8, and weight [n] of their dtype.
void check_norm(const at::Tensor& x, const char* name, const at::Tensor& weight, const char* op) {
  check_rows(x, name);
  const int64_t n = x.size(1);
  TORCH_CHECK(n % 8 == 0, op, " needs rows of a multiple of 8, got ", n);
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "weight must be ", dtype_name(x), " [", n, "]");
}

// out = weight * (x * (1 / sqrt(mean(x^2) + eps))) for one row of n (a multiple of 8), computed as
// torch computes it in T and rounded to O.
template <typename T, typename O>
void norm_row(const T* x, const T* weight, float eps, int64_t n, O* out) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = load8(x + i), b = load8(x + i + 8);
    acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(a, a));
    acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(b, b));
  }
  for (; i < n; i += 8) {
    const __m256 a = load8(x + i);
    acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(a, a));
  }
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  const float variance = _mm_cvtss_f32(s) / static_cast<float>(n);
  const __m256 r = _mm256_set1_ps(1.f / std::sqrt(variance + eps));
  for (int64_t j = 0; j < n; j += 8)
    store8(out + j, _mm256_mul_ps(load8(weight + j), round8<T>(_mm256_mul_ps(load8(x + j), r))));
}

template <typename T, typename O>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, float eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  O* op = out.data_ptr<O>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * ld, wp, eps, n, op + t * n);
  });
}

// Delta of type D: T's own, or bfloat16 beside a float32 h (widened as it is read).
template <typename T, typename D, typename O>
void add_rms_norm_rows(at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight, float eps, at::Tensor& out) {
  const int64_t rows = h.size(0), n = h.size(1), hld = h.stride(0), dld = delta.stride(0);
  T* hp = h.data_ptr<T>();
  const D* dp = delta.data_ptr<D>();
  const T* wp = weight.data_ptr<T>();
  O* op = out.data_ptr<O>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* ht = hp + t * hld;
      const D* dt = dp + t * dld;
      for (int64_t j = 0; j < n; j += 8) store8(ht + j, _mm256_add_ps(load8(ht + j), load8(dt + j)));
      norm_row(ht, wp, eps, n, op + t * n);
    }
  });
}

template <typename T>
void rope_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2, ld = x.stride(0);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = xp + t * ld + h * D;
        for (int64_t j = 0; j < half; j += 8) {
          const __m256 lo = load8(row + j), hi = load8(row + half + j);
          // (-hi) * sin is the negation of hi * sin, and a + (-b) is a - b: torch's rounding exactly.
          store8(row + j, _mm256_sub_ps(round8<T>(_mm256_mul_ps(lo, load8(c + j))),
                                        round8<T>(_mm256_mul_ps(hi, load8(s + j)))));
          store8(row + half + j, _mm256_add_ps(round8<T>(_mm256_mul_ps(hi, load8(c + half + j))),
                                               round8<T>(_mm256_mul_ps(lo, load8(s + half + j)))));
        }
      }
    }
  });
}

// Values of type T, math rounded as torch rounds it in M (T, or float32), the result stored as O.
template <typename T, typename M, typename O>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), F = gate_up.size(1) / 2, ld = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  O* op = out.data_ptr<O>();
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  at::parallel_for(0, rows, grain(2 * F), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * ld;
      const T* u = g + F;
      for (int64_t j = 0; j < F; j += 8) {
        const __m256 x = load8(g + j);
        const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(x, sign));
        const __m256 silu = round8<M>(_mm256_div_ps(x, _mm256_add_ps(one, e)));
        store8(op + t * F + j, _mm256_mul_ps(silu, load8(u + j)));
      }
    }
  });
}

// The dtype a result is stored in: `out_dtype` where given (float32 or bfloat16), else `own`.
at::ScalarType result_dtype(std::optional<at::ScalarType> out_dtype, at::ScalarType own, const char* op) {
  TORCH_CHECK(!out_dtype || float_or_bf16(*out_dtype), op, ": out_dtype must be float32 or bfloat16, got ",
              c10::toString(*out_dtype));
  return out_dtype.value_or(own);
}

}  // namespace

// RMSNorm of each row of x [rows, n] (HF's LlamaRMSNorm), rounded to out_dtype where given.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, std::optional<at::ScalarType> out_dtype) {
  check_norm(x, "x", weight, "rms_norm");
  const auto stored = result_dtype(out_dtype, x.scalar_type(), "rms_norm");
  auto out = at::empty({x.size(0), x.size(1)}, x.options().dtype(stored));
  dispatch(stored, [&]<typename O>() {
    dispatch(x.scalar_type(), [&]<typename T>() { rms_norm_rows<T, O>(x, weight, static_cast<float>(eps), out); });
  });
  return out;
}

// h += delta (the residual stream; delta in h's dtype, or bfloat16 beside a float32 h), then RMSNorm
// of the new h, rounded to out_dtype where given.
at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight, double eps,
                         std::optional<at::ScalarType> out_dtype) {
  check_norm(h, "h", weight, "add_rms_norm_");
  check_rows(delta, "delta");
  const bool widened = h.scalar_type() == at::kFloat && delta.scalar_type() == at::kBFloat16;
  TORCH_CHECK(h.sizes() == delta.sizes() && (h.scalar_type() == delta.scalar_type() || widened),
              "h and delta must have the same shape and dtype (or a bfloat16 delta beside a float32 h), got ",
              dtype_name(h), " ", h.sizes(), " and ", dtype_name(delta), " ", delta.sizes());
  const auto stored = result_dtype(out_dtype, h.scalar_type(), "add_rms_norm_");
  auto out = at::empty({h.size(0), h.size(1)}, h.options().dtype(stored));
  const float e = static_cast<float>(eps);
  dispatch(stored, [&]<typename O>() {
    if (widened)
      add_rms_norm_rows<float, c10::BFloat16, O>(h, delta, weight, e, out);
    else
      dispatch(h.scalar_type(), [&]<typename T>() { add_rms_norm_rows<T, T, O>(h, delta, weight, e, out); });
  });
  return out;
}

// In place, x [T, heads, D] (heads D apart, rows any distance apart): x * cos + rotate_half(x) * sin,
// where rotate_half(x) = [-x[D/2:], x[:D/2]]; cos, sin [T, D] (any shape of T * D, contiguous).
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && float_or_bf16(x.scalar_type()) && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be float32 or bfloat16 [tokens, heads, head_dim] with contiguous heads");
  const int64_t tokens = x.size(0), D = x.size(2);
  TORCH_CHECK(D % 16 == 0, "rope_ needs a head_dim that is a multiple of 16, got ", D);
  TORCH_CHECK(cos.numel() == tokens * D && sin.numel() == tokens * D && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must be contiguous ", dtype_name(x), " with tokens * head_dim = ", tokens * D, " values");
  dispatch(x.scalar_type(), [&]<typename T>() { rope_rows<T>(x, cos, sin); });
}

// gate_up [rows, 2F] = [gate | up] -> silu(gate) * up, silu(g) = g / (1 + e^-g) as torch computes it
// in gate_up's dtype; with out_dtype, as torch computes it in float32 from gate_up's values, rounded
// once to out_dtype.
at::Tensor silu_mul(const at::Tensor& gate_up, std::optional<at::ScalarType> out_dtype) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), F = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * F && F % 8 == 0, "gate_up must have 2F columns, F a multiple of 8, got ",
              gate_up.size(1));
  const auto stored = result_dtype(out_dtype, gate_up.scalar_type(), "silu_mul");
  auto out = at::empty({rows, F}, gate_up.options().dtype(stored));
  dispatch(gate_up.scalar_type(), [&]<typename T>() {
    if (!out_dtype)
      silu_mul_rows<T, T, T>(gate_up, out);
    else
      dispatch(stored, [&]<typename O>() { silu_mul_rows<T, float, O>(gate_up, out); });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, ScalarType? out_dtype=None) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor delta, Tensor weight, float eps, ScalarType? out_dtype=None) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up, ScalarType? out_dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
}
