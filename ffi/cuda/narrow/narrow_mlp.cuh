// The fused narrow MLP (docs/spec.md §8): the whole stack of a narrow MLP in one kernel per
// direction. h_0 = x [M, K0], h_l = act_l(h_{l-1} W_l + b_l), every hidden layer W wide
// (16/32/64/128), the last N_out <= 128 wide.
//
// One idea: a warp carries its 16-row tiles through every layer in registers. The m16n8k16
// tensor-core MMA leaves a layer's output in the accumulator layout that is, two 8-column
// tiles at a time, the A-operand layout of the next layer's MMA; so h_l goes from one MMA to
// the next without leaving the registers, and only x is read and y written. The weights (every
// layer's, transposed to [N][K] and padded) and the biases (f32) sit in shared memory, loaded
// once per block; the blocks are persistent, and each warp takes row tiles on its own.
//
// The backward (narrow_mlp_bwd, widths 16-64) recomputes the forward of its rows on chip,
// keeping each layer's z in shared memory, runs the chain of dgrad products down the stack
// with gZ in registers, and sums the weight gradients of its block's rows in registers (each
// warp owning fixed tiles: the same additions in the same order on every run); a second kernel
// sums the blocks' partial sums in a fixed order. Nothing per layer goes through HBM.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/narrow/gmma.h"
#include "regemm/activation.h"

namespace regemm::narrow {

constexpr int kMaxLayers = 9;  // 8 hidden layers and the output layer
constexpr int kWarps = 4;      // per block of the backward (and of the forward under 128 wide)
constexpr int kPad = 8;        // elements of padding per smem row: ldmatrix rows on distinct banks

struct Layer {
  const void* w;  // [K, N] (or [N, K] where w_transposed)
  const void* b;  // [N] or null
  int k, n;       // true sizes
  int kp, np;     // padded to 16
  int w_off;      // byte offsets into the block's shared memory: Wt [np][kp + kPad] T
  int b_off;      //   and the bias, f32 [np]
};

struct Params {
  int64_t m;
  int layers;  // matrices: hidden layers + 1
  bool w_transposed;
  Act act_hidden, act_out;
  float slope;
  const void* x;  // [M, K0]
  void* y;        // [M, N_out]
  int weights_bytes;  // shared memory the weights and biases take
  Layer layer[kMaxLayers];
};

// The element types' MMA and packing.
template <class T> struct Elem;
template <> struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t u) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm(  // registers only: not volatile, so the compiler schedules it among the loads
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct Elem<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t u) { return __half22float2(*reinterpret_cast<__half2*>(&u)); }
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Where a layer's Wt (n, k) lies in shared memory, in elements from its start: in padded rows
// [np][kp + kPad] (mma.sync's ldmatrix: rows on distinct banks), or in wgmma's 8 x 8 core
// matrices, K-major (gmma.h).
struct PaddedRows {
  __device__ int operator()(const Layer& L, int n, int k) const { return n * (L.kp + kPad) + k; }
};
struct CoreMatrices {
  __device__ int operator()(const Layer& L, int n, int k) const { return gmma::kmajor_at(n, k, L.kp); }
};

