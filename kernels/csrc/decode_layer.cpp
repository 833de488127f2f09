// One decoder layer of a decode step on the CPU in one call, for a float32 Llama-style layer whose
// four projections are 4-bit blocks (block_gemm_q4.cpp, or in stripes: block_gemm_q4_stripes.cpp). The layer is the same kernels the Python
// layer calls (tandem/server/model/llama.py, DecoderLayer.forward), in the same order on the same
// values, so its output is bit for bit theirs; what it removes is the glue between them: ~25 calls
// a layer through Python and torch's dispatcher (views, splits, the KV store's index_put, ...),
// which cost more than the small steps themselves at a decode step's one to eight rows.
// Registered as torch.ops.tandem.decode_layer_q4; torch.classes.tandem.DecodeStackQ4 holds every
// layer's operands and runs them all in one call.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <vector>

#include "ops.h"
#include "vec8.h"

namespace {

// A projection's 4-bit weight as three tensors: [q, scale, offset], block_gemm_q4's operands or, where q
// has four dimensions, block_gemm_q4_stripes'; over x's rows in float32, or in bfloat16 from
// `bfloat16_rows` rows (0: never), as Linear multiplies them.
at::Tensor project(const at::Tensor& x, at::TensorList w, int64_t bfloat16_rows, const char* name) {
  TORCH_CHECK(w.size() == 3, name, " must be [q, scale, offset], got ", w.size(), " tensors");
  const bool bfloat16 = bfloat16_rows > 0 && x.size(0) >= bfloat16_rows;
  if (w[0].dim() == 4) return block_gemm_q4_stripes(x, w[0], w[1], w[2], !bfloat16, -1);
  if (bfloat16) return block_gemm_q4_bf16(x, w[0], w[1], w[2], 0);
  return block_gemm_q4(x, w[0], w[1], w[2], 0, -1);
}

// Row t of src [T, width] (rows `ld` apart) into flat slot slots[t] of cache [slots, width]: copied
// into a float32 cache, rounded (nearest even, as torch's .to() rounds) into a bfloat16 one.
void store_rows(const float* src, int64_t ld, int64_t T, int64_t width, const int64_t* slots, float* cache) {
  for (int64_t t = 0; t < T; ++t) std::memcpy(cache + slots[t] * width, src + t * ld, width * sizeof(float));
}

void store_rows(const float* src, int64_t ld, int64_t T, int64_t width, const int64_t* slots, c10::BFloat16* cache) {
  for (int64_t t = 0; t < T; ++t) std::copy(src + t * ld, src + t * ld + width, cache + slots[t] * width);
}

}  // namespace

// h [T, hidden] the residual stream; delta the previous layer's output not yet added to it (None
// before the first layer): h += delta in place. Then attention over the paged cache (k_cache and
// v_cache [pages, page_size, kv_heads, head_dim], this layer's; the new tokens' K and V written at
// flat `slots` first; page_table [T, W] and kv_lens [T] as paged_decode_attention takes them) and
// the MLP. `bfloat16_rows`: from this many rows the projections multiply in bfloat16 (0: never), as
// the layer's Linears do. Returns the layer's output, the next layer's delta.
at::Tensor decode_layer_q4(at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& input_norm,
                           const at::Tensor& mlp_norm, double eps, at::TensorList qkv, at::TensorList o,
                           at::TensorList gate_up, at::TensorList down, const at::Tensor& cos, const at::Tensor& sin,
                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                           const at::Tensor& page_table, const at::Tensor& kv_lens, int64_t num_heads,
                           int64_t num_kv_heads, double scale, int64_t window, int64_t bfloat16_rows) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "h must be contiguous float32 [T, hidden]");
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && tandem_vec8::float_or_bf16(cache_dtype) && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == cache_dtype && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous float32 or bfloat16 [pages, page_size, kv_heads, head_dim]");
  const int64_t T = h.size(0), H = num_heads, KVH = num_kv_heads, D = k_cache.size(3);
  TORCH_CHECK(k_cache.size(2) == KVH, "k_cache has ", k_cache.size(2), " kv heads, num_kv_heads is ", KVH);
  TORCH_CHECK(slots.numel() == T && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be contiguous int64 [", T, "]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slots[", t, "] = ", sp[t], " is outside the cache's ", num_slots);

  const at::Tensor x = delta.has_value() ? add_rms_norm_(h, *delta, input_norm, eps) : rms_norm(h, input_norm, eps);
  const at::Tensor qkv_out = project(x, qkv, bfloat16_rows, "qkv");  // [T, (H + 2 KVH) D]: q's heads, k's, v's
  const int64_t row = qkv_out.size(1);
  TORCH_CHECK(row == (H + 2 * KVH) * D, "qkv gives rows of ", row, ", not (num_heads + 2 num_kv_heads) head_dim = ",
              (H + 2 * KVH) * D);
  at::Tensor qk = qkv_out.narrow(1, 0, (H + KVH) * D).view({T, H + KVH, D});
  rope_(qk, cos, sin);
  const float* qkv_p = qkv_out.data_ptr<float>();
  tandem_vec8::dispatch(cache_dtype, [&]<typename C>() {
    store_rows(qkv_p + H * D, row, T, KVH * D, sp, k_cache.data_ptr<C>());
    store_rows(qkv_p + (H + KVH) * D, row, T, KVH * D, sp, v_cache.data_ptr<C>());
  });
  const at::Tensor attended = paged_decode_attention(qkv_out.narrow(1, 0, H * D).view({T, H, D}), k_cache, v_cache,
                                                     page_table, kv_lens, scale, window, -1);
  const at::Tensor x2 = add_rms_norm_(h, project(attended.view({T, H * D}), o, bfloat16_rows, "o"), mlp_norm, eps);
  return project(silu_mul(project(x2, gate_up, bfloat16_rows, "gate_up")), down, bfloat16_rows, "down");
}

