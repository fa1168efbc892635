// Host cost of the CUDA calls a regemm handler makes per call (no GPU work to
// speak of): where the microseconds of an uncaptured custom call go.
//   nvcc -O2 -std=c++17 -arch=sm_90a benchmarks/host_cost.cu -o /tmp/host_cost && /tmp/host_cost
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>

__global__ void empty_kernel(int) {}
__global__ void __cluster_dims__(2, 1, 1) cluster_kernel(int) {}

template <class F>
void time_it(const char* what, F f, int n = 2000) {
  for (int i = 0; i < 50; ++i) f();
  cudaDeviceSynchronize();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  auto t1 = std::chrono::steady_clock::now();
  cudaDeviceSynchronize();
  printf("%8.2f us  %s\n", std::chrono::duration<double, std::micro>(t1 - t0).count() / n, what);
}

int main() {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void* buf;
  cudaMalloc(&buf, 1 << 20);
  time_it("cudaGetDevice", [] { int d; cudaGetDevice(&d); });
  time_it("cudaStreamIsCapturing", [&] { cudaStreamCaptureStatus c; cudaStreamIsCapturing(s, &c); });
  time_it("cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)", [] {
    void* p; cudaDriverEntryPointQueryResult q;
    cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
  });
  time_it("cudaFuncSetAttribute(max dyn smem)", [] {
    cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  });
  time_it("cudaMemsetAsync 4 KiB", [&] { cudaMemsetAsync(buf, 0, 4096, s); });
  time_it("empty kernel <<<1, 32>>>", [&] { empty_kernel<<<1, 32, 0, s>>>(0); });
  time_it("cudaLaunchKernelEx, cluster 2x1, 132 CTAs", [&] {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim = {2, 1, 1};
    cfg.gridDim = dim3(132); cfg.blockDim = dim3(128); cfg.stream = s; cfg.attrs = attr; cfg.numAttrs = 1;
    void* args[] = {nullptr};
    int x = 0; args[0] = &x;
    cudaLaunchKernelExC(&cfg, (const void*)empty_kernel, args);
  });
  time_it("cudaGetLastError", [] { cudaGetLastError(); });
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  time_it("cudaEventRecord", [&] { cudaEventRecord(e, s); });
  // A TMA descriptor as CUTLASS builds one per operand (bf16 1024 x 1024, 64 x 128 box),
  // through the driver entry point as CUTLASS looks it up.
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
  auto encode = reinterpret_cast<CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                              CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                              CUtensorMapFloatOOBfill)>(fn);
  time_it("cuTensorMapEncodeTiled (bf16 1024x1024, box 64x128, 128B swizzle)", [&] {
    alignas(64) CUtensorMap map;
    cuuint64_t dims[2] = {1024, 1024}, strides[1] = {2048};
    cuuint32_t box[2] = {64, 128}, es[2] = {1, 1};
    encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, buf, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
           CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  });
  printf("last error: %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
