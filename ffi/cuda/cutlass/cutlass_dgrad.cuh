// regemm_dgrad_dact's GEMM as a CUTLASS 3.x sm90 kernel: the dgrad GEMM of a
// layer with the act' of the layer below it, and that layer's bias gradient,
// in its epilogue:
//
//   gZ = (alpha * acc) * act'(S)              S (Z, or Y when from_y) an aux load
//   partials[r][j] = sum of gZ[i][j] over the rows i of one warp in one CTA tile
//
// The partial sums (f32, of gZ as stored, as the dact kernels sum it) are
// added in order by a small kernel after it (cutlass_dispatch.cu):
// deterministic, no atomics. Without a bias gradient the partials' pointer is
// null and the sums are skipped.
//
// Three choices make it run near the plain GEMM's speed at the narrow MLP's
// small K, where the epilogue is most of a tile's time (tools/tile_bench,
// 32768x512x512 bf16 relu on the H100: about 48 us against cuBLAS's plain
// GEMM's 35):
// - no C (ElementC = void): no C buffers in shared memory, and the builder
//   delays each subtile's TMA store behind the next subtile's math;
// - one act' slot per kernel (cutlass_dgrad.h, dgrad_act_slot): the cheap
//   forms inline behind a switch, each costly one and relu from Y in a kernel
//   of its own (every form behind one run-time switch with out-of-line calls:
//   64 us);
// - column sums that live in registers for one column of epilogue subtiles
//   only (ColSumPartials below): 2-3 us of a bf16 relu layer's 49 inside the
//   32768x512x12 step, against 70 for cuBLAS's GEMM and the act' pass.
//   CUTLASS's Sm90RowReduction keeps a row of the whole CTA tile per thread,
//   indexed by the subtile; the epilogue's loop over subtiles is not unrolled,
//   so that row lived in local memory (a 576-byte stack frame, and 104 us a
//   layer).
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
  // The GPU's approximate exp and division (FastMath, ~1e-7 relative) for every dtype: these
  // kernels are 16-bit or TF32 GEMMs (exact f32 runs elsewhere), whose product carries that
  // precision, and the epilogue's math is most of a tile's time at small K. (The composed
  // way's dact pass, which also serves exact f32 and is bound by memory, keeps the precise
  // forms for f32.)
  using M = FastMath;
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
      constexpr DgradForm f = dgrad_slot_form(Slot);
      dact_fragment<f.act, f.from_y, Out>(g, acc, s, a);
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

// The fusion "operation" tag of the epilogue below: gZ row-major, S an aux
// load of the same type and layout.
template <class T, int Slot>
struct DgradDactFusion : cutlass::epilogue::fusion::FusionOperation {
  using ElementOutput = T;
  using ElementCompute = float;
  static constexpr auto RoundStyle = cutlass::FloatRoundStyle::round_to_nearest;
  using ElementAux = T;
  using GmemLayoutTagAux = cutlass::layout::RowMajor;
  static constexpr int AlignmentAux = 128 / cute::sizeof_bits_v<T>;
  static constexpr bool IsAuxInSupported = true;
};

namespace evt {  // (cutlass_epilogue.cuh's: its names and kRound)

// The bias gradient's column sums as an epilogue node: passes gZ through and
// adds it, rounded to T as stored, into this thread's sums of its columns of
// the current epilogue subtile (a register tensor of one subtile's columns,
// indexed at compile time). The epilogue walks a CTA tile's subtiles column of
// subtiles by column (epi_n outer, epi_m inner: sm90_epilogue_tma_warpspecialized.hpp),
// so after a column's last subtile the sums are complete for this warp's rows:
// the lanes that share columns add theirs with shuffles in a fixed order (reduce
// below) and write the warp's sums to its row of partials,
//
//   partials[(l * tiles_m + m) * RowsPerTile + warp][n * CTA_N + j]      (ld apart)
//
// for CTA tile (m, n) of batch entry l. No check against the problem's edge:
// outside it TMA loads zeros for A, B and S, so acc = 0 and gZ = 0 * act'(0) = 0
// (every act' is finite at 0); the partials' rows are N rounded up to the tile.
template <class T, int RowsPerTile>
struct ColSumPartials {
  struct SharedStorage {};
  struct Arguments {
    float* ptr = nullptr;  // null: no sums
    int64_t ld = 0;        // floats a row
    int64_t rows = 0;      // rows a batch entry (tiles_m * RowsPerTile)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE ColSumPartials() {}
  CUTLASS_HOST_DEVICE ColSumPartials(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(ProducerLoadArgs<Args...> const&) {
    return EmptyProducerLoadCallbacks{};
  }

  template <class Sums, class Out, class Lanes, int LastM>
  struct ConsumerStoreCallbacks : EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Sums sums, Out out, Lanes lanes, int lane_m, bool on)
        : sums(sums), out(out), lanes(lanes), lane_m(lane_m), on(on) {}
    Sums sums;  // (CPY, CPY_M, CPY_N) of one subtile, stride 0 along M: a value a column
    Out out;    // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): this warp's row of partials, stride 0 along M
    Lanes lanes;  // (lane_m, lane_n) -> lane
    int lane_m;
    bool on;

