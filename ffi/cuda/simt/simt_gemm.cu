// SIMT regemm: a tiled GEMM on the CUDA cores whose epilogue (alpha, beta*C,
// bias, activation, optional Z) runs on the accumulators in registers and
// writes Y and Z once. It supports every problem (all dtypes, transposes,
// batch strides, K = 0) and is the registry's fallback; for f32 it is the
// true-f32 path (precision=HIGHEST): plain FMAs, no TF32.
//
// Structure: a block owns a BM x BN tile of one batch entry. K is walked in
// BK slices through two shared-memory buffers: while the block computes on
// one, each thread already holds its share of the next slice in registers
// (one barrier per slice). Each thread owns a TM x TN micro-tile of
// accumulators, rows strided by BM/TM and columns by BN/TN, so a warp's
// shared-memory reads are broadcasts or consecutive words (no bank conflicts)
// and its global stores are contiguous runs of a row.
#include <cstdint>
#include <type_traits>

#include "regemm/handlers.h"
#include "cuda/runtime.h"

namespace regemm {
namespace {

template <int BM_, int BN_, int BK_, int TM_, int TN_>
struct TileCfg {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, TM = TM_, TN = TN_;
  static constexpr int kThreadsM = BM / TM, kThreadsN = BN / TN;
  static constexpr int kThreads = kThreadsM * kThreadsN;
  static_assert(BM * BK % kThreads == 0 && BN * BK % kThreads == 0, "tile loads must split evenly");
};
using TileLarge = TileCfg<128, 128, 8, 8, 8>;  // 256 threads, 64 accumulators each
using TileSmall = TileCfg<64, 64, 8, 4, 4>;    // 256 threads: for small outputs and f64

// Shared-memory rows padded by 4 words: the k-contiguous tile loads scatter a
// warp over 8 k-rows x 4 columns, which then land in 32 distinct banks.
constexpr int kPad = 4;

// What the kernel reads, all sizes in elements (64-bit: past 2^31 is normal).
struct SimtArgs {
  int64_t m, n, k, lda, ldb;
  int64_t batch, stride_a, stride_b, stride_bias, stride_c;
  int64_t tiles_n;
  const void* a;
  const void* b;
  const void* bias;  // null: no bias
  const void* c;     // null: no C
  void* y;
  void* z;           // null: Z not stored
  double alpha, beta, slope;
  Act act;
  BiasKind bias_kind;
};

// One operand's share of a (R x BK) tile, held in registers between the
// global load and the shared-memory store. kKContig: consecutive k are
// adjacent in memory (A not transposed, or B transposed); otherwise
// consecutive rows are. Either way consecutive threads read adjacent
// addresses, and the tile lands in shared memory k-major: s[k][r].
template <class T, int R, int BK, int kThreads, bool kKContig>
struct TileLoader {
  using A = acc_t<T>;
  static constexpr int kPer = R * BK / kThreads;
  A v[kPer];

  __device__ __forceinline__ void fetch(const T* __restrict__ base, int64_t ld, int64_t r0, int64_t k0,
                                       int64_t rows, int64_t depth) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = int(threadIdx.x) + i * kThreads;
      const int rr = kKContig ? e / BK : e % R;
      const int kk = kKContig ? e % BK : e / R;
      const int64_t r = r0 + rr, q = k0 + kk;
      v[i] = (r < rows && q < depth) ? load<A>(base[kKContig ? r * ld + q : q * ld + r]) : A(0);
    }
  }

  __device__ __forceinline__ void store(A (*s)[R + kPad]) const {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = int(threadIdx.x) + i * kThreads;
      const int rr = kKContig ? e / BK : e % R;
      const int kk = kKContig ? e % BK : e / R;
      s[kk][rr] = v[i];
    }
  }
};

