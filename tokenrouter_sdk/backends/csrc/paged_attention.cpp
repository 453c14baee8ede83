// Paged attention for decode and extend queries on a CPU, reading keys and values in place
// from the KV pool (no per-step gather of a request's cache into a padded copy).
//
// Pool layout (tokenrouter_sdk/engine/kv_pool.py): k and v of one layer are [slots, Hkv, D];
// request r's key position l lives in slot table[r, l]. A request has q_len[r] queries, packed
// at rows q_start[r] .. q_start[r] + q_len[r] - 1 of q and out ([T, H, D]); its query t, at
// position p = kv_len[r] - q_len[r] + t, sees the keys l <= p (a decode: q_len 1, every key; an
// extend: causal) and, with a sliding window W > 0, only those with l > p - W (transformers'
// sliding_window: W keys, the query's own included). Only keys inside some query's window are
// read. Scores are q.k * scale, soft-capped to c * tanh(s / c) when c > 0 (Gemma 2's
// attn_logit_softcapping), in that order, as transformers' eager attention computes them.
// Grouped-query attention: query head h reads KV head h / (H / Hkv), as transformers' repeat_kv.
//
// dtypes: float64, float32, and bfloat16 (q, out and the pools; the computation in float32 on the
// widened values, which a bfloat16 holds exactly, and the output rounded to bfloat16 once: the bits
// of the float32 kernel run on the widened inputs; each key row is widened once for all its heads).
// A bfloat16 pool is read in place at half the bytes of a float32 one, where a gather would copy
// every request's keys and values out of the pool at every step.
//
// Split-K (flash-decoding, Dao et al. 2023): each (request, chunk of keys) is one task of
// at::parallel_for (torch's own thread pool); a task reads each of its keys' pool rows once,
// all heads together (a row is contiguous: Hkv * D values), prefetching a few keys ahead both
// the key rows and the value rows (so that the value pass finds them in the cache: a pool whose
// blocks lie scattered, as in a long-running server, reads at the latency of one stream
// otherwise), and keeps per query head the running max, the sum of exponentials and the
// weighted values; the chunks are merged by their log-sum-exp. Chunks tile each request's keys from the
// first one its window reaches, so a windowed layer reads W + q_len - 1 keys at most. A task of
// tile_from queries or more (0: none) scores its keys 16 at a time (float32 and bfloat16 with
// AVX-512; a bfloat16 tile's key rows widened first), with the same bits as the per-key loop.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "vec_math.h"

namespace {

constexpr int64_t kPrefetchKeys = 4;

// v16: 16 float32 lanes, loaded and stored at any 4-byte alignment; v16i: shuffle indices for it
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int v16i __attribute__((vector_size(64)));

template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < n * static_cast<int64_t>(sizeof(T)); o += 64) __builtin_prefetch(c + o, 0, 3);
}

// 16 stored values as float32 lanes: a float32 load, or bfloat16 values widened (exact: a
// bfloat16 is the upper half of a float32's bits)
inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline v16 load16(const c10::BFloat16* p) {
  v16 r;
#if defined(__AVX512F__)
  __m512 w = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  std::memcpy(&r, &w, sizeof(r));
#else
  for (int i = 0; i < 16; ++i) r[i] = tokenrouter_cpu::bf16_float(p[i].x);
#endif
  return r;
}

// n stored values as float32 (exact)
inline void widen(const c10::BFloat16* p, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) *reinterpret_cast<v16*>(out + i) = load16(p + i);
  for (; i < n; ++i) out[i] = tokenrouter_cpu::bf16_float(p[i].x);
}

