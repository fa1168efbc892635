// The activations of docs/spec.md §3 and their derivatives, defined once for the CPU
// and CUDA kernels. Each works in the accumulation type T (float or double).
//
// Stability: no overflow for |z| up to 1e30 (sigmoid picks the branch whose
// exp cannot overflow; gelu's derivative is taken at z clamped to [-30, 30]), and
// NaN in gives NaN out (comparisons are written so that NaN falls through).
#pragma once

#include <math.h>

#include <string_view>
#include <type_traits>

#include "numeric.h"
#if !defined(__CUDA_ARCH__)
#include "host_math.h"
#endif

namespace regemm {

enum class Act : int { kNone, kRelu, kLeakyRelu, kGelu, kGeluErf, kSigmoid, kTanh, kSilu };

// Names as the Python API spells them; the index is the enum value.
inline constexpr std::string_view kActNames[] = {
    "none", "relu", "leaky_relu", "gelu", "gelu_erf", "sigmoid", "tanh", "silu"};

inline bool parse_act(std::string_view name, Act* act) {
  for (int i = 0; i < int(sizeof(kActNames) / sizeof(kActNames[0])); ++i)
    if (kActNames[i] == name) { *act = Act(i); return true; }
  return false;
}

// A run-time activation as a compile-time one: calls
// f(std::integral_constant<Act, A>{}) with A == act, so that a kernel is
// instantiated once per activation. Every backend's dispatch goes through this
// one list. False for a value outside the enum (f not called).
template <class F> bool with_act(Act act, F&& f) {
  switch (act) {
#define REGEMM_ACT_CASE(A) \
  case A: f(std::integral_constant<Act, A>{}); return true;
    REGEMM_ACT_CASE(Act::kNone) REGEMM_ACT_CASE(Act::kRelu) REGEMM_ACT_CASE(Act::kLeakyRelu)
    REGEMM_ACT_CASE(Act::kGelu) REGEMM_ACT_CASE(Act::kGeluErf) REGEMM_ACT_CASE(Act::kSigmoid)
    REGEMM_ACT_CASE(Act::kTanh) REGEMM_ACT_CASE(Act::kSilu)
#undef REGEMM_ACT_CASE
  }
  return false;
}

// act' can be read off Y = act(Z) for these (docs/spec.md §4, save="y"); leaky_relu
// needs slope > 0 so that the sign of Y still tells the branch.
inline bool grad_from_y_ok(Act act, double slope) {
  switch (act) {
    case Act::kNone: case Act::kRelu: case Act::kSigmoid: case Act::kTanh: return true;
    case Act::kLeakyRelu: return slope > 0;
    default: return false;
  }
}

// sigmoid(z) and 1 - sigmoid(z), the pair that act' is written with.
template <class T> struct Sig { T s, one_minus_s; };

// Elementary functions: CUDA's own on the device; on the host, float exp/tanh/erfc
// from host_math.h (vectorizable), double from libm (f64 is the checking path).
namespace math {
#if defined(__CUDA_ARCH__)
REGEMM_HD float exp(float x) { return ::expf(x); }
REGEMM_HD float tanh(float x) { return ::tanhf(x); }
#else
REGEMM_HD float exp(float x) { return host_math::exp(x); }
REGEMM_HD float tanh(float x) { return host_math::tanh(x); }
#endif
REGEMM_HD double exp(double x) { return ::exp(x); }
REGEMM_HD double tanh(double x) { return ::tanh(x); }
#if defined(__CUDA_ARCH__)
REGEMM_HD float erfc(float x) { return ::erfcf(x); }
#else
REGEMM_HD float erfc(float x) { return host_math::erfc(x); }
#endif
REGEMM_HD double erfc(double x) { return ::erfc(x); }
REGEMM_HD float abs(float x) { return ::fabsf(x); }
REGEMM_HD double abs(double x) { return ::fabs(x); }
// x limited to [lo, hi] (callers that need NaN select it back): on the device fmin/fmax
// (one instruction each; NaN comes out as lo), on the host selects, which vectorize where
// libm's fminf is a call in every lane (NaN passes through).
#if defined(__CUDA_ARCH__)
REGEMM_HD float clamp(float x, float lo, float hi) { return ::fminf(::fmaxf(x, lo), hi); }
REGEMM_HD double clamp(double x, double lo, double hi) { return ::fmin(::fmax(x, lo), hi); }
#else
template <class T> inline T clamp(T x, T lo, T hi) { return x < lo ? lo : (x > hi ? hi : x); }
#endif
}  // namespace math

// The elementary functions the forward activations are written with, as a
// policy. PreciseMath (the default everywhere): the functions above and IEEE
// division. FastMath: the GPU's approximate instructions (ex2/rcp to ~1e-7
// relative, tanh.approx to ~5e-4), for tensor-core epilogues whose outputs are
// rounded to bf16/f16/TF32 precision anyway; there the accurate versions cost
// more than the GEMM's epilogue can hide (measured: gelu_erf 2.4x the matmul).
// ex2 and rcp flush subnormals (.ftz): without, each MUFU op carries a few
// instructions of subnormal scaling, and in the ping-pong epilogue those are
// time (session 13, tile_bench, the gelu_erf kernel of ping-pong 128x128 1x1 at
// 8192x1024x4096 bf16: 159 -> 132 us, 7 fewer instructions per element (ncu),
// the same bits; sigmoid 119 -> 115). What flushes: an exp below
// 2^-126 and a reciprocal of more than 2^126, i.e. activations whose true value
// is below ~1e-37 in magnitude (sigmoid(z < -87), gelu_erf(z < -13)) come out 0.
// On the host FastMath is PreciseMath.
struct PreciseMath {
  template <class T> static REGEMM_HD T exp(T x) { return math::exp(x); }
  // exp(x) for x <= 0: on the host, the cheaper float form (host_math::exp_nonpos).
  template <class T> static REGEMM_HD T exp_nonpos(T x) { return exp(x); }
#if !defined(__CUDA_ARCH__)
  static float exp_nonpos(float x) { return host_math::exp_nonpos(x); }
#endif
  template <class T> static REGEMM_HD T tanh(T x) { return math::tanh(x); }
  template <class T> static REGEMM_HD T erfc(T x) { return math::erfc(x); }
  template <class T> static REGEMM_HD T rcp(T x) { return T(1) / x; }
  template <class T> static REGEMM_HD T div(T x, T y) { return x / y; }
  template <class T> static REGEMM_HD Sig<T> sigmoid_pair(T z);  // below
  template <class T> static REGEMM_HD T sigmoid(T z) { return sigmoid_pair(z).s; }
};

struct FastMath : PreciseMath {
#if defined(__CUDA_ARCH__)
  using PreciseMath::sigmoid_pair;  // the double forms (a float one below hides them otherwise)
  static REGEMM_HD float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
  static REGEMM_HD float exp(float x) { return ex2(x * 1.4426950408889634f); }
  static REGEMM_HD float exp_nonpos(float x) { return exp(x); }
  static REGEMM_HD float rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
  static REGEMM_HD float div(float x, float y) { return x * rcp(y); }
  static REGEMM_HD float tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
  // 1 / (1 + 2^(-z log2 e)): two MUFU ops, no select; relative error ~1e-7 in
  // both tails (no cancellation: for z << 0 the sum is the exponential; it
  // overflows to inf and the reciprocal to 0, the right limit). NaN -> NaN.
  static REGEMM_HD float sigmoid(float z) { return rcp(1.0f + exp(-z)); }
  // 1 - s formed directly: absolute error ~6e-8, under the 16-bit or TF32 rounding of the
  // gradient it scales; in the tensor-core dgrad epilogue, where act' is most of a tile's
  // time at small K, this is ~10 instructions fewer than PreciseMath's (tools/tile_bench,
  // 32768x512x512 bf16, act' stored beside the forward's gelu: 90.7 -> 71.9 us; silu 59.3 -> 47.6).
  static REGEMM_HD Sig<float> sigmoid_pair(float z) {
    const float s = sigmoid(z);
    return {s, 1.0f - s};
  }
  // erfc(x) = P(t) exp(-x^2), t = 1 / (1 + p|x|), reflected for x < 0
  // (Abramowitz & Stegun 7.1.26: absolute error below 1.5e-7).
  static REGEMM_HD float erfc(float x) {
    const float ax = ::fabsf(x);
    const float t = rcp(1.0f + 0.3275911f * ax);
    float p = 1.061405429f;
    p = p * t - 1.453152027f;
    p = p * t + 1.421413741f;
    p = p * t - 0.284496736f;
    p = p * t + 0.254829592f;
    const float r = p * t * exp(-ax * ax);
    return x >= 0.0f ? r : 2.0f - r;  // NaN: r is NaN, and so is 2 - r
  }
#endif
};

// sigmoid(z) and 1 - sigmoid(z), each without cancellation: exp only of -|z|
// (it cannot overflow), branch-free (selects vectorize on the host and do not
// diverge on the device); NaN propagates through exp.
template <class T> REGEMM_HD Sig<T> PreciseMath::sigmoid_pair(T z) {
  const T e = exp_nonpos(-math::abs(z));
  const T r = rcp(T(1) + e);
  return z >= T(0) ? Sig<T>{r, e * r} : Sig<T>{e * r, r};
}
template <class T, class M = PreciseMath> REGEMM_HD T sigmoid(T z) { return M::sigmoid(z); }

template <class T> struct GeluConst {
  static constexpr T kC = T(0.7978845608028654);   // sqrt(2/pi)
  static constexpr T kA = T(0.044715);
  static constexpr T kRsqrt2 = T(0.7071067811865476);
  static constexpr T kRsqrt2Pi = T(0.3989422804014327);  // 1/sqrt(2 pi)
};

template <class T, class M = PreciseMath> REGEMM_HD T act_fwd(Act act, T z, T slope) {
  using G = GeluConst<T>;
  switch (act) {
    case Act::kNone: return z;
    case Act::kRelu: return z < T(0) ? T(0) : z;
    case Act::kLeakyRelu: return z < T(0) ? slope * z : z;
    // 0.5 z (1 + tanh(u)) == z sigmoid(2u): the same function, without the
    // cancellation of 1 + tanh(u) for negative z.
    case Act::kGelu: return z * sigmoid<T, M>(T(2) * G::kC * z * (T(1) + G::kA * z * z));
    case Act::kGeluErf: return T(0.5) * z * M::erfc(-z * G::kRsqrt2);
    case Act::kSigmoid: return sigmoid<T, M>(z);
    case Act::kTanh: return M::tanh(z);
    case Act::kSilu: return z * sigmoid<T, M>(z);
  }
  return z;
}

// act'(z). Branch-free (selects only) so that it vectorizes on the host and
// does not diverge on the device. M as for act_fwd: FastMath where gZ is
// rounded to bf16/f16 anyway (the backward epilogue of 16-bit layers).
template <class T, class M = PreciseMath> REGEMM_HD T act_grad(Act act, T z, T slope) {
  using G = GeluConst<T>;
  T g = T(1);
  switch (act) {
    case Act::kNone: g = T(1); break;
    case Act::kRelu: g = z > T(0) ? T(1) : T(0); break;
    case Act::kLeakyRelu: g = z > T(0) ? T(1) : slope; break;
    case Act::kGelu: {
      // d/dz z s(2u) = s + 2 z s (1 - s) u'. Past |z| = 30 the derivative is 1 or 0 in every
      // precision, and the formula at the clamped z gives exactly that (u' stays finite).
      const T zc = math::clamp(z, T(-30), T(30));
      const T z2 = zc * zc;
      const Sig<T> q = M::sigmoid_pair(T(2) * G::kC * zc * (T(1) + G::kA * z2));
      g = q.s + zc * q.s * q.one_minus_s * (T(2) * G::kC) * (T(1) + T(3) * G::kA * z2);
      break;
    }
    case Act::kGeluErf:
      g = T(0.5) * M::erfc(-z * G::kRsqrt2) + z * G::kRsqrt2Pi * M::exp(T(-0.5) * z * z);
      break;
    case Act::kSigmoid: { const Sig<T> q = M::sigmoid_pair(z); g = q.s * q.one_minus_s; break; }
    case Act::kTanh: {  // 1 - tanh^2 = 4e / (1 + e)^2, e = exp(-2|z|): no cancellation
      const T e = M::exp(T(-2) * math::abs(z));
      g = M::div(T(4) * e, (T(1) + e) * (T(1) + e));
      break;
    }
    case Act::kSilu: { const Sig<T> q = M::sigmoid_pair(z); g = q.s * (T(1) + z * q.one_minus_s); break; }
  }
  return z != z ? z : g;  // NaN in, NaN out
}

// act'(z) written in terms of y = act(z); valid where grad_from_y_ok().
template <class T> REGEMM_HD T act_grad_from_y(Act act, T y, T slope) {
  T g = T(1);
  switch (act) {
    case Act::kRelu: g = y > T(0) ? T(1) : T(0); break;
    case Act::kLeakyRelu: g = y > T(0) ? T(1) : slope; break;
    case Act::kSigmoid: g = y * (T(1) - y); break;
    case Act::kTanh: g = T(1) - y * y; break;
    default: break;
  }
  return y != y ? y : g;
}

}  // namespace regemm
