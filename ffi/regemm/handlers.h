// The FFI binding pattern, written once for every platform: decode the
// buffers and attributes, check them, build the problem, plan the batch, ask
// the registry for a kernel and run it. A platform only supplies a Runtime
// (what its kernels need at run time: a thread pool, or a stream and the
// workspace) and the context types XLA hands over to build it from.
//
// The chosen kernel runs through the Runtime (rt.run): the CPU's runs it, the
// CUDA runtime's may first time the registry's alternatives (its tuner).
//
// Every handler has one more result than the op: `workspace`, a byte buffer
// that the lowering sizes per platform (0 bytes on the CPU; the CUDA
// module's *_workspace_bytes functions say how much there). The Runtime is
// built from it and the context.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "batch.h"
#include "problem.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace regemm {

namespace ffi = xla::ffi;

template <class Runtime> using GemmRegistry = Registry<GemmProblem, GemmOperands, Runtime>;
template <class Runtime> using DactRegistry = Registry<DactProblem, DactOperands, Runtime>;
template <class Runtime> using DgradDactRegistry = Registry<DgradDactProblem, DgradDactOperands, Runtime>;

inline bool to_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::F64: *out = DType::kF64; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    default: return false;
  }
}

inline std::string shape_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline ffi::Error bad(const std::string& what) { return ffi::Error::InvalidArgument("regemm: " + what); }

template <class T> T* at(T* base, int64_t elements, DType t) {
  return base ? reinterpret_cast<T*>(reinterpret_cast<std::conditional_t<std::is_const_v<T>, const char, char>*>(base) +
                                     elements * dtype_size(t))
              : nullptr;
}

// Checks that `buf` has rank nb + trailing.size(), element type `dtype` and the
// given trailing dims.
inline ffi::Error check_operand(const char* name, const ffi::AnyBuffer& buf, int64_t nb, DType dtype,
                                std::initializer_list<int64_t> trailing) {
  auto dims = buf.dimensions();
  DType t;
  if (!to_dtype(buf.element_type(), &t) || t != dtype)
    return bad(std::string(name) + ": element type differs from A's or is unsupported");
  if (int64_t(dims.size()) != nb + int64_t(trailing.size()))
    return bad(std::string(name) + ": rank " + std::to_string(dims.size()) + ", expected " +
               std::to_string(nb + trailing.size()) + " (shape " + shape_str(dims) + ")");
  int64_t i = nb;
  for (int64_t want : trailing)
    if (dims[i++] != want)
      return bad(std::string(name) + ": shape " + shape_str(dims) + " does not fit the problem");
  return ffi::Error::Success();
}

// M, N, K of op(A) @ op(B) (p's dtype and transposes set) and the batch rank
// nb, with B checked against A.
inline ffi::Error gemm_dims(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, GemmProblem* p, int64_t* nb) {
  auto ad = a.dimensions(), bd = b.dimensions();
  *nb = int64_t(ad.size()) - 2;
  if (*nb < 0) return bad("A must have rank >= 2, got shape " + shape_str(ad));
  if (int64_t(bd.size()) != *nb + 2) return bad("A " + shape_str(ad) + " and B " + shape_str(bd) + " differ in rank");
  const int64_t i = *nb;
  p->m = p->trans_a ? ad[i + 1] : ad[i];
  p->k = p->trans_a ? ad[i] : ad[i + 1];
  const int64_t kb = p->trans_b ? bd[i + 1] : bd[i];
  p->n = p->trans_b ? bd[i] : bd[i + 1];
  if (kb != p->k) return bad("contraction sizes differ: A " + shape_str(ad) + ", B " + shape_str(bd));
  return check_operand("B", b, i, p->dtype, {bd[i], bd[i + 1]});
}

// ----------------------------------------------------------------------------
// regemm_fwd: Y (, Z) = act(alpha * op(A) @ op(B) + beta * C + bias)
// ----------------------------------------------------------------------------

