// GEMMs through cuBLAS: Y = alpha op(A) op(B), batched by stride, and every
// regemm problem whose epilogue cuBLASLt computes itself.
// - One cuBLASLt matmul does the whole problem where its epilogue covers it
//   (lt_epilogue): a plain GEMM (the backward's dgrad and wgrad), act none,
//   relu or gelu (cuBLASLt's GELU is the tanh form, as regemm's gelu), a
//   per-column bias, C through beta, Z for gelu (its AUX output is the GELU
//   input). XLA folds the same bias and relu into its cuBLAS GEMMs.
// - Otherwise the GEMM, then the epilogue (beta C, bias, Z, activation) as a
//   pass over Y (epilogue_pass.h). For f32 and f64 Y holds the f32/f64
//   accumulator's value in between, so the result is the fused one; this is
//   the rule's path for f32 HIGHEST and f64 (the SIMT kernel took 2.4x XLA's
//   time there). For 16-bit types Y would round twice (alpha op(A) op(B) to
//   bf16, then the result), as XLA's unfused GEMM + fusion does: the rule
//   never runs cuBLAS for their epilogues (supports()), only the tuner may.
// - Variants (for the tuner): each of these two ways with each of the
//   heuristic's first kLtAlgos algorithms; cublasGemmStridedBatchedEx where
//   cuBLASLt offers none. The rule (run_cublas) takes the first algorithm.
//
// - A cuBLASLt plan (descriptors and the heuristic's algorithms) is made on
//   first sight of a shape, layouts, alignments and epilogue and kept
//   (LtPlan), so a call costs the host one cuBLASLt call.
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

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "regemm/env.h"
#include "regemm/handlers.h"
#include "cuda/epilogue/epilogue_pass.h"
#include "cuda/pack.h"
#include "cuda/runtime.h"

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

// How many of the heuristic's algorithms the tuner may time per plan: per way
// of a GEMM; twice as many for dgrad_dact's DGELU matmul, whose best was the
// heuristic's 4th to 6th at the block's shapes on the H100.
constexpr int kLtAlgos = 4;
constexpr int kDgeluAlgos = 2 * kLtAlgos;

// The GEMM's types: storage, compute, and the scalars' (double for f64, else float).
struct Types {
  cudaDataType_t type;
  cublasComputeType_t compute;
};

bool types_of(const GemmProblem& p, Types* t) {
  switch (p.dtype) {
    case DType::kF32:
      *t = {CUDA_R_32F, p.exact_f32 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32};
      return true;
    case DType::kF64: *t = {CUDA_R_64F, CUBLAS_COMPUTE_64F}; return true;
    case DType::kBF16: *t = {CUDA_R_16BF, CUBLAS_COMPUTE_32F}; return true;
    case DType::kF16: *t = {CUDA_R_16F, CUBLAS_COMPUTE_32F}; return true;
  }
  return false;
}

// alpha and beta in the GEMM's scale type.
struct Scalars {
  double a64, b64;
  float a32, b32;
  bool f64;
  Scalars(double alpha, double beta, bool is_f64)
      : a64(alpha), b64(beta), a32(float(alpha)), b32(float(beta)), f64(is_f64) {}
  const void* alpha() const { return f64 ? static_cast<const void*>(&a64) : static_cast<const void*>(&a32); }
  const void* beta() const { return f64 ? static_cast<const void*>(&b64) : static_cast<const void*>(&b32); }
};

// Everything a cuBLASLt plan depends on (the pointers only through their
// alignment; bias, aux and C pointers are set on every call).
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

// Descriptors and the heuristic's first algorithms for one LtKey, made on
// first sight and kept for the process (like the handle): a cuBLASLt matmul
// then costs one call. Built per call, the descriptors and the heuristic
// query cost the host ~3 us (results/h100_host_cost.md), and cublasGemmEx,
// which does the same inside, ~11 us per call. No algorithms: cuBLASLt has
// none for it (the caller takes another way).
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  std::vector<cublasLtMatmulAlgo_t> algos;
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
// transposed for us, and the output's leading dimension is N. Our per-column
// bias runs along Y^T's rows: cuBLASLt's bias vector.
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

