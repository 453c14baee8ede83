// Projections of a few rows (decode steps) on a CPU, float32: y = x W^T (+ bias) (+ residual)
// over a weight packed once into column blocks of 32, [ceil(N / 32), K, 32], so that a step
// streams each weight's bytes exactly once, in order, from memory.
//
// At a few rows a projection is bound by reading its weight: every weight value is used M times
// (M = rows), so the arithmetic (M FMAs per value) hides under the read when it is kept in
// registers. A task takes one block (32 outputs, two 16-wide vectors per k, 128 contiguous
// bytes) and walks K: per k it loads the two weight vectors once and broadcasts x[m, k] into
// 2 M accumulators (M <= 8), prefetching the weight stream ahead; 9..16 rows take the block's two
// halves in turn with M accumulators each (the second half's lines are the ones the first left).
// One contiguous stream per task keeps the read at the bandwidth with 8 rows: two blocks of 16
// read as two streams run 10-15% slower there (measured on a 2-core AMD EPYC VM).
//
// The prefetch's locality (``prefetch``, __builtin_prefetch's 0..3) is the caller's: which one
// streams fastest depends on the CPU. On a 2-core AMD EPYC (Zen 5) the non-temporal one (0,
// prefetchnta) reads at the bandwidth; on a 2-core Intel Xeon (family 6 model 207) it reads at
// less than half of it (one row: 43 against 17 ms over SmolLM2-135M's 538 MB of weights), where
// prefetching into L2 (2, prefetcht1) reads at the bandwidth and the hardware's L2 streamer
// joins in. tokenrouter_sdk/backends/autotune.py measures the candidates on the machine. Tasks are
// spread over torch's thread pool (at::parallel_for, so torch.set_num_threads and core lending
// apply). Rows beyond 16 run in chunks of 16, all chunks on one block before the next (the
// block then comes from memory once), until a blocked GEMM (oneDNN) does better; which path
// runs at which row count is measured on the machine (tokenrouter_sdk/backends/autotune.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>

#include "kernels.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kLane = 16;       // floats per vector
constexpr int64_t kCols = 32;       // outputs per column block: two vectors
constexpr int64_t kAhead = 64;      // weight rows (of one block) prefetched ahead (8 KiB)

constexpr size_t kHugePage = size_t(2) << 20;

// A zeroed float32 [nb, K, 32] for a packed weight. On Linux one of 2 MiB or more gets its own
// mapping, 2 MiB-aligned and advised MADV_HUGEPAGE (before anything touches it), so that the
// kernel's stream over it takes few TLB misses where transparent huge pages are on "madvise"
// (the default of many distributions and VMs): up to 5-15% faster over 30 layers' weights,
// measured on a 2-core AMD EPYC VM. Elsewhere, or if the mapping fails, at::zeros.
at::Tensor packed_zeros(int64_t nb, int64_t K) {
  const size_t bytes = static_cast<size_t>(nb * K * kCols) * sizeof(float);
#ifdef __linux__
  if (bytes >= kHugePage) {
    const size_t len = bytes + kHugePage;
    void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      const uintptr_t b = reinterpret_cast<uintptr_t>(base);
      void* p = reinterpret_cast<void*>((b + kHugePage - 1) / kHugePage * kHugePage);
      madvise(p, (bytes + kHugePage - 1) / kHugePage * kHugePage, MADV_HUGEPAGE);  // a hint: failure is fine
      return at::from_blob(p, {nb, K, kCols}, [base, len](void*) { munmap(base, len); },
                           at::TensorOptions().dtype(at::kFloat));
    }
  }
#endif
  return at::zeros({nb, K, kCols}, at::TensorOptions().dtype(at::kFloat));
}

struct Args {
  const float* x;
  int64_t ldx;
  const float* wp;
  int64_t N, K;
  const float* bias;      // [N] or null
  const float* res;       // residual rows or null
  int64_t ldr;
  float* out;
  int64_t ldo;
};

// out[m, n .. n+15] = v (+ bias[n ..]) (+ res[m, n ..]), the columns past N left alone. Straight
// from the accumulator register: a buffer stored and read back with masked loads would stall
// each read (a masked load does not take a store's data forwarded), a third of a task at 8 rows.
inline void put(const Args& a, int m, int64_t n, v16 v) {
  float* o = a.out + m * a.ldo + n;
  const float* r = a.res ? a.res + m * a.ldr + n : nullptr;
  if (n + kLane <= a.N) {
    if (a.bias) v += *reinterpret_cast<const v16u*>(a.bias + n);
    if (r) v += *reinterpret_cast<const v16u*>(r);
    *reinterpret_cast<v16u*>(o) = v;
    return;
  }
  alignas(64) float s[kLane];
  *reinterpret_cast<v16*>(s) = v;
  for (int64_t j = 0; j < a.N - n; ++j) o[j] = s[j] + (a.bias ? a.bias[n + j] : 0.f) + (r ? r[j] : 0.f);
}

// out[:, n0 .. n0+31] = x w (+ bias, + residual), w one block [K, 32]: both halves in one pass.
template <int M, int L>
inline void both_halves(const Args& a, const float* w, int64_t n0) {
  const float* x = a.x;
  const int64_t ldx = a.ldx, K = a.K;
  v16 a0[M], a1[M];
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = (v16){};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(w + (k + kAhead) * kCols, 0, L);
    __builtin_prefetch(w + (k + kAhead) * kCols + kLane, 0, L);
    const v16 b0 = *reinterpret_cast<const v16*>(w + k * kCols);
    const v16 b1 = *reinterpret_cast<const v16*>(w + k * kCols + kLane);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * ldx + k];
      a0[m] += xv * b0;
      a1[m] += xv * b1;
    }
  }
  for (int m = 0; m < M; ++m) {
    put(a, m, n0, a0[m]);
    if (n0 + kLane < a.N) put(a, m, n0 + kLane, a1[m]);
  }
}

