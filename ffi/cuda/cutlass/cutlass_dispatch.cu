// See cutlass_dispatch.h.
#include "cutlass_dispatch.h"

#include <cuda_runtime.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "regemm/env.h"
#include "regemm/numeric.h"
#include "cuda/host_marks.h"
#include "cuda/pack.h"
#include "cuda/workspace.h"

namespace regemm::cutlass_sm90 {

// ---------------------------------------------------------------------------
// Device: queried once per device (attribute queries are cheap, but there is
// no reason to repeat them on every call).
// ---------------------------------------------------------------------------
namespace {
constexpr int kMaxDevices = 64;
struct DevState {
  std::once_flag once;
  bool sm90 = false;
  DeviceInfo info;
};
DevState g_dev[kMaxDevices];
}  // namespace

const DeviceInfo* sm90_device() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();  // clear, so that no later check trips over it
    return nullptr;
  }
  DevState& s = g_dev[dev];
  std::call_once(s.once, [&] {
    int major = 0, minor = 0, sms = 0;
    bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess;
    if (!ok) cudaGetLastError();
    s.sm90 = ok && major == 9 && minor == 0;
    s.info = DeviceInfo{dev, sms};
  });
  return s.sm90 ? &s.info : nullptr;
}

bool can_run(const GemmProblem& p) {
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16 && p.dtype != DType::kF32) return false;
  if (p.dtype == DType::kF32 && p.exact_f32) return false;  // TF32 only: HIGHEST goes elsewhere
  if (p.k == 0) return false;  // the mainloop would leave the accumulators unset
  const int64_t kIntMax = 0x7fffffff;
  if (p.m > kIntMax || p.n > kIntMax || p.k > kIntMax || p.batch > kIntMax) return false;
  // TMA: every row (leading dimension) and batch stride a multiple of 16 bytes.
  const int64_t e = dtype_size(p.dtype);
  auto aligned = [&](int64_t elems) { return (elems * e) % 16 == 0; };
  if (!aligned(p.lda()) || !aligned(p.ldb()) || !aligned(p.n)) return false;
  if (!aligned(p.stride_a) || !aligned(p.stride_b) || (p.has_c && !aligned(p.stride_c))) return false;
  if (env_off("REGEMM_USE_CUTLASS")) return false;
  if (!sm90_device()) return false;
  // At least one kernel of this dtype and layout was built.
  for (int c = 0; c < kNumConfigs; ++c)
    if (KernelTable::get().find(p.dtype, p.trans_a, p.trans_b, Config(c))) return true;
  return false;
}

bool can_launch(const GemmProblem& p, const GemmOperands& o) {
  return aligned16(o.a) && aligned16(o.b) && aligned16(o.y) && (!p.store_z || aligned16(o.z)) &&
         (!p.has_c || aligned16(o.c));
}

