// The fused narrow-MLP kernels alone (ffi/cuda/narrow), without XLA: checked against a host
// reference (f32 accumulation, each layer's output rounded to bf16 as the kernel stores it)
// and timed with CUDA events. A developer's probe of the kernel before the library sees it.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DREGEMM_SM90A -Iffi \
//     tools/narrow_bench.cu -o narrow_bench            (REGEMM_SM90A: the wgmma kernels have a body)
//   [NARROW_GMMA=1] [NARROW_BWD=1] [NARROW_NO_WGRAD=1] [NARROW_LOAD_ONLY=1] [NARROW_TRANSPOSED=1] ./narrow_bench [rows x in x width x hidden x out [act]] ...
//   (e.g. 1048576x32x64x4x16 relu; NARROW_LOAD_ONLY: also time the forward's weight load alone;
//   NARROW_GMMA: the forward on wgmma, narrow_mlp_gmma.cuh, checked and timed after mma.sync's, and
//   the backward on wgmma where that kernel takes the stack (else mma.sync's))
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/narrow/narrow_mlp_bwd_gmma.cuh"

using T = __nv_bfloat16;
using namespace regemm;

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

static float bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

struct Cell { int64_t m; int k0, width, hidden, out; Act act; bool bwd; };

// The forward's weight load alone (what each block of the persistent grid does before its
// first row): the fixed cost per call that small M exposes. One kernel per block size, as the
// forward's (resident_blocks caches a kernel's occupancy by its shared memory alone).
template <int WARPS>
__global__ void __launch_bounds__(WARPS * 32) load_only(const narrow::Params p, int* sink) {
  extern __shared__ __align__(128) char smem[];  // (128: as the wgmma kernels declare it)
  narrow::load_weights<T>(p, smem);
  __syncthreads();
  if (threadIdx.x == 0 && smem[blockIdx.x % 64] == 123) atomicAdd(sink, 1);  // (keeps the load)
}

