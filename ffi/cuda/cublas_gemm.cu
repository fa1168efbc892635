// GEMMs through cuBLAS: Y = alpha op(A) op(B), batched by stride.
// - The plain GEMMs of the backward pass (dgrad, wgrad: act none, no bias,
//   no C, no Z), every dtype.
// - f32 and f64 regemm problems (the forward at precision=HIGHEST, f64, and
//   f32 that the CUTLASS kernels cannot take): the GEMM, then the epilogue
//   (beta C, bias, Z, activation) as a pass over Y (epilogue_pass.h). Y holds
//   the f32/f64 accumulator's value in between, so the result is the fused
//   one. The pass costs a read and a write of Y (~7 us, 8% of a 2048x1024x1024
//   f32 GEMM at 51 TFLOP/s); the SIMT kernel took 2.4x XLA's time there.
//   16-bit types stay with the fused kernels: their Y would round twice.
//   f32 act none/relu with a per-column bias (the plain dense layer) runs as
//   one cuBLASLt matmul with its BIAS / RELU_BIAS epilogue instead, where
//   cuBLASLt has an algorithm for it: XLA folds that bias into its GEMM too.
//
// - The GEMM is a cuBLASLt matmul whose plan (descriptors and the heuristic's
//   algorithm) is made on first sight of its shape and kept (LtPlan), so a
//   call costs the host one cuBLASLt call; cublasGemmStridedBatchedEx, which
//   builds all of that on every call, is the fallback where cuBLASLt offers
//   no algorithm.
// - One cuBLAS and one cuBLASLt handle per device, created on first use and
//   kept for the life of the process (destroying them at exit races the CUDA
//   runtime's own teardown), with the plans. A handle is not safe to use from
//   two threads at once, and stream and workspace are cuBLAS handle state, so
//   every call runs under the device's mutex (host-side only: nothing waits
//   on the GPU).
// - Workspace: the call's workspace buffer (workspace.h), also under CUDA-graph
//   capture, so cuBLAS never falls back to its own pool (which in a graph would
//   need memory nodes, unsupported in the child graphs XLA builds). Should it
//   be missing, cuBLAS gets an explicit zero-size workspace and picks
//   algorithms that need none.
// - f32 uses TF32 tensor cores unless exact_f32 (precision=HIGHEST), as XLA's
//   own dots do; bf16/f16 accumulate in f32, and reduced-precision split-K
//   reductions are ruled out (plan preference; handle math mode) so that the
//   f32 accumulation is kept.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "../regemm/handlers.h"
#include "epilogue_pass.h"
#include "runtime.h"

