#!/bin/bash
# Prints the stamp of the sources the CUTLASS kernel objects are built from:
# sha256 of the lines "<sha256 of file>" of each file below, in this order.
# cutlass.cmake computes the same (keep the lists equal). Two stamps: the
# forward kernels' sources ("fwd", the default) and, for the dgrad kernels,
# those and their own ("dgrad").
#   ffi/cuda/cutlass_stamp.sh CUTLASS_ROOT [fwd|dgrad]     (run from the repo root)
set -eo pipefail
ROOT=${1:?usage: cutlass_stamp.sh CUTLASS_ROOT [fwd|dgrad]}
files="ffi/cuda/cutlass_inst.cu.in ffi/cuda/cutlass_gemm.cuh ffi/cuda/cutlass_epilogue.cuh ffi/cuda/cutlass_kernels.h
       ffi/regemm/problem.h ffi/regemm/activation.h ffi/regemm/numeric.h ffi/regemm/host_math.h
       $ROOT/include/cutlass/version.h"
[ "${2:-fwd}" = dgrad ] && files="$files ffi/cuda/cutlass_dgrad_inst.cu.in ffi/cuda/cutlass_dgrad.cuh ffi/cuda/cutlass_dgrad.h"
for f in $files; do
  sha256sum "$f" | cut -c1-64
done | sha256sum | cut -c1-64
