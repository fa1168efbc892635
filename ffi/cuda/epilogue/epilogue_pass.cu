// See epilogue_pass.h.
//
// A memory-bound elementwise pass: each thread owns V consecutive columns of
// a row (16-byte vectors where n, the buffers and C's batch stride allow;
// else one element), blocks of 256 threads tile (columns x rows), the grid's
// z walks the batch. No division per element: rows and batches are loop
// indices, so the bias kind is only a choice of index.
#include <algorithm>
#include <cstdint>

#include "regemm/activation.h"
#include "regemm/numeric.h"
#include "epilogue_pass.h"
#include "cuda/pack.h"

namespace regemm {
namespace {

struct PassArgs {
  int64_t m, n, batch, stride_bias, stride_c;
  const void* bias;  // null: no bias (or !with_bias_c)
  const void* c;     // null: no C (or !with_bias_c)
  const void* src;   // the GEMM's output: Y, or Z (from_z)
  void* y;
  void* z;           // null: Z not stored (or from_z: Z is the source)
  double beta, slope;
  BiasKind bias_kind;
};

template <class T, int V, Act A, class M>
__global__ void __launch_bounds__(256) epilogue_kernel(const PassArgs a) {
  using F = acc_t<T>;
  using W = Pack<T, V>;
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (col >= a.n) return;
  const F beta = F(a.beta), slope = F(a.slope);
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) {
    T* y = static_cast<T*>(a.y) + b * a.m * a.n;
    const T* src = static_cast<const T*>(a.src) + b * a.m * a.n;
    T* z = a.z ? static_cast<T*>(a.z) + b * a.m * a.n : nullptr;
    const T* c = a.c ? static_cast<const T*>(a.c) + b * a.stride_c : nullptr;
    const T* bias = a.bias ? static_cast<const T*>(a.bias) + b * a.stride_bias : nullptr;
    F bias_col[V];
#pragma unroll
    for (int j = 0; j < V; ++j)
      bias_col[j] = bias && a.bias_kind != BiasKind::kPerRow ? load<F>(bias[bias_index(a.bias_kind, 0, col + j)]) : F(0);
    for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < a.m; r += int64_t(gridDim.y) * blockDim.y) {
      const int64_t off = r * a.n + col;
      const W yv = load_pack<T, V>(src + off);
      F v[V];
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = load<F>(yv.v[j]) + bias_col[j];
      if (bias && a.bias_kind == BiasKind::kPerRow) {
        const F br = load<F>(bias[r]);
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] += br;
      }
      if (c) {
        const W cv = load_pack<T, V>(c + off);
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] += beta * load<F>(cv.v[j]);
      }
      if (z) store_pack<T, V>(z + off, round_pack<T, V>(v));
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = act_fwd<F, M>(A, v[j], slope);
      store_pack<T, V>(y + off, round_pack<T, V>(v));
    }
  }
}

template <class T, int V, class M>
cudaError_t launch_v(const PassArgs& a, Act act, cudaStream_t stream) {
  const int64_t cols = (a.n + V - 1) / V;
  const int tx = int(std::min<int64_t>(256, (cols + 31) / 32 * 32));
  const int ty = 256 / tx;
  const dim3 block{unsigned(tx), unsigned(ty)};
  const dim3 grid(unsigned((cols + tx - 1) / tx), unsigned(std::min<int64_t>((a.m + ty - 1) / ty, 65535)),
                  unsigned(std::min<int64_t>(a.batch, 65535)));
  if (!with_act(act, [&](auto k) { epilogue_kernel<T, V, decltype(k)::value, M><<<grid, block, 0, stream>>>(a); }))
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

template <class T, class M>
cudaError_t launch_t(const PassArgs& a, Act act, cudaStream_t stream) {
  constexpr int V = kVec<T>;
  // Vectors need every row start (n), C's batch stride and the buffers on 16 bytes.
  const bool vec = a.n % V == 0 && (!a.c || a.stride_c % V == 0) && aligned16(a.y) && aligned16(a.src) &&
                   (!a.z || aligned16(a.z)) && (!a.c || aligned16(a.c));
  return vec ? launch_v<T, V, M>(a, act, stream) : launch_v<T, 1, M>(a, act, stream);
}

template <class T>
cudaError_t launch_math(const PassArgs& a, Act act, bool fast, cudaStream_t stream) {
  return fast ? launch_t<T, FastMath>(a, act, stream) : launch_t<T, PreciseMath>(a, act, stream);
}

}  // namespace

const char* epilogue_pass(const GemmProblem& p, const GemmOperands& o, bool with_bias_c, bool fast_math,
                          cudaStream_t stream, bool from_z) {
  if (p.m == 0 || p.n == 0 || p.batch == 0) return nullptr;
  const bool use_c = with_bias_c && p.uses_c();
  const PassArgs a{p.m, p.n, p.batch, p.stride_bias, p.stride_c,
                   with_bias_c && p.bias_kind != BiasKind::kNone ? o.bias : nullptr,
                   use_c ? o.c : nullptr, from_z ? o.z : o.y, o.y, from_z ? nullptr : o.z,
                   p.beta, p.slope, p.bias_kind};
  cudaError_t e = cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kF32: e = launch_math<float>(a, p.act, fast_math, stream); break;
    case DType::kF64: e = launch_t<double, PreciseMath>(a, p.act, stream); break;
    case DType::kBF16: e = launch_math<bf16_t>(a, p.act, fast_math, stream); break;
    case DType::kF16: e = launch_math<f16_t>(a, p.act, fast_math, stream); break;
  }
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace regemm
