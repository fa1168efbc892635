// The wgmma forms of the narrow MLP's kernels (ffi/cuda/narrow/gmma.h), each checked alone
// against the host: one warpgroup, random bf16 operands in the layouts the kernels keep.
// Where an MN-major form fails with the strides gmma.h gives, it is tried with LBO and SBO
// swapped, and the probe says which order the hardware reads (a developer's check of the
// descriptors before any kernel uses them).
//
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iffi tools/wgmma_probe.cu -o wgmma_probe
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/narrow/gmma.h"

using T = __nv_bfloat16;
using namespace regemm::narrow;

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

// The forms. RS: D[64][N] = A[64][K] (registers) B[K][N], B kept as Bt[N][K] K-major
// (the forward's Wt) or as Wt[K][N] read MN-major (the dgrad's B = W^T from the forward's Wt).
// SS: D[64][N] = H^T G over K rows, H [K][64] and G [K][N] MN-major (the weight gradient).
enum Form { kRsK, kRsMn, kSsMn };

struct Probe {
  Form form;
  int lbo, sbo, kstep;  // bytes; kstep: the B (and SS A) start's advance per 16 of K
};

template <int N, int K>
__global__ void probe(Probe pr, const T* a, const T* b, float* d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ __align__(128) T sa[64 * K];
  __shared__ __align__(128) T sb[K * N];
  const int t = threadIdx.x, warp = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
  // a: [64][K] row-major (RS) or H [K][64] (SS); b: [K][N] row-major.
  for (int i = t; i < K * N; i += 128) {
    const int k = i / N, n = i % N;
    const int at = pr.form == kRsK ? gmma::kmajor_at(n, k, K)       // Bt [N][K]
                   : pr.form == kRsMn ? gmma::kmajor_at(k, n, N)    // Wt [K][N] as the forward keeps it
                                      : gmma::mnmajor_at(k, n, K);  // G [K rows][N]
    sb[at] = b[i];
  }
  if (pr.form == kSsMn)
    for (int i = t; i < K * 64; i += 128) sa[gmma::mnmajor_at(i / 64, i % 64, K)] = a[i];
  gmma::fence_shared();
  __syncthreads();
  float acc[N / 8][4];
  for (int j = 0; j < N / 8; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
  gmma::pin(acc);
  gmma::fence();
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) {
    const uint64_t bd = gmma::descriptor(reinterpret_cast<char*>(sb) + ks * pr.kstep, pr.lbo, pr.sbo);
    if (pr.form == kSsMn) {
      const uint64_t ad = gmma::descriptor(reinterpret_cast<char*>(sa) + ks * pr.kstep, pr.lbo, pr.sbo);
      gmma::Ss<T, N, 1, 1>::run(acc, ad, bd, 1);
    } else {
      uint32_t af[4];
      const int r = warp * 16 + g, c = ks * 16 + 2 * q;
      auto pair = [&](int rr, int cc) { return *reinterpret_cast<const uint32_t*>(a + rr * K + cc); };
      af[0] = pair(r, c);
      af[1] = pair(r + 8, c);
      af[2] = pair(r, c + 8);
      af[3] = pair(r + 8, c + 8);
      if (pr.form == kRsK) gmma::Rs<T, N, 0>::run(acc, af, bd, 1);
      else gmma::Rs<T, N, 1>::run(acc, af, bd, 1);
    }
  }
  gmma::commit();
  gmma::wait<0>();
  gmma::pin(acc);
  for (int j = 0; j < N / 8; ++j) {
    const int r = warp * 16 + g, c = j * 8 + 2 * q;
    d[r * N + c] = acc[j][0];
    d[r * N + c + 1] = acc[j][1];
    d[(r + 8) * N + c] = acc[j][2];
    d[(r + 8) * N + c + 1] = acc[j][3];
  }
#endif
}

