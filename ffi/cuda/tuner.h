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

// Forgets the in-process winners (the disk cache, if any, stays).
void forget();

}  // namespace regemm::tuner