// Every decoder layer of a model, each as decode_layer_q4 runs it, one after the other in one call:
// what a decode step of one to eight sequences spends between the layers (a call from Python per
// layer: the layer's checks, its ~20 arguments converted, the dispatcher) is spent once per step.
// Built once with the layers' fixed operands (`weights`: 14 tensors a layer: input norm, MLP norm,
// then the qkv, o, gate|up and down projections' [q, scale, offset]; and bfloat16_rows, as for
// decode_layer_q4); the KV caches come with each call, as the attention backend that owns them may change.
struct DecodeStackQ4 : torch::CustomClassHolder {
  static constexpr size_t kPerLayer = 14;

  DecodeStackQ4(std::vector<at::Tensor> weights, double eps, int64_t num_heads, int64_t num_kv_heads,
                int64_t bfloat16_rows)
      : weights(std::move(weights)), eps(eps), num_heads(num_heads), num_kv_heads(num_kv_heads),
        bfloat16_rows(bfloat16_rows) {
    TORCH_CHECK(!this->weights.empty() && this->weights.size() % kPerLayer == 0, "weights must be ", kPerLayer,
                " tensors a layer, got ", this->weights.size());
  }

  int64_t num_layers() const { return static_cast<int64_t>(weights.size() / kPerLayer); }

  // h [T, hidden] the embedded tokens (updated in place, as decode_layer_q4 updates it); k_caches,
  // v_caches and windows: each layer's; slots, page_table, kv_lens, scale as decode_layer_q4 takes
  // them, for every layer. Returns the last layer's output, not yet added to h.
  at::Tensor forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> k_caches,
                     std::vector<at::Tensor> v_caches, const at::Tensor& slots, const at::Tensor& page_table,
                     const at::Tensor& kv_lens, double scale, std::vector<int64_t> windows) {
    const int64_t L = num_layers();
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && v_caches.size() == k_caches.size() &&
                static_cast<int64_t>(windows.size()) == L, "k_caches, v_caches and windows: one a layer (", L,
                "), got ", k_caches.size(), ", ", v_caches.size(), " and ", windows.size());
    std::optional<at::Tensor> delta;
    for (int64_t i = 0; i < L; ++i) {
      const at::Tensor* w = weights.data() + i * kPerLayer;
      delta = decode_layer_q4(h, delta, w[0], w[1], eps, {w + 2, 3}, {w + 5, 3}, {w + 8, 3}, {w + 11, 3}, cos, sin,
                              k_caches[i], v_caches[i], slots, page_table, kv_lens, num_heads, num_kv_heads, scale,
                              windows[i], bfloat16_rows);
    }
    return *delta;
  }

  std::vector<at::Tensor> weights;
  double eps;
  int64_t num_heads, num_kv_heads, bfloat16_rows;
};

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.class_<DecodeStackQ4>("DecodeStackQ4")
      .def(torch::init<std::vector<at::Tensor>, double, int64_t, int64_t, int64_t>())
      .def("forward", &DecodeStackQ4::forward);
  m.def("decode_layer_q4(Tensor(a!) h, Tensor? delta, Tensor input_norm, Tensor mlp_norm, float eps, Tensor[] qkv, "
        "Tensor[] o, Tensor[] gate_up, Tensor[] down, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slots, Tensor page_table, Tensor kv_lens, int num_heads, int num_kv_heads, float scale, int window, "
        "int bfloat16_rows=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("decode_layer_q4", &decode_layer_q4);
}
