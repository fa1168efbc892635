// sm90a's warpgroup MMA (wgmma) for the narrow MLP: the instruction forms the kernels use, the
// shared-memory descriptors of their operands, and the layouts those describe. A warpgroup (4
// warps) multiplies a 64-row tile: warp w holds rows 16w..16w+15 in the layout of mma.sync's
// m16n8k16 (the A fragment of registers and, per 8 columns, the accumulator), so a layer's
// accumulators become the next layer's A operand in registers, as in the mma.sync kernels.
//
// Operands in shared memory are 8 x 8 "core matrices" (8 rows of 16 bytes, 128 contiguous
// bytes), no swizzle. A descriptor gives the start and two strides between core matrices: LBO
// along the layout's leading dimension, SBO along the other (docs/architecture.md):
//   K-major (rows of the operand are along M or N, K contiguous): LBO steps K, SBO steps M/N.
//   MN-major (transposed: M or N contiguous):                     LBO steps K, SBO steps M/N.
// tools/wgmma_probe.cu checks each form the kernels use against the host.
//
// Generated wrappers (one per N): the accumulator list of wgmma is written out in full.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace regemm::narrow::gmma {

// D (64 x N f32, as [N/8][4] a thread) (+)= A (registers) B (shared memory; TB: MN-major).
template <class T, int N, int TB> struct Rs;
// D (+)= A B, both from shared memory (TA, TB: MN-major).
template <class T, int N, int TA, int TB> struct Ss;

#define REGEMM_GMMA_FAMILY(T, AB) \
  template <int TB> struct Rs<T, 16, TB> { \
    static __device__ __forceinline__ void run(float (&d)[2][4], const uint32_t (&a)[4], uint64_t b, int scale_d) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n16k16.f32." AB " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, %14;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]) \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(TB)); \
    } \
  }; \
  template <int TA, int TB> struct Ss<T, 16, TA, TB> { \
    static __device__ __forceinline__ void run(float (&d)[2][4], uint64_t a, uint64_t b, int scale_d) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n16k16.f32." AB " {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, %12;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]) \
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB)); \
    } \
  }; \
  template <int TB> struct Rs<T, 32, TB> { \
    static __device__ __forceinline__ void run(float (&d)[4][4], const uint32_t (&a)[4], uint64_t b, int scale_d) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n32k16.f32." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]) \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(TB)); \
    } \
  }; \
  template <int TA, int TB> struct Ss<T, 32, TA, TB> { \
    static __device__ __forceinline__ void run(float (&d)[4][4], uint64_t a, uint64_t b, int scale_d) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n32k16.f32." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]) \
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB)); \
    } \
  }; \
  template <int TB> struct Rs<T, 64, TB> { \
    static __device__ __forceinline__ void run(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b, int scale_d) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(TB)); \
    } \
  }; \
  template <int TA, int TB> struct Ss<T, 64, TA, TB> { \
    static __device__ __forceinline__ void run(float (&d)[8][4], uint64_t a, uint64_t b, int scale_d) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB)); \
    } \
  }; \
  template <int TB> struct Rs<T, 128, TB> { \
    static __device__ __forceinline__ void run(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b, int scale_d) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(TB)); \
    } \
  }; \
  template <int TA, int TB> struct Ss<T, 128, TA, TB> { \
    static __device__ __forceinline__ void run(float (&d)[16][4], uint64_t a, uint64_t b, int scale_d) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB)); \
    } \
  };

REGEMM_GMMA_FAMILY(__nv_bfloat16, "bf16.bf16")
REGEMM_GMMA_FAMILY(__half, "f16.f16")
#undef REGEMM_GMMA_FAMILY

// The order of a warpgroup's MMAs: fence before the first (after the registers it reads were
// written), commit the issued ones as a group, wait until at most N groups are in flight.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by threads (the generic proxy) made visible to wgmma (the async proxy):
// each writing thread, before the barrier that orders the MMAs after the writes.
__device__ __forceinline__ void fence_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving reads or writes of accumulators across the MMAs in flight.
template <int NT> __device__ __forceinline__ void pin(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
}

// A shared-memory operand's descriptor: start, the strides between core matrices in bytes
// (no swizzle, base offset 0).
__device__ __forceinline__ uint64_t descriptor(const void* p, int lbo, int sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return uint64_t((a & 0x3FFFF) >> 4) | uint64_t(lbo >> 4) << 16 | uint64_t(sbo >> 4) << 32;
}

// Where element (r, c) of a rows x cols operand of 16-bit elements lies, in elements from its
// start, in the two layouts the kernels keep.
//   KMajor<kp>: rows r (the M or N dimension) of kp elements along K (c): core matrix (r/8, c/8)
//     at (r/8) * 8kp + (c/8) * 64: LBO 128 bytes, SBO 16 kp bytes.
//   MnMajor<rows>: a [rows][cols] row-major tile whose rows are K and columns M or N: core
//     matrix (r/8, c/8) at (c/8) * 8 rows + (r/8) * 64: LBO 128 bytes, SBO 16 rows bytes.
__host__ __device__ __forceinline__ int kmajor_at(int r, int c, int kp) {
  return (r >> 3) * 8 * kp + (c >> 3) * 64 + (r & 7) * 8 + (c & 7);
}
__host__ __device__ __forceinline__ int mnmajor_at(int r, int c, int rows) {
  return (c >> 3) * 8 * rows + (r >> 3) * 64 + (r & 7) * 8 + (c & 7);
}

}  // namespace regemm::narrow::gmma