namespace {

// ---------------------------------------------------------------------------
// Launch with one configuration. A batch with a shared (stride-0) TMA operand
// runs as a loop of single GEMMs: a stride-0 mode in a TMA descriptor is not
// something we rely on (REGEMM_CUTLASS_TMA_STRIDE0=1 tries it, for testing).
// ---------------------------------------------------------------------------
Status launch(RunFn fn, const GemmProblem& p, const GemmOperands& o, const Launch& l) {
  const bool use_c = p.uses_c();
  const bool zero_stride = p.batch > 1 && (p.stride_a == 0 || p.stride_b == 0 || (use_c && p.stride_c == 0));
  const bool stride0_ok = env_on("REGEMM_CUTLASS_TMA_STRIDE0");
  host_mark(HostPhase::kLaunch);  // the kernel's own setup (CUTLASS arguments, TMA descriptors) and launch follow
  if (!zero_stride || stride0_ok) return fn(p, o, l);
  GemmProblem q = p;
  q.batch = 1;
  const int64_t e = dtype_size(p.dtype), mn = p.m * p.n;
  auto at = [e](const void* base, int64_t elems) -> const char* {
    return base ? static_cast<const char*>(base) + elems * e : nullptr;
  };
  for (int64_t b = 0; b < p.batch; ++b) {
    GemmOperands ob{at(o.a, b * p.stride_a), at(o.b, b * p.stride_b), at(o.bias, b * p.stride_bias),
                    at(o.c, b * p.stride_c), const_cast<char*>(at(o.y, b * mn)),
                    const_cast<char*>(at(o.z, b * mn))};
    if (Status st = fn(q, ob, l); !st.ok()) return st;
  }
  return {};
}

// ---------------------------------------------------------------------------
// Configuration choice.
// ---------------------------------------------------------------------------
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The rule (the registry's choice without timing, also under graph capture
// before the tuner has seen a problem): from the measured winners
// (docs/performance.md, device runs 1-2, with bias):
// - no more 128x128 tiles than SMs (2048x1024 outputs): stream-K, which spreads
//   K over the idle SMs (bf16 1.37x cuBLAS vs 1.73 ping-pong, 2.38 cooperative);
// - K <= 256 (65536x256x256): the 128x128 cooperative tile, i.e. the stream-K
//   kernel, which has nothing to split there (1.30 vs 1.52 ping, 1.56 coop);
// - f32 (TF32): ping-pong otherwise (the 128x256 TF32 tile gets 3 smem stages
//   of 32 K-elements and trails by 30-45%);
// - 16-bit, 1-4 waves of 128x128 tiles (4096x4096x1024), or K in [512, 2048]
//   (8192x1024x4096): ping-pong without a cluster, whose epilogue overlaps the
//   other warpgroup's MMAs (tools/tile_bench, session 9, cold, x cuBLAS at
//   4096x4096x1024: 1.10 vs 1.26 cooperative, 1.29 ping-pong 2x1). With K in
//   [512, 2048] and 4+ waves it beats the 2x1 cluster too (docs/performance.md,
//   session 12, forced, bf16 forward: 8192x1024x4096 and 16384x1024x1024, none,
//   leaky_relu, silu, gelu_erf: 0.97-1.59x as fast, none at 8192x1024x4096 the
//   one loss);
// - otherwise (long K and many tiles: 16384x4096x4096): cooperative 128x256.
Config rule_config(const GemmProblem& p, const DeviceInfo& dev, DType t, bool ta, bool tb) {
  const auto& table = KernelTable::get();
  const int64_t sms = dev.sm_count > 0 ? dev.sm_count : 132;
  // The f32 K-major x N-major kernel computes the transposed problem (cutlass_gemm.cuh).
  const bool swapped = t == DType::kF32 && !ta && !tb;
  const int64_t m = swapped ? p.n : p.m, n = swapped ? p.m : p.n;
  const int64_t t128 = ceil_div(m, 128) * ceil_div(n, 128) * p.batch;
  Config c = Config::kCoop128x256;
  if (t128 <= sms || p.k <= 256)
    c = Config::kStreamK128x128;
  else if (t == DType::kF32)
    c = Config::kPing128x128;
  else if (t128 < 4 * sms || (p.k >= 512 && p.k <= 2048))
    c = Config::kPing128x128c1;
  for (int i = 0; i < kNumConfigs && !table.find(t, ta, tb, c); ++i) c = Config(i);
  return c;
}

// -1 when REGEMM_CUTLASS_CONFIG is unset, else the config it names (-2: no such name).
int forced_config() {
  const char* v = std::getenv("REGEMM_CUTLASS_CONFIG");
  if (!v || !*v) return -1;
  for (int i = 0; i < kNumConfigs; ++i)
    if (std::strcmp(v, kConfigNames[i]) == 0) return i;
  return -2;
}

// How a problem runs: a tile configuration, and whether a costly activation
// is fused or a pass of its own after the GEMM (epilogue_pass.h).
struct Choice {
  Config config;
  bool split;
};

// Activations dear enough that a pass of their own may pay. Not the epilogue's
// out-of-line set (cutlass_epilogue.cuh), which keeps tanh, one MUFU op, inline:
// that one is about code size, this one about time.
bool costly_act(Act a) {
  return a == Act::kGelu || a == Act::kGeluErf || a == Act::kSilu || a == Act::kSigmoid || a == Act::kTanh;
}

// -1 when unset, else 0/1.
int forced_split() {
  const char* v = std::getenv("REGEMM_CUTLASS_SPLIT");
  if (!v || !*v) return -1;
  return env_off("REGEMM_CUTLASS_SPLIT") ? 0 : 1;
}

// The kernel for p in configuration c: one compiled for p's activation where
// built (cutlass_kernels.h, kOneActs; REGEMM_CUTLASS_ONE_ACT=0: never) and p
// has no C (those kernels are built without one: cutlass_epilogue.cuh), else
// the every-activation one. Null if c was not built for p's dtype and layout.
RunFn kernel_for(const GemmProblem& p, Config c) {
  const auto& table = KernelTable::get();
  RunFn any = table.find(p.dtype, p.trans_a, p.trans_b, c);
  if (KernelTable::act_slot(int(p.act)) == 0 || p.uses_c() || env_off("REGEMM_CUTLASS_ONE_ACT"))
    return any;
  RunFn own = table.find(p.dtype, p.trans_a, p.trans_b, c, p.act);
  if (own != any) g_one_act_launches.fetch_add(1, std::memory_order_relaxed);
  return own;
}

// One run of the GEMM with a choice: fused, or Z (bias and C included) into
// Y's place and then the activation as a pass over it, which also writes Z.
Status execute(Choice ch, const GemmProblem& p, const GemmOperands& o, const Launch& l) {
  if (!ch.split || !costly_act(p.act)) return launch(kernel_for(p, ch.config), p, o, l);
  GemmProblem q = p;
  q.act = Act::kNone;
  q.store_z = false;
  GemmOperands oq = o;
  oq.z = nullptr;
  if (Status st = launch(kernel_for(q, ch.config), q, oq, l); !st.ok()) return st;
  if (const char* err = epilogue_pass(p, o, /*with_bias_c=*/false, /*fast_math=*/true, l.stream))
    return {"activation pass launch", err};
  if (l.enqueued) ++*l.enqueued;
  return {};
}

Choice rule_choice(const GemmProblem& p, const DeviceInfo& dev) {
  const int fc = forced_config();
  const Config c = fc >= 0 && KernelTable::get().find(p.dtype, p.trans_a, p.trans_b, Config(fc))
                       ? Config(fc)
                       : rule_config(p, dev, p.dtype, p.trans_a, p.trans_b);
  return {c, forced_split() == 1 && costly_act(p.act)};
}

// B [K, N] -> Bt [N, K] (f32), one 32x32 tile per block through padded shared
// memory (coalesced reads and writes); blockIdx.z walks the batch.
__global__ void transpose_f32(const float* __restrict__ b, float* __restrict__ bt, int64_t k, int64_t n,
                              int64_t stride_b, int64_t stride_bt) {
  __shared__ float tile[32][33];
  b += blockIdx.z * stride_b;
  bt += blockIdx.z * stride_bt;
  const int64_t r0 = int64_t(blockIdx.y) * 32, c0 = int64_t(blockIdx.x) * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < k && c < n) tile[i][threadIdx.x] = b[r * n + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t r = c0 + i, c = r0 + threadIdx.x;  // row of Bt = column of B
    if (r < n && c < k) bt[r * k + c] = tile[threadIdx.x][i];
  }
}

// f32 x @ w (A K-major, B N-major): TF32 wgmma wants B K-major. With
// workspace at hand, transposing B costs one pass over it (K*N*8 bytes) and
// then the direct shared-memory kernel runs; without, the kernel for this
// layout computes Y^T = B^T A^T through CUTLASS's register-A path.
// REGEMM_CUTLASS_F32_BT=swap forces the latter.
bool f32_transpose_b(const GemmProblem& p) {
  if (p.dtype != DType::kF32 || p.trans_a || p.trans_b) return false;
  const char* v = std::getenv("REGEMM_CUTLASS_F32_BT");
  return !(v && std::strcmp(v, "swap") == 0) && KernelTable::get().find(DType::kF32, false, true, Config::kPing128x128);
}

// B^T for the kernel, as a Launch::before hook: enqueued by the first launch
// of the call, after its host setup (so the GPU does not wait for the host
// between the transpose and the GEMM), and not again for later launches.
struct TransposeB {
  const float* b;
  float* bt;
  int64_t k, n, stride_b, batch;
  int* enqueued;  // Launch::enqueued: the transpose is one more device operation
  bool done = false;
  static Status launch(void* ctx, cudaStream_t stream) {
    auto* t = static_cast<TransposeB*>(ctx);
    if (t->done) return {};
    const dim3 grid(unsigned(ceil_div(t->n, 32)), unsigned(ceil_div(t->k, 32)), unsigned(t->batch));
    transpose_f32<<<grid, dim3(32, 8), 0, stream>>>(t->b, t->bt, t->k, t->n, t->stride_b, t->k * t->n);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return {"transpose launch", cudaGetErrorString(e)};
    if (t->enqueued) ++*t->enqueued;
    t->done = true;
    return {};
  }
};

Status run_config(const GemmProblem& p, const GemmOperands& o, const Launch& l, Choice ch) {
  if (!KernelTable::get().find(p.dtype, p.trans_a, p.trans_b, ch.config))
    return {"dispatch", "no kernel built for this dtype and layout"};
  Status st = execute(ch, p, o, l);
  if (!st.ok() && ch.config == Config::kStreamK128x128 && std::strcmp(st.stage, "workspace") == 0) {
    // Stream-K's workspace did not fit (workspace.h bounds it): the small
    // problems stream-K wins go to ping-pong (second best there in run 1).
    if (KernelTable::get().find(p.dtype, p.trans_a, p.trans_b, Config::kPing128x128))
      return execute({Config::kPing128x128, ch.split}, p, o, l);
  }
  return st;
}

// l.alloc hands out the workspace from its start on every request (each
// launch may reuse it: runtime.h). With B^T at the start, the kernels' own
// requests are served from behind it.
struct AfterStart {
  Launch base;
  size_t skip;  // bytes held at the start (B^T's), rounded up to the alignment
};
void* alloc_after_start(void* ctx, size_t bytes) {
  const auto* a = static_cast<const AfterStart*>(ctx);
  char* p = static_cast<char*>(a->base.alloc(a->base.alloc_ctx, a->skip + bytes));
  return p ? p + a->skip : nullptr;
}

// The choice (null: the rule's) for p as the kernels see it: with B
// transposed first (f32 x @ w), the problem they run has trans_b set.
Status run_with(const GemmProblem& p, const GemmOperands& o, const Launch& l, const Choice* ch) {
  if (f32_transpose_b(p) && l.alloc) {
    const int64_t nb = p.batch > 1 && p.stride_b != 0 ? p.batch : 1;
    const size_t bt_bytes = size_t(p.k * p.n * nb) * sizeof(float);
    TransposeB t{static_cast<const float*>(o.b), static_cast<float*>(l.alloc(l.alloc_ctx, bt_bytes)), p.k, p.n,
                 p.stride_b, nb, l.enqueued};
    if (t.bt && ceil_div(p.k, 32) <= 65535 && nb <= 65535) {
      GemmProblem q = p;
      q.trans_b = true;
      q.stride_b = nb > 1 ? p.k * p.n : 0;
      GemmOperands ob = o;
      ob.b = t.bt;
      AfterStart after{l, (bt_bytes + 255) & ~size_t(255)};
      Launch lq = l;
      lq.alloc = alloc_after_start;
      lq.alloc_ctx = &after;
      lq.before = TransposeB::launch;
      lq.before_ctx = &t;
      return run_config(q, ob, lq, ch ? *ch : rule_choice(q, l.dev));
    }
  }
  return run_config(p, o, l, ch ? *ch : rule_choice(p, l.dev));
}

}  // namespace

