// A host timeline of handler calls, for measurement (benchmarks/host_timeline.py;
// the module's host_marks() reads it). While on, each call records when it
// reaches each phase, on steady_clock (CLOCK_MONOTONIC, which Python's
// time.monotonic_ns reads too), so that a program's host time splits into
// XLA's (before and between our calls) and ours (inside them, by phase).
// Off: one relaxed load per phase. No CUDA or XLA types: the kernels'
// dispatch files mark their launches too.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

namespace regemm {

enum class HostPhase : int {
  kBegin,     // the runtime is built: the arguments are decoded and checked
  kStarted,   // the capture query is done
  kSigned,    // the tuner has the problem's signature (GEMMs)
  kWayFound,  // the tuner has the way to run (GEMMs)
  kLaunch,    // the first launch (kernel or library call) begins
  kEnd,       // the work is queued
};
struct HostMarks {
  std::atomic<bool> on{false};
  std::mutex mu;
  std::vector<std::pair<int, int64_t>> marks;  // (phase, ns)
};
inline HostMarks g_host_marks;
inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
inline void host_mark(HostPhase phase) {
  if (!g_host_marks.on.load(std::memory_order_relaxed)) return;
  const int64_t ns = steady_ns();
  std::lock_guard<std::mutex> lock(g_host_marks.mu);
  g_host_marks.marks.emplace_back(int(phase), ns);
}

}  // namespace regemm
