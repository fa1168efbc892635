// One CUTLASS 3.x sm90 GEMM (TMA + wgmma, warp-specialized, persistent) with
// the regemm epilogue tree, and the launch of it for a GemmProblem.
//
// Layouts: Y (and C, Z) row-major [M, N]; A row-major [M, K] or, trans_a,
// stored [K, M] = CUTLASS column-major; B row-major [K, N] (N-major) or,
// trans_b, stored [N, K] = CUTLASS column-major (K-major). The batch is
// CUTLASS's L mode with each operand's own stride.
//
// One exception, f32 (TF32) with A K-major and B N-major (plain x @ w): TF32
// wgmma takes both operands K-major from shared memory, and CUTLASS's builder
// answers this layout with a swap-A/B register path that computed wrong
// results on the H100 (device check 2026-11-22: relative error ~1, all three
// configs). That kernel computes Y^T = B^T A^T instead: A' = B as an N x K
// column-major matrix, B' = A as a K x M column-major one, D = Y^T column-major
// (the same bytes as Y row-major), the row and column biases swapped.
//
// Included only by the generated instantiation TUs (cutlass_inst.cu.in).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass_epilogue.cuh"
#include "cutlass_kernels.h"

namespace regemm::cutlass_sm90 {

template <DType D> struct Elem;
template <> struct Elem<DType::kBF16> { using type = cutlass::bfloat16_t; };
template <> struct Elem<DType::kF16> { using type = cutlass::half_t; };
template <> struct Elem<DType::kF32> { using type = float; };  // the builder maps f32 operands to TF32 MMA

// kActCall: the costly activations as out-of-line calls in the epilogue
// (cutlass_epilogue.cuh, ActFn): for the configurations that run few tiles per
// CTA (ping128x128c1 is the rule's pick at 1-4 waves; stream-K splits few
// tiles), not for those that win at many waves.
template <Config C, int KT> struct ConfigTraits;
template <int KT> struct ConfigTraits<Config::kCoop128x256, KT> {
  static constexpr bool kActCall = false;
  using Tile = cute::Shape<cute::_128, cute::_256, cute::Int<KT>>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using Scheduler = cutlass::gemm::PersistentScheduler;
};
template <int KT> struct ConfigTraits<Config::kPing128x128, KT> {
  static constexpr bool kActCall = false;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::Int<KT>>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
  using Scheduler = cutlass::gemm::PersistentScheduler;
};
template <int KT> struct ConfigTraits<Config::kPing128x128c1, KT> : ConfigTraits<Config::kPing128x128, KT> {
  static constexpr bool kActCall = true;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
};
template <int KT> struct ConfigTraits<Config::kStreamK128x128, KT> {
  static constexpr bool kActCall = true;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::Int<KT>>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using Scheduler = cutlass::gemm::StreamKScheduler;
};

// The K extent of a tile: 128 bytes.
template <DType D>
inline constexpr int kTileK = 128 / int(sizeof(typename Elem<D>::type));

// The kernel type for a dtype, the operand layouts, a ConfigTraits-like Cfg
// (Tile, Cluster, Mainloop, Epilogue, Scheduler, kActCall) and the
// activations its epilogue computes (cutlass_kernels.h: kAnyAct or one); or
// another epilogue, Fusion_ (regemm_dgrad_dact's, cutlass_dgrad.cuh).
template <DType D, bool TA, bool TB, class Cfg_, int OneAct = kAnyAct, class Fusion_ = void>
struct GemmTypeOf {
  using T = typename Elem<D>::type;
  using Cfg = Cfg_;
  static constexpr int kAlign = 16 / int(sizeof(T));  // TMA: 16-byte rows
  static constexpr bool kSwap = D == DType::kF32 && !TA && !TB;  // see the header comment
  using ColMajor = cutlass::layout::ColumnMajor;
  using RowMajor = cutlass::layout::RowMajor;
  using LayoutA = std::conditional_t<TA || kSwap, ColMajor, RowMajor>;
  using LayoutB = std::conditional_t<TB || kSwap, ColMajor, RowMajor>;
  using LayoutC = std::conditional_t<kSwap, ColMajor, RowMajor>;
  static constexpr int kOneAct = OneAct;
  // A kernel of one activation has no C (cutlass_epilogue.cuh says why).
  static constexpr bool kHasC = OneAct == kAnyAct;
  using ElementC = std::conditional_t<kHasC, T, void>;
  using Fusion = std::conditional_t<std::is_void_v<Fusion_>,
                                    RegemmFusion<T, float, T, ElementC, LayoutC, Cfg::kActCall, OneAct>, Fusion_>;

