// Projections of a few rows (decode steps) on a CPU, float32: y = x W^T (+ bias) (+ residual)
// over a weight packed once into column blocks of 16, [ceil(N / 16), K, 16], so that a step
// streams each weight's bytes exactly once, in order, from memory.
//
// At a few rows a projection is bound by reading its weight: every weight value is used M times
// (M = rows), so the arithmetic (M FMAs per value) hides under the read when it is kept in
// registers. A task takes two column blocks (32 outputs) and walks K: per k it loads the two
// 16-wide weight vectors once and broadcasts x[m, k] into 2 M accumulators (M <= 8; 9..16 rows
// take one block and M accumulators), prefetching the weight stream ahead. Tasks are spread over
// torch's thread pool (at::parallel_for, so torch.set_num_threads and core lending apply).
// Rows beyond 16 run in chunks of 16 (the weight read again per chunk), where a blocked GEMM
// (oneDNN) does better; which path runs at which row count is measured on the machine
// (tokenrouter_sdk/backends/autotune.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kCols = 16;       // outputs per column block
constexpr int64_t kAhead = 64;      // weight rows (of one block) prefetched ahead (4 KiB)

constexpr size_t kHugePage = size_t(2) << 20;

// A zeroed float32 [nb, K, 16] for a packed weight. On Linux one of 2 MiB or more gets its own
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

// W [N, K] -> [ceil(N / 16), K, 16] (zero-padded past N).
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

// acc[m][0..31] = sum_k x[m, k] * (block w0, block w1)[k]
template <int M>
inline void two_blocks(const float* x, int64_t ldx, const float* w0, const float* w1, int64_t K, float* acc) {
  v16 a0[M], a1[M];
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = (v16){};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(w0 + (k + kAhead) * kCols, 0, 0);
    __builtin_prefetch(w1 + (k + kAhead) * kCols, 0, 0);
    const v16 b0 = *reinterpret_cast<const v16*>(w0 + k * kCols);
    const v16 b1 = *reinterpret_cast<const v16*>(w1 + k * kCols);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * ldx + k];
      a0[m] += xv * b0;
      a1[m] += xv * b1;
    }
  }
  for (int m = 0; m < M; ++m) {
    *reinterpret_cast<v16u*>(acc + m * 2 * kCols) = a0[m];
    *reinterpret_cast<v16u*>(acc + m * 2 * kCols + kCols) = a1[m];
  }
}

// acc[m][0..15] = sum_k x[m, k] * (block w0)[k]
template <int M>
inline void one_block(const float* x, int64_t ldx, const float* w0, int64_t K, float* acc) {
  v16 a0[M];
  for (int m = 0; m < M; ++m) a0[m] = (v16){};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(w0 + (k + 2 * kAhead) * kCols, 0, 0);
    const v16 b0 = *reinterpret_cast<const v16*>(w0 + k * kCols);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) a0[m] += x[m * ldx + k] * b0;
  }
  for (int m = 0; m < M; ++m) *reinterpret_cast<v16u*>(acc + m * 2 * kCols) = a0[m];
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

template <int M>
void rows(const Args& a) {
  constexpr int64_t per = M <= 8 ? 2 : 1;  // column blocks per task
  const int64_t nb = (a.N + kCols - 1) / kCols, tasks = (nb + per - 1) / per;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[M * 2 * kCols];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * per, b1 = std::min(b0 + per, nb);
      if constexpr (M <= 8) {
        // a lone last block reads itself twice (cached) rather than a second code path
        two_blocks<M>(a.x, a.ldx, a.wp + b0 * a.K * kCols, a.wp + (b1 - 1) * a.K * kCols, a.K, acc);
      } else {
        one_block<M>(a.x, a.ldx, a.wp + b0 * a.K * kCols, a.K, acc);
      }
      const int64_t n0 = b0 * kCols, cols = std::min((b1 - b0) * kCols, a.N - n0);
      for (int m = 0; m < M; ++m) {
        float* o = a.out + m * a.ldo + n0;
        const float* s = acc + m * 2 * kCols;
        const float* r = a.res ? a.res + m * a.ldr + n0 : nullptr;
        for (int64_t j = 0; j < cols; ++j)
          o[j] = s[j] + (a.bias ? a.bias[n0 + j] : 0.f) + (r ? r[j] : 0.f);
      }
    }
  });
}

using RowsFn = void (*)(const Args&);
constexpr RowsFn kRows[17] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>,
                              rows<9>, rows<10>, rows<11>, rows<12>, rows<13>, rows<14>, rows<15>, rows<16>};

// x [M, K] float32; wp from skinny_pack of a [n, K] weight; bias [n] or none; residual [M, n]
// (unit stride in n) or none. Returns a new [M, n].
at::Tensor skinny_linear(const at::Tensor& x_, const at::Tensor& wp, int64_t n, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual) {
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
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t mm = std::min<int64_t>(16, M - m0);
    Args a{x.data_ptr<float>() + m0 * K, K, wp.data_ptr<float>(), n, K,
           b ? b->data_ptr<float>() : nullptr,
           r ? r->data_ptr<float>() + m0 * r->stride(0) : nullptr, r ? r->stride(0) : 0,
           out.data_ptr<float>() + m0 * n, n};
    kRows[mm](a);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenrouter_cpu, m) {
  m.def("skinny_pack(Tensor w) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor wp, int n, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.impl("skinny_pack", c10::DispatchKey::CPU, TORCH_FN(skinny_pack));
  m.impl("skinny_linear", c10::DispatchKey::CPU, TORCH_FN(skinny_linear));
}
