// CPU GEMMs on oneDNN's matmul primitive, for f32, bf16 and f16 (where this
// CPU has a oneDNN path for the dtype): oneDNN picks the instruction set at run
// time (AVX2, AVX-512, AMX) and fuses the linear part of the epilogue:
//
//   Z = alpha * op(A) @ op(B) + bias + beta * C    (src scale, bias, sum post-op)
//   Y = act(Z)                                     (elementwise.h, in cache-sized chunks)
//
// The activation is ours, not a oneDNN eltwise post-op: oneDNN's relu turns
// NaN into 0 and its gelu loses the negative tail (docs/spec.md §3 wants NaN out and
// relative accuracy), and one place defines the activations for every backend.
// Without store_z the matmul writes Z into Y's buffer and the pass is in place.
//
// Threads: a problem's output splits into blocks (bands of rows; in f32 also
// columns), one task each on XLA's intra-op pool, where each runs its block's
// matmul on oneDNN alone and then the pass over that block while it is in
// that core's cache (run_blocks). One pool for everything: oneDNN's OpenMP
// team is a second set of threads, which competed with XLA's for the cores.
// oneDNN's team runs only what stays one block (grid_of): 16-bit problems whose
// blocks would not be dense (its AMX kernels take dense operands alone), or
// problems too narrow to split. Small problems run on the calling thread.
// The sum post-op adds beta times what dst holds, so C is first copied into
// dst. Problems oneDNN cannot take (f64, an empty dimension, a dtype this CPU
// has no path for) go to the portable packed kernel (gemm.cc).
//
// Every primitive is built with a user scratchpad (oneDNN's own is not safe
// when XLA runs independent calls on several threads at once).
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

#include "regemm/handlers.h"
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
// block of rows strided as the whole problem (run_blocks). On the AVX512-BF16 EPYC
// brgemm is the faster for bf16 (one thread, 256x512x512: 0.59-0.62 ms against
// 0.68; 1024^3: 10.2 against 10.8; AMX kernels are brgemm's only) and gemm:jit
// for f32 (1.18 against 1.22-1.26), so f32 keeps the problem's strides.
bool dense_batch(const GemmProblem& p) { return p.dtype != DType::kF32; }

// A plan operand's batch stride: the dense one where `dense` and the batch dim is
// 1, else `whole` (the problem's).
int64_t batch_stride(bool dense, int64_t nb, int64_t rows, int64_t cols, int64_t whole) {
  return dense && nb == 1 ? rows * cols : whole;
}

// A [batch, rows, cols] operand stored row-major ([rows, ld]) or transposed
// ([cols, ld]: `rows` of its ld columns), problem b at b * stride (stride 0:
// shared, a batch dim of 1).
memory::desc operand(memory::data_type t, int64_t batch, int64_t stride, int64_t rows, int64_t cols, bool trans,
                     int64_t ld, bool dense) {
  const int64_t nb = stride == 0 ? 1 : batch;
  const int64_t bs = batch_stride(dense, nb, rows, cols, stride == 0 ? ld * (trans ? cols : rows) : stride);
  return memory::desc({nb, rows, cols}, t, trans ? memory::dims{bs, 1, ld} : memory::dims{bs, ld, 1});
}

// The bias of a rows x cols block.
memory::desc bias_desc(const GemmProblem& p, int64_t rows, int64_t cols, memory::data_type t, bool dense) {
  const int64_t nb = p.stride_bias == 0 ? 1 : p.batch;
  const int64_t brows = p.bias_kind == BiasKind::kPerRow ? rows : 1;
  cols = p.bias_kind == BiasKind::kPerCol ? cols : 1;
  const int64_t bs =
      batch_stride(dense, nb, brows, cols, p.stride_bias == 0 ? bias_length(p.bias_kind, p.m, p.n) : p.stride_bias);
  return memory::desc({nb, brows, cols}, t, memory::dims{bs, cols, 1});
}

struct Plan {
  memory::desc a, b, bias, d, scratchpad;
  dnnl::matmul matmul;
  bool sum_c = false;    // C copied into dst, added by the sum post-op
  int bias_post = -1;    // the bias as this binary-add post-op (its index), else oneDNN's bias argument
};

// oneDNN on the calling thread alone while in scope (a per-thread OpenMP
// setting), for the matmuls that run as tasks of XLA's pool. Their plans are
// built under it too: oneDNN fixes a primitive's thread count when it is built.
struct OneThread {
  const int team = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(team); }
};

// The problem, and the shape of the block the plan computes.
using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, double, bool,
                       int64_t, int64_t>;

