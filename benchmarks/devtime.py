"""Device-side timing of jitted JAX functions through the JAX profiler.

One profiler trace covers many functions; the GPU plane's stream lines give
each kernel's device start and end, and a program run's device time is its
first kernel's start to its last kernel's end (gaps inside a run included,
launch gaps between runs excluded). No host clock. Median of repeats after
warm-up.
"""

from __future__ import annotations

import glob
import time
import statistics
import tempfile

import jax
import numpy as np


# XLA compile options for every function jitted here (bench_gpu.py --graph-min-size
# sets xla_gpu_graph_min_graph_size for both sides of a comparison).
COMPILER_OPTIONS: dict = {}


def named_jit(fn, name: str, **jit_kwargs):
    """jit `fn` so that its XLA module is called jit_<name>."""
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn, compiler_options=dict(COMPILER_OPTIONS) or None, **jit_kwargs)


def _kernel_spans(pd):
    """Sorted (start_ns, end_ns) of every kernel/memset on the GPU planes' stream lines."""
    spans = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream") or line.name == "XLA Ops":
                spans += [(ev.start_ns, ev.end_ns) for ev in line.events]
    return sorted(spans)


def _group_runs(spans, gap_ns):
    """Splits kernel spans into program runs at idle gaps longer than gap_ns."""
    runs = []
    for s, e in spans:
        if runs and s - runs[-1][1] <= gap_ns:
            runs[-1][1] = max(runs[-1][1], e)
        else:
            runs.append([s, e])
    return runs


def device_times_ms(cases, repeats=20, pause_s=1e-2):
    """cases: {name: (jitted fn, [args tuple, ...])}; the arg sets are rotated so
    repeated runs do not just measure the L2 cache. Returns {name: median ms}.

    The GPU timeline of one run is its first kernel's start to its last
    kernel's end. Runs are told apart by an idle pause of `pause_s` the host
    leaves between them (kernels of one program follow each other within
    microseconds); the count of runs found is checked against the count made.
    """
    for fn, arg_sets in cases.values():  # compile and warm up (and let any tuner run)
        for args in arg_sets:
            jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for fn, arg_sets in cases.values():
            for r in range(repeats):
                jax.block_until_ready(fn(*arg_sets[r % len(arg_sets)]))
                time.sleep(pause_s)
        jax.profiler.stop_trace()
        paths = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not paths:
            raise RuntimeError("the profiler wrote no xplane file")
        pd = jax.profiler.ProfileData.from_file(paths[0])
    runs = _group_runs(_kernel_spans(pd), gap_ns=int(pause_s * 1e9 / 4))
    # A host stall inside a run (seen: one in 660 runs) splits it in two. The
    # gaps between runs are all >= pause_s, so the smallest gaps are the
    # spurious ones: merge those, at most one per 100 runs.
    extra = len(runs) - len(cases) * repeats
    if 0 < extra <= max(1, len(runs) // 100):
        for _ in range(extra):
            i = min(range(len(runs) - 1), key=lambda i: runs[i + 1][0] - runs[i][1])
            runs[i : i + 2] = [[runs[i][0], max(runs[i][1], runs[i + 1][1])]]
    if len(runs) != len(cases) * repeats:
        raise RuntimeError(f"found {len(runs)} program runs on the GPU timeline, made {len(cases) * repeats}")
    result = {}
    for i, name in enumerate(cases):
        ds = [(e - s) / 1e6 for s, e in runs[i * repeats : (i + 1) * repeats]]
        result[name] = statistics.median(ds)
    return result


def pipelined_ms(cases, n=50, repeats=9):
    """{name: (fn, arg_sets)} -> {name: wall clock per call}: n calls of fn pipelined as a
    program issues them (over the rotated arg sets, blocked once at the end), median of
    repeats after warm-up: device time plus whatever host time the calls do not hide. The
    cases' loops take turns, repeat by repeat, so that drift in the machine's state (the
    GPU's clock at its power cap, the host) falls on every case alike rather than on
    whichever ran last; in a fresh order each repeat (`turns`), so that no case always
    follows the same one (in a fixed order a host-bound two-GPU step read 0.87 of XLA's
    speed, shuffled 1.03: results/h100x2_train_dp2_donated_e54445f.md)."""
    for fn, arg_sets in cases.values():
        for args in arg_sets:
            jax.block_until_ready(fn(*args))
    ts = {name: [] for name in cases}
    for name in turns(cases, repeats):
        fn, arg_sets = cases[name]
        t0 = time.perf_counter()
        out = [fn(*arg_sets[i % len(arg_sets)]) for i in range(n)]
        jax.block_until_ready(out)
        ts[name].append((time.perf_counter() - t0) / n * 1e3)
    return {name: statistics.median(t) for name, t in ts.items()}


def turns(names, repeats):
    """The names, each once per repeat, in a fresh order each repeat (seeded): sides timed in
    turns so that no side always follows the same one."""
    order = np.random.default_rng(0)
    for _ in range(repeats):
        yield from (str(name) for name in order.permutation(list(names)))


def host_median_ms(fn, *args, repeats=20):
    """Median wall time of fn(*args) after warm-up: for the CPU backend, where
    host time is device time (the call blocks until the result is ready)."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)
