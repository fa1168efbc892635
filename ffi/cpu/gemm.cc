// CPU regemm: a packed, register-blocked GEMM whose epilogue (alpha, beta*C,
// bias, activation, optional Z) runs on the accumulator tile straight out of
// the micro-kernel. Each task owns one (M block, N block) tile of one batch
// entry and packs its own panels, so tasks share nothing but read-only inputs.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../regemm/handlers.h"
#include "runtime.h"

namespace regemm {
namespace {

// 256-bit vectors (GCC/Clang vector extensions; the attribute must not sit on
// a dependent type, or it is dropped).
typedef float vec_f32 __attribute__((vector_size(32)));
typedef double vec_f64 __attribute__((vector_size(32)));

template <class T>
struct CpuGemm {
  using A = acc_t<T>;
  using V = std::conditional_t<std::is_same_v<A, double>, vec_f64, vec_f32>;
  static_assert(sizeof(V) == 32);
  static constexpr int kLanes = 32 / sizeof(A);
  static constexpr int MR = 6, NR = 2 * kLanes;  // 6 x 16 floats: 12 accumulator registers

  const GemmProblem& p;
  const GemmOperands& o;
  int64_t mc, nc;  // block sizes, multiples of MR and NR

  A a_at(const T* a, int64_t i, int64_t q) const { return load<A>(p.trans_a ? a[q * p.m + i] : a[i * p.k + q]); }
  A b_at(const T* b, int64_t q, int64_t j) const { return load<A>(p.trans_b ? b[j * p.k + q] : b[q * p.n + j]); }

  // Packs rows [i0, i0+rows) of op(A) as MR-row panels, k-major, zero-padded.
  void pack_a(const T* a, int64_t i0, int64_t rows, A* dst) const {
    for (int64_t ir = 0; ir < rows; ir += MR)
      for (int64_t q = 0; q < p.k; ++q)
        for (int ii = 0; ii < MR; ++ii, ++dst) *dst = ir + ii < rows ? a_at(a, i0 + ir + ii, q) : A(0);
  }
  // Packs columns [j0, j0+cols) of op(B) as NR-column panels, k-major, zero-padded.
  void pack_b(const T* b, int64_t j0, int64_t cols, A* dst) const {
    for (int64_t jr = 0; jr < cols; jr += NR)
      for (int64_t q = 0; q < p.k; ++q)
        for (int jj = 0; jj < NR; ++jj, ++dst) *dst = jr + jj < cols ? b_at(b, q, j0 + jr + jj) : A(0);
  }

  static void micro(int64_t k, const A* ap, const A* bp, A out[MR][NR]) {
    V acc[MR][2] = {};
    for (int64_t q = 0; q < k; ++q, ap += MR, bp += NR) {
      V b0, b1;
      std::memcpy(&b0, bp, sizeof(V));
      std::memcpy(&b1, bp + kLanes, sizeof(V));
      for (int ii = 0; ii < MR; ++ii) {
        acc[ii][0] += ap[ii] * b0;
        acc[ii][1] += ap[ii] * b1;
      }
    }
    for (int ii = 0; ii < MR; ++ii) std::memcpy(out[ii], acc[ii], sizeof(acc[ii]));
  }

  void epilogue(int64_t batch, int64_t i0, int64_t j0, int64_t rows, int64_t cols, A acc[MR][NR]) const {
    const T* bias = o.bias ? static_cast<const T*>(o.bias) + batch * p.stride_bias : nullptr;
    const T* c = o.c ? static_cast<const T*>(o.c) + batch * p.stride_c : nullptr;
    T* y = static_cast<T*>(o.y) + batch * p.m * p.n;
    T* z = o.z ? static_cast<T*>(o.z) + batch * p.m * p.n : nullptr;
    const A alpha = A(p.alpha), beta = A(p.beta), slope = A(p.slope);
    for (int64_t ii = 0; ii < rows; ++ii)
      for (int64_t jj = 0; jj < cols; ++jj) {
        const int64_t i = i0 + ii, j = j0 + jj, idx = i * p.n + j;
        A v = alpha * acc[ii][jj];
        if (c) v += beta * load<A>(c[idx]);
        if (bias) v += load<A>(bias[bias_index(p.bias_kind, i, j)]);
        y[idx] = store<T>(act_fwd(p.act, v, slope));
        if (z) z[idx] = store<T>(v);
      }
  }

  void tile(int64_t batch, int64_t i0, int64_t j0) const {
    thread_local std::vector<V> a_buf, b_buf;
    const int64_t rows = std::min(mc, p.m - i0), cols = std::min(nc, p.n - j0);
    const int64_t a_len = (rows + MR - 1) / MR * MR * p.k, b_len = (cols + NR - 1) / NR * NR * p.k;
    if (int64_t(a_buf.size()) * kLanes < a_len + kLanes) a_buf.resize(a_len / kLanes + 1);
    if (int64_t(b_buf.size()) * kLanes < b_len + kLanes) b_buf.resize(b_len / kLanes + 1);
    A* ap = reinterpret_cast<A*>(a_buf.data());
    A* bp = reinterpret_cast<A*>(b_buf.data());
    pack_a(static_cast<const T*>(o.a) + batch * p.stride_a, i0, rows, ap);
    pack_b(static_cast<const T*>(o.b) + batch * p.stride_b, j0, cols, bp);
    A acc[MR][NR];
    for (int64_t jr = 0; jr < cols; jr += NR)
      for (int64_t ir = 0; ir < rows; ir += MR) {
        micro(p.k, ap + ir * p.k, bp + jr * p.k, acc);
        epilogue(batch, i0 + ir, j0 + jr, std::min<int64_t>(MR, rows - ir), std::min<int64_t>(NR, cols - jr), acc);
      }
  }

  void run(const CpuRuntime& rt) {
    // Keep a packed A block near 128 KiB and a B block near 256 KiB (L2-sized).
    const int64_t k = std::max<int64_t>(p.k, 1);
    mc = std::clamp<int64_t>((32768 / int64_t(sizeof(A)) / k) / MR * MR, MR, 16 * MR);
    nc = std::clamp<int64_t>((65536 / int64_t(sizeof(A)) / k) / NR * NR, NR, 16 * NR);
    const int64_t tm = (p.m + mc - 1) / mc, tn = (p.n + nc - 1) / nc;
    rt.parallel_for(p.batch * tm * tn, [&](int64_t t) {
      const int64_t b = t / (tm * tn), r = t % (tm * tn);
      tile(b, (r / tn) * mc, (r % tn) * nc);
    });
  }
};

ffi::Error run_gemm(const GemmProblem& p, const GemmOperands& o, CpuRuntime& rt) {
  switch (p.dtype) {
    case DType::kF32: CpuGemm<float>{p, o}.run(rt); break;
    case DType::kF64: CpuGemm<double>{p, o}.run(rt); break;
    case DType::kBF16: CpuGemm<bf16_t>{p, o}.run(rt); break;
    case DType::kF16: CpuGemm<f16_t>{p, o}.run(rt); break;
  }
  return ffi::Error::Success();
}

const Register<GemmProblem, GemmOperands, CpuRuntime> kRegister({
    "cpu_packed", 0, [](const GemmProblem&) { return true; }, run_gemm});

}  // namespace
}  // namespace regemm
