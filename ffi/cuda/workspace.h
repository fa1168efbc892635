// Device workspace: how much each CUDA handler needs, so that the lowering
// (jax_regemm/_ffi.py, through the module's *_workspace_bytes functions) can
// give it to the custom call as one more result buffer.
//
// Why a result and not XLA's FFI scratch allocator: XLA may capture the call
// into a CUDA graph (command buffers) and replay it; memory from the scratch
// allocator is released when the handler returns, so a replay would use freed
// memory. A result buffer belongs to XLA's buffer assignment: valid on every
// replay, and shared with other temporaries outside the call's live range.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../regemm/problem.h"

namespace regemm {

// Every workspace request is aligned to this (cuBLAS wants 256); sizes
// include the slack for aligning the buffer's start.
inline constexpr size_t kWorkspaceAlign = 256;

// cuBLAS's workspace on Hopper (its recommendation), also the bound for a
// CUTLASS stream-K workspace.
inline constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;

// regemm_dact: the tiles' partial bias sums (0 without a bias).
size_t dact_workspace_bytes(DType t, int64_t m, int64_t n, int64_t batch, BiasKind kind);

// regemm_gemm: a library GEMM's workspace, plus (f32 at default precision,
// x @ w) the K x N transposed B for each of the `batch_b` distinct Bs.
inline size_t gemm_workspace_bytes(DType t, int64_t k, int64_t n, int64_t batch_b, bool trans_a, bool trans_b,
                                   bool exact_f32) {
  size_t bytes = kGemmWorkspaceBytes + kWorkspaceAlign;
  if (t == DType::kF32 && !exact_f32 && !trans_a && !trans_b) bytes += size_t(k * n * batch_b) * 4 + kWorkspaceAlign;
  return bytes;
}

}  // namespace regemm
