// The fused narrow MLP's forward on sm90a's warpgroup MMA (gmma.h): narrow_mlp.cuh's design
// with a warpgroup in place of a warp. A warpgroup carries a 64-row tile through every layer:
// each layer is one chain of m64nWk16 MMAs, A (the tile, bf16/f16) from registers, B (Wt,
// K-major core matrices) from shared memory, the accumulators left in the layout the epilogue
// packs into the next layer's A, as mma.sync's are. Per layer a warp issues W/16 MMAs where
// mma.sync took W/2 with their B fragments' ldmatrix loads: the issue slots mma.sync's kernel
// spent on the tensor cores go to the epilogues (it ran at 31% of the tensor-core peak at 64
// wide with 51% of issue slots busy, docs/performance.md).
//
// Built only for sm90a (the body is empty elsewhere): gmma_runs_here() says whether this build
// and device run it.
#pragma once

#include "cuda/narrow/narrow_mlp.cuh"

namespace regemm::narrow {

// Warpgroups a block and blocks an SM the registers are bounded for, by width: 2 warpgroups
// share a block's copy of the weights under 128 wide (a few KB to 30 KB: several blocks an SM);
// at 128 the weights take about half of shared memory, so 3 warpgroups a block.
constexpr int gmma_groups(int width) { return width >= 128 ? 3 : 2; }
constexpr int gmma_min_blocks(int width) { return width >= 128 ? 1 : width >= 64 ? 2 : width >= 32 ? 3 : 4; }

// The descriptor of k step kt (16 of K) of B = a layer's Wt at wt (K-major core matrices, rows of
// kp elements): the forward's B (Wt^T: K along Wt's rows) or, TRANS, the dgrad's (Wt read
// MN-major: K along its columns' index n, 16 rows of Wt a step).
template <int TRANS>
__device__ __forceinline__ uint64_t wt_descriptor(const char* wt, int kp, int kt) {
  return TRANS ? gmma::descriptor(wt + kt * 32 * kp, 16 * kp, 128) : gmma::descriptor(wt + kt * 256, 128, 16 * kp);
}

// acc (=, or += where accumulate) A B: A in registers (KT k steps of 16), B from Wt (above); one
// chain of MMAs, waited for (its epilogue follows).
template <class T, int N, int KT, int TRANS = 0>
__device__ __forceinline__ void layer_mma(float (&acc)[N / 8][4], const uint32_t (&a)[KT][4], const char* wt, int kp,
                                          bool accumulate = false) {
  gmma::pin(acc);
  gmma::fence();
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
    gmma::Rs<T, N, TRANS>::run(acc, a[kt], wt_descriptor<TRANS>(wt, kp, kt), accumulate || kt > 0);
  gmma::commit();
  gmma::wait<0>();
  gmma::pin(acc);
}

// The A operand of x's columns c.. c + 16 for rows r and r + 8 (zero outside x).
template <class T>
__device__ __forceinline__ void x_operand(uint32_t (&ax)[4], const Params& p, int64_t r, int c) {
  const T* x = static_cast<const T*>(p.x);
  const int k0 = p.layer[0].k;
  ax[0] = load_pair(x, p.m, k0, r, c);
  ax[1] = load_pair(x, p.m, k0, r + 8, c);
  ax[2] = load_pair(x, p.m, k0, r, c + 8);
  ax[3] = load_pair(x, p.m, k0, r + 8, c + 8);
}

// The output layer W -> N_out, 16 columns at a time (m64n16k16), stored from the registers.
template <class T, Act A, int W>
__device__ __forceinline__ void output_layer_gmma(const Params& p, const char* smem, const uint32_t (&a)[1][W / 16][4],
                                                  int64_t row0, int lane) {
  constexpr int KT = W / 16;
  const int g = lane >> 2, q = lane & 3;
  const Layer& L = p.layer[p.layers - 1];
  const char* wt = smem + L.w_off;
  const float* bias = reinterpret_cast<const float*>(smem + L.b_off);
  T* y = static_cast<T*>(p.y);
  for (int j = 0; j < L.np / 16; ++j) {
    float o[2][4] = {};
    layer_mma<T, 16, KT>(o, a[0], wt + j * 32 * W, W);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = j * 16 + h * 8 + 2 * q;
      const float b0 = bias[c], b1 = bias[c + 1];
      store_pair(y, p.m, L.n, row0 + g, c, act<A>(o[h][0] + b0, p.slope), act<A>(o[h][1] + b1, p.slope));
      store_pair(y, p.m, L.n, row0 + g + 8, c, act<A>(o[h][2] + b0, p.slope), act<A>(o[h][3] + b1, p.slope));
    }
  }
}