Status run(const GemmProblem& p, const GemmOperands& o, const Launch& l) { return run_with(p, o, l, nullptr); }

const char* choice_name(const GemmProblem& p, int c) {
  static const std::array<std::string, kNumChoices> kNames = [] {  // kConfigNames, each also "+pass"
    std::array<std::string, kNumChoices> n;
    for (int i = 0; i < kNumChoices; ++i) n[i] = std::string(kConfigNames[i / 2]) + (i % 2 ? "+pass" : "");
    return n;
  }();
  if (c < 0 || c >= kNumChoices) return nullptr;
  const int config = c / 2, split = c % 2, fc = forced_config(), fs = forced_split();
  if (split && !costly_act(p.act)) return nullptr;
  if ((fc >= 0 && config != fc) || (fs >= 0 && split != fs)) return nullptr;
  const bool tb = p.trans_b || f32_transpose_b(p);
  if (!KernelTable::get().find(p.dtype, p.trans_a, tb, Config(config))) return nullptr;
  return kNames[c].c_str();
}

Status run_choice(const GemmProblem& p, const GemmOperands& o, const Launch& l, int c) {
  if (!choice_name(p, c)) return {"dispatch", "no such choice for this problem"};
  const Choice ch{Config(c / 2), c % 2 == 1};
  return run_with(p, o, l, &ch);
}

