// The kernel registry: every backend kernel says what it supports and how
// eager it is to run; a handler asks for the best candidate of a problem.
//
// Entries register themselves from their own translation unit (a static
// Register object), so adding a kernel never touches the handlers. The env
// var REGEMM_BACKEND=<name> forces a kernel by name wherever it applies.
//
// Two ways to choose: by rule (`select`: the forced or highest-priority entry
// that supports the problem, which then runs its own choice), or by timing
// (the CUDA runtime's tuner, ffi/cuda/tuner.cu): an entry may list the ways
// it can run a problem (`variants`: tile configurations, library algorithms,
// fused or split epilogues), and the tuner times them all, across entries.
#pragma once

#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace regemm {

namespace ffi = xla::ffi;

// Whether REGEMM_BACKEND names a kernel other than `name`. select() passes
// over a forced name that does not support a problem and takes the best of
// the rest; an entry that must stay out whenever another is forced (one that
// would run a backend the forcing keeps out, as the sanitizers' runs keep the
// TMA kernels out) declines in its supports() with this.
inline bool backend_forced_elsewhere(std::string_view name) {
  const char* forced = std::getenv("REGEMM_BACKEND");
  return forced && *forced && name != forced;
}

template <class Problem, class Operands, class Runtime>
struct Kernel {
  using Supports = bool (*)(const Problem&);
  using Run = ffi::Error (*)(const Problem&, const Operands&, Runtime&);
  // names[v] names way v of running the problem ("" where way v does not
  // apply to it); no names: not a candidate for timing. The indices must mean
  // the same on every call with the same problem and operand alignments.
  using Variants = void (*)(const Problem&, const Operands&, Runtime&, std::vector<std::string>* names);
  using RunVariant = ffi::Error (*)(const Problem&, const Operands&, Runtime&, int variant);
  // The way `run` takes for the problem, labelled as the tuner labels ways
  // ("entry/variant", any entry's); "" where it is none of them. Null: the
  // first way `variants` lists for the problem.
  using RuleWay = std::string (*)(const Problem&, const Operands&, Runtime&);
  std::string_view name;
  int priority;  // higher wins among those that support a problem
  Supports supports;  // a rule may pick it for the problem
  Run run;            // the entry's own choice among its ways
  Variants variants = nullptr;  // null: `run` is the only way (never timed)
  RunVariant run_variant = nullptr;
  RuleWay rule_way = nullptr;  // null: the first listed way
  // Whether `run` may write the output over an operand of the problem
  // (dgrad_dact: gZ over S, which the lowering then aliases, saving an M x N
  // buffer); null: never. A call in place runs `run` untimed: the tuner's
  // other ways may not (the composed way's GEMM would overwrite S first).
  Supports in_place = nullptr;
};

template <class Problem, class Operands, class Runtime>
class Registry {
 public:
  using Entry = Kernel<Problem, Operands, Runtime>;

  static Registry& get() {
    static Registry registry;
    return registry;
  }

  void add(const Entry& e) { entries_.push_back(e); }
  const std::vector<Entry>& entries() const { return entries_; }

  // Best supporting entry, or null. A forced name that does not support the
  // problem is passed over (so forcing a GEMM backend leaves other ops alone).
  const Entry* select(const Problem& p) const {
    const char* forced = std::getenv("REGEMM_BACKEND");
    const Entry* best = nullptr;
    for (const Entry& e : entries_) {
      if (!e.supports(p)) continue;
      if (forced && *forced && e.name == forced) return &e;
      if (!best || e.priority > best->priority) best = &e;
    }
    return best;
  }

  // The best entry that runs the problem in place, or null.
  const Entry* select_in_place(const Problem& p) const {
    const Entry* best = nullptr;
    for (const Entry& e : entries_)
      if (e.in_place && e.supports(p) && e.in_place(p) && (!best || e.priority > best->priority)) best = &e;
    return best;
  }

 private:
  std::vector<Entry> entries_;
};

template <class Problem, class Operands, class Runtime>
struct Register {
  explicit Register(const Kernel<Problem, Operands, Runtime>& e) {
    Registry<Problem, Operands, Runtime>::get().add(e);
  }
};

}  // namespace regemm
