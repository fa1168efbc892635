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
  for (int64_t t = int64_t(blockIdx.x) * WGS + wg; t < tiles; t += int64_t(gridDim.x) * WGS) {
    const int64_t row0 = t * 64 + warp * 16;  // this warp's 16 rows of the tile
    // Layer 0: K0 (padded to 32) -> W, its A operand read from x two k steps at a time.
    {
      const Layer& L = p.layer[0];
      const char* wt = smem + L.w_off;
      for (int kc = 0; kc < L.kp / 32; ++kc) {
        uint32_t ax[2][4];
        x_operand<T>(ax[0], p, row0 + g, kc * 32 + 2 * q);
        x_operand<T>(ax[1], p, row0 + g, kc * 32 + 16 + 2 * q);
        layer_mma<T, W, 2>(acc[0], ax, wt + kc * 512, L.kp, kc > 0);
      }
      epilogue_to_a<T, HID, 1, NT>(a, acc, reinterpret_cast<const float*>(smem + L.b_off), p.slope, lane);
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

// The forward on wgmma; p planned with Layout::kCoreMatrices. cudaErrorNoKernelImageForDevice
// where this build or device has no wgmma kernel (the caller takes launch_fwd).
template <class T>
cudaError_t launch_fwd_gmma(const Params& p, int width, cudaStream_t stream) {
  cudaError_t e = cudaErrorInvalidValue;
  with_width_act(width, p.act_hidden, [&](auto w, auto a) {
    constexpr int W = decltype(w)::value, WGS = gmma_groups(W);
    const void* kernel = reinterpret_cast<const void*>(&narrow_mlp_fwd_gmma<T, W, decltype(a)::value, WGS>);
    e = gmma_runs_here(kernel) ? launch_persistent(kernel, p, WGS * 128, (p.m + 63) / 64, WGS, stream)
                               : cudaErrorNoKernelImageForDevice;
  });
  return e;
}

}  // namespace regemm::narrow
