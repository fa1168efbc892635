// The tuner: the registry's selection with autotuning, for GEMMs and for
// regemm_dgrad_dact (a GEMM with the backward epilogue of the layer below).
//
// On first sight of a problem signature, every way the registered kernels
// offer to run it (Kernel::variants: the CUTLASS tile configurations, fused
// or with a costly activation as a pass; cuBLASLt's first heuristic
// algorithms, with cuBLASLt's own epilogue or ours as a pass; the SIMT kernel
// on small problems; for dgrad_dact, cuBLASLt's DGELU matmul against the GEMM
// followed by the dact pass) is timed on the call's stream, and the fastest is kept
// for the process (and, with REGEMM_TUNE_CACHE, on disk) unless it is within
// a margin of the way the registry's rule takes (time_candidates). Later calls with
// that signature run the winner for the cost of one pass over the
// environment and one hash-map lookup of the problem's fields (Key).
//
// Timing: the median device time of `reps` runs, each after a read of a
// buffer twice the L2 cache (cold inputs, as in a program), all queued behind
// a kernel that holds the stream until the host has queued them (it polls a
// word of pinned host memory the host sets then; events around each run),
// plus kExtraOpUs for each device operation beyond the first (a memset, a
// second kernel): an uncaptured call costs the host about that much per
// launch, more than a small problem's kernel takes
// (results/h100_host_cost.md). The winner runs once more at the end, so the
// call's outputs are its.
//
// No timing (the registry's rule runs, and nothing is remembered) when
// REGEMM_TUNE=0, when the stream is being captured into a CUDA graph (nothing
// may synchronise there), or when C overlaps Y or Z (a timed run would change
// the next one's input).
//
// Environment: REGEMM_TUNE=0 turns it off; REGEMM_TUNE_LOG=1 prints every
// candidate's time; REGEMM_TUNE_REPS=<n> timed runs per candidate (default 3
// to 10, fewer for larger problems); REGEMM_TUNE_MARGIN=<percent> how much
// faster than the rule's way another must be to displace it (default 3; 0:
// the fastest); REGEMM_TUNE_CACHE=<file> keeps winners
// across processes (JSON, per device name and cuBLASLt version; written
// atomically, merged with what other processes wrote); REGEMM_BACKEND=<entry> restricts the
// candidates to that entry's ways; REGEMM_VARIANT=<entry/variant> (a label
// as REGEMM_TUNE_LOG prints it) runs that way wherever the problem has it,
// untimed. The signature includes the variables that change the candidate
// lists, so forcing one never reuses a winner found without it.
#include "tuner.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include <unistd.h>  // environ

#include "regemm/env.h"
#include "regemm/handlers.h"
#include "pack.h"
#include "runtime.h"