const char* rule_choice_name(const GemmProblem& p, const DeviceInfo& dev) {
  GemmProblem q = p;
  q.trans_b = p.trans_b || f32_transpose_b(p);
  const Choice ch = rule_choice(q, dev);
  const int c = int(ch.config) * 2 + (ch.split ? 1 : 0);
  return choice_name(p, c) ? choice_name(p, c) : kConfigNames[int(ch.config)];
}

// ---------------------------------------------------------------------------
// regemm_dgrad_dact
// ---------------------------------------------------------------------------

bool can_run_dgrad_dact(const GemmProblem& p, const DactProblem& d) {
  if (p.trans_a || !p.is_plain_gemm()) return false;
  if (d.bias_kind != BiasKind::kNone && d.bias_kind != BiasKind::kPerCol) return false;
  // Stride-0 operands of a batch: not as TMA descriptors (launch() above loops there).
  if (p.batch > 1 && (p.stride_a == 0 || p.stride_b == 0 || d.stride_s == 0)) return false;
  const int64_t e = dtype_size(p.dtype);
  if ((d.stride_s * e) % 16 != 0) return false;
  GemmProblem q = p;
  q.has_c = true;  // S is an [M, N] operand like C: the same checks (q is only checked, never run)
  q.stride_c = d.stride_s;
  if (!can_run(q)) return false;
  return DgradTable::get().find(p.dtype, p.trans_b, dgrad_act_slot(d.act, d.from_y)) != nullptr;
}