// The plan of a rows x cols block of problem p (anywhere in it: the caller
// offsets the pointers), strided as the whole problem.
std::unique_ptr<Plan> build(const GemmProblem& p, int64_t rows, int64_t cols) {
  auto& e = engine();
  const memory::data_type t = dtype_of(p.dtype);
  auto plan = std::make_unique<Plan>();
  const bool dense = dense_batch(p);
  plan->a = operand(t, p.batch, p.stride_a, rows, p.k, p.trans_a, p.lda(), dense);
  plan->b = operand(t, p.batch, p.stride_b, p.k, cols, p.trans_b, p.ldb(), dense);
  plan->d = memory::desc({p.batch, rows, cols}, t,
                         memory::dims{batch_stride(dense, p.batch, rows, cols, p.m * p.n), p.n, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (p.alpha != 1.0) attr.set_scales_mask(DNNL_ARG_SRC, 0);
  plan->sum_c = p.uses_c();
  dnnl::post_ops ops;
  if (plan->sum_c) ops.append_sum(float(p.beta));
  if (p.bias_kind != BiasKind::kNone) plan->bias = bias_desc(p, rows, cols, t, dense);
  // oneDNN's fast matmuls (gemm:jit, brgemm) take a bias per column only: a
  // per-row or scalar one ran its reference kernel, 500-1000x slower (a 264
  // MFLOP GEMM: 2.5 s in f32, 4.4 s in bf16). Those are a binary add instead.
  if (p.bias_kind == BiasKind::kPerRow || p.bias_kind == BiasKind::kScalar) {
    plan->bias_post = ops.len();
    ops.append_binary(dnnl::algorithm::binary_add, plan->bias);
  }
  if (ops.len() > 0) attr.set_post_ops(ops);
  dnnl::matmul::primitive_desc pd;
  if (p.bias_kind == BiasKind::kNone || plan->bias_post >= 0) {
    pd = dnnl::matmul::primitive_desc(e, plan->a, plan->b, plan->d, attr);
  } else {
    pd = dnnl::matmul::primitive_desc(e, plan->a, plan->b, plan->bias, plan->d, attr);
  }
  plan->matmul = dnnl::matmul(pd);
  plan->scratchpad = pd.scratchpad_desc();
  return plan;
}

// The plan of a rows x cols block of p, built on first use (under OneThread):
// building one costs tens of microseconds, as much as a small GEMM. Null:
// oneDNN has no path for it. Bounded: a program sees few shapes.
const Plan* plan_of(const GemmProblem& p, int64_t rows, int64_t cols) {
  static std::mutex mu;
  static std::map<Key, std::unique_ptr<Plan>> plans;
  const Key key{int(p.dtype), p.m, p.n, p.k, p.batch, p.stride_a, p.stride_b, p.stride_bias,
                int(p.bias_kind), p.trans_a * 2 + p.trans_b, p.has_c ? p.beta : 0.0, p.alpha != 1.0, rows, cols};
  std::lock_guard<std::mutex> lock(mu);
  auto it = plans.find(key);
  if (it == plans.end()) {
    std::unique_ptr<Plan> plan;
    try {
      plan = build(p, rows, cols);
    } catch (const dnnl::error&) {  // unimplemented for this problem: run_gemm falls back
    }
    if (plans.size() >= 512) plans.clear();
    it = plans.emplace(key, std::move(plan)).first;
  }
  return it->second.get();
}

// Problems this small run as one task, on the calling thread: waking other
// threads costs more than the GEMM (measured with oneDNN's team, 64x64x128 f32
// relu forward+backward: 0.38x XLA's speed on the team, 0.87x on one thread;
// gelu 0.38x and 1.06x). 16-bit GEMMs run on AMX, several times faster per flop.
double flops(const GemmProblem& p) { return 2.0 * double(p.m) * double(p.n) * double(p.k) * double(p.batch); }

bool one_task(const GemmProblem& p) { return flops(p) < (p.dtype == DType::kF32 ? 4e6 : 16e6); }

bool supports(const GemmProblem& p) { return p.k > 0 && p.m > 0 && p.n > 0 && dtype_ok(p.dtype); }

// The portable packed kernel (gemm.cc), for the problems oneDNN has no path for.
ffi::Error run_packed(const GemmProblem& p, const GemmOperands& o, CpuRuntime& rt) {
  for (const auto& e : GemmRegistry<CpuRuntime>::get().entries())
    if (e.name == "cpu_packed") return e.run(p, o, rt);
  return ffi::Error(ffi::ErrorCode::kInternal, "oneDNN has no path for this GEMM and cpu_packed is not registered");
}

// A block of the output: rows [r0, r0 + rows) and columns [c0, c0 + cols) of
// every problem of the batch.
struct Block {
  int64_t r0, rows, c0, cols;
};

// fn(b, offset, length) over a block's elements in problem b's [M, N] output:
// one range per problem where the block spans whole rows, else one per row.
template <class F> void for_ranges(const GemmProblem& p, const Block& blk, F fn) {
  const bool whole_rows = blk.cols == p.n;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t r = blk.r0; r < blk.r0 + blk.rows; r += whole_rows ? blk.rows : 1)
      fn(b, r * p.n + blk.c0, whole_rows ? blk.rows * p.n : blk.cols);
}

// Runs `plan` over block blk of p into dst (Z's buffer, or Y's), C's block
// copied into dst first where the sum post-op adds it. Throws dnnl::error.
void execute(const Plan& plan, const GemmProblem& p, const GemmOperands& o, void* dst, const Block& blk) {
  const int64_t size = dtype_size(p.dtype), mn = p.m * p.n;
  char* out = static_cast<char*>(dst);
  if (plan.sum_c)
    for_ranges(p, blk, [&](int64_t b, int64_t off, int64_t len) {
      std::memcpy(out + (b * mn + off) * size, static_cast<const char*>(o.c) + (b * p.stride_c + off) * size,
                  len * size);
    });
  thread_local std::vector<char> scratch;
  scratch.resize(std::max(scratch.size(), plan.scratchpad.get_size()));
  float alpha = float(p.alpha);
  const char* a0 = static_cast<const char*>(o.a) + (p.trans_a ? blk.r0 : blk.r0 * p.k) * size;
  const char* b0 = static_cast<const char*>(o.b) + (p.trans_b ? blk.c0 * p.k : blk.c0) * size;
  std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, wrap(plan.a, a0)},
                                          {DNNL_ARG_WEIGHTS, wrap(plan.b, b0)},
                                          {DNNL_ARG_DST, wrap(plan.d, out + (blk.r0 * p.n + blk.c0) * size)},
                                          {DNNL_ARG_SCRATCHPAD, wrap(plan.scratchpad, scratch.data())}};
  if (p.alpha != 1.0)
    args.emplace(DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, wrap(memory::desc({1}, memory::data_type::f32, {1}), &alpha));
  if (p.bias_kind != BiasKind::kNone) {
    const int64_t at = p.bias_kind == BiasKind::kPerRow ? blk.r0 : p.bias_kind == BiasKind::kPerCol ? blk.c0 : 0;
    args.emplace(plan.bias_post >= 0 ? DNNL_ARG_ATTR_MULTIPLE_POST_OP(plan.bias_post) | DNNL_ARG_SRC_1 : DNNL_ARG_BIAS,
                 wrap(plan.bias, static_cast<const char*>(o.bias) + at * size));
  }
  dnnl::stream s(engine());
  plan.matmul.execute(s, args);
  s.wait();
}

