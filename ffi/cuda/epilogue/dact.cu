// The backward epilogue on the GPU: gZ = gY * act'(S) (S = Z, or Y where act'
// can be read off the output), with the bias gradient reduced in the same
// pass over gZ.
//
// Speed: the pass is memory-bound (read gY and S, write gZ: 6 bytes per bf16
// element), so each thread moves 16-byte vectors (8 bf16/f16, 4 f32, 2 f64)
// and a warp covers 512 contiguous bytes of a row. The activation is a
// template parameter, so the per-element work is straight-line code.
//
// Determinism: gBias is bit-identical from run to run. No atomics; every sum
// has a fixed order. The M x N output is cut into tiles of 8 x rows rows by
// 32 vectors of columns (block of 32 x 8 threads; thread (x, y) covers one
// vector of columns and rows y, y + 8, ...; tile_shape picks rows). A tile's
// partial sums are added in a fixed order and written to the workspace; a
// second kernel adds the partials of the tiles in tile order. Where each bias
// element has one tile (M within one tile for a per-column bias), the tile
// kernel writes the bias gradient itself: one launch instead of two.
// The bias gradient sums gZ as stored (rounded to the output dtype), in the
// accumulation type (f32, or f64 for f64).
// act' of bf16/f16 uses the GPU's approximate exp and division (FastMath,
// activation.h: ~1e-7 relative, far below the 16-bit rounding of gZ); the
// precise forms cost gelu's pass 24 us against relu's 13 (4096x1024 bf16,
// docs/performance.md). f32 and f64 keep the precise forms.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "regemm/handlers.h"
#include "cuda/pack.h"
#include "cuda/runtime.h"
#include "cuda/workspace.h"

