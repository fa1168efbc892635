// CPU regemm: a packed, register-blocked GEMM whose epilogue (alpha, beta*C,
// bias, activation, optional Z) runs on the accumulator tile straight out of
// the micro-kernel. Each task owns one (M block, N block) tile of one batch
// entry and packs its own panels, so tasks share nothing but read-only inputs.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "regemm/handlers.h"
#include "runtime.h"

namespace regemm {
namespace {

// Native vectors (GCC/Clang vector extensions): 512-bit where AVX-512 is on,
// else 256-bit. The attribute must not sit on a dependent type, or it is dropped.
#if defined(__AVX512F__)
inline constexpr int kVecBytes = 64;
#else
inline constexpr int kVecBytes = 32;
#endif
typedef float vec_f32 __attribute__((vector_size(kVecBytes)));
typedef double vec_f64 __attribute__((vector_size(kVecBytes)));

// Goto-style blocking: a kc x nc block of op(B) is packed once per task and
// stays in L2; kc x NR panels of it stream through L1 against MR-row panels of
// a packed mc x kc block of op(A). Partial sums over K blocks live in a float
// tile buffer; the last K block runs the epilogue from the registers.
template <class T>
struct CpuGemm {
  using A = acc_t<T>;
  using V = std::conditional_t<std::is_same_v<A, double>, vec_f64, vec_f32>;
  static constexpr int kLanes = kVecBytes / sizeof(A);
  static constexpr int MR = kVecBytes == 64 ? 12 : 6;  // MR x 2 vector accumulators
  static constexpr int NR = 2 * kLanes;
  static constexpr int64_t kKc = 256, kMc = 8 * MR, kNc = 16 * NR;

  const GemmProblem& p;
  const GemmOperands& o;

  A a_at(const T* a, int64_t i, int64_t q) const { return load<A>(p.trans_a ? a[q * p.m + i] : a[i * p.k + q]); }
  A b_at(const T* b, int64_t q, int64_t j) const { return load<A>(p.trans_b ? b[j * p.k + q] : b[q * p.n + j]); }

  // Rows [i0, i0+rows) x K range [q0, q0+kc) of op(A) as MR-row panels, zero-padded.
  void pack_a(const T* a, int64_t i0, int64_t rows, int64_t q0, int64_t kc, A* dst) const {
    for (int64_t ir = 0; ir < rows; ir += MR)
      for (int64_t q = q0; q < q0 + kc; ++q)
        for (int ii = 0; ii < MR; ++ii, ++dst) *dst = ir + ii < rows ? a_at(a, i0 + ir + ii, q) : A(0);
  }
  // K range [q0, q0+kc) x columns [j0, j0+cols) of op(B) as NR-column panels, zero-padded.
  void pack_b(const T* b, int64_t q0, int64_t kc, int64_t j0, int64_t cols, A* dst) const {
    for (int64_t jr = 0; jr < cols; jr += NR)
      for (int64_t q = q0; q < q0 + kc; ++q)
        for (int jj = 0; jj < NR; ++jj, ++dst) *dst = jr + jj < cols ? b_at(b, q, j0 + jr + jj) : A(0);
  }

  // acc (MR x NR, row stride NR) = (first ? 0 : acc) + Apanel . Bpanel over kc.
  static void micro(int64_t kc, const A* ap, const A* bp, A* acc, bool first) {
    V c[MR][2];
    if (first) {
      for (int ii = 0; ii < MR; ++ii) c[ii][0] = c[ii][1] = V{};
    } else {
      for (int ii = 0; ii < MR; ++ii) std::memcpy(c[ii], acc + ii * NR, sizeof(c[ii]));
    }
    for (int64_t q = 0; q < kc; ++q, ap += MR, bp += NR) {
      V b0, b1;
      std::memcpy(&b0, bp, sizeof(V));
      std::memcpy(&b1, bp + kLanes, sizeof(V));
      for (int ii = 0; ii < MR; ++ii) {
        c[ii][0] += ap[ii] * b0;
        c[ii][1] += ap[ii] * b1;
      }
    }
    for (int ii = 0; ii < MR; ++ii) std::memcpy(acc + ii * NR, c[ii], sizeof(c[ii]));
  }

