// The FFI targets of the fused narrow MLP (narrow_mlp.cuh): regemm_narrow_mlp_v1, the forward,
// and regemm_narrow_mlp_bwd_v1, the backward. The operands are x [M, K0], every layer's weight
// ([K, N], or [N, K] where w_transposed) and every layer's bias ([N], or [0] where the layer
// has none); the backward also takes gy [M, N_out] and returns gx ([M, K0], or [0, 0] where not
// wanted), every gW (or [0, 0]) and every gb (or [0]). The last result is the workspace (the
// backward's partial sums; 0 bytes for the forward), as for every regemm target.
#include "cuda/narrow/narrow_ffi.h"

#include <string>

#include "cuda/narrow/narrow_launch.h"
#include "cuda/runtime.h"
#include "regemm/env.h"
#include "regemm/handlers.h"

namespace regemm::narrow {
namespace {

struct Shape {
  DType dtype;
  int64_t m;
  int k0, width, layers, n_out;
};

// The stack's dims, checked: every hidden layer `width` wide, the last at most 128.
ffi::Error stack_shape(const ffi::AnyBuffer& x, ffi::RemainingArgs args, int layers, bool w_transposed, Shape* s) {
  if (!to_dtype(x.element_type(), &s->dtype) || (s->dtype != DType::kBF16 && s->dtype != DType::kF16))
    return bad("narrow MLP: x must be bfloat16 or float16");
  auto xd = x.dimensions();
  if (xd.size() != 2) return bad("narrow MLP: x must be [M, K0], got " + shape_str(xd));
  if (layers < 2 || layers > kMaxLayers) return bad("narrow MLP: 2-" + std::to_string(kMaxLayers) + " layers");
  s->m = xd[0];
  s->k0 = int(xd[1]);
  s->layers = layers;
  int64_t k = xd[1];
  for (int l = 0; l < layers; ++l) {
    auto w = args.get<ffi::AnyBuffer>(l);
    auto b = args.get<ffi::AnyBuffer>(layers + l);
    if (!w.has_value() || !b.has_value()) return bad("narrow MLP: missing operands");
    DType t;
    auto wd = w->dimensions();
    if (!to_dtype(w->element_type(), &t) || t != s->dtype || wd.size() != 2)
      return bad("narrow MLP: weight " + std::to_string(l) + " must be 2-D of x's dtype");
    const int64_t wk = w_transposed ? wd[1] : wd[0], wn = w_transposed ? wd[0] : wd[1];
    if (wk != k) return bad("narrow MLP: weight " + std::to_string(l) + " " + shape_str(wd) + " does not fit");
    auto bd = b->dimensions();
    if (!to_dtype(b->element_type(), &t) || t != s->dtype || bd.size() != 1 || (bd[0] != 0 && bd[0] != wn))
      return bad("narrow MLP: bias " + std::to_string(l) + " must be [N] or [0] of x's dtype");
    if (l == 0) s->width = int(wn);
    if (l + 1 < layers && wn != s->width) return bad("narrow MLP: every hidden layer must have one width");
    k = wn;
  }
  s->n_out = int(k);
  if (!width_ok(s->width) || s->n_out < 1 || s->n_out > 128 || s->k0 < 1)
    return bad("narrow MLP: hidden width 16, 32, 64 or 128 and an output of 1-128 columns");
  return ffi::Error::Success();
}

void fill(const Shape& s, const void* x, ffi::RemainingArgs args, Act act, Act final_act, double slope,
          bool w_transposed, Params* p) {
  *p = Params{};
  p->m = s.m;
  p->layers = s.layers;
  p->w_transposed = w_transposed;
  p->act_hidden = act;
  p->act_out = final_act;
  p->slope = float(slope);
  p->x = x;
  for (int l = 0; l < s.layers; ++l) {
    auto w = args.get<ffi::AnyBuffer>(l);
    auto b = args.get<ffi::AnyBuffer>(s.layers + l);
    Layer& L = p->layer[l];
    L.w = w->untyped_data();
    L.b = b->element_count() ? b->untyped_data() : nullptr;
    L.k = l == 0 ? s.k0 : s.width;
    L.n = l + 1 < s.layers ? s.width : s.n_out;
  }
  plan_weights(p, 2);
}

ffi::Error parse_acts(std::string_view act, std::string_view final_act, Act* a, Act* f) {
  if (!parse_act(act, a) || !parse_act(final_act, f)) return bad("narrow MLP: unknown activation");
  return ffi::Error::Success();
}

template <class F> cudaError_t by_dtype(DType t, F&& f) {
  return t == DType::kBF16 ? f(__nv_bfloat16{}) : f(__half{});
}

ffi::Error forward(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   std::string_view act, std::string_view final_act, double slope, bool w_transposed) {
  Act a, f;
  if (auto e = parse_acts(act, final_act, &a, &f); e.failure()) return e;
  if (args.size() % 2 != 0) return bad("narrow MLP: a weight and a bias per layer");
  Shape s;
  if (auto e = stack_shape(x, args, int(args.size() / 2), w_transposed, &s); e.failure()) return e;
  auto y = rets.get<ffi::AnyBuffer>(0);
  if (!y.has_value()) return bad("narrow MLP: no result");
  Params p;
  fill(s, x.untyped_data(), args, a, f, slope, w_transposed, &p);
  p.y = (*y)->untyped_data();
  int limit = 0;
  REGEMM_CUDA_CHECK(max_smem(&limit));
  // On wgmma from 64 wide, where this build and the device have it (H100, kernel alone: 2^20 x
  // 128 x 4 351 -> 233 us, 2^18 x 64 41 -> 37; at 32 wide it lost, 63 -> 69; 16 level).
  if (s.width >= 64 && !env_off("REGEMM_NARROW_WGMMA")) {
    Params g = p;
    if (plan_weights(&g, 2, Layout::kCoreMatrices) <= limit) {
      const cudaError_t e = by_dtype(s.dtype, [&](auto t) { return launch_fwd_gmma<decltype(t)>(g, s.width, stream); });
      if (e != cudaErrorNoKernelImageForDevice) {
        REGEMM_CUDA_CHECK(e);
        return ffi::Error::Success();
      }
    }
  }
  if (p.weights_bytes > limit) return bad("narrow MLP: the weights do not fit in shared memory");
  REGEMM_CUDA_CHECK(by_dtype(s.dtype, [&](auto t) { return launch_fwd<decltype(t)>(p, s.width, stream); }));
  return ffi::Error::Success();
}

ffi::Error backward(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    std::string_view act, std::string_view final_act, double slope, bool w_transposed) {
  Act a, f;
  if (auto e = parse_acts(act, final_act, &a, &f); e.failure()) return e;
  if (args.size() % 2 != 1) return bad("narrow MLP backward: a weight and a bias per layer, then gy");
  const int layers = int(args.size() / 2);
  Shape s;
  if (auto e = stack_shape(x, args, layers, w_transposed, &s); e.failure()) return e;
  if (rets.size() != size_t(2 * layers + 2)) return bad("narrow MLP backward: gx, a gW and a gb per layer, the workspace");
  auto gy = args.get<ffi::AnyBuffer>(2 * layers);
  if (!gy.has_value() || gy->dimensions().size() != 2 || gy->dimensions()[0] != s.m || gy->dimensions()[1] != s.n_out)
    return bad("narrow MLP backward: gy must be [M, N_out]");
  Params p;
  fill(s, x.untyped_data(), args, a, f, slope, w_transposed, &p);
  BwdParams bp{};
  bp.gy = gy->untyped_data();
  auto ret = [&](int i) { return (*rets.get<ffi::AnyBuffer>(i)); };
  bp.gx = ret(0)->element_count() ? ret(0)->untyped_data() : nullptr;
  for (int l = 0; l < layers; ++l) {
    bp.gw[l] = ret(1 + l)->element_count() ? ret(1 + l)->untyped_data() : nullptr;
    bp.gb[l] = ret(1 + layers + l)->element_count() ? ret(1 + layers + l)->untyped_data() : nullptr;
  }
  int limit = 0;
  REGEMM_CUDA_CHECK(max_smem(&limit));
  auto ws = ret(2 * layers + 1);
  bp.partial = static_cast<float*>(ws->untyped_data());
  // The plan: on wgmma where its kernel takes the stack and this build and the device have it
  // (H200, kernel alone: 2^20 x 64 x 4 hidden 878 -> 521 us, 32 x 3 293 -> 228, 16 x 4 263 ->
  // 201), else on mma.sync.
  auto blocks = [&](const Params& q, BwdParams& b) {
    return by_dtype(s.dtype, [&](auto t) { return bwd_blocks<decltype(t)>(q, s.width, b, &b.blocks); });
  };
  Params q = p;
  BwdParams b = bp;
  bool planned = false;
  if (!env_off("REGEMM_NARROW_WGMMA")) {
    plan_weights(&q, 2, Layout::kCoreMatrices);
    const int smem = plan_bwd_gmma(q, s.width, &b);
    if (smem >= 0 && smem <= limit) {
      const cudaError_t e = blocks(q, b);
      if (e != cudaErrorNoKernelImageForDevice) {
        REGEMM_CUDA_CHECK(e);
        planned = true;
      }
    }
  }
  if (!planned) {
    q = p;
    b = bp;
    const int smem = plan_bwd(q, s.width, 2, &b);
    if (smem < 0 || smem > limit) return bad("narrow MLP backward: the kernel does not take this stack (width, depth or shared memory)");
    REGEMM_CUDA_CHECK(blocks(q, b));
  }
  if (int64_t(b.blocks) * (b.dw_floats + b.db_floats) * 4 > int64_t(ws->size_bytes()))
    return bad("narrow MLP backward: the workspace is smaller than the lowering said");
  REGEMM_CUDA_CHECK(by_dtype(s.dtype, [&](auto t) { return launch_bwd<decltype(t)>(q, s.width, b, stream); }));
  return ffi::Error::Success();
}

// The plan of a stack from its dims alone (null pointers): for the lowering's questions.
Params plan_of(int k0, int width, int layers, int n_out, Act act) {
  Params p{};
  p.layers = layers;
  p.act_hidden = act;
  for (int l = 0; l < layers; ++l) {
    p.layer[l].k = l == 0 ? k0 : width;
    p.layer[l].n = l + 1 < layers ? width : n_out;
  }
  plan_weights(&p, 2);
  return p;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(narrow_mlp_fwd_handler, forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .RemainingArgs()        // every weight, then every bias
                                  .RemainingRets()        // y, the workspace
                                  .Attr<std::string_view>("act")
                                  .Attr<std::string_view>("final_act")
                                  .Attr<double>("slope")
                                  .Attr<bool>("w_transposed"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(narrow_mlp_bwd_handler, backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .RemainingArgs()        // every weight, every bias, gy
                                  .RemainingRets()        // gx, every gW, every gb, the workspace
                                  .Attr<std::string_view>("act")
                                  .Attr<std::string_view>("final_act")
                                  .Attr<double>("slope")
                                  .Attr<bool>("w_transposed"),
                              {ffi::Traits::kCmdBufferCompatible});

void* forward_handler() { return reinterpret_cast<void*>(narrow_mlp_fwd_handler); }
void* backward_handler() { return reinterpret_cast<void*>(narrow_mlp_bwd_handler); }

int64_t smem_bytes(int k0, int width, int layers, int n_out, bool backward) {
  if (!width_ok(width) || layers < 2 || layers > kMaxLayers || n_out < 1 || n_out > 128 || k0 < 1) return -1;
  Params p = plan_of(k0, width, layers, n_out, Act::kNone);
  if (!backward) return p.weights_bytes;
  BwdParams bp{};
  return plan_bwd(p, width, 2, &bp);
}

int64_t smem_limit() {
  int limit = 0;
  return max_smem(&limit) == cudaSuccess ? limit : 0;
}

bool wgmma_here() {  // (a forward of no rows: it launches nothing, and says whether its kernel runs here)
  Params p = plan_of(16, 64, 2, 16, Act::kRelu);
  plan_weights(&p, 2, Layout::kCoreMatrices);
  return launch_fwd_gmma<__nv_bfloat16>(p, 64, nullptr) == cudaSuccess;
}

int64_t bwd_workspace_bytes(bool f16, int k0, int width, int layers, int n_out, std::string_view act) {
  Act a;
  if (!parse_act(act, &a) || smem_bytes(k0, width, layers, n_out, true) < 0) return -1;
  // The larger of the two kernels' partial sums (the handler takes either).
  auto bytes = [&](const Params& p, const BwdParams& bp) -> int64_t {
    int blocks = 0;
    const cudaError_t e = f16 ? bwd_max_blocks<__half>(p, width, bp, &blocks)
                              : bwd_max_blocks<__nv_bfloat16>(p, width, bp, &blocks);
    return e == cudaSuccess ? int64_t(blocks) * (bp.dw_floats + bp.db_floats) * 4 : -1;
  };
  Params p = plan_of(k0, width, layers, n_out, a);
  BwdParams bp{};
  if (plan_bwd(p, width, 2, &bp) > smem_limit()) return -1;
  const int64_t plain = bytes(p, bp);
  if (plain < 0) return -1;
  Params g = p;
  BwdParams gb{};
  plan_weights(&g, 2, Layout::kCoreMatrices);
  const int gsmem = plan_bwd_gmma(g, width, &gb);
  const int64_t on_gmma = gsmem >= 0 && gsmem <= smem_limit() ? bytes(g, gb) : -1;
  return on_gmma > plain ? on_gmma : plain;
}

}  // namespace regemm::narrow