    template <class EA, class EI, int F>
    CUTLASS_DEVICE cutlass::Array<EI, F> visit(cutlass::Array<EA, F> const&, int epi_v, int, int,
                                               cutlass::Array<EI, F> const& gz) {
      if (on) {
        const cutlass::Array<T, F> stored = cutlass::NumericArrayConverter<T, EI, F, kRound>{}(gz);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < F; ++i) sums(epi_v * F + i) += float(stored[i]);
      }
      return gz;
    }

    // After a column of subtiles: the sums of the lanes along M added up by
    // halving exchanges: at each step a lane sends the half of its values that
    // its partner keeps (8 values over 8 lanes in every kernel built: 7
    // shuffles), and ends with n / L of them, which it writes: every column of
    // the subtile by one lane.
    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor) {
      if (!on || epi_m != LastM) return;
      auto s = cute::filter(sums);
      auto o = cute::filter(out(cute::_, cute::_, cute::_, _0{}, epi_n));
      constexpr int n = decltype(cute::size(s))::value, L = decltype(cute::size<0>(Lanes{}))::value;
      static_assert(n % L == 0, "each lane along M ends with whole values");
      float v[n];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < n; ++i) v[i] = s(i);
      CUTLASS_PRAGMA_UNROLL
      for (int h = L / 2, half = n / 2; h > 0; h /= 2, half /= 2) {
        const bool upper = lane_m & h;
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < half; ++r) {
          const float send = upper ? v[r] : v[r + half];
          const float keep = upper ? v[r + half] : v[r];
          v[r] = keep + __shfl_xor_sync(0xffffffffu, send, lanes(h, _0{}));
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < n / L; ++r) o(n / L * lane_m + r) = v[r];
      cute::fill(sums, 0.0f);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    // Which lanes and warps share columns (as Sm90RowReduction finds them).
    Layout ref_layout_MN = [&]() {
      auto mn_shape = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
      if constexpr (ReferenceSrc) return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
      else return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
    }();
    using W = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
    Layout tv2lane = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_1, _0, _0>>{};
    Layout ref2lane = composition(tv2lane, ref_layout_MN);
    Layout lanes = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
    auto lane_mn = idx2crd(right_inverse(lanes)(cutlass::canonical_lane_idx()), shape(lanes));
    Layout tv2warp = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_0, _1, _0>>{};
    Layout ref2warp = composition(tv2warp, ref_layout_MN);
    Layout warps = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
    static_assert(size<0>(decltype(warps){}) == RowsPerTile && size<1>(decltype(warps){}) == 1,
                  "a CTA tile's warps stacked along M, RowsPerTile of them");
    const int warp_m = get<0>(idx2crd(right_inverse(warps)(args.thread_idx / cutlass::NumThreadsPerWarp), shape(warps)));

    auto [tile_m, tile_n, tile_k] = args.tile_shape_mnk;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    float* row = params.ptr + (int64_t(l) * params.rows + int64_t(m) * RowsPerTile + warp_m) * params.ld +
                 int64_t(n) * int64_t(tile_n);
    Tensor g = make_tensor(make_gmem_ptr(row), make_layout(make_shape(tile_m, tile_n), make_stride(_0{}, _1{})));
    Tensor out = sm90_partition_for_epilogue<ReferenceSrc>(g, args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor sums = make_tensor_like<float>(out(_, _, _, _0{}, _0{}));
    fill(sums, 0.0f);
    constexpr int kLastM = decltype(size<3>(out))::value - 1;
    return ConsumerStoreCallbacks<decltype(sums), decltype(out), decltype(lanes), kLastM>(
        sums, out, lanes, get<0>(lane_mn), params.ptr != nullptr);
  }
};

