// One bf16 tile variant of the regemm CUTLASS kernel (ffi/cuda/cutlass_gemm.cuh,
// same epilogue), chosen by -DTILE_V=n; -DTILE_TA/-DTILE_TB: the layouts.
// Session 9 (benchmarks/NOTES.md) measured these; ping128x128_c11 became
// Config::kPing128x128c1.
#include "cutlass_gemm.cuh"
#include "harness.h"

using namespace regemm;
using namespace regemm::cutlass_sm90;
using namespace cute;
namespace cg = cutlass::gemm;
namespace ce = cutlass::epilogue;

template <class Tile_, class Cluster_, class Mainloop_, class Epilogue_, class Scheduler_>
struct Cfg {
  using Tile = Tile_;
  using Cluster = Cluster_;
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Scheduler = Scheduler_;
};
using Coop = Cfg<void, void, cg::KernelTmaWarpSpecializedCooperative, ce::TmaWarpSpecializedCooperative,
                 cg::PersistentScheduler>;
using Ping = Cfg<void, void, cg::KernelTmaWarpSpecializedPingpong, ce::TmaWarpSpecialized, cg::PersistentScheduler>;
template <class S, int M, int N, int CM, int CN>
using Make = Cfg<Shape<Int<M>, Int<N>, _64>, Shape<Int<CM>, Int<CN>, _1>, typename S::Mainloop, typename S::Epilogue,
                 typename S::Scheduler>;
using StreamK = Cfg<void, void, cg::KernelTmaWarpSpecializedCooperative, ce::TmaWarpSpecializedCooperative,
                    cg::StreamKScheduler>;

// name, config: "_cMN" is the cluster shape.
#if TILE_V == 0
#define NAME "coop128x256_c21"  // Config::kCoop128x256
using CF = Make<Coop, 128, 256, 2, 1>;
#elif TILE_V == 1
#define NAME "ping128x128_c21"  // Config::kPing128x128
using CF = Make<Ping, 128, 128, 2, 1>;
#elif TILE_V == 2
#define NAME "streamk128x128_c11"  // Config::kStreamK128x128
using CF = Make<StreamK, 128, 128, 1, 1>;
#elif TILE_V == 3
#define NAME "ping128x128_c11"  // Config::kPing128x128c1
using CF = Make<Ping, 128, 128, 1, 1>;
#elif TILE_V == 4
#define NAME "coop128x256_c11"
using CF = Make<Coop, 128, 256, 1, 1>;
#elif TILE_V == 5
#define NAME "coop128x256_c12"
using CF = Make<Coop, 128, 256, 1, 2>;
#elif TILE_V == 6
#define NAME "coop128x128_c21"
using CF = Make<Coop, 128, 128, 2, 1>;
#elif TILE_V == 7
#define NAME "coop128x128_c12"
using CF = Make<Coop, 128, 128, 1, 2>;
#elif TILE_V == 8
#define NAME "coop256x128_c12"
using CF = Make<Coop, 256, 128, 1, 2>;
#elif TILE_V == 9
#define NAME "coop128x192_c21"
using CF = Make<Coop, 128, 192, 2, 1>;
#elif TILE_V == 10
#define NAME "ping128x128_c12"
using CF = Make<Ping, 128, 128, 1, 2>;
#elif TILE_V == 11
#define NAME "ping64x256_c21"
using CF = Make<Ping, 64, 256, 2, 1>;
#else
#error "TILE_V: 0-11"
#endif

using G = GemmTypeOf<DType::kBF16, bool(TILE_TA), bool(TILE_TB), CF>;

static Status run(const GemmProblem& p, const GemmOperands& o, const Launch& l) { return run_gemm_of<G>(p, o, l); }
static const bool kAdded =
    add_variant({NAME, TILE_TA, TILE_TB, &run, int(G::Kernel::SharedStorageSize),
                 int(G::CollectiveMainloop::DispatchPolicy::Stages),
                 int(sizeof(typename G::CollectiveEpilogue::SharedStorage))});
