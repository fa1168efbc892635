"""Where the device time of one jitted program goes: its kernels, in order,
with their device time and the idle gaps between them (from the JAX
profiler's GPU stream timeline, as devtime.py reads it). For the
"two numbers" method: which kernel is off its floor, and how much is launch
gaps.

    python tools/kernel_trace.py --shape 128:1024:1024 --dtype bf16 --act sigmoid --mode fwd_bwd
"""

from __future__ import annotations

import argparse
import collections
import glob
import tempfile
import time

import jax

import jax_regemm as rg
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench_gpu, devtime
from bench_gpu import layer_program


def trace(fn, args, repeats=5, pause_s=2e-3):
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(repeats):
            jax.block_until_ready(fn(*args))
            time.sleep(pause_s)
        jax.profiler.stop_trace()
        pd = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    events, host, host_events = [], collections.defaultdict(float), []
    for plane in pd.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream") or line.name == "XLA Ops":
                    events += [(ev.start_ns, ev.end_ns, ev.name) for ev in line.events]
        elif plane.name.startswith("/host"):  # host time per event name (XLA's thunks, CUDA API calls)
            for line in plane.lines:
                for ev in line.events:
                    if ev.end_ns - ev.start_ns < pause_s * 1e9 / 2:
                        host[f"{line.name[:20]}: {ev.name[:90]}"] += (ev.end_ns - ev.start_ns) / 1e3 / repeats
                        host_events.append((ev.start_ns, ev.end_ns, f"{line.name[:20]}: {ev.name[:90]}"))
    events.sort()
    runs, cur = [], []
    for e in events:  # split at the host's pauses
        if cur and e[0] - max(x[1] for x in cur) > pause_s * 1e9 / 4:
            runs.append(cur)
            cur = []
        cur.append(e)
    runs.append(cur)
    run = runs[len(runs) // 2]  # a middle run
    t0, t1 = run[0][0], max(e[1] for e in run)
    # The host's events from the previous run's end (the program's dispatch) to this run's end.
    prev_end = max(e[1] for e in runs[len(runs) // 2 - 1]) if len(runs) > 1 else t0 - int(pause_s * 1e9)
    timeline = sorted((s - t0, e - s, name) for s, e, name in host_events if prev_end < s < t1)
    return run, host, timeline  # host: us per run by name


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="128:1024:1024")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--act", default="relu")
    p.add_argument("--mode", default="fwd_bwd")
    p.add_argument("--impl", default="regemm,xla")
    p.add_argument("--host", action="store_true", help="also the host's time per event name (thunks, CUDA calls)")
    args = p.parse_args()
    m, k, n = (int(v) for v in args.shape.split(":"))
    for impl in args.impl.split(","):
        fn, fargs = layer_program(impl, args.act, args.mode, m, k, n, args.dtype)
        run, host, timeline = trace(fn, fargs)
        if args.host:  # back-to-back calls, no sync between: host-bound for small programs
            jax.block_until_ready(fn(*fargs))
            cuda = rg._ffi._regemm_cuda
            h0 = cuda.host_time() if cuda is not None else (0, 0.0)
            t = time.perf_counter()
            for _ in range(200):
                out = fn(*fargs)
            jax.block_until_ready(out)
            wall = (time.perf_counter() - t) / 200 * 1e6
            h1 = cuda.host_time() if cuda is not None else (0, 0.0)
            calls = (h1[0] - h0[0]) / 200
            inside = (h1[1] - h0[1]) / 200 * 1e6
            print(f"== {impl}: {wall:.1f} us per call back to back (wall); {calls:.0f} regemm handler calls, "
                  f"{inside:.1f} us of host time inside them")
        t0, t1 = run[0][0], max(e[1] for e in run)
        busy = collections.defaultdict(float)
        print(f"== {impl} {args.shape} {args.dtype} {args.act} {args.mode}: {(t1 - t0) / 1e3:.1f} us, {len(run)} kernels")
        end = t0
        for s, e, name in run:
            gap = (s - end) / 1e3
            print(f"  +{gap:6.1f} gap  {(e - s) / 1e3:7.1f} us  {name[:110]}")
            end = max(end, e)
            busy[name[:60]] += (e - s) / 1e3
        print(f"  kernels {sum(busy.values()):.1f} us of {(t1 - t0) / 1e3:.1f} us")
        if args.host:
            print("  host time per run, by event (top 30):")
            for name, us in sorted(host.items(), key=lambda kv: -kv[1])[:30]:
                print(f"    {us:8.1f} us  {name}")
            print("  host events of that run (start relative to its first kernel, duration):")
            for start, dur, name in timeline[-120:]:
                print(f"    {start / 1e3:+9.1f} us {dur / 1e3:7.1f} us  {name}")
    cuda = rg._ffi._regemm_cuda
    if cuda is not None:  # handler calls so far that XLA made under CUDA-graph capture
        print(f"regemm calls captured into CUDA graphs so far: {cuda.captured_calls()}")


if __name__ == "__main__":
    main()
