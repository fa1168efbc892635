// CPU backward epilogue: gZ = gY * act'(Z or Y) and the bias gradient in one
// pass over gY (the row loops: elementwise_isa.cc, for this CPU's instruction
// set). Rows are split into chunks over the thread pool; each chunk
// keeps its own bias partial sums (double), combined in a fixed order, so the
// result does not depend on scheduling.
#include <algorithm>
#include <vector>

#include "regemm/handlers.h"
#include "elementwise.h"
#include "runtime.h"

namespace regemm {
namespace {

template <class T>
void dact(const DactProblem& p, const DactOperands& o, const CpuRuntime& rt) {
  const auto& kernels = elementwise();
  const int64_t rows_per_chunk = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(p.n, 1));
  const int64_t chunks = std::max<int64_t>(1, (p.m + rows_per_chunk - 1) / rows_per_chunk);
  const bool per_col = p.bias_kind == BiasKind::kPerCol;
  // Row sums only where the bias gradient is made of them.
  const bool by_row = p.bias_kind == BiasKind::kPerRow || p.bias_kind == BiasKind::kScalar;
  for (int64_t b = 0; b < p.batch; ++b) {
    const T* gy = static_cast<const T*>(o.gy) + b * p.stride_gy;
    const T* s = static_cast<const T*>(o.s) + b * p.stride_s;
    T* gz = static_cast<T*>(o.gz) + b * p.m * p.n;
    std::vector<double> col(per_col ? chunks * p.n : 0, 0.0), row(by_row ? std::max<int64_t>(p.m, 1) : 0, 0.0);
    rt.parallel_for(chunks, [&](int64_t c) {
      const int64_t i0 = c * rows_per_chunk, i1 = std::min(p.m, i0 + rows_per_chunk);
      if (i0 < i1) kernels.dact_rows(p, gy, s, gz, i0, i1, per_col ? &col[c * p.n] : nullptr, by_row ? &row[i0] : nullptr);
    });
    if (p.bias_kind == BiasKind::kNone) continue;
    T* gbias = static_cast<T*>(o.gbias) + b * bias_length(p.bias_kind, p.m, p.n);
    using A = acc_t<T>;
    if (p.bias_kind == BiasKind::kPerRow) {
      for (int64_t i = 0; i < p.m; ++i) gbias[i] = store<T>(A(row[i]));
    } else if (p.bias_kind == BiasKind::kScalar) {
      double total = 0.0;
      for (int64_t i = 0; i < p.m; ++i) total += row[i];
      gbias[0] = store<T>(A(total));
    } else {
      for (int64_t j = 0; j < p.n; ++j) {
        double sum = 0.0;
        for (int64_t c = 0; c < chunks; ++c) sum += col[c * p.n + j];
        gbias[j] = store<T>(A(sum));
      }
    }
  }
}

ffi::Error run_dact(const DactProblem& p, const DactOperands& o, CpuRuntime& rt) {
  switch (p.dtype) {
    case DType::kF32: dact<float>(p, o, rt); break;
    case DType::kF64: dact<double>(p, o, rt); break;
    case DType::kBF16: dact<bf16_t>(p, o, rt); break;
    case DType::kF16: dact<f16_t>(p, o, rt); break;
  }
  return ffi::Error::Success();
}

const Register<DactProblem, DactOperands, CpuRuntime> kRegister({
    "cpu_dact", 0, [](const DactProblem&) { return true; }, run_dact});

}  // namespace
}  // namespace regemm
