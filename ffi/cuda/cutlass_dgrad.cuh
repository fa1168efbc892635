// regemm_dgrad_dact's GEMM as a CUTLASS 3.x sm90 kernel: the dgrad GEMM of a
// layer with the act' of the layer below it in its epilogue,
//
//   gZ = (alpha * acc) * act'(S)          S (Z, or Y when from_y) an aux load
//
// through CUTLASS's LinCombDeEltAct (D = f(alpha * acc + beta * C, aux)) with
// this act' as f. The bias gradient is not here: the registry entry sums the
// stored gZ afterwards with the dact kernel's read-only pass
// (cutlass_registry.cu), as the cuBLASLt DGELU way does.
//
// Two choices make it run near the plain GEMM's speed at the narrow MLP's
// small K, where the epilogue is most of a tile's time (tools/tile_bench,
// 32768x512x512 bf16 relu on the H100: about 48 us against cuBLAS's plain
// GEMM's 35; the same kernel with every act' form behind one run-time switch
// with out-of-line calls, 64):
// - no C (ElementC = void): no C buffers in shared memory, and the builder
//   delays each subtile's TMA store behind the next subtile's math;
// - one act' slot per kernel (cutlass_dgrad.h, dgrad_act_slot): the cheap
//   forms inline behind a switch, each costly one in a kernel of its own.
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

// Out: the stored type (the rounding). Slot: the act' forms this kernel
// computes (cutlass_dgrad.h, dgrad_act_slot); the dispatch never hands it
// another.
template <class T, class Out, int Slot> struct DactFn {
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

template <class T, int N, class Out, int Slot> struct DactFn<cutlass::Array<T, N>, Out, Slot> {
  using Arguments = DactArgs;
  using Frag = cutlass::Array<T, N>;

  CUTLASS_HOST_DEVICE Frag operator()(Frag const& acc, Frag const& s, Arguments const& a) const {
    Frag g;
    if constexpr (Slot > 0) {
      dact_fragment<kOneActs[Slot - 1], false, Out>(g, acc, s, a);
    } else if (a.from_y) {  // uniform across the kernel: no divergence
      switch (Act(a.act)) {
        case Act::kRelu: dact_fragment<Act::kRelu, true, Out>(g, acc, s, a); break;
        case Act::kLeakyRelu: dact_fragment<Act::kLeakyRelu, true, Out>(g, acc, s, a); break;
        case Act::kSigmoid: dact_fragment<Act::kSigmoid, true, Out>(g, acc, s, a); break;
        case Act::kTanh: dact_fragment<Act::kTanh, true, Out>(g, acc, s, a); break;
        default: dact_fragment<Act::kNone, true, Out>(g, acc, s, a);
      }
    } else {
      switch (Act(a.act)) {
        case Act::kRelu: dact_fragment<Act::kRelu, false, Out>(g, acc, s, a); break;
        case Act::kLeakyRelu: dact_fragment<Act::kLeakyRelu, false, Out>(g, acc, s, a); break;
        case Act::kTanh: dact_fragment<Act::kTanh, false, Out>(g, acc, s, a); break;
        default: dact_fragment<Act::kNone, false, Out>(g, acc, s, a);
      }
    }
    return g;
  }
};

template <class Out, int Slot> struct DactFnOf {
  template <class T> using Fn = DactFn<T, Out, Slot>;
};

// The kernel: the mainloop of cutlass_gemm.cuh's GemmTypeOf (A row-major, B
// as stored), this epilogue without C. A type of its own rather than
// GemmTypeOf's, whose epilogue always has a C (beta * C in the forward) and
// whose header is in the forward kernels' stamp (cutlass.cmake).
template <DType D, bool TB, class Cfg, int Slot>
struct DgradGemmOf {
  using T = typename Elem<D>::type;
  static constexpr int kAlign = 16 / int(sizeof(T));  // TMA: 16-byte rows
  static_assert(D != DType::kF32 || TB, "TF32 wgmma takes B K-major: the f32 dgrad kernels are built with B transposed");
  using RowMajor = cutlass::layout::RowMajor;
  using LayoutB = std::conditional_t<TB, cutlass::layout::ColumnMajor, RowMajor>;
  using Fusion = cutlass::epilogue::fusion::LinCombDeEltAct<RowMajor, DactFnOf<T, Slot>::template Fn, T, float, T,
                                                            T, float>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor, kAlign, T, RowMajor, kAlign,
      typename Cfg::Epilogue, Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, RowMajor, kAlign, T, LayoutB, kAlign, float,
      typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Cfg::Mainloop>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, typename Cfg::Scheduler>;
};

// regemm_dgrad_dact's GEMM: gZ = (alpha op(A) op(B)) act'(S) (cutlass_dgrad.h).
template <DType D, bool TB, int Slot>
Status run_dgrad_dact(const GemmProblem& p, const DactProblem& d, const DgradOperands& o, const Launch& l) {
  using G = DgradGemmOf<D, TB, ConfigTraits<kDgradConfig, kTileK<D>>, Slot>;
  using T = typename G::T;
  using K = typename G::Kernel;
  const bool one = p.batch == 1;
  const int64_t d_batch = one ? 0 : p.m * p.n;
  typename G::CollectiveEpilogue::FusionCallbacks::Arguments fa;
  fa.alpha = 1.0f;  // alpha is the act' node's (DactFn), as in the dact kernels
  fa.beta = 0.0f;
  fa.activation = DactArgs{int(d.act), float(d.slope), float(p.alpha), d.from_y};
  fa.aux_ptr = static_cast<const T*>(o.s);
  fa.dAux = make_stride3<decltype(fa.dAux)>(p.n, one ? 0 : d.stride_s);
  typename K::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {int(p.m), int(p.n), int(p.k), int(p.batch)},
      {static_cast<const T*>(o.a), make_stride3<typename K::StrideA>(p.lda(), one ? 0 : p.stride_a),
       static_cast<const T*>(o.b), make_stride3<typename K::StrideB>(p.ldb(), one ? 0 : p.stride_b)},
      {fa, nullptr, make_stride3<typename K::StrideC>(p.n, d_batch), static_cast<T*>(o.gz),
       make_stride3<typename K::StrideD>(p.n, d_batch)},
      hardware(l)};
  return enqueue<K>(args, l);
}

}  // namespace regemm::cutlass_sm90