  // Epilogue subtiles: CUTLASS's default (128x32 cooperative, 64x32 ping-pong).
  // 128x16 would leave the 128x256 bf16 mainloop 4 smem stages instead of 3,
  // but measured slower (device run 2: plain 1.031 -> 1.074 x cuBLAS at
  // 16384x4096x4096, activations dearer): half the work per subtile barrier.
  using EpiTile = cutlass::epilogue::collective::EpilogueTileAuto;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster, EpiTile,
      float, float, ElementC, LayoutC, kAlign, T, LayoutC, kAlign, typename Cfg::Epilogue, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, LayoutA, kAlign, T, LayoutB, kAlign, float,
      typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Cfg::Mainloop>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, typename Cfg::Scheduler>;
};

template <DType D, bool TA, bool TB, Config C, int OneAct = kAnyAct, class Fusion = void>
using GemmType = GemmTypeOf<D, TA, TB, ConfigTraits<C, kTileK<D>>, OneAct, Fusion>;

// A rank-3 CuTe stride (rows, cols, batch) with one static unit mode: the
// leading dimension goes to whichever of the first two modes is dynamic.
template <class S>
S make_stride3(int64_t ld, int64_t batch) {
  S s{};
  if constexpr (cute::is_static_v<std::remove_cv_t<std::remove_reference_t<decltype(cute::get<0>(s))>>>)
    cute::get<1>(s) = ld;
  else
    cute::get<0>(s) = ld;
  cute::get<2>(s) = batch;
  return s;
}

// The kernel's dynamic shared memory above 48 KB must be allowed once per
// device (CUTLASS's initialize() asks on every call: a CUDA call per launch).
template <class K>
Status allow_shared_memory(int device) {
  static std::atomic<uint64_t> done{0};  // bit d: device d (devices >= 64: every call)
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
  if (bit && (done.load(std::memory_order_relaxed) & bit)) return {};
  const cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(K::SharedStorageSize));
  if (e != cudaSuccess) {
    cudaGetLastError();
    return {"cudaFuncSetAttribute", cudaGetErrorString(e)};
  }
  done.fetch_or(bit, std::memory_order_relaxed);
  return {};
}

// One cudaLaunchKernelEx with the kernel's cluster shape (what CUTLASS's
// ClusterLauncher does, less its cudaFuncSetAttribute on every launch: the
// clusters here are at most 2 CTAs, within the portable size). A 1x1x1
// cluster gets no cluster attribute: CUTLASS launches those as plain kernels.
template <class K>
Status launch_kernel(typename K::Params& params, cudaStream_t stream) {
  using Cluster = typename K::DispatchPolicy::ClusterShape;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = unsigned(cute::size<0>(Cluster{}));
  cluster.val.clusterDim.y = unsigned(cute::size<1>(Cluster{}));
  cluster.val.clusterDim.z = unsigned(cute::size<2>(Cluster{}));
  const bool clustered = cluster.val.clusterDim.x * cluster.val.clusterDim.y * cluster.val.clusterDim.z > 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = K::get_grid_shape(params);
  cfg.blockDim = K::get_block_shape();
  cfg.dynamicSmemBytes = size_t(K::SharedStorageSize);
  cfg.stream = stream;
  cfg.attrs = clustered ? &cluster : nullptr;
  cfg.numAttrs = clustered ? 1 : 0;
  void* kernel_args[] = {&params};
  const cudaError_t e = cudaLaunchKernelExC(&cfg, reinterpret_cast<const void*>(&cutlass::device_kernel<K>), kernel_args);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it: the status reports it
    return {"launch", cudaGetErrorString(e)};
  }
  return {};
}

inline cutlass::KernelHardwareInfo hardware(const Launch& l) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = l.dev.device;
  hw.sm_count = l.dev.sm_count;
  return hw;
}