namespace regemm {
namespace {

using GemmEntry = Kernel<GemmProblem, GemmOperands, CudaRuntime>;
using DgradDactEntry = Kernel<DgradDactProblem, DgradDactOperands, CudaRuntime>;

// The variables that change the candidate lists or what a candidate runs: a
// winner found with one of them set is not reused without it, nor the other
// way round.
constexpr const char* kWayVars[] = {"REGEMM_BACKEND",         "REGEMM_VARIANT",         "REGEMM_USE_CUTLASS",
                                    "REGEMM_CUTLASS_CONFIG",  "REGEMM_CUTLASS_SPLIT",   "REGEMM_CUTLASS_F32_BT",
                                    "REGEMM_CUTLASS_TMA_STRIDE0", "REGEMM_CUTLASS_ONE_ACT", "REGEMM_FUSED_DGRAD",
                                    "REGEMM_TUNE_MARGIN"};

// Those of kWayVars that are set and not empty, as " NAME=value" in kWayVars'
// order, from one pass over the environment. They are read on every call
// (env.h), and a getenv per variable would scan the whole environment each
// time (the H100 machine has 89 variables: ~0.15-0.2 us per getenv). With the
// string signature built on every call, the lookup cost 2.5-13 us of host
// time per call; with this key 1.0-4.6 (results/h100_host_cost.md).
std::string way_vars() {
  constexpr int kN = int(sizeof kWayVars / sizeof kWayVars[0]);
  const char* value[kN] = {};
  for (char** e = environ; e && *e; ++e) {
    if (std::strncmp(*e, "REGEMM_", 7) != 0) continue;
    for (int i = 0; i < kN; ++i) {
      const size_t n = std::strlen(kWayVars[i]);
      if (!value[i] && std::strncmp(*e, kWayVars[i], n) == 0 && (*e)[n] == '=') value[i] = *e + n + 1;  // as getenv: the first
    }
  }
  std::string s;
  for (int i = 0; i < kN; ++i)
    if (value[i] && *value[i]) s.append(" ").append(kWayVars[i]).append("=").append(value[i]);
  return s;
}

// Everything a winner may depend on: the device, the problem, whether the
// batch shares operands (a loop of GEMMs or one batched call), the buffers'
// alignment (pack.h: up to 16 bytes, so that a winner carries over from
// rg.autotune's program to the captured one), and the variables that change
// the candidates. Compared field by field on every call; spelled out as a
// string (signature()) only for a problem seen the first time.
struct Key {
  int device;
  DType dtype;
  bool ta, tb;
  int64_t m, n, k, batch;
  Act act;
  BiasKind bias;
  bool use_c, z, exact;
  uint32_t align;
  uint32_t shared;  // batch > 1: which of A, B, bias, C have batch stride 0 (bits 3..0)
  int dact = 0;      // dgrad_dact: dact_code() of its backward epilogue; 0 for a GEMM
  std::string vars;  // way_vars(): usually empty
  auto tie() const {
    return std::tie(device, dtype, ta, tb, m, n, k, batch, act, bias, use_c, z, exact, align, shared, dact, vars);
  }
  bool operator==(const Key& o) const { return tie() == o.tie(); }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = std::hash<std::string>()(k.vars);
    for (int64_t v : {int64_t(k.device), int64_t(k.dtype), int64_t(k.ta), int64_t(k.tb), k.m, k.n, k.k, k.batch,
                      int64_t(k.act), int64_t(k.bias), int64_t(k.use_c), int64_t(k.z), int64_t(k.exact),
                      int64_t(k.align), int64_t(k.shared), int64_t(k.dact)})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

Key key_of(int device, const GemmProblem& p, const GemmOperands& o) {
  const bool use_c = p.uses_c();
  uint32_t al = std::min({alignment(o.a), alignment(o.b), alignment(o.y), alignment(o.z)});
  if (use_c) al = std::min(al, alignment(o.c));
  if (o.bias) al = std::min(al, alignment(o.bias));
  const uint32_t shared = p.batch > 1 ? (uint32_t(p.stride_a == 0) << 3 | uint32_t(p.stride_b == 0) << 2 |
                                         uint32_t(p.stride_bias == 0) << 1 | uint32_t(p.stride_c == 0))
                                      : 0;
  return Key{device, p.dtype, p.trans_a, p.trans_b, p.m, p.n, p.k, p.batch, p.act, p.bias_kind,
             use_c, p.store_z, p.exact_f32, al, shared, 0, way_vars()};
}

// dgrad_dact's key: its GEMM's (S in Z's place, for its alignment) and its
// backward epilogue (act, S = Y or Z, bias kind) as Key::dact.
int dact_code(const DactProblem& d) { return 1 + (int(d.act) * 2 + int(d.from_y)) * 4 + int(d.bias_kind); }
Key key_of(int device, const DgradDactProblem& q, const DgradDactOperands& o) {
  Key key = key_of(device, q.gemm, gemm_operands_with_s(o));
  key.dact = dact_code(q.dact);
  return key;
}

// The key as the tuning log, the disk cache and rg.tuned() name it.
std::string signature(const Key& k) {
  char buf[320];
  std::snprintf(buf, sizeof buf, "%s %c%c m=%lld n=%lld k=%lld batch=%lld act=%s bias=%s c=%d z=%d exact=%d align=%u",
                kDTypeNames[int(k.dtype)].data(), k.ta ? 't' : 'n', k.tb ? 't' : 'n', (long long)k.m,
                (long long)k.n, (long long)k.k, (long long)k.batch, kActNames[int(k.act)].data(),
                kBiasKindNames[int(k.bias)].data(), int(k.use_c), int(k.z), int(k.exact), k.align);
  std::string s = buf;
  if (k.dact) {
    const int c = k.dact - 1;
    std::snprintf(buf, sizeof buf, " dact=%s from_%s gbias=%s", kActNames[c / 8].data(), c / 4 % 2 ? "y" : "z",
                  kBiasKindNames[c % 4].data());
    s += buf;
  }
  if (k.batch > 1) {
    std::snprintf(buf, sizeof buf, " shared=%d%d%d%d", int(k.shared >> 3 & 1), int(k.shared >> 2 & 1),
                  int(k.shared >> 1 & 1), int(k.shared & 1));
    s += buf;
  }
  return s + k.vars;
}

// A way to run a problem: an entry's variant, or the registry's rule. The
// entry is a Kernel<P, O, CudaRuntime> of the problem type the Key says
// (Key::dact: dgrad_dact, else a GEMM).
struct Candidate {
  const void* entry = nullptr;  // null: the registry's rule
  int variant = -1;
  std::string label = "rule";  // "entry/variant"
};

template <class P, class O>
const Kernel<P, O, CudaRuntime>& entry_of(const Candidate& c) {
  return *static_cast<const Kernel<P, O, CudaRuntime>*>(c.entry);
}

// The GEMM whose size sets how often a candidate is timed.
const GemmProblem& gemm_of(const GemmProblem& p) { return p; }
const GemmProblem& gemm_of(const DgradDactProblem& q) { return q.gemm; }

// Every way to run p, from every entry that offers ways (or only from the one
// REGEMM_BACKEND names).
template <class P, class O>
std::vector<Candidate> candidates(const P& p, const O& o, CudaRuntime& rt) {
  const char* forced = std::getenv("REGEMM_BACKEND");
  const bool restrict = forced && *forced;
  std::vector<Candidate> out;
  std::vector<std::string> names;
  for (const auto& e : Registry<P, O, CudaRuntime>::get().entries()) {
    if (!e.variants || !e.run_variant || (restrict && e.name != forced)) continue;
    names.clear();
    e.variants(p, o, rt, &names);
    for (int v = 0; v < int(names.size()); ++v)
      if (!names[v].empty()) out.push_back({&e, v, std::string(e.name) + "/" + names[v]});
  }
  return out;
}

// ---------------------------------------------------------------------------
// In-process winners, and the optional disk cache.
// ---------------------------------------------------------------------------
std::mutex g_mu;
struct Winner {
  Candidate way;
  std::string name;  // "<device> <signature>"
};
std::unordered_map<Key, Winner, KeyHash> g_winners;
int64_t g_timings = 0;

struct DiskCache {
  std::string path;  // the file loaded (REGEMM_TUNE_CACHE may change between calls)
  std::map<std::string, std::string> entries;  // "<device name>|cublasLt <v>|<signature>" -> label
};
DiskCache g_disk;  // under g_mu

// The file's "entries" object: one "key": "value" pair per line, as save() writes
// it. Keys and values never hold quotes or backslashes (signatures and labels).
std::map<std::string, std::string> parse_cache(const std::string& text) {
  std::map<std::string, std::string> out;
  const size_t start = text.find("\"entries\"");
  if (start == std::string::npos) return out;
  std::istringstream lines(text.substr(start));
  std::string line;
  std::getline(lines, line);  // "entries": {
  while (std::getline(lines, line)) {
    size_t q[4], at = 0;
    bool ok = true;
    for (size_t& x : q) {
      x = line.find('"', at);
      if (x == std::string::npos) { ok = false; break; }
      at = x + 1;
    }
    if (!ok) break;  // the closing brace
    out[line.substr(q[0] + 1, q[1] - q[0] - 1)] = line.substr(q[2] + 1, q[3] - q[2] - 1);
  }
  return out;
}

std::map<std::string, std::string> read_cache(const std::string& path) {
  std::ifstream f(path);
  if (!f) return {};
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_cache(ss.str());
}

// Merges `more` into the file (re-read first: another process may have added
// to it) and writes it whole to a temporary that replaces it, so that a
// reader never sees half a file. Failures only cost the cache: a warning.
void save_cache(const std::string& path, const std::map<std::string, std::string>& more) {
  std::map<std::string, std::string> all = read_cache(path);
  for (const auto& kv : more) all[kv.first] = kv.second;
  const std::string tmp = path + ".tmp" + std::to_string(reinterpret_cast<uintptr_t>(&all));
  {
    std::ofstream f(tmp);
    f << "{\n\"format\": \"jax_regemm tuning cache 1\",\n\"entries\": {\n";
    size_t i = 0;
    for (const auto& kv : all) f << "\"" << kv.first << "\": \"" << kv.second << "\"" << (++i < all.size() ? "," : "") << "\n";
    f << "}\n}\n";
    if (!f) {
      std::fprintf(stderr, "regemm tune: could not write the tuning cache %s\n", tmp.c_str());
      std::remove(tmp.c_str());
      return;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "regemm tune: could not replace the tuning cache %s\n", path.c_str());
    std::remove(tmp.c_str());
  }
}

// "<device name>|cublasLt <version>|": winners hold for one kind of GPU and one
// cuBLASLt (whose heuristic's algorithm list the cuBLASLt labels index).
std::string disk_prefix(int device) {
  cudaDeviceProp prop;
  std::string name = cudaGetDeviceProperties(&prop, device) == cudaSuccess ? prop.name : "unknown GPU";
  return name + "|cublasLt " + std::to_string(cublasLtGetVersion()) + "|";
}

// ---------------------------------------------------------------------------
// Timing.
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
constexpr int kMaxDevices = 64;

// Holds the stream (one thread, sleeping) until *release has reached ticket
// (never, for a null release), or max_ns at most: work queued behind it
// starts back to back when it ends, however slowly the host queued it.
// Tickets only grow (modulo 2^32), so a hold the stream reaches after the
// host released a later one ends at once. A hold that ran to its limit is
// counted in release[kMaxDevices] (hold_words()).
__global__ void hold_stream(volatile uint32_t* release, uint32_t ticket, uint64_t max_ns) {
  const uint64_t t0 = global_ns();
  while ((!release || int32_t(*release - ticket) < 0) && global_ns() - t0 < max_ns) __nanosleep(500);
  if (release && int32_t(*release - ticket) < 0) release[kMaxDevices] += 1;
}

// Releases the holds up to ticket (never moving the word back).
void release_holds(volatile uint32_t* release, uint32_t ticket) {
  if (release && int32_t(ticket - *release) > 0) *release = ticket;
}

// The words hold_stream reads and writes: pinned, mapped host memory (the
// same address on the device: unified addressing), allocated once per process
// and never freed: a release word per device, then a count of holds that ran
// to their limit per device; null where that failed.
volatile uint32_t* hold_words() {
  static volatile uint32_t* words = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    if (cudaHostAlloc(&p, 2 * kMaxDevices * sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      cudaGetLastError();
      return;
    }
    words = static_cast<volatile uint32_t*>(p);
    for (int i = 0; i < 2 * kMaxDevices; ++i) words[i] = 0;
  });
  return words;
}

// The device's release word (null: then a hold runs to its limit).
volatile uint32_t* release_word(int device) {
  volatile uint32_t* words = hold_words();
  return words && device >= 0 && device < kMaxDevices ? words + device : nullptr;
}

bool overlaps(const void* a, const void* b, int64_t bytes) {
  if (!a || !b) return false;
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + bytes && y < x + bytes;
}

constexpr double kExtraOpUs = 4.0;  // host cost of one more launch (results/h100_host_cost.md: 3.8-4.1 us)
constexpr uint64_t kMaxHoldNs = 50000000;  // a bound, should the release never come
constexpr double kMarginPct = 3.0;  // time_candidates: the rule's way keeps ties within it

// Reads a buffer (twice the L2 cache) through, so that the run after it
// starts from a cold cache. The sink is written only if the XOR of the
// zeroed buffer is not 0 (never): it keeps the loads.
__global__ void read_through(const uint4* __restrict__ buf, size_t n, uint32_t* sink) {
  uint32_t x = 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = buf[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x != 0) *sink = x;
}

// The buffer read_through reads, for one tuning (freed by its destructor:
// the tuning has synchronised by then); empty where it could not be had
// (then the runs are timed as they come: cache-hot).
struct ColdCache {
  uint4* buf = nullptr;
  size_t n = 0;
  explicit ColdCache(int device) {
    const size_t bytes = 2 * l2_cache_bytes(device);
    if (cudaMalloc(&buf, bytes) != cudaSuccess || cudaMemset(buf, 0, bytes) != cudaSuccess) {
      cudaGetLastError();
      if (buf) cudaFree(buf);
      buf = nullptr;
      return;
    }
    n = bytes / sizeof(uint4);
  }
  ~ColdCache() {
    if (buf) cudaFree(buf);
  }
  void flush(cudaStream_t s) const {
    if (buf) read_through<<<1024, 256, 0, s>>>(buf, n, reinterpret_cast<uint32_t*>(buf));
  }
};

// A CUDA error left in the runtime after a way failed (a sticky one: an
// illegal address or a launch failure, the context is lost; or a launch error
// not yet read). It is the call's error, not a reason to try another way: a
// way that declines a problem (no room in the workspace, an alignment, an
// unsupported layout) fails without one.
ffi::Error cuda_fault(const std::string& label, cudaError_t e = cudaGetLastError()) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal("regemm: " + label + " broke: CUDA error " + cudaGetErrorName(e) + " (" +
                              cudaGetErrorString(e) + ")");
}

// The way to keep in *best: the rule's way (rule_way: its label, "" where
// unknown) unless another is faster by more than the margin
// (REGEMM_TUNE_MARGIN percent, default kMarginPct), else the fastest; the
// rule's (the registry's, untimed) when none could be timed. One way's time
// moves between timings by more than ways often differ (a 4096-wide dgrad:
// 846-958 us for one way, its rivals within 1-3%), so without a margin such
// picks were a coin toss. Inside programs the rule's way was the better of
// a tie in one case and the worse in another (docs/performance.md, the
// tuner's ties; results/h100_tuner_pick_drift.md, h100_train_full_966013e.md).
//
// A candidate's time: the median of `reps` runs, each timed alone (events
// around it) right after the L2 cache was flushed, plus the host charge.
// Timed with the inputs left in L2 by the run before, cuBLASLt's picks
// looked up to 2.5x faster than they run in a program (65536x256x256 and
// 8192x1024x4096 bf16 forwards, docs/performance.md): a program's inputs
// come from other work and mostly from DRAM. The candidates run in turns
// (run r of each before run r + 1 of any, each round behind its own hold):
// timed one after another, the later ones ran on a GPU heated under its power
// cap. A candidate that declines the problem is passed over; one that leaves
// a CUDA error ends the call with it.
template <class P, class O>
ffi::Error time_candidates(const std::vector<Candidate>& cands, const P& p, const O& o, CudaRuntime& rt, int device,
                           const std::string& sig, const std::string& rule_way, Candidate* best) {
  // Enough runs per candidate to see past launch noise (3 to 10).
  const GemmProblem& g = gemm_of(p);
  const double flops = 2.0 * double(g.m) * double(g.n) * double(g.k) * double(g.batch);
  int reps = flops > 4e11 ? 3 : flops > 4e10 ? 5 : 10;
  if (const char* r = std::getenv("REGEMM_TUNE_REPS"); r && std::atoi(r) > 0) reps = std::min(std::atoi(r), 32);
  double margin_pct = kMarginPct;
  if (const char* m = std::getenv("REGEMM_TUNE_MARGIN"); m && *m) margin_pct = std::max(0.0, std::atof(m));
  const bool log = env_on("REGEMM_TUNE_LOG");
  // Warm-up (and: can it run at all?), every candidate before any is timed. A
  // way that runs GEMMs (dgrad_dact's composed way) may have them tuned here,
  // on their first sight.
  std::vector<const Candidate*> live;
  for (const Candidate& c : cands) {
    if (entry_of<P, O>(c).run_variant(p, o, rt, c.variant).failure()) {
      if (ffi::Error e = cuda_fault(c.label); e.failure()) return e;
      if (log) std::fprintf(stderr, "regemm tune: %s: %s cannot run it\n", sig.c_str(), c.label.c_str());
      continue;
    }
    live.push_back(&c);
  }
  const size_t nc = live.size();
  if (nc == 0) return ffi::Error::Success();
  // [run][candidate][start, end]
  std::vector<cudaEvent_t> ev(2 * size_t(reps) * nc, nullptr);
  struct Destroy {
    std::vector<cudaEvent_t>& ev;
    ~Destroy() {
      for (cudaEvent_t e : ev)
        if (e) cudaEventDestroy(e);
    }
  } destroy{ev};
  for (cudaEvent_t& e : ev) REGEMM_CUDA_CHECK(cudaEventCreate(&e));
  const ColdCache cold(device);
  volatile uint32_t* release = release_word(device);
  static std::atomic<uint32_t> tickets{0};
  std::vector<char> ran(nc, 1);
  std::vector<int> ops(nc, 0);  // the device operations of one run (counted on the first timed one)
  for (int r = 0; r < reps; ++r) {
    const uint32_t ticket = ++tickets;
    hold_stream<<<1, 1, 0, rt.stream>>>(release, ticket, release ? kMaxHoldNs : 1000000);
    REGEMM_LAUNCH_CHECK();
    for (size_t i = 0; i < nc; ++i) {
      cudaEvent_t* e = &ev[2 * (size_t(r) * nc + i)];
      cold.flush(rt.stream);
      cudaEventRecord(e[0], rt.stream);
      rt.ops = 0;
      if (ran[i]) ran[i] = !entry_of<P, O>(*live[i]).run_variant(p, o, rt, live[i]->variant).failure();
      if (r == 0) ops[i] = rt.ops;
      cudaEventRecord(e[1], rt.stream);
      if (ffi::Error err = cuda_fault(live[i]->label); err.failure()) {
        release_holds(release, ticket);
        return err;
      }
    }
    release_holds(release, ticket);
  }
  if (ffi::Error e = cuda_fault("the tuner's timing", cudaEventSynchronize(ev.back())); e.failure()) return e;
  std::vector<double> us(nc, 0.0);
  std::vector<float> ms(reps, 0.0f);
  int fastest = -1, rule = -1;
  for (size_t i = 0; i < nc; ++i) {
    if (!ran[i]) continue;  // declined on a later run (it should not: nothing changed)
    for (int r = 0; r < reps; ++r) {
      const cudaEvent_t* e = &ev[2 * (size_t(r) * nc + i)];
      REGEMM_CUDA_CHECK(cudaEventElapsedTime(&ms[r], e[0], e[1]));
    }
    std::sort(ms.begin(), ms.end());
    const double device_us = 1e3 * double(ms[reps / 2]);
    const int extra = ops[i] > 1 ? ops[i] - 1 : 0;
    us[i] = device_us + extra * kExtraOpUs;
    const Candidate& c = *live[i];
    if (c.label == rule_way) rule = int(i);
    if (log)
      std::fprintf(stderr, "regemm tune: %s: %s %.2f us (device %.2f%s + %.0f us x %d extra ops)%s\n", sig.c_str(),
                   c.label.c_str(), us[i], device_us, cold.buf ? ", cold L2" : "", kExtraOpUs, extra,
                   c.label == rule_way ? " the rule's way" : "");
    if (fastest < 0 || us[i] < us[fastest]) fastest = int(i);
  }
  if (fastest < 0) return ffi::Error::Success();
  const bool keep_rule = rule >= 0 && us[fastest] >= us[rule] * (1.0 - margin_pct / 100.0);
  *best = *live[keep_rule ? rule : fastest];
  if (log)
    std::fprintf(stderr, "regemm tune: %s: chose %s (margin %g%% over the rule's way, %s)\n", sig.c_str(),
                 best->label.c_str(), margin_pct, rule >= 0 ? rule_way.c_str() : "not timed");
  return ffi::Error::Success();
}

// A remembered way that declines now (it should not: the signature fixes
// what applies) gives way to the rule, which reports any error of its own; a
// way that broke reports its CUDA error.
template <class P, class O>
ffi::Error run_candidate(const Candidate& c, const Kernel<P, O, CudaRuntime>& rule, const P& p, const O& o,
                         CudaRuntime& rt) {
  if (!c.entry) return rule.run(p, o, rt);
  ffi::Error e = entry_of<P, O>(c).run_variant(p, o, rt, c.variant);
  if (!e.failure()) return e;
  if (ffi::Error fault = cuda_fault(c.label); fault.failure()) return fault;
  std::fprintf(stderr, "regemm tune: %s declined here (%s); the rule runs instead\n", c.label.c_str(),
               std::string(e.message()).c_str());
  return rule.run(p, o, rt);
}

// The winner for `key` (timed now if it is new and may be), run. `may_time`
// false: a new signature runs the rule, untimed and not remembered.
template <class P, class O>
ffi::Error tuned_run(const Kernel<P, O, CudaRuntime>& rule, const P& p, const O& o, CudaRuntime& rt, int device,
                     Key key, bool may_time) {
  host_mark(HostPhase::kSigned);
  Candidate known;
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (auto it = g_winners.find(key); it != g_winners.end()) { known = it->second.way; found = true; }
  }
  if (found) {
    host_mark(HostPhase::kWayFound);
    return run_candidate(known, rule, p, o, rt);
  }
  const std::string sig = signature(key);
  std::vector<Candidate> cands = candidates(p, o, rt);
  Candidate chosen;
  if (cands.size() == 1) chosen = cands[0];
  if (const char* forced = std::getenv("REGEMM_VARIANT"); forced && *forced)
    for (const Candidate& c : cands)
      if (c.label == forced) chosen = c;
  // The disk cache, loaded on first need (and again when the variable names another file).
  const char* path = std::getenv("REGEMM_TUNE_CACHE");
  const std::string disk_key = path && *path ? disk_prefix(device) + sig : "";
  if (cands.size() > 1 && !chosen.entry && !disk_key.empty()) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_disk.path != path) g_disk = {path, read_cache(path)};
    if (auto it = g_disk.entries.find(disk_key); it != g_disk.entries.end())
      for (const Candidate& c : cands)
        if (c.label == it->second) chosen = c;
  }
  if (cands.size() > 1 && !chosen.entry) {
    if (rt.capturing || !may_time) return rule.run(p, o, rt);  // untimed, and not remembered
    std::string rule_way;  // Kernel::rule_way, or the rule's entry's first listed way
    if (rule.rule_way)
      rule_way = rule.rule_way(p, o, rt);
    else
      for (const Candidate& c : cands)
        if (c.entry == &rule && rule_way.empty()) rule_way = c.label;
    if (ffi::Error e = time_candidates(cands, p, o, rt, device, sig, rule_way, &chosen); e.failure()) return e;
    std::lock_guard<std::mutex> lock(g_mu);
    ++g_timings;
    if (chosen.entry && !disk_key.empty()) {
      g_disk.entries[disk_key] = chosen.label;
      save_cache(path, {{disk_key, chosen.label}});
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_winners.emplace(std::move(key), Winner{chosen, std::to_string(device) + " " + sig});
  }
  return run_candidate(chosen, rule, p, o, rt);
}

}  // namespace

