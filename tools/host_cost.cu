// Host cost per call of what a regemm handler does (no GPU work to speak of,
// or small kernels): where the microseconds of an uncaptured custom call go.
//  1. The CUDA calls one by one (2000 calls, mean).
//  2. The GEMM paths outside XLA (200 calls back to back, below the launch
//     queue's depth, mean): the CUTLASS dispatch (run(): the rule's choice,
//     then the kernel's argument setup and launch), each CUTLASS kernel entry
//     alone, and cuBLAS's two APIs for the plain backward GEMMs
//     (cublasGemmStridedBatchedEx as the handler calls it, against
//     cublasLtMatmul with descriptors and algorithm made once).
//  3. The same pieces one call at a time with the host's caches cold (64 MiB
//     written and 1 ms asleep before each call, median of 40): inside XLA a
//     handler runs after other thunks' work, and tools/host_timeline.py
//     read 35-70 us from our CUTLASS launch call where 2. reads at most 13.
//  4. cublasLtMatmul's host time (the backward's dgrad of 4096x4096x1024) right
//     after one launch of something else, the GPU busy with it: inside XLA the
//     silu layer's dgrad call took ~19 us longer before its launch than the
//     relu layer's, whose forward was a cuBLASLt kernel and not CUTLASS's.
//
//   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -Iffi -Iffi/cuda/cutlass tools/host_cost.cu ffi/cuda/cutlass/cutlass_dispatch.cu ffi/cuda/epilogue/epilogue_pass.cu \
//     .cutlass_prebuilt/cutlass_*.o -lcublas -lcublasLt -o /tmp/host_cost && /tmp/host_cost
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda/cutlass/cutlass_dispatch.h"

using namespace regemm;
using namespace regemm::cutlass_sm90;

namespace {

__global__ void empty_kernel(int) {}

template <class F>
void time_it(int n, const char* what, F f) {
  for (int i = 0; i < n / 10; ++i) f();
  cudaDeviceSynchronize();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  auto t1 = std::chrono::steady_clock::now();
  cudaDeviceSynchronize();
  const cudaError_t e = cudaGetLastError();
  printf("%8.2f us  %s%s%s\n", std::chrono::duration<double, std::micro>(t1 - t0).count() / n, what,
         e == cudaSuccess ? "" : "  CUDA error: ", e == cudaSuccess ? "" : cudaGetErrorString(e));
}

// One call at a time after the host's caches were overwritten and the thread
// slept: the median time of f() alone.
template <class F>
void time_cold(const char* what, F f) {
  static std::vector<char> junk(size_t(64) << 20);
  constexpr int n = 40;
  std::vector<double> us(n);
  f();
  cudaDeviceSynchronize();
  for (int i = 0; i < n; ++i) {
    std::memset(junk.data(), i, junk.size());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto t0 = std::chrono::steady_clock::now();
    f();
    us[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    cudaDeviceSynchronize();
  }
  std::sort(us.begin(), us.end());
  const cudaError_t e = cudaGetLastError();
  printf("%8.2f us  (cold; min %.2f, max %.2f)  %s%s%s\n", us[n / 2], us[0], us[n - 1], what,
         e == cudaSuccess ? "" : "  CUDA error: ", e == cudaSuccess ? "" : cudaGetErrorString(e));
}

// A kernel with a parameter block the size of a CUTLASS sm90 GEMM's (TMA
// descriptors and all), to tell the launch's cost from CUTLASS's setup.
struct BigParams {
  char bytes[1024];
};
__global__ void big_params_kernel(BigParams) {}

void cuda_calls(cudaStream_t s, void* buf) {
  time_it(2000, "cudaGetDevice", [] { int d; cudaGetDevice(&d); });
  time_it(2000, "cudaStreamIsCapturing", [&] { cudaStreamCaptureStatus c; cudaStreamIsCapturing(s, &c); });
  time_it(2000, "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)", [] {
    void* p; cudaDriverEntryPointQueryResult q;
    cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
  });
  time_it(2000, "cudaFuncSetAttribute(max dyn smem)", [] {
    cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  });
  time_it(2000, "cudaMemsetAsync 4 KiB", [&] { cudaMemsetAsync(buf, 0, 4096, s); });
  time_it(2000, "empty kernel <<<1, 32>>>", [&] { empty_kernel<<<1, 32, 0, s>>>(0); });
  time_it(2000, "cudaLaunchKernelEx, cluster 2x1, 132 CTAs", [&] {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim = {2, 1, 1};
    cfg.gridDim = dim3(132); cfg.blockDim = dim3(128); cfg.stream = s; cfg.attrs = attr; cfg.numAttrs = 1;
    void* args[] = {nullptr};
    int x = 0; args[0] = &x;
    cudaLaunchKernelExC(&cfg, (const void*)empty_kernel, args);
  });
  time_it(2000, "cudaGetLastError", [] { cudaGetLastError(); });
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  time_it(2000, "cudaEventRecord", [&] { cudaEventRecord(e, s); });
  // A TMA descriptor as CUTLASS builds one per operand (bf16 1024 x 1024, 64 x 128 box),
  // through the driver entry point as CUTLASS looks it up.
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
  auto encode = reinterpret_cast<CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                              CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                              CUtensorMapFloatOOBfill)>(fn);
  time_it(2000, "cuTensorMapEncodeTiled (bf16 1024x1024, box 64x128, 128B swizzle)", [&] {
    alignas(64) CUtensorMap map;
    cuuint64_t dims[2] = {1024, 1024}, strides[1] = {2048};
    cuuint32_t box[2] = {64, 128}, es[2] = {1, 1};
    encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, buf, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
           CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  });
  time_cold("entry point lookup + cuTensorMapEncodeTiled (as CUTLASS does per descriptor)", [&] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult r;
    cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &r);
    alignas(64) CUtensorMap map;
    cuuint64_t dims[2] = {1024, 1024}, strides[1] = {2048};
    cuuint32_t box[2] = {64, 128}, es[2] = {1, 1};
    reinterpret_cast<decltype(encode)>(f)(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, buf, dims, strides, box, es,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  });
}

