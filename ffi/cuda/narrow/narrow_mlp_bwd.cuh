// The fused narrow MLP's backward (narrow_mlp.cuh has the design): per block of 64 rows (a
// 16-row tile per warp), recompute the forward on chip keeping each layer's input H_l and
// act'(z_l) in shared memory, then walk down the stack: gZ_l = gH_l * act'(z_l), dW_l += H_l^T
// gZ_l and db_l += sum gZ_l over the block's rows (f32, shared memory), gH_{l-1} = gZ_l W_l^T.
// The weight-gradient products reduce over rows, across the four warps' tiles: each warp owns
// fixed output tiles of dW and adds the same rows in the same order on every run, so the
// gradients are deterministic; a second kernel sums the blocks' partial sums in block order.
#pragma once

#include "narrow_mlp.cuh"

namespace regemm::narrow {

struct BwdParams {
  const void* gy;                // [M, N_out]
  void* gx;                      // [M, K0]; null: not wanted
  float* partial;                // the workspace: per block, every layer's dW sums (fragment order), then db
  void* gw[kMaxLayers];          // [K, N] ([N, K] where w_transposed); null: not wanted
  void* gb[kMaxLayers];          // [N]; null: not wanted
  // One warp's region of shared memory (at warps_off + warp * warp_bytes), byte offsets:
  int h_off[kMaxLayers];         //   H_l [16][kp_l + kPad] T, the input of layer l
  int d_off[kMaxLayers];         //   D_l [16][W + kPad] T, act'(z_l) of hidden layer l
  int g_off[2];                  //   gZ, ping-pong [16][g_stride] T
  int g_stride;
  int warp_bytes, warps_off;
  // The block's sums (f32, at sums_off): dW of every layer in MMA fragment order (dw_off[l]
  // floats in), then one row of db sums per warp (db_off[l] floats into a row of db_floats).
  int dw_off[kMaxLayers], db_off[kMaxLayers];
  int dw_floats, db_floats;
  int sums_off;
  int smem_bytes;
  int blocks;  // the persistent grid: how many partial sums the reduction adds
};

template <class T>
__device__ __forceinline__ void st_pair(T* base, int stride, int r, int c, uint32_t v) {
  *reinterpret_cast<uint32_t*>(base + r * stride + c) = v;
}

// The sums over a 16-row tile's rows of two columns (c, c+1) of an accumulator tile, in the
// lanes with g == 0 (lanes 0-3): the bias gradient's share of the tile.
__device__ __forceinline__ float2 column_sums(float v0, float v1, float v2, float v3) {
  float s0 = v0 + v2, s1 = v1 + v3;
#pragma unroll
  for (int m = 4; m < 32; m <<= 1) {
    s0 += __shfl_xor_sync(0xffffffffu, s0, m);
    s1 += __shfl_xor_sync(0xffffffffu, s1, m);
  }
  return make_float2(s0, s1);
}

// A hidden layer's epilogue in the recompute: z = acc + bias; h = act(z) to the next layer's A
// operand and to H_{l+1}; act'(z) to D_l.
template <class T, Act A, int NT>
__device__ __forceinline__ void epilogue_keep(uint32_t (&a)[1][NT / 2][4], const float (&acc)[1][NT][4],
                                              const float* bias, float slope, T* h, T* d, int lane) {
  const int g = lane >> 2, q = lane & 3;
  constexpr int stride = NT * 8 + kPad;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int c = j * 8 + 2 * q;
    const float b0 = bias[c], b1 = bias[c + 1];
    const float* v = acc[0][j];
    const float z0 = v[0] + b0, z1 = v[1] + b1, z2 = v[2] + b0, z3 = v[3] + b1;
    const uint32_t lo = Elem<T>::pack(act<A>(z0, slope), act<A>(z1, slope));
    const uint32_t hi = Elem<T>::pack(act<A>(z2, slope), act<A>(z3, slope));
    a[0][j / 2][(j & 1) * 2 + 0] = lo;
    a[0][j / 2][(j & 1) * 2 + 1] = hi;
    st_pair(h, stride, g, c, lo);
    st_pair(h, stride, g + 8, c, hi);
    st_pair(d, stride, g, c, Elem<T>::pack(act_grad<float, FastMath>(A, z0, slope), act_grad<float, FastMath>(A, z1, slope)));
    st_pair(d, stride, g + 8, c, Elem<T>::pack(act_grad<float, FastMath>(A, z2, slope), act_grad<float, FastMath>(A, z3, slope)));
  }
}

