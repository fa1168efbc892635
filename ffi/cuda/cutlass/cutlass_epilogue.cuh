// The regemm epilogue as a CUTLASS 3.x sm90 epilogue visitor tree (EVT):
//
//   Z = beta * C + (alpha * acc + (bias_n + bias_m + bias_s))     (f32)
//   Y = act(Z)                                              (act chosen at run time)
//   Z is stored beside Y when a pointer is given (Sm90AuxStore: nullptr = no-op).
//
// One compiled epilogue serves every bias kind, activation and store_z:
// - bias along D's columns (bias_n[j]): Sm90RowBroadcast; along D's rows
//   (bias_m[i]): Sm90ColBroadcast; a scalar: Sm90ScalarBroadcast from a
//   pointer. Those not in use have null pointers and add a zero without loading.
//   (A dynamic-stride RowBroadcast serving per-column and scalar alike cost 8%
//   at 16384x4096x4096: static strides only.)
// - C: the beta*C node skips C's load when beta == 0, but a kernel built with
//   a C still holds C's shared-memory buffers and does not delay its TMA
//   stores behind the next subtile's math: at the narrow MLP's K = 512 that is
//   about 10 us of a 57 us ping-pong kernel (32768x512x512, tools/tile_bench,
//   H100). So the kernels of one activation (kOneActs, the narrow layers'
//   forward) are built without C (ES void: Z = X) and serve problems without
//   one; the every-activation kernels keep it.
// - the activation: a compute node whose functor calls regemm::act_fwd with the
//   GPU's fast elementary functions (activation.h's FastMath; the outputs are
//   bf16/f16/TF32-precision), the one place the activation math lives. The
//   switch sits outside the per-fragment loop, so each case compiles to the
//   straight-line code of one activation; the costly ones are out-of-line
//   calls in the tile configurations that say so (ActFn below says why). A
//   kernel compiled for one activation (OneAct >= 0) has no switch.
// - D (and Z) row-major, or column-major for kernels that compute Y^T = B^T A^T
//   (cutlass_gemm.cuh: the f32 layout TF32 wgmma cannot take directly).
//
// Packaged as a FusionOperation + FusionCallbacks pair so that CUTLASS's
// epilogue builder supplies the aux store's smem layout and copy atom.
#pragma once

#include <type_traits>

#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"

#include "regemm/activation.h"
#include "cutlass_kernels.h"

namespace regemm::cutlass_sm90 {

// Run-time arguments of the activation node (CUTLASS's Sm90Compute passes a
// functor's `Arguments` member to its call operator).
struct ActArgs {
  int act = int(Act::kNone);
  float slope = 0.01f;
};

// Call: the costly activations as out-of-line calls (below). OneAct: kAnyAct
// (cutlass_kernels.h), or the one activation computed, whatever a.act says
// (run_gemm refuses problems with another).
template <class T, bool Call, int OneAct>
struct ActFn {
  using Arguments = ActArgs;
  CUTLASS_HOST_DEVICE T operator()(T const& z, Arguments const& a) const {
    return act_fwd<T, FastMath>(OneAct == kAnyAct ? Act(a.act) : Act(OneAct), z, T(a.slope));
  }
};

// act over a fragment with the activation a compile-time constant, so that
// act_fwd's switch folds away and the loop is straight-line code.
template <Act A, class T, int N>
CUTLASS_HOST_DEVICE void act_fragment(cutlass::Array<T, N>& y, cutlass::Array<T, N> const& z, T slope) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < N; ++i) y[i] = act_fwd<T, FastMath>(A, z[i], slope);
}

#if defined(__CUDA_ARCH__)
// The same, as one out-of-line copy per activation and fragment type.
template <Act A, class T, int N>
__device__ __noinline__ cutlass::Array<T, N> act_fragment_call(cutlass::Array<T, N> z, T slope) {
  cutlass::Array<T, N> y;
  act_fragment<A>(y, z, slope);
  return y;
}
#endif

// With Call, the costly activations (gelu, gelu_erf, sigmoid, silu: two MUFU
// ops and up to a dozen FMAs per element) are calls to act_fragment_call; the
// cheap ones (relu, leaky_relu, tanh: one or two instructions) are always
// inline. CUTLASS unrolls the epilogue over a tile's subtiles (8 subtiles of
// 64x32 for ping-pong 128x128, a 16-element fragment per thread each), so an
// inlined activation is copied 8 times, for each of the 8 cases: 168 KB of
// code in all, more than an SM's instruction cache holds. That costs where a
// CTA runs few tiles and so meets the code cold; where it runs many, the
// calls cost instead. Hence per tile configuration (ConfigTraits::kActCall).
// Measured (session 10), bf16 ping-pong 128x128: tools/tile_bench, cold,
// gelu_erf 4096x4096x1024 76.5 -> 61.9 us and 8192x1024x4096 257 -> 162 us,
// silu 60 -> 56 and 153 -> 138 us; the benchmark (back to back) at
// 16384x4096x4096 (16 waves) gelu_erf 0.740 -> 0.805 ms, silu 0.760 -> 0.790.
// A kernel of one activation has neither cost: its one copy is inline
// (session 13, tile_bench, ping-pong 128x128 1x1, cold, 8192x1024x4096:
// sigmoid 147 -> 120 us, silu 151 -> 125, gelu 153 -> 138; gelu_erf 172 either
// way, until FastMath's ex2/rcp flushed subnormals: 132, activation.h).
template <class T, int N, bool Call, int OneAct>
struct ActFn<cutlass::Array<T, N>, Call, OneAct> {
  using Arguments = ActArgs;
  using Frag = cutlass::Array<T, N>;

