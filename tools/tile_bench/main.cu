// Times the tile variants built in (variant.cu) and cuBLAS's plain bf16 GEMM
// (the hardware's GEMM, no bias) on the problems given as M:K:N:ACT:Z, all
// with a per-column bias. Interleaved: round-robin over the candidates, so
// that clock drift hits all alike. Cold: L2 flushed (a 256 MB memset) before
// each timed launch; warm: 10 back-to-back launches between two events (host
// bound for small shapes: CUTLASS builds its TMA descriptors per call).
// Median over the rounds; ratios to cuBLAS of the same layout. Each variant's
// Y is checked against the first variant of its layout (same epilogue).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "harness.h"

using namespace regemm;
using namespace regemm::cutlass_sm90;

std::vector<Variant>& variants() {
  static std::vector<Variant> v;
  return v;
}

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s: %s line %d\n", #x, cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { printf("cuBLAS %s: %d\n", #x, int(s_)); exit(1); } } while (0)

__global__ void fill(__nv_bfloat16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = __float2bfloat16(scale * (float(h & 0xffff) / 32768.0f - 1.0f));
  }
}
__global__ void maxdiff(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n, float* out) {
  float m = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i])));
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
}

static char* g_ws;
static size_t g_ws_bytes = size_t(256) << 20;
static void* ws_alloc(void*, size_t b) { return b <= g_ws_bytes ? g_ws : nullptr; }