namespace regemm {
namespace {

ffi::Error cublas_error(cublasStatus_t s, const char* what, const char* file, int line) {
  return ffi::Error::Internal(std::string("regemm: cuBLAS error ") + cublasGetStatusName(s) + " (" +
                              cublasGetStatusString(s) + ") from " + what + " at " + file + ":" +
                              std::to_string(line));
}

#define REGEMM_CUBLAS_CHECK(expr)                                                \
  do {                                                                           \
    const cublasStatus_t regemm_st_ = (expr);                                    \
    if (regemm_st_ != CUBLAS_STATUS_SUCCESS)                                     \
      return cublas_error(regemm_st_, #expr, __FILE__, __LINE__);                \
  } while (0)

// The largest power of two (up to 256) that divides the address: cuBLASLt's
// algorithms may assume the alignment they are told, so tell the truth.
uint32_t alignment(const void* ptr) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
  uint32_t al = 256;
  while (al > 1 && (a & (al - 1))) al /= 2;
  return al;
}

// alpha, and beta = 0, in the GEMM's scale type: double for f64, else float.
struct Scalars {
  double a64, b64 = 0.0;
  float a32, b32 = 0.0f;
  bool f64;
  Scalars(double alpha, bool is_f64) : a64(alpha), a32(float(alpha)), f64(is_f64) {}
  const void* alpha() const { return f64 ? static_cast<const void*>(&a64) : static_cast<const void*>(&a32); }
  const void* beta() const { return f64 ? static_cast<const void*>(&b64) : static_cast<const void*>(&b32); }
};

// Everything a cuBLASLt plan depends on (the pointers only through their
// alignment; the bias pointer is set on every call).
struct LtKey {
  int compute, type, epilogue;
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
  uint32_t align_a, align_b, align_c;
  uint64_t workspace;
  auto tie() const {
    return std::tie(compute, type, epilogue, ta, tb, m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c,
                    align_a, align_b, align_c, workspace);
  }
  bool operator<(const LtKey& o) const { return tie() < o.tie(); }
};

// Descriptors and the heuristic's algorithm for one LtKey, made on first
// sight and kept for the process (like the handle): a cuBLASLt matmul then
// costs one call. Built per call, the descriptors and the heuristic query
// cost the host ~3 us (results/h100_host_cost.md), and cublasGemmEx, which
// does the same inside, ~11 us per call. algo_ok false: cuBLASLt has no
// algorithm (the caller takes another way).
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo;
  bool algo_ok = false;
};

struct DeviceHandle {
  std::mutex mu;  // guards the handle's stream/workspace state and the plans across calls
  cublasHandle_t handle = nullptr;
  cublasLtHandle_t lt = nullptr;
  std::map<LtKey, LtPlan> plans;
};

ffi::Error create_handle(cublasHandle_t* out, cublasLtHandle_t* lt) {
  // The first call may come while XLA is capturing a CUDA graph on this
  // thread; creating a handle allocates memory, which strict capture modes
  // forbid. Relaxed mode for the duration is the documented way to
  // initialise a library lazily under capture (nothing is enqueued here).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  REGEMM_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  cublasStatus_t created = cublasCreate(out);
  if (created == CUBLAS_STATUS_SUCCESS) created = cublasLtCreate(lt);
  const cudaError_t restored = cudaThreadExchangeStreamCaptureMode(&mode);
  REGEMM_CUBLAS_CHECK(created);
  REGEMM_CUDA_CHECK(restored);
  REGEMM_CUBLAS_CHECK(
      cublasSetMathMode(*out, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  return ffi::Error::Success();
}

// The current device's handle (XLA runs the handler with its device current).
ffi::Error device_handle(DeviceHandle** out) {
  static std::mutex mu;
  static auto* handles = new std::unordered_map<int, std::unique_ptr<DeviceHandle>>();  // never freed: see top
  int device = 0;
  REGEMM_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = (*handles)[device];
  if (!slot) {
    auto h = std::make_unique<DeviceHandle>();
    if (auto e = create_handle(&h->handle, &h->lt); e.failure()) return e;
    slot = std::move(h);
  }
  *out = slot.get();
  return ffi::Error::Success();
}

// The one place where row-major meets column-major. cuBLAS is column-major;
// a row-major [R, C] matrix is the same memory as a column-major [C, R] one
// with the same leading dimension. So the row-major Y[M,N] = op(A) op(B) is
// the column-major Y^T[N,M] = op(B)^T op(A)^T: B becomes cuBLAS's first
// operand and A its second, each transposed for cuBLAS exactly when it was
// transposed for us, and the output's leading dimension is N.
struct ColMajorGemm {
  cublasOperation_t op_a, op_b;
  int64_t m, n, k;
  const void* a;
  int64_t lda, stride_a;
  const void* b;
  int64_t ldb, stride_b;
  void* c;
  int64_t ldc, stride_c;
};

ColMajorGemm col_major(const GemmProblem& p, const GemmOperands& o) {
  return ColMajorGemm{p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                      p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                      p.n, p.m, p.k,
                      o.b, p.ldb(), p.stride_b,
                      o.a, p.lda(), p.stride_a,
                      o.y, p.n, p.m * p.n};
}

// cuBLASLt's fused epilogue covers Y = act(alpha op(A) op(B) + bias) for
// these: f32, act none or relu, a per-column bias (cuBLASLt's per-row bias of
// the column-major Y^T), no C, no Z, one problem.
bool lt_bias_fits(const GemmProblem& p) {
  return p.dtype == DType::kF32 && p.batch == 1 && p.bias_kind == BiasKind::kPerCol &&
         (p.act == Act::kNone || p.act == Act::kRelu) && !(p.has_c && p.beta != 0.0) && !p.store_z;
}

ffi::Error set_batch(cublasLtMatrixLayout_t l, int64_t batch, int64_t stride) {
  if (batch == 1) return ffi::Error::Success();
  const int32_t count = int32_t(batch);
  REGEMM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
  REGEMM_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
  return ffi::Error::Success();
}

ffi::Error make_plan(cublasLtHandle_t lt, const LtKey& key, LtPlan* plan) {
  const auto compute = cublasComputeType_t(key.compute);
  const auto type = cudaDataType_t(key.type);
  const cudaDataType_t scale = type == CUDA_R_64F ? CUDA_R_64F : CUDA_R_32F;
  REGEMM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, compute, scale));
  const cublasOperation_t op_a = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  REGEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
  REGEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
  const auto epilogue = cublasLtEpilogue_t(key.epilogue);
  REGEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
  // Layouts as stored (rows x cols of the column-major matrix, before op).
  REGEMM_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->a, type, key.ta ? key.k : key.m, key.ta ? key.m : key.k, key.lda));
  REGEMM_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->b, type, key.tb ? key.n : key.k, key.tb ? key.k : key.n, key.ldb));
  REGEMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, type, key.m, key.n, key.ldc));
  if (auto e = set_batch(plan->a, key.batch, key.stride_a); e.failure()) return e;
  if (auto e = set_batch(plan->b, key.batch, key.stride_b); e.failure()) return e;
  if (auto e = set_batch(plan->d, key.batch, key.stride_c); e.failure()) return e;

  cublasLtMatmulPreference_t pref = nullptr;
  REGEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  std::unique_ptr<void, void (*)(void*)> pref_guard(
      pref, [](void* q) { cublasLtMatmulPreferenceDestroy(static_cast<cublasLtMatmulPreference_t>(q)); });
  REGEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &key.workspace, sizeof key.workspace));
  // Split-K partial sums stay in the compute type (f32 for the 16-bit types),
  // as the handle's CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION asks of cublasGemmEx.
  const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_MASK & ~uint32_t(CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE);
  REGEMM_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes));
  REGEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                           &key.align_a, sizeof key.align_a));
  REGEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                           &key.align_b, sizeof key.align_b));
  REGEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                           &key.align_c, sizeof key.align_c));
  REGEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                           &key.align_c, sizeof key.align_c));
  cublasLtMatmulHeuristicResult_t h;
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt, plan->op, plan->a, plan->b, plan->d, plan->d, pref, 1, &h, &found);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && found == 0)) return ffi::Error::Success();
  REGEMM_CUBLAS_CHECK(st);
  plan->algo = h.algo;
  plan->algo_ok = true;
  return ffi::Error::Success();
}