namespace regemm {
namespace {

constexpr int kLanes = 32;                          // vectors of columns per tile = lanes of a warp
constexpr int kWarps = 8;                           // warps per block, along rows
constexpr int kThreads = kLanes * kWarps;           // 256
// Rows per thread: 16 (tiles of 128 rows), one row at a time. Measured on the
// H100 against 64-row tiles and against loading 4 rows before the first use
// (docs/performance.md): within 3% of the best of those everywhere; loading 4
// rows at once made the bf16 relu kernel 2x slower. Small outputs take fewer
// rows per thread (tile_shape): 16 rows per thread would leave most of the
// GPU idle (128 x 1024 bf16: 4 blocks on 132 SMs, so gelu's act' ran on 4 SMs).
constexpr int kMaxRowsPerThread = 16;
// Enough blocks that every SM of a large GPU (132 on the H100) gets two.
constexpr int64_t kFillBlocks = 264;

struct DactArgs {
  int64_t m, n, batch, stride_gy, stride_s, tiles_m, tiles_n;
  int rows;     // rows per thread: a tile is kWarps * rows rows
  bool direct;  // one tile per bias element: the tile kernel writes gBias itself
  int64_t len;  // of the bias (0: none)
  const void* gy;
  const void* s;
  void* gz;
  void* gbias;     // null: no bias
  void* partials;  // workspace for the tiles' partial sums (null: no bias)
  double slope;
  bool from_y;
  BiasKind kind;
  bool write_gz;  // false for act none in place (gZ is gY): the pass only reduces the bias gradient
};

// The tiling of an M x N output: rows per thread (halved from 16 while the
// grid would have fewer than kFillBlocks blocks) and the tile counts. `cols`:
// columns per tile.
struct TileShape {
  int rows;
  int64_t tiles_m, tiles_n;
};
TileShape tile_shape(int64_t m, int64_t n, int64_t batch, int64_t cols) {
  const int64_t tiles_n = (n + cols - 1) / cols, entries = batch < 65535 ? batch : 65535;
  int rows = kMaxRowsPerThread;
  auto tiles_m = [&] { return (m + kWarps * rows - 1) / (kWarps * rows); };
  while (rows > 1 && tiles_m() * tiles_n * entries < kFillBlocks) rows /= 2;
  return {rows, tiles_m(), tiles_n};
}

// Partial sums per batch entry, in the layout of each kind:
// per-col [tiles_m][n], per-row [tiles_n][m], scalar [tiles_m * tiles_n].
__host__ __device__ int64_t partials_per_batch(BiasKind kind, int64_t m, int64_t n, int64_t tiles_m, int64_t tiles_n) {
  switch (kind) {
    case BiasKind::kPerCol: return tiles_m * n;
    case BiasKind::kPerRow: return tiles_n * m;
    case BiasKind::kScalar: return tiles_m * tiles_n;
    default: return 0;
  }
}

// The activations whose act' a call may read off Y: grad_from_y_ok's list
// (dact_attrs refuses from_y elsewhere), here as a compile-time fact so that the
// other activations compile the form from Z alone (with both forms the gelu
// kernel's code grew by 40% and some kernels took more registers and spilled).
template <Act A>
constexpr bool kMayReadY = A == Act::kRelu || A == Act::kLeakyRelu || A == Act::kSigmoid || A == Act::kTanh;

// Fixed-order warp sum (xor butterfly): every lane ends with the same bits.
template <class A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Fixed-order sum of one value per thread over the block; thread 0 gets it.
template <class A> __device__ __forceinline__ A block_sum(A v) {
  __shared__ A buf[kThreads];
  const int t = threadIdx.y * kLanes + threadIdx.x;
  buf[t] = v;
  __syncthreads();
#pragma unroll
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (t < w) buf[t] += buf[t + w];
    __syncthreads();
  }
  const A total = buf[0];
  __syncthreads();  // buf may be reused right away
  return total;
}

// One tile: gZ written, and the tile's partial bias sums to the workspace.
// V: elements per thread along the row (n and the strides are multiples of V).
template <class T, int V, Act kAct>
__global__ void __launch_bounds__(kThreads) dact_tiles_kernel(const DactArgs a) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  using M = std::conditional_t<sizeof(T) == 2, FastMath, PreciseMath>;
  __shared__ A red[kWarps][kLanes * V];  // per-col: the warps' column sums
  const int64_t tm = int64_t(blockIdx.x) / a.tiles_n, tn = int64_t(blockIdx.x) % a.tiles_n;
  const int64_t col = (tn * kLanes + threadIdx.x) * V;
  const bool col_in = col < a.n;  // n % V == 0: the whole vector is in range
  const A slope = A(a.slope);
  const int64_t per_batch = partials_per_batch(a.kind, a.m, a.n, a.tiles_m, a.tiles_n);
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) {
    const T* gy = static_cast<const T*>(a.gy) + b * a.stride_gy;
    const T* s = static_cast<const T*>(a.s) + b * a.stride_s;
    T* gz = static_cast<T*>(a.gz) + b * a.m * a.n;
    // Direct: the one partial of each bias element is its gradient, stored
    // in place of the partials (the layouts agree when there is one tile per
    // element), and the sum kernel is not launched.
    A* part = a.kind == BiasKind::kNone || a.direct ? nullptr : static_cast<A*>(a.partials) + b * per_batch;
    T* gb = a.direct ? static_cast<T*>(a.gbias) + b * a.len : nullptr;
    auto put = [&](int64_t i, A v) {
      if (gb) gb[i] = store<T>(v);
      else part[i] = v;
    };
    // Row r of this thread's rows in the tile (rows y, y + 8, ...).
    auto row_of = [&](int r) { return tm * kWarps * a.rows + threadIdx.y + r * kWarps; };
    A colsum[V];
#pragma unroll
    for (int v = 0; v < V; ++v) colsum[v] = A(0);
    // Column sums alone (act none in place, per-column bias: after cuBLASLt's
    // DGELU matmul): every row's load is issued before the first add. With one
    // load per row the loop below leaves too few in flight (a read-only pass over
    // 8192 x 4096 bf16 took 47 us, 1.4 TB/s).
    const bool sums_only = kAct == Act::kNone && !a.write_gz && a.kind == BiasKind::kPerCol;
    if (sums_only) {
      P gv[kMaxRowsPerThread];
#pragma unroll
      for (int r = 0; r < kMaxRowsPerThread; ++r) {
        const int64_t row = row_of(r);
        if (r < a.rows && row < a.m && col_in) gv[r] = load_pack<T, V>(gy + row * a.n + col);
        else
#pragma unroll
          for (int v = 0; v < V; ++v) gv[r].v[v] = store<T>(A(0));
      }
#pragma unroll
      for (int r = 0; r < kMaxRowsPerThread; ++r)
#pragma unroll
        for (int v = 0; v < V; ++v) colsum[v] += load<A>(gv[r].v[v]);
    }
    // The rows: gZ = gY act'(S) per element, the bias gradient summed from gZ as
    // stored. Whether act' is read off Y is decided once, outside the loop, so
    // that a vector's V elements are straight-line code whose MUFU chains the
    // compiler interleaves (a per-element branch kept them one after another).
    //
    // f32 loads each row's gY and S while the row before is computed (one row
    // ahead), so that its precise act' math overlaps the memory traffic. 16-bit
    // elements load each row when they reach it (measured on an H200: one row
    // ahead, f32 gelu 118 -> 109 us at 8192 x 4096, bf16 gelu 69 -> 74 us: the
    // extra registers cost the 16-bit kernels a block per SM), and so does f64,
    // the checking path, whose gelu_erf spilled one row ahead.
    constexpr bool kAhead = std::is_same_v<T, float>;
    const int rows = sums_only ? 0 : a.rows;
    P gnext, snext;
    auto fetch = [&](int r) {
      const int64_t row = row_of(r);
      if (r < rows && row < a.m && col_in) {
        gnext = load_pack<T, V>(gy + row * a.n + col);
        if constexpr (kAct != Act::kNone) snext = load_pack<T, V>(s + row * a.n + col);
      }
    };
    auto rows_loop = [&](auto from_y) {
      if constexpr (kAhead) fetch(0);
#pragma unroll(kAhead ? 1 : 4)
      for (int r = 0; r < rows; ++r) {
        const int64_t row = row_of(r);
        P gv, sv;
        if constexpr (kAhead) {
          gv = gnext;
          sv = snext;
          fetch(r + 1);
        }
        A rowsum = A(0);
        if (row < a.m && col_in) {
          const int64_t off = row * a.n + col;
          if constexpr (!kAhead) {
            gv = load_pack<T, V>(gy + off);
            if constexpr (kAct != Act::kNone) sv = load_pack<T, V>(s + off);
          }
          if constexpr (kAct == Act::kNone) sv = gv;  // act none reads no S
          A prod[V];
#pragma unroll
          for (int v = 0; v < V; ++v) {
            const A x = load<A>(sv.v[v]);
            A d;
            if constexpr (decltype(from_y)::value) d = act_grad_from_y(kAct, x, slope);
            else d = act_grad<A, M>(kAct, x, slope);
            prod[v] = load<A>(gv.v[v]) * d;
          }
          const P out = round_pack<T, V>(prod);
#pragma unroll
          for (int v = 0; v < V; ++v) {
            const A g = load<A>(out.v[v]);  // the bias gradient sums gZ as stored
            colsum[v] += g;
            rowsum += g;
          }
          if (a.write_gz) store_pack<T, V>(gz + off, out);
        }
        if (a.kind == BiasKind::kPerRow) {  // uniform branch: the whole warp takes it
          rowsum = warp_sum(rowsum);
          if (threadIdx.x == 0 && row < a.m) put(tn * a.m + row, rowsum);
        }
      }
    };
    if (kMayReadY<kAct> && a.from_y) rows_loop(std::true_type{});
    else rows_loop(std::false_type{});
    if (a.kind == BiasKind::kPerCol) {
#pragma unroll
      for (int v = 0; v < V; ++v) red[threadIdx.y][threadIdx.x * V + v] = colsum[v];
      __syncthreads();
      if (threadIdx.y == 0 && col_in) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          A sum = A(0);
#pragma unroll
          for (int y = 0; y < kWarps; ++y) sum += red[y][threadIdx.x * V + v];
          put(tm * a.n + col + v, sum);
        }
      }
      __syncthreads();  // red is reused by the next batch entry
    } else if (a.kind == BiasKind::kScalar) {
      A t = A(0);
#pragma unroll
      for (int v = 0; v < V; ++v) t += colsum[v];
      t = block_sum(t);
      if (threadIdx.x == 0 && threadIdx.y == 0) put(tm * a.tiles_n + tn, t);
    }
  }
}

