// regemm_dgrad_dact's CUTLASS kernels, free of CUTLASS headers (as
// cutlass_kernels.h for the forward): the operands, the table the
// instantiation TUs (cutlass_dgrad_inst.cu.in) fill in, and the launch they
// define (cutlass_dgrad.cuh). These and the kernels' sources carry a stamp of
// their own (kernels.cmake, the dgrad stamp), so that changing them rebuilds these
// kernels alone.
#pragma once

#include "cutlass_kernels.h"

namespace regemm::cutlass_sm90 {

// regemm_dgrad_dact's GEMM (A not transposed): gZ = (alpha op(A) op(B)) act'(S),
// S read as an aux matrix, and the bias gradient's column sums of each warp's
// rows of each CTA tile into `partials` (f32, per batch entry
// [dgrad_partials_rows(M)][dgrad_partials_ld(N)], the entries one after
// another; null: no bias gradient), summed afterwards in order.
struct DgradOperands {
  const void* a;
  const void* b;
  const void* s;
  void* gz;
  float* partials = nullptr;
};
using DgradRunFn = Status (*)(const GemmProblem&, const DactProblem&, const DgradOperands&, const Launch&);

// The configuration they are built in: ping-pong, 128x128 tiles, no cluster
// (its epilogue, with the act', overlaps the other
// warpgroup's MMAs; the 128x256 cooperative tile was slower at every shape
// measured, tools/tile_bench).
inline constexpr Config kDgradConfig = Config::kPing128x128c1;
inline constexpr int64_t kDgradTileM = 128, kDgradTileN = 128;  // its CTA tile
// The warps of its epilogue (one consumer warpgroup), stacked along M: a row
// of partial sums each.
inline constexpr int kDgradPartialRowsPerTile = 4;
inline int64_t dgrad_partials_rows(int64_t m) { return (m + kDgradTileM - 1) / kDgradTileM * kDgradPartialRowsPerTile; }
inline int64_t dgrad_partials_ld(int64_t n) { return (n + kDgradTileN - 1) / kDgradTileN * kDgradTileN; }

// The act' forms of a kernel, its slot: 0 the cheap ones (relu, leaky_relu,
// tanh and none from Z; every form from Y), inline behind one switch; each
// slot after it one form in a kernel of its own (dgrad_slot_form): each of
// kOneActs from Z (gelu, gelu_erf, sigmoid, silu), then relu from Y (a relu
// MLP's default, save="auto": behind slot 0's switch, 11160 instructions of
// SASS in bf16, its warps waited on instruction fetch in ncu, no_instruction
// 1.82 cycles per issue against 0.23 in its own kernel of 3240).
struct DgradForm {
  Act act;
  bool from_y;
};
inline constexpr int kNumDgradActSlots = 2 + kNumOneActs;
constexpr DgradForm dgrad_slot_form(int slot) {  // slot in [1, kNumDgradActSlots)
  return slot <= kNumOneActs ? DgradForm{kOneActs[slot - 1], false} : DgradForm{Act::kRelu, true};
}
inline int dgrad_act_slot(Act act, bool from_y) {
  for (int slot = 1; slot < kNumDgradActSlots; ++slot)
    if (dgrad_slot_form(slot).act == act && dgrad_slot_form(slot).from_y == from_y) return slot;
  return 0;
}

// dtype x trans_b x act slot -> kernel.
class DgradTable {
 public:
  static DgradTable& get() {
    static DgradTable table;
    return table;
  }
  DgradRunFn find(DType t, bool tb, int slot) const {
    const int d = KernelTable::dtype_slot(t);
    return d < 0 ? nullptr : fns_[d][tb][slot];
  }
  void set(DType t, bool tb, int slot, DgradRunFn fn) { fns_[KernelTable::dtype_slot(t)][tb][slot] = fn; }

 private:
  DgradRunFn fns_[3][2][kNumDgradActSlots] = {};
};

// Launches of these kernels so far, and of those that summed a bias gradient
// (test hooks: the module's cutlass_dgrad_dact_launches(), cutlass_dgrad_bias_sums()).
inline std::atomic<int64_t> g_dgrad_dact_launches{0};
inline std::atomic<int64_t> g_dgrad_bias_sums{0};

template <DType D, bool TB, int Slot>
Status run_dgrad_dact(const GemmProblem& p, const DactProblem& d, const DgradOperands& o, const Launch& l);

}  // namespace regemm::cutlass_sm90
