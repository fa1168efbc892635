// The fused narrow MLP's backward on sm90a's warpgroup MMA (gmma.h), and the host side of both
// backward kernels. narrow_mlp_bwd.cuh's design with a warpgroup of 64 rows a chunk in place of
// 8 warps of 16, and every product on wgmma:
//   recompute  h_l in registers as the forward's (RS, B = Wt K-major), keeping x and each z
//              in shared memory as [64 rows][64] MN-major tiles H_l (the weight gradient's A);
//   dgrad      gH_{l-1} = gZ_l W_l^T (RS: A = gZ_l in registers, B = the same Wt read MN-major),
//              then gZ_{l-1} = gH * act'(z_{l-1}) in registers (the next dgrad's A), into the
//              tile G (the weight gradient's B), with h = act(z) written over z;
//   dW         dW_l += H_l^T G_l over the chunk's 64 rows (SS, both MN-major, the rows as K;
//              M is the layer's input width padded to 64 by columns kept zero), the sums in
//              registers over every chunk the block takes, issued after the barrier that
//              completes G_l and running while the next layer's dgrad epilogue works (three G
//              tiles in turn).
// Then, as the mma.sync kernel, the block's partial sums (row-major here) and the ordered
// reduction. Stacks of 1-4 hidden layers 16-64 wide, relu or gelu, K0 <= 64, N_out <= 16 (the
// dW sums are registers, so the depth is a template parameter); the mma.sync kernel elsewhere.
#pragma once

#include "cuda/narrow/narrow_mlp_bwd.cuh"
#include "cuda/narrow/narrow_mlp_gmma.cuh"

namespace regemm::narrow {

constexpr int kGmmaBwdDepth = 4;  // hidden layers at most
constexpr int gmma_bwd_min_blocks(int width) { return width >= 64 ? 2 : 3; }

// Whether the wgmma backward takes the stack (p's sizes; hidden layers all `width` wide).
inline bool gmma_bwd_takes(const Params& p, int width) {
  const int hidden = p.layers - 1;
  return (width == 16 || width == 32 || width == 64) && hidden >= 1 && hidden <= kGmmaBwdDepth &&
         p.layer[0].k <= 64 && p.layer[p.layers - 1].n <= 16 &&
         (p.act_hidden == Act::kRelu || p.act_hidden == Act::kGelu);
}

// The packed pair (r, c), (r, c + 1) of a [64 rows][..] MN-major tile.
template <class T>
__device__ __forceinline__ uint32_t& mn_pair(char* tile, int r, int c) {
  return *reinterpret_cast<uint32_t*>(reinterpret_cast<T*>(tile) + gmma::mnmajor_at(r, c, 64));
}

// A recomputed hidden layer's epilogue: z = acc + bias to the tile hz (rounded, for the way
// down), h = act(z) to the next layer's A operand.
template <class T, Act A, int NT>
__device__ __forceinline__ void keep_z(uint32_t (&a)[1][NT / 2][4], const float (&acc)[NT][4], const float* bias,
                                       float slope, char* hz, int r0, int q) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int c = j * 8 + 2 * q;
    const float z0 = acc[j][0] + bias[c], z1 = acc[j][1] + bias[c + 1];
    const float z2 = acc[j][2] + bias[c], z3 = acc[j][3] + bias[c + 1];
    a[0][j / 2][(j & 1) * 2 + 0] = Elem<T>::pack(act<A>(z0, slope), act<A>(z1, slope));
    a[0][j / 2][(j & 1) * 2 + 1] = Elem<T>::pack(act<A>(z2, slope), act<A>(z3, slope));
    mn_pair<T>(hz, r0, c) = Elem<T>::pack(z0, z1);
    mn_pair<T>(hz, r0 + 8, c) = Elem<T>::pack(z2, z3);
  }
}