// The same with one half of the block at a time (M accumulators: for 9..16 rows).
template <int M, int L>
inline void one_half_at_a_time(const Args& a, const float* w, int64_t n0) {
  const float* x = a.x;
  const int64_t ldx = a.ldx, K = a.K;
  for (int64_t h = 0; h < kCols && n0 + h < a.N; h += kLane) {
    v16 a0[M];
    for (int m = 0; m < M; ++m) a0[m] = (v16){};
    for (int64_t k = 0; k < K; ++k) {
      __builtin_prefetch(w + (k + kAhead) * kCols + h, 0, L);
      const v16 b0 = *reinterpret_cast<const v16*>(w + k * kCols + h);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) a0[m] += x[m * ldx + k] * b0;
    }
    for (int m = 0; m < M; ++m) put(a, m, n0 + h, a0[m]);
  }
}

// Block b of the weight (columns b*32 .. b*32+31) against the M rows of a, prefetching with
// locality L.
template <int M, int L>
void block(const Args& a, int64_t b) {
  if constexpr (M <= 8) {
    both_halves<M, L>(a, a.wp + b * a.K * kCols, b * kCols);
  } else {
    one_half_at_a_time<M, L>(a, a.wp + b * a.K * kCols, b * kCols);
  }
}

using BlockFn = void (*)(const Args&, int64_t);
template <int L>
constexpr std::array<BlockFn, 17> blocks() {
  return {nullptr, block<1, L>, block<2, L>, block<3, L>, block<4, L>, block<5, L>, block<6, L>,
          block<7, L>, block<8, L>, block<9, L>, block<10, L>, block<11, L>, block<12, L>,
          block<13, L>, block<14, L>, block<15, L>, block<16, L>};
}
// kBlock[locality][rows]
constexpr std::array<std::array<BlockFn, 17>, 4> kBlock = {blocks<0>(), blocks<1>(), blocks<2>(), blocks<3>()};

}  // namespace

namespace tokenrouter_cpu {

// W [N, K] -> [ceil(N / 32), K, 32] (zero-padded past N).
at::Tensor skinny_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "skinny_pack: the weight must be a 2-D float32 CPU tensor");
  auto W = w.contiguous();
  const int64_t N = W.size(0), K = W.size(1), nb = (N + kCols - 1) / kCols;
  auto out = packed_zeros(nb, K);
  const float* src = W.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < kCols && b * kCols + j < N; ++j) {
        const float* row = src + (b * kCols + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[(b * K + k) * kCols + j] = row[k];
      }
  });
  return out;
}

// x [M, K] float32; wp from skinny_pack of a [n, K] weight; bias [n] or none; residual [M, n]
// (unit stride in n) or none; prefetch: the locality of the weight stream's prefetch, 0..3 (as
// __builtin_prefetch's; the same bits whichever). Returns a new [M, n].
at::Tensor skinny_linear(const at::Tensor& x_, const at::Tensor& wp, int64_t n, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual, int64_t prefetch) {
  TORCH_CHECK(prefetch >= 0 && prefetch <= 3, "skinny_linear: prefetch must be a locality of 0..3, got ", prefetch);
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat && x_.device().is_cpu(),
              "skinny_linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == kCols && wp.size(1) == x_.size(1) && wp.size(0) * kCols >= n &&
                  wp.is_contiguous() && wp.scalar_type() == at::kFloat,
              "skinny_linear: the packed weight does not fit x [M, K] and n");
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto out = at::empty({M, n}, x.options());
  std::optional<at::Tensor> b, r;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat, "skinny_linear: bias must be [n] float32");
    b = bias->contiguous();
  }
  if (residual && residual->defined()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == M && residual->size(1) == n &&
                    residual->stride(1) == 1 && residual->scalar_type() == at::kFloat,
                "skinny_linear: residual must be [M, n] float32 with unit stride in n");
    r = *residual;
  }
  // chunks of up to 16 rows; a task runs every chunk on one block before the next block, so
  // that the block (K x 128 bytes) comes from memory once and from the cache for the others
  c10::SmallVector<std::pair<int64_t, Args>, 4> chunks;  // on the stack up to 64 rows
  for (int64_t m0 = 0; m0 < M; m0 += 16)
    chunks.emplace_back(std::min<int64_t>(16, M - m0),
                        Args{x.data_ptr<float>() + m0 * K, K, wp.data_ptr<float>(), n, K,
                             b ? b->data_ptr<float>() : nullptr,
                             r ? r->data_ptr<float>() + m0 * r->stride(0) : nullptr, r ? r->stride(0) : 0,
                             out.data_ptr<float>() + m0 * n, n});
  const int64_t nb = (n + kCols - 1) / kCols;
  const auto& fns = kBlock[prefetch];
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk)
      for (const auto& [mm, a] : chunks) fns[mm](a, blk);
  });
  return out;
}

}  // namespace tokenrouter_cpu

TORCH_LIBRARY_FRAGMENT(tokenrouter_cpu, m) {
  m.def("skinny_pack(Tensor w) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor wp, int n, Tensor? bias=None, Tensor? residual=None, int prefetch=0) -> Tensor");
  m.impl("skinny_pack", c10::DispatchKey::CPU, TORCH_FN(tokenrouter_cpu::skinny_pack));
  m.impl("skinny_linear", c10::DispatchKey::CPU, TORCH_FN(tokenrouter_cpu::skinny_linear));
}
