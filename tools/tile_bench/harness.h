// tools/tile_bench: CUTLASS tile variants of the regemm kernel (variant.cu,
// one object per variant) timed beside cuBLAS's plain GEMM (main.cu), without
// XLA. Each variant object adds itself to variants() at load time.
#pragma once
#include <vector>

#include "cutlass_kernels.h"

struct Variant {
  const char* name;
  int ta, tb;  // A stored [K, M], B stored [N, K]
  regemm::cutlass_sm90::Status (*run)(const regemm::GemmProblem&, const regemm::GemmOperands&,
                                      const regemm::cutlass_sm90::Launch&);
  int smem, stages, epi_smem;  // bytes, mainloop stages, epilogue bytes
};
std::vector<Variant>& variants();
inline bool add_variant(Variant v) {
  variants().push_back(v);
  return true;
}
