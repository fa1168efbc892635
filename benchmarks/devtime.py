"""Device-side timing of jitted JAX functions through the JAX profiler.

Each function is jitted under a unique name; one profiler trace covers many
functions; the GPU plane's "XLA Modules" line gives, per program run, the
device time from its first kernel's start to its last kernel's end. No host
clock, launch gaps between runs excluded. Median of repeats after warm-up.
"""

from __future__ import annotations

import glob
import statistics
import tempfile
from collections import defaultdict

import jax


def named_jit(fn, name: str):
    """jit `fn` so that its XLA module is called jit_<name>."""
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn)


def _module_durations(pd):
    """{module name: [duration ms, ...]} from a ProfileData, GPU planes only."""
    out = defaultdict(list)
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name != "XLA Modules":
                continue
            for ev in line.events:
                out[ev.name.split("(")[0]].append(ev.duration_ns / 1e6)
    return out


def device_times_ms(cases, repeats=20):
    """cases: {name: (jitted fn, [args tuple, ...])}; the arg sets are rotated so
    repeated runs do not just measure the L2 cache. Returns {name: median ms}."""
    for fn, arg_sets in cases.values():  # compile and warm up
        for args in arg_sets:
            jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for fn, arg_sets in cases.values():
            for r in range(repeats):
                jax.block_until_ready(fn(*arg_sets[r % len(arg_sets)]))
        jax.profiler.stop_trace()
        paths = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not paths:
            raise RuntimeError("the profiler wrote no xplane file")
        pd = jax.profiler.ProfileData.from_file(paths[0])
    durations = _module_durations(pd)
    result = {}
    for name in cases:
        ds = durations.get(f"jit_{name}", [])
        if len(ds) < repeats // 2:
            lines = sorted({(pl.name, ln.name) for pl in pd.planes for ln in pl.lines})
            raise RuntimeError(
                f"profiler saw {len(ds)} runs of {name}; modules seen: {sorted(durations)[:10]}; lines: {lines[:40]}"
            )
        result[name] = statistics.median(ds)
    return result
