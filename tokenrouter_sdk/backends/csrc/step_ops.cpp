// Fused operations of the native forward's eager step on a CPU (the work between its GEMMs), in
// float32 or bfloat16: each replaces several ATen calls, whose per-call cost dominates at decode
// sizes (a few rows of 576-2048 values).
//
// bfloat16 tensors take the roundings of the ATen ops they replace (the native forward's bfloat16
// arithmetic, as transformers' modules compute it): rms_norm's statistics and normalised row in
// float32, the row rounded to bfloat16 and then scaled by the weight (a bfloat16 product);
// rope's two products each rounded to bfloat16, then their sum (the same bits as the ATen ops:
// a product of two bfloat16 values is exact in float32); silu_mul's SiLU rounded to bfloat16, then
// the product with u.
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

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels.h"
#include "vec_math.h"

namespace {

// t is a CPU tensor of dtype dt (float32 or bfloat16)
void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dt) {
  TORCH_CHECK(t.device().is_cpu() && (dt == at::kFloat || dt == at::kBFloat16) && t.scalar_type() == dt, name,
              " must be a float32 or bfloat16 CPU tensor of the first input's dtype, got ", t.scalar_type());
}

using bf16 = c10::BFloat16;

using tokenrouter_cpu::bf16_bits;
using tokenrouter_cpu::bf16_float;

// T's values as float32 and back; T's storage as the loops index it (bfloat16 as its 16 bits)
template <typename T>
using Raw = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
template <typename T>
inline float ld(Raw<T> v) {
  if constexpr (std::is_same_v<T, float>) return v; else return bf16_float(v);
}
template <typename T>
inline Raw<T> st(float v) {
  if constexpr (std::is_same_v<T, float>) return v; else return bf16_bits(v);
}
// v rounded to T's precision (a no-op for float)
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) return v; else return bf16_float(bf16_bits(v));
}
template <typename T>
inline const Raw<T>* raw(const at::Tensor& t) {
  return reinterpret_cast<const Raw<T>*>(t.data_ptr());
}
template <typename T>
inline Raw<T>* raw_out(at::Tensor& t) {
  return reinterpret_cast<Raw<T>*>(t.data_ptr());
}

int64_t grain(int64_t row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row, 1)); }

}  // namespace

namespace tokenrouter_cpu {

template <typename T>
void rms_norm_rows(const Raw<T>* xp, const Raw<T>* wp, Raw<T>* op, int64_t N, int64_t C, float e) {
  at::parallel_for(0, N, grain(C), [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const Raw<T>* r = xp + i * C;
      float ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < C; ++c) ss += ld<T>(r[c]) * ld<T>(r[c]);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(C) + e);
      Raw<T>* o = op + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = st<T>(ld<T>(wp[c]) * round_to<T>(ld<T>(r[c]) * inv));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const auto dt = x.scalar_type();
  check_dtype(x, "x", dt);
  check_dtype(w, "w", dt);
  const int64_t C = x.size(-1);
  TORCH_CHECK(w.numel() == C && w.is_contiguous(), "w must be contiguous with x.size(-1) values");
  auto xc = x.contiguous();
  auto out = at::empty(xc.sizes(), xc.options());
  const int64_t N = xc.numel() / C;
  const float e = static_cast<float>(eps);
  if (dt == at::kFloat)
    rms_norm_rows<float>(raw<float>(xc), raw<float>(w), raw_out<float>(out), N, C, e);
  else
    rms_norm_rows<bf16>(raw<bf16>(xc), raw<bf16>(w), raw_out<bf16>(out), N, C, e);
  return out;
}

template <typename T>
void rope_rows(const Raw<T>* xp, const Raw<T>* cp, const Raw<T>* sp, Raw<T>* op, int64_t T_, int64_t H, int64_t D,
               int64_t s0, int64_t s1) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_ * H, grain(D), [&](int64_t b, int64_t end) {
    for (int64_t th = b; th < end; ++th) {
      const int64_t t = th / H, h = th % H;
      const Raw<T>* r = xp + t * s0 + h * s1;
      const Raw<T>* c = cp + t * D;
      const Raw<T>* s = sp + t * D;
      Raw<T>* o = op + th * D;
      // each product rounded to T, as one ATen product of T tensors, then their sum
#pragma omp simd
      for (int64_t d = 0; d < half; ++d)
        o[d] = st<T>(round_to<T>(ld<T>(r[d]) * ld<T>(c[d])) + round_to<T>(ld<T>(r[d + half]) * ld<T>(s[d])));
#pragma omp simd
      for (int64_t d = half; d < D; ++d)
        o[d] = st<T>(round_to<T>(ld<T>(r[d]) * ld<T>(c[d])) + round_to<T>(ld<T>(r[d - half]) * ld<T>(s[d])));
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dt = x.scalar_type();
  check_dtype(x, "x", dt);
  check_dtype(cos, "cos", dt);
  check_dtype(sin, "sin", dt);
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, H, D] with unit stride in D");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "rope needs an even head size, got ", D);
  auto cc = cos.contiguous(), sc = sin.contiguous();
  TORCH_CHECK(cc.numel() == T * D && sc.numel() == T * D, "cos and sin must hold [T, D] values");
  auto out = at::empty({T, H, D}, x.options());
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  if (dt == at::kFloat)
    rope_rows<float>(raw<float>(x), raw<float>(cc), raw<float>(sc), raw_out<float>(out), T, H, D, s0, s1);
  else
    rope_rows<bf16>(raw<bf16>(x), raw<bf16>(cc), raw<bf16>(sc), raw_out<bf16>(out), T, H, D, s0, s1);
  return out;
}

template <typename T>
void silu_mul_rows(const Raw<T>* gp, const Raw<T>* up, Raw<T>* op, int64_t N, int64_t F, int64_t gs, int64_t us) {
  at::parallel_for(0, N, grain(F), [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const Raw<T>* gr = gp + i * gs;
      const Raw<T>* ur = up + i * us;
      Raw<T>* o = op + i * F;
#pragma omp simd
      for (int64_t f = 0; f < F; ++f) {
        const float g = ld<T>(gr[f]);
        o[f] = st<T>(round_to<T>(g / (1.0f + tokenrouter_cpu::exp_f32(-g))) * ld<T>(ur[f]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  const auto dt = g.scalar_type();
  check_dtype(g, "g", dt);
  check_dtype(u, "u", dt);
  TORCH_CHECK(g.sizes() == u.sizes() && g.dim() == 2 && g.stride(1) == 1 && u.stride(1) == 1,
              "g and u must be [N, F] of one shape with unit stride in F");
  const int64_t N = g.size(0), F = g.size(1);
  auto out = at::empty({N, F}, g.options());
  if (dt == at::kFloat)
    silu_mul_rows<float>(raw<float>(g), raw<float>(u), raw_out<float>(out), N, F, g.stride(0), u.stride(0));
  else
    silu_mul_rows<bf16>(raw<bf16>(g), raw<bf16>(u), raw_out<bf16>(out), N, F, g.stride(0), u.stride(0));
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
