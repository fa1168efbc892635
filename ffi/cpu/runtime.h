// What CPU kernels get at run time: XLA's intra-op thread pool, and a
// parallel_for over it in which the calling thread takes part (so a busy or
// absent pool only slows the work, never deadlocks it).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace regemm {

namespace ffi = xla::ffi;

// A helper woken onto the CPU its caller runs on waits there behind the caller,
// however idle the other cores are, until the scheduler rebalances: the two
// halves of a split GEMM then run one after the other. So a helper that starts
// on its caller's CPU moves itself off it for its work (its affinity restored
// after), and the caller yields once after handing out the work, so that such a
// helper gets to run and move. On the 2-vCPU VM a quarter of the helpers
// started on their caller's CPU; moving them took the f32 layers' backward
// (512^3 and 256x4096x1024, every activation) from 1.046-1.127x the plain
// program to 1.083-1.227x (benchmarks/results/cpu_helper_off_caller_cpu.md).
#if defined(__linux__)
inline int current_cpu() { return sched_getcpu(); }
inline void yield_cpu() { sched_yield(); }
class OffCpu {
 public:
  explicit OffCpu(int cpu) {
    if (cpu < 0 || sched_getcpu() != cpu || pthread_getaffinity_np(pthread_self(), sizeof saved_, &saved_) != 0) return;
    cpu_set_t away = saved_;
    CPU_CLR(cpu, &away);
    moved_ = CPU_COUNT(&away) > 0 && pthread_setaffinity_np(pthread_self(), sizeof away, &away) == 0;
  }
  ~OffCpu() {
    if (moved_) pthread_setaffinity_np(pthread_self(), sizeof saved_, &saved_);
  }
  OffCpu(const OffCpu&) = delete;
  OffCpu& operator=(const OffCpu&) = delete;

 private:
  cpu_set_t saved_;
  bool moved_ = false;
};
#else
inline int current_cpu() { return -1; }
inline void yield_cpu() {}
struct OffCpu {
  explicit OffCpu(int) {}
};
#endif

struct CpuRuntime {
  // The workspace result is empty on the CPU (kernels allocate on the host).
  CpuRuntime(ffi::AnyBuffer /*workspace*/, ffi::ThreadPool& p) : pool(&p) {}
  ffi::ThreadPool* pool;

  template <class B> static constexpr auto bind_ctx(B&& b) { return std::move(b).template Ctx<ffi::ThreadPool>(); }
  ffi::Error start() const { return ffi::Error::Success(); }

  // Runs the kernel the registry chose (one kernel per op here: nothing to time).
  template <class K, class P, class O> ffi::Error run(const K& kernel, const P& p, const O& o) {
    return kernel.run(p, o, *this);
  }

  // Threads a GEMM splits its output over: the pool's (one per core), or the
  // machine's cores where there is no pool.
  int64_t workers() const {
    const int64_t t = pool ? pool->num_threads() : 0;
    return t > 0 ? t : std::max<int64_t>(1, std::thread::hardware_concurrency());
  }

  // Threads parallel_for will use: the pool's and the caller's.
  int64_t threads() const { return pool && pool->num_threads() > 0 ? workers() + 1 : workers(); }

  // Runs fn(i) for i in [0, n), spread over the pool; returns when all are done.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) const {
    const int64_t pool_threads = pool ? pool->num_threads() : 0;
    if (pool_threads == 0 && n > 1) return spawn_for(n, fn);
    int64_t helpers = std::min<int64_t>(pool_threads, n - 1);
    if (helpers <= 0) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    struct State {
      std::atomic<int64_t> next{0}, done{0};
      int64_t n;
      const std::function<void(int64_t)>* fn;
      std::mutex mu;
      std::condition_variable cv;
      void work() {  // indices below n are always finished before the caller returns
        for (int64_t i; (i = next.fetch_add(1)) < n;) {
          (*fn)(i);
          if (done.fetch_add(1) + 1 == n) { std::lock_guard<std::mutex> l(mu); cv.notify_all(); }
        }
      }
    };
    auto st = std::make_shared<State>();
    st->n = n;
    st->fn = &fn;
    const int caller_cpu = current_cpu();
    for (int64_t h = 0; h < helpers; ++h)
      pool->Schedule([st, caller_cpu] {
        OffCpu off(caller_cpu);
        st->work();
      });
    yield_cpu();  // to a helper queued on this CPU, which then moves off it (OffCpu)
    st->work();
    std::unique_lock<std::mutex> l(st->mu);
    st->cv.wait(l, [&] { return st->done.load() == n; });
  }

  // Where XLA hands the handler no intra-op pool (it reports 0 threads), use
  // the machine's cores with short-lived threads: tasks here are large.
  static void spawn_for(int64_t n, const std::function<void(int64_t)>& fn) {
    const int64_t workers = std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()), n);
    std::atomic<int64_t> next{0};
    auto work = [&] { for (int64_t i; (i = next.fetch_add(1)) < n;) fn(i); };
    std::vector<std::thread> threads;
    for (int64_t t = 1; t < workers; ++t) threads.emplace_back(work);
    work();
    for (auto& t : threads) t.join();
  }
};

}  // namespace regemm
