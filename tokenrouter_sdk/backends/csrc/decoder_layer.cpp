// Decoder layers of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) in one or two calls, or
// all of a step's layers in one, for eager float32 steps whose projections all run the few-row
// kernel. They call the same kernels,
// in the same order and on the same tensors, as the native forward's Python layer loop
// (native_forward.decoder_step), so their outputs equal that loop's bit for bit; what they save
// is the loop's per-layer Python and the dispatch of its ops.
//
//   layer_qkv(x [T, C], w, b, eps, heads [H, Hkv, D], cos [T, D], sin [T, D], k_pool, v_pool
//             [slots, Hkv, D], slots [T], prefetch) -> (q [T, H, D], k [T, Hkv, D], v [T, Hkv, D])
//     w: the input norm [C] and the q/k/v few-row weight ((H + 2 Hkv) D outputs), then for Qwen3
//     the q and k norms [D]; b: the q/k/v bias or none; eps: the norms' epsilons in w's order.
//     h = rms_norm(x, w0); q, k, v = split(skinny(h, w1) + b); (q, k = rms_norm(q, w2),
//     rms_norm(k, w3)); q, k = rope(q), rope(k); k and v stored at their slots of the pools.
//   layer_mlp(y [T, H D], x [T, C], w, b, eps, F, prefetch) -> [T, C]
//     w: o, the post-attention norm [C], gate/up (2F outputs), down (C); b: their biases (o,
//     gate/up, down; each or none). h = x + skinny(y, w0) + b0; g, u = split(skinny(rms_norm(h,
//     w1), w2) + b1); returns h + skinny(silu(g) * u, w3) + b2.
//   decoder_layer(x, w, b, eps, heads [H, Hkv, D, F], cos, sin, k_pool, v_pool, slots, table
//                 [R, Lmax], q_start, q_len, kv_len [R], scale, chunk, window, softcap, tile_from, prefetch)
//                 -> [T, C]
//     the whole layer when the paged kernel attends every request: layer_qkv, paged_attention,
//     layer_mlp. w: input norm, q/k/v, o, post-attention norm, gate/up, down (+ q and k norms);
//     b: the four projections' biases; eps: the norms' (input, post-attention, q, k).
//   decoder_stack(x, w, b, eps, heads, cos, sin, k_pools, v_pools [layers, slots, Hkv, D], layers
//                 [L], slots, table, q_start, q_len, kv_len, scale [L], window [L], softcap [L], chunk,
//                 tile_from, prefetch) -> [T, C]
//     L decoder_layer calls in order, each on the last one's output, layer i on pools
//     layers[i]: w, b, eps and heads hold every layer's list one after the other (6 or 8
//     tensors, 4 biases, 2 or 4 epsilons, 4 sizes a layer). One call a step instead of L saves
//     each layer's op dispatch and Python: 5% of a batch-8 decode step of SmolLM2-135M (30
//     layers) on a 2-core Intel Xeon.
//   prefetch: the few-row kernel's prefetch locality (skinny_gemm.cpp), for every projection.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

using tokenrouter_cpu::rms_norm;
using tokenrouter_cpu::skinny_linear;

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_qkv(const at::Tensor& x, at::TensorList w,
                                                          const std::optional<at::Tensor>& b, at::ArrayRef<double> eps,
                                                          at::IntArrayRef heads, const at::Tensor& cos,
                                                          const at::Tensor& sin, at::Tensor k_pool, at::Tensor v_pool,
                                                          const at::Tensor& slots, int64_t prefetch) {
  TORCH_CHECK((w.size() == 2 || w.size() == 4) && eps.size() == w.size() - 1 && heads.size() >= 3,
              "layer_qkv: w must hold the input norm and q/k/v (and the q and k norms), eps one per norm, "
              "heads [H, Hkv, D]");
  TORCH_CHECK(x.dim() == 2, "layer_qkv: x must be [T, C]");
  const int64_t T = x.size(0), H = heads[0], Hkv = heads[1], D = heads[2];
  auto qkv = skinny_linear(rms_norm(x, w[0], eps[0]), w[1], (H + 2 * Hkv) * D, b, std::nullopt, prefetch);
  auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
  auto k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
  auto v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
  if (w.size() == 4) {
    q = rms_norm(q, w[2], eps[1]);
    k = rms_norm(k, w[3], eps[2]);
  }
  q = tokenrouter_cpu::rope(q, cos, sin);
  k = tokenrouter_cpu::rope(k, cos, sin);
  tokenrouter_cpu::store_kv(k_pool, v_pool, slots, k, v);
  return {q, k, v};
}

