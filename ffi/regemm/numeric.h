// Element types and their conversions, shared by the CPU and CUDA kernels.
//
// XLA hands bf16/f16 buffers over as raw 16-bit words; kernels load them into
// the accumulation type (float, or double for f64) and store back with
// round-to-nearest-even. On the device the CUDA intrinsics do the same job.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define REGEMM_HD __host__ __device__ __forceinline__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#define REGEMM_HD inline
#endif

namespace regemm {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

REGEMM_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f; std::memcpy(&f, &u, 4); return f;
#endif
}
REGEMM_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u; std::memcpy(&u, &f, 4); return u;
#endif
}

// Accumulation type of each element type: f32 everywhere except f64.
template <class T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };
template <class T> using acc_t = typename Acc<T>::type;

template <class A> REGEMM_HD A load(float x) { return A(x); }
template <class A> REGEMM_HD A load(double x) { return A(x); }
template <class A> REGEMM_HD A load(bf16_t x) { return A(bits_to_float(uint32_t(x.bits) << 16)); }
template <class A> REGEMM_HD A load(f16_t x) {
#if defined(__CUDA_ARCH__)
  __half h; memcpy(&h, &x.bits, 2); return A(__half2float(h));
#else
  // IEEE binary16 -> binary32, subnormals and inf/nan included.
  uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu, man = x.bits & 0x3ffu;
  if (exp == 0x1f) return A(bits_to_float(sign | 0x7f800000u | (man << 13)));
  if (exp == 0) {
    float f = float(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return A(sign ? -f : f);
  }
  return A(bits_to_float(sign | ((exp + 112u) << 23) | (man << 13)));
#endif
}

template <class T> REGEMM_HD T store(float x) { return T(x); }
template <class T> REGEMM_HD T store(double x) { return T(x); }
template <> REGEMM_HD float store<float>(double x) { return float(x); }

REGEMM_HD bf16_t to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{uint16_t(u >> 16)};
}
REGEMM_HD f16_t to_f16(float f) {
#if defined(__CUDA_ARCH__)
  __half h = __float2half_rn(f); f16_t r; memcpy(&r.bits, &h, 2); return r;
#else
  uint32_t u = float_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16_t{uint16_t(sign | 0x7e00u)};     // NaN
  if (a >= 0x477ff000u) return f16_t{uint16_t(sign | 0x7c00u)};    // overflow -> inf
  if (a < 0x38800000u) {                                           // subnormal or zero
    if (a < 0x33000000u) return f16_t{sign};                       // < 2^-25: rounds to 0
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;                                     // 14..24
    uint32_t half = m >> shift, rem = m & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return f16_t{uint16_t(sign | half)};
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);                      // round to nearest even
  return f16_t{uint16_t(sign | ((r - 0x38000000u) >> 13))};
#endif
}
template <> REGEMM_HD bf16_t store<bf16_t>(float x) { return to_bf16(x); }
template <> REGEMM_HD f16_t store<f16_t>(float x) { return to_f16(x); }

}  // namespace regemm
