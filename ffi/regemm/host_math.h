// Branch-free float exp and tanh for the host: pure arithmetic and selects, so
// the compiler vectorizes the CPU epilogue loop (libm's expf/tanhf are opaque
// calls that keep it scalar). Accuracy within a few ulp, like CUDA's expf and
// tanhf on the device. NaN propagates; exp underflows to 0, overflows to inf.
#pragma once

#include <cstdint>
#include <cstring>

namespace regemm::host_math {

inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float pow2i(float n) { return from_bits(uint32_t(int32_t(n) + 127) << 23); }  // n in [-126, 127]

inline float exp(float x) {
  const float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
  const float xc = x < -104.0f ? -104.0f : (x > 88.8f ? 88.8f : x);  // beyond: 0 or inf anyway
  const float n = __builtin_floorf(xc * kLog2e + 0.5f);               // in [-150, 128]
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;                      // |r| <= ln2/2, exact reduction
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
  const float e = exp(-2.0f * t);
  const float large = (1.0f - e) / (1.0f + e);
  const float r = t < 0.3f ? small : large;
  return x != x ? x : (x < 0.0f ? -r : r);
}

}  // namespace regemm::host_math