// Blocks at least this tall and wide keep oneDNN's one-thread matmuls as fast
// as its team's matmul of the whole (2 threads: 512^3 in blocks of 256 rows
// as fast; 256x1024x4096 in blocks of 128 rows 3-10% slower).
constexpr int64_t kMinBlock = 256;

// How the output splits into blocks, one task each on XLA's pool.
struct Grid {
  int64_t nr, nc, h, w;  // blocks down and across; a block's height and width (the last ones take the rest)
  bool team;             // one block, its matmul on oneDNN's own OpenMP team
  Block block(int64_t t, const GemmProblem& p) const {
    const int64_t i = t / nc, j = t % nc;
    return Block{i * h, i == nr - 1 ? p.m - i * h : h, j * w, j == nc - 1 ? p.n - j * w : w};
  }
};

// Bands of rows, as many as the pool has threads, then each band split into
// columns while threads are left; a problem that this leaves in one block
// splits at half the size (blocks of 128: 1024x256x4 f32 training steps 0.88-0.95
// of the plain program's speed with its 256x256 wgrad on oneDNN's team, 1.05-1.07
// with it split; 256x4096x1024 bf16 forwards 1.8-3.0 ms on the team, 1.9-2.2 in
// two bands). 16-bit blocks are bands of a non-transposed A only: oneDNN's AMX
// kernels take dense operands alone, and on a strided block it runs a kernel
// 2-4x slower. Every block carries at least 32 MFLOP (f32; 128 in 16-bit, on
// AMX): handing a task to another core costs about 0.1 ms on the VM (256x128x128
// f32 forward+backward in blocks of 4 MFLOP: 0.77 of the plain program's speed,
// 1.24 on the team). A problem left in one block runs on oneDNN's team, unless
// it is small.
Grid grid_of(const GemmProblem& p, const CpuRuntime& rt) {
  if (one_task(p)) return Grid{1, 1, p.m, p.n, false};
  const bool f32 = p.dtype == DType::kF32;
  const int64_t threads = std::min(rt.workers(), std::max<int64_t>(1, int64_t(flops(p) / (f32 ? 32e6 : 128e6))));
  int64_t nr = 1, nc = 1;
  for (const int64_t size : {kMinBlock, kMinBlock / 2}) {
    nr = f32 || !p.trans_a ? std::clamp<int64_t>(p.m / size, 1, threads) : 1;
    nc = f32 ? std::clamp<int64_t>(p.n / size, 1, std::max<int64_t>(1, threads / nr)) : 1;
    if (nr * nc > 1) break;
  }
  return Grid{nr, nc, (p.m + nr - 1) / nr, (p.n + nc - 1) / nc, nr * nc == 1};
}

