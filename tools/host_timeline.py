"""Where an uncaptured program's host time goes, without a profiler.

Each run of the jitted program starts after an idle pause (as bench_gpu.py's
do); the module's host timeline (ffi/cuda/host_marks.h) records when each
regemm handler call passed each phase (HostPhase: built, capture query
done, signature and way found by the tuner, first launch begun, work
queued), on the clock time.monotonic_ns reads. Printed,
as medians over the runs, in microseconds from the program's call:

    call -> first handler     XLA's dispatch and thunks before our first call
    handler i: phases         ours: the time up to each phase from the one before
    after the last            XLA's time between two of our calls
    last handler -> ready     the device finishing after the host is done

    python tools/host_timeline.py --shape 128:1024:1024 --acts relu --mode fwd_bwd
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import jax_regemm as rg
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench_gpu, devtime
from bench_gpu import layer_program

PHASES = ("begin", "started", "signed", "way", "launch", "end")  # runtime.h: HostPhase


def handlers(marks):
    """[[(phase name, ns), ...] per handler call], from the flat marks."""
    out = []
    for phase, ns in marks:
        if PHASES[phase] == "begin":
            out.append([])
        if out:
            out[-1].append((PHASES[phase], ns))
    return out


def timeline(fn, args, runs, pause_s, cuda):
    for _ in range(5):
        jax.block_until_ready(fn(*args))
    rows = []
    for _ in range(runs):
        time.sleep(pause_s)
        if cuda is not None:
            cuda.host_marks(True)
        t0 = time.monotonic_ns()
        out = fn(*args)
        t1 = time.monotonic_ns()
        jax.block_until_ready(out)
        t2 = time.monotonic_ns()
        calls = handlers(cuda.host_marks(False)) if cuda is not None else []
        rows.append((t0, t1, t2, calls))
    return rows


def report(name, rows):
    us = lambda ns: ns / 1e3  # noqa: E731
    med = lambda xs: float(np.median(xs))  # noqa: E731
    # Runs whose calls passed the same phases (a first sight's tuning would not).
    shape = [[ph for ph, _ in c] for c in rows[-1][3]]
    rows = [r for r in rows if [[ph for ph, _ in c] for c in r[3]] == shape]
    print(f"== {name}: {len(rows)} runs, {len(shape)} regemm handler calls each (medians, us from the call)")
    print(f"  dispatch returned {med([us(r[1] - r[0]) for r in rows]):8.1f}")
    print(f"  outputs ready     {med([us(r[2] - r[0]) for r in rows]):8.1f}")
    prev, inside = [r[0] for r in rows], 0.0
    for i, phases in enumerate(shape):
        calls = [r[3][i] for r in rows]
        gap = med([us(c[0][1] - p) for c, p in zip(calls, prev)])
        steps = ", ".join(
            f"{phases[j]} +{med([us(c[j][1] - c[j - 1][1]) for c in calls]):.1f}" for j in range(1, len(phases)))
        total = med([us(c[-1][1] - c[0][1]) for c in calls])
        inside += total
        begins = med([us(c[0][1] - r[0]) for c, r in zip(calls, rows)])
        print(f"  handler {i}: begins {begins:7.1f} ({gap:6.1f} after the {'call' if i == 0 else 'last'}); "
              f"{total:6.1f} inside: {steps}")
        prev = [c[-1][1] for c in calls]
    if shape:
        tail = med([us(r[2] - r[3][-1][-1][1]) for r in rows])
        print(f"  inside our handlers {inside:7.1f}; last handler's end -> outputs ready {tail:7.1f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="128:1024:1024")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--acts", default="relu")
    p.add_argument("--mode", default="fwd_bwd")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--pause", type=float, default=10e-3, help="seconds idle before each run (bench_gpu: 10 ms)")
    args = p.parse_args()
    m, k, n = (int(v) for v in args.shape.split(":"))
    cuda = rg._ffi._regemm_cuda
    for act in args.acts.split(","):
        for impl in ("regemm", "xla"):
            fn, fargs = layer_program(impl, act, args.mode, m, k, n, args.dtype)
            rows = timeline(fn, fargs, args.runs, args.pause, cuda)
            report(f"{impl} {args.shape} {args.dtype} {act} {args.mode}, pause {args.pause * 1e3:.0f} ms", rows)


if __name__ == "__main__":
    main()
