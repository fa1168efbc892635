// The fused narrow MLP's backward (narrow_mlp.cuh has the design). A block of 8 warps takes
// 128 rows at a time, a 16-row tile per warp. It recomputes the forward of its rows on chip,
// keeping each layer's input in shared memory: x, then each hidden layer's z, from which both
// act(z) and act'(z) follow (one buffer per layer where h and act'(z) took two). Then it walks
// down the stack. At layer l a warp holds gZ_l in registers, in the A-operand layout the
// forward uses for h, forms gH_{l-1} = gZ_l W_l^T, reads z_{l-1}, and leaves gZ_{l-1} =
// gH_{l-1} * act'(z_{l-1}) in registers and in shared memory and h_{l-1} = act(z_{l-1}) over
// z_{l-1}; after one barrier the block's warps add dW_l += H_{l-1}^T gZ_l over its 128 rows.
// The weight-gradient tiles (16 x 16) are dealt to the warps in turn and summed in registers
// over every row the block takes: no sums in shared memory (they took 61 KB at 64 x 4 hidden
// and held the kernel to one block of 4 warps an SM). Each warp adds the same rows in the same
// order on every run and a second kernel sums the blocks' partial sums in block order, so the
// gradients are deterministic.
#pragma once

#include "narrow_mlp.cuh"

namespace regemm::narrow {

constexpr int kBwdWarps = 8;  // a block of the backward: 128 rows a chunk
// The dW tiles (16 x 16, f32: 8 registers a lane) a warp keeps, by width: the block keeps
// kBwdWarps times as many, which bounds the stacks the kernel takes (64 wide: 80 tiles, 4
// hidden layers with K0 and N_out up to 64). 128 wide takes the per-layer backward.
constexpr int dw_tiles(int width) { return width <= 16 ? 4 : width <= 32 ? 6 : 10; }
// Blocks an SM the registers are bounded for: at 64 wide one (221 registers a thread); under it
// two, so that 16 warps hide the latency of their short MMA chains (at one block of 8 warps
// 32 x 3 hidden took 468 us at 2^20 rows, 14% slower than 3 blocks of 4 warps).
constexpr int bwd_min_blocks(int width) { return width <= 32 ? 2 : 1; }
inline bool bwd_width_ok(int width) { return width == 16 || width == 32 || width == 64; }

struct BwdParams {
  const void* gy;                // [M, N_out]
  void* gx;                      // [M, K0]; null: not wanted
  float* partial;                // the workspace: per block, every layer's dW sums (fragment order), then db
  void* gw[kMaxLayers];          // [K, N] ([N, K] where w_transposed); null (all of them): not wanted
  void* gb[kMaxLayers];          // [N]; null: not wanted
  // One warp's region of shared memory (at warps_off + warp * warp_bytes), byte offsets:
  int h_off[kMaxLayers];         //   H_l [16][kp_l + kPad] T, layer l's input: x, else z_{l-1} (then h_{l-1})
  int g_off[3];                  //   gZ, three in turn [16][g_stride] T (one barrier a layer)
  int g_stride;
  int warp_bytes, warps_off;
  // The dW tiles of layer l are [tile0[l], tile0[l+1]) (kt-major over the layer's kp/16 x np/16),
  // tile t kept by warp t % kBwdWarps; partial sums in fragment order (dw_off[l] floats in).
  int tile0[kMaxLayers + 1];
  int dw_off[kMaxLayers], db_off[kMaxLayers];
  int dw_floats, db_floats;
  int sums_off;                  // the warps' db sums (f32): a row of db_floats per warp
  int smem_bytes;
  int blocks;  // the persistent grid: how many partial sums the reduction adds
  bool gmma;   // planned for the wgmma kernel (narrow_mlp_bwd_gmma.cuh): dW sums row-major [kp][np]
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

// db[c] += the sums over a 16-row tile's rows of its 8 * NT columns, from each lane's sums of
// its two rows (v[2j + h]: column j * 8 + 2q + h). A reduce-scatter over the eight lanes of a
// column pair: each exchange hands half of the values to the partner lane and keeps the other
// half summed, so 2 * NT values take 14 shuffles at NT = 8 where a butterfly per column pair
// took 48; at the end lane (g, q) holds whole column sums and every lane adds its own.
template <int N, int M>
__device__ __forceinline__ void reduce_scatter(float* v, int lane, int& base, bool& dup) {
  if constexpr (M >= 4) {
    const bool upper = (lane & M) != 0;
    if constexpr (N > 1) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float give = upper ? v[i] : v[i + N / 2], keep = upper ? v[i + N / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, give, M);
      }
      if (upper) base += N / 2;
      reduce_scatter<N / 2, M / 2>(v, lane, base, dup);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], M);
      dup = dup || upper;
      reduce_scatter<N, M / 2>(v, lane, base, dup);
    }
  }
}