  // Written for a compile-time activation so that the row loop vectorizes.
  template <Act kAct>
  void epilogue_t(int64_t batch, int64_t i0, int64_t j0, int64_t rows, int64_t cols, const A* acc) const {
    const T* bias = o.bias ? static_cast<const T*>(o.bias) + batch * p.stride_bias : nullptr;
    const T* c = o.c ? static_cast<const T*>(o.c) + batch * p.stride_c : nullptr;
    T* y = static_cast<T*>(o.y) + batch * p.m * p.n;
    T* z = o.z ? static_cast<T*>(o.z) + batch * p.m * p.n : nullptr;
    const A alpha = A(p.alpha), beta = A(p.beta), slope = A(p.slope);
    const bool per_col = bias && p.bias_kind == BiasKind::kPerCol;
    A bias_col[NR] = {};
    if (per_col)
      for (int64_t jj = 0; jj < cols; ++jj) bias_col[jj] = load<A>(bias[j0 + jj]);
    for (int64_t ii = 0; ii < rows; ++ii) {
      const int64_t i = i0 + ii, row = i * p.n + j0;
      const A bias_row = bias && !per_col ? load<A>(bias[bias_index(p.bias_kind, i, 0)]) : A(0);
      const A* __restrict a_row = acc + ii * NR;
      T* __restrict y_row = y + row;
      for (int64_t jj = 0; jj < cols; ++jj) {
        A v = alpha * a_row[jj] + (per_col ? bias_col[jj] : bias_row);
        if (c) v += beta * load<A>(c[row + jj]);
        y_row[jj] = store<T>(act_fwd(kAct, v, slope));
        if (z) z[row + jj] = store<T>(v);
      }
    }
  }

  void epilogue(int64_t batch, int64_t i0, int64_t j0, int64_t rows, int64_t cols, const A* acc) const {
    with_act(p.act, [&](auto act) { epilogue_t<decltype(act)::value>(batch, i0, j0, rows, cols, acc); });
  }

  // One task: rows [m0, m1) x columns [j0, j0+cols) of batch entry `batch`.
  void task(int64_t batch, int64_t m0, int64_t m1, int64_t j0, int64_t cols) const {
    thread_local std::vector<V> a_buf, b_buf, c_buf;
    const int64_t kc_max = std::min<int64_t>(kKc, std::max<int64_t>(p.k, 1));
    const int64_t cols_p = (cols + NR - 1) / NR * NR;
    auto grow = [](std::vector<V>& v, int64_t elems) {
      if (int64_t(v.size()) * kLanes < elems) v.resize(elems / kLanes + 1);
      return reinterpret_cast<A*>(v.data());
    };
    A* ap = grow(a_buf, kMc * kc_max);
    A* bp = grow(b_buf, kc_max * cols_p);
    A* cp = grow(c_buf, kMc * cols_p);  // partial sums, MR x NR tiles in (ir, jr) order
    const T* a = static_cast<const T*>(o.a) + batch * p.stride_a;
    const T* b = static_cast<const T*>(o.b) + batch * p.stride_b;
    const int64_t k_blocks = std::max<int64_t>((p.k + kKc - 1) / kKc, 1);
    for (int64_t i0 = m0; i0 < m1; i0 += kMc) {
      const int64_t rows = std::min(kMc, m1 - i0);
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const int64_t q0 = kb * kKc, kc = std::min(kKc, p.k - q0);
        const bool first = kb == 0, last = kb + 1 == k_blocks;
        if (i0 == m0 || k_blocks > 1) pack_b(b, q0, kc, j0, cols, bp);  // reused across i0 when K fits
        pack_a(a, i0, rows, q0, kc, ap);
        for (int64_t jr = 0; jr < cols; jr += NR)
          for (int64_t ir = 0; ir < rows; ir += MR) {
            A* acc = cp + (ir / MR * (cols_p / NR) + jr / NR) * MR * NR;
            micro(kc, ap + ir * kc, bp + jr * kc, acc, first);
            if (last)
              epilogue(batch, i0 + ir, j0 + jr, std::min<int64_t>(MR, rows - ir), std::min<int64_t>(NR, cols - jr), acc);
          }
      }
    }
  }

  void run(const CpuRuntime& rt) const {
    // Tasks: (batch entry, N block, M range). Split M only as far as needed to
    // give every thread work: each task packs its own B block.
    const int64_t tn = (p.n + kNc - 1) / kNc;
    const int64_t threads = rt.threads();
    const int64_t m_blocks = (p.m + kMc - 1) / kMc;
    const int64_t parts = std::clamp<int64_t>((2 * threads + p.batch * tn - 1) / (p.batch * tn), 1, m_blocks);
    const int64_t rows_per_part = (m_blocks + parts - 1) / parts * kMc;
    rt.parallel_for(p.batch * tn * parts, [&](int64_t t) {
      const int64_t b = t / (tn * parts), jn = (t / parts) % tn, part = t % parts;
      const int64_t m0 = part * rows_per_part, m1 = std::min(p.m, m0 + rows_per_part);
      const int64_t j0 = jn * kNc;
      if (m0 < m1) task(b, m0, m1, j0, std::min(kNc, p.n - j0));
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