// Every layer's weights into shared memory as Wt in the layout `at` (zero padded), biases as
// f32. Each block loads them once, so at small M the load is the call's fixed cost: 16-byte
// loads (a source row of whole 8-element vectors), eight in flight a thread before their
// stores, with one division per vector (2-byte loads with the index math per element took
// 32 us a call at 64 x 4 hidden and 95 us at 128 x 4, tools/narrow_bench.cu NARROW_LOAD_ONLY).
template <class T, class At = PaddedRows>
__device__ void load_weights(const Params& p, char* smem, At at = {}) {
  constexpr int kBatch = 8;
  for (int l = 0; l < p.layers; ++l) {
    const Layer& L = p.layer[l];
    T* wt = reinterpret_cast<T*>(smem + L.w_off);
    const T* __restrict__ w = static_cast<const T*>(L.w);
    // The source's rows: W [N, K] row n is Wt's row n; W [K, N] row k is Wt's column k.
    const int rows = p.w_transposed ? L.n : L.k, cols = p.w_transposed ? L.k : L.n;
    if (L.n < L.np || L.k < L.kp)  // the padding, apart from the elements stored below
      for (int i = threadIdx.x; i < L.np * L.kp; i += blockDim.x) {
        const int n = i / L.kp, k = i % L.kp;
        if (n >= L.n || k >= L.k) wt[at(L, n, k)] = Elem<T>::from_float(0.f);
      }
    if (cols % 8 == 0 && (reinterpret_cast<uintptr_t>(w) & 15) == 0) {
      const int per_row = cols / 8, total = rows * per_row;
      const uint4* __restrict__ src = reinterpret_cast<const uint4*>(w);
      for (int i0 = threadIdx.x; i0 < total; i0 += kBatch * blockDim.x) {
        uint4 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int i = i0 + u * blockDim.x;
          if (i < total) v[u] = __ldg(src + i);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int i = i0 + u * blockDim.x;
          if (i >= total) break;
          const int r = i / per_row, c = (i % per_row) * 8;
          if (p.w_transposed) {  // 8 elements along k: contiguous and 16-byte aligned in both layouts
            *reinterpret_cast<uint4*>(wt + at(L, r, c)) = v[u];
          } else {
            const T* e = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
            for (int j = 0; j < 8; ++j) wt[at(L, c + j, r)] = e[j];
          }
        }
      }
    } else {  // rows of other lengths (an input or output width that is not a multiple of 8)
      for (int i = threadIdx.x; i < rows * cols; i += blockDim.x) {
        const int r = i / cols, c = i % cols;
        wt[p.w_transposed ? at(L, r, c) : at(L, c, r)] = w[i];
      }
    }
    float* bias = reinterpret_cast<float*>(smem + L.b_off);
    for (int n = threadIdx.x; n < L.np; n += blockDim.x)
      bias[n] = (L.b != nullptr && n < L.n) ? Elem<T>::to_float(static_cast<const T*>(L.b)[n]) : 0.f;
  }
}

// Two consecutive elements of row r (cols c, c+1) of a row-major [rows, cols] matrix, zero
// outside it, as one packed register.
template <class T>
__device__ __forceinline__ uint32_t load_pair(const T* a, int64_t rows, int cols, int64_t r, int c) {
  if (r >= rows) return 0u;
  const T* row = a + r * cols;
  if ((cols & 1) == 0 && c + 1 < cols) return *reinterpret_cast<const uint32_t*>(row + c);
  float lo = c < cols ? Elem<T>::to_float(row[c]) : 0.f;
  float hi = c + 1 < cols ? Elem<T>::to_float(row[c + 1]) : 0.f;
  return Elem<T>::pack(lo, hi);
}

template <class T>
__device__ __forceinline__ void store_pair(T* a, int64_t rows, int cols, int64_t r, int c, float lo, float hi) {
  if (r >= rows) return;
  T* row = a + r * cols;
  if ((cols & 1) == 0 && c + 1 < cols) {
    *reinterpret_cast<uint32_t*>(row + c) = Elem<T>::pack(lo, hi);
    return;
  }
  if (c < cols) row[c] = Elem<T>::from_float(lo);
  if (c + 1 < cols) row[c + 1] = Elem<T>::from_float(hi);
}

