// The CPU extension: the FFI handlers, bound once in handlers.h, instantiated
// for the CPU runtime and exported to Python as capsules.
#include <nanobind/nanobind.h>

#include "regemm/handlers.h"
#include "regemm/module_util.h"
#include "runtime.h"

namespace nb = nanobind;
using regemm::CpuRuntime;

XLA_FFI_DEFINE_HANDLER_SYMBOL(regemm_gemm_cpu, (regemm::gemm_handler<CpuRuntime, xla::ffi::ThreadPool>),
                              regemm::gemm_binding<CpuRuntime>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(regemm_dact_cpu, (regemm::dact_handler<CpuRuntime, xla::ffi::ThreadPool>),
                              regemm::dact_binding<CpuRuntime>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(regemm_dgrad_dact_cpu,
                              (regemm::dgrad_dact_handler<CpuRuntime, xla::ffi::ThreadPool>),
                              regemm::dgrad_dact_binding<CpuRuntime>());

// Per dtype (NumPy's names), the GEMM kernels that run a plain 256x256x256
// problem of it on this machine: oneDNN's supports() asks the instruction set
// (its bf16 and f16 need AVX-512 or AMX), and the routing sends the dtypes
// that only the portable packed kernel runs to XLA's dot (jax_regemm/_route.py,
// "portable").
nb::dict gemm_kernels_by_dtype() {
  nb::dict d;
  for (int t = 0; t < 4; ++t) {
    regemm::GemmProblem p;
    p.dtype = regemm::DType(t);
    p.m = p.n = p.k = 256;
    nb::list names;
    for (const auto& e : regemm::GemmRegistry<CpuRuntime>::get().entries())
      if (e.supports(p)) names.append(nb::str(e.name.data(), e.name.size()));
    d[nb::str(regemm::kDTypeNames[t].data(), regemm::kDTypeNames[t].size())] = names;
  }
  return d;
}

NB_MODULE(_regemm_cpu, m) {
  m.def("registrations", [] {
    nb::dict d;
    d[regemm::kGemmTarget] = nb::capsule(reinterpret_cast<void*>(regemm_gemm_cpu));
    d[regemm::kDactTarget] = nb::capsule(reinterpret_cast<void*>(regemm_dact_cpu));
    d[regemm::kDgradDactTarget] = nb::capsule(reinterpret_cast<void*>(regemm_dgrad_dact_cpu));
    return d;
  });
  m.def("kernels", [] { return regemm::kernels_by_op<CpuRuntime>(); });
  m.def("gemm_kernels_by_dtype", gemm_kernels_by_dtype);
}