// Per-col / per-row: a block per 32 bias elements; warp w adds the partials
// of tiles w, w + 8, ... in order, then the 8 warp sums are added in order.
// (One thread per element walking all tiles was latency-bound: 28 us for
// 16384 x 4096 bf16, a single block for N = 256.)
template <class T>
__global__ void __launch_bounds__(kThreads) dact_sum_vector_kernel(const DactArgs a) {
  using A = acc_t<T>;
  __shared__ A red[kWarps][kLanes];
  const int64_t len = a.len, parts = a.kind == BiasKind::kPerCol ? a.tiles_m : a.tiles_n;
  const int64_t per_batch = partials_per_batch(a.kind, a.m, a.n, a.tiles_m, a.tiles_n);
  const int64_t j = int64_t(blockIdx.x) * kLanes + threadIdx.x;
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) {
    const A* p = static_cast<const A*>(a.partials) + b * per_batch;
    A sum = A(0);
    if (j < len)
#pragma unroll 4
      for (int64_t t = threadIdx.y; t < parts; t += kWarps) sum += p[t * len + j];
    red[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && j < len) {
      A total = A(0);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += red[w][threadIdx.x];
      static_cast<T*>(a.gbias)[b * len + j] = store<T>(total);
    }
    __syncthreads();  // red is reused by the next batch entry
  }
}