// The output layer's gZ = gy * act'_out(z_out) (z recomputed; gy itself for act none), to the
// gZ buffer `gz` and the bias sums of the warp (db).
template <class T, Act A, int W>
__device__ __forceinline__ void output_grad(const Params& p, const BwdParams& bp, const char* smem,
                                            const uint32_t (&a)[1][W / 16][4], int64_t row0, T* gz, float* db,
                                            int lane) {
  constexpr int KT = W / 16;
  const int g = lane >> 2, q = lane & 3;
  const Layer& L = p.layer[p.layers - 1];
  const T* wt = reinterpret_cast<const T*>(smem + L.w_off);
  const float* bias = reinterpret_cast<const float*>(smem + L.b_off);
  const T* gy = static_cast<const T*>(bp.gy);
  for (int j = 0; j < L.np / 16; ++j) {
    float o[1][2][4];
    zero(o);
    if (A != Act::kNone) mma_tile<T, 1, KT, 2>(o, a, wt + j * 16 * (W + kPad), W + kPad, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = j * 16 + h * 8 + 2 * q;
      const float2 g0 = Elem<T>::unpack(load_pair(gy, p.m, L.n, row0 + g, c));
      const float2 g1 = Elem<T>::unpack(load_pair(gy, p.m, L.n, row0 + g + 8, c));
      float v[4] = {g0.x, g0.y, g1.x, g1.y};
      if (A != Act::kNone) {
        const float* z = o[0][h];
        v[0] *= act_grad<float, FastMath>(A, z[0] + bias[c], p.slope);
        v[1] *= act_grad<float, FastMath>(A, z[1] + bias[c + 1], p.slope);
        v[2] *= act_grad<float, FastMath>(A, z[2] + bias[c], p.slope);
        v[3] *= act_grad<float, FastMath>(A, z[3] + bias[c + 1], p.slope);
      }
      st_pair(gz, bp.g_stride, g, c, Elem<T>::pack(v[0], v[1]));
      st_pair(gz, bp.g_stride, g + 8, c, Elem<T>::pack(v[2], v[3]));
      const float2 s = column_sums(v[0], v[1], v[2], v[3]);
      if (g == 0) { db[c] += s.x; db[c + 1] += s.y; }
    }
  }
}

// dW_l += H_l^T gZ_l over the block's 64 rows: the (16 x 16) output tiles dealt to the warps in
// turn, each summing the four warps' rows in warp order into the block's f32 sums.
template <class T>
__device__ __forceinline__ void weight_grad(const Params& p, const BwdParams& bp, char* smem, int l, int slot,
                                            int warp, int lane) {
  const Layer& L = p.layer[l];
  const int hs = L.kp + kPad, nt16 = L.np / 16, tiles = (L.kp / 16) * nt16;
  float* sums = reinterpret_cast<float*>(smem + bp.sums_off) + bp.dw_off[l];
  const int i = lane >> 3, j = lane & 7;
  // Four tiles at a time (eight independent MMAs in flight).
  constexpr int kTiles = 4;
  for (int t0 = warp * kTiles; t0 < tiles; t0 += kWarps * kTiles) {
    float acc[kTiles][2][4] = {};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const char* region = smem + bp.warps_off + w * bp.warp_bytes;
      const T* h = reinterpret_cast<const T*>(region + bp.h_off[l]);
      const T* gz = reinterpret_cast<const T*>(region + bp.g_off[slot]);
      uint32_t af[kTiles][4], bf[kTiles][4];
#pragma unroll
      for (int u = 0; u < kTiles; ++u) {
        const int t = t0 + u < tiles ? t0 + u : t0;  // (past the end: a repeat, not stored)
        const int mt = t / nt16, nt = t % nt16;
        // A' = H^T (k_in x rows): matrices (k_in block i & 1, row block i >> 1), transposed.
        ldmatrix_x4_trans(af[u], h + ((i >> 1) * 8 + j) * hs + mt * 16 + (i & 1) * 8);
        // B' = gZ (rows x n): matrices (n block i >> 1, row block i & 1), transposed.
        ldmatrix_x4_trans(bf[u], gz + ((i & 1) * 8 + j) * bp.g_stride + nt * 16 + (i >> 1) * 8);
      }
#pragma unroll
      for (int u = 0; u < kTiles; ++u) {
        Elem<T>::mma(acc[u][0], af[u], bf[u][0], bf[u][1]);
        Elem<T>::mma(acc[u][1], af[u], bf[u][2], bf[u][3]);
      }
    }
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
      const int t = t0 + u;
      if (t >= tiles) break;
      const int mt = t / nt16, nt = t % nt16;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float4* s = reinterpret_cast<float4*>(sums + ((mt * (L.np / 8) + nt * 2 + h) * 32 + lane) * 4);
        float4 v = *s;
        v.x += acc[u][h][0]; v.y += acc[u][h][1]; v.z += acc[u][h][2]; v.w += acc[u][h][3];
        *s = v;
      }
    }
  }
}

