// The C++ functions behind torch.ops.tandem.*, for kernels that call each other without going
// through Python and torch's dispatcher (decode_layer.cpp). Each is defined, and documented, in the
// file named beside it.
#pragma once

#include <ATen/ATen.h>

#include <optional>

at::Tensor block_gemm_q4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                         int64_t tile_rows, int64_t avx512);                                        // block_gemm_q4.cpp
at::Tensor block_gemm_q4_bf16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                              const at::Tensor& offset, int64_t tile_rows);                         // block_gemm_bf16.cpp
at::Tensor block_gemm_q4_stripes(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                 const at::Tensor& offset, bool exact, int64_t avx512);             // block_gemm_q4_stripes.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    std::optional<at::ScalarType> out_dtype = std::nullopt);                        // layer_ops.cpp
at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight, double eps,
                         std::optional<at::ScalarType> out_dtype = std::nullopt);                   // layer_ops.cpp
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);                           // layer_ops.cpp
at::Tensor silu_mul(const at::Tensor& gate_up, std::optional<at::ScalarType> out_dtype = std::nullopt);  // layer_ops.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& page_table, const at::Tensor& kv_lens, double scale,
                                  int64_t window, int64_t avx512);                                  // paged_decode_attention.cpp
