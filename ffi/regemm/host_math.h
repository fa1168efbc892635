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
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
inline float reduce_ln2(float x, float* n) {
  *n = __builtin_floorf(x * kLog2e + 0.5f);
  return (x - *n * kLn2Hi) - *n * kLn2Lo;
}

// The Taylor series of e^r past its leading 1, divided by r, to r^(N-1)/N!:
// 1 + r/2! + ... = (e^r - 1) / r for |r| <= ln2/2 (a little beyond is fine).
template <int N>
inline float exp_series(float r) {
  float f = 1.0f;  // N!, then each factorial below it: exact in float up to 10!
  for (int k = 2; k <= N; ++k) f *= float(k);
  float p = 1.0f / f;
  for (int k = N; k > 1; --k) p = p * r + 1.0f / (f /= float(k));
  return p;
}

// e^r for |r| <= ln2/2: Taylor to r^6, 1.2e-7 relative.
inline float exp_reduced(float r) { return exp_series<6>(r) * r + 1.0f; }

// p 2^n for whole n in [-252, 254], as two normal factors, so that subnormal
// and infinite results come out right.
inline float scale2(float p, float n) {
  const float n1 = __builtin_floorf(0.5f * n);
  return p * pow2i(n1) * pow2i(n - n1);
}

inline float exp(float x) {
  const float xc = x < -104.0f ? -104.0f : (x > 88.8f ? 88.8f : x);  // beyond: 0 or inf anyway
  float n;                                                             // in [-150, 128]
  const float r = reduce_ln2(xc, &n);
  const float y = scale2(exp_reduced(r), n);
  return x != x ? x : y;
}

// exp(x) for x <= 0 (or NaN, which propagates), where the activations call it
// (exp(-|z|), exp(-2|z|)): no overflow side, and a result below the smallest
// normal float (x < -87.33) comes out 0, an absolute error below 1.2e-38. One
// scaling by 2^n, a few instructions fewer than exp() above.
inline float exp_nonpos(float x) {
  const float xc = x < -87.33f ? -87.33f : x;
  float n;  // in [-126, 0]
  const float r = reduce_ln2(xc, &n);
  const float y = exp_reduced(r) * pow2i(n);
  return x < -87.33f ? 0.0f : y;
}

// e^x - 1 for x <= 0 (or NaN), to a few ulp also near 0 where 1 - e^x would
// cancel: 2^n (e^r - 1) + (2^n - 1), e^r - 1 = r (1 + r/2 + ...) to r^7
// (1.6e-8 relative); for n != 0 the result is below -0.29, so the sum does
// not cancel. Below x = -87.33 it is -1, as it is in float from x = -17 on.
inline float expm1_nonpos(float x) {
  const float xc = x < -87.33f ? -87.33f : x;
  float n;  // in [-126, 0]
  const float r = reduce_ln2(xc, &n);
  const float s = pow2i(n);
  return s * (r * exp_series<7>(r)) + (s - 1.0f);
}

// tanh|x| = -E / (2 + E), E = e^(-2|x|) - 1: one expression for every |x|
// (E is accurate near 0, where 1 - e^(-2|x|) would cancel), odd in x.
inline float tanh(float x) {
  const float t = x < 0.0f ? -x : x;
  const float e = expm1_nonpos(-2.0f * t);
  const float r = __builtin_fabsf(e / (2.0f + e));
  return x != x ? x : __builtin_copysignf(r, x);
}

// erfc(x) = t exp(-x^2 + f(u)) for x >= 0, t = 2 / (2 + x), u = 4t - 2
// (Numerical Recipes' form), f a degree-9 polynomial fitted to 4.3e-8 (minimax,
// float coefficients) on [0, 9.35] (beyond, erfc is below 2^-130, and 0 from
// x = 10.1 on, where it is below the smallest subnormal); erfc(-x) = 2 - erfc(x).
// One exponential, of -h^2 + d with h = x less its 12 low mantissa bits and
// d = (h - x)(h + x) + f small (|d| < 1.5): h^2 is exact, and so is h^2 less
// its multiple of ln2 (both have at most 24 significant bits and are close),
// so the reduced argument, and the tail's relative accuracy, lose nothing to
// x^2's rounding (as fdlibm does with two exponentials). The scaling by 2^n
// (n >= -150) is one factor 2^(n + 24), always normal, times t 2^-24 (exact):
// a subnormal result comes out of the last product, rounded there once.
inline float erfc(float x) {
  const float a = x < 0.0f ? -x : x;
  const float ac = a > 10.1f ? 10.1f : a;
  const float t = 2.0f / (2.0f + ac), u = 4.0f * t - 2.0f;
  float f = 5.248654134e-07f;
  f = f * u - 3.248066491e-07f;
  f = f * u - 1.604047611e-05f;
  f = f * u + 2.612716889e-05f;
  f = f * u + 2.730622364e-04f;
  f = f * u - 6.154676666e-04f;
  f = f * u - 5.860617384e-03f;
  f = f * u + 1.183529105e-02f;
  f = f * u + 3.363214135e-01f;
  f = f * u - 6.717940569e-01f;
  uint32_t bits;
  std::memcpy(&bits, &ac, 4);
  const float h = from_bits(bits & 0xfffff000u), hh = h * h;
  const float d = (h - ac) * (h + ac) + f;
  const float n = __builtin_floorf((d - hh) * kLog2e + 0.5f);  // in [-150, 0]
  const float r = ((-hh - n * kLn2Hi) + d) - n * kLn2Lo;
  const float r0 = exp_reduced(r) * pow2i(n + 24.0f) * (t * 5.9604644775390625e-08f);
  const float y = a > 10.1f ? 0.0f : r0;
  return x != x ? x : (x < 0.0f ? 2.0f - y : y);
}

}  // namespace regemm::host_math