template <class Runtime, class... Ctx>
ffi::Error gemm_handler(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer bias, ffi::AnyBuffer c,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> z,
                        ffi::Result<ffi::AnyBuffer> workspace, std::string_view act, double slope, double alpha, double beta, bool trans_a,
                        bool trans_b, std::string_view bias_kind, bool has_c, bool store_z,
                        bool exact_f32, Ctx... ctx) {
  GemmProblem p;
  if (!parse_act(act, &p.act)) return bad("unknown activation '" + std::string(act) + "'");
  if (!parse_bias_kind(bias_kind, &p.bias_kind)) return bad("unknown bias kind '" + std::string(bias_kind) + "'");
  if (!to_dtype(a.element_type(), &p.dtype)) return bad("A: unsupported element type");
  p.slope = slope; p.alpha = alpha; p.beta = beta; p.trans_a = trans_a; p.trans_b = trans_b;
  p.has_c = has_c; p.store_z = store_z; p.exact_f32 = exact_f32;

  auto ad = a.dimensions(), bd = b.dimensions();
  int64_t nb;
  if (auto e = gemm_dims(a, b, &p, &nb); e.failure()) return e;
  const int64_t len = bias_length(p.bias_kind, p.m, p.n);
  if (p.bias_kind != BiasKind::kNone)
    if (auto e = check_operand("bias", bias, nb, p.dtype, {len}); e.failure()) return e;
  if (has_c)
    if (auto e = check_operand("C", c, nb, p.dtype, {p.m, p.n}); e.failure()) return e;
  if (auto e = check_operand("Y", *y, nb, p.dtype, {p.m, p.n}); e.failure()) return e;
  if (store_z)
    if (auto e = check_operand("Z", *z, nb, p.dtype, {p.m, p.n}); e.failure()) return e;
  ffi::Span<const int64_t> batch_dims(y->dimensions().begin(), nb);

  auto plan = plan_batch(batch_dims, {{ad, p.m * p.k},
                                      {bd, p.k * p.n},
                                      {bias.dimensions(), p.bias_kind == BiasKind::kNone ? 0 : len},
                                      {c.dimensions(), has_c ? p.m * p.n : 0},
                                      {y->dimensions(), p.m * p.n},
                                      {z->dimensions(), store_z ? p.m * p.n : 0}});
  if (plan.has_error()) return plan.error();
  if (plan->count == 0 || p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.batch = plan->count;
  p.stride_a = plan->stride[0]; p.stride_b = plan->stride[1];
  p.stride_bias = plan->stride[2]; p.stride_c = plan->stride[3];

  // A batch that shares B (and a bias that does not vary along M), with A, C,
  // Y and Z dense, is one GEMM of batch * M rows: vmap over examples becomes
  // a single large GEMM instead of many small ones.
  if (p.batch > 1 && p.stride_b == 0 && !p.trans_a && p.stride_a == p.m * p.k &&
      (p.bias_kind == BiasKind::kNone || (p.bias_kind != BiasKind::kPerRow && p.stride_bias == 0)) &&
      (!p.has_c || p.stride_c == p.m * p.n)) {
    p.m *= p.batch;
    p.batch = 1;
  }

  const auto* kernel = GemmRegistry<Runtime>::get().select(p);
  if (!kernel) return bad("no kernel supports this problem (dtype, act or layout)");
  Runtime rt(*workspace, ctx...);
  if (auto e = rt.start(); e.failure()) return e;
  return plan->for_each_outer([&](const int64_t* off) {
    GemmOperands ops{at(a.untyped_data(), off[0], p.dtype),
                     at(b.untyped_data(), off[1], p.dtype),
                     p.bias_kind == BiasKind::kNone ? nullptr : at(bias.untyped_data(), off[2], p.dtype),
                     has_c ? at(c.untyped_data(), off[3], p.dtype) : nullptr,
                     at(y->untyped_data(), off[4], p.dtype),
                     store_z ? at(z->untyped_data(), off[5], p.dtype) : nullptr};
    return rt.run(*kernel, p, ops);
  });
}

template <class Runtime>
constexpr auto gemm_binding() {
  return Runtime::bind_ctx(ffi::Ffi::Bind()
                               .template Arg<ffi::AnyBuffer>()  // a
                               .template Arg<ffi::AnyBuffer>()  // b
                               .template Arg<ffi::AnyBuffer>()  // bias (size 0 when absent)
                               .template Arg<ffi::AnyBuffer>()  // c (size 0 when absent)
                               .template Ret<ffi::AnyBuffer>()  // y
                               .template Ret<ffi::AnyBuffer>()  // z (size 0 when not stored)
                               .template Ret<ffi::AnyBuffer>()  // workspace (bytes; see the top)
                               .template Attr<std::string_view>("act")
                               .template Attr<double>("slope")
                               .template Attr<double>("alpha")
                               .template Attr<double>("beta")
                               .template Attr<bool>("trans_a")
                               .template Attr<bool>("trans_b")
                               .template Attr<std::string_view>("bias_kind")
                               .template Attr<bool>("has_c")
                               .template Attr<bool>("store_z")
                               .template Attr<bool>("exact_f32"));
}

// ----------------------------------------------------------------------------
// regemm_dact: gZ = gY * act'(Z or Y), gBias = sum of gZ over the bias's broadcast axes
// ----------------------------------------------------------------------------

// The backward epilogue's attributes into d; then its operands checked against
// d (dtype, M and N set): S (Z or Y) and gZ [batch..., M, N], gBias [batch..., L].
inline ffi::Error dact_attrs(std::string_view act, double slope, bool from_y, std::string_view bias_kind,
                             DactProblem* d) {
  if (!parse_act(act, &d->act)) return bad("unknown activation '" + std::string(act) + "'");
  if (!parse_bias_kind(bias_kind, &d->bias_kind)) return bad("unknown bias kind '" + std::string(bias_kind) + "'");
  if (from_y && !grad_from_y_ok(d->act, slope)) return bad("act' cannot be derived from Y for '" + std::string(act) + "'");
  d->slope = slope;
  d->from_y = from_y;
  return ffi::Error::Success();
}

inline ffi::Error check_dact_operands(const DactProblem& d, int64_t nb, const ffi::AnyBuffer& s,
                                      const ffi::AnyBuffer& gz, const ffi::AnyBuffer& gbias) {
  if (auto e = check_operand("Z/Y", s, nb, d.dtype, {d.m, d.n}); e.failure()) return e;
  if (auto e = check_operand("gZ", gz, nb, d.dtype, {d.m, d.n}); e.failure()) return e;
  if (d.bias_kind == BiasKind::kNone) return ffi::Error::Success();
  return check_operand("gBias", gbias, nb, d.dtype, {bias_length(d.bias_kind, d.m, d.n)});
}

template <class Runtime, class... Ctx>
ffi::Error dact_handler(ffi::AnyBuffer gy, ffi::AnyBuffer s, ffi::Result<ffi::AnyBuffer> gz,
                        ffi::Result<ffi::AnyBuffer> gbias, ffi::Result<ffi::AnyBuffer> workspace,
                        std::string_view act, double slope,
                        bool from_y, std::string_view bias_kind, Ctx... ctx) {
  DactProblem p;
  if (auto e = dact_attrs(act, slope, from_y, bias_kind, &p); e.failure()) return e;
  if (!to_dtype(gy.element_type(), &p.dtype)) return bad("gY: unsupported element type");
  auto gd = gy.dimensions();
  const int64_t nb = int64_t(gd.size()) - 2;
  if (nb < 0) return bad("gY must have rank >= 2, got shape " + shape_str(gd));
  p.m = gd[nb]; p.n = gd[nb + 1];
  const int64_t len = bias_length(p.bias_kind, p.m, p.n);
  if (auto e = check_dact_operands(p, nb, s, *gz, *gbias); e.failure()) return e;
  ffi::Span<const int64_t> batch_dims(gz->dimensions().begin(), nb);
  auto plan = plan_batch(batch_dims, {{gd, p.m * p.n},
                                      {s.dimensions(), p.m * p.n},
                                      {gz->dimensions(), p.m * p.n},
                                      {gbias->dimensions(), len}});
  if (plan.has_error()) return plan.error();
  if (plan->count == 0 || (p.m * p.n == 0 && len == 0)) return ffi::Error::Success();
  p.batch = plan->count;
  p.stride_gy = plan->stride[0]; p.stride_s = plan->stride[1];

  const auto* kernel = DactRegistry<Runtime>::get().select(p);
  if (!kernel) return bad("no backward-epilogue kernel supports this problem");
  Runtime rt(*workspace, ctx...);
  if (auto e = rt.start(); e.failure()) return e;
  return plan->for_each_outer([&](const int64_t* off) {
    DactOperands ops{at(gy.untyped_data(), off[0], p.dtype), at(s.untyped_data(), off[1], p.dtype),
                     at(gz->untyped_data(), off[2], p.dtype),
                     p.bias_kind == BiasKind::kNone ? nullptr : at(gbias->untyped_data(), off[3], p.dtype)};
    return rt.run(*kernel, p, ops);
  });
}

template <class Runtime>
constexpr auto dact_binding() {
  return Runtime::bind_ctx(ffi::Ffi::Bind()
                               .template Arg<ffi::AnyBuffer>()  // gy
                               .template Arg<ffi::AnyBuffer>()  // z or y
                               .template Ret<ffi::AnyBuffer>()  // gz
                               .template Ret<ffi::AnyBuffer>()  // gbias (size 0 when no bias)
                               .template Ret<ffi::AnyBuffer>()  // workspace (bytes; see the top)
                               .template Attr<std::string_view>("act")
                               .template Attr<double>("slope")
                               .template Attr<bool>("from_y")
                               .template Attr<std::string_view>("bias_kind"));
}

// ----------------------------------------------------------------------------
// regemm_dgrad_dact: gZ = (alpha * op(A) @ op(B)) * act'(Z or Y), gBias from gZ
// ----------------------------------------------------------------------------
// A layer's dgrad GEMM with the backward epilogue of the layer below it, the
// step of jax_regemm.mlp's backward: one call where a layer-by-layer backward
// makes two (a GEMM writing gY, then the dact pass). A kernel of the
// DgradDactRegistry runs it whole where one supports it (the CUDA module's
// CUTLASS GEMM with the act' in its epilogue); otherwise `dgrad_then_dact`:
// the GEMM writes gZ's buffer and the dact kernel rewrites it in place (both
// kernels' loops allow gY == gZ), so nothing else is allocated. Where the
// lowering aliased gZ to S (dgrad_dact_in_place), the call runs the entry that
// can write gZ over S, untimed.

// The GEMM's operands with S in Z's place: S is what cuBLASLt's DGELU reads as
// its aux matrix, and the tuner keys a dgrad_dact winner by its alignment too.
inline GemmOperands gemm_operands_with_s(const DgradDactOperands& o) {
  return GemmOperands{o.a, o.b, nullptr, nullptr, o.gz, const_cast<void*>(o.s)};
}

// The composed way, for one outer batch entry.
template <class Runtime>
ffi::Error dgrad_then_dact(const DgradDactProblem& q, const DgradDactOperands& o, Runtime& rt) {
  const auto* gemm = GemmRegistry<Runtime>::get().select(q.gemm);
  if (!gemm) return bad("no kernel supports this problem (dtype, act or layout)");
  const auto* dact = DactRegistry<Runtime>::get().select(q.dact);
  if (!dact) return bad("no backward-epilogue kernel supports this problem");
  if (q.gemm.m * q.gemm.n > 0)
    if (auto e = rt.run(*gemm, q.gemm, GemmOperands{o.a, o.b, nullptr, nullptr, o.gz, nullptr}); e.failure()) return e;
  return rt.run(*dact, q.dact, DactOperands{o.gz, o.s, o.gz, o.gbias});
}

// The bias gradient of a way whose GEMM wrote gZ with act' applied already
// (cuBLASLt's DGELU matmul, the CUDA module's CUTLASS kernel): the dact kernel
// with act none over the stored gZ, a read-only pass.
template <class Runtime>
ffi::Error bias_grad_from_gz(const DgradDactProblem& q, const DgradDactOperands& o, Runtime& rt) {
  if (q.dact.bias_kind == BiasKind::kNone) return ffi::Error::Success();
  DactProblem bias_only = q.dact;
  bias_only.act = Act::kNone;
  const auto* dact = DactRegistry<Runtime>::get().select(bias_only);
  if (!dact) return bad("no backward-epilogue kernel supports this problem");
  return rt.run(*dact, bias_only, DactOperands{o.gz, o.gz, o.gz, o.gbias});
}

template <class Runtime, class... Ctx>
ffi::Error dgrad_dact_handler(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer s,
                              std::optional<ffi::AnyBuffer> /*after*/, ffi::Result<ffi::AnyBuffer> gz,
                              ffi::Result<ffi::AnyBuffer> gbias, ffi::Result<ffi::AnyBuffer> workspace,
                              std::string_view act, double slope, bool from_y, std::string_view bias_kind,
                              double alpha, bool trans_a, bool trans_b, bool exact_f32, Ctx... ctx) {
  GemmProblem p;
  DactProblem d;
  if (auto e = dact_attrs(act, slope, from_y, bias_kind, &d); e.failure()) return e;
  if (!to_dtype(a.element_type(), &p.dtype)) return bad("A: unsupported element type");
  p.alpha = alpha; p.trans_a = trans_a; p.trans_b = trans_b; p.exact_f32 = exact_f32;
  int64_t nb;
  if (auto e = gemm_dims(a, b, &p, &nb); e.failure()) return e;
  d.dtype = p.dtype; d.m = p.m; d.n = p.n;
  const int64_t len = bias_length(d.bias_kind, d.m, d.n);
  if (auto e = check_dact_operands(d, nb, s, *gz, *gbias); e.failure()) return e;
  ffi::Span<const int64_t> batch_dims(gz->dimensions().begin(), nb);
  auto plan = plan_batch(batch_dims, {{a.dimensions(), p.m * p.k},
                                      {b.dimensions(), p.k * p.n},
                                      {s.dimensions(), p.m * p.n},
                                      {gz->dimensions(), p.m * p.n},
                                      {gbias->dimensions(), len}});
  if (plan.has_error()) return plan.error();
  if (plan->count == 0 || (p.m * p.n == 0 && len == 0)) return ffi::Error::Success();
  p.batch = d.batch = plan->count;
  p.stride_a = plan->stride[0]; p.stride_b = plan->stride[1];
  d.stride_gy = p.m * p.n; d.stride_s = plan->stride[2];

  const DgradDactProblem q{p, d};
  const bool in_place = s.untyped_data() == gz->untyped_data();
  const auto& registry = DgradDactRegistry<Runtime>::get();
  const auto* fused = in_place ? registry.select_in_place(q) : registry.select(q);
  if (in_place && !fused)  // (XLA aliases equal shapes only: S's batch stride is gZ's)
    return bad("gZ aliases S, and no kernel runs this problem in place (the lowering asks dgrad_dact_in_place)");
  Runtime rt(*workspace, ctx...);
  if (auto e = rt.start(); e.failure()) return e;
  return plan->for_each_outer([&](const int64_t* off) {
    DgradDactOperands o{at(a.untyped_data(), off[0], p.dtype), at(b.untyped_data(), off[1], p.dtype),
                        at(s.untyped_data(), off[2], p.dtype), at(gz->untyped_data(), off[3], p.dtype),
                        d.bias_kind == BiasKind::kNone ? nullptr : at(gbias->untyped_data(), off[4], p.dtype)};
    if (in_place) return fused->run(q, o, rt);
    return fused ? rt.run(*fused, q, o) : dgrad_then_dact(q, o, rt);
  });
}

// Whether a dgrad_dact call of these dims runs with gZ over S, so that the
// lowering aliases them (jax_regemm/_ffi.py): A, B and S with gZ's batch, and
// an entry that runs the problem in place.
template <class Runtime>
bool dgrad_dact_in_place(DType t, int64_t m, int64_t n, int64_t k, int64_t batch, std::string_view act, double slope,
                         bool from_y, std::string_view bias_kind, bool trans_a, bool trans_b, bool exact_f32) {
  DgradDactProblem q;
  GemmProblem& p = q.gemm;
  DactProblem& d = q.dact;
  if (dact_attrs(act, slope, from_y, bias_kind, &d).failure()) return false;
  p.dtype = d.dtype = t;
  p.m = d.m = m; p.n = d.n = n; p.k = k;
  p.trans_a = trans_a; p.trans_b = trans_b; p.exact_f32 = exact_f32;
  p.batch = d.batch = batch;
  p.stride_a = m * k; p.stride_b = k * n;
  d.stride_gy = d.stride_s = m * n;
  return DgradDactRegistry<Runtime>::get().select_in_place(q) != nullptr;
}

template <class Runtime>
constexpr auto dgrad_dact_binding() {
  return Runtime::bind_ctx(ffi::Ffi::Bind()
                               .template Arg<ffi::AnyBuffer>()  // a
                               .template Arg<ffi::AnyBuffer>()  // b
                               .template Arg<ffi::AnyBuffer>()  // z or y of the layer below
                               // Never read: a value the call must follow (the other reader of
                               // an S that gZ is written over, jax_regemm/_ops.py).
                               .template OptionalArg<ffi::AnyBuffer>()
                               .template Ret<ffi::AnyBuffer>()  // gz
                               .template Ret<ffi::AnyBuffer>()  // gbias (size 0 when no bias)
                               .template Ret<ffi::AnyBuffer>()  // workspace (bytes; see the top)
                               .template Attr<std::string_view>("act")
                               .template Attr<double>("slope")
                               .template Attr<bool>("from_y")
                               .template Attr<std::string_view>("bias_kind")
                               .template Attr<double>("alpha")
                               .template Attr<bool>("trans_a")
                               .template Attr<bool>("trans_b")
                               .template Attr<bool>("exact_f32"));
}

}  // namespace regemm
