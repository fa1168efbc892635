// The regemm epilogue as a pass of its own over a GEMM's output, for GEMMs
// that run without it: cuBLAS for f32 HIGHEST and f64 (cublas_gemm.cu), and
// the CUTLASS kernels' "split" choice for a costly activation
// (cutlass_dispatch.cu). Free of XLA and CUTLASS, like the kernels' table.
//
// Y holds the GEMM's alpha op(A) op(B) (the CUTLASS split path: the whole
// Z, bias and C included); the pass computes, in the accumulation type,
//     v = Y + beta C + bias      (the terms only when with_bias_c)
//     Z = v (when o.z),  Y = act(v)
// reading Y once and writing it (and Z) once. from_z: the GEMM wrote the whole
// Z into Z's buffer itself, and the pass reads Z and writes Y alone (two M x N
// passes instead of three).
#pragma once

#include <cuda_runtime.h>

#include "regemm/problem.h"

namespace regemm {

// fast_math: the activation with the GPU's approximate instructions (as the
// fused CUTLASS epilogue computes it), else the precise forms (as the SIMT
// kernel does). Returns null, or the launch's CUDA error string.
const char* epilogue_pass(const GemmProblem& p, const GemmOperands& o, bool with_bias_c, bool fast_math,
                          cudaStream_t stream, bool from_z = false);

}  // namespace regemm
