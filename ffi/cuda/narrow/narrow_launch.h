// The launches of the narrow-MLP kernels (narrow_mlp.cuh, narrow_mlp_bwd.cuh and their wgmma
// forms, narrow_mlp_gmma.cuh, narrow_mlp_bwd_gmma.cuh), instantiated
// once per dtype and direction in their own translation units (narrow_{fwd,bwd}_{bf16,f16}.cu:
// 64 kernels each, compiled in parallel), declared here for the handlers.
#pragma once

#include "cuda/narrow/narrow_mlp_bwd_gmma.cuh"

#define REGEMM_NARROW_FWD(EXTERN, T)                                                       \
  EXTERN template cudaError_t regemm::narrow::launch_fwd<T>(const Params&, int, cudaStream_t); \
  EXTERN template cudaError_t regemm::narrow::launch_fwd_gmma<T>(const Params&, int, cudaStream_t);
#define REGEMM_NARROW_BWD(EXTERN, T)                                                                            \
  EXTERN template cudaError_t regemm::narrow::launch_bwd<T>(const Params&, int, const BwdParams&, cudaStream_t); \
  EXTERN template cudaError_t regemm::narrow::bwd_blocks<T>(const Params&, int, const BwdParams&, int*);         \
  EXTERN template cudaError_t regemm::narrow::bwd_max_blocks<T>(const Params&, int, const BwdParams&, int*);

namespace regemm::narrow {
REGEMM_NARROW_FWD(extern, __nv_bfloat16)
REGEMM_NARROW_FWD(extern, __half)
REGEMM_NARROW_BWD(extern, __nv_bfloat16)
REGEMM_NARROW_BWD(extern, __half)
}  // namespace regemm::narrow