at::Tensor layer_mlp(const at::Tensor& y, const at::Tensor& x, at::TensorList w,
                     const c10::List<std::optional<at::Tensor>>& b, double eps, int64_t F, int64_t prefetch) {
  TORCH_CHECK(w.size() == 4 && b.size() == 3, "layer_mlp: w must hold o, the norm, gate/up and down; b three biases");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && y.size(0) == x.size(0), "layer_mlp: y and x must be [T, *] of one T");
  const int64_t C = x.size(1);
  auto h = skinny_linear(y, w[0], C, b.get(0), x, prefetch);
  auto gu = skinny_linear(rms_norm(h, w[1], eps), w[2], 2 * F, b.get(1), std::nullopt, prefetch);
  return skinny_linear(tokenrouter_cpu::silu_mul(gu.narrow(1, 0, F), gu.narrow(1, F, F)), w[3], C, b.get(2), h,
                       prefetch);
}

// One layer: w the 6 (8) tensors of `decoder_layer`'s order, b its 4 biases, eps its norms'.
at::Tensor layer(const at::Tensor& x, at::ArrayRef<at::Tensor> w, const std::optional<at::Tensor>* b,
                 at::ArrayRef<double> eps, at::IntArrayRef heads, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots, const at::Tensor& table,
                 const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len, double scale,
                 int64_t chunk, int64_t window, double softcap, int64_t tile_from, int64_t prefetch) {
  const int64_t H = heads[0], D = heads[2];
  c10::SmallVector<at::Tensor, 4> wq{w[0], w[1]};
  c10::SmallVector<double, 3> eq{eps[0]};
  if (w.size() == 8) {
    wq.append({w[6], w[7]});
    eq.append({eps[2], eps[3]});
  }
  auto [q, k, v] = layer_qkv(x, wq, b[0], eq, heads, cos, sin, k_pool, v_pool, slots, prefetch);
  const int64_t T = q.size(0);
  auto y = at::empty({T, H, D}, q.options());
  tokenrouter_cpu::paged_attention(y, q, k_pool, v_pool, table, q_start, q_len, kv_len, scale, chunk, window, softcap,
                                   tile_from);
  c10::List<std::optional<at::Tensor>> bm{b[1], b[2], b[3]};
  return layer_mlp(y.view({T, H * D}), x, {w[2], w[3], w[4], w[5]}, bm, eps[1], heads[3], prefetch);
}

at::Tensor decoder_layer(const at::Tensor& x, at::TensorList w, const c10::List<std::optional<at::Tensor>>& b,
                         at::ArrayRef<double> eps, at::IntArrayRef heads, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots, const at::Tensor& table,
                         const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len, double scale,
                         int64_t chunk, int64_t window, double softcap, int64_t tile_from, int64_t prefetch) {
  TORCH_CHECK(w.size() == 6 || w.size() == 8, "decoder_layer: w must hold 6 tensors (8 with q and k norms), got ",
              w.size());
  TORCH_CHECK(b.size() == 4 && eps.size() == (w.size() == 8 ? 4u : 2u) && heads.size() == 4,
              "decoder_layer: b must hold 4 biases, eps one per norm, heads [H, Hkv, D, F]");
  const std::optional<at::Tensor> bs[4] = {b.get(0), b.get(1), b.get(2), b.get(3)};
  return layer(x, w, bs, eps, heads, cos, sin, k_pool, v_pool, slots, table, q_start, q_len, kv_len, scale, chunk,
               window, softcap, tile_from, prefetch);
}

