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

NB_MODULE(_regemm_cpu, m) {
  m.def("registrations", [] {
    nb::dict d;
    d[regemm::kGemmTarget] = nb::capsule(reinterpret_cast<void*>(regemm_gemm_cpu));
    d[regemm::kDactTarget] = nb::capsule(reinterpret_cast<void*>(regemm_dact_cpu));
    d[regemm::kDgradDactTarget] = nb::capsule(reinterpret_cast<void*>(regemm_dgrad_dact_cpu));
    return d;
  });
  m.def("kernels", [] { return regemm::kernels_by_op<CpuRuntime>(); });
}
