// regemm_dgrad_dact's GEMM as a CUTLASS 3.x sm90 kernel: the dgrad GEMM of a
// layer with the backward epilogue of the layer below it in its epilogue
// visitor tree,
//
//   gZ = (alpha * acc) * act'(S)          S (Z, or Y when from_y) read as C
//   partials[tile_m][j] = sum of gZ[i][j] over the tile's 128 rows   (f32)
//
// gZ is rounded to the output type before the reduction sums it (the bias
// gradient sums gZ as stored, as the dact kernels do); the partials are summed
// in order afterwards (cutlass_dispatch.cu), so the bias gradient is
// deterministic. The GEMM itself is cutlass_gemm.cuh's, with this epilogue.
//
// Included only by the generated instantiation TUs (cutlass_dgrad_inst.cu.in).
#pragma once

#include <type_traits>

#include "cutlass_dgrad.h"
#include "cutlass_gemm.cuh"

namespace regemm::cutlass_sm90 {

// Run-time arguments of the act' node (Sm90Compute hands a functor's
// `Arguments` member to its call operator).
struct DactArgs {
  int act = int(Act::kNone);
  float slope = 0.01f;
  float alpha = 1.0f;
  bool from_y = false;
};

template <Act A, bool FromY, class Out, class T, int N>
CUTLASS_HOST_DEVICE void dact_fragment(cutlass::Array<T, N>& g, cutlass::Array<T, N> const& acc,
                                       cutlass::Array<T, N> const& s, DactArgs const& a) {
  using M = std::conditional_t<sizeof(Out) == 2, FastMath, PreciseMath>;  // as dact.cu
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < N; ++i) {
    const T d = FromY ? act_grad_from_y(A, s[i], T(a.slope)) : act_grad<T, M>(A, s[i], T(a.slope));
    g[i] = T(Out(T(a.alpha) * acc[i] * d));
  }
}

#if defined(__CUDA_ARCH__)
template <Act A, class Out, class T, int N>
__device__ __noinline__ cutlass::Array<T, N> dact_fragment_call(cutlass::Array<T, N> acc, cutlass::Array<T, N> s,
                                                                DactArgs a) {
  cutlass::Array<T, N> g;
  dact_fragment<A, false, Out>(g, acc, s, a);
  return g;
}
#endif

// Out: the stored type (the rounding). The costly act' forms (gelu, gelu_erf,
// sigmoid, silu from Z) are out-of-line calls: one copy each, not one per
// epilogue subtile (ActFn above says why).
template <class T, class Out> struct DactFn {
  using Arguments = DactArgs;
  CUTLASS_HOST_DEVICE T operator()(T const& acc, T const& s, Arguments const& a) const {
    cutlass::Array<T, 1> g, x, y;
    x[0] = acc;
    y[0] = s;
    with_act(Act(a.act), [&](auto act) {
      if (a.from_y) dact_fragment<decltype(act)::value, true, Out>(g, x, y, a);
      else dact_fragment<decltype(act)::value, false, Out>(g, x, y, a);
    });
    return g[0];
  }
};

template <class T, int N, class Out> struct DactFn<cutlass::Array<T, N>, Out> {
  using Arguments = DactArgs;
  using Frag = cutlass::Array<T, N>;

  template <Act A>
  static CUTLASS_HOST_DEVICE void costly(Frag& g, Frag const& acc, Frag const& s, Arguments const& a) {
#if defined(__CUDA_ARCH__)
    g = dact_fragment_call<A, Out>(acc, s, a);
#else
    dact_fragment<A, false, Out>(g, acc, s, a);
#endif
  }

  CUTLASS_HOST_DEVICE Frag operator()(Frag const& acc, Frag const& s, Arguments const& a) const {
    Frag g;
    if (a.from_y) {  // relu, leaky_relu, sigmoid, tanh: a few instructions each
      switch (Act(a.act)) {
        case Act::kRelu: dact_fragment<Act::kRelu, true, Out>(g, acc, s, a); break;
        case Act::kLeakyRelu: dact_fragment<Act::kLeakyRelu, true, Out>(g, acc, s, a); break;
        case Act::kSigmoid: dact_fragment<Act::kSigmoid, true, Out>(g, acc, s, a); break;
        case Act::kTanh: dact_fragment<Act::kTanh, true, Out>(g, acc, s, a); break;
        default: dact_fragment<Act::kNone, true, Out>(g, acc, s, a);
      }
      return g;
    }
    switch (Act(a.act)) {  // uniform across the kernel: no divergence
      case Act::kRelu: dact_fragment<Act::kRelu, false, Out>(g, acc, s, a); break;
      case Act::kLeakyRelu: dact_fragment<Act::kLeakyRelu, false, Out>(g, acc, s, a); break;
      case Act::kTanh: dact_fragment<Act::kTanh, false, Out>(g, acc, s, a); break;
      case Act::kGelu: costly<Act::kGelu>(g, acc, s, a); break;
      case Act::kGeluErf: costly<Act::kGeluErf>(g, acc, s, a); break;
      case Act::kSigmoid: costly<Act::kSigmoid>(g, acc, s, a); break;
      case Act::kSilu: costly<Act::kSilu>(g, acc, s, a); break;
      default: dact_fragment<Act::kNone, false, Out>(g, acc, s, a);
    }
    return g;
  }
};

