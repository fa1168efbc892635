// The CPU's elementwise epilogues, written once with activation.h's math and
// compiled for several instruction sets (elementwise_isa.cc, built once per
// set by CMake); `elementwise()` picks the widest this CPU runs, once. The
// package itself is built for baseline x86-64, so this is where the
// activation loops get their vector width.
#pragma once

#include <cstdint>

#include "regemm/problem.h"

namespace regemm {

struct ElementwiseKernels {
  // y[i] = act(z[i]) for i in [begin, end) (y may be z).
  void (*act)(DType t, Act act, double slope, const void* z, void* y, int64_t begin, int64_t end);
  // Rows [i0, i1) of one problem of the backward epilogue: gZ = gY * act'(S);
  // where row_sums is not null, each row's sum of gZ (as stored) into
  // row_sums[i - i0], and where col is not null, each column's sum over these
  // rows added into col.
  void (*dact_rows)(const DactProblem& p, const void* gy, const void* s, void* gz, int64_t i0, int64_t i1,
                    double* col, double* row_sums);
};

const ElementwiseKernels& elementwise();

}  // namespace regemm
