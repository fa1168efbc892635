// Choosing and launching a CUTLASS sm90 kernel for a GemmProblem, free of XLA
// (the registry entry in cutlass_registry.cu wraps it; a test harness can call
// it directly).
//
// Configuration choice, in order:
//   REGEMM_CUTLASS_CONFIG=<name>  forces one (coop128x256, ping128x128, streamk128x128);
//   the autotuner (default on; REGEMM_CUTLASS_TUNE=0 turns it off): on first
//     sight of a problem signature it times every built configuration with CUDA
//     events on the call's stream and caches the winner for the process. It
//     never times inside a CUDA-graph capture, nor when C overlaps Y or Z (a
//     candidate's run would overwrite the next one's input). For the costly
//     activations (gelu, gelu_erf, silu, sigmoid, tanh) each configuration is
//     also timed with the activation as a separate pass over Y (REGEMM_CUTLASS_SPLIT=0/1
//     forces fused/split). It compares device time (the timed runs wait behind
//     a kernel that holds the stream until they are all queued) plus 4 us per
//     device operation beyond the kernel (a memset, a pass: one more enqueue
//     for the host). REGEMM_CUTLASS_TUNE_LOG=1 prints every candidate's time;
//   otherwise a rule on the tile count (rule_config in cutlass_dispatch.cu).
#pragma once

#include "cutlass_kernels.h"
#include "epilogue_pass.h"

namespace regemm::cutlass_sm90 {

// The current device if it is compute capability 9.0 (sm_90a code runs there
// only), else null. Queried once per device.
const DeviceInfo* sm90_device();

// Whether the built kernels can run p (dtype, alignment of leading dims and
// batch strides, sizes), on an sm_90 device. Pointers are checked by can_launch.
bool can_run(const GemmProblem& p);

// Whether the buffers meet TMA's 16-byte base alignment.
bool can_launch(const GemmProblem& p, const GemmOperands& o);

// Picks the configuration (forced, tuned or by rule) and launches it. Under
// CUDA-graph capture (l.capturing) it does not tune. l.alloc's memory must
// stay valid for as long as the work it is used for may run (replays of a
// graph included).
Status run(const GemmProblem& p, const GemmOperands& o, const Launch& l);

// The configuration run() would use now for p (forced, cached tuning result,
// or the rule), without tuning, and whether the activation runs as a separate
// pass (*split). For tests and benchmarks.
Config peek_config(const GemmProblem& p, const DeviceInfo& dev, bool* split = nullptr);

}  // namespace regemm::cutlass_sm90
