// Float32 math the compiler vectorizes inside `#pragma omp simd` loops (glibc's expf does not
// vectorize without -ffast-math, and a scalar expf per element is most of an elementwise
// pass at decode sizes).
//
//   exp_f32(x): e^x to about 2 ulp; 0 below -87.33 (where e^x < 1.2e-38, the smallest normal
//     float), +inf above 88.72 (where e^x > the largest float); NaN stays NaN. Cody-Waite range reduction
//     x = n ln2 + r, |r| <= ln2 / 2, and Cephes' degree-6 polynomial for e^r (S. L. Moshier,
//     Cephes Math Library, expf.c), scaled by 2^n through the exponent bits.
//   exp_of<T>(x): exp_f32 for float, std::exp otherwise.
//   bf16_float(b), bf16_bits(x): a bfloat16's 16 bits as float32 (exact: a bfloat16 is the upper
//     half of a float32) and float32 to bfloat16 bits (c10::BFloat16's round-to-nearest-even, a
//     NaN as 0x7FC0), in integer arithmetic (c10::BFloat16's own conversions are scalar).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tokenrouter_cpu {

inline float exp_f32(float x) {
  const float lo = -87.33f, hi = 88.73f;
  const bool under = x < lo;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;  // NaN compares false both times and stays NaN
  // n = round(x / ln2): adding and subtracting 1.5 * 2^23 rounds to nearest in float arithmetic
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  // 2^n as 2^a * 2^b, each a normal float for n in [-126, 128] (2^128 itself is not)
  const int32_t ni = static_cast<int32_t>(n), a = ni >> 1, b = ni - a;
  const int32_t abits = (a + 127) << 23, bbits = (b + 127) << 23;
  float sa, sb;
  std::memcpy(&sa, &abits, sizeof sa);
  std::memcpy(&sb, &bbits, sizeof sb);
  return under ? 0.0f : y * sa * sb;
}

inline float bf16_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : static_cast<uint16_t>(r);
}

template <typename T>
inline T exp_of(T x) {
  if constexpr (sizeof(T) == 4) {
    return exp_f32(x);
  } else {
    return std::exp(x);
  }
}

}  // namespace tokenrouter_cpu