// Scalar: one block per batch entry; lane t adds tiles t, t + 256, ... in
// order, then a fixed tree adds the lanes.
template <class T>
__global__ void __launch_bounds__(kThreads) dact_sum_scalar_kernel(const DactArgs a) {
  using A = acc_t<T>;
  const int64_t parts = a.tiles_m * a.tiles_n;
  const int t = threadIdx.y * kLanes + threadIdx.x;
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) {
    const A* p = static_cast<const A*>(a.partials) + b * parts;
    A sum = A(0);
    for (int64_t i = t; i < parts; i += kThreads) sum += p[i];
    const A total = block_sum(sum);
    if (t == 0) static_cast<T*>(a.gbias)[b] = store<T>(total);
  }
}

// ---------------------------------------------------------------------------

unsigned grid_z(int64_t batch) { return unsigned(batch < 65535 ? batch : 65535); }

template <class T, int V>
ffi::Error launch_tiles(const DactArgs& a, Act act, unsigned tiles, cudaStream_t stream) {
  const dim3 grid(tiles, 1, grid_z(a.batch)), block(kLanes, kWarps);
  if (!with_act(act, [&](auto k) { dact_tiles_kernel<T, V, decltype(k)::value><<<grid, block, 0, stream>>>(a); }))
    return bad("backward epilogue: unknown activation");
  REGEMM_LAUNCH_CHECK();
  return ffi::Error::Success();
}

// 16-byte vectors when every row and batch entry starts on a 16-byte boundary.
template <class T> bool vectorizable(const DactProblem& p, const DactOperands& o) {
  constexpr int V = kVec<T>;
  return p.n % V == 0 && p.stride_gy % V == 0 && p.stride_s % V == 0 && aligned16(o.gy) && aligned16(o.s) &&
         aligned16(o.gz);
}

// Columns per tile: a warp's vectors (16 bytes each), or a warp's elements.
int64_t tile_cols(int64_t elem_bytes, bool vec) { return int64_t(kLanes) * (vec ? 16 / elem_bytes : 1); }

