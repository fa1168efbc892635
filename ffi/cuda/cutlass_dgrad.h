// regemm_dgrad_dact's CUTLASS kernels, free of CUTLASS headers (as
// cutlass_kernels.h for the forward): the operands, the table the
// instantiation TUs (cutlass_dgrad_inst.cu.in) fill in, and the launch they
// define (cutlass_dgrad.cuh). These and the kernels' sources carry a stamp of
// their own (cutlass_stamp.sh dgrad), so that changing them rebuilds these
// kernels alone.
#pragma once

#include "cutlass_kernels.h"

namespace regemm::cutlass_sm90 {

// regemm_dgrad_dact's GEMM (A not transposed): gZ = (alpha op(A) op(B)) act'(S)
// with S read where C would be, and each 128-row tile's column sums of gZ in
// `partials` (f32, [ceil(M / 128), round_up(N, tile N)] per batch entry,
// partials_batch apart; null: no bias gradient), summed afterwards in order.
struct DgradOperands {
  const void* a;
  const void* b;
  const void* s;
  void* gz;
  float* partials;
  int64_t partials_batch;
};
using DgradRunFn = Status (*)(const GemmProblem&, const DactProblem&, const DgradOperands&, const Launch&);
// The configurations built for it (cutlass.cmake, cutlass_prebuild.sh), and
// the N extent of their tiles (the partials' row length rounds N up to it).
inline constexpr Config kDgradConfigs[] = {Config::kPing128x128c1, Config::kCoop128x256};
inline constexpr int kDgradTileM = 128;
inline int64_t dgrad_tile_n(Config c) { return c == Config::kCoop128x256 ? 256 : 128; }

// dtype x trans_b x config -> kernel.
class DgradTable {
 public:
  static DgradTable& get() {
    static DgradTable table;
    return table;
  }
  DgradRunFn find(DType t, bool tb, Config c) const {
    const int d = KernelTable::dtype_slot(t);
    return d < 0 ? nullptr : fns_[d][tb][int(c)];
  }
  void set(DType t, bool tb, Config c, DgradRunFn fn) { fns_[KernelTable::dtype_slot(t)][tb][int(c)] = fn; }

 private:
  DgradRunFn fns_[3][2][kNumConfigs] = {};
};

// Launches of these kernels so far (a test hook: the module's
// cutlass_dgrad_dact_launches()).
inline std::atomic<int64_t> g_dgrad_dact_launches{0};

template <DType D, bool TB, Config C>
Status run_dgrad_dact(const GemmProblem& p, const DactProblem& d, const DgradOperands& o, const Launch& l);

}  // namespace regemm::cutlass_sm90
