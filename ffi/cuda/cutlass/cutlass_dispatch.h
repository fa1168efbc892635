// Choosing and launching a CUTLASS sm90 kernel for a GemmProblem, free of XLA
// (the registry entry in cutlass_registry.cu wraps it; a test harness can call
// it directly).
//
// A problem runs one of kNumChoices ways: a tile configuration, with a costly
// activation (gelu, gelu_erf, silu, sigmoid, tanh) fused into the epilogue or
// as a separate pass over Y. The registry's tuner (tuner.cu) times them
// beside the other entries' ways; without it, run() takes
//   REGEMM_CUTLASS_CONFIG=<name>  (coop128x256, ping128x128, streamk128x128, ping128x128c1)
//   and REGEMM_CUTLASS_SPLIT=0/1 where set (they also narrow the tuner's
//   choices to those), else a rule on the tile count (rule_config in
//   cutlass_dispatch.cu).
#pragma once

#include "cutlass_dgrad.h"
#include "cutlass_kernels.h"
#include "cuda/epilogue/epilogue_pass.h"

namespace regemm::cutlass_sm90 {

// The current device if it is compute capability 9.0 (sm_90a code runs there
// only), else null. Queried once per device.
const DeviceInfo* sm90_device();

// Whether the built kernels can run p (dtype, alignment of leading dims and
// batch strides, sizes), on an sm_90 device. Pointers are checked by can_launch.
bool can_run(const GemmProblem& p);

// Whether the buffers meet TMA's 16-byte base alignment.
bool can_launch(const GemmProblem& p, const GemmOperands& o);

// Runs p the forced or the rule's way. l.alloc's memory must stay valid for
// as long as the work it is used for may run (replays of a graph included).
Status run(const GemmProblem& p, const GemmOperands& o, const Launch& l);

// Choice c = 2 * config + split. Its name ("ping128x128", "coop128x256+pass"),
// or null where it does not apply to p: kernel not built, a split of a cheap
// activation, or excluded by REGEMM_CUTLASS_CONFIG / REGEMM_CUTLASS_SPLIT.
inline constexpr int kNumChoices = 2 * kNumConfigs;
const char* choice_name(const GemmProblem& p, int c);

// Runs p with choice c (an error where choice_name(p, c) is null).
Status run_choice(const GemmProblem& p, const GemmOperands& o, const Launch& l, int c);

// The name of the choice run() makes for p. For tests and benchmarks.
const char* rule_choice_name(const GemmProblem& p, const DeviceInfo& dev);

// regemm_dgrad_dact's GEMM with act' in its epilogue (cutlass_dgrad.h): whether
// it can run (p: the plain dgrad GEMM; d: the backward epilogue) and the run
// (the kernel of d's act slot). With gbias (d's bias kind per_col) the kernel
// sums the bias gradient too, where the workspace has room for its partial
// sums: *summed says whether it did (else the caller sums the stored gZ,
// cutlass_registry.cu).
bool can_run_dgrad_dact(const GemmProblem& p, const DactProblem& d);
bool can_launch_dgrad_dact(const DgradOperands& o);
Status run_dgrad_dact(const GemmProblem& p, const DactProblem& d, const DgradOperands& o, void* gbias,
                      const Launch& l, bool* summed);

}  // namespace regemm::cutlass_sm90