// gZ = act'(S) * alpha * acc, its column sums beside.
template <class CtaTile, class EpiTile, int Stages, class SmemLayoutAtom, class CopyOpS2R, class T, int Slot>
using DgradDactTree =
    Sm90EVT<ColSumPartials<T, kDgradPartialRowsPerTile>,                                                    // partials
      Sm90EVT<Sm90Compute<DactFnOf<T, Slot>::template Fn, float, float, kRound>,                              // gZ
        Sm90AccFetch,                                                                                        //   acc
        Sm90AuxLoad<Stages, EpiTile, T, cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>,
                    SmemLayoutAtom, CopyOpS2R>>>;                                                            //   S
}  // namespace evt

}  // namespace regemm::cutlass_sm90

namespace cutlass::epilogue::fusion {

template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore, class T, int Slot,
          class CtaTile, class EpiTile, class SmemLayoutAtom, class CopyOpS2R>
struct FusionCallbacks<epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore>,
                       regemm::cutlass_sm90::DgradDactFusion<T, Slot>, CtaTile, EpiTile, SmemLayoutAtom, CopyOpS2R>
    : regemm::cutlass_sm90::evt::DgradDactTree<CtaTile, EpiTile, StagesC, SmemLayoutAtom, CopyOpS2R, T, Slot> {
  using Impl = regemm::cutlass_sm90::evt::DgradDactTree<CtaTile, EpiTile, StagesC, SmemLayoutAtom, CopyOpS2R, T, Slot>;
  using Operation = regemm::cutlass_sm90::DgradDactFusion<T, Slot>;
  using StrideS = cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>;

  struct Arguments {
    regemm::cutlass_sm90::DactArgs dact = {};
    T const* s = nullptr;
    StrideS ds = {};
    float* partials = nullptr;  // null: no bias gradient
    int64_t partials_ld = 0;
    int64_t partials_rows = 0;  // a batch entry's

    operator typename Impl::Arguments() const {
      return {  // partials
          {  // gZ
              {},               // acc
              {s, T(0), ds},    // S
              dact},
          {partials, partials_ld, partials_rows}};
    }
  };

  using Impl::Impl;
};

}  // namespace cutlass::epilogue::fusion

namespace regemm::cutlass_sm90 {

// The kernel: the mainloop of cutlass_gemm.cuh's GemmTypeOf (A row-major, B
// as stored), this epilogue without C. A type of its own rather than
// GemmTypeOf's, whose epilogue always has a C (beta * C in the forward) and
// whose header is in the forward kernels' stamp (build.cmake).
template <DType D, bool TB, class Cfg, int Slot>
struct DgradGemmOf {
  using T = typename Elem<D>::type;
  static constexpr int kAlign = 16 / int(sizeof(T));  // TMA: 16-byte rows
  static_assert(D != DType::kF32 || TB, "TF32 wgmma takes B K-major: the f32 dgrad kernels are built with B transposed");
  using RowMajor = cutlass::layout::RowMajor;
  using LayoutB = std::conditional_t<TB, cutlass::layout::ColumnMajor, RowMajor>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor, kAlign, T, RowMajor, kAlign,
      typename Cfg::Epilogue, DgradDactFusion<T, Slot>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, RowMajor, kAlign, T, LayoutB, kAlign, float,
      typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Cfg::Mainloop>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, typename Cfg::Scheduler>;
};

// regemm_dgrad_dact's GEMM: gZ = (alpha op(A) op(B)) act'(S) and the bias
// gradient's partial sums (cutlass_dgrad.h, DgradOperands).
template <DType D, bool TB, int Slot>
Status run_dgrad_dact(const GemmProblem& p, const DactProblem& d, const DgradOperands& o, const Launch& l) {
  using G = DgradGemmOf<D, TB, ConfigTraits<kDgradConfig, kTileK<D>>, Slot>;
  static_assert(cute::size<0>(typename ConfigTraits<kDgradConfig, kTileK<D>>::Tile{}) == kDgradTileM &&
                    cute::size<1>(typename ConfigTraits<kDgradConfig, kTileK<D>>::Tile{}) == kDgradTileN,
                "the partials' shape (cutlass_dgrad.h) follows the CTA tile");
  using T = typename G::T;
  using K = typename G::Kernel;
  const bool one = p.batch == 1;
  const int64_t d_batch = one ? 0 : p.m * p.n;
  typename G::CollectiveEpilogue::FusionCallbacks::Arguments fa;
  fa.dact = DactArgs{int(d.act), float(d.slope), float(p.alpha), d.from_y};
  fa.s = static_cast<const T*>(o.s);
  fa.ds = make_stride3<decltype(fa.ds)>(p.n, one ? 0 : d.stride_s);
  fa.partials = o.partials;
  fa.partials_ld = dgrad_partials_ld(p.n);
  fa.partials_rows = dgrad_partials_rows(p.m);
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
