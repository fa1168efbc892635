// CPU GEMMs on oneDNN's matmul primitive, for f32, bf16 and f16 (where this
// CPU has a oneDNN path for the dtype): oneDNN picks the instruction set at run
// time (AVX2, AVX-512, AMX) and fuses the linear part of the epilogue:
//
//   Z = alpha * op(A) @ op(B) + bias + beta * C    (src scale, bias, sum post-op)
//   Y = act(Z)                                     (elementwise.h, in cache-sized chunks)
//
// The activation is ours, not a oneDNN eltwise post-op: oneDNN's relu turns
// NaN into 0 and its gelu loses the negative tail (SPEC §3 wants NaN out and
// relative accuracy), and one place defines the activations for every backend.
// Without store_z the matmul writes Z into Y's buffer and the pass is in place.
// Where there is a pass and M is large, each OpenMP thread runs the matmul of
// its own block of rows and then the pass over them (run_rows): the pass finds
// its rows in that core's cache and needs no second wake-up of the threads
// (after a matmul on the whole team, the pass ran at about one thread's speed:
// the other threads had gone to sleep).
// The sum post-op adds beta times what dst holds, so C is first copied into
// dst. Problems oneDNN cannot take (f64, an empty dimension, a dtype this CPU
// has no path for) go to the portable packed kernel (gemm.cc).
//
// Every primitive is built with a user scratchpad (oneDNN's own is not safe
// when XLA runs independent calls on several threads at once) and runs on
// oneDNN's OpenMP threads.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <dnnl.hpp>
#include <omp.h>

#include "../regemm/handlers.h"
#include "elementwise.h"
#include "runtime.h"

