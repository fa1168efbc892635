// 16-byte vector accesses for the memory-bound kernels (the backward
// epilogue, dact.cu; the forward epilogue pass, epilogue_pass.cu) and the
// alignment test that decides whether a buffer can take them (also TMA's,
// for the CUTLASS kernels).
#pragma once

#include <cstdint>

namespace regemm {

// Elements of T in 16 bytes.
template <class T> constexpr int kVec = int(16 / sizeof(T));

// V elements of T, moved as one access (16 bytes when V == kVec<T>).
template <class T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace regemm
