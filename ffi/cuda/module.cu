// The CUDA extension: the FFI handlers, bound once in handlers.h, instantiated
// for the CUDA runtime (XLA's stream + the call's workspace) and exported to
// Python as capsules, like the CPU module, with the workspace sizes the
// lowering asks for (workspace.h).
//
// Every handler declares the command-buffer trait: XLA may capture them into
// CUDA graphs. That holds because nothing they enqueue outlives the graph's
// resources: no host synchronisation, no allocation (the workspace is an XLA
// buffer), and the cuBLAS handle is created under relaxed capture mode and
// never freed. The GEMM tuner does not time under capture (rule instead).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <utility>

#include "regemm/handlers.h"
#include "regemm/module_util.h"
#include "cuda/cutlass/cutlass_dgrad.h"
#include "cuda/cutlass/cutlass_kernels.h"
#include "cuda/narrow/narrow_ffi.h"
#include "runtime.h"
#include "tuner.h"
#include "workspace.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
using regemm::CudaRuntime;

XLA_FFI_DEFINE_HANDLER_SYMBOL(regemm_gemm_cuda,
                              (regemm::gemm_handler<CudaRuntime, cudaStream_t>),
                              regemm::gemm_binding<CudaRuntime>(), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(regemm_dact_cuda,
                              (regemm::dact_handler<CudaRuntime, cudaStream_t>),
                              regemm::dact_binding<CudaRuntime>(), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(regemm_dgrad_dact_cuda,
                              (regemm::dgrad_dact_handler<CudaRuntime, cudaStream_t>),
                              regemm::dgrad_dact_binding<CudaRuntime>(), {ffi::Traits::kCmdBufferCompatible});

NB_MODULE(_regemm_cuda, m) {
  m.def("registrations", [] {
    nb::dict d;
    d[regemm::kGemmTarget] = nb::capsule(reinterpret_cast<void*>(regemm_gemm_cuda));
    d[regemm::kDactTarget] = nb::capsule(reinterpret_cast<void*>(regemm_dact_cuda));
    d[regemm::kDgradDactTarget] = nb::capsule(reinterpret_cast<void*>(regemm_dgrad_dact_cuda));
    d[regemm::narrow::kForwardTarget] = nb::capsule(regemm::narrow::forward_handler());
    d[regemm::narrow::kBackwardTarget] = nb::capsule(regemm::narrow::backward_handler());
    return d;
  });
  // The targets whose handlers are CUDA-graph safe. XLA learns the trait from
  // the registration call, not from the handler, so Python passes it along.
  m.def("command_buffer_compatible", [] {
    nb::list names;
    names.append(regemm::kGemmTarget);
    names.append(regemm::kDactTarget);
    names.append(regemm::kDgradDactTarget);
    names.append(regemm::narrow::kForwardTarget);
    names.append(regemm::narrow::kBackwardTarget);
    return names;
  });
  // Workspace bytes of a call (workspace.h); dtype by its NumPy name.
  auto dtype = [](const std::string& name) {
    regemm::DType t;
    if (!regemm::parse_dtype(name, &t)) throw nb::value_error(("regemm: unsupported dtype " + name).c_str());
    return t;
  };
  m.def("gemm_workspace_bytes", [] { return regemm::gemm_workspace_bytes(); });
  m.def("gemm_call_workspace_bytes", [dtype](const std::string& t, int64_t m, int64_t n, int64_t k, int64_t batch,
                                             int64_t batch_b, bool trans_a, bool trans_b) {
    return regemm::gemm_call_workspace_bytes(dtype(t), m, n, k, batch, batch_b, trans_a, trans_b);
  });
  m.def("dgrad_dact_workspace_bytes",
        [dtype](const std::string& t, int64_t m, int64_t n, int64_t batch, const std::string& kind) {
          regemm::BiasKind b;
          if (!regemm::parse_bias_kind(kind, &b)) throw nb::value_error(("regemm: unknown bias kind " + kind).c_str());
          return regemm::dgrad_dact_workspace_bytes(dtype(t), m, n, batch, b);
        });
  // Whether a dgrad_dact call runs with gZ over S (handlers.h), by its dims and attributes.
  m.def("dgrad_dact_in_place",
        [dtype](const std::string& t, int64_t m, int64_t n, int64_t k, int64_t batch, const std::string& act,
                double slope, bool from_y, const std::string& bias_kind, bool trans_a, bool trans_b, bool exact_f32) {
          return regemm::dgrad_dact_in_place<CudaRuntime>(dtype(t), m, n, k, batch, act, slope, from_y, bias_kind,
                                                          trans_a, trans_b, exact_f32);
        });
  m.def("dact_workspace_bytes", [dtype](const std::string& t, int64_t m, int64_t n, int64_t batch, const std::string& kind) {
    regemm::BiasKind k;
    if (!regemm::parse_bias_kind(kind, &k)) throw nb::value_error(("regemm: unknown bias kind " + kind).c_str());
    return regemm::dact_workspace_bytes(dtype(t), m, n, batch, k);
  });
  // Kernel calls so far that ran under CUDA-graph capture (a test hook).
  m.def("captured_calls", [] { return regemm::g_captured_calls.load(); });
  // Launches of the CUTLASS kernels compiled for one activation (a test hook;
  // cutlass_kernels.h, which needs no CUTLASS headers: 0 in a build without them).
  m.def("cutlass_one_act_launches", [] { return regemm::cutlass_sm90::g_one_act_launches.load(); });
  m.def("cutlass_dgrad_dact_launches", [] { return regemm::cutlass_sm90::g_dgrad_dact_launches.load(); });
  m.def("cutlass_dgrad_bias_sums", [] { return regemm::cutlass_sm90::g_dgrad_bias_sums.load(); });
  // The dtypes this build has CUTLASS forward kernels of (REGEMM_CUTLASS_DTYPES; none without
  // the CUTLASS headers), so that tests of the others skip.
  m.def("cutlass_dtypes", [] {
    using regemm::cutlass_sm90::Config;
    using regemm::cutlass_sm90::KernelTable;
    nb::list out;
    const std::pair<regemm::DType, const char*> dtypes[] = {
        {regemm::DType::kBF16, "bfloat16"}, {regemm::DType::kF16, "float16"}, {regemm::DType::kF32, "float32"}};
    for (const auto& [t, name] : dtypes) {
      bool built = false;
      for (int c = 0; c < regemm::cutlass_sm90::kNumConfigs; ++c)
        for (bool ta : {false, true})
          for (bool tb : {false, true}) built = built || KernelTable::get().find(t, ta, tb, Config(c)) != nullptr;
      if (built) out.append(name);
    }
    return out;
  });
  // (handler calls, seconds of host time in them) so far (runtime.h).
  m.def("host_time", [] { return nb::make_tuple(regemm::g_host_calls.load(), regemm::g_host_ns.load() * 1e-9); });
  // The host timeline (host_marks.h): [(phase, monotonic ns)] recorded since the
  // last call, which also clears it and turns recording on or off.
  m.def("host_marks", [](bool on) {
    auto& hm = regemm::g_host_marks;
    std::lock_guard<std::mutex> lock(hm.mu);
    nb::list out;
    for (const auto& [phase, ns] : hm.marks) out.append(nb::make_tuple(phase, ns));
    hm.marks.clear();
    hm.on.store(on, std::memory_order_relaxed);
    return out;
  });
  m.def("kernels", [] {
    nb::dict d = regemm::kernels_by_op<CudaRuntime>();
    nb::list narrow;
    narrow.append("narrow_mlp_sm80");  // the fused narrow MLP (ffi/cuda/narrow): mma.sync
    if (regemm::narrow::wgmma_here()) narrow.append("narrow_mlp_sm90a_wgmma");  // and its wgmma forms
    d["narrow_mlp"] = narrow;
    return d;
  });
  // The fused narrow MLP's questions at lowering (narrow_ffi.h).
  m.def("narrow_smem_bytes", &regemm::narrow::smem_bytes);
  m.def("narrow_smem_limit", &regemm::narrow::smem_limit);
  m.def("narrow_bwd_workspace_bytes", [](const std::string& dtype, int k0, int width, int layers, int n_out,
                                         const std::string& act) {
    return regemm::narrow::bwd_workspace_bytes(dtype == "float16", k0, width, layers, n_out, act);
  });
  // The GEMM tuner (tuner.cu): {signature: "entry/variant"} chosen so far,
  // how many problems were timed, how many of its stream holds ran to their
  // limit, and forgetting the in-process winners.
  m.def("tuned", [] {
    nb::dict d;
    for (const auto& kv : regemm::tuner::winners()) d[nb::str(kv.first.c_str())] = nb::str(kv.second.c_str());
    return d;
  });
  m.def("tuning_count", [] { return regemm::tuner::timings(); });
  m.def("tuner_hold_timeouts", [] { return regemm::tuner::hold_timeouts(); });
  m.def("forget_tuned", [] { regemm::tuner::forget(); });
}
