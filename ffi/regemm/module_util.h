// What both extension modules export to Python beside their handlers: the
// custom-call target names, and the names of the kernels registered for a
// runtime, per op (jax_regemm.kernels()).
#pragma once

#include <nanobind/nanobind.h>

#include "handlers.h"

namespace regemm {

// The custom-call targets, versioned: a program exported with jax.export
// names them, so a target keeps its operands, results and attributes (the
// binding in handlers.h) for as long as it exists; a change to any of them
// is a new target (_v2) beside the old one (README, "Export").
inline constexpr const char* kGemmTarget = "regemm_gemm_v1";
inline constexpr const char* kDactTarget = "regemm_dact_v1";
inline constexpr const char* kDgradDactTarget = "regemm_dgrad_dact_v1";

template <class Registry> nanobind::list kernel_names() {
  nanobind::list names;
  for (const auto& e : Registry::get().entries()) names.append(nanobind::str(e.name.data(), e.name.size()));
  return names;
}

template <class Runtime> nanobind::dict kernels_by_op() {
  nanobind::dict d;
  d["gemm"] = kernel_names<GemmRegistry<Runtime>>();
  d["dact"] = kernel_names<DactRegistry<Runtime>>();
  d["dgrad_dact"] = kernel_names<DgradDactRegistry<Runtime>>();
  return d;
}

}  // namespace regemm
