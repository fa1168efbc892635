// The backward epilogue on the GPU: gZ = gY * act'(S) (S = Z, or Y where act'
// can be read off the output), with the bias gradient reduced in the same
// pass over gZ.
//
// Determinism: gBias is bit-identical from run to run. No atomics; every sum
// has a fixed order. The M x N output is cut into 64 x 32 tiles (block of
// 32 x 8 threads, 8 rows each); a tile's partial sums are computed by one
// function (tile_partial) in a fixed order, and the partials of the tiles are
// then added in tile order. Two ways to add them, same arithmetic, same bits:
// - two passes (the usual case): every tile in parallel writes its partial to
//   scratch, and a second kernel adds them up;
// - one pass, no scratch (while XLA captures the call into a CUDA graph, where
//   scratch cannot be used, see runtime.h): one block per output strip walks
//   its tiles in order and keeps the running sums itself. Less parallel, so
//   it is only the fallback.
// The bias gradient sums gZ as stored (rounded to the output dtype), in the
// accumulation type (f32, or f64 for f64).
#include <cstdint>

#include "../regemm/handlers.h"
#include "runtime.h"

namespace regemm {
namespace {

constexpr int kTileN = 32;                      // columns per tile = lanes of a warp
constexpr int kRowLanes = 8;                    // warps per block
constexpr int kRowsPerThread = 8;
constexpr int kTileM = kRowLanes * kRowsPerThread;  // 64 rows per tile
constexpr int kThreads = kTileN * kRowLanes;        // 256
constexpr int kScalarLanes = kThreads;              // scalar: partials folded into 256 running sums

struct DactArgs {
  int64_t m, n, batch, stride_gy, stride_s, tiles_m, tiles_n;
  const void* gy;
  const void* s;
  void* gz;
  void* gbias;     // null: no bias
  void* partials;  // scratch for the two-pass reduction, or null
  double slope;
  Act act;
  bool from_y;
  BiasKind kind;
};

__host__ __device__ int64_t bias_len(const DactArgs& a) {
  return a.kind == BiasKind::kPerCol ? a.n : a.kind == BiasKind::kPerRow ? a.m : a.kind == BiasKind::kScalar ? 1 : 0;
}

// Partial sums per batch entry, in the scratch layout of each kind:
// per-col [tiles_m][n], per-row [tiles_n][m], scalar [tiles_m * tiles_n].
__host__ __device__ int64_t partials_per_batch(const DactArgs& a) {
  switch (a.kind) {
    case BiasKind::kPerCol: return a.tiles_m * a.n;
    case BiasKind::kPerRow: return a.tiles_n * a.m;
    case BiasKind::kScalar: return a.tiles_m * a.tiles_n;
    default: return 0;
  }
}

// gZ of tile (tm, tn) of batch entry b: writes gZ and returns this thread's
// values (as stored, in the accumulation type; 0 outside the matrix) for its
// column tn*32 + threadIdx.x and rows tm*64 + threadIdx.y + 8r.
template <class T>
__device__ __forceinline__ void tile_gz(const DactArgs& a, int64_t b, int64_t tm, int64_t tn,
                                        acc_t<T> (&g)[kRowsPerThread]) {
  using A = acc_t<T>;
  const T* gy = static_cast<const T*>(a.gy) + b * a.stride_gy;
  const T* s = static_cast<const T*>(a.s) + b * a.stride_s;
  T* gz = static_cast<T*>(a.gz) + b * a.m * a.n;
  const A slope = A(a.slope);
  const int64_t col = tn * kTileN + threadIdx.x;
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int64_t row = tm * kTileM + threadIdx.y + r * kRowLanes;
    g[r] = A(0);
    if (row < a.m && col < a.n) {
      const int64_t off = row * a.n + col;
      const A sv = load<A>(s[off]);
      const A d = a.from_y ? act_grad_from_y(a.act, sv, slope) : act_grad(a.act, sv, slope);
      const T v = store<T>(load<A>(gy[off]) * d);
      gz[off] = v;
      g[r] = load<A>(v);
    }
  }
}

// Fixed-order warp sum (xor butterfly); lane 0's result is the one used.
template <class A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The tile's partial sums for the bias kind, computed the same way by both
// paths. Per-col and scalar: the result is in `col` of the threads with
// threadIdx.y == 0 (column x's sum over the tile's rows; scalar: lane 0 of
// warp 0 holds the tile's total). Per-row: lane 0 of warp y holds in row[r]
// the sum over the tile's columns of row y + 8r (no shared memory). Where
// shared memory is used it ends with a barrier, so the caller may call it
// again right away.
template <class T>
__device__ __forceinline__ void tile_partial(const DactArgs& a, int64_t b, int64_t tm, int64_t tn,
                                             acc_t<T>& col, acc_t<T> (&row)[kRowsPerThread]) {
  using A = acc_t<T>;
  __shared__ A red[kRowLanes][kTileN];
  A g[kRowsPerThread];
  tile_gz<T>(a, b, tm, tn, g);
  if (a.kind == BiasKind::kPerRow) {
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) row[r] = warp_sum(g[r]);
    return;  // no shared memory used
  }
  A t = A(0);
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) t += g[r];
  red[threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  if (threadIdx.y == 0) {
    A sum = A(0);
#pragma unroll
    for (int y = 0; y < kRowLanes; ++y) sum += red[y][threadIdx.x];
    col = a.kind == BiasKind::kScalar ? warp_sum(sum) : sum;
  }
  __syncthreads();
}