  template <Act A>
  static CUTLASS_HOST_DEVICE void costly(Frag& y, Frag const& z, T slope) {
#if defined(__CUDA_ARCH__)
    if constexpr (Call) {
      y = act_fragment_call<A>(z, slope);
      return;
    }
#endif
    act_fragment<A>(y, z, slope);
  }

  CUTLASS_HOST_DEVICE Frag operator()(Frag const& z, Arguments const& a) const {
    Frag y;
    const T slope = T(a.slope);
    if constexpr (OneAct != kAnyAct) {
      act_fragment<Act(OneAct)>(y, z, slope);
    } else {
      switch (Act(a.act)) {  // uniform across the kernel: no divergence
        case Act::kNone: y = z; break;
        case Act::kRelu: act_fragment<Act::kRelu>(y, z, slope); break;
        case Act::kLeakyRelu: act_fragment<Act::kLeakyRelu>(y, z, slope); break;
        case Act::kGelu: costly<Act::kGelu>(y, z, slope); break;
        case Act::kGeluErf: costly<Act::kGeluErf>(y, z, slope); break;
        case Act::kSigmoid: costly<Act::kSigmoid>(y, z, slope); break;
        case Act::kTanh: act_fragment<Act::kTanh>(y, z, slope); break;
        case Act::kSilu: costly<Act::kSilu>(y, z, slope); break;
        default: y = z;
      }
    }
    return y;
  }
};

// ActFn with the choices made, as the one-parameter template CUTLASS's
// Sm90Compute takes.
template <bool Call, int OneAct> struct ActFnOf {
  template <class T> using Fn = ActFn<T, Call, OneAct>;
};

// The fusion "operation" tag: what the epilogue computes, free of tile details
// (ActCall, OneAct: see ActFn).
template <class ElementOutput_, class ElementCompute_, class ElementBias_, class ElementSource_, class LayoutD_,
          bool ActCall, int OneAct>
struct RegemmFusion : cutlass::epilogue::fusion::FusionOperation {
  using ElementOutput = ElementOutput_;
  using ElementCompute = ElementCompute_;
  static constexpr auto RoundStyle = cutlass::FloatRoundStyle::round_to_nearest;

  using ElementSource = ElementSource_;  // void: a kernel without C
  static constexpr bool IsSourceSupported = !std::is_void_v<ElementSource_>;

  using ElementScalar = ElementCompute_;
  static constexpr int AlignmentScalar = 1;

  using ElementBias = ElementBias_;
  static constexpr int AlignmentBias = 1;  // bias may sit at any element offset (batched outer loops)
  static constexpr bool IsPerRowBiasSupported = true;
  static constexpr bool IsPerColBiasSupported = true;

  using ActivationFn = ActFn<ElementCompute_, ActCall, OneAct>;
  static constexpr bool IsEltActSupported = true;

  using ElementAux = ElementOutput_;  // Z has Y's type
  using GmemLayoutTagAux = LayoutD_;
  static constexpr int AlignmentAux = 128 / cute::sizeof_bits_v<ElementOutput_>;
  static constexpr bool IsAuxOutSupported = true;
};