// The A operand (rows x 16 columns kt*16..) of the warp's gZ tile, from shared memory.
template <class T>
__device__ __forceinline__ void gz_operand(uint32_t (&a)[4], const T* gz, int stride, int kt, int lane) {
  ldmatrix_x4(a, gz + (((lane >> 3) & 1) * 8 + (lane & 7)) * stride + kt * 16 + (lane >> 4) * 8);
}

// The B operand of gZ_l W_l^T for output columns (16 of K_l) j*16.. and k tile kt (16 of N_l):
// W_l^T's rows are Wt_l's, read transposed.
template <class T>
__device__ __forceinline__ void wt_operand_trans(uint32_t (&b)[4], const T* wt, int stride, int kt, int j, int lane) {
  ldmatrix_x4_trans(b, wt + (kt * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * stride + j * 16 + (lane >> 4) * 8);
}

template <class T, int W, Act HID>
__global__ void __launch_bounds__(kWarps * 32, 1) narrow_mlp_bwd(const Params p, const BwdParams bp) {
  extern __shared__ __align__(16) char smem[];
  load_weights<T>(p, smem);
  {
    float* sums = reinterpret_cast<float*>(smem + bp.sums_off);
    for (int i = threadIdx.x; i < bp.dw_floats + kWarps * bp.db_floats; i += blockDim.x) sums[i] = 0.f;
  }
  __syncthreads();
  constexpr int NT = W / 8, KT = W / 16, WS = W + kPad;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  char* region = smem + bp.warps_off + warp * bp.warp_bytes;
  float* db = reinterpret_cast<float*>(smem + bp.sums_off) + bp.dw_floats + warp * bp.db_floats;
  const T* x = static_cast<const T*>(p.x);
  const int k0 = p.layer[0].k, top = p.layers - 1;
  const int64_t chunks = (p.m + 16 * kWarps - 1) / (16 * kWarps);
  for (int64_t ch = blockIdx.x; ch < chunks; ch += gridDim.x) {
    const int64_t row0 = ch * 16 * kWarps + warp * 16;
    float acc[1][NT][4];
    uint32_t a[1][KT][4];
    // The forward, keeping H_l and act'(z_l). Layer 0 reads x, one k tile at a time, into H_0.
    {
      const Layer& L = p.layer[0];
      T* h0 = reinterpret_cast<T*>(region + bp.h_off[0]);
      const int hs = L.kp + kPad;
      zero(acc);
      for (int kt = 0; kt < L.kp / 16; ++kt) {
        uint32_t ax[1][1][4];
        const int c = kt * 16 + 2 * q;
        ax[0][0][0] = load_pair(x, p.m, k0, row0 + g, c);
        ax[0][0][1] = load_pair(x, p.m, k0, row0 + g + 8, c);
        ax[0][0][2] = load_pair(x, p.m, k0, row0 + g, c + 8);
        ax[0][0][3] = load_pair(x, p.m, k0, row0 + g + 8, c + 8);
        st_pair(h0, hs, g, c, ax[0][0][0]);
        st_pair(h0, hs, g + 8, c, ax[0][0][1]);
        st_pair(h0, hs, g, c + 8, ax[0][0][2]);
        st_pair(h0, hs, g + 8, c + 8, ax[0][0][3]);
        mma_tile<T, 1, 1, NT>(acc, ax, reinterpret_cast<const T*>(smem + L.w_off) + kt * 16, hs, lane);
      }
      epilogue_keep<T, HID, NT>(a, acc, reinterpret_cast<const float*>(smem + L.b_off), p.slope,
                                reinterpret_cast<T*>(region + bp.h_off[1]), reinterpret_cast<T*>(region + bp.d_off[0]),
                                lane);
    }
    for (int l = 1; l < top; ++l) {
      const Layer& L = p.layer[l];
      zero(acc);
      mma_tile<T, 1, KT, NT>(acc, a, reinterpret_cast<const T*>(smem + L.w_off), WS, lane);
      epilogue_keep<T, HID, NT>(a, acc, reinterpret_cast<const float*>(smem + L.b_off), p.slope,
                                reinterpret_cast<T*>(region + bp.h_off[l + 1]),
                                reinterpret_cast<T*>(region + bp.d_off[l]), lane);
    }
    // gZ of the output layer.
    {
      T* gz = reinterpret_cast<T*>(region + bp.g_off[top & 1]);
      float* dbl = db + bp.db_off[top];
      switch (p.act_out) {
#define REGEMM_NARROW_OUT(A) \
  case A: output_grad<T, A, W>(p, bp, smem, a, row0, gz, dbl, lane); break;
        REGEMM_NARROW_OUT(Act::kNone) REGEMM_NARROW_OUT(Act::kRelu) REGEMM_NARROW_OUT(Act::kLeakyRelu)
        REGEMM_NARROW_OUT(Act::kGelu) REGEMM_NARROW_OUT(Act::kGeluErf) REGEMM_NARROW_OUT(Act::kSigmoid)
        REGEMM_NARROW_OUT(Act::kTanh) REGEMM_NARROW_OUT(Act::kSilu)
#undef REGEMM_NARROW_OUT
      }
    }
    // Down the stack.
    for (int l = top; l >= 0; --l) {
      __syncthreads();  // every warp's gZ_l is in place (and, at l = top, its H)
      if (bp.gw[0] != nullptr) weight_grad<T>(p, bp, smem, l, l & 1, warp, lane);
      const Layer& L = p.layer[l];
      const T* gz = reinterpret_cast<const T*>(region + bp.g_off[l & 1]);
      const T* wt = reinterpret_cast<const T*>(smem + L.w_off);
      const int wts = L.kp + kPad;
      if (l > 0) {  // gZ_{l-1} = (gZ_l W_l^T) * act'(z_{l-1})
        zero(acc);
        for (int kt = 0; kt < L.np / 16; ++kt) {
          uint32_t af[4], b[KT][4];
          gz_operand(af, gz, bp.g_stride, kt, lane);
#pragma unroll
          for (int j = 0; j < KT; ++j) wt_operand_trans(b[j], wt, wts, kt, j, lane);
#pragma unroll
          for (int j = 0; j < KT; ++j) {
            Elem<T>::mma(acc[0][2 * j], af, b[j][0], b[j][1]);
            Elem<T>::mma(acc[0][2 * j + 1], af, b[j][2], b[j][3]);
          }
        }
        const T* d = reinterpret_cast<const T*>(region + bp.d_off[l - 1]);
        T* out = reinterpret_cast<T*>(region + bp.g_off[(l - 1) & 1]);
        float* dbl = db + bp.db_off[l - 1];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int c = j * 8 + 2 * q;
          const float2 d0 = Elem<T>::unpack(*reinterpret_cast<const uint32_t*>(d + g * WS + c));
          const float2 d1 = Elem<T>::unpack(*reinterpret_cast<const uint32_t*>(d + (g + 8) * WS + c));
          const float* v = acc[0][j];
          const float z0 = v[0] * d0.x, z1 = v[1] * d0.y, z2 = v[2] * d1.x, z3 = v[3] * d1.y;
          st_pair(out, bp.g_stride, g, c, Elem<T>::pack(z0, z1));
          st_pair(out, bp.g_stride, g + 8, c, Elem<T>::pack(z2, z3));
          const float2 s = column_sums(z0, z1, z2, z3);
          if (g == 0) { dbl[c] += s.x; dbl[c + 1] += s.y; }
        }
      } else if (bp.gx != nullptr) {  // gx = gZ_0 W_0^T, 16 columns of K0 at a time
        T* gx = static_cast<T*>(bp.gx);
        for (int j = 0; j < L.kp / 16; ++j) {
          float o[2][4] = {};
#pragma unroll
          for (int kt = 0; kt < KT; ++kt) {
            uint32_t af[4], b[4];
            gz_operand(af, gz, bp.g_stride, kt, lane);
            wt_operand_trans(b, wt, wts, kt, j, lane);
            Elem<T>::mma(o[0], af, b[0], b[1]);
            Elem<T>::mma(o[1], af, b[2], b[3]);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int c = j * 16 + h * 8 + 2 * q;
            store_pair(gx, p.m, k0, row0 + g, c, o[h][0], o[h][1]);
            store_pair(gx, p.m, k0, row0 + g + 8, c, o[h][2], o[h][3]);
          }
        }
      }
    }
    __syncthreads();  // the next chunk's recompute overwrites H, D and gZ
  }
  // The block's partial sums: dW as accumulated, db summed over the warps in warp order.
  const float* sums = reinterpret_cast<const float*>(smem + bp.sums_off);
  float* part = bp.partial + int64_t(blockIdx.x) * (bp.dw_floats + bp.db_floats);
  for (int i = threadIdx.x; i < bp.dw_floats; i += blockDim.x) part[i] = sums[i];
  for (int c = threadIdx.x; c < bp.db_floats; c += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < kWarps; ++w) s += sums[bp.dw_floats + w * bp.db_floats + c];
    part[bp.dw_floats + c] = s;
  }
}