// The last step of the scalar reduction: 256 running sums (lane t holds
// the partials of tiles t, t+256, ... added in order) to one, fixed tree.
template <class A> __device__ __forceinline__ A block_sum(A v) {
  __shared__ A buf[kScalarLanes];
  const int t = threadIdx.y * kTileN + threadIdx.x;
  buf[t] = v;
  __syncthreads();
#pragma unroll
  for (int w = kScalarLanes / 2; w > 0; w >>= 1) {
    if (t < w) buf[t] += buf[t + w];
    __syncthreads();
  }
  return buf[0];
}

// ---------------------------------------------------------------------------
// Two passes: all tiles in parallel (partials to scratch), then the sums.
// ---------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads) dact_tiles_kernel(const DactArgs a) {
  using A = acc_t<T>;
  const int64_t tm = int64_t(blockIdx.x) / a.tiles_n, tn = int64_t(blockIdx.x) % a.tiles_n;
  const int64_t per_batch = partials_per_batch(a);
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) {
    if (a.kind == BiasKind::kNone) {
      A g[kRowsPerThread];
      tile_gz<T>(a, b, tm, tn, g);
      continue;
    }
    A col = A(0), row[kRowsPerThread];
    tile_partial<T>(a, b, tm, tn, col, row);
    A* p = static_cast<A*>(a.partials) + b * per_batch;
    if (a.kind == BiasKind::kPerCol) {
      const int64_t c = tn * kTileN + threadIdx.x;
      if (threadIdx.y == 0 && c < a.n) p[tm * a.n + c] = col;
    } else if (a.kind == BiasKind::kPerRow) {
      if (threadIdx.x == 0)
#pragma unroll
        for (int r = 0; r < kRowsPerThread; ++r) {
          const int64_t i = tm * kTileM + threadIdx.y + r * kRowLanes;
          if (i < a.m) p[tn * a.m + i] = row[r];
        }
    } else if (threadIdx.x == 0 && threadIdx.y == 0) {
      p[tm * a.tiles_n + tn] = col;
    }
  }
}

// Per-col / per-row: one thread per bias element adds its partials in tile order.
template <class T>
__global__ void __launch_bounds__(kThreads) dact_sum_vector_kernel(const DactArgs a) {
  using A = acc_t<T>;
  const int64_t len = bias_len(a), parts = a.kind == BiasKind::kPerCol ? a.tiles_m : a.tiles_n;
  const int64_t per_batch = partials_per_batch(a);
  const int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.y * kTileN + threadIdx.x;
  if (j >= len) return;
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) {
    const A* p = static_cast<const A*>(a.partials) + b * per_batch;
    A sum = A(0);
    for (int64_t t = 0; t < parts; ++t) sum += p[t * len + j];
    static_cast<T*>(a.gbias)[b * len + j] = store<T>(sum);
  }
}

// Scalar: one block per batch entry.
template <class T>
__global__ void __launch_bounds__(kThreads) dact_sum_scalar_kernel(const DactArgs a) {
  using A = acc_t<T>;
  const int64_t parts = a.tiles_m * a.tiles_n;
  const int t = threadIdx.y * kTileN + threadIdx.x;
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) {
    const A* p = static_cast<const A*>(a.partials) + b * parts;
    A sum = A(0);
    for (int64_t i = t; i < parts; i += kScalarLanes) sum += p[i];
    const A total = block_sum(sum);
    if (t == 0) static_cast<T*>(a.gbias)[b] = store<T>(total);
    __syncthreads();  // buf is reused by the next batch entry
  }
}

