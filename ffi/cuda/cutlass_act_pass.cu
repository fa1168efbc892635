// A separate activation pass, Y = act(Z) over a dense buffer, for the problems
// where the fused epilogue cannot hide an expensive activation (device run 2:
// in the ping-pong kernel at K = 1024 gelu cost +66% fused, while one extra
// pass over Y at full occupancy costs its bytes, ~45 us for a 8192x4096 bf16
// Y). The dispatch's tuner times both ways and keeps the faster. The math is
// activation.h's act_fwd with the same FastMath policy as the fused epilogue,
// so both ways compute the same function.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "../regemm/activation.h"
#include "cutlass_kernels.h"

namespace regemm::cutlass_sm90 {
namespace {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// 16 bytes per thread and step (src and dst 16-byte aligned), grid-stride; the
// tail below a whole vector runs one element per thread.
template <class T, Act A>
__global__ void __launch_bounds__(256) act_kernel(const T* __restrict__ src, T* __restrict__ dst, int64_t count,
                                                  float slope) {
  constexpr int V = 16 / sizeof(T);
  struct alignas(16) Vec { T v[V]; };
  const int64_t nvec = count / V;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += stride) {
    Vec x = reinterpret_cast<const Vec*>(src)[i];
#pragma unroll
    for (int j = 0; j < V; ++j) x.v[j] = from_f<T>(act_fwd<float, FastMath>(A, to_f(x.v[j]), slope));
    reinterpret_cast<Vec*>(dst)[i] = x;
  }
  for (int64_t i = nvec * V + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    dst[i] = from_f<T>(act_fwd<float, FastMath>(A, to_f(src[i]), slope));
}

template <class T>
Status launch_act(const void* src, void* dst, int64_t count, Act act, float slope, cudaStream_t stream, int sms) {
  const int64_t nvec = (count + 16 / int64_t(sizeof(T)) - 1) / (16 / int64_t(sizeof(T)));
  const int64_t blocks = std::min<int64_t>((nvec + 255) / 256, int64_t(sms > 0 ? sms : 132) * 8);
  const dim3 grid(unsigned(blocks > 0 ? blocks : 1));
  auto s = static_cast<const T*>(src);
  auto d = static_cast<T*>(dst);
  switch (act) {
    case Act::kNone: return {};
    case Act::kRelu: act_kernel<T, Act::kRelu><<<grid, 256, 0, stream>>>(s, d, count, slope); break;
    case Act::kLeakyRelu: act_kernel<T, Act::kLeakyRelu><<<grid, 256, 0, stream>>>(s, d, count, slope); break;
    case Act::kGelu: act_kernel<T, Act::kGelu><<<grid, 256, 0, stream>>>(s, d, count, slope); break;
    case Act::kGeluErf: act_kernel<T, Act::kGeluErf><<<grid, 256, 0, stream>>>(s, d, count, slope); break;
    case Act::kSigmoid: act_kernel<T, Act::kSigmoid><<<grid, 256, 0, stream>>>(s, d, count, slope); break;
    case Act::kTanh: act_kernel<T, Act::kTanh><<<grid, 256, 0, stream>>>(s, d, count, slope); break;
    case Act::kSilu: act_kernel<T, Act::kSilu><<<grid, 256, 0, stream>>>(s, d, count, slope); break;
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return {"activation pass launch", cudaGetErrorString(e)};
  return {};
}

}  // namespace

Status act_pass(DType t, const void* src, void* dst, int64_t count, Act act, float slope, cudaStream_t stream,
                int sms) {
  switch (t) {
    case DType::kBF16: return launch_act<__nv_bfloat16>(src, dst, count, act, slope, stream, sms);
    case DType::kF16: return launch_act<__half>(src, dst, count, act, slope, stream, sms);
    case DType::kF32: return launch_act<float>(src, dst, count, act, slope, stream, sms);
    default: return {"activation pass", "unsupported dtype"};
  }
}

}  // namespace regemm::cutlass_sm90