// gW_l and gb_l: the blocks' partial sums added in block order (deterministic), as T.
template <class T>
__global__ void narrow_mlp_bwd_reduce(const Params p, const BwdParams bp) {
  const int per_block = bp.dw_floats + bp.db_floats;
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < per_block; e += gridDim.x * blockDim.x) {
    int l = 0;
    T* dst = nullptr;
    if (e < bp.dw_floats) {
      while (l + 1 < p.layers && e >= bp.dw_off[l + 1]) ++l;
      const Layer& L = p.layer[l];
      const int idx = e - bp.dw_off[l], tile = idx >> 7, ln = (idx >> 2) & 31, i = idx & 3;
      const int mt = tile / (L.np / 8), nt = tile % (L.np / 8);
      const int k = mt * 16 + (ln >> 2) + (i >> 1) * 8, n = nt * 8 + 2 * (ln & 3) + (i & 1);
      if (bp.gw[l] == nullptr || k >= L.k || n >= L.n) continue;
      dst = static_cast<T*>(bp.gw[l]) + (p.w_transposed ? int64_t(n) * L.k + k : int64_t(k) * L.n + n);
    } else {
      const int c = e - bp.dw_floats;
      while (l + 1 < p.layers && c >= bp.db_off[l + 1]) ++l;
      const int n = c - bp.db_off[l];
      if (bp.gb[l] == nullptr || n >= p.layer[l].n) continue;
      dst = static_cast<T*>(bp.gb[l]) + n;
    }
    float s = 0.f;
    for (int b = 0; b < bp.blocks; ++b) s += bp.partial[int64_t(b) * per_block + e];
    *dst = Elem<T>::from_float(s);
  }
}