// ---------------------------------------------------------------------------
// One pass without scratch: a block per output strip walks its tiles in order.
// ---------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads) dact_strip_kernel(const DactArgs a) {
  using A = acc_t<T>;
  __shared__ A lanes[kScalarLanes];  // scalar: the 256 running sums of dact_sum_scalar_kernel
  const int t = threadIdx.y * kTileN + threadIdx.x;
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) {
    T* gbias = static_cast<T*>(a.gbias) + b * bias_len(a);
    if (a.kind == BiasKind::kPerCol) {  // strip = 32 columns, all row tiles
      const int64_t tn = blockIdx.x;
      A sum = A(0), col = A(0), row[kRowsPerThread];
      for (int64_t tm = 0; tm < a.tiles_m; ++tm) {
        tile_partial<T>(a, b, tm, tn, col, row);
        sum += col;
      }
      const int64_t c = tn * kTileN + threadIdx.x;
      if (threadIdx.y == 0 && c < a.n) gbias[c] = store<T>(sum);
    } else if (a.kind == BiasKind::kPerRow) {  // strip = 64 rows, all column tiles
      const int64_t tm = blockIdx.x;
      A sum[kRowsPerThread] = {}, col = A(0), row[kRowsPerThread];
      for (int64_t tn = 0; tn < a.tiles_n; ++tn) {
        tile_partial<T>(a, b, tm, tn, col, row);
#pragma unroll
        for (int r = 0; r < kRowsPerThread; ++r) sum[r] += row[r];
      }
      if (threadIdx.x == 0)
#pragma unroll
        for (int r = 0; r < kRowsPerThread; ++r) {
          const int64_t i = tm * kTileM + threadIdx.y + r * kRowLanes;
          if (i < a.m) gbias[i] = store<T>(sum[r]);
        }
    } else {  // scalar: one block walks every tile
      lanes[t] = A(0);
      __syncthreads();
      A col = A(0), row[kRowsPerThread];
      const int64_t parts = a.tiles_m * a.tiles_n;
      for (int64_t i = 0; i < parts; ++i) {
        tile_partial<T>(a, b, i / a.tiles_n, i % a.tiles_n, col, row);
        if (t == 0) lanes[i % kScalarLanes] += col;
      }
      __syncthreads();
      const A total = block_sum(lanes[t]);
      if (t == 0) gbias[0] = store<T>(total);
      __syncthreads();
    }
  }
}

// ---------------------------------------------------------------------------

unsigned grid_z(int64_t batch) { return unsigned(batch < 65535 ? batch : 65535); }

template <class T>
ffi::Error run_t(DactArgs a, CudaRuntime& rt) {
  using A = acc_t<T>;
  const dim3 block(kTileN, kRowLanes);
  const int64_t tiles = a.tiles_m * a.tiles_n;
  if (tiles > int64_t(0x7fffffff)) return bad("gY too large for the backward-epilogue grid");
  if (a.kind != BiasKind::kNone) {
    const size_t bytes = size_t(a.batch * partials_per_batch(a)) * sizeof(A);
    if (auto e = rt.scratch_for_call(bytes, &a.partials); e.failure()) return e;
    if (bytes > 0 && !a.partials) {  // capturing a CUDA graph: the scratch-free path
      const int64_t strips = a.kind == BiasKind::kPerCol ? a.tiles_n : a.kind == BiasKind::kPerRow ? a.tiles_m : 1;
      dact_strip_kernel<T><<<dim3(unsigned(strips), 1, grid_z(a.batch)), block, 0, rt.stream>>>(a);
      REGEMM_LAUNCH_CHECK();
      return ffi::Error::Success();
    }
  }
  // Two passes. With no partials at all (M or N is 0) the second pass writes zeros.
  if (tiles > 0) {
    dact_tiles_kernel<T><<<dim3(unsigned(tiles), 1, grid_z(a.batch)), block, 0, rt.stream>>>(a);
    REGEMM_LAUNCH_CHECK();
  }
  const int64_t len = bias_len(a);
  if (a.kind == BiasKind::kScalar) {
    dact_sum_scalar_kernel<T><<<dim3(1, 1, grid_z(a.batch)), block, 0, rt.stream>>>(a);
    REGEMM_LAUNCH_CHECK();
  } else if (a.kind != BiasKind::kNone && len > 0) {
    dact_sum_vector_kernel<T><<<dim3(unsigned((len + kThreads - 1) / kThreads), 1, grid_z(a.batch)), block, 0,
                                rt.stream>>>(a);
    REGEMM_LAUNCH_CHECK();
  }
  return ffi::Error::Success();
}

ffi::Error run_dact(const DactProblem& p, const DactOperands& o, CudaRuntime& rt) {
  DactArgs a{p.m, p.n, p.batch, p.stride_gy, p.stride_s,
             (p.m + kTileM - 1) / kTileM, (p.n + kTileN - 1) / kTileN,
             o.gy, o.s, o.gz, o.gbias, /*partials=*/nullptr,
             p.slope, p.act, p.from_y, o.gbias ? p.bias_kind : BiasKind::kNone};
  switch (p.dtype) {
    case DType::kF32: return run_t<float>(a, rt);
    case DType::kF64: return run_t<double>(a, rt);
    case DType::kBF16: return run_t<bf16_t>(a, rt);
    case DType::kF16: return run_t<f16_t>(a, rt);
  }
  return bad("backward epilogue: unsupported dtype");
}

const Register<DactProblem, DactOperands, CudaRuntime> kRegister({
    "cuda_dact", 0, [](const DactProblem&) { return true; }, run_dact});

}  // namespace
}  // namespace regemm
