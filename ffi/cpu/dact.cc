// CPU backward epilogue: gZ = gY * act'(Z or Y) and the bias gradient, in one
// pass over gY. Bias sums accumulate in double, so they do not drift with M.
#include <vector>

#include "../regemm/handlers.h"
#include "runtime.h"

namespace regemm {
namespace {

template <class T>
void dact(const DactProblem& p, const DactOperands& o, const CpuRuntime& rt) {
  using A = acc_t<T>;
  const A slope = A(p.slope);
  const int64_t mn = p.m * p.n;
  rt.parallel_for(p.batch, [&](int64_t b) {
    const T* gy = static_cast<const T*>(o.gy) + b * p.stride_gy;
    const T* s = static_cast<const T*>(o.s) + b * p.stride_s;
    T* gz = static_cast<T*>(o.gz) + b * mn;
    std::vector<double> col(p.bias_kind == BiasKind::kPerCol ? p.n : 0, 0.0);
    double total = 0.0;
    for (int64_t i = 0; i < p.m; ++i) {
      double row = 0.0;
      for (int64_t j = 0; j < p.n; ++j) {
        const int64_t idx = i * p.n + j;
        const A sv = load<A>(s[idx]);
        const A d = p.from_y ? act_grad_from_y(p.act, sv, slope) : act_grad(p.act, sv, slope);
        const T g = store<T>(load<A>(gy[idx]) * d);
        gz[idx] = g;
        const double gd = double(load<A>(g));  // the bias gradient sums gZ as stored
        row += gd;
        if (!col.empty()) col[j] += gd;
      }
      if (p.bias_kind == BiasKind::kPerRow) static_cast<T*>(o.gbias)[b * p.m + i] = store<T>(A(row));
      total += row;
    }
    if (p.bias_kind == BiasKind::kScalar) static_cast<T*>(o.gbias)[b] = store<T>(A(total));
    if (p.bias_kind == BiasKind::kPerCol)
      for (int64_t j = 0; j < p.n; ++j) static_cast<T*>(o.gbias)[b * p.n + j] = store<T>(A(col[j]));
  });
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