// acc[r][j] (+)= A[r] (16 x 16*KT, registers) x Wt rows [n0, n0 + 8*NT) (B from shared memory).
template <class T, int RT, int KT, int NT>
__device__ __forceinline__ void mma_tile(float (&acc)[RT][NT][4], const uint32_t (&a)[RT][KT][4], const T* wt,
                                         int stride, int lane) {
  static_assert(NT % 2 == 0, "n tiles go in pairs (one ldmatrix.x4)");
  // ldmatrix.x4: lane l gives row l % 8 of matrix l / 8: (n tile 2j + l/16, k half (l/8) % 2).
  // A k tile's B fragments are all loaded before its MMAs: one load latency per k tile.
  const T* base = wt + ((lane >> 4) * 8 + (lane & 7)) * stride + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    uint32_t b[NT / 2][4];
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) ldmatrix_x4(b[j], base + j * 16 * stride + kt * 16);
#pragma unroll
    for (int j = 0; j < NT / 2; ++j)
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        Elem<T>::mma(acc[r][2 * j], a[r][kt], b[j][0], b[j][1]);
        Elem<T>::mma(acc[r][2 * j + 1], a[r][kt], b[j][2], b[j][3]);
      }
  }
}

// acc + bias -> act, packed as the A operand of the next layer (n tile j is k tile j/2's low or
// high 8 columns: registers 0, 1 or 2, 3).
// The activation as the kernels apply it: compile-time (a run-time switch per element puts
// every activation's code inline in the loop: 36k PTX lines and 30x slower, from the
// instruction cache), with the GPU's fast math (the result is rounded to 16 bits).
template <Act A>
__device__ __forceinline__ float act(float z, float slope) { return act_fwd<float, FastMath>(A, z, slope); }

template <class T, Act A, int RT, int NT>
__device__ __forceinline__ void epilogue_to_a(uint32_t (&a)[RT][NT / 2][4], const float (&acc)[RT][NT][4],
                                              const float* bias, float slope, int lane) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int c = j * 8 + 2 * (lane & 3);
    const float b0 = bias[c], b1 = bias[c + 1];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const float* v = acc[r][j];
      a[r][j / 2][(j & 1) * 2 + 0] = Elem<T>::pack(act<A>(v[0] + b0, slope), act<A>(v[1] + b1, slope));
      a[r][j / 2][(j & 1) * 2 + 1] = Elem<T>::pack(act<A>(v[2] + b0, slope), act<A>(v[3] + b1, slope));
    }
  }
}

template <int RT, int NT>
__device__ __forceinline__ void zero(float (&acc)[RT][NT][4]) {
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][j][i] = 0.f;
}

// The output layer W -> N_out, 16 columns at a time, stored from the registers.
template <class T, Act A, int W, int RT>
__device__ __forceinline__ void output_layer(const Params& p, const char* smem, const uint32_t (&a)[RT][W / 16][4],
                                             int64_t row0, int lane) {
  constexpr int KT = W / 16;
  const int g = lane >> 2, q = lane & 3;
  const Layer& L = p.layer[p.layers - 1];
  const T* wt = reinterpret_cast<const T*>(smem + L.w_off);
  const float* bias = reinterpret_cast<const float*>(smem + L.b_off);
  T* y = static_cast<T*>(p.y);
  for (int j = 0; j < L.np / 16; ++j) {
    float o[RT][2][4];
    zero(o);
    mma_tile<T, RT, KT, 2>(o, a, wt + j * 16 * (W + kPad), W + kPad, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = j * 16 + h * 8 + 2 * q;
      const float b0 = bias[c], b1 = bias[c + 1];
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const int64_t r0 = row0 + r * 16 + g;
        const float* v = o[r][h];
        store_pair(y, p.m, L.n, r0, c, act<A>(v[0] + b0, p.slope), act<A>(v[1] + b1, p.slope));
        store_pair(y, p.m, L.n, r0 + 8, c, act<A>(v[2] + b0, p.slope), act<A>(v[3] + b1, p.slope));
      }
    }
  }
}