// The cuBLASLt epilogue that computes the whole problem in the matmul, if
// any: act none, relu, or gelu (not for f32 HIGHEST and f64, where the
// precise pass is the reference); a per-column bias (16-byte aligned: there
// is no alignment preference for it) or none; C through beta; Z only for gelu
// (GELU_AUX: the GELU input, bias and C included); one problem, unless a plain
// GEMM (bias, aux and C would need batch strides of their own).
bool lt_epilogue(const GemmProblem& p, const GemmOperands& o, cublasLtEpilogue_t* e) {
  if (p.is_plain_gemm()) { *e = CUBLASLT_EPILOGUE_DEFAULT; return true; }
  if (p.batch != 1 || p.dtype == DType::kF64) return false;
  const bool bias = p.bias_kind == BiasKind::kPerCol;
  if ((p.bias_kind != BiasKind::kNone && !bias) || (bias && !aligned16(o.bias))) return false;
  switch (p.act) {
    case Act::kNone:
      if (p.store_z) return false;
      *e = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
      return true;
    case Act::kRelu:
      if (p.store_z) return false;  // RELU_AUX keeps a bit mask, not Z
      *e = bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
      return true;
    case Act::kGelu:
      if (p.dtype == DType::kF32 && p.exact_f32) return false;
      if (p.store_z) {
        if (!aligned16(o.z) || p.n % 8 != 0) return false;  // AUX_LD: a multiple of 8
        *e = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      } else {
        *e = bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
      }
      return true;
    default: return false;
  }
}

// Epilogues with an aux matrix laid out as Y: Z, written (GELU_AUX) or read (DGELU).
bool has_aux(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU;
}
bool has_bias(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_RELU_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
         e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
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
  if (has_aux(epilogue)) {  // Z, laid out as Y^T (leading dimension = the column-major rows)
    const int64_t ld = key.ldc;
    REGEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld));
  }
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
  cublasLtMatmulHeuristicResult_t h[kDgeluAlgos];
  const int want = epilogue == CUBLASLT_EPILOGUE_DGELU ? kDgeluAlgos : kLtAlgos;
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt, plan->op, plan->a, plan->b, plan->d, plan->d, pref, want, h, &found);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) return ffi::Error::Success();
  REGEMM_CUBLAS_CHECK(st);
  for (int i = 0; i < found; ++i)
    if (h[i].state == CUBLAS_STATUS_SUCCESS) plan->algos.push_back(h[i].algo);
  return ffi::Error::Success();
}

