// 16-byte vector accesses for the memory-bound kernels (the backward
// epilogue, dact.cu; the forward epilogue pass, epilogue_pass.cu) and the
// alignment tests that decide whether a buffer can take them (also TMA's,
// for the CUTLASS kernels, and cuBLASLt's).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "regemm/numeric.h"

namespace regemm {

// Elements of T in 16 bytes.
template <class T> constexpr int kVec = int(16 / sizeof(T));

// V elements of T, moved as one access (16 bytes when V == kVec<T>).
template <class T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

#if defined(__CUDACC__)
// A Pack's load and store as one access: copied as a struct, a Pack of 16-bit
// elements was stored as four 32-bit words (STG.E x 4 instead of STG.E.128).
template <class T, int V> __device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  if constexpr (sizeof(Pack<T, V>) == 16) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    Pack<T, V> v;
    memcpy(&v, &u, 16);
    return v;
  } else {
    return *reinterpret_cast<const Pack<T, V>*>(p);
  }
}
template <class T, int V> __device__ __forceinline__ void store_pack(T* p, const Pack<T, V>& v) {
  if constexpr (sizeof(Pack<T, V>) == 16) {
    uint4 u;
    memcpy(&u, &v, 16);
    // As PTX: a plain assignment was split the same way. No memory clobber: the
    // kernels' later loads never read what a thread stores here.
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w));
  } else {
    *reinterpret_cast<Pack<T, V>*>(p) = v;
  }
}

// V floats rounded to T, to nearest even. bf16 pairs take the hardware's
// conversion (cvt.rn.bf16x2.f32: one instruction for two elements, where
// numeric.h's portable to_bf16 takes several per element; the same value, and
// NaN for NaN).
template <class T, int V, class A> __device__ __forceinline__ Pack<T, V> round_pack(const A (&x)[V]) {
  Pack<T, V> out;
  if constexpr (std::is_same_v<T, bf16_t> && V % 2 == 0) {
#pragma unroll
    for (int v = 0; v < V; v += 2) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(x[v], x[v + 1]);
      memcpy(&out.v[v], &h, 4);
    }
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) out.v[v] = store<T>(x[v]);
  }
  return out;
}
#endif

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The largest power of two, up to 16, that divides the address (16 for
// null). 16 bytes is all any kernel here uses (TMA, 16-byte vectors,
// cuBLASLt's vector loads); beyond that XLA's buffer offsets differ from
// program to program. cuBLASLt's algorithms may assume the alignment they are
// told, and the tuner keeps its winners per alignment: both read this one
// value, so a winner's algorithm index means the same plan wherever its
// signature recurs.
inline uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 16;
  while (al > 1 && (a & (al - 1))) al /= 2;
  return al;
}

}  // namespace regemm