namespace regemm {
namespace {

using dnnl::memory;

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

memory::data_type dtype_of(DType t) {
  switch (t) {
    case DType::kF32: return memory::data_type::f32;
    case DType::kBF16: return memory::data_type::bf16;
    case DType::kF16: return memory::data_type::f16;
    default: return memory::data_type::undef;  // f64: oneDNN has no f64 matmul
  }
}

// Whether this CPU has oneDNN kernels for a dtype (bf16 and f16 need
// instruction-set support that oneDNN checks at run time): can it build a
// small matmul of it.
bool dtype_ok(DType t) {
  auto probe = [](DType t) {
    if (dtype_of(t) == memory::data_type::undef) return false;
    try {
      const memory::desc d({8, 8}, dtype_of(t), memory::format_tag::ab);
      dnnl::matmul::primitive_desc(engine(), d, d, d);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  };
  static const bool f32 = probe(DType::kF32), bf16 = probe(DType::kBF16), f16 = probe(DType::kF16);
  return t == DType::kF32 ? f32 : t == DType::kBF16 ? bf16 : t == DType::kF16 ? f16 : false;
}

// A oneDNN memory over a buffer XLA owns.
memory wrap(const memory::desc& d, const void* p) { return memory(d, engine(), const_cast<void*>(p)); }

// Whether a plan's operands with a batch dim of 1 get the dense batch stride
// (rows * cols) rather than the whole problem's: it is never stepped over, but
// oneDNN 3.2 takes its brgemm kernels for dense layouts only, and gemm:jit for a
// block of rows strided as the whole problem (run_rows). On the AVX512-BF16 EPYC
// brgemm is the faster for bf16 (one thread, 256x512x512: 0.59-0.62 ms against
// 0.68; 1024^3: 10.2 against 10.8; AMX kernels are brgemm's only) and gemm:jit
// for f32 (1.18 against 1.22-1.26), so f32 keeps the problem's strides.
bool dense_batch(const GemmProblem& p) { return p.dtype != DType::kF32; }

// A plan operand's batch stride: the dense one where `dense` and the batch dim is
// 1, else `whole` (the problem's).
int64_t batch_stride(bool dense, int64_t nb, int64_t rows, int64_t cols, int64_t whole) {
  return dense && nb == 1 ? rows * cols : whole;
}

// A [batch, rows, cols] operand stored row-major ([rows, cols]) or transposed
// ([cols, ld]: `rows` of its ld columns), problem b at b * stride (stride 0:
// shared, a batch dim of 1).
memory::desc operand(memory::data_type t, int64_t batch, int64_t stride, int64_t rows, int64_t cols, bool trans,
                     int64_t ld, bool dense) {
  const int64_t nb = stride == 0 ? 1 : batch;
  const int64_t bs = batch_stride(dense, nb, rows, cols, stride == 0 ? ld * cols : stride);
  return memory::desc({nb, rows, cols}, t, trans ? memory::dims{bs, 1, ld} : memory::dims{bs, cols, 1});
}

memory::desc bias_desc(const GemmProblem& p, int64_t rows, memory::data_type t, bool dense) {
  const int64_t nb = p.stride_bias == 0 ? 1 : p.batch;
  const int64_t brows = p.bias_kind == BiasKind::kPerRow ? rows : 1;
  const int64_t cols = p.bias_kind == BiasKind::kPerCol ? p.n : 1;
  const int64_t bs =
      batch_stride(dense, nb, brows, cols, p.stride_bias == 0 ? bias_length(p.bias_kind, p.m, p.n) : p.stride_bias);
  return memory::desc({nb, brows, cols}, t, memory::dims{bs, cols, 1});
}

struct Plan {
  memory::desc a, b, bias, d, scratchpad;
  dnnl::matmul matmul;
  bool sum_c = false;  // C copied into dst, added by the sum post-op
};

// The problem, and how many of its M rows the plan computes (all, or a block).
using Key =
    std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, double, bool, int64_t>;

// The plan of `rows` rows of problem p (from any row on: the caller offsets
// the pointers), strided as the whole problem.
std::unique_ptr<Plan> build(const GemmProblem& p, int64_t rows) {
  auto& e = engine();
  const memory::data_type t = dtype_of(p.dtype);
  auto plan = std::make_unique<Plan>();
  const bool dense = dense_batch(p);
  plan->a = operand(t, p.batch, p.stride_a, rows, p.k, p.trans_a, p.m, dense);
  plan->b = operand(t, p.batch, p.stride_b, p.k, p.n, p.trans_b, p.k, dense);
  plan->d = memory::desc({p.batch, rows, p.n}, t, memory::dims{batch_stride(dense, p.batch, rows, p.n, p.m * p.n), p.n, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (p.alpha != 1.0) attr.set_scales_mask(DNNL_ARG_SRC, 0);
  plan->sum_c = p.uses_c();
  if (plan->sum_c) {
    dnnl::post_ops ops;
    ops.append_sum(float(p.beta));
    attr.set_post_ops(ops);
  }
  dnnl::matmul::primitive_desc pd;
  if (p.bias_kind == BiasKind::kNone) {
    pd = dnnl::matmul::primitive_desc(e, plan->a, plan->b, plan->d, attr);
  } else {
    plan->bias = bias_desc(p, rows, t, dense);
    pd = dnnl::matmul::primitive_desc(e, plan->a, plan->b, plan->bias, plan->d, attr);
  }
  plan->matmul = dnnl::matmul(pd);
  plan->scratchpad = pd.scratchpad_desc();
  return plan;
}

// The plan of a problem's `rows` rows (all of them by default), built on
// first use: building one costs tens of microseconds, as much as a small GEMM.
// Null: oneDNN has no path for it. Bounded: a program sees few shapes.
const Plan* plan_of(const GemmProblem& p, int64_t rows = -1) {
  static std::mutex mu;
  static std::map<Key, std::unique_ptr<Plan>> plans;
  if (rows < 0) rows = p.m;
  const Key key{int(p.dtype), p.m, p.n, p.k, p.batch, p.stride_a, p.stride_b, p.stride_bias,
                int(p.bias_kind), p.trans_a * 2 + p.trans_b, p.has_c ? p.beta : 0.0, p.alpha != 1.0, rows};
  std::lock_guard<std::mutex> lock(mu);
  auto it = plans.find(key);
  if (it == plans.end()) {
    std::unique_ptr<Plan> plan;
    try {
      plan = build(p, rows);
    } catch (const dnnl::error&) {  // unimplemented for this problem: run_gemm falls back
    }
    if (plans.size() >= 512) plans.clear();
    it = plans.emplace(key, std::move(plan)).first;
  }
  return it->second.get();
}

// Problems this small run on the calling thread alone: waking oneDNN's OpenMP
// team (its threads wait passively, jax_regemm/_onednn.py) costs more than the
// GEMM (64x64x128 f32 relu forward+backward: 0.38x XLA's speed with the team, 0.87x
// alone; gelu 0.38x and 1.06x). 16-bit GEMMs run on AMX, several times faster per flop.
bool single_threaded(const GemmProblem& p) {
  const double flops = 2.0 * double(p.m) * double(p.n) * double(p.k) * double(p.batch);
  return flops < (p.dtype == DType::kF32 ? 4e6 : 16e6);
}

bool supports(const GemmProblem& p) { return p.k > 0 && p.m > 0 && p.n > 0 && dtype_ok(p.dtype); }

// The portable packed kernel (gemm.cc), for the problems oneDNN has no path for.
ffi::Error run_packed(const GemmProblem& p, const GemmOperands& o, CpuRuntime& rt) {
  for (const auto& e : GemmRegistry<CpuRuntime>::get().entries())
    if (e.name == "cpu_packed") return e.run(p, o, rt);
  return ffi::Error(ffi::ErrorCode::kInternal, "oneDNN has no path for this GEMM and cpu_packed is not registered");
}

// Runs `plan` over rows [r0, r0 + rows) of p into dst (Z's buffer, or Y's),
// C's rows copied into dst first where the sum post-op adds them. Throws
// dnnl::error.
void execute(const Plan& plan, const GemmProblem& p, const GemmOperands& o, void* dst, int64_t r0, int64_t rows) {
  const int64_t size = dtype_size(p.dtype), mn = p.m * p.n;
  char* d0 = static_cast<char*>(dst) + r0 * p.n * size;
  if (plan.sum_c)
    for (int64_t b = 0; b < p.batch; ++b)
      std::memcpy(d0 + b * mn * size, static_cast<const char*>(o.c) + (b * p.stride_c + r0 * p.n) * size,
                  rows * p.n * size);
  thread_local std::vector<char> scratch;
  scratch.resize(std::max(scratch.size(), plan.scratchpad.get_size()));
  float alpha = float(p.alpha);
  const char* a0 = static_cast<const char*>(o.a) + (p.trans_a ? r0 : r0 * p.k) * size;
  std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, wrap(plan.a, a0)},
                                          {DNNL_ARG_WEIGHTS, wrap(plan.b, o.b)},
                                          {DNNL_ARG_DST, wrap(plan.d, d0)},
                                          {DNNL_ARG_SCRATCHPAD, wrap(plan.scratchpad, scratch.data())}};
  if (p.alpha != 1.0)
    args.emplace(DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, wrap(memory::desc({1}, memory::data_type::f32, {1}), &alpha));
  if (p.bias_kind != BiasKind::kNone)
    args.emplace(DNNL_ARG_BIAS, wrap(plan.bias, static_cast<const char*>(o.bias) +
                                                    (p.bias_kind == BiasKind::kPerRow ? r0 * size : 0)));
  dnnl::stream s(engine());
  plan.matmul.execute(s, args);
  s.wait();
}

// Y = act(dst) over rows [r0, r0 + rows) of every problem of the batch.
void act_rows(const GemmProblem& p, const void* dst, void* y, int64_t r0, int64_t rows) {
  const int64_t mn = p.m * p.n;
  for (int64_t b = 0; b < p.batch; ++b)
    elementwise().act(p.dtype, p.act, p.slope, dst, y, b * mn + r0 * p.n, b * mn + (r0 + rows) * p.n);
}

// Blocks of at least this many rows keep oneDNN's one-thread matmuls as fast as
// the team's matmul of the whole (2 threads: 512^3 in blocks of 256 rows as
// fast; 256x1024x4096 in blocks of 128 rows 3-10% slower).
constexpr int64_t kMinBlockRows = 256;

// How many blocks of rows run_rows splits p into; 1: the matmul on the whole
// team, then the pass (no pass, too few rows, or a problem for one thread).
int row_blocks(const GemmProblem& p) {
  if (p.act == Act::kNone || single_threaded(p)) return 1;
  return int(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), p.m / kMinBlockRows)));
}