// the sum of v's 16 lanes: lanes 8 apart, then 4, 2 and 1 apart
inline float lane_sum(v16 v) {
  v += __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, (v16i){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
  v += __builtin_shuffle(v, (v16i){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
  return v[0];
}

// a . b over n values; float32 with n a multiple of 16: one vector of lane sums (the first
// product, then fused multiply-adds, explicit with AVX-512 so that the tiles' `lane_dot` adds the
// same way), then `lane_sum`
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  if constexpr (sizeof(T) == 4) {
    if (n % 16 == 0) {
#if defined(__AVX512F__)
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
      for (int64_t d = 16; d < n; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
      return lane_sum(reinterpret_cast<v16&>(acc));
#else
      v16 acc = *reinterpret_cast<const v16*>(a) * *reinterpret_cast<const v16*>(b);
      for (int64_t d = 16; d < n; d += 16)
        acc += *reinterpret_cast<const v16*>(a + d) * *reinterpret_cast<const v16*>(b + d);
      return lane_sum(acc);
#endif
    }
  }
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

struct Shape {
  int64_t H, Hkv, D, Lmax, Qmax, C, nc, W, tile_from;
};

// the first key request r reads: its first query's window start (0 without a window)
inline int64_t first_key(int64_t q_len, int64_t kv_len, int64_t W) {
  return W > 0 ? std::max<int64_t>(kv_len - q_len + 1 - W, 0) : 0;
}

// keys per chunk: enough chunks to give every thread two tasks, at most kMaxChunk keys (so a
// task's scores, Qmax * H * C values, stay small) and at least 32
constexpr int64_t kMaxChunk = 2048;

constexpr int64_t kLane = 16;  // floats per vector

// The largest of s[a .. b) (-inf when empty). Float32 with AVX-512: 16 lanes at a time, then the
// rest one by one; a scalar loop's std::max keeps one chain of dependent maxss, whose order the
// compiler must keep for NaNs: 18% of the samples of a task's work (perf), and 4-8% of the
// attention's time over 8 decodes of 200 or 1,100 keys (2-core Intel Xeon). The same value
// either way: a maximum is exact in any order, and a +-0 tie, the one case the order could pick,
// gives the same exp(s - m).
template <typename T>
inline T max_of(const T* s, int64_t a, int64_t b) {
  T m = -INFINITY;
  int64_t l = a;
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    if (b - a >= kLane) {
      __m512 v = _mm512_loadu_ps(s + a);
      for (l = a + kLane; l + kLane <= b; l += kLane) v = _mm512_max_ps(v, _mm512_loadu_ps(s + l));
      m = _mm512_reduce_max_ps(v);
    }
  }
#endif
  for (; l < b; ++l) m = std::max(m, s[l]);
  return m;
}

// The keys [l0, l0 + n) of one task: query t (of q_len, the last at position kv_len - 1) sees
// those in [from(t), seen(t)), relative to l0.
struct Keys {
  int64_t q_len, kv_len, l0, n, W;
  int64_t seen(int64_t t) const { return std::clamp<int64_t>(kv_len - q_len + t + 1 - l0, 0, n); }
  int64_t from(int64_t t) const {
    return W > 0 ? std::clamp<int64_t>(kv_len - q_len + t + 1 - W - l0, 0, n) : int64_t(0);
  }
};

// The exp-weighted values of one task, float32 with D = 16 NV, added to part's sums (zeroed
// before): for each query t, tile of kTile keys and KV head, query heads HP at a time keep
// their D sums in registers (HP * NV vectors) while the tile's value slices stream by. A tile's
// value rows (kTile * Hkv * D floats) stay in the L1 cache across its KV heads' passes; what
// reaches memory per key is its value row once, where an accumulation in part at every key
// would load and store every head's sums.
constexpr int64_t kTile = 32;

template <int NV, typename S>
void value_sums(const Shape& sh, const S* vc, const int64_t* slots, int64_t l0, int64_t q_len, const float* s,
                float* part, const Keys& keys) {
  constexpr int HP = std::min(8, std::max(1, 24 / NV));
  const int64_t H = sh.H, D = sh.D, g = H / sh.Hkv, row = sh.Hkv * D, C = sh.C, P = D + 2;
  for (int64_t t = 0; t < q_len; ++t) {
    const int64_t a = keys.from(t), b = std::max(keys.seen(t), a);
    for (int64_t t0 = a; t0 < b; t0 += kTile) {
      const int64_t t1 = std::min(b, t0 + kTile);
      for (int64_t kvh = 0; kvh < sh.Hkv; ++kvh) {
        for (int64_t h0 = kvh * g; h0 < (kvh + 1) * g; h0 += HP) {
          const int64_t nh = std::min<int64_t>(HP, (kvh + 1) * g - h0);
          const float* st = s + (t * H + h0) * C;
          float* out = part + (t * H + h0) * P + 2;
          v16 acc[HP][NV];
#pragma GCC unroll 8
          for (int j = 0; j < HP; ++j)
            for (int i = 0; i < NV; ++i)
              acc[j][i] = j < nh ? *reinterpret_cast<const v16*>(out + j * P + i * kLane) : (v16){};
          for (int64_t l = t0; l < t1; ++l) {
            const S* vp = vc + slots[l0 + l] * row + kvh * D;
            v16 vv[NV];
#pragma GCC unroll 8
            for (int i = 0; i < NV; ++i) vv[i] = load16(vp + i * kLane);
#pragma GCC unroll 8
            for (int j = 0; j < HP; ++j) {
              if (j < nh) {
                const float p = st[j * C + l];
#pragma GCC unroll 8
                for (int i = 0; i < NV; ++i) acc[j][i] += p * vv[i];
              }
            }
          }
#pragma GCC unroll 8
          for (int j = 0; j < HP; ++j)
            if (j < nh)
              for (int i = 0; i < NV; ++i) *reinterpret_cast<v16*>(out + j * P + i * kLane) = acc[j][i];
        }
      }
    }
  }
}

template <typename S>
using ValueSumsFn = void (*)(const Shape&, const S*, const int64_t*, int64_t, int64_t, const float*, float*,
                             const Keys&);
template <typename S>
constexpr ValueSumsFn<S> kValueSums[9] = {nullptr,          value_sums<1, S>, value_sums<2, S>,
                                          value_sums<3, S>, value_sums<4, S>, value_sums<5, S>,
                                          value_sums<6, S>, value_sums<7, S>, value_sums<8, S>};

// The scores of one task, a dot per key: st[h * C + l] = (q_t[h] . k_l) * mul for each query t
// and the keys l it sees, keys read in order, each row once for all queries, the key and value
// rows fetched kPrefetchKeys keys ahead.
template <typename T, typename S>
void key_scores(const Shape& sh, const T* q, const S* kc, const S* vc, const int64_t* slots, int64_t q_len,
                int64_t l0, T mul, T* s, const Keys& keys) {
  const int64_t H = sh.H, D = sh.D, g = H / sh.Hkv, row = sh.Hkv * D, C = sh.C, n = keys.n;
  std::vector<T> wide(std::is_same_v<S, T> ? 0 : row);  // a key row widened once for all its heads
  for (int64_t l = 0; l < n; ++l) {
    if (l + kPrefetchKeys < n) {
      prefetch_row(kc + slots[l0 + l + kPrefetchKeys] * row, row);
      prefetch_row(vc + slots[l0 + l + kPrefetchKeys] * row, row);
    }
    const T* kr;
    if constexpr (std::is_same_v<S, T>) {
      kr = kc + slots[l0 + l] * row;
    } else {
      widen(kc + slots[l0 + l] * row, wide.data(), row);
      kr = wide.data();
    }
    for (int64_t t = 0; t < q_len; ++t) {
      if (l >= keys.seen(t) || l < keys.from(t)) continue;
      const T* qt = q + t * H * D;
      T* st = s + t * H * C;
      for (int64_t h = 0; h < H; ++h) st[h * C + l] = dot(qt + h * D, kr + (h / g) * D, D) * mul;
    }
  }
}

#if defined(__AVX512F__)
// Scores of 16 keys at a time, float32 with D = 16 NV: per query head, each key's dot is kept as
// one vector of lane sums (its products added along D as `dot` adds them), and the 16 vectors'
// lanes are summed together by a tree of two-vector folds, 15 folds for 16 sums where a dot per
// key ends in 4 shuffles and 4 adds of its own. Each sum is added in `dot`'s order (lanes 8 apart,
// then 4, then 2, then 1), so a score has the same bits either way:
//   fold8(a, b) = [a0 + a2, a1 + a3, b0 + b2, b1 + b3]   (ai: a's i-th group of 4 lanes)
//   fold4(x, y) = [x0 + x1, x2 + x3, y0 + y1, y2 + y3]   (each group now holds one key's 4 partials)
//   fold2, fold1: the lanes 2 and 1 apart within each group, across two such vectors.
// Lane 4 j + q of the result is the key that fed group j of the q-th fold4, so the keys are fed
// in the order that leaves key m in lane m.
inline v16 fold8(v16 a, v16 b) {
  return __builtin_shuffle(a, b, (v16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
         __builtin_shuffle(a, b, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
}
inline v16 fold4(v16 x, v16 y) {
  return __builtin_shuffle(x, y, (v16i){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
         __builtin_shuffle(x, y, (v16i){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
}
inline v16 fold2(v16 x, v16 y) {
  return __builtin_shuffle(x, y, (v16i){0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29}) +
         __builtin_shuffle(x, y, (v16i){2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31});
}
inline v16 fold1(v16 x, v16 y) {
  return __builtin_shuffle(x, y, (v16i){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
         __builtin_shuffle(x, y, (v16i){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
}

// one key's products with one query head summed along D with the lanes kept, as `dot` adds them
template <int NV>
inline v16 lane_dot(const float* q, const float* k) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
#pragma GCC unroll 8
  for (int i = 1; i < NV; ++i)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * kLane), _mm512_loadu_ps(k + i * kLane), acc);
  return reinterpret_cast<v16&>(acc);
}

// out[m] = (q . k[m]) * mul for the 16 keys k[m] (m = 0..15), each at offset ko of its row:
// key m's lane vector enters the fold tree where its sum comes out in lane m
template <int NV>
inline void score16(const float* q, const float* const* k, int64_t ko, float mul, float* out) {
  v16 f[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
    f[j] = fold4(fold8(lane_dot<NV>(q, k[j] + ko), lane_dot<NV>(q, k[4 + j] + ko)),
                 fold8(lane_dot<NV>(q, k[8 + j] + ko), lane_dot<NV>(q, k[12 + j] + ko)));
  *reinterpret_cast<v16*>(out) = fold1(fold2(f[0], f[1]), fold2(f[2], f[3])) * mul;
}

// The scores of one task of several queries (an extend), float32 with D = 16 NV:
// st[h * C + l] = (q_t[h] . k_l) * mul for each query t and the keys l it sees. Tiles of 16 keys:
// every query head that sees a whole tile scores it with one fold tree (`score16`), the tile's
// key rows staying in the L1 cache across the queries and heads; a key of a tile seen in part
// gets one `dot`. The next tile's key and value rows are fetched while a tile is scored. Tasks of
// fewer than `tile_from` queries keep the per-key loop: its keys stream from memory in order,
// where the tile order reads them more slowly, and few queries leave too little work per key to
// make up for it (cold pools, 30 layers, 2-core AMD EPYC: tiles 5% faster at 4 queries, 23-36% at
// 8-32, 5-23% slower at 2-3); the runner measures the crossover per machine (`kernel_choice`).
template <int NV, typename S>
void tile_scores(const Shape& sh, const float* q, const S* kc, const S* vc, const int64_t* slots,
                 int64_t q_len, int64_t l0, float mul, float* s, const Keys& keys) {
  const int64_t H = sh.H, D = sh.D, g = H / sh.Hkv, row = sh.Hkv * D, C = sh.C, n = keys.n;
  const float* kr[16];
  std::vector<float> wide(std::is_same_v<S, float> ? 0 : 16 * row);  // a tile's key rows widened
  for (int64_t l = 0; l < n; l += 16) {
    const int64_t e = std::min(n, l + 16);
    for (int64_t m = e; m < std::min(n, e + 16); ++m) {
      prefetch_row(kc + slots[l0 + m] * row, row);
      prefetch_row(vc + slots[l0 + m] * row, row);
    }
    for (int64_t m = l; m < e; ++m) {
      if constexpr (std::is_same_v<S, float>) {
        kr[m - l] = kc + slots[l0 + m] * row;
      } else {
        widen(kc + slots[l0 + m] * row, wide.data() + (m - l) * row, row);
        kr[m - l] = wide.data() + (m - l) * row;
      }
    }
    for (int64_t t = 0; t < q_len; ++t) {
      const int64_t a = std::max(keys.from(t), l), b = std::min(keys.seen(t), e);
      if (a >= b) continue;
      const float* qt = q + t * H * D;
      float* st = s + t * H * C;
      for (int64_t kvh = 0; kvh < sh.Hkv; ++kvh)
        for (int64_t h = kvh * g; h < (kvh + 1) * g; ++h) {
          if (b - a == 16)
            score16<NV>(qt + h * D, kr, kvh * D, mul, st + h * C + l);
          else
            for (int64_t m = a; m < b; ++m) st[h * C + m] = dot(qt + h * D, kr[m - l] + kvh * D, D) * mul;
        }
    }
  }
}

template <typename S>
using ScoresFn = void (*)(const Shape&, const float*, const S*, const S*, const int64_t*, int64_t, int64_t, float,
                          float*, const Keys&);
template <typename S>
constexpr ScoresFn<S> kTileScores[9] = {nullptr,           tile_scores<1, S>, tile_scores<2, S>,
                                        tile_scores<3, S>, tile_scores<4, S>, tile_scores<5, S>,
                                        tile_scores<6, S>, tile_scores<7, S>, tile_scores<8, S>};
#endif

// One task: request r's queries (as T) against keys [l0, l1) of pools stored as S. part holds, per
// (query t, head h), D + 2 values: max score, sum of exponentials, then the exp-weighted values.
template <typename T, typename S>
void attend_chunk(const Shape& sh, const T* q, const S* kc, const S* vc, const int64_t* slots,
                  int64_t q_len, int64_t kv_len, int64_t l0, int64_t l1, T scale, T cap, T* s, T* part) {
  const int64_t H = sh.H, D = sh.D, g = H / sh.Hkv, row = sh.Hkv * D, C = sh.C, P = D + 2;
  const int64_t n = std::max<int64_t>(l1 - l0, 0);
  const Keys keys{q_len, kv_len, l0, n, sh.W};
  // a soft-capped score is the dot alone here (x 1 is exact): the cap follows below
  const T mul = cap > 0 ? T(1) : scale;
  bool tiled = false;
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    tiled = sh.tile_from > 0 && q_len >= sh.tile_from && D % kLane == 0 && D / kLane <= 8;
    if (tiled) kTileScores<S>[D / kLane](sh, q, kc, vc, slots, q_len, l0, mul, s, keys);
  }
#endif
  if (!tiled) key_scores<T, S>(sh, q, kc, vc, slots, q_len, l0, mul, s, keys);
  for (int64_t t = 0; t < q_len; ++t) {
    const int64_t a = keys.from(t), b = std::max(keys.seen(t), a);
    for (int64_t h = 0; h < H; ++h) {
      T* si = s + (t * H + h) * C;
      T* pi = part + (t * H + h) * P;
      // the soft-cap c * tanh(s * scale / c) over the scores this query reads: the same
      // operations in the same order as inside the key loop, where they made a soft-capped
      // layer's attention 1.3-1.6x as long (30 layers of decodes and extends, 2-core AMD EPYC)
      if (cap > 0)
        for (int64_t l = a; l < b; ++l) si[l] = cap * std::tanh(si[l] * scale / cap);
      std::fill(pi + 2, pi + P, T(0));
      const T m = max_of(si, a, b);
      T z = 0;
#pragma omp simd reduction(+ : z)
      for (int64_t l = a; l < b; ++l) {
        si[l] = tokenrouter_cpu::exp_of(si[l] - m);
        z += si[l];
      }
      pi[0] = m;
      pi[1] = z;
    }
  }
  if constexpr (sizeof(T) == 4) {
    if (D % kLane == 0 && D / kLane <= 8) {
      kValueSums<S>[D / kLane](sh, vc, slots, l0, q_len, s, part, keys);
      return;
    }
  }
  for (int64_t l = 0; l < n; ++l) {
    if (l + kPrefetchKeys < n) prefetch_row(vc + slots[l0 + l + kPrefetchKeys] * row, row);
    const S* vr = vc + slots[l0 + l] * row;
    for (int64_t t = 0; t < q_len; ++t) {
      if (l >= keys.seen(t) || l < keys.from(t)) continue;
      for (int64_t h = 0; h < H; ++h) {
        const T p = s[(t * H + h) * C + l];
        const S* vp = vr + (h / g) * D;
        T* acc = part + (t * H + h) * P + 2;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<T>(vp[d]);
      }
    }
  }
}

// T: the arithmetic's type; S: q's, out's and the pools' (T, or bfloat16 with T float32: a request's
// queries are widened once per task, its output rows rounded once)
template <typename T, typename S>
void attend(const Shape& sh, S* out, const S* q, const S* kc, const S* vc, const int64_t* table,
            const int64_t* q_start, const int64_t* q_len, const int64_t* kv_len, int64_t R, T scale, T cap) {
  constexpr bool kSame = std::is_same_v<S, T>;
  const int64_t H = sh.H, D = sh.D, P = D + 2, nc = sh.nc;
  // request r's parts: nc chunks x q_len[r] queries x H heads x P values, from offset[r]
  std::vector<int64_t> offset(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) offset[r + 1] = offset[r] + nc * q_len[r] * H * P;
  std::vector<T> parts(offset[R]);
  at::parallel_for(0, R * nc, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> s(sh.Qmax * H * sh.C);
    std::vector<T> qw(kSame ? 0 : sh.Qmax * H * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / nc, c = task % nc, l0 = first_key(q_len[r], kv_len[r], sh.W) + c * sh.C;
      const int64_t l1 = std::min(kv_len[r], l0 + sh.C);
      const S* qr = q + q_start[r] * H * D;
      const T* qt;
      if constexpr (kSame) {
        qt = qr;
      } else {
#pragma omp simd
        for (int64_t i = 0; i < q_len[r] * H * D; ++i) qw[i] = tokenrouter_cpu::bf16_float(qr[i].x);
        qt = qw.data();
      }
      attend_chunk<T, S>(sh, qt, kc, vc, table + r * sh.Lmax, q_len[r], kv_len[r], l0, l1, scale, cap, s.data(),
                         parts.data() + offset[r] + c * q_len[r] * H * P);
    }
  });
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> ow(kSame ? 0 : D);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t th = 0; th < q_len[r] * H; ++th) {
        T m = -INFINITY;
        const int64_t stride = q_len[r] * H * P;
        for (int64_t c = 0; c < nc; ++c) {
          const T* p = parts.data() + offset[r] + c * stride + th * P;
          if (p[1] > 0) m = std::max(m, p[0]);
        }
        S* os = out + q_start[r] * H * D + th * D;
        T* o;
        if constexpr (kSame) o = os; else o = ow.data();
        std::fill(o, o + D, T(0));
        T z = 0;
        for (int64_t c = 0; c < nc; ++c) {
          const T* p = parts.data() + offset[r] + c * stride + th * P;
          if (!(p[1] > 0)) continue;
          const T a = std::exp(p[0] - m);
          z += a * p[1];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += a * p[2 + d];
        }
        const T inv = T(1) / z;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        if constexpr (!kSame)
          for (int64_t d = 0; d < D; ++d) os[d].x = tokenrouter_cpu::bf16_bits(o[d]);
      }
    }
  });
}

}  // namespace

namespace tokenrouter_cpu {

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& table, const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& kv_len, double scale, int64_t chunk, int64_t window, double softcap,
                     int64_t tile_from) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, H, D] of one shape");
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(), "k_pool and v_pool must be [slots, Hkv, D]");
  TORCH_CHECK(q.size(2) == k_pool.size(2) && q.size(1) % k_pool.size(1) == 0,
              "head dims differ, or query heads are not a multiple of KV heads");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  table.is_contiguous(), "q, out, k_pool, v_pool and table must be contiguous");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16,
              "paged_attention supports float32, float64 and bfloat16, got ", dt);
  TORCH_CHECK(out.scalar_type() == dt && k_pool.scalar_type() == dt && v_pool.scalar_type() == dt,
              "q, out and the pools must share one dtype");
  for (const auto* t : {&table, &q_start, &q_len, &kv_len})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu(), "table and lengths must be int64 CPU tensors");
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu(), "paged_attention runs on the CPU");
  const int64_t R = table.size(0);
  if (R == 0) return;
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(tile_from >= 0, "tile_from must be >= 0 (0: never), got ", tile_from);
  Shape sh{q.size(1), k_pool.size(1), q.size(2), table.size(1), 1, 256, 1, window, tile_from};
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* kl = kv_len.data_ptr<int64_t>();
  const int64_t* qs = q_start.contiguous().data_ptr<int64_t>();
  int64_t span = 1;  // the most keys one request reads
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(ql[r] >= 1 && kl[r] >= ql[r] && kl[r] <= sh.Lmax && qs[r] >= 0 && qs[r] + ql[r] <= q.size(0),
                "request ", r, ": q_len ", ql[r], ", kv_len ", kl[r], ", q_start ", qs[r], " do not fit");
    sh.Qmax = std::max(sh.Qmax, ql[r]);
    span = std::max(span, kl[r] - first_key(ql[r], kl[r], window));
  }
  const int64_t want = (2 * at::get_num_threads() + R - 1) / R;  // chunks per request
  TORCH_CHECK(chunk >= 0, "chunk must be >= 0 (0: chosen here), got ", chunk);
  sh.C = chunk > 0 ? chunk : std::clamp<int64_t>(((span + want - 1) / want + 15) / 16 * 16, 32, kMaxChunk);
  sh.nc = (span + sh.C - 1) / sh.C;
  if (dt == at::kFloat)
    attend<float, float>(sh, out.data_ptr<float>(), q.data_ptr<float>(), k_pool.data_ptr<float>(),
                         v_pool.data_ptr<float>(), table.data_ptr<int64_t>(), qs, ql, kl, R, static_cast<float>(scale),
                         static_cast<float>(softcap));
  else if (dt == at::kBFloat16)
    attend<float, c10::BFloat16>(sh, out.data_ptr<c10::BFloat16>(), q.data_ptr<c10::BFloat16>(),
                                 k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>(),
                                 table.data_ptr<int64_t>(), qs, ql, kl, R, static_cast<float>(scale),
                                 static_cast<float>(softcap));
  else
    attend<double, double>(sh, out.data_ptr<double>(), q.data_ptr<double>(), k_pool.data_ptr<double>(),
                           v_pool.data_ptr<double>(), table.data_ptr<int64_t>(), qs, ql, kl, R, scale, softcap);
}

