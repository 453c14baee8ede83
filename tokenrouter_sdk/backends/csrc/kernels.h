// The kernels one source calls from another (the decoder layer runs the others in one call),
// each defined in its own file and registered there as a tokenrouter_cpu op of the same name.
// Shapes, dtypes and errors: see the defining file.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace tokenrouter_cpu {

// step_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u);

// skinny_gemm.cpp
at::Tensor skinny_pack(const at::Tensor& w);
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual, int64_t prefetch);

// paged_attention.cpp
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& table, const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& kv_len, double scale, int64_t chunk, int64_t window, double softcap,
                     int64_t tile_from);
void store_kv(at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v);

}  // namespace tokenrouter_cpu