// gZ_{l-1} = gH_{l-1} (acc) * act'(z_{l-1}): to the A operand ga, the tile gout and the warp's
// bias sums; h_{l-1} = act(z_{l-1}) over z_{l-1} in the tile h.
template <class T, Act A, int W>
__device__ __forceinline__ void hidden_grad_gmma(uint32_t (&ga)[W / 16][4], const float (&acc)[W / 8][4], char* h,
                                                 char* gout, float* db, float slope, int r0, int q, int lane) {
  constexpr int NT = W / 8;
  float sums[2 * NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int c = j * 8 + 2 * q;
    uint32_t& p0 = mn_pair<T>(h, r0, c);
    uint32_t& p1 = mn_pair<T>(h, r0 + 8, c);
    const float2 z0 = Elem<T>::unpack(p0), z1 = Elem<T>::unpack(p1);
    p0 = Elem<T>::pack(act<A>(z0.x, slope), act<A>(z0.y, slope));
    p1 = Elem<T>::pack(act<A>(z1.x, slope), act<A>(z1.y, slope));
    const float g0 = acc[j][0] * act_grad<float, FastMath>(A, z0.x, slope);
    const float g1 = acc[j][1] * act_grad<float, FastMath>(A, z0.y, slope);
    const float g2 = acc[j][2] * act_grad<float, FastMath>(A, z1.x, slope);
    const float g3 = acc[j][3] * act_grad<float, FastMath>(A, z1.y, slope);
    const uint32_t lo = Elem<T>::pack(g0, g1), hi = Elem<T>::pack(g2, g3);
    ga[j / 2][(j & 1) * 2 + 0] = lo;
    ga[j / 2][(j & 1) * 2 + 1] = hi;
    mn_pair<T>(gout, r0, c) = lo;
    mn_pair<T>(gout, r0 + 8, c) = hi;
    sums[2 * j] = g0 + g2;
    sums[2 * j + 1] = g1 + g3;
  }
  add_column_sums<NT>(sums, db, lane);
}

// The output layer's gZ = gy * act'_out(z_out) (z recomputed; gy itself for act none), 16
// columns: to the A operand gt, the tile gout and the warp's bias sums.
template <class T, Act A, int W>
__device__ __forceinline__ void top_grad_gmma(const Params& p, const BwdParams& bp, const char* smem,
                                              const uint32_t (&a)[1][W / 16][4], int64_t row0, int r0, int q,
                                              uint32_t (&gt)[1][4], char* gout, float* db, int lane) {
  const Layer& L = p.layer[p.layers - 1];
  const float* bias = reinterpret_cast<const float*>(smem + L.b_off);
  float o[2][4] = {};
  if constexpr (A != Act::kNone) layer_mma<T, 16, W / 16>(o, a[0], smem + L.w_off, W);
  const T* gy = static_cast<const T*>(bp.gy);
  float sums[4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = h * 8 + 2 * q;
    const float2 g0 = Elem<T>::unpack(load_pair(gy, p.m, L.n, row0 + r0, c));
    const float2 g1 = Elem<T>::unpack(load_pair(gy, p.m, L.n, row0 + r0 + 8, c));
    float v[4] = {g0.x, g0.y, g1.x, g1.y};
    if constexpr (A != Act::kNone) {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] *= act_grad<float, FastMath>(A, o[h][i] + bias[c + (i & 1)], p.slope);
    }
    const uint32_t lo = Elem<T>::pack(v[0], v[1]), hi = Elem<T>::pack(v[2], v[3]);
    gt[0][h * 2 + 0] = lo;
    gt[0][h * 2 + 1] = hi;
    mn_pair<T>(gout, r0, c) = lo;
    mn_pair<T>(gout, r0 + 8, c) = hi;
    sums[2 * h] = v[0] + v[2];
    sums[2 * h + 1] = v[1] + v[3];
  }
  add_column_sums<2>(sums, db, lane);
}

// dW += H^T G over the chunk's 64 rows (4 k steps of 16 rows), N columns.
template <class T, int N>
__device__ __forceinline__ void weight_grad_gmma(float (&dw)[N / 8][4], const char* h, const char* g) {
#pragma unroll
  for (int s = 0; s < 4; ++s)
    gmma::Ss<T, N, 1, 1>::run(dw, gmma::descriptor(h + s * 256, 128, 1024), gmma::descriptor(g + s * 256, 128, 1024), 1);
}

