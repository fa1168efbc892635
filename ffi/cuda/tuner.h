// The GEMM tuner (tuner.cu): what it has chosen so far, for the module's test
// and measuring hooks (jax_regemm's _regemm_cuda.tuned(), ...).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace regemm::tuner {

// (problem signature, "entry/variant") of every problem seen in this process;
// "rule" where nothing was timed (one candidate, or none).
std::vector<std::pair<std::string, std::string>> winners();

// Problems timed so far in this process (a cache hit, in memory or on disk, times nothing).
int64_t timings();

// The tuner's holds of a stream (while it queues a round of timed runs) that
// ran to their limit instead of being released: work queued behind them waited
// for nothing. Read after the timing's synchronisation.
int64_t hold_timeouts();

// Forgets the in-process winners (the disk cache, if any, stays).
void forget();

}  // namespace regemm::tuner
