// Leading batch dimensions, as vmap (vmap_method="expand_dims") and callers
// pass them: every operand has the same number of leading dims, each either
// the output's extent or 1 (broadcast). The plan merges what can be merged
// into one kernel-visible batch with an element stride per operand (0 for a
// broadcast operand: it is read in place, never copied); anything left is an
// outer loop that the handler runs.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace regemm {

namespace ffi = xla::ffi;

inline constexpr int kMaxOperands = 8;
inline constexpr int kMaxBatchDims = 8;

struct BatchOperand {
  ffi::Span<const int64_t> dims;  // the operand's full shape
  int64_t matrix_size;            // elements per batch entry (product of non-batch dims)
};

struct BatchPlan {
  int n_ops = 0;
  int64_t count = 1;                 // inner batch, seen by kernels
  int64_t stride[kMaxOperands] = {};
  int n_outer = 0;                   // outer dims, looped by the handler
  int64_t outer_extent[kMaxBatchDims] = {};
  int64_t outer_stride[kMaxOperands][kMaxBatchDims] = {};

  // Calls f(offsets) once per outer index; offsets[i] is operand i's element offset.
  template <class F> ffi::Error for_each_outer(F&& f) const {
    int64_t idx[kMaxBatchDims] = {};
    while (true) {
      int64_t off[kMaxOperands] = {};
      for (int o = 0; o < n_ops; ++o)
        for (int d = 0; d < n_outer; ++d) off[o] += idx[d] * outer_stride[o][d];
      ffi::Error err = f(off);
      if (err.failure()) return err;
      int d = n_outer - 1;
      for (; d >= 0; --d) {
        if (++idx[d] < outer_extent[d]) break;
        idx[d] = 0;
      }
      if (d < 0) return ffi::Error::Success();
    }
  }
};

// `batch_dims` are the output's leading dims; each operand has nb = batch_dims.size()
// leading dims of its own.
inline ffi::ErrorOr<BatchPlan> plan_batch(ffi::Span<const int64_t> batch_dims,
                                          std::initializer_list<BatchOperand> ops) {
  const int nb = int(batch_dims.size());
  if (nb > kMaxBatchDims) return ffi::Unexpected(ffi::Error::InvalidArgument("too many batch dimensions"));
  BatchPlan plan;
  plan.n_ops = int(ops.size());
  // Kept dims (extent > 1) with each operand's stride along them.
  int64_t extent[kMaxBatchDims];
  int64_t stride[kMaxOperands][kMaxBatchDims];
  int kept = 0;
  for (int d = 0; d < nb; ++d) {
    int64_t e = batch_dims[d];
    int o = 0;
    for (const BatchOperand& op : ops) {
      if (int(op.dims.size()) < nb)
        return ffi::Unexpected(ffi::Error::InvalidArgument("operand rank below batch rank"));
      int64_t od = op.dims[d];
      if (od != e && od != 1)
        return ffi::Unexpected(ffi::Error::InvalidArgument(
            "batch dimension " + std::to_string(d) + " of operand " + std::to_string(o) + " is " +
            std::to_string(od) + ", expected 1 or " + std::to_string(e)));
      int64_t s = 0;
      if (od == e && e > 1) {
        s = op.matrix_size;
        for (int d2 = d + 1; d2 < nb; ++d2) s *= op.dims[d2];
      }
      stride[o][kept] = s;
      ++o;
    }
    if (e == 0) { plan.count = 0; return plan; }
    if (e > 1) extent[kept++] = e;
  }
  // Merge dim d into d+1 where every operand is contiguous (or broadcast) across them.
  int64_t m_extent[kMaxBatchDims];
  int64_t m_stride[kMaxOperands][kMaxBatchDims];
  int merged = 0;
  for (int d = 0; d < kept; ++d) {
    bool can_merge = merged > 0;
    for (int o = 0; o < plan.n_ops && can_merge; ++o)
      can_merge = m_stride[o][merged - 1] == stride[o][d] * extent[d];
    if (can_merge) {
      m_extent[merged - 1] *= extent[d];
      for (int o = 0; o < plan.n_ops; ++o) m_stride[o][merged - 1] = stride[o][d];
    } else {
      m_extent[merged] = extent[d];
      for (int o = 0; o < plan.n_ops; ++o) m_stride[o][merged] = stride[o][d];
      ++merged;
    }
  }
  if (merged > 0) {
    plan.count = m_extent[merged - 1];
    for (int o = 0; o < plan.n_ops; ++o) plan.stride[o] = m_stride[o][merged - 1];
    plan.n_outer = merged - 1;
    for (int d = 0; d + 1 < merged; ++d) {
      plan.outer_extent[d] = m_extent[d];
      for (int o = 0; o < plan.n_ops; ++o) plan.outer_stride[o][d] = m_stride[o][d];
    }
  }
  return plan;
}

}  // namespace regemm