template <class T, int W, Act HID, int WGS>
__global__ void __launch_bounds__(WGS * 128, gmma_min_blocks(W)) narrow_mlp_fwd_gmma(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) char smem[];
  load_weights<T>(p, smem, CoreMatrices{});
  gmma::fence_shared();
  __syncthreads();
  constexpr int NT = W / 8, KT = W / 16;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, wg = threadIdx.x >> 7;
  const int g = lane >> 2, q = lane & 3;
  const int64_t tiles = (p.m + 63) / 64;
  float acc[1][NT][4];
  zero(acc);
  uint32_t a[1][KT][4];
  // x of the warpgroup's next tile, loaded while it works on this one (K0 <= 64: two 32-column
  // steps in 16 registers): with a few warpgroups an SM nothing else hides a global load's
  // latency, paid at every tile's start where x was loaded in place.
  const Layer& L0 = p.layer[0];
  const bool ahead = L0.kp <= 64;
  const int64_t step = int64_t(gridDim.x) * WGS;
  uint32_t xn[2][2][4];
  auto fetch = [&](int64_t t) {
#pragma unroll
    for (int kc = 0; kc < 2; ++kc)
      if (kc * 32 < L0.kp) {
        x_operand<T>(xn[kc][0], p, t * 64 + warp * 16 + g, kc * 32 + 2 * q);
        x_operand<T>(xn[kc][1], p, t * 64 + warp * 16 + g, kc * 32 + 16 + 2 * q);
      }
  };
  const int64_t first = int64_t(blockIdx.x) * WGS + wg;
  if (ahead && first < tiles) fetch(first);
  for (int64_t t = first; t < tiles; t += step) {
    const int64_t row0 = t * 64 + warp * 16;  // this warp's 16 rows of the tile
    // Layer 0: K0 (padded to 32) -> W, its A operand read from x two k steps at a time.
    {
      const char* wt = smem + L0.w_off;
      if (ahead) {
        uint32_t ax[2][2][4];
#pragma unroll
        for (int kc = 0; kc < 2; ++kc)
#pragma unroll
          for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int i = 0; i < 4; ++i) ax[kc][s][i] = xn[kc][s][i];
        if (t + step < tiles) fetch(t + step);  // (row zero outside x: load_pair)
#pragma unroll
        for (int kc = 0; kc < 2; ++kc)
          if (kc * 32 < L0.kp) layer_mma<T, W, 2>(acc[0], ax[kc], wt + kc * 512, L0.kp, kc > 0);
      } else {
        for (int kc = 0; kc < L0.kp / 32; ++kc) {
          uint32_t ax[2][4];
          x_operand<T>(ax[0], p, row0 + g, kc * 32 + 2 * q);
          x_operand<T>(ax[1], p, row0 + g, kc * 32 + 16 + 2 * q);
          layer_mma<T, W, 2>(acc[0], ax, wt + kc * 512, L0.kp, kc > 0);
        }
      }
      epilogue_to_a<T, HID, 1, NT>(a, acc, reinterpret_cast<const float*>(smem + L0.b_off), p.slope, lane);
    }
    // The hidden layers W -> W.
    for (int l = 1; l < p.layers - 1; ++l) {
      const Layer& L = p.layer[l];
      layer_mma<T, W, KT>(acc[0], a[0], smem + L.w_off, W);
      epilogue_to_a<T, HID, 1, NT>(a, acc, reinterpret_cast<const float*>(smem + L.b_off), p.slope, lane);
    }
    switch (p.act_out) {
#define REGEMM_NARROW_OUT(A) \
  case A: output_layer_gmma<T, A, W>(p, smem, a, row0, lane); break;
      REGEMM_NARROW_OUT(Act::kNone) REGEMM_NARROW_OUT(Act::kRelu) REGEMM_NARROW_OUT(Act::kLeakyRelu)
      REGEMM_NARROW_OUT(Act::kGelu) REGEMM_NARROW_OUT(Act::kGeluErf) REGEMM_NARROW_OUT(Act::kSigmoid)
      REGEMM_NARROW_OUT(Act::kTanh) REGEMM_NARROW_OUT(Act::kSilu)
#undef REGEMM_NARROW_OUT
    }
  }