// The plan for key (made once; kept for the process), or null when making it
// failed (*err says why).
const LtPlan* plan_for(DeviceHandle& dh, const LtKey& key, ffi::Error* err) {
  auto it = dh.plans.find(key);
  if (it != dh.plans.end()) return &it->second;
  LtPlan plan;
  if (auto e = make_plan(dh.lt, key, &plan); e.failure()) {
    if (plan.d) cublasLtMatrixLayoutDestroy(plan.d);
    if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
    if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
    if (plan.op) cublasLtMatmulDescDestroy(plan.op);
    *err = std::move(e);
    return nullptr;
  }
  return &dh.plans.emplace(key, plan).first->second;
}

// Y = epilogue(alpha op(A) op(B) [+ bias]) as one cuBLASLt matmul; *ran false
// when cuBLASLt has no algorithm for it (the caller then takes cublasGemmEx).
ffi::Error run_lt(const GemmProblem& p, const GemmOperands& o, cublasComputeType_t compute, cudaDataType_t type,
                  cublasLtEpilogue_t epilogue, DeviceHandle& dh, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream, bool* ran) {
  *ran = false;
  if (p.batch > 0x7fffffff) return ffi::Error::Success();  // cuBLASLt's batch count is an int32
  const ColMajorGemm g = col_major(p, o);
  const LtKey key{int(compute), int(type), int(epilogue), g.op_a == CUBLAS_OP_T, g.op_b == CUBLAS_OP_T,
                  g.m, g.n, g.k, g.lda, g.ldb, g.ldc, p.batch, g.stride_a, g.stride_b, g.stride_c,
                  alignment(g.a), alignment(g.b), alignment(g.c), workspace ? uint64_t(workspace_bytes) : 0};
  ffi::Error err = ffi::Error::Success();
  const LtPlan* plan = plan_for(dh, key, &err);
  if (!plan) return err;
  if (!plan->algo_ok) return ffi::Error::Success();
  if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    const void* bias = o.bias;
    REGEMM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  }
  const Scalars ab(p.alpha, type == CUDA_R_64F);
  REGEMM_CUBLAS_CHECK(cublasLtMatmul(dh.lt, plan->op, ab.alpha(), g.a, plan->a, g.b, plan->b, ab.beta(), g.c,
                                     plan->d, g.c, plan->d, &plan->algo, workspace, key.workspace, stream));
  *ran = true;
  return ffi::Error::Success();
}