at::Tensor decoder_stack(const at::Tensor& x, at::TensorList w, const c10::List<std::optional<at::Tensor>>& b,
                         at::ArrayRef<double> eps, at::IntArrayRef heads, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor k_pools, at::Tensor v_pools, at::IntArrayRef layers, const at::Tensor& slots,
                         const at::Tensor& table, const at::Tensor& q_start, const at::Tensor& q_len,
                         const at::Tensor& kv_len, at::ArrayRef<double> scale, at::IntArrayRef window,
                         at::ArrayRef<double> softcap, int64_t chunk, int64_t tile_from, int64_t prefetch) {
  const size_t L = layers.size();
  TORCH_CHECK(L > 0 && (w.size() == 6 * L || w.size() == 8 * L),
              "decoder_stack: w must hold 6 tensors a layer (8 with q and k norms), got ", w.size(), " for ", L,
              " layers");
  const size_t per = w.size() / L, norms = per == 8 ? 4 : 2;
  TORCH_CHECK(b.size() == 4 * L && eps.size() == norms * L && heads.size() == 4 * L && scale.size() == L &&
                  window.size() == L && softcap.size() == L,
              "decoder_stack: b must hold 4 biases a layer, eps one per norm, heads [H, Hkv, D, F] a layer, and "
              "scale, window and softcap one a layer");
  TORCH_CHECK(k_pools.dim() == 4 && v_pools.dim() == 4, "decoder_stack: the pools must be [layers, slots, Hkv, D]");
  for (const int64_t l : layers)
    TORCH_CHECK(l >= 0 && l < k_pools.size(0), "decoder_stack: layer ", l, " is not in the pools");
  at::Tensor h = x;
  for (size_t i = 0; i < L; ++i) {
    const std::optional<at::Tensor> bs[4] = {b.get(4 * i), b.get(4 * i + 1), b.get(4 * i + 2), b.get(4 * i + 3)};
    h = layer(h, w.slice(per * i, per), bs, eps.slice(norms * i, norms), heads.slice(4 * i, 4), cos, sin,
              k_pools.select(0, layers[i]), v_pools.select(0, layers[i]), slots, table, q_start, q_len, kv_len,
              scale[i], chunk, window[i], softcap[i], tile_from, prefetch);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenrouter_cpu, m) {
  m.def("layer_qkv(Tensor x, Tensor[] w, Tensor? b, float[] eps, int[] heads, Tensor cos, Tensor sin, "
        "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, int prefetch=0) -> (Tensor, Tensor, Tensor)");
  m.def("layer_mlp(Tensor y, Tensor x, Tensor[] w, Tensor?[] b, float eps, int F, int prefetch=0) -> Tensor");
  m.def("decoder_layer(Tensor x, Tensor[] w, Tensor?[] b, float[] eps, int[] heads, Tensor cos, Tensor sin, "
        "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, Tensor table, Tensor q_start, Tensor q_len, "
        "Tensor kv_len, float scale, int chunk=0, int window=0, float softcap=0.0, int tile_from=4, int prefetch=0) -> Tensor");
  m.def("decoder_stack(Tensor x, Tensor[] w, Tensor?[] b, float[] eps, int[] heads, Tensor cos, Tensor sin, "
        "Tensor(a!) k_pools, Tensor(b!) v_pools, int[] layers, Tensor slots, Tensor table, Tensor q_start, "
        "Tensor q_len, Tensor kv_len, float[] scale, int[] window, float[] softcap, int chunk=0, int tile_from=4, "
        "int prefetch=0) -> Tensor");
  m.impl("layer_qkv", c10::DispatchKey::CPU, TORCH_FN(layer_qkv));
  m.impl("layer_mlp", c10::DispatchKey::CPU, TORCH_FN(layer_mlp));
  m.impl("decoder_layer", c10::DispatchKey::CPU, TORCH_FN(decoder_layer));
  m.impl("decoder_stack", c10::DispatchKey::CPU, TORCH_FN(decoder_stack));
}
