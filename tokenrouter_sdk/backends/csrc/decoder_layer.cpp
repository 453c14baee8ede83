// One decoder layer of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) in one call, for an
// eager float32 step whose projections all run the few-row kernel and whose requests are all
// attended in place by the paged kernel. It calls the same kernels, in the same order and on the
// same tensors, as the native forward's Python layer loop (native_forward.decoder_step), so its
// output equals that loop's bit for bit; what it saves is the loop's per-layer Python and the
// dispatch of eleven ops (about 100 us a layer at decode sizes on a 2-core CPU).
//
//   decoder_layer(x [T, C], w, b, eps, heads [H, Hkv, D, F], cos [T, D], sin [T, D],
//                 k_pool, v_pool [slots, Hkv, D], slots [T], table [R, Lmax], q_start, q_len,
//                 kv_len [R], scale, chunk, window, softcap) -> [T, C]
//   w: input norm [C], q/k/v few-row weight ((H + 2 Hkv) D outputs), o ([C]), post-attention
//      norm [C], gate/up (2F), down (C); then, for Qwen3, the q and k norms [D].
//   b: the four projections' biases (each [outputs] or none); eps: the norms' epsilons, in w's order.
//
//   h = rms_norm(x, w0); q, k, v = split(skinny(h, w1) + b0); (q, k = rms_norm(q, w6), rms_norm(k, w7))
//   q, k = rope(q), rope(k); store k, v at slots; y = paged_attention(q)
//   x = x + skinny(y, w2) + b1; h = rms_norm(x, w3); g, u = split(skinny(h, w4) + b2)
//   return x + skinny(silu(g) * u, w5) + b3

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

at::Tensor decoder_layer(const at::Tensor& x, at::TensorList w, const c10::List<std::optional<at::Tensor>>& b,
                         at::ArrayRef<double> eps, at::IntArrayRef heads, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots, const at::Tensor& table,
                         const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len, double scale,
                         int64_t chunk, int64_t window, double softcap) {
  using namespace tokenrouter_cpu;
  TORCH_CHECK(w.size() == 6 || w.size() == 8, "decoder_layer: w must hold 6 tensors (8 with q and k norms), got ",
              w.size());
  TORCH_CHECK(b.size() == 4 && eps.size() == (w.size() == 8 ? 4u : 2u) && heads.size() == 4,
              "decoder_layer: b must hold 4 biases, eps one per norm, heads [H, Hkv, D, F]");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layer: x must be a contiguous [T, C]");
  const int64_t T = x.size(0), C = x.size(1), H = heads[0], Hkv = heads[1], D = heads[2], F = heads[3];
  auto bias = [&](size_t i) { return b.get(i); };

  auto qkv = skinny_linear(rms_norm(x, w[0], eps[0]), w[1], (H + 2 * Hkv) * D, bias(0), std::nullopt);
  auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
  auto k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
  auto v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
  if (w.size() == 8) {
    q = rms_norm(q, w[6], eps[2]);
    k = rms_norm(k, w[7], eps[3]);
  }
  q = rope(q, cos, sin);
  k = rope(k, cos, sin);
  store_kv(k_pool, v_pool, slots, k, v);
  auto y = at::empty({T, H, D}, q.options());
  paged_attention(y, q, k_pool, v_pool, table, q_start, q_len, kv_len, scale, chunk, window, softcap);
  auto h = skinny_linear(y.view({T, H * D}), w[2], C, bias(1), x);
  auto gu = skinny_linear(rms_norm(h, w[3], eps[1]), w[4], 2 * F, bias(2), std::nullopt);
  return skinny_linear(silu_mul(gu.narrow(1, 0, F), gu.narrow(1, F, F)), w[5], C, bias(3), h);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenrouter_cpu, m) {
  m.def("decoder_layer(Tensor x, Tensor[] w, Tensor?[] b, float[] eps, int[] heads, Tensor cos, Tensor sin, "
        "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, Tensor table, Tensor q_start, Tensor q_len, "
        "Tensor kv_len, float scale, int chunk=0, int window=0, float softcap=0.0) -> Tensor");
  m.impl("decoder_layer", c10::DispatchKey::CPU, TORCH_FN(decoder_layer));
}
