// What both extension modules export to Python beside their handlers: the
// names of the kernels registered for a runtime, per op (jax_regemm.kernels()).
#pragma once

#include <nanobind/nanobind.h>

#include "handlers.h"

namespace regemm {

template <class Registry> nanobind::list kernel_names() {
  nanobind::list names;
  for (const auto& e : Registry::get().entries()) names.append(nanobind::str(e.name.data(), e.name.size()));
  return names;
}

template <class Runtime> nanobind::dict kernels_by_op() {
  nanobind::dict d;
  d["gemm"] = kernel_names<GemmRegistry<Runtime>>();
  d["dact"] = kernel_names<DactRegistry<Runtime>>();
  return d;
}

}  // namespace regemm