// One OpenMP thread per block of rows (blocks of h rows, the last of the rest):
// the block's matmul on that thread alone (plans `full` and `tail`), then the
// activation of its rows, still in that core's cache.
ffi::Error run_rows(const GemmProblem& p, const GemmOperands& o, int blocks, int64_t h, const Plan& full,
                    const Plan& tail) {
  const int64_t last = p.m - (blocks - 1) * h;
  void* dst = p.store_z ? o.z : o.y;
  std::mutex mu;
  std::string error;
#pragma omp parallel num_threads(blocks)
  {
    omp_set_num_threads(1);  // oneDNN's parallel regions inside this one: this thread alone
    for (int i = omp_get_thread_num(); i < blocks; i += omp_get_num_threads()) {
      const int64_t r0 = i * h, rows = i == blocks - 1 ? last : h;
      try {
        execute(i == blocks - 1 ? tail : full, p, o, dst, r0, rows);
        act_rows(p, dst, o.y, r0, rows);
      } catch (const dnnl::error& err) {
        std::lock_guard<std::mutex> lock(mu);
        error = err.what();
      }
    }
  }
  if (!error.empty()) return ffi::Error(ffi::ErrorCode::kInternal, "oneDNN: " + error);
  return ffi::Error::Success();
}

ffi::Error run_gemm(const GemmProblem& p, const GemmOperands& o, CpuRuntime& rt) {
  const Plan* plan = plan_of(p);
  if (!plan) return run_packed(p, o, rt);
  if (const int blocks = row_blocks(p); blocks > 1) {
    const int64_t h = (p.m + blocks - 1) / blocks;
    const Plan* full = plan_of(p, h);
    const Plan* tail = plan_of(p, p.m - (blocks - 1) * h);
    if (full && tail) return run_rows(p, o, blocks, h, *full, *tail);  // else the whole matmul, then the pass
  }
  const int64_t size = dtype_size(p.dtype), total = p.batch * p.m * p.n;
  void* dst = p.store_z ? o.z : o.y;
  const int team = omp_get_max_threads();  // a per-thread setting: restored below
  if (single_threaded(p)) omp_set_num_threads(1);
  try {
    execute(*plan, p, o, dst, 0, p.m);
  } catch (const dnnl::error& err) {
    omp_set_num_threads(team);
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("oneDNN: ") + err.what());
  }
  omp_set_num_threads(team);
  if (p.act == Act::kNone) {
    if (p.store_z) std::memcpy(o.y, o.z, total * size);
    return ffi::Error::Success();
  }
  const auto& kernels = elementwise();
  const int64_t chunk = 1 << 15, chunks = (total + chunk - 1) / chunk;
  rt.parallel_for(chunks, [&](int64_t c) {
    kernels.act(p.dtype, p.act, p.slope, dst, o.y, c * chunk, std::min(total, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

const Register<GemmProblem, GemmOperands, CpuRuntime> kRegister({"cpu_onednn", 1, supports, run_gemm});

}  // namespace
}  // namespace regemm