bool can_launch_dgrad_dact(const DgradOperands& o) {
  return aligned16(o.a) && aligned16(o.b) && aligned16(o.s) && aligned16(o.gz);
}

namespace {

// gbias[b][j] = sum over the rows r of partials[b][r][j], in a fixed order:
// thread (x, y) of a block (8 columns x 128 groups of rows) adds rows y,
// y + 128, ... of column x (8 loads in flight: at 32768 x 512 every thread
// has 8 rows, one round of loads), then a fixed tree adds the 128 groups.
// Narrow blocks put the sum of 512 columns on 64 SMs (32-column blocks used 16
// and took 4.7 us there, latency-bound). Deterministic: no atomics.
constexpr int kSumCols = 8, kSumGroups = 128;
template <class T>
__global__ void __launch_bounds__(kSumCols * kSumGroups)
    sum_partials_kernel(const float* __restrict__ partials, int64_t rows, int64_t n, int64_t ld, int64_t batch,
                        T* __restrict__ gbias) {
  __shared__ float red[kSumGroups][kSumCols];
  const int64_t j = int64_t(blockIdx.x) * kSumCols + threadIdx.x;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const float* part = partials + b * rows * ld;
    float acc = 0.0f;
    if (j < n)
#pragma unroll 8
      for (int64_t r = threadIdx.y; r < rows; r += kSumGroups) acc += part[r * ld + j];
    red[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
#pragma unroll
    for (int h = kSumGroups / 2; h > 0; h /= 2) {
      if (threadIdx.y < h) red[threadIdx.y][threadIdx.x] += red[threadIdx.y + h][threadIdx.x];
      __syncthreads();
    }
    if (threadIdx.y == 0 && j < n) gbias[b * n + j] = store<T>(red[0][threadIdx.x]);
    __syncthreads();  // red is reused by the next batch entry
  }
}

template <class T>
Status sum_partials(const float* partials, const GemmProblem& p, void* gbias, const Launch& l) {
  const dim3 grid(unsigned(ceil_div(p.n, kSumCols)), unsigned(p.batch < 65535 ? p.batch : 65535));
  sum_partials_kernel<<<grid, dim3(kSumCols, kSumGroups), 0, l.stream>>>(
      partials, dgrad_partials_rows(p.m), p.n, dgrad_partials_ld(p.n), p.batch, static_cast<T*>(gbias));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return {"bias gradient sum launch", cudaGetErrorString(e)};
  if (l.enqueued) ++*l.enqueued;
  return {};
}

}  // namespace

