// Host time per call of the GEMM paths a regemm handler takes, outside XLA:
// the CUTLASS dispatch (run(): rule or tuned choice, then the kernel's
// argument setup and launch), each CUTLASS kernel entry alone, and cuBLAS's
// two APIs for the plain backward GEMMs (cublasGemmStridedBatchedEx as the
// handler calls it, against cublasLtMatmul with descriptors and algorithm
// made once). 200 calls back to back (below the launch queue's depth), mean.
//
//   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -Iffi/cuda benchmarks/host_cost_gemm.cu ffi/cuda/cutlass_dispatch.cu ffi/cuda/epilogue_pass.cu \
//     .cutlass_prebuilt/cutlass_*.o -lcublas -lcublasLt -o /tmp/host_cost_gemm && /tmp/host_cost_gemm
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>

#include "../ffi/cuda/cutlass_dispatch.h"

using namespace regemm;
using namespace regemm::cutlass_sm90;

namespace {
constexpr size_t kWs = size_t(64) << 20;
void* g_ws = nullptr;
void* ws_alloc(void*, size_t bytes) { return bytes <= kWs ? g_ws : nullptr; }

template <class F>
void time_it(const char* what, F f, int n = 200) {
  for (int i = 0; i < 20; ++i) f();
  cudaDeviceSynchronize();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  auto t1 = std::chrono::steady_clock::now();
  cudaDeviceSynchronize();
  const cudaError_t e = cudaGetLastError();
  printf("%8.2f us  %s%s%s\n", std::chrono::duration<double, std::micro>(t1 - t0).count() / n, what,
         e == cudaSuccess ? "" : "  CUDA error: ", e == cudaSuccess ? "" : cudaGetErrorString(e));
}
}  // namespace

int main() {
  const int64_t m = 128, n = 1024, k = 1024;
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void *a, *b, *bias, *y, *z;
  cudaMalloc(&a, m * k * 2); cudaMalloc(&b, k * n * 2); cudaMalloc(&bias, n * 2);
  cudaMalloc(&y, m * n * 2); cudaMalloc(&z, m * n * 2); cudaMalloc(&g_ws, kWs);
  cudaMemset(a, 0, m * k * 2); cudaMemset(b, 0, k * n * 2); cudaMemset(bias, 0, n * 2);

  const DeviceInfo* dev = sm90_device();
  if (!dev) { printf("no sm_90 device\n"); return 1; }
  Launch l;
  l.stream = s; l.dev = *dev; l.alloc = ws_alloc;
  GemmProblem p;
  p.dtype = DType::kBF16; p.m = m; p.n = n; p.k = k;
  p.bias_kind = BiasKind::kPerCol;
  GemmOperands o{a, b, bias, nullptr, y, nullptr};
  for (Act act : {Act::kRelu, Act::kGelu}) {
    p.act = act;
    run(p, o, l);  // first sight: tunes
    cudaDeviceSynchronize();
    char what[128];
    bool split = false;
    const Config chosen = peek_config(p, *dev, &split);
    snprintf(what, sizeof what, "cutlass run(), %s 128x1024x1024 bf16 (tuned: %s%s)", act == Act::kRelu ? "relu" : "gelu",
             kConfigNames[int(chosen)], split ? "+split" : "");
    time_it(what, [&] { run(p, o, l); });
    for (int c = 0; c < kNumConfigs; ++c) {
      RunFn fn = KernelTable::get().find(p.dtype, false, false, Config(c));
      snprintf(what, sizeof what, "  kernel entry %s alone", kConfigNames[c]);
      if (fn) time_it(what, [&] { fn(p, o, l); });
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
  time_it("cublasGemmStridedBatchedEx_64 (dgrad 128x1024x1024)", gemm_ex);
  time_it("  + cublasSetStream + cublasSetWorkspace (as the handler)", [&] {
    cublasSetStream(h, s);
    cublasSetWorkspace(h, g_ws, size_t(32) << 20);
    gemm_ex();
  });

  cublasLtHandle_t lt;
  cublasLtCreate(&lt);
  cublasLtMatmulDesc_t op;
  cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, n, k, n);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, n, m, n);
  cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, k, m, k);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  size_t wsb = size_t(32) << 20;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb);
  cublasLtMatmulHeuristicResult_t heur;
  int found = 0;
  cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &found);
  if (!found) { printf("no cuBLASLt algorithm\n"); return 1; }
  time_it("cublasLtMatmul, plan made once (dgrad 128x1024x1024)", [&] {
    cublasLtMatmul(lt, op, &alpha, b, la, y, lb, &beta, z, lc, z, lc, &heur.algo, g_ws, wsb, s);
  });
  time_it("  cublasLtMatmulAlgoGetHeuristic alone", [&] {
    int f = 0;
    cublasLtMatmulHeuristicResult_t r;
    cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &r, &f);
  });
  return 0;
}
