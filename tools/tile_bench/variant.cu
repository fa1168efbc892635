// One bf16 tile variant of the regemm CUTLASS kernel (ffi/cuda/cutlass/cutlass_gemm.cuh,
// same epilogue), chosen at compile time (build.sh sets these):
//   TILE_SCHED  coop, ping or streamk (cooperative, ping-pong, cooperative + stream-K)
//   TILE_M, TILE_N, TILE_CM, TILE_CN   tile and cluster shape
//   TILE_TA, TILE_TB   A stored [K, M], B stored [N, K]
//   TILE_TAG   a suffix of the name (A/B of a header change; may be empty)
//   TILE_ACT_CALL  1: the costly activations as out-of-line calls (ConfigTraits::kActCall)
//   TILE_ONE_ACT   a regemm::Act value: the kernel of that activation alone
//                  (cutlass_kernels.h, kOneActs); default every activation
// Session 9 (docs/performance.md) measured these; ping 128x128 without a
// cluster became Config::kPing128x128c1.
#include "cutlass_gemm.cuh"
#include "harness.h"

using namespace regemm;
using namespace regemm::cutlass_sm90;

// Everything below has internal linkage: every variant object defines CF,
// G and run under the same names, and with external linkage the linker keeps
// one run_gemm_of<G> for all of them (every variant then runs the same kernel).
namespace {
namespace cg = cutlass::gemm;
namespace ce = cutlass::epilogue;

struct coop {
  using Mainloop = cg::KernelTmaWarpSpecializedCooperative;
  using Epilogue = ce::TmaWarpSpecializedCooperative;
  using Scheduler = cg::PersistentScheduler;
};
struct ping {
  using Mainloop = cg::KernelTmaWarpSpecializedPingpong;
  using Epilogue = ce::TmaWarpSpecialized;
  using Scheduler = cg::PersistentScheduler;
};
struct streamk : coop {
  using Scheduler = cg::StreamKScheduler;
};

#ifndef TILE_ACT_CALL
#define TILE_ACT_CALL 0
#endif
struct CF : TILE_SCHED {
  static constexpr bool kActCall = TILE_ACT_CALL;
  using Tile = cute::Shape<cute::Int<TILE_M>, cute::Int<TILE_N>, cute::_64>;
  using Cluster = cute::Shape<cute::Int<TILE_CM>, cute::Int<TILE_CN>, cute::_1>;
};
#ifndef TILE_ONE_ACT
#define TILE_ONE_ACT kAnyAct
#endif
#define STR2(x) #x
#define STR(x) STR2(x)
#define NAME STR(TILE_SCHED) STR(TILE_M) "x" STR(TILE_N) "_c" STR(TILE_CM) STR(TILE_CN) STR(TILE_TAG)

using G = GemmTypeOf<DType::kBF16, bool(TILE_TA), bool(TILE_TB), CF, int(TILE_ONE_ACT)>;

Status run(const GemmProblem& p, const GemmOperands& o, const Launch& l) { return run_gemm_of<G>(p, o, l); }
const bool kAdded =
    add_variant({NAME, TILE_TA, TILE_TB, &run, int(G::Kernel::SharedStorageSize),
                 int(G::CollectiveMainloop::DispatchPolicy::Stages),
                 int(sizeof(typename G::CollectiveEpilogue::SharedStorage))});
}  // namespace