Status run_dgrad_dact(const GemmProblem& p, const DactProblem& d, const DgradOperands& o, void* gbias,
                      const Launch& l, bool* summed) {
  *summed = false;
  const DgradRunFn fn = DgradTable::get().find(p.dtype, p.trans_b, dgrad_act_slot(d.act, d.from_y));
  if (!fn) return {"dispatch", "no dgrad_dact kernel built for this dtype, layout and act"};
  // The partial sums at the workspace's start, the kernel's own requests behind
  // them; where they have no room (a workspace sized for the GEMM alone,
  // workspace.h) the kernel runs without them and the caller sums gZ.
  const size_t bytes = size_t(dgrad_partials_rows(p.m) * dgrad_partials_ld(p.n) * p.batch) * sizeof(float);
  DgradOperands ok = o;
  ok.partials = gbias && l.alloc ? static_cast<float*>(l.alloc(l.alloc_ctx, bytes)) : nullptr;
  Launch lk = l;
  AfterStart after{l, (bytes + kWorkspaceAlign - 1) & ~(kWorkspaceAlign - 1)};
  if (ok.partials) {
    lk.alloc = alloc_after_start;
    lk.alloc_ctx = &after;
  }
  host_mark(HostPhase::kLaunch);
  if (Status st = fn(p, d, ok, lk); !st.ok()) return st;
  g_dgrad_dact_launches.fetch_add(1, std::memory_order_relaxed);
  if (!ok.partials) return {};
  *summed = true;
  g_dgrad_bias_sums.fetch_add(1, std::memory_order_relaxed);
  switch (p.dtype) {
    case DType::kBF16: return sum_partials<bf16_t>(ok.partials, p, gbias, l);
    case DType::kF16: return sum_partials<f16_t>(ok.partials, p, gbias, l);
    default: return sum_partials<float>(ok.partials, p, gbias, l);
  }
}

}  // namespace regemm::cutlass_sm90
