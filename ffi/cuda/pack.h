// 16-byte vector accesses for the memory-bound kernels (the backward
// epilogue, dact.cu; the forward epilogue pass, epilogue_pass.cu) and the
// alignment tests that decide whether a buffer can take them (also TMA's,
// for the CUTLASS kernels, and cuBLASLt's).
#pragma once

#include <cstdint>

namespace regemm {

// Elements of T in 16 bytes.
template <class T> constexpr int kVec = int(16 / sizeof(T));

// V elements of T, moved as one access (16 bytes when V == kVec<T>).
template <class T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

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
