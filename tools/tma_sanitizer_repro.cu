// Can compute-sanitizer see memory written by Hopper's copy engine (TMA)?
//
// One 64 x 64 int tile is written to a fresh cudaMalloc buffer by one of three
// writers, then summed by a plain kernel (`read_tile`), and the values are
// checked on the host (so the writer did write them):
//   plain   st.global from every thread (the control)
//   bulk    cp.async.bulk shared -> global (1-D, no tensor map)
//   tensor  cp.async.bulk.tensor.2d through a tensor map: how the sm90 GEMM
//           epilogues of CUTLASS and cuBLASLt store their output
//   tensor-load  the other direction, as their mainloops read A and B: a
//           plain kernel writes a source tile, the copy engine loads it into
//           shared memory (completing on an mbarrier), plain stores write it
// Nothing else runs, so any report is about that one mechanism:
//   compute-sanitizer --tool initcheck tools/tma_sanitizer_repro tensor
//   compute-sanitizer --tool racecheck tools/tma_sanitizer_repro tensor
//   compute-sanitizer --tool racecheck --kernel-name kns=read_tile tools/tma_sanitizer_repro tensor
// tools/gpu_check.sh builds it and runs every writer under each tool; its
// summary prints the counts beside the kernels this justifies excluding.
//
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -o tools/tma_sanitizer_repro tools/tma_sanitizer_repro.cu
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int kRows = 64, kCols = 64, kElems = kRows * kCols, kThreads = 256;

#define CHECK(expr)                                                                                   \
  do {                                                                                                \
    const cudaError_t e_ = (expr);                                                                    \
    if (e_ != cudaSuccess) {                                                                          \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_));    \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

__device__ int value(int i) { return 3 * i + 1; }

__global__ void write_plain(int* out) {
  for (int i = threadIdx.x; i < kElems; i += kThreads) out[i] = value(i);
}

// The tile in shared memory, made visible to the copy engine (the async proxy).
__device__ unsigned fill_tile(int* tile) {
  for (int i = threadIdx.x; i < kElems; i += kThreads) tile[i] = value(i);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  return static_cast<unsigned>(__cvta_generic_to_shared(tile));
}

__device__ void wait_stores() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void write_bulk(int* out) {
  __shared__ alignas(128) int tile[kElems];
  const unsigned s = fill_tile(tile);
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(out), "r"(s),
                 "r"(unsigned(sizeof tile))
                 : "memory");
    wait_stores();
  }
}

__global__ void write_tensor(const __grid_constant__ CUtensorMap map) {
  __shared__ alignas(128) int tile[kElems];
  const unsigned s = fill_tile(tile);
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(&map), "r"(0),
                 "r"(0), "r"(s)
                 : "memory");
    wait_stores();
  }
}

__device__ void wait_phase0(unsigned bar) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n @!p bra WAIT%=;\n}" ::"r"(bar)
      : "memory");
}

__global__ void write_via_tensor_load(const __grid_constant__ CUtensorMap src, int* out) {
  __shared__ alignas(128) int tile[kElems];
  __shared__ alignas(8) unsigned long long bar_word;
  const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&bar_word));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(unsigned(sizeof tile))
                 : "memory");
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            static_cast<unsigned>(__cvta_generic_to_shared(tile))),
        "l"(&src), "r"(0), "r"(0), "r"(bar)
        : "memory");
  }
  wait_phase0(bar);
  for (int i = threadIdx.x; i < kElems; i += kThreads) out[i] = tile[i];
}

__global__ void read_tile(const int* in, long long* sum) {
  long long s = 0;
  for (int i = threadIdx.x; i < kElems; i += kThreads) s += in[i];
  atomicAdd(reinterpret_cast<unsigned long long*>(sum), static_cast<unsigned long long>(s));
}

CUtensorMap tensor_map(int* buf) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (!fn || q != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled not found\n");
    std::exit(1);
  }
  CUtensorMap map;
  const cuuint64_t dims[2] = {kCols, kRows}, strides[1] = {kCols * sizeof(int)};
  const cuuint32_t box[2] = {kCols, kRows}, elem_strides[2] = {1, 1};
  const CUresult r = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)(
      &map, CU_TENSOR_MAP_DATA_TYPE_INT32, 2, buf, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", int(r));
    std::exit(1);
  }
  return map;
}

}  // namespace

int main(int argc, char** argv) {
  const char* how = argc > 1 ? argv[1] : "";
  int *buf = nullptr, *src = nullptr;
  long long* sum = nullptr;
  CHECK(cudaMalloc(&buf, kElems * sizeof(int)));  // never written but by the writer
  CHECK(cudaMalloc(&sum, sizeof(long long)));
  CHECK(cudaMemset(sum, 0, sizeof(long long)));
  if (!std::strcmp(how, "plain")) {
    write_plain<<<1, kThreads>>>(buf);
  } else if (!std::strcmp(how, "bulk")) {
    write_bulk<<<1, kThreads>>>(buf);
  } else if (!std::strcmp(how, "tensor")) {
    write_tensor<<<1, kThreads>>>(tensor_map(buf));
  } else if (!std::strcmp(how, "tensor-load")) {
    CHECK(cudaMalloc(&src, kElems * sizeof(int)));
    write_plain<<<1, kThreads>>>(src);
    write_via_tensor_load<<<1, kThreads>>>(tensor_map(src), buf);
  } else {
    std::fprintf(stderr, "usage: %s plain|bulk|tensor|tensor-load\n", argv[0]);
    return 2;
  }
  CHECK(cudaGetLastError());
  read_tile<<<1, kThreads>>>(buf, sum);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<int> host(kElems);
  long long got = 0, want = 0;
  CHECK(cudaMemcpy(host.data(), buf, kElems * sizeof(int), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&got, sum, sizeof got, cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int i = 0; i < kElems; ++i) {
    wrong += host[i] != 3 * i + 1;
    want += 3 * i + 1;
  }
  std::printf("%s writer: %d of %d values wrong, sum %lld (want %lld): %s\n", how, wrong, kElems, got, want,
              wrong == 0 && got == want ? "ok" : "WRONG");
  CHECK(cudaFree(buf));
  if (src) CHECK(cudaFree(src));
  CHECK(cudaFree(sum));
  return wrong == 0 && got == want ? 0 : 1;
}