// Y = act(dst) (or Z copied into Y) over a block, while it is in this core's cache.
void epilogue(const GemmProblem& p, const GemmOperands& o, const void* dst, const Block& blk) {
  const int64_t size = dtype_size(p.dtype), mn = p.m * p.n;
  if (p.act != Act::kNone) {
    for_ranges(p, blk, [&](int64_t b, int64_t off, int64_t len) {
      elementwise().act(p.dtype, p.act, p.slope, dst, o.y, b * mn + off, b * mn + off + len);
    });
  } else if (p.store_z) {
    for_ranges(p, blk, [&](int64_t b, int64_t off, int64_t len) {
      std::memcpy(static_cast<char*>(o.y) + (b * mn + off) * size,
                  static_cast<const char*>(dst) + (b * mn + off) * size, len * size);
    });
  }
}

// Each task runs its block's matmul on its own thread, then the block's
// epilogue. All of it on XLA's intra-op pool: oneDNN's OpenMP team is a second
// pool of threads, which competed with XLA's for the cores, and whose
// passive wake-ups are slow in a VM (2 cores: 512^3 f32 on the team 1.28 ms,
// one thread 1.38, two blocks on two threads 0.76).
ffi::Error run_blocks(const GemmProblem& p, const GemmOperands& o, CpuRuntime& rt, const Grid& g) {
  void* dst = p.store_z ? o.z : o.y;
  std::mutex mu;
  std::string error;
  rt.parallel_for(g.nr * g.nc, [&](int64_t t) {
    OneThread one;  // this task's thread: a pool thread, or the caller's
    const Block blk = g.block(t, p);
    try {
      execute(*plan_of(p, blk.rows, blk.cols), p, o, dst, blk);
    } catch (const dnnl::error& err) {
      std::lock_guard<std::mutex> lock(mu);
      error = err.what();
      return;
    }
    epilogue(p, o, dst, blk);
  });
  if (!error.empty()) return ffi::Error(ffi::ErrorCode::kInternal, "oneDNN: " + error);
  return ffi::Error::Success();
}

// The whole problem's matmul on oneDNN's team, then the epilogue over the pool.
ffi::Error run_team(const GemmProblem& p, const GemmOperands& o, CpuRuntime& rt, const Plan& plan) {
  void* dst = p.store_z ? o.z : o.y;
  try {
    execute(plan, p, o, dst, Block{0, p.m, 0, p.n});
  } catch (const dnnl::error& err) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("oneDNN: ") + err.what());
  }
  if (p.act == Act::kNone && !p.store_z) return ffi::Error::Success();
  const int64_t rows = std::max<int64_t>(1, (1 << 15) / p.n), chunks = (p.m + rows - 1) / rows;
  rt.parallel_for(chunks, [&](int64_t c) {
    epilogue(p, o, dst, Block{c * rows, std::min(rows, p.m - c * rows), 0, p.n});
  });
  return ffi::Error::Success();
}

ffi::Error run_gemm(const GemmProblem& p, const GemmOperands& o, CpuRuntime& rt) {
  const Grid g = grid_of(p, rt);
  if (!g.team) {
    OneThread one;
    bool ok = true;  // a plan for every block shape (the last band and column may differ)
    for (int64_t t : {int64_t(0), g.nc - 1, (g.nr - 1) * g.nc, g.nr * g.nc - 1}) {
      const Block blk = g.block(t, p);
      ok = ok && plan_of(p, blk.rows, blk.cols);
    }
    if (ok) return run_blocks(p, o, rt, g);
    if (one_task(p)) return run_packed(p, o, rt);  // no plan for the whole
  }
  // Built for the team's threads. Its key is taken by no one-thread plan: the
  // one block of a problem that is not small is always the team's.
  const Plan* plan = plan_of(p, p.m, p.n);
  if (!plan) return run_packed(p, o, rt);
  return run_team(p, o, rt, *plan);
}

const Register<GemmProblem, GemmOperands, CpuRuntime> kRegister({"cpu_onednn", 1, supports, run_gemm});

}  // namespace
}  // namespace regemm