int main(int argc, char** argv) {
  printf("variants:\n");
  for (auto& v : variants())
    printf("  %-22s %d%d smem %6d stages %d epilogue smem %6d\n", v.name, v.ta, v.tb, v.smem, v.stages, v.epi_smem);
  fflush(stdout);
  std::sort(variants().begin(), variants().end(), [](const Variant& x, const Variant& y) {
    return std::make_tuple(x.ta, x.tb, std::string(x.name)) < std::make_tuple(y.ta, y.tb, std::string(y.name));
  });
  struct P { long m, k, n; int act; int z; };
  std::vector<P> ps;
  size_t maxa = 0, maxb = 0, maxy = 0;
  for (int i = 1; i < argc; ++i) {
    P p{};
    if (sscanf(argv[i], "%ld:%ld:%ld:%d:%d", &p.m, &p.k, &p.n, &p.act, &p.z) != 5 || p.m < 1 || p.k < 1 ||
        p.n < 1 || p.n > 65536 || p.act < 0 || p.act > 7) {
      printf("bad problem '%s': M:K:N:ACT:Z, N <= 65536, ACT 0-7\n", argv[i]);
      return 2;
    }
    ps.push_back(p);
    maxa = std::max(maxa, size_t(p.m * p.k)); maxb = std::max(maxb, size_t(p.k * p.n)); maxy = std::max(maxy, size_t(p.m * p.n));
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  __nv_bfloat16 *a, *b, *bias, *y, *y0, *z;
  char* flush;
  const size_t flush_bytes = size_t(256) << 20;
  CK(cudaMalloc(&a, maxa * 2)); CK(cudaMalloc(&b, maxb * 2)); CK(cudaMalloc(&bias, 65536 * 2));
  CK(cudaMalloc(&y, maxy * 2)); CK(cudaMalloc(&y0, maxy * 2)); CK(cudaMalloc(&z, maxy * 2));
  CK(cudaMalloc(&flush, flush_bytes)); CK(cudaMalloc(&g_ws, g_ws_bytes));
  float* dmax; CK(cudaMalloc(&dmax, 4));
  fill<<<1024, 256>>>(a, maxa, 1, 1.0f); fill<<<1024, 256>>>(b, maxb, 2, 0.05f); fill<<<64, 256>>>(bias, 65536, 3, 1.0f);
  CK(cudaGetLastError());
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cublasHandle_t h; CB(cublasCreate(&h)); CB(cublasSetStream(h, st));
  void* cublas_ws; CK(cudaMalloc(&cublas_ws, 32 << 20)); CB(cublasSetWorkspace(h, cublas_ws, 32 << 20));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));

  for (auto& q : ps) {
    printf("\n== M %ld K %ld N %ld act %d z %d (GFLOP %.1f, floor %.1f us at 730 TF)\n", q.m, q.k, q.n, q.act, q.z,
           2.0 * q.m * q.k * q.n / 1e9, 2.0 * q.m * q.k * q.n / 730e12 * 1e6);
    struct Cand { std::string name; int ta, tb; std::function<void()> run; std::vector<float> cold, cold2, warm; float md; };
    std::vector<Cand> cands;
    const float alpha = 1, beta = 0;
    for (int lay = 0; lay < 4; ++lay) {
      const int ta = lay >> 1, tb = lay & 1;
      bool any = false;
      for (auto& v : variants()) any |= v.ta == ta && v.tb == tb;
      if (!any) continue;
      cands.push_back({"cublas", ta, tb, [&, ta, tb] {
        CB(cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(q.n), int(q.m), int(q.k),
                        &alpha, b, CUDA_R_16BF, int(tb ? q.k : q.n), a, CUDA_R_16BF, int(ta ? q.m : q.k), &beta, y,
                        CUDA_R_16BF, int(q.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }});
      for (auto& v : variants()) {
        if (v.ta != ta || v.tb != tb) continue;
        GemmProblem p;
        p.dtype = DType::kBF16; p.m = q.m; p.n = q.n; p.k = q.k; p.act = Act(q.act); p.bias_kind = BiasKind::kPerCol;
        p.store_z = q.z != 0; p.trans_a = ta; p.trans_b = tb;
        GemmOperands o{a, b, bias, nullptr, y, q.z ? z : nullptr};
        Launch l; l.stream = st; l.dev = DeviceInfo{0, sms}; l.alloc = ws_alloc;
        const Variant* vp = &v;
        // A kernel of one activation (TILE_ONE_ACT) refuses the others: not a candidate there.
        if (Status s = vp->run(p, o, l); !s.ok() && std::strcmp(s.stage, "dispatch") == 0) continue;
        cands.push_back({v.name, ta, tb, [=] {
          Status s = vp->run(p, o, l);
          if (!s.ok()) { printf("fail %s: %s %s\n", vp->name, s.stage, s.detail); exit(1); }
        }});
      }
    }
    // Correctness: every variant against the first of its layout (same epilogue).
    int ref_ta = -1, ref_tb = -1;
    for (auto& c : cands) {
      if (c.name == "cublas") { c.md = 0; continue; }
      c.run(); CK(cudaStreamSynchronize(st));
      if (c.ta != ref_ta || c.tb != ref_tb) {
        CK(cudaMemcpy(y0, y, q.m * q.n * 2, cudaMemcpyDeviceToDevice)); ref_ta = c.ta; ref_tb = c.tb; c.md = 0; continue;
      }
      CK(cudaMemset(dmax, 0, 4));
      maxdiff<<<264, 256, 0, st>>>(y, y0, size_t(q.m * q.n), dmax);
      CK(cudaGetLastError());
      CK(cudaMemcpy(&c.md, dmax, 4, cudaMemcpyDeviceToHost));
    }
    for (auto& c : cands) { c.run(); c.run(); }
    CK(cudaStreamSynchronize(st));
    // Each round runs the candidates in a new random order: a run reads
    // faster when the kernel before it was its own (instruction and constant
    // caches, session 10), so a fixed order would favour some.
    const size_t nc = cands.size();
    std::vector<size_t> order(nc);
    std::mt19937 rng(12345);
    for (int r = 0; r < 15; ++r) {
      for (size_t i = 0; i < nc; ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), rng);
      for (size_t i = 0; i < nc; ++i) {
        Cand& c = cands[order[i]];
        // Twice, L2 flushed before each: the second run finds the SMs' caches
        // (instructions, constants) as the first left them.
        for (int twice = 0; twice < 2; ++twice) {
          CK(cudaMemsetAsync(flush, r, flush_bytes, st));
          CK(cudaEventRecord(e0, st)); c.run(); CK(cudaEventRecord(e1, st));
          CK(cudaEventSynchronize(e1));
          float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); (twice ? c.cold2 : c.cold).push_back(ms * 1000);
        }
      }
    }
    for (int r = 0; r < 5; ++r) {
      for (size_t i = 0; i < nc; ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), rng);
      for (size_t i = 0; i < nc; ++i) {
        Cand& c = cands[order[i]];
        CK(cudaEventRecord(e0, st)); for (int i = 0; i < 10; ++i) c.run(); CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); c.warm.push_back(ms * 1000 / 10);
      }
    }
    float ref_c = 0, ref_w = 0;
    for (auto& c : cands) {
      std::sort(c.cold.begin(), c.cold.end()); std::sort(c.cold2.begin(), c.cold2.end());
      std::sort(c.warm.begin(), c.warm.end());
      const float mc = c.cold[c.cold.size() / 2], mc2 = c.cold2[c.cold2.size() / 2], mw = c.warm[c.warm.size() / 2];
      if (c.name == "cublas") { ref_c = mc; ref_w = mw; }
      printf("  %d%d %-22s cold %8.1f (min %8.1f) %.3f  cold again %8.1f  warm %8.1f %.3f  maxdiff %.3g\n", c.ta, c.tb,
             c.name.c_str(), mc, c.cold[0], mc / ref_c, mc2, mw, mw / ref_w, c.md);
    }
    fflush(stdout);
  }
  return 0;
}