template <class T, int W, Act HID, int D>
__global__ void __launch_bounds__(128, gmma_bwd_min_blocks(W)) narrow_mlp_bwd_gmma(const Params p, const BwdParams bp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) char smem[];
  constexpr int NT = W / 8, KT = W / 16;
  load_weights<T>(p, smem, CoreMatrices{});
  // The H and G tiles zeroed: the columns past a layer's width stay zero (dW's padded M).
  for (int i = threadIdx.x * 16; i < bp.sums_off - bp.h_off[0]; i += 128 * 16)
    *reinterpret_cast<uint4*>(smem + bp.h_off[0] + i) = make_uint4(0, 0, 0, 0);
  {
    float* sums = reinterpret_cast<float*>(smem + bp.sums_off);
    for (int i = threadIdx.x; i < 4 * bp.db_floats; i += 128) sums[i] = 0.f;
  }
  gmma::fence_shared();
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int r0 = warp * 16 + g;  // this thread's rows of a chunk: r0, r0 + 8
  auto H = [&](int l) { return smem + bp.h_off[l]; };
  auto G = [&](int l) { return smem + bp.g_off[l % 3]; };
  auto Wt = [&](int l) { return smem + p.layer[l].w_off; };
  float* db = reinterpret_cast<float*>(smem + bp.sums_off) + warp * bp.db_floats;
  const int k0 = p.layer[0].k, kp0 = p.layer[0].kp;
  const bool want_dw = bp.gw[0] != nullptr;
  float dw[D][NT][4];  // dW_0 .. dW_{D-1}: M = the layer's input width padded to 64, N = W
  float dwt[2][4];     // dW_D, the output layer's: M = W padded to 64, N = 16
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int l = 0; l < D; ++l)
#pragma unroll
      for (int j = 0; j < NT; ++j) dw[l][j][i] = 0.f;
    dwt[0][i] = dwt[1][i] = 0.f;
  }
  float acc[1][NT][4];
  zero(acc);
  const int64_t chunks = (p.m + 63) / 64;
  for (int64_t ch = blockIdx.x; ch < chunks; ch += gridDim.x) {
    const int64_t row0 = ch * 64;
    uint32_t a[1][KT][4];
    // The forward, keeping x in H_0 and z_l in H_{l+1}.
    for (int kc = 0; kc < kp0 / 32; ++kc) {
      uint32_t ax[2][4];
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int c = kc * 32 + s * 16 + 2 * q;
        x_operand<T>(ax[s], p, row0 + r0, c);
        mn_pair<T>(H(0), r0, c) = ax[s][0];
        mn_pair<T>(H(0), r0 + 8, c) = ax[s][1];
        mn_pair<T>(H(0), r0, c + 8) = ax[s][2];
        mn_pair<T>(H(0), r0 + 8, c + 8) = ax[s][3];
      }
      layer_mma<T, W, 2>(acc[0], ax, Wt(0) + kc * 512, kp0, kc > 0);
    }
    keep_z<T, HID, NT>(a, acc[0], reinterpret_cast<const float*>(smem + p.layer[0].b_off), p.slope, H(1), r0, q);
#pragma unroll
    for (int l = 1; l < D; ++l) {
      layer_mma<T, W, KT>(acc[0], a[0], Wt(l), W);
      keep_z<T, HID, NT>(a, acc[0], reinterpret_cast<const float*>(smem + p.layer[l].b_off), p.slope, H(l + 1), r0, q);
    }
    // The output layer's gZ.
    uint32_t gt[1][4];
    switch (p.act_out) {
#define REGEMM_NARROW_OUT(A) \
  case A: top_grad_gmma<T, A, W>(p, bp, smem, a, row0, r0, q, gt, G(D), db + bp.db_off[D], lane); break;
      REGEMM_NARROW_OUT(Act::kNone) REGEMM_NARROW_OUT(Act::kRelu) REGEMM_NARROW_OUT(Act::kLeakyRelu)
      REGEMM_NARROW_OUT(Act::kGelu) REGEMM_NARROW_OUT(Act::kGeluErf) REGEMM_NARROW_OUT(Act::kSigmoid)
      REGEMM_NARROW_OUT(Act::kTanh) REGEMM_NARROW_OUT(Act::kSilu)
#undef REGEMM_NARROW_OUT
    }
    gmma::fence_shared();
    __syncthreads();  // every H_l and G_D in place
    // Down the stack. Layer D: gH_{D-1} = gZ_D W_D^T (one k step: N_out <= 16).
    uint32_t ga[KT][4];
    layer_mma<T, W, 1, 1>(acc[0], gt, Wt(D), W);
    hidden_grad_gmma<T, HID, W>(ga, acc[0], H(D), G(D - 1), db + bp.db_off[D - 1], p.slope, r0, q, lane);
    gmma::fence_shared();
    __syncthreads();  // H_D (now h) and G_{D-1} in place
    // Layers D-1 .. 1: the dgrad, then dW_{l+1} behind it (running through the epilogue).