constexpr size_t kWs = size_t(64) << 20;
void* g_ws = nullptr;
void* ws_alloc(void*, size_t bytes) { return bytes <= kWs ? g_ws : nullptr; }

void cold_calls(cudaStream_t s) {
  time_cold("cudaGetDevice", [] { int d; cudaGetDevice(&d); });
  time_cold("cudaStreamIsCapturing", [&] { cudaStreamCaptureStatus c; cudaStreamIsCapturing(s, &c); });
  time_cold("getenv x 10 (unset)", [] {
    for (int i = 0; i < 10; ++i) (void)std::getenv("REGEMM_NOT_SET");
  });
  time_cold("snprintf of a tuner-like signature", [] {
    char buf[320];
    snprintf(buf, sizeof buf, "%s %c%c m=%lld n=%lld k=%lld batch=%lld act=%s bias=%s c=%d z=%d exact=%d align=%u",
             "bfloat16", 'n', 'n', 128LL, 1024LL, 1024LL, 1LL, "relu", "per_col", 0, 0, 0, 16u);
  });
  time_cold("empty kernel <<<1, 32>>>", [&] { empty_kernel<<<1, 32, 0, s>>>(0); });
  time_cold("kernel with 1 KiB of parameters <<<132, 128>>>", [&] { big_params_kernel<<<132, 128, 0, s>>>(BigParams{}); });
}

// The backward's dgrad as one cuBLASLt matmul, its plan (descriptors and the
// heuristic's first algorithm) made once: Y[m, k] = gZ[m, n] W[k, n]^T, i.e.
// column-major Y^T = W^T-as-stored x gZ^T.
struct LtDgrad {
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulHeuristicResult_t heur = {};
  size_t ws_bytes = size_t(32) << 20;
  bool found = false;
  LtDgrad(int64_t m, int64_t n, int64_t k) {
    cublasLtCreate(&lt);
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, n, k, n);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, n, m, n);
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, k, m, k);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes);
    int n_found = 0;
    cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &n_found);
    cublasLtMatmulPreferenceDestroy(pref);
    found = n_found > 0;
  }
  // W: w [k, n], gZ: gz [m, n], the result: out [m, k]; ws: ws_bytes of workspace.
  void run(const void* w, const void* gz, void* out, void* ws, cudaStream_t s) const {
    const float alpha = 1.0f, beta = 0.0f;
    cublasLtMatmul(lt, op, &alpha, w, la, gz, lb, &beta, out, lc, out, lc, &heur.algo, ws, ws_bytes, s);
  }
};

