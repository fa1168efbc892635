// What CUDA kernels get at run time: XLA's stream and its scratch allocator,
// plus the error checks every CUDA call in this backend goes through.
//
// Rules the kernels follow (and why):
// - Everything is enqueued on `stream`; nothing synchronises the host, so a
//   handler returns as soon as its work is queued.
// - No cudaMalloc per call: temporary device memory comes from XLA's scratch
//   allocator, which is stream-ordered on XLA's stream.
// - Scratch is NOT used while the stream is being captured into a CUDA graph
//   (XLA command buffers trace the handler once and replay the graph): the
//   allocation is freed when the handler returns, but the graph would keep its
//   address for every replay. Kernels therefore have a scratch-free path, and
//   `scratch_for_call` says which one to take.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

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

// How many kernel calls found their stream being captured into a CUDA graph
// (and took the scratch-free path): a test hook, exported by the module.
inline std::atomic<int64_t> g_captured_calls{0};

// XLA's scratch allocator accepts alignments up to 16 bytes only; cuBLAS wants
// 256 for its workspace. So every scratch request is padded and aligned here.
constexpr size_t kScratchAlign = 256;

struct CudaRuntime {
  CudaRuntime(cudaStream_t s, ffi::ScratchAllocator& a) : stream(s), scratch(&a) {}

  cudaStream_t stream;
  ffi::ScratchAllocator* scratch;  // valid until the handler returns

  template <class B> static constexpr auto bind_ctx(B&& b) {
    return std::move(b).template Ctx<ffi::PlatformStream<cudaStream_t>>().template Ctx<ffi::ScratchAllocator>();
  }

  // Whether the stream is being captured into a CUDA graph right now.
  ffi::Error capturing(bool* out) const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    REGEMM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    *out = status != cudaStreamCaptureStatusNone;
    return ffi::Error::Success();
  }

  // `bytes` of device scratch (256-byte aligned) for this call, or null while
  // the stream is being captured (see the header comment): the caller then
  // takes its scratch-free path.
  ffi::Error scratch_for_call(size_t bytes, void** out) const {
    *out = nullptr;
    bool cap = false;
    if (auto e = capturing(&cap); e.failure()) return e;
    if (cap) g_captured_calls.fetch_add(1, std::memory_order_relaxed);
    if (cap || bytes == 0) return ffi::Error::Success();
    auto mem = scratch->Allocate(bytes + kScratchAlign, 16);
    if (!mem.has_value() || *mem == nullptr)
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "regemm: could not allocate " + std::to_string(bytes) + " bytes of scratch");
    const uintptr_t p = reinterpret_cast<uintptr_t>(*mem);
    *out = reinterpret_cast<void*>((p + kScratchAlign - 1) & ~uintptr_t(kScratchAlign - 1));
    return ffi::Error::Success();
  }
};

}  // namespace regemm
