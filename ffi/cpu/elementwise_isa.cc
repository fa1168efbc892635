// The elementwise epilogues for one instruction set: CMake compiles this file
// once per set, naming it with REGEMM_ISA (and its -march), so each copy's
// loops vectorize to that width. The loops are branch-free per activation
// (with_act makes the activation a compile-time constant).
#include <vector>

#include "regemm/activation.h"
#include "regemm/numeric.h"
#include "elementwise.h"

#ifndef REGEMM_ISA
#error "REGEMM_ISA names the instruction set this copy is compiled for"
#endif

namespace regemm::REGEMM_ISA {
namespace {

// In place (z == y: Y = act(Y) where Z is not kept) through one pointer, else
// through two restrict ones: either way the loop vectorizes without a run-time
// overlap check, whose fallback (taken in place) is the scalar loop.
template <class T, Act kAct>
void act_in_place(T* __restrict y, typename Acc<T>::type s, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  for (int64_t i = begin; i < end; ++i) y[i] = store<T>(act_fwd(kAct, load<A>(y[i]), s));
}

template <class T, Act kAct>
void act_copy(const T* __restrict z, T* __restrict y, typename Acc<T>::type s, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  for (int64_t i = begin; i < end; ++i) y[i] = store<T>(act_fwd(kAct, load<A>(z[i]), s));
}

template <class T> void act_t(Act act, double slope, const void* z, void* y, int64_t begin, int64_t end) {
  const acc_t<T> s = acc_t<T>(slope);
  with_act(act, [&](auto a) {
    constexpr Act k = decltype(a)::value;
    if (z == y) act_in_place<T, k>(static_cast<T*>(y), s, begin, end);
    else act_copy<T, k>(static_cast<const T*>(z), static_cast<T*>(y), s, begin, end);
  });
}

// kInPlace: gY is gZ's buffer (regemm_dgrad_dact), read through gz; gy is unused.
// kSums: a bias gradient is taken (col or row_sums not null); without one the
// loop is gZ alone.
template <class T, Act kAct, bool kFromY, bool kInPlace, bool kSums>
void dact_t(const DactProblem& p, const T* __restrict gy, const T* __restrict s, T* __restrict gz, int64_t i0,
            int64_t i1, double* col, double* row_sums) {
  using A = acc_t<T>;
  const A slope = A(p.slope);
  thread_local std::vector<A> g;
  if (kSums) g.resize(p.n);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t off = i * p.n;
    for (int64_t j = 0; j < p.n; ++j) {  // vectorizes: no calls, selects only
      const A sv = load<A>(s[off + j]);
      const A d = kFromY ? act_grad_from_y(kAct, sv, slope) : act_grad(kAct, sv, slope);
      const A x = load<A>(kInPlace ? gz[off + j] : gy[off + j]) * d;
      gz[off + j] = store<T>(x);
      // The bias gradient sums gZ as stored (one use of a 16-bit struct per
      // statement: GCC vectorizes that, not two).
      if (kSums) g[j] = load<A>(store<T>(x));
    }
    if (row_sums) {  // only for the bias kinds made of row sums
      // Eight running sums, one per column modulo 8, then added in a fixed
      // order: as deterministic as one running sum, and it vectorizes (one
      // running sum is a chain of dependent adds as long as the pass itself).
      double part[8] = {};
      int64_t j = 0;
      for (; j + 8 <= p.n; j += 8)
        for (int k = 0; k < 8; ++k) part[k] += double(g[j + k]);
      double r = 0.0;
      for (; j < p.n; ++j) r += double(g[j]);
      for (double v : part) r += v;
      row_sums[i - i0] = r;
    }
    if (col)
      for (int64_t j = 0; j < p.n; ++j) col[j] += double(g[j]);
  }
}

template <class T>
void dact_rows_t(const DactProblem& p, const void* gy, const void* s, void* gz, int64_t i0, int64_t i1, double* col,
                 double* row_sums) {
  with_act(p.act, [&](auto act) {
    constexpr Act k = decltype(act)::value;
    auto run = [&](auto from_y, auto in_place, auto sums) {
      dact_t<T, k, decltype(from_y)::value, decltype(in_place)::value, decltype(sums)::value>(
          p, in_place ? nullptr : static_cast<const T*>(gy), static_cast<const T*>(s), static_cast<T*>(gz), i0, i1,
          col, row_sums);
    };
    auto with_sums = [&](auto from_y, auto in_place) {
      col || row_sums ? run(from_y, in_place, std::true_type{}) : run(from_y, in_place, std::false_type{});
    };
    auto with_place = [&](auto from_y) {
      gy == gz ? with_sums(from_y, std::true_type{}) : with_sums(from_y, std::false_type{});
    };
    p.from_y ? with_place(std::true_type{}) : with_place(std::false_type{});
  });
}

void act(DType t, Act a, double slope, const void* z, void* y, int64_t begin, int64_t end) {
  switch (t) {
    case DType::kF32: return act_t<float>(a, slope, z, y, begin, end);
    case DType::kF64: return act_t<double>(a, slope, z, y, begin, end);
    case DType::kBF16: return act_t<bf16_t>(a, slope, z, y, begin, end);
    case DType::kF16: return act_t<f16_t>(a, slope, z, y, begin, end);
  }
}

void dact_rows(const DactProblem& p, const void* gy, const void* s, void* gz, int64_t i0, int64_t i1, double* col,
               double* row_sums) {
  switch (p.dtype) {
    case DType::kF32: return dact_rows_t<float>(p, gy, s, gz, i0, i1, col, row_sums);
    case DType::kF64: return dact_rows_t<double>(p, gy, s, gz, i0, i1, col, row_sums);
    case DType::kBF16: return dact_rows_t<bf16_t>(p, gy, s, gz, i0, i1, col, row_sums);
    case DType::kF16: return dact_rows_t<f16_t>(p, gy, s, gz, i0, i1, col, row_sums);
  }
}

}  // namespace

extern const ElementwiseKernels kElementwise = {act, dact_rows};

}  // namespace regemm::REGEMM_ISA