void gemm_paths(cudaStream_t s) {
  const int64_t m = 128, n = 1024, k = 1024;
  void *a, *b, *bias, *y, *z;
  cudaMalloc(&a, m * k * 2); cudaMalloc(&b, k * n * 2); cudaMalloc(&bias, n * 2);
  cudaMalloc(&y, m * n * 2); cudaMalloc(&z, m * n * 2); cudaMalloc(&g_ws, kWs);
  cudaMemset(a, 0, m * k * 2); cudaMemset(b, 0, k * n * 2); cudaMemset(bias, 0, n * 2);

  const DeviceInfo* dev = sm90_device();
  if (!dev) { printf("no sm_90 device: GEMM paths skipped\n"); return; }
  Launch l;
  l.stream = s; l.dev = *dev; l.alloc = ws_alloc;
  GemmProblem p;
  p.dtype = DType::kBF16; p.m = m; p.n = n; p.k = k;
  p.bias_kind = BiasKind::kPerCol;
  GemmOperands o{a, b, bias, nullptr, y, nullptr};
  for (Act act : {Act::kRelu, Act::kGelu}) {
    p.act = act;
    run(p, o, l);
    cudaDeviceSynchronize();
    char what[128];
    snprintf(what, sizeof what, "cutlass run(), %s 128x1024x1024 bf16 (rule: %s)", act == Act::kRelu ? "relu" : "gelu",
             rule_choice_name(p, *dev));
    time_it(200, what, [&] { run(p, o, l); });
    time_cold(what, [&] { run(p, o, l); });
    for (int c = 0; c < kNumConfigs; ++c) {
      RunFn fn = KernelTable::get().find(p.dtype, false, false, Config(c));
      snprintf(what, sizeof what, "  kernel entry %s alone", kConfigNames[c]);
      if (fn) time_it(200, what, [&] { fn(p, o, l); });
      if (fn) time_cold(what, [&] { fn(p, o, l); });
    }
  }

  // Plain GEMM as the backward's dgrad: Y[m, k] = gZ[m, n] W[k, n]^T, column-major Y^T = W gZ^T.
  cublasHandle_t h;
  cublasCreate(&h);
  cublasSetMathMode(h, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm_ex = [&] {
    cublasGemmStridedBatchedEx_64(h, CUBLAS_OP_T, CUBLAS_OP_N, k, m, n, &alpha, b, CUDA_R_16BF, n, 0, y, CUDA_R_16BF,
                                  n, 0, &beta, z, CUDA_R_16BF, k, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  cublasSetStream(h, s);
  cublasSetWorkspace(h, g_ws, size_t(32) << 20);
  time_it(200, "cublasGemmStridedBatchedEx_64 (dgrad 128x1024x1024)", gemm_ex);
  time_it(200, "  + cublasSetStream + cublasSetWorkspace (as the handler)", [&] {
    cublasSetStream(h, s);
    cublasSetWorkspace(h, g_ws, size_t(32) << 20);
    gemm_ex();
  });

  const LtDgrad lt(m, n, k);
  if (!lt.found) { printf("no cuBLASLt algorithm\n"); return; }
  time_it(200, "cublasLtMatmul, plan made once (dgrad 128x1024x1024)", [&] { lt.run(b, y, z, g_ws, s); });
  time_cold("cublasLtMatmul, plan made once (dgrad 128x1024x1024)", [&] { lt.run(b, y, z, g_ws, s); });
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &lt.ws_bytes, sizeof lt.ws_bytes);
  time_it(200, "  cublasLtMatmulAlgoGetHeuristic alone", [&] {
    int f = 0;
    cublasLtMatmulHeuristicResult_t r;
    cublasLtMatmulAlgoGetHeuristic(lt.lt, lt.op, lt.la, lt.lb, lt.lc, lt.lc, pref, 1, &r, &f);
  });
}

}  // namespace

// Section 4: median host time of the dgrad's cublasLtMatmul issued right after `first`.
void lt_after(cudaStream_t s) {
  const int64_t m = 4096, n = 1024, k = 4096;  // the layer: A[m, k] B[k, n]; dgrad gA[m, k] = gZ[m, n] B^T
  void *a, *b, *bias, *y, *ga, *ws;
  cudaMalloc(&a, m * k * 2); cudaMalloc(&b, k * n * 2); cudaMalloc(&bias, n * 2);
  cudaMalloc(&y, m * n * 2); cudaMalloc(&ga, m * k * 2); cudaMalloc(&ws, kWs);
  cudaMemset(a, 0, m * k * 2); cudaMemset(b, 0, k * n * 2); cudaMemset(bias, 0, n * 2); cudaMemset(y, 0, m * n * 2);
  const DeviceInfo* dev = sm90_device();
  RunFn fwd = KernelTable::get().find(DType::kBF16, false, false, Config::kPing128x128c1);
  if (!dev || !fwd) { printf("no sm_90 device or kernel: section 4 skipped\n"); return; }
  g_ws = ws;
  Launch l;
  l.stream = s; l.dev = *dev; l.alloc = ws_alloc;
  GemmProblem p;
  p.dtype = DType::kBF16; p.m = m; p.n = n; p.k = k; p.bias_kind = BiasKind::kPerCol; p.act = Act::kSilu;
  GemmOperands o{a, b, bias, nullptr, y, nullptr};

  const LtDgrad lt(m, n, k);
  if (!lt.found) { printf("no cuBLASLt algorithm: section 4 skipped\n"); return; }
  char* wsl = static_cast<char*>(ws) + lt.ws_bytes;  // the CUTLASS forward's workspace comes before
  auto dgrad = [&] { lt.run(b, y, ga, wsl, s); };
  auto after = [&](const char* what, auto first) {
    std::vector<double> us(40);
    for (double& u : us) {
      cudaDeviceSynchronize();
      first();
      const auto t0 = std::chrono::steady_clock::now();
      dgrad();
      u = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    cudaDeviceSynchronize();
    std::sort(us.begin(), us.end());
    printf("%8.2f us  (min %.2f, max %.2f)  cublasLtMatmul (dgrad 4096x4096x1024) right after %s%s\n", us[20], us[0],
           us[39], what, cudaGetLastError() == cudaSuccess ? "" : "  CUDA error");
  };
  for (int round = 0; round < 2; ++round) {
    after("nothing (GPU idle)", [] {});
    after("the CUTLASS forward (ping128x128c1, silu)", [&] { fwd(p, o, l); });
    after("another cublasLtMatmul (the same dgrad)", dgrad);
  }
}

int main() {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void* buf;
  cudaMalloc(&buf, 1 << 20);
  cuda_calls(s, buf);
  cold_calls(s);
  gemm_paths(s);
  lt_after(s);
  return 0;
}
