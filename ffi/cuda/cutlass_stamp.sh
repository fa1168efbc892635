#!/bin/bash
# Prints the stamp of the sources the CUTLASS kernel objects are built from:
# sha256 of the lines "<sha256 of file>" of each file below, in this order.
# cutlass.cmake computes the same (keep the two lists equal).
#   ffi/cuda/cutlass_stamp.sh CUTLASS_ROOT      (run from the repo root)
set -eo pipefail
ROOT=${1:?usage: cutlass_stamp.sh CUTLASS_ROOT}
for f in ffi/cuda/cutlass_inst.cu.in ffi/cuda/cutlass_gemm.cuh ffi/cuda/cutlass_epilogue.cuh ffi/cuda/cutlass_kernels.h \
         ffi/regemm/problem.h ffi/regemm/activation.h ffi/regemm/numeric.h ffi/regemm/host_math.h \
         "$ROOT/include/cutlass/version.h"; do
  sha256sum "$f" | cut -c1-64
done | sha256sum | cut -c1-64