// Write a step's new keys and values into one layer's pool: k_pool[slots[t]] = k[t], the same
// for v. k and v [T, Hkv, D] with unit stride in D (q/k/v views of one projection output);
// the pools [slots, Hkv, D] contiguous, of k's dtype. One call for both, where two index_copy_
// calls cost several microseconds each at decode sizes.
void store_kv(at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "store_kv: k_pool and v_pool must be contiguous [slots, Hkv, D] of one shape");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == k_pool.size(1) && k.size(2) == k_pool.size(2) &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "store_kv: k and v must be [T, Hkv, D] like the pool's rows, with unit stride in D");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "store_kv: slots must be a contiguous int64 [T]");
  const auto dt = k_pool.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16) && v_pool.scalar_type() == dt &&
                  k.scalar_type() == dt && v.scalar_type() == dt,
              "store_kv: the pools, k and v must share one dtype, float32, float64 or bfloat16");
  TORCH_CHECK(k_pool.device().is_cpu() && k.device().is_cpu() && slots.device().is_cpu(), "store_kv runs on the CPU");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2), S = k_pool.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "store_kv: slot ", sl[t], " of token ", t, " is outside the pool's ", S);
  const int64_t bytes = D * static_cast<int64_t>(k.element_size());
  char* kp = static_cast<char*>(k_pool.data_ptr());
  char* vp = static_cast<char*>(v_pool.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size(), k0 = k.stride(0) * es, k1 = k.stride(1) * es, v0 = v.stride(0) * es,
                v1 = v.stride(1) * es;
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(H * bytes, 1)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t dst = (sl[t] * H + h) * bytes;
        std::memcpy(kp + dst, ks + t * k0 + h * k1, bytes);
        std::memcpy(vp + dst, vs + t * v0 + h * v1, bytes);
      }
  });
}

}  // namespace tokenrouter_cpu

TORCH_LIBRARY_FRAGMENT(tokenrouter_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor q_start, "
        "Tensor q_len, Tensor kv_len, float scale, int chunk=0, int window=0, float softcap=0.0, "
        "int tile_from=4) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(tokenrouter_cpu::paged_attention));
  m.def("store_kv(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, Tensor k, Tensor v) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, TORCH_FN(tokenrouter_cpu::store_kv));
}