// Launches kernel K with its arguments.
template <class K>
Status enqueue(typename K::Arguments const& args, const Launch& l) {
  // Host work first (argument checks, TMA descriptors, the shared-memory
  // limit), then the device work back to back: whatever `before` enqueues,
  // the workspace initialisation (stream-K's memset), the kernel. CUTLASS's
  // Gemm::initialize() memsets first and builds the descriptors after, which
  // left the GPU idle for the whole host setup between the two (device spans
  // of small stream-K calls: 80-90 us against a 12 us kernel).
  if (!K::can_implement(args)) return {"can_implement", "CUTLASS cannot run this problem"};
  const size_t ws_bytes = K::get_workspace_size(args);
  void* ws = nullptr;
  if (ws_bytes > 0) {
    ws = l.alloc ? l.alloc(l.alloc_ctx, ws_bytes) : nullptr;
    if (!ws) return {"workspace", "allocation failed"};
  }
  typename K::Params params = K::to_underlying_arguments(args, ws);
  if (Status st = allow_shared_memory<K>(l.dev.device); !st.ok()) return st;
  if (l.before)
    if (Status st = l.before(l.before_ctx, l.stream); !st.ok()) return st;
  if (cutlass::Status cs = K::initialize_workspace(args, ws, l.stream); cs != cutlass::Status::kSuccess) {
    cudaGetLastError();  // a failed memset sets it; the status says so
    return {"initialize_workspace", cutlassGetStatusString(cs)};
  }
  // CUTLASS's stream-K zeroes its barriers (one memset) when it has any
  // workspace; the data-parallel decomposition has none.
  if (l.enqueued) *l.enqueued += 1 + (ws_bytes > 0);
  return launch_kernel<K>(params, l.stream);
}

// One launch of the kernel G (a GemmTypeOf) for p.
template <class G>
Status run_gemm_of(const GemmProblem& p, const GemmOperands& o, const Launch& l) {
  using T = typename G::T;
  using K = typename G::Kernel;
  if (G::kOneAct != kAnyAct && int(p.act) != G::kOneAct) return {"dispatch", "kernel built for another activation"};

  const int64_t mn = p.m * p.n;
  const bool one = p.batch == 1;
  const bool use_c = p.uses_c();
  if (use_c && !G::kHasC) return {"dispatch", "kernel built without C"};
  // A kernel with C given a problem without one: the C descriptor points at
  // Y (any valid tensor) and beta = 0 makes the epilogue skip the load. A
  // kernel without C ignores the pointer.
  const void* c_ptr = use_c ? o.c : o.y;
  const int64_t c_batch = one ? 0 : (use_c ? p.stride_c : mn);
  const int64_t d_batch = one ? 0 : mn;
  // The kernel's problem: (M, N) and operands as given, or transposed (kSwap).
  const int64_t km = G::kSwap ? p.n : p.m, kn = G::kSwap ? p.m : p.n;
  const void* ka = G::kSwap ? o.b : o.a;
  const void* kb = G::kSwap ? o.a : o.b;
  auto sa = G::kSwap ? make_stride3<typename K::StrideA>(p.ldb(), one ? 0 : p.stride_b)
                     : make_stride3<typename K::StrideA>(p.lda(), one ? 0 : p.stride_a);
  auto sb = G::kSwap ? make_stride3<typename K::StrideB>(p.lda(), one ? 0 : p.stride_a)
                     : make_stride3<typename K::StrideB>(p.ldb(), one ? 0 : p.stride_b);
  auto sc = make_stride3<typename K::StrideC>(p.n, c_batch);  // Y's row length either way
  auto sd = make_stride3<typename K::StrideD>(p.n, d_batch);

  typename G::CollectiveEpilogue::FusionCallbacks::Arguments fa;
  fa.alpha = float(p.alpha);
  fa.beta = use_c ? float(p.beta) : 0.0f;
  const T* bias = static_cast<const T*>(o.bias);
  const int64_t sbias = one ? 0 : p.stride_bias;
  // Problem's per-column bias is along D's columns, or its rows when swapped.
  const bool along_n = (p.bias_kind == BiasKind::kPerCol) != G::kSwap;
  switch (p.bias_kind) {
    case BiasKind::kNone: break;
    case BiasKind::kScalar: fa.bias_s = bias; fa.bias_s_batch_stride = sbias; break;
    case BiasKind::kPerCol:
    case BiasKind::kPerRow:
      if (along_n) { fa.bias_n = bias; fa.bias_n_batch_stride = sbias; }
      else { fa.bias_m = bias; fa.bias_m_batch_stride = sbias; }
      break;
  }
  fa.z = p.store_z ? static_cast<T*>(o.z) : nullptr;
  fa.dz = make_stride3<decltype(fa.dz)>(p.n, d_batch);
  fa.act = ActArgs{int(p.act), float(p.slope)};

  typename K::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {int(km), int(kn), int(p.k), int(p.batch)},
      {static_cast<const T*>(ka), sa, static_cast<const T*>(kb), sb},
      {fa, static_cast<const T*>(c_ptr), sc, static_cast<T*>(o.y), sd},
      hardware(l)};
  return enqueue<K>(args, l);
}

template <DType D, bool TA, bool TB, Config C, int A>
Status run_gemm(const GemmProblem& p, const GemmOperands& o, const Launch& l) {
  return run_gemm_of<GemmType<D, TA, TB, C, A>>(p, o, l);
}

}  // namespace regemm::cutlass_sm90
