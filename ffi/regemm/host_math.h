// Branch-free float exp, tanh and erfc for the host: pure arithmetic and
// selects, so the compiler vectorizes the CPU epilogue loops (libm's expf,
// tanhf and erfcf are opaque calls that keep them scalar; the floor in exp
// vectorizes with -fno-trapping-math). Accuracy within a few ulp, like CUDA's
// expf, tanhf and erfcf on the device. NaN propagates; exp underflows to 0,
// overflows to inf.
#pragma once

#include <cstdint>
#include <cstring>

namespace regemm::host_math {

inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float pow2i(float n) { return from_bits(uint32_t(int32_t(n) + 127) << 23); }  // n in [-126, 127]

// x = n ln2 + r with n whole and |r| <= ln2/2; ln2 in two parts, so that r is exact.
inline float reduce_ln2(float x, float* n) {
  const float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
  *n = __builtin_floorf(x * kLog2e + 0.5f);
  return (x - *n * kLn2Hi) - *n * kLn2Lo;
}

inline float exp(float x) {
  const float xc = x < -104.0f ? -104.0f : (x > 88.8f ? 88.8f : x);  // beyond: 0 or inf anyway
  float n;                                                             // in [-150, 128]
  const float r = reduce_ln2(xc, &n);
  float p = 1.0f / 5040.0f;                                           // Taylor to r^7: < 1e-8 relative
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float n1 = __builtin_floorf(0.5f * n);                         // 2^n as two normal factors,
  const float y = p * pow2i(n1) * pow2i(n - n1);                       // so subnormals and inf come out right
  return x != x ? x : y;
}

// exp(x) for x <= 0 (or NaN, which propagates), where the activations call it
// (exp(-|z|), exp(-2|z|)): no overflow side, and a result below the smallest
// normal float (x < -87.33) comes out 0, an absolute error below 1.2e-38. One
// scaling by 2^n and a sixth-order polynomial (|r| <= ln2/2: 1.2e-7 relative),
// about a third fewer instructions than exp() above.
inline float exp_nonpos(float x) {
  const float xc = x < -87.33f ? -87.33f : x;
  float n;  // in [-126, 0]
  const float r = reduce_ln2(xc, &n);
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float y = p * pow2i(n);
  return x < -87.33f ? 0.0f : y;
}

inline float tanh(float x) {
  const float t = x < 0.0f ? -x : x;
  // |x| < 0.3: odd Taylor series (next term < 3e-11); else (1 - e) / (1 + e), e = exp(-2|x|).
  const float s = t * t;
  float p = 21844.0f / 6081075.0f;
  p = p * s - 1382.0f / 155925.0f;
  p = p * s + 62.0f / 2835.0f;
  p = p * s - 17.0f / 315.0f;
  p = p * s + 2.0f / 15.0f;
  p = p * s - 1.0f / 3.0f;
  const float small = t + t * s * p;
  const float e = exp_nonpos(-2.0f * t);
  const float large = (1.0f - e) / (1.0f + e);
  const float r = t < 0.3f ? small : large;
  return x != x ? x : (x < 0.0f ? -r : r);
}

// erfc(x) = t exp(-x^2 + f(u)) for x >= 0, t = 2 / (2 + x), u = 4t - 2
// (Numerical Recipes' form), f a degree-12 polynomial fitted to 6e-10 on
// [0, 10.1] (beyond, erfc is below the smallest subnormal). x^2 is split as
// h^2 + (x - h)(x + h), h being x with its 12 low mantissa bits cleared, so that
// h^2 is exact and the tail keeps its relative accuracy (as fdlibm does).
// erfc(-x) = 2 - erfc(x).
inline float erfc(float x) {
  const float a = x < 0.0f ? -x : x;
  const float ac = a > 10.1f ? 10.1f : a;
  const float t = 2.0f / (2.0f + ac), u = 4.0f * t - 2.0f;
  float f = 1.144207661e-08f;
  f = f * u - 6.270970689e-08f;
  f = f * u - 8.738045437e-08f;
  f = f * u + 1.263629433e-06f;
  f = f * u - 5.623424698e-07f;
  f = f * u - 1.826593086e-05f;
  f = f * u + 2.746759916e-05f;
  f = f * u + 2.757434141e-04f;
  f = f * u - 6.170350156e-04f;
  f = f * u - 5.861941763e-03f;
  f = f * u + 1.183582545e-02f;
  f = f * u + 3.363216112e-01f;
  f = f * u - 6.717940840e-01f;
  uint32_t bits;
  std::memcpy(&bits, &ac, 4);
  const float h = from_bits(bits & 0xfffff000u);
  const float r0 = t * exp(-h * h) * exp((h - ac) * (h + ac) + f);
  const float r = a > 10.1f ? 0.0f : r0;
  return x != x ? x : (x < 0.0f ? 2.0f - r : r);
}

}  // namespace regemm::host_math