template <class T, class Cfg, bool kTransA, bool kTransB>
__global__ void __launch_bounds__(Cfg::kThreads) simt_gemm_kernel(const SimtArgs args) {
  using A = acc_t<T>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, TM = Cfg::TM, TN = Cfg::TN;
  __shared__ A sa[2][BK][BM + kPad];
  __shared__ A sb[2][BK][BN + kPad];

  const int tx = int(threadIdx.x) % Cfg::kThreadsN, ty = int(threadIdx.x) / Cfg::kThreadsN;
  const int64_t m0 = int64_t(blockIdx.x) / args.tiles_n * BM;
  const int64_t n0 = int64_t(blockIdx.x) % args.tiles_n * BN;
  const int64_t k_tiles = (args.k + BK - 1) / BK;
  const A alpha = A(args.alpha), beta = A(args.beta), slope = A(args.slope);

  TileLoader<T, BM, BK, Cfg::kThreads, !kTransA> load_a;
  TileLoader<T, BN, BK, Cfg::kThreads, kTransB> load_b;

  for (int64_t batch = blockIdx.z; batch < args.batch; batch += gridDim.z) {
    const T* a = static_cast<const T*>(args.a) + batch * args.stride_a;
    const T* b = static_cast<const T*>(args.b) + batch * args.stride_b;

    A acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = A(0);

    if (k_tiles > 0) {
      load_a.fetch(a, args.lda, m0, 0, args.m, args.k);
      load_b.fetch(b, args.ldb, n0, 0, args.n, args.k);
      load_a.store(sa[0]);
      load_b.store(sb[0]);
      __syncthreads();
    }
    for (int64_t t = 0; t < k_tiles; ++t) {
      const int cur = int(t & 1);
      const bool more = t + 1 < k_tiles;
      if (more) {  // the next slice travels while this one is computed
        load_a.fetch(a, args.lda, m0, (t + 1) * BK, args.m, args.k);
        load_b.fetch(b, args.ldb, n0, (t + 1) * BK, args.n, args.k);
      }
#pragma unroll
      for (int kk = 0; kk < BK; ++kk) {
        A av[TM], bv[TN];
#pragma unroll
        for (int i = 0; i < TM; ++i) av[i] = sa[cur][kk][ty + i * Cfg::kThreadsM];
#pragma unroll
        for (int j = 0; j < TN; ++j) bv[j] = sb[cur][kk][tx + j * Cfg::kThreadsN];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) acc[i][j] = fma(av[i], bv[j], acc[i][j]);
      }
      // The other buffer was last read before the previous barrier.
      if (more) {
        load_a.store(sa[cur ^ 1]);
        load_b.store(sb[cur ^ 1]);
      }
      __syncthreads();
    }

    // Epilogue, straight from the registers: Z = alpha acc + bias + beta C, Y = act(Z).
    const T* bias = args.bias ? static_cast<const T*>(args.bias) + batch * args.stride_bias : nullptr;
    const T* c = args.c ? static_cast<const T*>(args.c) + batch * args.stride_c : nullptr;
    T* y = static_cast<T*>(args.y) + batch * args.m * args.n;
    T* z = args.z ? static_cast<T*>(args.z) + batch * args.m * args.n : nullptr;
    const bool per_col = bias && args.bias_kind == BiasKind::kPerCol;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const int64_t row = m0 + ty + i * Cfg::kThreadsM;
      if (row >= args.m) continue;
      const A bias_row = bias && !per_col ? load<A>(bias[bias_index(args.bias_kind, row, 0)]) : A(0);
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        const int64_t col = n0 + tx + j * Cfg::kThreadsN;
        if (col >= args.n) continue;
        const int64_t off = row * args.n + col;
        A v = alpha * acc[i][j] + (per_col ? load<A>(bias[col]) : bias_row);
        if (c) v += beta * load<A>(c[off]);
        y[off] = store<T>(act_fwd(args.act, v, slope));
        if (z) z[off] = store<T>(v);
      }
    }
  }
}

