// The CUTLASS sm90 GEMM as an entry of the CUDA kernel registry. The choice
// of configuration and the launch are in cutlass_dispatch.cu; the kernels in
// their own translation units (build.cmake).
#include <cstdlib>
#include <string>

#include "regemm/env.h"
#include "regemm/handlers.h"
#include "cutlass_dispatch.h"
#include "cuda/runtime.h"

namespace regemm::cutlass_sm90 {
namespace {

constexpr const char* kName = "cutlass_sm90";
// Above the SIMT fallback: this kernel fuses the whole epilogue.
constexpr int kPriority = 100;

// Plain GEMMs (the backward's dgrad and wgrad) are cuBLAS's: H100, bf16,
// 16384x4096x4096 dgrad 701 vs 649 us, wgrad 739 vs 677 us; 65536x256x256
// wgrad (K = 65536) 102 vs 26 us (docs/performance.md).
bool supports(const GemmProblem& p) { return can_run(p) && !p.is_plain_gemm(); }

// The next-best other entry, for the rare call supports() could not foresee
// (a buffer not 16-byte aligned).
ffi::Error run_elsewhere(const GemmProblem& p, const GemmOperands& o, CudaRuntime& rt) {
  const GemmRegistry<CudaRuntime>::Entry* best = nullptr;
  for (const auto& e : GemmRegistry<CudaRuntime>::get().entries())
    if (e.name != kName && e.supports(p) && (!best || e.priority > best->priority)) best = &e;
  if (!best) return ffi::Error::InvalidArgument("regemm/cutlass: unaligned buffer and no other kernel for it");
  return best->run(p, o, rt);
}

// From the call's workspace (valid under CUDA-graph capture too); null when
// it has no room, and the dispatch then does without.
void* workspace_alloc(void* ctx, size_t bytes) { return static_cast<CudaRuntime*>(ctx)->take(bytes); }

Launch launch_for(CudaRuntime& rt, const DeviceInfo& dev) {
  Launch l;
  l.stream = rt.stream;
  l.dev = dev;
  l.enqueued = &rt.ops;
  l.alloc = workspace_alloc;
  l.alloc_ctx = &rt;
  return l;
}

ffi::Error to_ffi(const Status& st) {
  if (st.ok()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("regemm/cutlass: ") + st.stage + ": " + (st.detail ? st.detail : ""));
}

ffi::Error run_entry(const GemmProblem& p, const GemmOperands& o, CudaRuntime& rt) {
  const DeviceInfo* dev = sm90_device();
  if (!dev || !can_launch(p, o)) return run_elsewhere(p, o, rt);
  return to_ffi(run(p, o, launch_for(rt, *dev)));
}

// For the tuner: every choice (tile configuration x fused or split), plain
// GEMMs included (the rule leaves those to cuBLAS; the tuner may not).
void variants(const GemmProblem& p, const GemmOperands& o, CudaRuntime&, std::vector<std::string>* names) {
  if (!can_run(p) || !can_launch(p, o)) return;
  for (int c = 0; c < kNumChoices; ++c) {
    const char* n = choice_name(p, c);
    names->push_back(n ? n : "");
  }
}

ffi::Error run_variant(const GemmProblem& p, const GemmOperands& o, CudaRuntime& rt, int c) {
  const DeviceInfo* dev = sm90_device();
  if (!dev || !can_launch(p, o)) return ffi::Error::InvalidArgument("regemm/cutlass: cannot launch this problem");
  return to_ffi(run_choice(p, o, launch_for(rt, *dev), c));
}

// The choice run_entry's rule takes, as variants() names it.
std::string rule_way(const GemmProblem& p, const GemmOperands& o, CudaRuntime&) {
  const DeviceInfo* dev = sm90_device();
  if (!dev || !can_run(p) || !can_launch(p, o)) return "";
  return std::string(kName) + "/" + rule_choice_name(p, *dev);
}

const Register<GemmProblem, GemmOperands, CudaRuntime> kRegister(
    {kName, kPriority, supports, run_entry, variants, run_variant, rule_way});

// regemm_dgrad_dact with act' in the GEMM's epilogue and the bias gradient's
// column sums there too, added up by a small kernel after it
// (cutlass_dispatch.h; where the workspace has no room for the sums, the dact
// pass with act none sums the stored gZ instead, as after cuBLASLt's DGELU
// matmul, cublas_gemm.cu). A way the tuner times against cuBLAS's composed one
// (its dgrad GEMM, then the in-place dact pass) and DGELU ones: it wins where
// the act' pass is large against the GEMM (narrow layers, cheap act' forms)
// and ties or loses at 4096 wide, where CUTLASS's mainloop is behind cuBLAS's
// (docs/performance.md). REGEMM_FUSED_DGRAD=1 forces it; =0 keeps it out.
// Never where REGEMM_BACKEND forces another kernel (the sanitizers' runs keep
// TMA kernels out).
bool supports_dgrad_dact(const DgradDactProblem& q) {
  if (backend_forced_elsewhere(kName) || env_off("REGEMM_FUSED_DGRAD")) return false;
  return can_run_dgrad_dact(q.gemm, q.dact);
}

ffi::Error run_fused(const DgradDactProblem& q, const DgradDactOperands& o, CudaRuntime& rt) {
  const DeviceInfo* dev = sm90_device();
  const DgradOperands ok{o.a, o.b, o.s, o.gz};
  if (!dev || !can_launch_dgrad_dact(ok)) {  // a buffer not 16-byte aligned
    if (o.gz == o.s) return ffi::Error::InvalidArgument("regemm: dgrad_dact in place needs 16-byte aligned buffers");
    return dgrad_then_dact(q, o, rt);
  }
  bool summed = false;
  void* gbias = q.dact.bias_kind == BiasKind::kPerCol ? o.gbias : nullptr;
  if (q.gemm.m * q.gemm.n > 0)
    if (auto e = to_ffi(run_dgrad_dact(q.gemm, q.dact, ok, gbias, launch_for(rt, *dev), &summed)); e.failure())
      return e;
  return summed ? ffi::Error::Success() : bias_grad_from_gz(q, o, rt);
}

// The rule (untimed: REGEMM_TUNE=0, a call captured into a CUDA graph before
// its signature was timed; timed, the way the tuner keeps unless another is
// faster by more than its margin): the fused way up to K = kFusedRuleMaxK,
// the composed one past it. In training steps with every dgrad forced one way
// or the other (results/h100_train_dgrad_ab_f31d9e8.md) the fused way was as
// fast or faster wherever the two tied alone at K <= 2048 (32768x512x12 bf16
// silu, K = 512: 1.645 against 1.782 ms a step), and the composed one was the
// faster at K = 4096 (every 4096x4096x4 step, 2-5%).
constexpr int64_t kFusedRuleMaxK = 2048;

bool fused_by_rule(const DgradDactProblem& q) {
  return env_on("REGEMM_FUSED_DGRAD") || q.gemm.k <= kFusedRuleMaxK;
}

ffi::Error run_dgrad_dact_entry(const DgradDactProblem& q, const DgradDactOperands& o, CudaRuntime& rt) {
  return fused_by_rule(q) ? run_fused(q, o, rt) : dgrad_then_dact(q, o, rt);
}

void dgrad_dact_variants(const DgradDactProblem&, const DgradDactOperands&, CudaRuntime&,
                         std::vector<std::string>* names) {
  names->assign(1, "fused");
}

ffi::Error run_dgrad_dact_variant(const DgradDactProblem& q, const DgradDactOperands& o, CudaRuntime& rt, int) {
  return run_fused(q, o, rt);
}

// In place (gZ over S) where the rule runs the fused way: each CTA reads its
// tile of S into shared memory before it stores that tile of gZ, and no two
// CTAs share a tile. The composed and DGELU ways cannot: their GEMM writes gZ
// before S is read.
bool fused_in_place(const DgradDactProblem& q) { return fused_by_rule(q); }

std::string dgrad_dact_rule_way(const DgradDactProblem& q, const DgradDactOperands&, CudaRuntime&) {
  return fused_by_rule(q) ? std::string(kName) + "/fused" : kComposedDgradWay;
}

const Register<DgradDactProblem, DgradDactOperands, CudaRuntime> kRegisterDgradDact(
    {kName, kPriority, supports_dgrad_dact, run_dgrad_dact_entry, dgrad_dact_variants, run_dgrad_dact_variant,
     dgrad_dact_rule_way, fused_in_place});

}  // namespace
}  // namespace regemm::cutlass_sm90