template <int N, int K>
static double run(Probe pr) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> u(-4, 4);  // small integers: every sum is exact
  const int arows = pr.form == kSsMn ? K : 64, acols = pr.form == kSsMn ? 64 : K;
  std::vector<float> a(arows * acols), b(K * N), ref(64 * N, 0.f);
  for (auto& v : a) v = float(u(rng));
  for (auto& v : b) v = float(u(rng));
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k)
        ref[m * N + n] += (pr.form == kSsMn ? a[k * 64 + m] : a[m * K + k]) * b[k * N + n];
  auto dev = [](const std::vector<float>& h) {
    std::vector<T> t(h.size());
    for (size_t i = 0; i < h.size(); ++i) t[i] = __float2bfloat16_rn(h[i]);
    T* d = nullptr;
    CHECK(cudaMalloc(&d, t.size() * sizeof(T)));
    CHECK(cudaMemcpy(d, t.data(), t.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  };
  T *da = dev(a), *db = dev(b);
  float* dd = nullptr;
  CHECK(cudaMalloc(&dd, 64 * N * sizeof(float)));
  CHECK(cudaMemset(dd, 0, 64 * N * sizeof(float)));
  probe<N, K><<<1, 128>>>(pr, da, db, dd);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<float> got(64 * N);
  CHECK(cudaMemcpy(got.data(), dd, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double err = 0;
  for (int i = 0; i < 64 * N; ++i) err = std::fmax(err, std::fabs(got[i] - ref[i]));
  CHECK(cudaFree(da));
  CHECK(cudaFree(db));
  CHECK(cudaFree(dd));
  return err;
}

// One form at gmma.h's strides, then (if wrong) with LBO and SBO swapped.
template <int N, int K>
static bool check(const char* name, Probe pr) {
  const double e = run<N, K>(pr);
  std::printf("%-44s N %3d K %3d lbo %5d sbo %5d: max error %g %s\n", name, N, K, pr.lbo, pr.sbo, e,
              e == 0 ? "ok" : "WRONG");
  if (e != 0) {
    Probe sw = pr;
    sw.lbo = pr.sbo;
    sw.sbo = pr.lbo;
    const double e2 = run<N, K>(sw);
    std::printf("%-44s   swapped lbo %5d sbo %5d: max error %g %s\n", "", sw.lbo, sw.sbo, e2, e2 == 0 ? "ok" : "WRONG");
  }
  return e == 0;
}

int main() {
  bool ok = true;
  // The forward: B = Wt [N][K] K-major: LBO 128 (K), SBO 16 K (N); 16 of K = 2 core matrices.
  ok &= check<64, 64>("RS, B K-major (forward)", {kRsK, 128, 16 * 64, 256});
  ok &= check<16, 32>("RS, B K-major (forward)", {kRsK, 128, 16 * 32, 256});
  ok &= check<128, 32>("RS, B K-major (forward)", {kRsK, 128, 16 * 32, 256});
  // The dgrad: B[n][k] = Wt[n][k] kept K-major for the forward (rows n of kp = N here), read
  // MN-major: LBO 16 kp (K = n), SBO 128 (MN = k); 16 of K = 16 rows of Wt = 2 x LBO.
  ok &= check<64, 64>("RS, B MN-major from the forward's Wt (dgrad)", {kRsMn, 16 * 64, 128, 2 * 16 * 64});
  ok &= check<32, 16>("RS, B MN-major from the forward's Wt (dgrad)", {kRsMn, 16 * 32, 128, 2 * 16 * 32});
  // The weight gradient: H^T G over 64 rows (K), both MN-major [64 rows][64 or N]: LBO 128 (K),
  // SBO 16 * 64 (MN); 16 rows = 2 core matrices.
  ok &= check<64, 64>("SS, A and B MN-major (weight gradient)", {kSsMn, 128, 16 * 64, 256});
  ok &= check<16, 64>("SS, A and B MN-major (weight gradient)", {kSsMn, 128, 16 * 64, 256});
  std::printf(ok ? "all forms ok\n" : "SOME FORMS WRONG\n");
  return ok ? 0 : 1;
}