ffi::Error run_cublas(const GemmProblem& p, const GemmOperands& o, CudaRuntime& rt) {
  cudaDataType_t type;
  cublasComputeType_t compute;
  switch (p.dtype) {
    case DType::kF32:
      type = CUDA_R_32F;
      compute = p.exact_f32 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
      break;
    case DType::kF64: type = CUDA_R_64F; compute = CUBLAS_COMPUTE_64F; break;
    case DType::kBF16: type = CUDA_R_16BF; compute = CUBLAS_COMPUTE_32F; break;
    case DType::kF16: type = CUDA_R_16F; compute = CUBLAS_COMPUTE_32F; break;
    default: return bad("cuBLAS GEMM: unsupported dtype");
  }
  void* workspace = rt.take(kGemmWorkspaceBytes);  // null: zero-size workspace

  DeviceHandle* dh = nullptr;
  if (auto e = device_handle(&dh); e.failure()) return e;
  std::lock_guard<std::mutex> lock(dh->mu);
  // The bias (and relu) in cuBLASLt's epilogue where it fits; the bias
  // pointer must be 16-byte aligned (there is no alignment preference for it).
  const bool lt_bias = lt_bias_fits(p) && alignment(o.bias) >= 16;
  const cublasLtEpilogue_t epilogue = p.act == Act::kRelu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
  bool ran = false;
  if (lt_bias) {  // done, unless cuBLASLt has no algorithm with the bias epilogue: then the GEMM and the pass
    if (auto e = run_lt(p, o, compute, type, epilogue, *dh, workspace, kGemmWorkspaceBytes, rt.stream, &ran);
        e.failure())
      return e;
    if (ran) return ffi::Error::Success();
  }
  if (auto e = run_lt(p, o, compute, type, CUBLASLT_EPILOGUE_DEFAULT, *dh, workspace, kGemmWorkspaceBytes,
                      rt.stream, &ran);
      e.failure())
    return e;
  if (!ran) {  // no cuBLASLt algorithm at all: cublasGemmEx picks its own
    const Scalars ab(p.alpha, type == CUDA_R_64F);
    // SetStream resets the workspace to cuBLAS's own pool, so it goes first.
    REGEMM_CUBLAS_CHECK(cublasSetStream(dh->handle, rt.stream));
    REGEMM_CUBLAS_CHECK(cublasSetWorkspace(dh->handle, workspace, workspace ? kGemmWorkspaceBytes : 0));
    const ColMajorGemm g = col_major(p, o);
    REGEMM_CUBLAS_CHECK(cublasGemmStridedBatchedEx_64(dh->handle, g.op_a, g.op_b, g.m, g.n, g.k, ab.alpha(),
                                                      g.a, type, g.lda, g.stride_a,
                                                      g.b, type, g.ldb, g.stride_b, ab.beta(),
                                                      g.c, type, g.ldc, g.stride_c,
                                                      p.batch, compute, CUBLAS_GEMM_DEFAULT));
  }
  if (p.is_plain_gemm()) return ffi::Error::Success();
  if (const char* err = epilogue_pass(p, o, /*with_bias_c=*/true, /*fast_math=*/false, rt.stream))
    return ffi::Error::Internal(std::string("regemm: CUDA error from the epilogue pass launch: ") + err);
  return ffi::Error::Success();
}

// Plain GEMMs, and f32/f64 problems with an epilogue; K > 0 (K = 0 needs
// Y = act(beta C + bias), which the SIMT kernel writes). Above the SIMT
// fallback.
bool supports(const GemmProblem& p) {
  return p.k > 0 && (p.is_plain_gemm() || p.dtype == DType::kF32 || p.dtype == DType::kF64);
}

const Register<GemmProblem, GemmOperands, CudaRuntime> kRegister({"cublas", 10, supports, run_cublas});

}  // namespace
}  // namespace regemm
