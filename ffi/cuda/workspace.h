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

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "regemm/problem.h"
#include "cuda/cutlass/cutlass_dgrad.h"

namespace regemm {

// Every workspace request is aligned to this (cuBLAS wants 256); sizes
// include the slack for aligning the buffer's start.
inline constexpr size_t kWorkspaceAlign = 256;

// A library GEMM's workspace (cuBLAS recommends 32 MiB on Hopper), also the
// bound for a CUTLASS stream-K workspace: 31 MiB, so that with the alignment
// slack a call's workspace stays within 32 MiB, the size of XLA's own cuBLAS
// workspaces, and XLA's buffer assignment packs both into the same slots (at
// 32 MiB + 256 B it kept slots of 32.5 MiB: the bf16 32768x512x12 relu step's
// temporaries 448.5 MiB against XLA's 448).
inline constexpr size_t kGemmWorkspaceBytes = size_t(31) << 20;

// regemm_dact: the tiles' partial bias sums (0 without a bias).
size_t dact_workspace_bytes(DType t, int64_t m, int64_t n, int64_t batch, BiasKind kind);

// The full share, a library GEMM's workspace: regemm_gemm's below 2^22 output
// elements (and where a dim is symbolic). No way needs more at once: the
// CUTLASS f32 x @ w way takes its transposed B from the start of it where B^T
// fits (cutlass_dispatch.cu; else its kernel runs without B^T) and its own
// requests from behind B^T. So the call's workspace is the size of XLA's own
// cuBLAS workspaces whatever B is: with B^T reserved on top of it (up to 4 MiB),
// those calls did not fit XLA's 32 MiB slots (the f32 8192x1024x4 gelu training
// step's temporaries 291 MiB against 264 now, results/h200_train_memory_workspace.md).
inline size_t gemm_workspace_bytes() { return kGemmWorkspaceBytes + kWorkspaceAlign; }

// A call whose output has kLargeGemmElements or more (256 or more 128x128
// tiles, about two waves on an H100, where no way needs to split K or stream,
// the ways that want a large workspace) gets a share sized by the problem:
// 8 MiB, or what it keeps at the workspace's start (the forward's B^T, the
// fused dgrad kernel's partial bias sums) and 1 MiB where that is larger. The
// calls' workspaces share one slot of XLA's buffer assignment, live through
// the forward's peak and the backward's: the slot is as large as the largest
// call's. Compiled temporaries of relu steps with a dgrad_dact share of
// 31 / 8 / 2 MiB (MiB; XLA's first, REGEMM_IN_PLACE=0; 832 in place at 8 MiB):
// 32768x512x12 f32 832: 863 / 840 / 834, bf16 448: 447 / 424 / 776 (at 6 MiB
// and below XLA's buffer assignment packs that step far worse), 16384x2048x6
// bf16 480: 487 / 464 / 456, f32 1056: 927 / 896 / 896
// (results/h100_train_memory_workspace_by_problem.md). From 2^22 elements
// rather than 2^24 the 4096x2048x8 bf16 relu step holds 159 MiB, not 175, its
// time level (results/h100_train_memory_peaks_3edea1e.md).
inline constexpr int64_t kLargeGemmElements = int64_t(1) << 22;
inline constexpr size_t kLargeGemmWorkspaceBytes = size_t(8) << 20;

// The share of a call with an output of m x n x batch that keeps `held` bytes
// at the workspace's start (above).
inline size_t large_gemm_share(int64_t m, int64_t n, int64_t batch, size_t held) {
  const size_t full = gemm_workspace_bytes();
  if (m * n * batch < kLargeGemmElements) return full;
  const size_t own = held ? held + (size_t(1) << 20) : 0;
  return std::min(full, std::max(kLargeGemmWorkspaceBytes, own) + kWorkspaceAlign);
}

// regemm_gemm: a library GEMM's workspace, or the large problem's share, with
// room for B^T where the f32 x @ w way transposes B (cutlass_dispatch.cu;
// batch_b: B's batch, 1 where B is shared).
inline size_t gemm_call_workspace_bytes(DType t, int64_t m, int64_t n, int64_t k, int64_t batch, int64_t batch_b,
                                        bool trans_a, bool trans_b) {
  const size_t bt = t == DType::kF32 && !trans_a && !trans_b ? size_t(k * n * batch_b) * sizeof(float) : 0;
  return large_gemm_share(m, n, batch, bt < gemm_workspace_bytes() ? bt : 0);
}

// regemm_dgrad_dact: the GEMM's share, then the dact pass's (the composed
// way; cuBLASLt's DGELU matmul, then the bias gradient), one after the other on
// the stream. The fused kernel's partial bias sums (per-column bias only; 1/8
// of gZ's elements, f32) come out of the GEMM's share; where they do not fit
// it the kernel runs without them (cutlass_dispatch.cu).
inline size_t dgrad_dact_workspace_bytes(DType t, int64_t m, int64_t n, int64_t batch, BiasKind kind) {
  const size_t partials =
      kind == BiasKind::kPerCol
          ? size_t(cutlass_sm90::dgrad_partials_rows(m) * cutlass_sm90::dgrad_partials_ld(n) * batch) * sizeof(float)
          : 0;
  const size_t gemm = large_gemm_share(m, n, batch, partials);
  const size_t dact = dact_workspace_bytes(t, m, n, batch, kind);
  return std::max(gemm, dact);
}

}  // namespace regemm