template <int NT>
__device__ __forceinline__ void add_column_sums(float (&v)[2 * NT], float* db, int lane) {
  constexpr int n = 2 * NT >= 8 ? 2 * NT / 8 : 1;  // the sums a lane is left with
  int base = 0;
  bool dup = false;  // (past the halving: partner lanes hold the same sums, the lower one adds)
  reduce_scatter<2 * NT, 16>(v, lane, base, dup);
  if (dup) return;
  const int q = lane & 3;
#pragma unroll
  for (int i = 0; i < n; ++i) {
    const int idx = base + i, c = (idx >> 1) * 8 + 2 * q + (idx & 1);
    db[c] += v[i];
  }
}

// A hidden layer's epilogue in the recompute: z = acc + bias, rounded, to Z (for the way
// down); h = act(z) to the next layer's A operand.
template <class T, Act A, int NT>
__device__ __forceinline__ void epilogue_keep(uint32_t (&a)[1][NT / 2][4], const float (&acc)[1][NT][4],
                                              const float* bias, float slope, T* z_out, int lane) {
  const int g = lane >> 2, q = lane & 3;
  constexpr int stride = NT * 8 + kPad;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int c = j * 8 + 2 * q;
    const float b0 = bias[c], b1 = bias[c + 1];
    const float* v = acc[0][j];
    const float z0 = v[0] + b0, z1 = v[1] + b1, z2 = v[2] + b0, z3 = v[3] + b1;
    a[0][j / 2][(j & 1) * 2 + 0] = Elem<T>::pack(act<A>(z0, slope), act<A>(z1, slope));
    a[0][j / 2][(j & 1) * 2 + 1] = Elem<T>::pack(act<A>(z2, slope), act<A>(z3, slope));
    st_pair(z_out, stride, g, c, Elem<T>::pack(z0, z1));
    st_pair(z_out, stride, g + 8, c, Elem<T>::pack(z2, z3));
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

// dW_l += H_l^T gZ_l over the block's 128 rows, into the warp's tiles of layer l (those of the
// warp's TILES slots that fall in [tile0[l], tile0[l+1]); the slot index is static, so the
// sums stay in registers), adding the warps' rows in warp order.
template <class T, int TILES>
__device__ __forceinline__ void weight_grad(float (&dw)[TILES][2][4], const Params& p, const BwdParams& bp,
                                            const char* smem, int l, int slot, int warp, int lane) {
  const Layer& L = p.layer[l];
  const int hs = L.kp + kPad, nt16 = L.np / 16, t0 = bp.tile0[l], t1 = bp.tile0[l + 1];
  const int i = lane >> 3, j = lane & 7;
#pragma unroll
  for (int s = 0; s < TILES; ++s) {
    const int t = s * kBwdWarps + warp;
    if (t < t0 || t >= t1) continue;  // (uniform over the warp)
    const int mt = (t - t0) / nt16, nt = (t - t0) % nt16;
    // A' = H^T (k_in x rows): matrices (k_in block i & 1, row block i >> 1), transposed.
    // B' = gZ (rows x n): matrices (n block i >> 1, row block i & 1), transposed.
    const char* region = smem + bp.warps_off;
    const int a_off = bp.h_off[l] + (((i >> 1) * 8 + j) * hs + mt * 16 + (i & 1) * 8) * int(sizeof(T));
    const int b_off = bp.g_off[slot] + (((i & 1) * 8 + j) * bp.g_stride + nt * 16 + (i >> 1) * 8) * int(sizeof(T));
    // The odd warps' rows into a second sum, added at the end: four MMA chains, not two (a
    // chain of 8 dependent MMAs per accumulator left the warps waiting on the tensor pipe's
    // latency).
    float odd[2][4] = {};
#pragma unroll
    for (int w = 0; w < kBwdWarps; ++w) {
      uint32_t af[4], bf[4];
      ldmatrix_x4_trans(af, region + w * bp.warp_bytes + a_off);
      ldmatrix_x4_trans(bf, region + w * bp.warp_bytes + b_off);
      float(&d)[2][4] = w & 1 ? odd : dw[s];
      Elem<T>::mma(d[0], af, bf[0], bf[1]);
      Elem<T>::mma(d[1], af, bf[2], bf[3]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) dw[s][i / 4][i % 4] += odd[i / 4][i % 4];
  }
}

// The warp's dW tiles to the block's partial sums, in fragment order.
template <int TILES>
__device__ __forceinline__ void store_weight_grad(const float (&dw)[TILES][2][4], const Params& p,
                                                  const BwdParams& bp, float* part, int warp, int lane) {
#pragma unroll
  for (int s = 0; s < TILES; ++s) {
    const int t = s * kBwdWarps + warp;
    if (t >= bp.tile0[p.layers]) break;
    int l = 0;
    while (t >= bp.tile0[l + 1]) ++l;
    const Layer& L = p.layer[l];
    const int mt = (t - bp.tile0[l]) / (L.np / 16), nt = (t - bp.tile0[l]) % (L.np / 16);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float4*>(part + bp.dw_off[l] + ((mt * (L.np / 8) + nt * 2 + h) * 32 + lane) * 4) =
          make_float4(dw[s][h][0], dw[s][h][1], dw[s][h][2], dw[s][h][3]);
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

// gZ_{l-1} = (gZ_l W_l^T) * act'(z_{l-1}) for a hidden layer l-1 (acc holds gZ_l W_l^T): to
// the A operand `ga` (the next dgrad's), to the gZ buffer `out` and the warp's bias sums; and
// h_{l-1} = act(z_{l-1}) over z_{l-1} in H (dW_l's operand).
template <class T, Act A, int W>
__device__ __forceinline__ void hidden_grad(uint32_t (&ga)[W / 16][4], const float (&acc)[1][W / 8][4], T* h,
                                            T* out, int g_stride, float* db, float slope, int lane) {
  constexpr int NT = W / 8, WS = W + kPad;
  const int g = lane >> 2, q = lane & 3;
  float sums[2 * NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int c = j * 8 + 2 * q;
    const float2 z0 = Elem<T>::unpack(*reinterpret_cast<const uint32_t*>(h + g * WS + c));
    const float2 z1 = Elem<T>::unpack(*reinterpret_cast<const uint32_t*>(h + (g + 8) * WS + c));
    st_pair(h, WS, g, c, Elem<T>::pack(act<A>(z0.x, slope), act<A>(z0.y, slope)));
    st_pair(h, WS, g + 8, c, Elem<T>::pack(act<A>(z1.x, slope), act<A>(z1.y, slope)));
    const float* v = acc[0][j];
    const float g0 = v[0] * act_grad<float, FastMath>(A, z0.x, slope);
    const float g1 = v[1] * act_grad<float, FastMath>(A, z0.y, slope);
    const float g2 = v[2] * act_grad<float, FastMath>(A, z1.x, slope);
    const float g3 = v[3] * act_grad<float, FastMath>(A, z1.y, slope);
    const uint32_t lo = Elem<T>::pack(g0, g1), hi = Elem<T>::pack(g2, g3);
    ga[j / 2][(j & 1) * 2 + 0] = lo;
    ga[j / 2][(j & 1) * 2 + 1] = hi;
    st_pair(out, g_stride, g, c, lo);
    st_pair(out, g_stride, g + 8, c, hi);
    sums[2 * j] = g0 + g2;
    sums[2 * j + 1] = g1 + g3;
  }
  add_column_sums<NT>(sums, db, lane);
}

template <class T, int W, Act HID>
__global__ void __launch_bounds__(kBwdWarps * 32, bwd_min_blocks(W)) narrow_mlp_bwd(const Params p, const BwdParams bp) {
  extern __shared__ __align__(128) char smem[];  // (128: as the wgmma kernels declare it)
  constexpr int NT = W / 8, KT = W / 16, WS = W + kPad, TILES = dw_tiles(W);
  load_weights<T>(p, smem);
  {
    float* sums = reinterpret_cast<float*>(smem + bp.sums_off);
    for (int i = threadIdx.x; i < kBwdWarps * bp.db_floats; i += blockDim.x) sums[i] = 0.f;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  char* region = smem + bp.warps_off + warp * bp.warp_bytes;
  auto H = [&](int l) { return reinterpret_cast<T*>(region + bp.h_off[l]); };
  auto G = [&](int l) { return reinterpret_cast<T*>(region + bp.g_off[l % 3]); };
  float* db = reinterpret_cast<float*>(smem + bp.sums_off) + warp * bp.db_floats;
  const T* x = static_cast<const T*>(p.x);
  const int k0 = p.layer[0].k, top = p.layers - 1;
  const bool want_dw = bp.gw[0] != nullptr;
  float dw[TILES][2][4];
#pragma unroll
  for (int s = 0; s < TILES; ++s)
#pragma unroll
    for (int i = 0; i < 8; ++i) dw[s][i / 4][i % 4] = 0.f;
  const int64_t chunks = (p.m + 16 * kBwdWarps - 1) / (16 * kBwdWarps);
  for (int64_t ch = blockIdx.x; ch < chunks; ch += gridDim.x) {
    const int64_t row0 = ch * 16 * kBwdWarps + warp * 16;
    float acc[1][NT][4];
    uint32_t a[1][KT][4];
    // The forward, keeping x and each z. Layer 0 reads x, one k tile at a time, into H_0.
    {
      const Layer& L = p.layer[0];
      T* h0 = H(0);
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
      epilogue_keep<T, HID, NT>(a, acc, reinterpret_cast<const float*>(smem + L.b_off), p.slope, H(1), lane);
    }
    for (int l = 1; l < top; ++l) {
      const Layer& L = p.layer[l];
      zero(acc);
      mma_tile<T, 1, KT, NT>(acc, a, reinterpret_cast<const T*>(smem + L.w_off), WS, lane);
      epilogue_keep<T, HID, NT>(a, acc, reinterpret_cast<const float*>(smem + L.b_off), p.slope, H(l + 1), lane);
    }
    // gZ of the output layer, to shared memory (its width is any up to 128).
    switch (p.act_out) {
#define REGEMM_NARROW_OUT(A) \
  case A: output_grad<T, A, W>(p, bp, smem, a, row0, G(top), db + bp.db_off[top], lane); break;
      REGEMM_NARROW_OUT(Act::kNone) REGEMM_NARROW_OUT(Act::kRelu) REGEMM_NARROW_OUT(Act::kLeakyRelu)
      REGEMM_NARROW_OUT(Act::kGelu) REGEMM_NARROW_OUT(Act::kGeluErf) REGEMM_NARROW_OUT(Act::kSigmoid)
      REGEMM_NARROW_OUT(Act::kTanh) REGEMM_NARROW_OUT(Act::kSilu)
#undef REGEMM_NARROW_OUT
    }
    __syncwarp();  // (the warp's gZ_top, read back below as an A operand)
    // Down the stack: ga holds gZ_l (below the top) as the A operand of gZ_l W_l^T.
    uint32_t ga[KT][4];
    for (int l = top; l >= 0; --l) {
      const Layer& L = p.layer[l];
      const T* wt = reinterpret_cast<const T*>(smem + L.w_off);
      const int wts = L.kp + kPad;
      if (l > 0) {  // gZ_{l-1} = (gZ_l W_l^T) * act'(z_{l-1})
        zero(acc);
        if (l == top) {
          const T* gz = G(top);
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
        } else {
#pragma unroll
          for (int kt = 0; kt < KT; ++kt) {
            uint32_t b[KT][4];
#pragma unroll
            for (int j = 0; j < KT; ++j) wt_operand_trans(b[j], wt, wts, kt, j, lane);
#pragma unroll
            for (int j = 0; j < KT; ++j) {
              Elem<T>::mma(acc[0][2 * j], ga[kt], b[j][0], b[j][1]);
              Elem<T>::mma(acc[0][2 * j + 1], ga[kt], b[j][2], b[j][3]);
            }
          }
        }
        hidden_grad<T, HID, W>(ga, acc, H(l), G(l - 1), bp.g_stride, db + bp.db_off[l - 1], p.slope, lane);
      } else if (bp.gx != nullptr) {  // gx = gZ_0 W_0^T, 16 columns of K0 at a time
        T* gx = static_cast<T*>(bp.gx);
        for (int j = 0; j < L.kp / 16; ++j) {
          float o[2][4] = {};
#pragma unroll
          for (int kt = 0; kt < KT; ++kt) {
            uint32_t b[4];
            wt_operand_trans(b, wt, wts, kt, j, lane);
            Elem<T>::mma(o[0], ga[kt], b[0], b[1]);
            Elem<T>::mma(o[1], ga[kt], b[2], b[3]);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int c = j * 16 + h * 8 + 2 * q;
            store_pair(gx, p.m, k0, row0 + g, c, o[h][0], o[h][1]);
            store_pair(gx, p.m, k0, row0 + g + 8, c, o[h][2], o[h][3]);
          }
        }
      }
      // Every warp's gZ_l and H_l (h_{l-1}) are in place; the gZ buffer written next (l - 2's)
      // was last read by dW_{l+1}, which every warp finished before this barrier's previous use.
      __syncthreads();
      if (want_dw) weight_grad<T, TILES>(dw, p, bp, smem, l, l % 3, warp, lane);
    }
    __syncthreads();  // the next chunk's recompute overwrites H and gZ
  }
  // The block's partial sums: dW from the warps' registers, db summed over the warps in warp order.
  float* part = bp.partial + int64_t(blockIdx.x) * (bp.dw_floats + bp.db_floats);
  if (want_dw) store_weight_grad<TILES>(dw, p, bp, part, warp, lane);
  const float* sums = reinterpret_cast<const float*>(smem + bp.sums_off);
  for (int c = threadIdx.x; c < bp.db_floats; c += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < kBwdWarps; ++w) s += sums[w * bp.db_floats + c];
    part[bp.dw_floats + c] = s;
  }
}

// gW_l and gb_l: the blocks' partial sums added in block order (deterministic), as T. (Both
// backward kernels: the dW sums in fragment order, or row-major from the wgmma kernel.)
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
      const int k = bp.gmma ? idx / L.np : mt * 16 + (ln >> 2) + (i >> 1) * 8;
      const int n = bp.gmma ? idx % L.np : nt * 8 + 2 * (ln & 3) + (i & 1);
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
// memory a block takes, or -1 where the kernel does not take the stack (its width, or more dW
// tiles than the warps keep).
inline int plan_bwd(const Params& p, int width, int elem_bytes, BwdParams* bp) {
  if (!bwd_width_ok(width)) return -1;
  int off = 0, gmax = width;
  for (int l = 0; l < p.layers; ++l) {
    bp->h_off[l] = off;
    off += 16 * (p.layer[l].kp + kPad) * elem_bytes;
    if (p.layer[l].np > gmax) gmax = p.layer[l].np;
  }
  bp->g_stride = gmax + kPad;
  for (int s = 0; s < 3; ++s) {
    bp->g_off[s] = off;
    off += 16 * bp->g_stride * elem_bytes;
  }
  bp->warp_bytes = (off + 15) / 16 * 16;
  bp->warps_off = p.weights_bytes;
  bp->sums_off = bp->warps_off + kBwdWarps * bp->warp_bytes;
  int f = 0, t = 0;
  for (int l = 0; l < p.layers; ++l) {
    bp->dw_off[l] = f;
    bp->tile0[l] = t;
    f += p.layer[l].kp * p.layer[l].np;
    t += (p.layer[l].kp / 16) * (p.layer[l].np / 16);
  }
  bp->tile0[p.layers] = t;
  if (t > kBwdWarps * dw_tiles(width)) return -1;
  bp->dw_floats = f;
  int c = 0;
  for (int l = 0; l < p.layers; ++l) {
    bp->db_off[l] = c;
    c += p.layer[l].np;
  }
  bp->db_floats = c;
  bp->smem_bytes = bp->sums_off + kBwdWarps * bp->db_floats * 4;
  bp->gmma = false;
  return bp->smem_bytes;
}

}  // namespace regemm::narrow
