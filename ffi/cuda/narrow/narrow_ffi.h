// What the CUDA module exports of the fused narrow MLP (narrow_mlp.cu), without its kernels'
// headers: the two handlers and the questions the lowering asks.
#pragma once

#include <cstdint>
#include <string_view>

namespace regemm::narrow {

inline constexpr const char* kForwardTarget = "regemm_narrow_mlp_v1";
inline constexpr const char* kBackwardTarget = "regemm_narrow_mlp_bwd_v1";

void* forward_handler();
void* backward_handler();

// Shared memory a block of the forward (or backward) takes for this stack; -1 where the
// kernels do not take it (width, depth or output width).
int64_t smem_bytes(int k0, int width, int layers, int n_out, bool backward);
// The most shared memory a block may take on the current device.
int64_t smem_limit();
// Whether the wgmma kernels (narrow_mlp_gmma.cuh) run on the current device in this build.
bool wgmma_here();
// The backward's workspace on the current device (its partial sums); -1 where it does not run.
int64_t bwd_workspace_bytes(bool f16, int k0, int width, int layers, int n_out, std::string_view act);

}  // namespace regemm::narrow