template <class T, class Cfg, bool kTransA, bool kTransB>
ffi::Error launch(const SimtArgs& args, cudaStream_t stream) {
  const int64_t tiles_m = (args.m + Cfg::BM - 1) / Cfg::BM;
  const int64_t tiles_n = (args.n + Cfg::BN - 1) / Cfg::BN;
  const int64_t tiles = tiles_m * tiles_n;
  if (tiles > int64_t(0x7fffffff)) return bad("output too large for the SIMT kernel's grid");
  SimtArgs a = args;
  a.tiles_n = tiles_n;
  // Batches past the grid's z limit loop inside the kernel.
  const dim3 grid(unsigned(tiles), 1, unsigned(a.batch < 65535 ? a.batch : 65535));
  host_mark(HostPhase::kLaunch);
  simt_gemm_kernel<T, Cfg, kTransA, kTransB><<<grid, Cfg::kThreads, 0, stream>>>(a);
  REGEMM_LAUNCH_CHECK();
  return ffi::Error::Success();
}

template <class T, class Cfg>
ffi::Error launch_cfg(const GemmProblem& p, const SimtArgs& args, cudaStream_t stream) {
  if (p.trans_a) return p.trans_b ? launch<T, Cfg, true, true>(args, stream) : launch<T, Cfg, true, false>(args, stream);
  return p.trans_b ? launch<T, Cfg, false, true>(args, stream) : launch<T, Cfg, false, false>(args, stream);
}

template <class T>
ffi::Error run_t(const GemmProblem& p, const GemmOperands& o, cudaStream_t stream) {
  const SimtArgs args{p.m, p.n, p.k, p.lda(), p.ldb(),
                      p.batch, p.stride_a, p.stride_b, p.stride_bias, p.stride_c,
                      /*tiles_n=*/0,
                      o.a, o.b, o.bias, o.c, o.y, o.z,
                      p.alpha, p.beta, p.slope, p.act, p.bias_kind};
  // The large tile where it still gives the GPU a few waves of blocks; f64
  // (twice the registers per accumulator) always takes the small one.
  const int64_t large_tiles = ((p.m + 127) / 128) * ((p.n + 127) / 128) * p.batch;
  if (std::is_same_v<T, double> || large_tiles < 256) return launch_cfg<T, TileSmall>(p, args, stream);
  return launch_cfg<T, TileLarge>(p, args, stream);
}

ffi::Error run_simt(const GemmProblem& p, const GemmOperands& o, CudaRuntime& rt) {
  ++rt.ops;
  switch (p.dtype) {
    case DType::kF32: return run_t<float>(p, o, rt.stream);
    case DType::kF64: return run_t<double>(p, o, rt.stream);
    case DType::kBF16: return run_t<bf16_t>(p, o, rt.stream);
    case DType::kF16: return run_t<f16_t>(p, o, rt.stream);
  }
  return bad("SIMT GEMM: unsupported dtype");
}

// A candidate for the tuner only where timing it is cheap (up to 2^30
// FLOPs: ~0.1 ms at the kernel's 14 TFLOP/s): past that the library
// GEMMs win by far.
void variants(const GemmProblem& p, const GemmOperands&, CudaRuntime&, std::vector<std::string>* names) {
  if (2.0 * double(p.m) * double(p.n) * double(p.k) * double(p.batch) <= double(int64_t(1) << 30))
    names->push_back("simt");
}

ffi::Error run_variant(const GemmProblem& p, const GemmOperands& o, CudaRuntime& rt, int) { return run_simt(p, o, rt); }

// The fallback: supports everything, lowest priority. run_simt is its one way
// (no rule_way).
const Register<GemmProblem, GemmOperands, CudaRuntime> kRegister({
    "cuda_simt", 0, [](const GemmProblem&) { return true; }, run_simt, variants, run_variant});

}  // namespace
}  // namespace regemm