// ---------------------------------------------------------------------------
// Host side.

// Fills bp's shared-memory plan for p (planned by plan_weights); returns the bytes of shared
// memory a block takes.
inline int plan_bwd(const Params& p, int width, int elem_bytes, BwdParams* bp) {
  int off = 0, gmax = width;
  for (int l = 0; l < p.layers; ++l) {
    bp->h_off[l] = off;
    off += 16 * (p.layer[l].kp + kPad) * elem_bytes;
    if (p.layer[l].np > gmax) gmax = p.layer[l].np;
  }
  for (int l = 0; l + 1 < p.layers; ++l) {
    bp->d_off[l] = off;
    off += 16 * (width + kPad) * elem_bytes;
  }
  bp->g_stride = gmax + kPad;
  for (int s = 0; s < 2; ++s) {
    bp->g_off[s] = off;
    off += 16 * bp->g_stride * elem_bytes;
  }
  bp->warp_bytes = (off + 15) / 16 * 16;
  bp->warps_off = p.weights_bytes;
  bp->sums_off = bp->warps_off + kWarps * bp->warp_bytes;
  int f = 0;
  for (int l = 0; l < p.layers; ++l) {
    bp->dw_off[l] = f;
    f += p.layer[l].kp * p.layer[l].np;
  }
  bp->dw_floats = f;
  int c = 0;
  for (int l = 0; l < p.layers; ++l) {
    bp->db_off[l] = c;
    c += p.layer[l].np;
  }
  bp->db_floats = c;
  bp->smem_bytes = bp->sums_off + (bp->dw_floats + kWarps * bp->db_floats) * 4;
  return bp->smem_bytes;
}