namespace evt {
using namespace cutlass::epilogue::fusion;
using cute::_0;
using cute::_1;
using cute::Stride;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// X = alpha * acc + bias, bias = (bias_n[j] + bias_m[i]) + bias_s.
template <class CtaTile, class EC, class EB>
using AlphaAccBias =
    Sm90EVT<Sm90Compute<cutlass::homogeneous_multiply_add, EC, EC, kRound>,      // X = alpha * acc + bias
      Sm90ScalarBroadcast<EC, Stride<_0, _0, int64_t>>,                          //   alpha
      Sm90AccFetch,                                                              //   acc
      Sm90EVT<Sm90Compute<cutlass::plus, EC, EC, kRound>,                        //   bias = (n + m) + s
        Sm90EVT<Sm90Compute<cutlass::plus, EC, EC, kRound>,
          Sm90RowBroadcast<0, CtaTile, EB, EC, Stride<_0, _1, int64_t>, 1>,      //     bias_n[j]
          Sm90ColBroadcast<0, CtaTile, EB, EC, Stride<_1, _0, int64_t>, 1>>,     //     bias_m[i]
        Sm90ScalarBroadcast<EB, Stride<_0, _0, int64_t>>>>;                      //     bias_s

// Z = beta * C + X, or X in a kernel without C (ES void).
template <class EC, class ES, class X> struct ZOf {
  using type = Sm90EVT<Sm90Compute<cutlass::homogeneous_multiply_add, EC, EC, kRound>,  // Z = beta * C + X
                       Sm90ScalarBroadcast<EC, Stride<_0, _0, int64_t>>,                //   beta
                       Sm90SrcFetch<ES>,                                                //   C
                       X>;
};
template <class EC, class X> struct ZOf<EC, void, X> {
  using type = X;
};

template <class CtaTile, class EpiTile, int StagesD, class SmemLayoutAtom, class CopyOpR2S, class EO, class EC,
          class EB, class ES, class StrideZ, bool ActCall, int OneAct>
using Tree =
    Sm90EVT<Sm90Compute<ActFnOf<ActCall, OneAct>::template Fn, EO, EC, kRound>,     // Y = act(Z)
      Sm90EVT<Sm90AuxStore<StagesD, EpiTile, EO, kRound, StrideZ, SmemLayoutAtom, CopyOpR2S>,  // store Z (optional)
        typename ZOf<EC, ES, AlphaAccBias<CtaTile, EC, EB>>::type>>;
}  // namespace evt

}  // namespace regemm::cutlass_sm90

namespace cutlass::epilogue::fusion {

template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore, class EO, class EC,
          class EB, class ES, class LayoutD, bool ActCall, int OneAct, class CtaTileShapeMNK, class EpilogueTile,
          class SmemLayoutAtom, class CopyOpR2S>
struct FusionCallbacks<epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore>,
                       regemm::cutlass_sm90::RegemmFusion<EO, EC, EB, ES, LayoutD, ActCall, OneAct>, CtaTileShapeMNK,
                       EpilogueTile, SmemLayoutAtom, CopyOpR2S>
    : regemm::cutlass_sm90::evt::Tree<CtaTileShapeMNK, EpilogueTile, StagesD, SmemLayoutAtom, CopyOpR2S, EO, EC, EB,
                                      ES, cutlass::gemm::TagToStrideC_t<LayoutD>, ActCall, OneAct> {
  using StrideZ = cutlass::gemm::TagToStrideC_t<LayoutD>;
  using Impl = regemm::cutlass_sm90::evt::Tree<CtaTileShapeMNK, EpilogueTile, StagesD, SmemLayoutAtom, CopyOpR2S,
                                               EO, EC, EB, ES, StrideZ, ActCall, OneAct>;
  using Operation = regemm::cutlass_sm90::RegemmFusion<EO, EC, EB, ES, LayoutD, ActCall, OneAct>;

  // Flat, named arguments; converted to the tree's nested ones below. Biases
  // are in D's coordinates (for a transposed problem the caller swaps them).
  struct Arguments {
    EC alpha = EC(1);
    EC beta = EC(0);
    EB const* bias_n = nullptr;  // bias_n[j], j < N
    int64_t bias_n_batch_stride = 0;
    EB const* bias_m = nullptr;  // bias_m[i], i < M
    int64_t bias_m_batch_stride = 0;
    EB const* bias_s = nullptr;  // bias_s[0]
    int64_t bias_s_batch_stride = 0;
    EO* z = nullptr;             // null: Z not stored
    StrideZ dz = {};
    regemm::cutlass_sm90::ActArgs act = {};

    operator typename Impl::Arguments() const {
      using cute::_0;
      using cute::_1;
      using XArgs = typename regemm::cutlass_sm90::evt::AlphaAccBias<CtaTileShapeMNK, EC, EB>::Arguments;
      const XArgs x{  // X = alpha * acc + bias
          {{alpha}, {nullptr}, {{_0{}, _0{}, int64_t(0)}}},  // alpha
          {},                                                // acc
          {  // bias = (n + m) + s
              {{bias_n, EB(0), {_0{}, _1{}, bias_n_batch_stride}},
               {bias_m, EB(0), {_1{}, _0{}, bias_m_batch_stride}},
               {}},
              {{EB(0)}, {bias_s}, {{_0{}, _0{}, bias_s_batch_stride}}},
              {}},
          {}};
      if constexpr (std::is_void_v<ES>) {
        return {{x, {z, dz}}, act};  // Y = act(Z), store Z, Z = X
      } else {
        return {  // Y = act(Z)
            {  // store Z
                {  // Z = beta * C + X
                    {{beta}, {nullptr}, {{_0{}, _0{}, int64_t(0)}}},  // beta
                    {},                                               // C
                    x,
                    {}},
                {z, dz}},
            act};
      }
    }
  };

  using Impl::Impl;
};

}  // namespace cutlass::epilogue::fusion