// The plan for one matmul (made once; kept for the process), or null when
// making it failed (*err says why). Under the device's lock.
const LtPlan* plan_for(DeviceHandle& dh, const GemmProblem& p, const GemmOperands& o, const Types& t,
                       cublasLtEpilogue_t epilogue, bool with_c, size_t workspace_bytes, ffi::Error* err) {
  if (p.batch > 0x7fffffff) return nullptr;  // cuBLASLt's batch count is an int32
  const ColMajorGemm g = col_major(p, o);
  uint32_t align_c = alignment(g.c);
  if (with_c) align_c = std::min(align_c, alignment(o.c));
  if (has_aux(epilogue)) align_c = std::min(align_c, alignment(o.z));
  const LtKey key{int(t.compute), int(t.type), int(epilogue), g.op_a == CUBLAS_OP_T, g.op_b == CUBLAS_OP_T,
                  g.m, g.n, g.k, g.lda, g.ldb, g.ldc, p.batch, g.stride_a, g.stride_b, g.stride_c,
                  alignment(g.a), alignment(g.b), align_c, uint64_t(workspace_bytes)};
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

// ---------------------------------------------------------------------------
// The ways to run a problem. Variant v: way v / kLtAlgos with the heuristic's
// algorithm v % kLtAlgos; kGemmEx alone.
// ---------------------------------------------------------------------------
enum Way : int {
  kLtFused = 0,  // one matmul with the epilogue lt_epilogue() gives (a plain GEMM: none)
  kLtPass = 1,   // the matmul, then the epilogue as a pass (not for plain GEMMs)
  kGemmEx = 2,   // cublasGemmStridedBatchedEx (+ the pass): where cuBLASLt has no algorithm
};
constexpr int kNumVariants = 2 * kLtAlgos + 1;

// What a call needs: the device's handle (locked by the caller), types, workspace.
struct Call {
  DeviceHandle* dh;
  Types t;
  void* workspace;
  size_t workspace_bytes;
};

ffi::Error prepare(const GemmProblem& p, CudaRuntime& rt, Call* c) {
  if (!types_of(p, &c->t)) return bad("cuBLAS GEMM: unsupported dtype");
  // Up to a library GEMM's workspace, as much as the call has (less where the
  // lowering sized it by the problem, workspace.h); null: zero-size workspace.
  c->workspace_bytes = std::min(kGemmWorkspaceBytes, rt.capacity());
  c->workspace = rt.take(c->workspace_bytes);
  if (!c->workspace) c->workspace_bytes = 0;
  return device_handle(&c->dh);
}

// kLtPass where Z is kept: the matmul writes Z itself, its per-column bias
// (cuBLASLt's BIAS epilogue) and C (beta) included, and the pass reads Z and
// writes Y alone: two M x N passes where reading Y and writing Z and Y took
// three (8192x8192 f32 gelu: 205 us for the three, results/h200_block.md). Not
// for f64 (lt_epilogue has no epilogues there) nor batches (bias and C would
// need batch strides of their own).
bool matmul_into_z(const GemmProblem& p, const GemmOperands& o) {
  if (!p.store_z || p.is_plain_gemm() || p.dtype == DType::kF64 || p.batch != 1) return false;
  return p.bias_kind == BiasKind::kNone || (p.bias_kind == BiasKind::kPerCol && aligned16(o.bias));
}

// The matmul of `way` for p: its epilogue, its operands (D is Y, or Z where
// matmul_into_z: into_z) and whether it adds C; false where the way does not
// apply.
struct LtCall {
  cublasLtEpilogue_t epilogue;
  GemmOperands o;
  bool with_c;
  bool into_z = false;
};
bool lt_call(const GemmProblem& p, const GemmOperands& o, Way way, LtCall* c) {
  c->o = o;
  if (way == kLtFused) {
    c->with_c = p.uses_c();
    return lt_epilogue(p, o, &c->epilogue);
  }
  if (way != kLtPass || p.is_plain_gemm()) return false;
  c->into_z = matmul_into_z(p, o);
  c->epilogue = c->into_z && p.bias_kind == BiasKind::kPerCol ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  c->with_c = c->into_z && p.uses_c();
  if (c->into_z) c->o.y = o.z;
  return true;
}

// Runs the epilogue pass after a matmul into Y, or into Z (from_z: bias and C
// in it). The activation's math as the fused CUTLASS epilogue computes it
// (FastMath) wherever the GEMM is on tensor cores, whose outputs carry 16-bit
// or TF32 rounding anyway (the f32 gelu pass over 8192x8192 was bound by the
// precise exp and division, results/h200_block.md); precise for f32 HIGHEST
// and f64, where the pass is the reference.
ffi::Error pass_after(const GemmProblem& p, const GemmOperands& o, CudaRuntime& rt, bool from_z = false) {
  if (p.is_plain_gemm()) return ffi::Error::Success();
  const bool fast = p.dtype == DType::kBF16 || p.dtype == DType::kF16 || (p.dtype == DType::kF32 && !p.exact_f32);
  if (const char* err = epilogue_pass(p, o, /*with_bias_c=*/!from_z, fast, rt.stream, from_z))
    return ffi::Error::Internal(std::string("regemm: CUDA error from the epilogue pass launch: ") + err);
  ++rt.ops;
  return ffi::Error::Success();
}

// One cuBLASLt matmul with `epilogue` (its bias and aux pointers: o.bias and
// o.z) and the heuristic's algorithm `algo`; *ran false where the plan has no
// such algorithm.
ffi::Error lt_matmul(const GemmProblem& p, const GemmOperands& o, cublasLtEpilogue_t epilogue, bool with_c, int algo,
                     const Call& c, CudaRuntime& rt, bool* ran) {
  *ran = false;
  ffi::Error err = ffi::Error::Success();
  const LtPlan* plan = plan_for(*c.dh, p, o, c.t, epilogue, with_c, c.workspace_bytes, &err);
  if (!plan) return err;
  if (algo >= int(plan->algos.size())) return ffi::Error::Success();
  if (has_bias(epilogue)) {
    const void* bias = o.bias;
    REGEMM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  }
  if (has_aux(epilogue)) {
    void* aux = o.z;
    REGEMM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
  }
  const ColMajorGemm g = col_major(p, o);
  const Scalars ab(p.alpha, with_c ? p.beta : 0.0, c.t.type == CUDA_R_64F);
  host_mark(HostPhase::kLaunch);
  REGEMM_CUBLAS_CHECK(cublasLtMatmul(c.dh->lt, plan->op, ab.alpha(), g.a, plan->a, g.b, plan->b, ab.beta(),
                                     with_c ? o.c : g.c, plan->d, g.c, plan->d, &plan->algos[algo], c.workspace,
                                     c.workspace_bytes, rt.stream));
  ++rt.ops;
  *ran = true;
  return ffi::Error::Success();
}

// One cuBLASLt matmul of `way` with the heuristic's algorithm `algo` (and
// the pass, for kLtPass); *ran false where the plan has no such algorithm.
ffi::Error run_lt(const GemmProblem& p, const GemmOperands& o, Way way, int algo, const Call& c, CudaRuntime& rt,
                  bool* ran) {
  *ran = false;
  LtCall call;
  if (!lt_call(p, o, way, &call)) return ffi::Error::Success();
  if (auto e = lt_matmul(p, call.o, call.epilogue, call.with_c, algo, c, rt, ran); e.failure() || !*ran) return e;
  return way == kLtPass ? pass_after(p, o, rt, /*from_z=*/call.into_z) : ffi::Error::Success();
}

// cublasGemmStridedBatchedEx picks its own algorithm; then the pass.
ffi::Error run_gemm_ex(const GemmProblem& p, const GemmOperands& o, const Call& c, CudaRuntime& rt) {
  const Scalars ab(p.alpha, 0.0, c.t.type == CUDA_R_64F);
  // SetStream resets the workspace to cuBLAS's own pool, so it goes first.
  REGEMM_CUBLAS_CHECK(cublasSetStream(c.dh->handle, rt.stream));
  REGEMM_CUBLAS_CHECK(cublasSetWorkspace(c.dh->handle, c.workspace, c.workspace_bytes));
  const ColMajorGemm g = col_major(p, o);
  host_mark(HostPhase::kLaunch);
  REGEMM_CUBLAS_CHECK(cublasGemmStridedBatchedEx_64(c.dh->handle, g.op_a, g.op_b, g.m, g.n, g.k, ab.alpha(),
                                                    g.a, c.t.type, g.lda, g.stride_a,
                                                    g.b, c.t.type, g.ldb, g.stride_b, ab.beta(),
                                                    g.c, c.t.type, g.ldc, g.stride_c,
                                                    p.batch, c.t.compute, CUBLAS_GEMM_DEFAULT));
  ++rt.ops;
  return pass_after(p, o, rt);
}

// The rule: the fused matmul where it applies, else the matmul and the pass,
// each with the heuristic's first algorithm; cublasGemmEx where cuBLASLt has none.
ffi::Error run_cublas(const GemmProblem& p, const GemmOperands& o, CudaRuntime& rt) {
  Call c;
  if (auto e = prepare(p, rt, &c); e.failure()) return e;
  std::lock_guard<std::mutex> lock(c.dh->mu);
  for (Way way : {kLtFused, kLtPass}) {
    bool ran = false;
    if (auto e = run_lt(p, o, way, 0, c, rt, &ran); e.failure() || ran) return e;
  }
  return run_gemm_ex(p, o, c, rt);
}

void variants(const GemmProblem& p, const GemmOperands& o, CudaRuntime& rt, std::vector<std::string>* names) {
  if (p.k == 0) return;
  Call c;
  if (prepare(p, rt, &c).failure()) return;
  std::lock_guard<std::mutex> lock(c.dh->mu);
  names->assign(kNumVariants, "");
  bool any_lt = false;
  for (Way way : {kLtFused, kLtPass}) {
    LtCall call;
    if (!lt_call(p, o, way, &call)) continue;
    ffi::Error err = ffi::Error::Success();
    const LtPlan* plan = plan_for(*c.dh, p, call.o, c.t, call.epilogue, call.with_c, c.workspace_bytes, &err);
    const int n = plan ? std::min(int(plan->algos.size()), kLtAlgos) : 0;
    for (int i = 0; i < n; ++i)
      (*names)[way * kLtAlgos + i] = std::string(way == kLtFused ? "lt" : "lt+pass") + "#" + std::to_string(i);
    any_lt = any_lt || n > 0;
  }
  if (!any_lt) (*names)[kNumVariants - 1] = p.is_plain_gemm() ? "gemmex" : "gemmex+pass";
}

ffi::Error run_variant(const GemmProblem& p, const GemmOperands& o, CudaRuntime& rt, int v) {
  Call c;
  if (auto e = prepare(p, rt, &c); e.failure()) return e;
  std::lock_guard<std::mutex> lock(c.dh->mu);
  if (v == kNumVariants - 1) return run_gemm_ex(p, o, c, rt);
  bool ran = false;
  if (auto e = run_lt(p, o, Way(v / kLtAlgos), v % kLtAlgos, c, rt, &ran); e.failure()) return e;
  return ran ? ffi::Error::Success() : bad("cuBLAS: no such algorithm for this problem");
}

// The rule's cuBLAS problems: plain GEMMs, and f32 and f64 problems (the
// pass keeps their accumulator); K > 0 (K = 0 needs Y = act(beta C + bias),
// which the SIMT kernel writes). Above the SIMT fallback, below the fused
// CUTLASS kernels. 16-bit problems with an epilogue reach cuBLAS only through
// the tuner (variants).
bool supports(const GemmProblem& p) {
  return p.k > 0 && (p.is_plain_gemm() || p.dtype == DType::kF32 || p.dtype == DType::kF64);
}

// run_cublas takes the first of the ways variants() lists (no rule_way).
const Register<GemmProblem, GemmOperands, CudaRuntime> kRegister(
    {"cublas", 10, supports, run_cublas, variants, run_variant});

// ---------------------------------------------------------------------------
// regemm_dgrad_dact with cuBLASLt's DGELU epilogue: gZ = (alpha op(A) op(B))
// gelu'(Z) in the matmul, Z read as its aux matrix (the GELU input, what
// GELU_AUX keeps: the same tanh GELU as regemm's gelu), then the bias
// gradient, where there is one, by the dact pass with act none over gZ (which
// then reads gZ only). DGELU_BGRAD, which reduces the bias gradient in the
// matmul, ran 1.8-4.9x the plain GEMM's time on the H100; DGELU 1.1-1.7x, against
// the dact pass's three M x N passes (benchmarks/results/h100_dgrad_dact_cublaslt.md).
// For 16-bit types: with TF32, DGELU took 1.5-3.3x the plain GEMM.
//
// Ways (the tuner times them): 0 the composed way (the handler's own: the GEMM
// into gZ's buffer, then the dact pass in place), 1 + i the DGELU matmul with
// the heuristic's algorithm i. The rule, untimed, is the composed way: the
// heuristic's first algorithm was 2.6x slower than its best at 8192x4096x1024.
//
// Only where gZ is larger than the L2 cache. The tuner times each way from a
// cold cache; inside a program the composed way's pass finds the GEMM's output
// in L2 when it fits there, and then wins: with the DGELU way on at every size,
// the training steps with gZ of 16 and 32 MB (8192x1024x4 and 32768x512x12 bf16
// gelu) ran 8% and 4% slower, where the block's 64-128 MB gZ ran faster.
// ---------------------------------------------------------------------------
enum DgradWay : int { kComposed = 0, kDgelu = 1 };

// The current device's L2 cache in bytes (read once per process: the first
// device's, as a bound for all).
int64_t l2_bytes() {
  static const int64_t bytes = [] {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();
    return int64_t(l2_cache_bytes(device));
  }();
  return bytes;
}

// cuBLASLt's DGELU matmul applies: 16-bit gelu from Z, gZ past the L2 cache
// (above), no batch, the aux row length a multiple of 8.
bool dgelu_applies(const DgradDactProblem& q) {
  const GemmProblem& p = q.gemm;
  return (p.dtype == DType::kBF16 || p.dtype == DType::kF16) && q.dact.act == Act::kGelu && !q.dact.from_y &&
         (q.dact.bias_kind == BiasKind::kNone || q.dact.bias_kind == BiasKind::kPerCol) && p.batch == 1 &&
         p.m > 0 && p.k > 0 && p.n % 8 == 0 &&  // AUX_LD: a multiple of 8
         p.m * p.n * dtype_size(p.dtype) > l2_bytes();
}

bool supports_dgrad_dact(const DgradDactProblem& q) {
  if (backend_forced_elsewhere("cublas") || env_off("REGEMM_FUSED_DGRAD")) return false;
  return dgelu_applies(q);
}

ffi::Error run_dgelu(const DgradDactProblem& q, const DgradDactOperands& o, int algo, CudaRuntime& rt) {
  if (!aligned16(o.s) || !aligned16(o.gz)) return bad("cuBLASLt DGELU: Z and gZ must be 16-byte aligned");
  const GemmOperands go = gemm_operands_with_s(o);  // aux: read only (DGELU)
  {
    Call c;
    if (auto e = prepare(q.gemm, rt, &c); e.failure()) return e;
    std::lock_guard<std::mutex> lock(c.dh->mu);
    bool ran = false;
    if (auto e = lt_matmul(q.gemm, go, CUBLASLT_EPILOGUE_DGELU, false, algo, c, rt, &ran); e.failure()) return e;
    if (!ran) return bad("cuBLAS: no such algorithm for this problem");
  }
  return bias_grad_from_gz(q, o, rt);
}

// The composed way always (the tuner times it against the CUTLASS entry's
// fused way too, cutlass_registry.cu), and the DGELU ways where they apply;
// none where REGEMM_FUSED_DGRAD=1 forces the fused way, or =0 the composed one
// (the rule, untimed).
void dgrad_dact_variants(const DgradDactProblem& q, const DgradDactOperands& o, CudaRuntime& rt,
                         std::vector<std::string>* names) {
  if (env_on("REGEMM_FUSED_DGRAD") || env_off("REGEMM_FUSED_DGRAD")) return;
  names->assign(1, "composed");
  Call c;
  if (!dgelu_applies(q) || !aligned16(o.s) || !aligned16(o.gz) || prepare(q.gemm, rt, &c).failure()) return;
  std::lock_guard<std::mutex> lock(c.dh->mu);
  const GemmOperands go = gemm_operands_with_s(o);
  ffi::Error err = ffi::Error::Success();
  const LtPlan* plan = plan_for(*c.dh, q.gemm, go, c.t, CUBLASLT_EPILOGUE_DGELU, false, c.workspace_bytes, &err);
  if (!plan || plan->algos.empty()) return;
  names->resize(kDgelu + plan->algos.size());
  for (size_t i = 0; i < plan->algos.size(); ++i) (*names)[kDgelu + i] = "dgelu#" + std::to_string(i);
}

ffi::Error run_dgrad_dact_variant(const DgradDactProblem& q, const DgradDactOperands& o, CudaRuntime& rt, int v) {
  return v == kComposed ? dgrad_then_dact(q, o, rt) : run_dgelu(q, o, v - kDgelu, rt);
}

// Its rule, the composed way, is the first way it lists (no rule_way).
const Register<DgradDactProblem, DgradDactOperands, CudaRuntime> kRegisterDgradDact(
    {"cublas", 10, supports_dgrad_dact, dgrad_then_dact<CudaRuntime>, dgrad_dact_variants, run_dgrad_dact_variant});

}  // namespace
}  // namespace regemm