#pragma unroll
    for (int l = D - 1; l >= 1; --l) {
      gmma::pin(acc[0]);
      gmma::fence();
#pragma unroll
      for (int kt = 0; kt < KT; ++kt)
        gmma::Rs<T, W, 1>::run(acc[0], ga[kt], wt_descriptor<1>(Wt(l), W, kt), kt > 0);
      gmma::commit();
      if (want_dw) {
        if (l + 1 == D) weight_grad_gmma<T, 16>(dwt, H(l + 1), G(l + 1));
        else weight_grad_gmma<T, W>(dw[l + 1 < D ? l + 1 : 0], H(l + 1), G(l + 1));
        gmma::commit();
        gmma::wait<1>();
      } else {
        gmma::wait<0>();
      }
      gmma::pin(acc[0]);
      hidden_grad_gmma<T, HID, W>(ga, acc[0], H(l), G(l - 1), db + bp.db_off[l - 1], p.slope, r0, q, lane);
      gmma::fence_shared();
      __syncthreads();
    }
    // Layer 0: dW_1 and dW_0, then gx = gZ_0 W_0^T 16 columns at a time.
    if (want_dw) {
      gmma::fence();
      if constexpr (D == 1) weight_grad_gmma<T, 16>(dwt, H(1), G(1));
      else weight_grad_gmma<T, W>(dw[1], H(1), G(1));
      weight_grad_gmma<T, W>(dw[0], H(0), G(0));
      gmma::commit();
    }
    if (bp.gx != nullptr) {
      T* gx = static_cast<T*>(bp.gx);
      for (int cc = 0; cc < kp0 / 16; ++cc) {
        float o[2][4] = {};
        layer_mma<T, 16, KT, 1>(o, ga, Wt(0) + cc * 256, kp0);  // (16 of Wt's columns: 2 core matrices on)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = cc * 16 + h * 8 + 2 * q;
          store_pair(gx, p.m, k0, row0 + r0, c, o[h][0], o[h][1]);
          store_pair(gx, p.m, k0, row0 + r0 + 8, c, o[h][2], o[h][3]);
        }
      }
    }
    gmma::wait<0>();
#pragma unroll
    for (int l = 0; l < D; ++l) gmma::pin(dw[l]);
    gmma::pin(dwt);
    __syncthreads();  // the next chunk's forward overwrites H and G
  }
  // The block's partial sums: dW row-major [kp][np] from the registers, db over the warps in order.
  float* part = bp.partial + int64_t(blockIdx.x) * (bp.dw_floats + bp.db_floats);
  if (want_dw) {
#pragma unroll
    for (int l = 0; l <= D; ++l) {
      const Layer& L = p.layer[l];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = r0 + h * 8;
        if (k >= L.kp) continue;
        float* row = part + bp.dw_off[l] + k * L.np;
        if (l < D) {
#pragma unroll
          for (int j = 0; j < NT; ++j)
            *reinterpret_cast<float2*>(row + j * 8 + 2 * q) = make_float2(dw[l < D ? l : 0][j][2 * h], dw[l < D ? l : 0][j][2 * h + 1]);
        } else {
#pragma unroll
          for (int j = 0; j < 2; ++j) *reinterpret_cast<float2*>(row + j * 8 + 2 * q) = make_float2(dwt[j][2 * h], dwt[j][2 * h + 1]);
        }
      }
    }
  }
  const float* sums = reinterpret_cast<const float*>(smem + bp.sums_off);
  for (int c = threadIdx.x; c < bp.db_floats; c += 128) {
    float s = 0.f;
    for (int w = 0; w < 4; ++w) s += sums[w * bp.db_floats + c];
    part[bp.dw_floats + c] = s;
  }
#endif
}

// ---------------------------------------------------------------------------
// Host side of both backward kernels.

// bp's plan for the wgmma kernel; p planned with Layout::kCoreMatrices. Returns the bytes of
// shared memory a block takes, or -1 where the kernel does not take the stack.
inline int plan_bwd_gmma(const Params& p, int width, BwdParams* bp) {
  if (!gmma_bwd_takes(p, width)) return -1;
  int off = (p.weights_bytes + 127) / 128 * 128;
  for (int l = 0; l < p.layers; ++l) {  // H_0 .. H_D
    bp->h_off[l] = off;
    off += 64 * 64 * 2;
  }
  for (int s = 0; s < 3; ++s) {
    bp->g_off[s] = off;
    off += 64 * (width > 16 ? width : 16) * 2;
  }
  bp->sums_off = off;
  int f = 0, c = 0;
  for (int l = 0; l < p.layers; ++l) {
    bp->dw_off[l] = f;
    f += p.layer[l].kp * p.layer[l].np;
    bp->db_off[l] = c;
    c += p.layer[l].np;
  }
  bp->dw_floats = f;
  bp->db_floats = c;
  bp->smem_bytes = bp->sums_off + 4 * c * 4;
  bp->gmma = true;
  return bp->smem_bytes;
}

