// Test-only C API over the CUTLASS sm90 kernels (ffi/cuda/cutlass/cutlass_dispatch.h),
// so that tests/cutlass_check.py can drive them from Python (ctypes + PyTorch
// buffers) without XLA: correctness of every epilogue combination and
// per-configuration timing, independent of the FFI module.
//
//   nvcc -shared -Xcompiler -fPIC tests/cutlass_capi.cu ffi/cuda/cutlass/cutlass_dispatch.cu ffi/cuda/epilogue/epilogue_pass.cu \
//     <kernel objects> -o lib.so
#include <cuda_runtime.h>

#include <cstdio>

#include "cuda/cutlass/cutlass_dispatch.h"

using namespace regemm;
using namespace regemm::cutlass_sm90;

namespace {
// Workspace (stream-K, the f32 transpose of B), with the FFI entry's
// semantics (ffi/cuda/runtime.h: every request is served from the start):
// one buffer, allocated once and kept (tests only, so that CUDA graphs of
// these calls stay valid; the FFI entry uses the call's workspace result).
constexpr size_t kWsBytes = size_t(256) << 20;
void* g_ws = nullptr;
void* grow(void*, size_t bytes) {
  if (!g_ws && cudaMalloc(&g_ws, kWsBytes) != cudaSuccess) g_ws = nullptr;
  return g_ws && bytes <= kWsBytes ? g_ws : nullptr;
}

GemmProblem make_problem(const long long* d, const double* f) {
  GemmProblem p;
  p.dtype = DType(d[0]);
  p.m = d[1]; p.n = d[2]; p.k = d[3];
  p.trans_a = d[4]; p.trans_b = d[5];
  p.act = Act(d[6]);
  p.bias_kind = BiasKind(d[7]);
  p.has_c = d[8]; p.store_z = d[9];
  p.batch = d[10];
  p.stride_a = d[11]; p.stride_b = d[12]; p.stride_bias = d[13]; p.stride_c = d[14];
  p.exact_f32 = false;
  p.slope = f[0]; p.alpha = f[1]; p.beta = f[2];
  return p;
}
}  // namespace

extern "C" {

// d: dtype(0 f32,2 bf16,3 f16), m, n, k, trans_a, trans_b, act, bias_kind, has_c,
//    store_z, batch, stride_a, stride_b, stride_bias, stride_c
// f: slope, alpha, beta;  ptrs: a, b, bias, c, y, z
// Returns 0 on success, 1 if the kernels do not support the problem, 2 on
// error (message in err).
int regemm_cutlass_gemm(const long long* d, const double* f, void* const* ptrs, void* stream, char* err, int errlen) {
  GemmProblem p = make_problem(d, f);
  GemmOperands o{ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4], ptrs[5]};
  const DeviceInfo* dev = sm90_device();
  if (!dev || !can_run(p) || !can_launch(p, o)) return 1;
  Launch l;
  l.stream = static_cast<cudaStream_t>(stream);
  l.dev = *dev;
  l.alloc = grow;
  Status st = run(p, o, l);  // grow() keeps its buffers
  if (st.ok()) return 0;
  std::snprintf(err, errlen, "%s: %s", st.stage, st.detail ? st.detail : "");
  return 2;
}

// Name of the choice run() makes (forced or the rule's), with "+pass" when
// the activation runs as a pass of its own. (The timing tuner sits above
// this layer, in the FFI module: tuner.cu.)
const char* regemm_cutlass_config(const long long* d, const double* f) {
  const DeviceInfo* dev = sm90_device();
  if (!dev) return "none";
  return rule_choice_name(make_problem(d, f), *dev);
}

}  // extern "C"