#endif
}

// 16 columns of y (c, c + 8 of this thread, c = 16 j + 2 q) for rows r and r + 8 from an
// m64n16 accumulator: act_out(o + bias).
template <class T>
__device__ __forceinline__ void store_out16(const Params& p, const float* bias, const float (&o)[2][4], int64_t r, int c0) {
  const Layer& L = p.layer[p.layers - 1];
  T* y = static_cast<T*>(p.y);
  switch (p.act_out) {
#define REGEMM_NARROW_OUT(A)                                                                           \
  case A:                                                                                              \
    for (int h = 0; h < 2; ++h) {                                                                      \
      const int c = c0 + h * 8;                                                                        \
      const float b0 = bias[c], b1 = bias[c + 1];                                                      \
      store_pair(y, p.m, L.n, r, c, act<A>(o[h][0] + b0, p.slope), act<A>(o[h][1] + b1, p.slope));     \
      store_pair(y, p.m, L.n, r + 8, c, act<A>(o[h][2] + b0, p.slope), act<A>(o[h][3] + b1, p.slope)); \
    }                                                                                                  \
    break;
    REGEMM_NARROW_OUT(Act::kNone) REGEMM_NARROW_OUT(Act::kRelu) REGEMM_NARROW_OUT(Act::kLeakyRelu)
    REGEMM_NARROW_OUT(Act::kGelu) REGEMM_NARROW_OUT(Act::kGeluErf) REGEMM_NARROW_OUT(Act::kSigmoid)
    REGEMM_NARROW_OUT(Act::kTanh) REGEMM_NARROW_OUT(Act::kSilu)
#undef REGEMM_NARROW_OUT
  }
}

// Two tiles a warpgroup, in step: while one tile's epilogue runs, the other's MMA chain does, where
// narrow_mlp_fwd_gmma waits on each chain it issues. Per tile in turn: wait for its chain
// (wait_group 1: the other's may still run), its epilogue to the next layer's A, its next chain
// issued and committed. Widths 16-64, K0 <= 32, N_out 16 (launch_fwd_gmma).
// ptxas keeps the chains asynchronous only if none is in flight across a loop's back-edge or
// a branch's join (else it serializes every wgmma of the kernel: tools/wgmma_serialization.sh),
// so each depth has its own copy of the pair, every layer unrolled.
template <class T, int W, Act HID, int WGS>
__global__ void __launch_bounds__(WGS * 128, 2) narrow_mlp_fwd_gmma2(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) char smem[];
  load_weights<T>(p, smem, CoreMatrices{});
  gmma::fence_shared();
  __syncthreads();
  constexpr int NT = W / 8, KT = W / 16;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, wg = threadIdx.x >> 7;
  const int g = lane >> 2, q = lane & 3;
  const int64_t tiles = (p.m + 63) / 64, step = int64_t(gridDim.x) * WGS;
  const int hidden = p.layers - 1;
  const Layer& Lo = p.layer[hidden];
  float acc[2][NT][4];
  uint32_t a[2][KT][4];
  float o[2][2][4];
  auto A1 = [&](int s) -> uint32_t(&)[1][KT][4] { return *reinterpret_cast<uint32_t(*)[1][KT][4]>(&a[s]); };
  auto C1 = [&](int s) -> float(&)[1][NT][4] { return *reinterpret_cast<float(*)[1][NT][4]>(&acc[s]); };
  // Tile s's epilogue of layer l (bias b_off) to its A operand, then its chain through Wt at
  // w_off into d (N columns).
  auto step_tile = [&](int s, int b_off, auto& d, const char* wt) {
    constexpr int N = sizeof(d) / sizeof(float) / 4 * 8;
    gmma::wait<1>();
    gmma::pin(acc[s]);
    epilogue_to_a<T, HID, 1, NT>(A1(s), C1(s), reinterpret_cast<const float*>(smem + b_off), p.slope, lane);
    gmma::fence();
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) gmma::Rs<T, N, 0>::run(d, a[s][kt], wt_descriptor<0>(wt, W, kt), kt > 0);
    gmma::commit();
  };
  auto pair = [&](auto depth, int64_t t) {
    constexpr int D = decltype(depth)::value;
    const int64_t row0[2] = {t * 64 + warp * 16, (t + step) * 64 + warp * 16};  // (the second may be past m)
    // Layer 0 of both tiles (K0 <= 32: one 32-column step), x loaded for both first.
    uint32_t ax[2][2][4];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      x_operand<T>(ax[s][0], p, row0[s] + g, 2 * q);
      x_operand<T>(ax[s][1], p, row0[s] + g, 16 + 2 * q);
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      gmma::pin(acc[s]);
      gmma::fence();
#pragma unroll
      for (int kt = 0; kt < 2; ++kt)
        gmma::Rs<T, W, 0>::run(acc[s], ax[s][kt], wt_descriptor<0>(smem + p.layer[0].w_off, 32, kt), kt > 0);
      gmma::commit();
    }