template <class T, int W, Act HID>
const void* bwd_kernel() {
  return reinterpret_cast<const void*>(&narrow_mlp_bwd<T, W, HID>);
}

template <class T>
const void* bwd_kernel(int width, Act hid) {
  const void* k = nullptr;
  with_act(hid, [&](auto a) {
    constexpr Act A = decltype(a)::value;
    switch (width) {
      case 16: k = bwd_kernel<T, 16, A>(); break;
      case 32: k = bwd_kernel<T, 32, A>(); break;
      case 64: k = bwd_kernel<T, 64, A>(); break;
      case 128: k = bwd_kernel<T, 128, A>(); break;
    }
  });
  return k;
}

// The partial sums' blocks: the persistent grid of the backward for p (planned by plan_bwd).
template <class T>
cudaError_t bwd_blocks(const Params& p, int width, const BwdParams& bp, int* blocks) {
  const void* kernel = bwd_kernel<T>(width, p.act_hidden);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  int resident = 0;
  cudaError_t e = resident_blocks(kernel, bp.smem_bytes, &resident);
  if (e != cudaSuccess) return e;
  const int64_t chunks = (p.m + 16 * kWarps - 1) / (16 * kWarps);
  *blocks = int(chunks < resident ? chunks : resident);
  return cudaSuccess;
}

// The most partial sums any M needs (the workspace the lowering sizes: resident blocks).
template <class T>
cudaError_t bwd_max_blocks(const Params& p, int width, const BwdParams& bp, int* blocks) {
  const void* kernel = bwd_kernel<T>(width, p.act_hidden);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  return resident_blocks(kernel, bp.smem_bytes, blocks);
}

// The backward on `stream`: bp planned, bp.blocks set (bwd_blocks), bp.partial holding
// bp.blocks * (dw_floats + db_floats) floats.
template <class T>
cudaError_t launch_bwd(const Params& p, int width, const BwdParams& bp, cudaStream_t stream) {
  if (bp.blocks > 0) {
    const void* kernel = bwd_kernel<T>(width, p.act_hidden);
    void* args[] = {const_cast<Params*>(&p), const_cast<BwdParams*>(&bp)};
    cudaError_t e = cudaLaunchKernel(kernel, dim3(bp.blocks), dim3(kWarps * 32), args, bp.smem_bytes, stream);
    if (e != cudaSuccess) return e;
  }
  const int per_block = bp.dw_floats + bp.db_floats;
  narrow_mlp_bwd_reduce<T><<<(per_block + 255) / 256, 256, 0, stream>>>(p, bp);
  return cudaGetLastError();
}

}  // namespace regemm::narrow