static bool run(const Cell& c) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int layers = c.hidden + 1;
  std::vector<int> ks(layers), ns(layers);
  for (int l = 0; l < layers; ++l) {
    ks[l] = l == 0 ? c.k0 : c.width;
    ns[l] = l == layers - 1 ? c.out : c.width;
  }
  std::vector<float> x(c.m * c.k0);
  for (auto& v : x) v = bf(nd(rng));
  std::vector<std::vector<float>> w(layers), b(layers);
  for (int l = 0; l < layers; ++l) {
    w[l].resize(size_t(ks[l]) * ns[l]);
    b[l].resize(ns[l]);
    const float s = 1.f / std::sqrt(float(ks[l]));
    for (auto& v : w[l]) v = bf(nd(rng) * s);
    for (auto& v : b[l]) v = bf(0.1f * nd(rng));
  }
  auto to_dev = [](const std::vector<float>& h) {
    std::vector<T> t(h.size());
    for (size_t i = 0; i < h.size(); ++i) t[i] = __float2bfloat16_rn(h[i]);
    void* d = nullptr;
    CHECK(cudaMalloc(&d, t.size() * sizeof(T) + 16));
    CHECK(cudaMemcpy(d, t.data(), t.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  };
  narrow::Params p{};
  p.m = c.m;
  p.layers = layers;
  p.w_transposed = std::getenv("NARROW_TRANSPOSED") != nullptr;  // W [N, K], Equinox's layout
  p.act_hidden = c.act;
  p.act_out = Act::kNone;
  p.slope = 0.01f;
  p.x = to_dev(x);
  CHECK(cudaMalloc(&p.y, c.m * c.out * sizeof(T) + 16));
  for (int l = 0; l < layers; ++l) {
    p.layer[l].k = ks[l];
    p.layer[l].n = ns[l];
    std::vector<float> wt(w[l].size());
    for (int k = 0; k < ks[l]; ++k)
      for (int n = 0; n < ns[l]; ++n) wt[size_t(n) * ks[l] + k] = w[l][size_t(k) * ns[l] + n];
    p.layer[l].w = to_dev(p.w_transposed ? wt : w[l]);
    p.layer[l].b = to_dev(b[l]);
  }
  const bool gmma = std::getenv("NARROW_GMMA") != nullptr;
  bool ok = true;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  float ms = 0;
  double flops = 0;
  const int iters = 50;
  for (int pass = 0; pass < (gmma ? 2 : 1); ++pass) {  // mma.sync, then (NARROW_GMMA) wgmma
    const bool on_gmma = pass == 1;
    const int smem = narrow::plan_weights(&p, sizeof(T), on_gmma ? narrow::Layout::kCoreMatrices : narrow::Layout::kPaddedRows);
    auto fwd = [&] { return on_gmma ? narrow::launch_fwd_gmma<T>(p, c.width, nullptr) : narrow::launch_fwd<T>(p, c.width, nullptr); };
    CHECK(cudaMemset(p.y, 0xff, c.m * c.out * sizeof(T)));
    CHECK(fwd());
    CHECK(cudaDeviceSynchronize());
    std::vector<T> yd(c.m * c.out);
    CHECK(cudaMemcpy(yd.data(), p.y, yd.size() * sizeof(T), cudaMemcpyDeviceToHost));
    // The reference on a sample of rows.
    double max_err = 0, max_ref = 0;
    const int64_t step = c.m > 4096 ? c.m / 4096 : 1;
    for (int64_t r = 0; r < c.m; r += step) {
      std::vector<float> h(x.begin() + r * c.k0, x.begin() + (r + 1) * c.k0);
      for (int l = 0; l < layers; ++l) {
        std::vector<float> o(ns[l]);
        for (int n = 0; n < ns[l]; ++n) {
          float acc = 0;
          for (int k = 0; k < ks[l]; ++k) acc += h[k] * w[l][size_t(k) * ns[l] + n];
          const float z = acc + b[l][n];
          o[n] = bf(act_fwd<float>(l == layers - 1 ? Act::kNone : c.act, z, 0.01f));
        }
        h = o;
      }
      for (int n = 0; n < c.out; ++n) {
        const double got = __bfloat162float(yd[r * c.out + n]);
        max_err = std::fmax(max_err, std::fabs(got - h[n]));
        max_ref = std::fmax(max_ref, std::fabs(h[n]));
      }
    }

    CHECK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) CHECK(fwd());
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    ms /= iters;
    flops = 0;
    for (int l = 0; l < layers; ++l) flops += 2.0 * c.m * ks[l] * ns[l];
    const double bytes = double(c.m) * (c.k0 + c.out) * sizeof(T);
    const bool fok = max_err <= 2e-2 * std::fmax(1.0, max_ref);
    ok = ok && fok;
    std::printf("%lldx%dx%dx%dx%d %s fwd%s: %.1f us, %.0f TFLOP/s, %.2f TB/s, smem %d B, max err %.3g (max |y| %.3g) %s\n",
                (long long)c.m, c.k0, c.width, c.hidden, c.out, std::string(kActNames[int(c.act)]).c_str(), on_gmma ? " (wgmma)" : "",
                ms * 1e3, flops / ms * 1e-9, bytes / ms * 1e-9, smem, max_err, max_ref, fok ? "ok" : "FAIL");
    if (std::getenv("NARROW_LOAD_ONLY")) {  // the weight load alone: one wave of blocks, so about one block's load
      int resident = 0, *sink = nullptr;
      CHECK(cudaMalloc(&sink, sizeof(int)));
      const bool wide = narrow::fwd_warps(c.width) == 16;
      static_assert(narrow::fwd_warps(128) == 16 && narrow::fwd_warps(64) == narrow::kWarps, "the forward's block sizes");
      const void* kernel = wide ? reinterpret_cast<const void*>(&load_only<16>)
                                : reinterpret_cast<const void*>(&load_only<narrow::kWarps>);
      const int threads = narrow::fwd_warps(c.width) * 32;
      CHECK(narrow::resident_blocks(kernel, smem, &resident, threads));
      CHECK(cudaEventRecord(e0));
      for (int i = 0; i < iters; ++i) {
        if (wide) load_only<16><<<resident, threads, smem>>>(p, sink);
        else load_only<narrow::kWarps><<<resident, threads, smem>>>(p, sink);
      }
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float lms = 0;
      CHECK(cudaEventElapsedTime(&lms, e0, e1));
      std::printf("   weights load alone: %.1f us (%d blocks, %d B)\n", lms * 1e3 / iters, resident, smem);
    }
  }
  if (!c.bwd) return ok;
  // The backward: gy random; the reference on the first `check` rows (a problem of its own).
  const int64_t check = c.m < 2999 ? c.m : 2999;
  std::vector<float> gy(c.m * c.out);
  for (auto& v : gy) v = bf(nd(rng));
  narrow::BwdParams bp{};
  bp.gy = to_dev(gy);
  CHECK(cudaMalloc(&bp.gx, c.m * c.k0 * sizeof(T) + 16));
  for (int l = 0; l < layers; ++l) {
    CHECK(cudaMalloc(&bp.gw[l], size_t(ks[l]) * ns[l] * sizeof(T)));
    CHECK(cudaMalloc(&bp.gb[l], ns[l] * sizeof(T)));
  }
  // The backward's kernel: on wgmma under NARROW_GMMA where it takes the stack.
  int bsmem = -1;
  if (gmma) {
    narrow::plan_weights(&p, sizeof(T), narrow::Layout::kCoreMatrices);
    bsmem = narrow::plan_bwd_gmma(p, c.width, &bp);
  }
  if (bsmem < 0) {
    narrow::plan_weights(&p, sizeof(T));
    bsmem = narrow::plan_bwd(p, c.width, sizeof(T), &bp);
  }
  int max_blocks = 0;
  CHECK(narrow::bwd_max_blocks<T>(p, c.width, bp, &max_blocks));
  CHECK(cudaMalloc(&bp.partial, size_t(max_blocks) * (bp.dw_floats + bp.db_floats) * 4));
  narrow::Params pc = p;
  pc.m = check;
  narrow::BwdParams bc = bp;
  CHECK(narrow::bwd_blocks<T>(pc, c.width, bc, &bc.blocks));
  CHECK(narrow::launch_bwd<T>(pc, c.width, bc, nullptr));
  CHECK(cudaDeviceSynchronize());
  auto from_dev = [](const void* d, size_t n) {
    std::vector<T> t(n);
    CHECK(cudaMemcpy(t.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<float> f(n);
    for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(t[i]);
    return f;
  };
  std::vector<std::vector<double>> gw_ref(layers), gb_ref(layers);
  for (int l = 0; l < layers; ++l) {
    gw_ref[l].assign(size_t(ks[l]) * ns[l], 0.0);
    gb_ref[l].assign(ns[l], 0.0);
  }
  std::vector<float> gx_ref(check * c.k0);
  for (int64_t r = 0; r < check; ++r) {
    std::vector<std::vector<float>> hs(layers), ds(layers);
    hs[0].assign(x.begin() + r * c.k0, x.begin() + (r + 1) * c.k0);
    std::vector<float> zo(c.out);
    for (int l = 0; l < layers; ++l) {
      std::vector<float> o(ns[l]), d(ns[l]);
      for (int n = 0; n < ns[l]; ++n) {
        float acc = 0;
        for (int k = 0; k < ks[l]; ++k) acc += hs[l][k] * w[l][size_t(k) * ns[l] + n];
        const float z = acc + b[l][n];
        o[n] = bf(act_fwd<float>(c.act, z, 0.01f));
        d[n] = bf(act_grad<float>(c.act, z, 0.01f));
      }
      if (l + 1 < layers) { hs[l + 1] = o; ds[l] = d; }
    }
    std::vector<float> gz(gy.begin() + r * c.out, gy.begin() + (r + 1) * c.out);  // act_out none
    for (int l = layers - 1; l >= 0; --l) {
      for (int n = 0; n < ns[l]; ++n) gb_ref[l][n] += gz[n];
      std::vector<float> gzr(ns[l]);
      for (int n = 0; n < ns[l]; ++n) gzr[n] = bf(gz[n]);
      for (int k = 0; k < ks[l]; ++k)
        for (int n = 0; n < ns[l]; ++n) gw_ref[l][size_t(k) * ns[l] + n] += double(hs[l][k]) * gzr[n];
      std::vector<float> gh(ks[l]);
      for (int k = 0; k < ks[l]; ++k) {
        float acc = 0;
        for (int n = 0; n < ns[l]; ++n) acc += gzr[n] * w[l][size_t(k) * ns[l] + n];
        gh[k] = acc;
      }
      if (l == 0) {
        for (int k = 0; k < c.k0; ++k) gx_ref[r * c.k0 + k] = gh[k];
      } else {
        gz.assign(ks[l], 0.f);
        for (int k = 0; k < ks[l]; ++k) gz[k] = gh[k] * ds[l - 1][k];
      }
    }
  }
  auto compare = [](const char* what, const std::vector<float>& got, auto& ref) {
    double err = 0, mx = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      err = std::fmax(err, std::fabs(got[i] - double(ref[i])));
      mx = std::fmax(mx, std::fabs(double(ref[i])));
    }
    const bool ok = err <= 2e-2 * std::fmax(1e-3, mx) + 1e-6;
    if (!ok) std::printf("  %s: max err %.3g of max %.3g FAIL\n", what, err, mx);
    return ok;
  };
  bool bok = compare("gx", from_dev(bp.gx, check * c.k0), gx_ref);
  for (int l = 0; l < layers; ++l) {
    std::string n = "gw" + std::to_string(l), m = "gb" + std::to_string(l);
    std::vector<float> gw = from_dev(bp.gw[l], size_t(ks[l]) * ns[l]), gkn(gw.size());
    for (int k = 0; k < ks[l]; ++k)  // to [K, N] where the kernel wrote W's layout [N, K]
      for (int n = 0; n < ns[l]; ++n)
        gkn[size_t(k) * ns[l] + n] = p.w_transposed ? gw[size_t(n) * ks[l] + k] : gw[size_t(k) * ns[l] + n];
    bok = compare(n.c_str(), gkn, gw_ref[l]) && bok;
    bok = compare(m.c_str(), from_dev(bp.gb[l], ns[l]), gb_ref[l]) && bok;
  }
  // Deterministic: the same bits again.
  std::vector<float> w0 = from_dev(bp.gw[0], size_t(ks[0]) * ns[0]);
  CHECK(narrow::launch_bwd<T>(pc, c.width, bc, nullptr));
  CHECK(cudaDeviceSynchronize());
  std::vector<float> w1 = from_dev(bp.gw[0], size_t(ks[0]) * ns[0]);
  const bool same = std::memcmp(w0.data(), w1.data(), w0.size() * 4) == 0;
  CHECK(narrow::bwd_blocks<T>(p, c.width, bp, &bp.blocks));
  CHECK(cudaEventRecord(e0));
  for (int i = 0; i < iters; ++i) CHECK(narrow::launch_bwd<T>(p, c.width, bp, nullptr));
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  ms /= iters;
  float ms_nw = 0;
  if (std::getenv("NARROW_NO_WGRAD")) {  // where the time goes: the backward without dW
    narrow::BwdParams nw = bp;
    nw.gw[0] = nullptr;
    CHECK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) CHECK(narrow::launch_bwd<T>(p, c.width, nw, nullptr));
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaEventElapsedTime(&ms_nw, e0, e1));
    std::printf("   bwd without dW: %.1f us\n", ms_nw * 1e3 / iters);
  }
  std::printf("   bwd%s: %.1f us, %.0f TFLOP/s (3x the forward's), smem %d B, %d blocks, %s%s\n", bp.gmma ? " (wgmma)" : "", ms * 1e3,
              3 * flops / ms * 1e-9, bsmem, bp.blocks, bok ? "ok" : "FAIL", same ? "" : " NOT DETERMINISTIC");
  return ok && bok && same;
}

int main(int argc, char** argv) {
  std::vector<Cell> cells;
  for (int i = 1; i < argc; ++i) {
    Cell c{};
    long long m;
    if (std::sscanf(argv[i], "%lldx%dx%dx%dx%d", &m, &c.k0, &c.width, &c.hidden, &c.out) != 5) return 2;
    c.m = m;
    c.act = Act::kRelu;
    if (i + 1 < argc && !std::isdigit(argv[i + 1][0])) parse_act(argv[++i], &c.act);
    c.bwd = std::getenv("NARROW_BWD") != nullptr;
    cells.push_back(c);
  }
  bool ok = true;
  for (const Cell& c : cells) ok = run(c) && ok;
  return ok ? 0 : 1;
}