// The forward: y = the stack on x. W: the hidden width; RT: 16-row tiles a warp carries at
// once (they share each B fragment); WARPS a block.
template <class T, int W, int RT, Act HID, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) narrow_mlp_fwd(const Params p) {
  extern __shared__ __align__(128) char smem[];  // (128: as the wgmma kernels declare it)
  load_weights<T>(p, smem);
  __syncthreads();
  constexpr int NT = W / 8, KT = W / 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const T* x = static_cast<const T*>(p.x);
  const int k0 = p.layer[0].k;
  const int64_t tiles = (p.m + 16 * RT - 1) / (16 * RT);
  for (int64_t t = int64_t(blockIdx.x) * WARPS + warp; t < tiles; t += int64_t(gridDim.x) * WARPS) {
    const int64_t row0 = t * 16 * RT;
    float acc[RT][NT][4];
    uint32_t a[RT][KT][4];
    // Layer 0: K0 -> W, its A operand read from x one k tile at a time.
    zero(acc);
    {
      const Layer& L = p.layer[0];
      const T* wt = reinterpret_cast<const T*>(smem + L.w_off);
      const int stride = L.kp + kPad;
      for (int kt = 0; kt < L.kp / 16; ++kt) {
        uint32_t ax[RT][1][4];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const int64_t r0 = row0 + r * 16 + g;
          const int c = kt * 16 + 2 * q;
          ax[r][0][0] = load_pair(x, p.m, k0, r0, c);
          ax[r][0][1] = load_pair(x, p.m, k0, r0 + 8, c);
          ax[r][0][2] = load_pair(x, p.m, k0, r0, c + 8);
          ax[r][0][3] = load_pair(x, p.m, k0, r0 + 8, c + 8);
        }
        mma_tile<T, RT, 1, NT>(acc, ax, wt + kt * 16, stride, lane);
      }
      epilogue_to_a<T, HID, RT, NT>(a, acc, reinterpret_cast<const float*>(smem + L.b_off), p.slope, lane);
    }
    // The hidden layers W -> W.
    for (int l = 1; l < p.layers - 1; ++l) {
      const Layer& L = p.layer[l];
      zero(acc);
      mma_tile<T, RT, KT, NT>(acc, a, reinterpret_cast<const T*>(smem + L.w_off), W + kPad, lane);
      epilogue_to_a<T, HID, RT, NT>(a, acc, reinterpret_cast<const float*>(smem + L.b_off), p.slope, lane);
    }
    // The output layer, its activation chosen here (one copy of its code runs).
    switch (p.act_out) {
#define REGEMM_NARROW_OUT(A) \
  case A: output_layer<T, A, W, RT>(p, smem, a, row0, lane); break;
      REGEMM_NARROW_OUT(Act::kNone) REGEMM_NARROW_OUT(Act::kRelu) REGEMM_NARROW_OUT(Act::kLeakyRelu)
      REGEMM_NARROW_OUT(Act::kGelu) REGEMM_NARROW_OUT(Act::kGeluErf) REGEMM_NARROW_OUT(Act::kSigmoid)
      REGEMM_NARROW_OUT(Act::kTanh) REGEMM_NARROW_OUT(Act::kSilu)
#undef REGEMM_NARROW_OUT
    }
  }
}

// ---------------------------------------------------------------------------
// Host side: the shared-memory plan and the launch.

// 16-row tiles a warp carries at once, by width (W = 128 keeps one: registers).
constexpr int row_tiles(int width) { return width <= 64 ? 2 : 1; }
// Warps a block of the forward, by width. Under 128 wide 4 to 6 blocks of 4 share an SM; at 128
// the weights (121 KB at 4 hidden) leave room for one block, so it takes 16 warps (128
// registers a thread fill the register file) where 4 left one warp a scheduler (24% of the
// tensor-core peak, ncu: 0.27 eligible warps a cycle).
constexpr int fwd_warps(int width) { return width >= 128 ? 16 : kWarps; }
inline bool width_ok(int width) { return width == 16 || width == 32 || width == 64 || width == 128; }