ffi::Error CudaRuntime::run(const GemmEntry& rule, const GemmProblem& p, const GemmOperands& o) {
  if (env_off("REGEMM_TUNE")) return rule.run(p, o, *this);
  int device = 0;
  REGEMM_CUDA_CHECK(cudaGetDevice(&device));
  // A timed run would change the next one's input where C overlaps Y or Z.
  const int64_t y_bytes = p.m * p.n * p.batch * dtype_size(p.dtype);
  const bool c_aliases = p.has_c && (overlaps(o.c, o.y, y_bytes) || overlaps(o.c, o.z, y_bytes));
  return tuned_run(rule, p, o, *this, device, key_of(device, p, o), !c_aliases);
}

// dgrad_dact: timed among the ways of every entry that offers some (the CUTLASS
// kernel's fused way, cuBLAS's composed and DGELU ways), where the rule's entry
// offers some; untimed, the rule's entry runs its own choice.
ffi::Error CudaRuntime::run(const DgradDactEntry& rule, const DgradDactProblem& q, const DgradDactOperands& o) {
  if (env_off("REGEMM_TUNE") || !rule.variants) return rule.run(q, o, *this);
  int device = 0;
  REGEMM_CUDA_CHECK(cudaGetDevice(&device));
  return tuned_run(rule, q, o, *this, device, key_of(device, q, o), true);
}

namespace tuner {

std::vector<std::pair<std::string, std::string>> winners() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& kv : g_winners) out.emplace_back(kv.second.name, kv.second.way.label);
  return out;
}

int64_t timings() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_timings;
}

int64_t hold_timeouts() {
  volatile uint32_t* words = hold_words();
  int64_t n = 0;
  for (int i = 0; words && i < kMaxDevices; ++i) n += words[kMaxDevices + i];
  return n;
}

void forget() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_winners.clear();
  g_disk = {};
}

}  // namespace tuner
}  // namespace regemm