#pragma unroll
    for (int l = 0; l + 1 < D; ++l)
#pragma unroll
      for (int s = 0; s < 2; ++s) step_tile(s, p.layer[l].b_off, acc[s], smem + p.layer[l + 1].w_off);
#pragma unroll
    for (int s = 0; s < 2; ++s) step_tile(s, p.layer[D - 1].b_off, o[s], smem + Lo.w_off);
    const float* bias = reinterpret_cast<const float*>(smem + Lo.b_off);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if (s == 0) gmma::wait<1>();
      else gmma::wait<0>();  // (an empty group's wait<1> instead: ptxas serializes)
      gmma::pin(o[s]);
      store_out16<T>(p, bias, o[s], row0[s] + g, 2 * q);
    }
  };
  for (int64_t t = int64_t(blockIdx.x) * WGS + wg; t < tiles; t += 2 * step) {
    switch (hidden) {
      case 1: pair(std::integral_constant<int, 1>{}, t); break;
      case 2: pair(std::integral_constant<int, 2>{}, t); break;
      case 3: pair(std::integral_constant<int, 3>{}, t); break;
      case 4: pair(std::integral_constant<int, 4>{}, t); break;
      case 5: pair(std::integral_constant<int, 5>{}, t); break;
      case 6: pair(std::integral_constant<int, 6>{}, t); break;
      case 7: pair(std::integral_constant<int, 7>{}, t); break;
      default: pair(std::integral_constant<int, 8>{}, t); break;
    }
  }
#endif
}

// Whether this build has the wgmma kernels (CMake defines REGEMM_SM90A where it builds for 90a
// alone) and the current device runs them (the driver chose their sm_90 binary).
inline bool gmma_runs_here(const void* kernel) {
#if defined(REGEMM_SM90A)
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, bool> cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(dev, kernel);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes attr{};
  const bool ok = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion == 90;
  (void)cudaGetLastError();  // (a kernel with no image here leaves its error behind)
  return cache[key] = ok;
#else
  (void)kernel;
  return false;
#endif
}

// The wgmma forward's kernel for dtype T, hidden activation A and a hidden width (null for
// another width); pair: narrow_mlp_fwd_gmma2 where the width allows it.
template <class T, Act A>
const void* kernel_fwd_gmma(int width, bool pair) {
  const void* k = nullptr;
  with_width(width, [&](auto w) {
    constexpr int W = decltype(w)::value, WGS = gmma_groups(W);
    k = reinterpret_cast<const void*>(&narrow_mlp_fwd_gmma<T, W, A, WGS>);
    if constexpr (W <= 64)
      if (pair) k = reinterpret_cast<const void*>(&narrow_mlp_fwd_gmma2<T, W, A, WGS>);
  });
  return k;
}

// The forward on wgmma (pair: two tiles a warpgroup, narrow_mlp_fwd_gmma2, where N_out is 16); p
// planned with Layout::kCoreMatrices. cudaErrorNoKernelImageForDevice
// where this build or device has no wgmma kernel (the caller takes launch_fwd).
template <class T>
cudaError_t launch_fwd_gmma(const Params& p, int width, cudaStream_t stream, bool pair = false) {
  pair = pair && width <= 64 && p.layer[0].kp == 32 && p.layer[p.layers - 1].np == 16;  // (narrow_mlp_fwd_gmma2's)
  const void* kernel = nullptr;
  with_act(p.act_hidden, [&](auto a) { kernel = kernel_fwd_gmma<T, decltype(a)::value>(width, pair); });
  if (kernel == nullptr) return cudaErrorInvalidValue;
  if (!gmma_runs_here(kernel)) return cudaErrorNoKernelImageForDevice;
  const int wgs = gmma_groups(width);
  return launch_persistent(kernel, p, wgs * 128, (p.m + 63) / 64, pair ? 2 * wgs : wgs, stream);
}

}  // namespace regemm::narrow