template <class T, int W, Act HID>
const void* bwd_kernel(int depth, bool gmma) {
  if (!gmma) return reinterpret_cast<const void*>(&narrow_mlp_bwd<T, W, HID>);
  if constexpr (HID == Act::kRelu || HID == Act::kGelu) {
    switch (depth) {
      case 1: return reinterpret_cast<const void*>(&narrow_mlp_bwd_gmma<T, W, HID, 1>);
      case 2: return reinterpret_cast<const void*>(&narrow_mlp_bwd_gmma<T, W, HID, 2>);
      case 3: return reinterpret_cast<const void*>(&narrow_mlp_bwd_gmma<T, W, HID, 3>);
      case 4: return reinterpret_cast<const void*>(&narrow_mlp_bwd_gmma<T, W, HID, 4>);
    }
  }
  return nullptr;
}

// The kernel bp was planned for (null where there is none; NoKernelImage where this build or
// device has no wgmma kernel).
template <class T>
cudaError_t bwd_kernel(const Params& p, int width, const BwdParams& bp, const void** kernel) {
  const void* k = nullptr;
  with_act(p.act_hidden, [&](auto a) {
    constexpr Act A = decltype(a)::value;
    switch (width) {
      case 16: k = bwd_kernel<T, 16, A>(p.layers - 1, bp.gmma); break;
      case 32: k = bwd_kernel<T, 32, A>(p.layers - 1, bp.gmma); break;
      case 64: k = bwd_kernel<T, 64, A>(p.layers - 1, bp.gmma); break;
    }
  });
  if (k == nullptr) return cudaErrorInvalidValue;
  if (bp.gmma && !gmma_runs_here(k)) return cudaErrorNoKernelImageForDevice;
  *kernel = k;
  return cudaSuccess;
}

inline int bwd_threads(const BwdParams& bp) { return bp.gmma ? 128 : kBwdWarps * 32; }
inline int bwd_chunk_rows(const BwdParams& bp) { return bp.gmma ? 64 : 16 * kBwdWarps; }

// The most partial sums any M needs (the workspace the lowering sizes: resident blocks).
template <class T>
cudaError_t bwd_max_blocks(const Params& p, int width, const BwdParams& bp, int* blocks) {
  const void* kernel = nullptr;
  cudaError_t e = bwd_kernel<T>(p, width, bp, &kernel);
  if (e != cudaSuccess) return e;
  return resident_blocks(kernel, bp.smem_bytes, blocks, bwd_threads(bp));
}

// The partial sums' blocks: the persistent grid of the backward for p (planned by plan_bwd or
// plan_bwd_gmma).
template <class T>
cudaError_t bwd_blocks(const Params& p, int width, const BwdParams& bp, int* blocks) {
  int resident = 0;
  cudaError_t e = bwd_max_blocks<T>(p, width, bp, &resident);
  if (e != cudaSuccess) return e;
  const int64_t chunks = (p.m + bwd_chunk_rows(bp) - 1) / bwd_chunk_rows(bp);
  *blocks = int(chunks < resident ? chunks : resident);
  return cudaSuccess;
}

// The backward on `stream`: bp planned, bp.blocks set (bwd_blocks), bp.partial holding
// bp.blocks * (dw_floats + db_floats) floats.
template <class T>
cudaError_t launch_bwd(const Params& p, int width, const BwdParams& bp, cudaStream_t stream) {
  if (bp.blocks > 0) {
    const void* kernel = nullptr;
    cudaError_t e = bwd_kernel<T>(p, width, bp, &kernel);
    if (e != cudaSuccess) return e;
    void* args[] = {const_cast<Params*>(&p), const_cast<BwdParams*>(&bp)};
    e = cudaLaunchKernel(kernel, dim3(bp.blocks), dim3(bwd_threads(bp)), args, bp.smem_bytes, stream);
    if (e != cudaSuccess) return e;
  }
  const int per_block = bp.dw_floats + bp.db_floats;
  narrow_mlp_bwd_reduce<T><<<(per_block + 255) / 256, 256, 0, stream>>>(p, bp);
  return cudaGetLastError();
}

}  // namespace regemm::narrow
