// What CUDA kernels get at run time: XLA's stream and the call's workspace,
// plus the error checks every CUDA call in this backend goes through.
//
// Rules the kernels follow (and why):
// - Everything is enqueued on `stream`; nothing synchronises the host, so a
//   handler returns as soon as its work is queued.
// - No device allocation per call: temporary device memory is the workspace
//   buffer XLA allocates as one more result of the custom call (workspace.h
//   says why not the FFI scratch allocator). So every handler may be captured
//   into a CUDA graph and replayed.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "regemm/problem.h"
#include "regemm/registry.h"
#include "host_marks.h"
#include "workspace.h"
#include "xla/ffi/api/ffi.h"

namespace regemm {

namespace ffi = xla::ffi;

inline ffi::Error cuda_error(cudaError_t e, const char* what, const char* file, int line) {
  return ffi::Error::Internal(std::string("regemm: CUDA error ") + cudaGetErrorName(e) + " (" +
                              cudaGetErrorString(e) + ") from " + what + " at " + file + ":" +
                              std::to_string(line));
}

// Returns an ffi::Error from the enclosing function when a CUDA call fails.
#define REGEMM_CUDA_CHECK(expr)                                                  \
  do {                                                                           \
    const cudaError_t regemm_err_ = (expr);                                      \
    if (regemm_err_ != cudaSuccess)                                              \
      return ::regemm::cuda_error(regemm_err_, #expr, __FILE__, __LINE__);       \
  } while (0)

// After every kernel launch: a bad configuration is reported here, not later.
#define REGEMM_LAUNCH_CHECK() REGEMM_CUDA_CHECK(cudaGetLastError())

// How many handler calls found their stream being captured into a CUDA graph:
// a test hook, exported by the module.
inline std::atomic<int64_t> g_captured_calls{0};

// Host time of handler calls, from the runtime's construction (after the
// arguments are checked) to its destruction (the work is queued): problem
// setup, kernel choice, launches. A measuring hook (benchmarks/trace.py):
// what an uncaptured custom call costs the host beyond XLA's own thunk.
inline std::atomic<int64_t> g_host_calls{0}, g_host_ns{0};

// The tuner's label of regemm_dgrad_dact's composed way (dgrad_then_dact:
// the GEMM, then the dact pass in place): cublas_gemm.cu's first listed
// dgrad_dact way, its entry's rule, which cutlass_registry.cu's rule takes
// past K = 2048.
inline constexpr const char* kComposedDgradWay = "cublas/composed";

// The device's L2 cache in bytes (64 MiB where the query fails).
inline size_t l2_cache_bytes(int device) {
  int l2 = 0;
  if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess || l2 <= 0) {
    cudaGetLastError();
    l2 = 64 << 20;
  }
  return size_t(l2);
}

struct CudaRuntime {
  // `workspace`: the call's workspace result (workspace.h).
  CudaRuntime(ffi::AnyBuffer workspace, cudaStream_t s)
      : stream(s), base_(static_cast<char*>(workspace.untyped_data())), size_(workspace.size_bytes()) {
    host_mark(HostPhase::kBegin);
  }
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;
  ~CudaRuntime() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_);
    host_mark(HostPhase::kEnd);
    g_host_ns.fetch_add(ns.count(), std::memory_order_relaxed);
    g_host_calls.fetch_add(1, std::memory_order_relaxed);
  }

  cudaStream_t stream;

  template <class B> static constexpr auto bind_ctx(B&& b) {
    return std::move(b).template Ctx<ffi::PlatformStream<cudaStream_t>>();
  }

  // Whether XLA is capturing `stream` into a CUDA graph (set by start()):
  // then nothing may be timed or synchronised.
  bool capturing = false;

  // Device operations (kernels, memsets, library calls) enqueued so far; each
  // backend adds its own. The tuner charges the host's cost per operation.
  int ops = 0;

  // Runs the kernel the registry's rule chose. GEMMs and dgrad_dact go
  // through the tuner (tuner.cu), which may run another entry's way instead,
  // timed faster.
  template <class K, class P, class O> ffi::Error run(const K& kernel, const P& p, const O& o) {
    return kernel.run(p, o, *this);
  }
  ffi::Error run(const Kernel<GemmProblem, GemmOperands, CudaRuntime>& rule, const GemmProblem& p,
                 const GemmOperands& o);
  ffi::Error run(const Kernel<DgradDactProblem, DgradDactOperands, CudaRuntime>& rule, const DgradDactProblem& q,
                 const DgradDactOperands& o);

  // Called once per handler call: asks whether the stream is being captured
  // (the one capture query of the call) and counts the captured calls.
  ffi::Error start() {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    REGEMM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    capturing = status != cudaStreamCaptureStatusNone;
    if (capturing) g_captured_calls.fetch_add(1, std::memory_order_relaxed);
    host_mark(HostPhase::kStarted);
    return ffi::Error::Success();
  }

  // The workspace's first `bytes` (kWorkspaceAlign-aligned), or null when
  // they do not fit: for optional uses (a faster algorithm), which then do
  // without. Every kernel launch may use the workspace from its start: the
  // launches of a call are ordered on one stream. A user that needs two
  // regions at once carves them out of one request.
  void* take(size_t bytes) const {
    return bytes > 0 && bytes <= capacity() ? static_cast<void*>(base_ + slack()) : nullptr;
  }

  // The most take() hands out: the workspace less its alignment slack.
  size_t capacity() const { return base_ && size_ > slack() ? size_ - slack() : 0; }

  // `bytes` the kernel cannot do without (null for 0 bytes); too little is a
  // bug in the size the lowering asked for (workspace.h).
  ffi::Error workspace(size_t bytes, void** out) const {
    *out = take(bytes);
    if (bytes > 0 && !*out)
      return ffi::Error::Internal("regemm: the workspace of " + std::to_string(size_) + " bytes has no room for " +
                                  std::to_string(bytes) + " (the lowering sized it: workspace.h)");
    return ffi::Error::Success();
  }

 private:
  // Bytes from the workspace's start to its first kWorkspaceAlign boundary.
  size_t slack() const {
    const uintptr_t b = reinterpret_cast<uintptr_t>(base_);
    return ((b + kWorkspaceAlign - 1) & ~uintptr_t(kWorkspaceAlign - 1)) - b;
  }

  char* base_;
  size_t size_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

}  // namespace regemm