template <class Out> struct DactFnOf {
  template <class T> using Fn = DactFn<T, Out>;
};

// The fusion "operation" tag of the dgrad GEMM's epilogue: D row-major, the
// bias gradient's per-tile partial sums as a row vector per 128-row tile.
template <class ElementOutput_, class ElementCompute_, class ElementSource_>
struct DgradDactFusion : cutlass::epilogue::fusion::FusionOperation {
  using ElementOutput = ElementOutput_;
  using ElementCompute = ElementCompute_;
  static constexpr auto RoundStyle = cutlass::FloatRoundStyle::round_to_nearest;
  using ElementSource = ElementSource_;
  static constexpr bool IsSourceSupported = true;
};

namespace evt {  // (cutlass_epilogue.cuh's: its names and kRound)

// gZ = (alpha acc) act'(S), with the column sums of each CTA tile's gZ written
// to a [tiles_m, round_up(N, tile_n)] f32 buffer (FinalReduction false: no
// atomics, no tile counters; the sum over tiles is a kernel of its own, in order).
template <class CtaTile, class EO, class EC, class ES>
using DgradDactTree =
    Sm90EVT<Sm90RowReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, CtaTile, EC, EC, kRound,
                             Stride<_0, _1, int64_t>, 128 / cutlass::sizeof_bits<EC>::value, true, false>,  // partials
      Sm90EVT<Sm90Compute<DactFnOf<EO>::template Fn, EC, EC, kRound>,                                       // gZ
        Sm90AccFetch,                                                                                       //   acc
        Sm90SrcFetch<ES>>>;                                                                                 //   S
}  // namespace evt

}  // namespace regemm::cutlass_sm90

namespace cutlass::epilogue::fusion {

template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore, class EO, class EC,
          class ES, class CtaTileShapeMNK, class EpilogueTile>
struct FusionCallbacks<epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore>,
                       regemm::cutlass_sm90::DgradDactFusion<EO, EC, ES>, CtaTileShapeMNK, EpilogueTile>
    : regemm::cutlass_sm90::evt::DgradDactTree<CtaTileShapeMNK, EO, EC, ES> {
  using Impl = regemm::cutlass_sm90::evt::DgradDactTree<CtaTileShapeMNK, EO, EC, ES>;
  using Operation = regemm::cutlass_sm90::DgradDactFusion<EO, EC, ES>;

  struct Arguments {
    regemm::cutlass_sm90::DactArgs dact = {};
    EC* partials = nullptr;        // null: no bias gradient
    int64_t partials_batch = 0;    // elements between batch entries' partials

    operator typename Impl::Arguments() const {
      using cute::_0;
      using cute::_1;
      return {  // partials
          {  // gZ
              {},     // acc
              {},     // S
              dact},
          {partials, EC(0), {_0{}, _1{}, partials_batch}}};
    }
  };

  using Impl::Impl;
};

}  // namespace cutlass::epilogue::fusion

namespace regemm::cutlass_sm90 {

// regemm_dgrad_dact's GEMM: gZ = (alpha op(A) op(B)) act'(S), S read as C, and
// the bias gradient's per-tile partial sums (cutlass_dgrad.h, DgradOperands).
template <DType D, bool TB, Config C>
Status run_dgrad_dact(const GemmProblem& p, const DactProblem& d, const DgradOperands& o, const Launch& l) {
  using G = GemmType<D, false, TB, C, kAnyAct, DgradDactFusion<typename Elem<D>::type, float, typename Elem<D>::type>>;
  static_assert(!G::kSwap, "the bias gradient's reduction runs along D's columns");
  using T = typename G::T;
  using K = typename G::Kernel;
  const bool one = p.batch == 1;
  typename G::CollectiveEpilogue::FusionCallbacks::Arguments fa;
  fa.dact = DactArgs{int(d.act), float(d.slope), float(p.alpha), d.from_y};
  fa.partials = o.partials;
  fa.partials_batch = one ? 0 : o.partials_batch;
  typename K::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {int(p.m), int(p.n), int(p.k), int(p.batch)},
      {static_cast<const T*>(o.a), make_stride3<typename K::StrideA>(p.lda(), one ? 0 : p.stride_a),
       static_cast<const T*>(o.b), make_stride3<typename K::StrideB>(p.ldb(), one ? 0 : p.stride_b)},
      {fa, static_cast<const T*>(o.s), make_stride3<typename K::StrideC>(p.n, one ? 0 : d.stride_s),
       static_cast<T*>(o.gz), make_stride3<typename K::StrideD>(p.n, one ? 0 : p.m * p.n)},
      hardware(l)};
  return enqueue<K>(args, l);
}

}  // namespace regemm::cutlass_sm90