// Fills the padded sizes and shared-memory offsets of p.layer[0..layers) from k, n for the
// weights' layout; returns the bytes the weights and biases take. Core matrices (wgmma's) pad
// layer 0's K to 32: its MMAs go two k steps at a time.
enum class Layout { kPaddedRows, kCoreMatrices };
inline int plan_weights(Params* p, int elem_bytes, Layout layout = Layout::kPaddedRows) {
  int off = 0;
  for (int l = 0; l < p->layers; ++l) {
    Layer& L = p->layer[l];
    const int kq = layout == Layout::kCoreMatrices && l == 0 ? 32 : 16;
    L.kp = (L.k + kq - 1) / kq * kq;
    L.np = (L.n + 15) / 16 * 16;
    L.w_off = off;
    off += L.np * (L.kp + (layout == Layout::kPaddedRows ? kPad : 0)) * elem_bytes;
    L.b_off = off;
    off += (L.np * 4 + 15) / 16 * 16;
  }
  p->weights_bytes = off;
  return off;
}

// Blocks of `kernel` that run at once on the current device with `smem` bytes each: the
// persistent grid. Cached per (device, kernel, smem); the attribute that admits more than
// 48 KiB of shared memory is set once per (device, kernel).
inline cudaError_t resident_blocks(const void* kernel, int smem, int* out, int threads = kWarps * 32) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int>, int> cache;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(dev, kernel, smem);  // (a kernel is launched with one block size)
  auto it = cache.find(key);
  if (it != cache.end()) { *out = it->second; return cudaSuccess; }
  int optin = 0, sms = 0, per_sm = 0;
  if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
  if ((e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin)) != cudaSuccess) return e;
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem)) != cudaSuccess) return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;  // (the caller checked the size first)
  cache[key] = *out = per_sm * sms;
  return cudaSuccess;
}

inline cudaError_t max_smem(int* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(out, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
}

// A persistent grid of `kernel` (its one argument p): as many blocks as run at once, or fewer
// where `tiles` (per_block of them a block at once) need fewer.
inline cudaError_t launch_persistent(const void* kernel, const Params& p, int threads, int64_t tiles, int per_block,
                                     cudaStream_t stream) {
  int resident = 0;
  cudaError_t e = resident_blocks(kernel, p.weights_bytes, &resident, threads);
  if (e != cudaSuccess) return e;
  const int64_t want = (tiles + per_block - 1) / per_block;
  const int blocks = int(want < resident ? want : resident);
  if (blocks == 0) return cudaSuccess;
  void* args[] = {const_cast<Params*>(&p)};
  return cudaLaunchKernel(kernel, dim3(blocks), dim3(threads), args, p.weights_bytes, stream);
}

// f(std::integral_constant<int, W>{}, std::integral_constant<Act, A>{}) for a stack's hidden
// width and activation: the forward kernels' instances. False for another width.
template <class F>
bool with_width_act(int width, Act act, F&& f) {
  bool ok = false;
  with_act(act, [&](auto a) {
    switch (width) {
      case 16: f(std::integral_constant<int, 16>{}, a); ok = true; break;
      case 32: f(std::integral_constant<int, 32>{}, a); ok = true; break;
      case 64: f(std::integral_constant<int, 64>{}, a); ok = true; break;
      case 128: f(std::integral_constant<int, 128>{}, a); ok = true; break;
    }
  });
  return ok;
}

// The forward on `stream`; p planned (plan_weights), every hidden layer `width` wide.
template <class T>
cudaError_t launch_fwd(const Params& p, int width, cudaStream_t stream) {
  cudaError_t e = cudaErrorInvalidValue;
  with_width_act(width, p.act_hidden, [&](auto w, auto a) {
    constexpr int W = decltype(w)::value, RT = row_tiles(W), WARPS = fwd_warps(W);
    const void* kernel = reinterpret_cast<const void*>(&narrow_mlp_fwd<T, W, RT, decltype(a)::value, WARPS>);
    e = launch_persistent(kernel, p, WARPS * 32, (p.m + 16 * RT - 1) / (16 * RT), WARPS, stream);
  });
  return e;
}

}  // namespace regemm::narrow
