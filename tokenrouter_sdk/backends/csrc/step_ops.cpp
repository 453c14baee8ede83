// Fused float32 operations of the native forward's eager step on a CPU (the work between its
// GEMMs): each replaces several ATen calls, whose per-call cost dominates at decode sizes
// (a few rows of 576-2048 values).
//
//   rms_norm(x [N, C], w [C], eps) -> [N, C]: w * x / sqrt(mean(x^2) + eps) per row (the
//     Llama-family RMSNorm; statistics in float32, as transformers computes them).
//   rope(x [T, H, D], cos [T, D], sin [T, D]) -> [T, H, D] contiguous: x * cos + roll(x, D/2) * sin,
//     with rotate_half's signs folded into sin (its first half negated), as the native forward
//     applies rotary position embeddings.
//   silu_mul(g [N, F], u [N, F]) -> [N, F]: silu(g) * u (the SiLU-gated MLP).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "vec_math.h"

namespace {

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

int64_t grain(int64_t row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row, 1)); }

}  // namespace

namespace tokenrouter_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  const int64_t C = x.size(-1);
  TORCH_CHECK(w.numel() == C && w.is_contiguous(), "w must be contiguous with x.size(-1) values");
  auto xc = x.contiguous();
  auto out = at::empty(xc.sizes(), xc.options());
  const int64_t N = xc.numel() / C;
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain(C), [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const float* r = xp + i * C;
      float ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < C; ++c) ss += r[c] * r[c];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(C) + e);
      float* o = op + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = wp[c] * (r[c] * inv);
    }
  });
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, H, D] with unit stride in D");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rope needs an even head size, got ", D);
  auto cc = cos.contiguous(), sc = sin.contiguous();
  TORCH_CHECK(cc.numel() == T * D && sc.numel() == T * D, "cos and sin must hold [T, D] values");
  auto out = at::empty({T, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T * H, grain(D), [&](int64_t b, int64_t end) {
    for (int64_t th = b; th < end; ++th) {
      const int64_t t = th / H, h = th % H;
      const float* r = xp + t * s0 + h * s1;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      float* o = op + th * D;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) o[d] = r[d] * c[d] + r[d + half] * s[d];
#pragma omp simd
      for (int64_t d = half; d < D; ++d) o[d] = r[d] * c[d] + r[d - half] * s[d];
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  check_f32(g, "g");
  check_f32(u, "u");
  TORCH_CHECK(g.sizes() == u.sizes() && g.dim() == 2 && g.stride(1) == 1 && u.stride(1) == 1,
              "g and u must be [N, F] of one shape with unit stride in F");
  const int64_t N = g.size(0), F = g.size(1);
  auto out = at::empty({N, F}, g.options());
  const float* gp = g.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = g.stride(0), us = u.stride(0);
  at::parallel_for(0, N, grain(F), [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const float* gr = gp + i * gs;
      const float* ur = up + i * us;
      float* o = op + i * F;
#pragma omp simd
      for (int64_t f = 0; f < F; ++f) o[f] = gr[f] / (1.0f + tokenrouter_cpu::exp_f32(-gr[f])) * ur[f];
    }
  });
  return out;
}

}  // namespace tokenrouter_cpu

TORCH_LIBRARY_FRAGMENT(tokenrouter_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(tokenrouter_cpu::rms_norm));
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(tokenrouter_cpu::rope));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(tokenrouter_cpu::silu_mul));
}
