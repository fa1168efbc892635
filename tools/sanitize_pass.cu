// The epilogue pass (ffi/cuda/epilogue/epilogue_pass.cu) alone, for initcheck and
// racecheck. In the product it reads a GEMM output that CUTLASS's or
// cuBLASLt's sm90 kernels stored through the copy engine (TMA), which those
// two tools cannot see (tools/tma_sanitizer_repro.cu), so inside XLA every
// read of it is reported and racecheck stops. Here its inputs come from
// cudaMemcpy: every instance runs under the tools that way, each dtype x
// activation x 16-byte vectors or single elements x fast or precise math x
// bias kind, with C and Z, a batch of 2; each result is checked against a
// float64 host evaluation of the same activation (activation.h).
//
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Iffi \
//     -o tools/sanitize_pass tools/sanitize_pass.cu ffi/cuda/epilogue/epilogue_pass.cu
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/epilogue/epilogue_pass.h"

using namespace regemm;

namespace {

#define CHECK(expr)                                                                                   \
  do {                                                                                                \
    const cudaError_t e_ = (expr);                                                                    \
    if (e_ != cudaSuccess) {                                                                          \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_));    \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { CHECK(cudaMalloc(&p, bytes ? bytes : 1)); }
  ~Buf() { cudaFree(p); }
};

// Values as the dtype rounds them, and their device copy.
template <class T> std::vector<double> upload(const std::vector<double>& v, void* dev) {
  std::vector<T> t(v.size());
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    t[i] = store<T>(acc_t<T>(v[i]));
    r[i] = double(load<acc_t<T>>(t[i]));
  }
  CHECK(cudaMemcpy(dev, t.data(), t.size() * sizeof(T), cudaMemcpyHostToDevice));
  return r;
}

template <class T> std::vector<double> download(const void* dev, size_t n) {
  std::vector<T> t(n);
  CHECK(cudaMemcpy(t.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<double> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = double(load<acc_t<T>>(t[i]));
  return r;
}

double rel_err(const std::vector<double>& x, const std::vector<double>& ref) {
  double d = 0, s = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    d += (x[i] - ref[i]) * (x[i] - ref[i]);
    s += ref[i] * ref[i];
  }
  return std::sqrt(d / (s > 0 ? s : 1));
}

std::mt19937 g_rng(7);

std::vector<double> normal(size_t n) {
  std::normal_distribution<double> d;
  std::vector<double> v(n);
  for (double& x : v) x = d(g_rng);
  return v;
}

// One call of the pass; false when its result is off.
template <class T> bool run_case(int64_t m, int64_t n, Act act, BiasKind kind, bool fast, double tol) {
  const int64_t batch = 2, mn = m * n, len = bias_length(kind, m, n);
  GemmProblem p;
  p.dtype = std::is_same_v<T, float> ? DType::kF32 : std::is_same_v<T, double> ? DType::kF64
            : std::is_same_v<T, bf16_t> ? DType::kBF16 : DType::kF16;
  p.m = m, p.n = n, p.act = act, p.slope = 0.1, p.bias_kind = kind, p.beta = 0.5, p.has_c = true, p.store_z = true;
  p.batch = batch, p.stride_bias = len, p.stride_c = mn;
  Buf y(batch * mn * sizeof(T)), z(batch * mn * sizeof(T)), c(batch * mn * sizeof(T)), bias(batch * len * sizeof(T));
  const std::vector<double> y0 = upload<T>(normal(batch * mn), y.p), c0 = upload<T>(normal(batch * mn), c.p);
  const std::vector<double> b0 = len ? upload<T>(normal(batch * len), bias.p) : std::vector<double>();
  const GemmOperands o{nullptr, nullptr, len ? bias.p : nullptr, c.p, y.p, z.p};
  if (const char* err = epilogue_pass(p, o, true, fast, nullptr)) {
    std::fprintf(stderr, "launch: %s\n", err);
    return false;
  }
  CHECK(cudaDeviceSynchronize());
  std::vector<double> zr(batch * mn), yr(batch * mn);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = b * mn + i * n + j;
        const double v = y0[at] + 0.5 * c0[at] + (len ? b0[b * len + bias_index(kind, i, j)] : 0.0);
        zr[at] = v;
        yr[at] = act_fwd<double>(act, v, 0.1);
      }
  const double ey = rel_err(download<T>(y.p, batch * mn), yr), ez = rel_err(download<T>(z.p, batch * mn), zr);
  if (ey < tol && ez < tol) return true;
  std::fprintf(stderr, "%s %lldx%lld act %s bias %s fast %d: rel. error Y %.3g Z %.3g\n",
               kDTypeNames[int(p.dtype)].data(), (long long)m, (long long)n, kActNames[int(act)].data(),
               kBiasKindNames[int(kind)].data(), int(fast), ey, ez);
  return false;
}

template <class T> int run_dtype(double tol, double fast_tol) {
  int bad = 0, runs = 0;
  for (int64_t n : {64, 37})  // 16-byte vectors (n % 8 == 0 covers every dtype), single elements
    for (int a = 0; a < 8; ++a)
      for (BiasKind kind : {BiasKind::kNone, BiasKind::kScalar, BiasKind::kPerRow, BiasKind::kPerCol})
        for (bool fast : {false, true}) {
          if (fast && std::is_same_v<T, double>) continue;  // f64 has the precise forms only
          bad += !run_case<T>(9, n, Act(a), kind, fast, fast ? fast_tol : tol);
          ++runs;
        }
  std::printf("%d of %d cases right\n", runs - bad, runs);
  return bad;
}

}  // namespace

int main() {
  int bad = run_dtype<float>(1e-6, 2e-3) + run_dtype<double>(1e-12, 0) + run_dtype<bf16_t>(1e-2, 1e-2) +
            run_dtype<f16_t>(2e-3, 3e-3);
  std::printf("epilogue pass %s\n", bad ? "WRONG" : "ok");
  return bad ? 1 : 0;
}