template <class T>
ffi::Error run_t(const DactProblem& p, const DactOperands& o, CudaRuntime& rt) {
  using A = acc_t<T>;
  const bool vec = vectorizable<T>(p, o);
  const BiasKind kind = o.gbias ? p.bias_kind : BiasKind::kNone;
  const TileShape ts = tile_shape(p.m, p.n, p.batch, tile_cols(sizeof(T), vec));
  DactArgs a{p.m, p.n, p.batch, p.stride_gy, p.stride_s, ts.tiles_m, ts.tiles_n, ts.rows, /*direct=*/false,
             bias_length(kind, p.m, p.n), o.gy, o.s, o.gz, o.gbias, /*partials=*/nullptr, p.slope, p.from_y, kind,
             /*write_gz=*/!(p.act == Act::kNone && o.gz == o.gy && p.stride_gy == p.m * p.n)};
  a.direct = kind != BiasKind::kNone && a.len > 0 && partials_per_batch(kind, a.m, a.n, a.tiles_m, a.tiles_n) == a.len;
  const int64_t tiles = a.tiles_m * a.tiles_n;
  if (tiles > int64_t(0x7fffffff)) return bad("gY too large for the backward-epilogue grid");
  const int64_t parts = a.direct ? 0 : a.batch * partials_per_batch(kind, a.m, a.n, a.tiles_m, a.tiles_n);
  const size_t bytes = size_t(parts) * sizeof(A);
  if (auto e = rt.workspace(bytes, &a.partials); e.failure()) return e;
  // With no tiles at all (M or N is 0) the sums below write zeros.
  if (tiles > 0) {
    host_mark(HostPhase::kLaunch);
    auto e = vec ? launch_tiles<T, kVec<T>>(a, p.act, unsigned(tiles), rt.stream)
                 : launch_tiles<T, 1>(a, p.act, unsigned(tiles), rt.stream);
    if (e.failure()) return e;
  }
  if (a.direct) return ffi::Error::Success();  // (direct: len > 0 partials, so tiles > 0)
  const dim3 block(kLanes, kWarps);
  const int64_t len = a.len;
  if (kind == BiasKind::kScalar) {
    dact_sum_scalar_kernel<T><<<dim3(1, 1, grid_z(a.batch)), block, 0, rt.stream>>>(a);
    REGEMM_LAUNCH_CHECK();
  } else if (kind != BiasKind::kNone && len > 0) {
    const unsigned blocks = unsigned((len + kLanes - 1) / kLanes);
    dact_sum_vector_kernel<T><<<dim3(blocks, 1, grid_z(a.batch)), block, 0, rt.stream>>>(a);
    REGEMM_LAUNCH_CHECK();
  }
  return ffi::Error::Success();
}

ffi::Error run_dact(const DactProblem& p, const DactOperands& o, CudaRuntime& rt) {
  switch (p.dtype) {
    case DType::kF32: return run_t<float>(p, o, rt);
    case DType::kF64: return run_t<double>(p, o, rt);
    case DType::kBF16: return run_t<bf16_t>(p, o, rt);
    case DType::kF16: return run_t<f16_t>(p, o, rt);
  }
  return bad("backward epilogue: unsupported dtype");
}

const Register<DactProblem, DactOperands, CudaRuntime> kRegister({
    "cuda_dact", 0, [](const DactProblem&) { return true; }, run_dact});

}  // namespace

size_t dact_workspace_bytes(DType t, int64_t m, int64_t n, int64_t batch, BiasKind kind) {
  const size_t acc = t == DType::kF64 ? sizeof(acc_t<double>) : sizeof(acc_t<float>);
  // Either tiling (vectorized or not: known only from the pointers at run time).
  size_t bytes = 0;
  for (const bool vec : {false, true}) {
    const TileShape ts = tile_shape(m, n, batch, tile_cols(dtype_size(t), vec));
    bytes = std::max(bytes, size_t(batch * partials_per_batch(kind, m, n, ts.tiles_m, ts.tiles_n)) * acc);
  }
  return bytes == 0 ? 0 : bytes + kWorkspaceAlign;
}

}  // namespace regemm
