// The narrow-MLP kernels (narrow_mlp.cuh, narrow_mlp_bwd.cuh and their wgmma forms,
// narrow_mlp_gmma.cuh, narrow_mlp_bwd_gmma.cuh) are instantiated where their kernel_* functions
// are: one translation unit per dtype and hidden activation, which CMake writes from
// narrow_inst.cu.in (16 units, compiled in parallel: with the two-tile forward unrolled for every
// depth, tools/narrow_bench.cu, one unit of every bf16 kernel, compiled in 24 minutes on 2 cores
// against 3 before it; one unit here, f16 tanh, in 3). Declared here for the handlers.
#pragma once

#include "cuda/narrow/narrow_mlp_bwd_gmma.cuh"

#define REGEMM_NARROW_KERNELS(EXTERN, T, A)                                         \
  EXTERN template const void* regemm::narrow::kernel_fwd<T, A>(int);                \
  EXTERN template const void* regemm::narrow::kernel_fwd_gmma<T, A>(int, bool);     \
  EXTERN template const void* regemm::narrow::kernel_bwd<T, A>(int, int, bool);
#define REGEMM_NARROW_KERNELS_EXTERN(T)                                                            \
  REGEMM_NARROW_KERNELS(extern, T, Act::kNone) REGEMM_NARROW_KERNELS(extern, T, Act::kRelu)       \
  REGEMM_NARROW_KERNELS(extern, T, Act::kLeakyRelu) REGEMM_NARROW_KERNELS(extern, T, Act::kGelu)  \
  REGEMM_NARROW_KERNELS(extern, T, Act::kGeluErf) REGEMM_NARROW_KERNELS(extern, T, Act::kSigmoid) \
  REGEMM_NARROW_KERNELS(extern, T, Act::kTanh) REGEMM_NARROW_KERNELS(extern, T, Act::kSilu)

namespace regemm::narrow {
REGEMM_NARROW_KERNELS_EXTERN(__nv_bfloat16)
REGEMM_NARROW_KERNELS_EXTERN(__half)
}  // namespace regemm::narrow
