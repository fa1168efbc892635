// oneDNN plumbing for the CPU GEMM (onednn_gemm.cc): the engine, dtypes in
// oneDNN's terms, a cache of built primitives, and the hand-over to the
// portable kernel where oneDNN has no path.
//
// Every primitive is built with a user scratchpad (oneDNN's own is not safe
// when XLA runs independent calls on several threads at once) and runs on
// oneDNN's OpenMP threads.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include <dnnl.hpp>

#include "../regemm/handlers.h"
#include "runtime.h"

namespace regemm::onednn {

inline dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

inline dnnl::memory::data_type dtype_of(DType t) {
  using dt = dnnl::memory::data_type;
  switch (t) {
    case DType::kF32: return dt::f32;
    case DType::kBF16: return dt::bf16;
    case DType::kF16: return dt::f16;
    default: return dt::undef;  // f64: oneDNN has no f64 matmul
  }
}

// Whether this CPU has oneDNN kernels for a dtype (bf16 and f16 need
// instruction-set support that oneDNN checks at run time): can it build a
// small matmul of it.
inline bool dtype_ok(DType t) {
  auto probe = [](DType t) {
    if (dtype_of(t) == dnnl::memory::data_type::undef) return false;
    try {
      const dnnl::memory::desc d({8, 8}, dtype_of(t), dnnl::memory::format_tag::ab);
      dnnl::matmul::primitive_desc(engine(), d, d, d);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  };
  static const bool f32 = probe(DType::kF32), bf16 = probe(DType::kBF16), f16 = probe(DType::kF16);
  return t == DType::kF32 ? f32 : t == DType::kBF16 ? bf16 : t == DType::kF16 ? f16 : false;
}

// Built primitives by problem key, built on first use: building one costs
// tens of microseconds, as much as a small GEMM. A null plan records that
// oneDNN has no path for the problem. Bounded: a program sees few shapes.
template <class Key, class Plan>
class PlanCache {
 public:
  const Plan* get(const Key& key, const std::function<std::unique_ptr<Plan>()>& build) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      std::unique_ptr<Plan> plan;
      try {
        plan = build();
      } catch (const dnnl::error&) {  // unimplemented for this problem: the caller falls back
      }
      if (plans_.size() >= 512) plans_.clear();
      it = plans_.emplace(key, std::move(plan)).first;
    }
    return it->second.get();
  }

 private:
  std::mutex mu_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

// A oneDNN memory over a buffer XLA owns.
inline dnnl::memory wrap(const dnnl::memory::desc& d, const void* p) {
  return dnnl::memory(d, engine(), const_cast<void*>(p));
}

// Runs the portable kernel registered as `name` (where oneDNN has no path).
template <class Registry, class P, class O>
ffi::Error fallback(const Registry& registry, std::string_view name, const P& p, const O& o, CpuRuntime& rt) {
  for (const auto& e : registry.entries())
    if (e.name == name) return e.run(p, o, rt);
  return ffi::Error(ffi::ErrorCode::kInternal, "oneDNN has no path for this problem and '" + std::string(name) +
                                                   "' is not registered");
}

// fn(), with a oneDNN exception returned as an error.
template <class F> ffi::Error guarded(F&& fn) {
  try {
    fn();
  } catch (const dnnl::error& err) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("oneDNN: ") + err.what());
  }
  return ffi::Error::Success();
}

}  // namespace regemm::onednn
