"""CPU: jax_regemm's dense layer against XLA's own act(x @ w + b), one process.

XLA runs two programs of the layer: the reference (`rg.reference.dense`: the
product accumulated in f32, bias and act in f32, our numerics), whose time
gives `speedup`, and the plain program a user writes (`act(x @ w + b)` in the
input dtype, jax.nn's activations), whose time gives `plain_speedup`. They
differ for 16-bit inputs, where XLA's CPU dot with a bf16 result is several
times slower than the one with an f32 result.

For each shape (M x K x N), dtype and activation: the jitted forward, and the
jitted forward+backward (grad of sum(y**2) with respect to x, w and b). Each
repeat times one call of every program, in a shuffled order, so all see the
same machine state; a speed-up is the median over repeats of the two sides'
ratio within a repeat (wall time: on the CPU the call blocks until the result
is ready), and the ms columns are each side's median. --block N times N calls
of one side back to back per sample (the steady state of a loop of one
program, against each call following another side's).
--ab NAME=VAR=VALUE adds a side: ours compiled with the environment variable VAR
set to VALUE (an A/B of a lowering choice in the same process).

    python benchmarks/cpu_vs_xla.py [--shapes 512x512x512,...] [--dtypes float32,bfloat16]
        [--acts none,relu,...] [--repeats 15] [--json results/cpu_vs_xla.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_regemm as rg
import plain as PLAIN

ACTS = "none,relu,leaky_relu,gelu,gelu_erf,sigmoid,tanh,silu"



def paired_times_ms(fns, args, repeats, block=1, seed=0):
    """Ms per call of each of fns on args, one list per function: a sample of each per
    repeat, in a shuffled order (no side always follows the same other); each sample is
    `block` calls of one function back to back (1: every call follows another side's)."""
    for _ in range(3):
        for f in fns:
            jax.block_until_ready(f(*args))
    rng = random.Random(seed)
    ts = [[] for _ in fns]
    for _ in range(repeats):
        order = list(range(len(fns)))
        rng.shuffle(order)
        for i in order:
            t0 = time.perf_counter()
            for _ in range(block):
                jax.block_until_ready(fns[i](*args))
            ts[i].append(1e3 * (time.perf_counter() - t0) / block)
    return ts


def paired_speedup(t_other, t_ours):
    """The median over repeats of other/ours within one repeat: the machine's slow and fast
    spells (longer than a repeat) cancel, where a ratio of two medians keeps them."""
    return statistics.median(o / u for o, u in zip(t_other, t_ours))


def compiled(f, args, env=None):
    """f jitted and compiled now, with env (VAR, VALUE) set while it is lowered."""
    var, value = env or (None, None)
    old = os.environ.get(var) if var else None
    if var:
        os.environ[var] = value
    try:
        return jax.jit(f).lower(*args).compile()
    finally:
        if var and old is None:
            del os.environ[var]
        elif var:
            os.environ[var] = old


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="512x512x512,2048x1024x1024,256x4096x1024")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--acts", default=ACTS)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--block", type=int, default=1,
                   help="calls of one side back to back per timed sample (1: the sides alternate call by call)")
    p.add_argument("--json")
    p.add_argument("--ab", default="", help="NAME=VAR=VALUE: ours compiled with VAR=VALUE, as side NAME")
    args = p.parse_args()
    ab = tuple(args.ab.split("=", 2)) if args.ab else None
    print(f"device: {jax.devices()[0]}  cpu: {platform.processor() or platform.machine()}  jax {jax.__version__}")
    extra = f" {ab[0]} ms | speed-up ({ab[0]}) |" if ab else ""
    print("| M x K x N | dtype | act | mode | regemm ms | xla ms | speed-up (xla/regemm) | plain ms "
          "| speed-up (plain/regemm) |" + extra)
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + " --- | --- |" * bool(ab))
    records = []
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        for dtype in args.dtypes.split(","):
            x = jax.random.normal(keys[0], (m, k), dtype)
            w = (jax.random.normal(keys[1], (k, n)) / np.sqrt(k)).astype(dtype)
            b = jax.random.normal(keys[2], (n,), dtype)
            for act in args.acts.split(","):
                ours = lambda x, w, b: rg.dense(x, w, b, act=act)
                xla = lambda x, w, b: rg.reference.dense(x, w, b, act=act)
                plain = lambda x, w, b: PLAIN.dense(x, w, b, act=act)
                grad = lambda f: jax.grad(lambda x, w, b: jnp.sum(f(x, w, b).astype(jnp.float32) ** 2), (0, 1, 2))
                for mode, fo, fx, fp in (("fwd", ours, xla, plain), ("fwd+bwd", grad(ours), grad(xla), grad(plain))):
                    fns = [compiled(fo, (x, w, b)), compiled(fx, (x, w, b)), compiled(fp, (x, w, b))]
                    if ab:
                        fns.append(compiled(fo, (x, w, b), ab[1:]))
                    ts = paired_times_ms(fns, (x, w, b), args.repeats, args.block)
                    to, tx, tp, *ta = (statistics.median(t) for t in ts)
                    sx, sp = paired_speedup(ts[1], ts[0]), paired_speedup(ts[2], ts[0])
                    rec = dict(shape=shape, dtype=dtype, act=act, mode=mode, regemm_ms=to, xla_ms=tx, speedup=sx,
                               plain_ms=tp, plain_speedup=sp)
                    line = f"| {shape} | {dtype} | {act} | {mode} | {to:.3f} | {tx:.3f} | {sx:.2f} | {tp:.3f} | {sp:.2f} |"
                    if ab:
                        sa = paired_speedup(ts[1], ts[3])
                        rec[ab[0]] = dict(env=f"{ab[1]}={ab[2]}", ms=ta[0], speedup=sa)
                        line += f" {ta[0]:.3f} | {sa:.2f} |"
                    print(line, flush=True)
                    records.append(rec)
    summaries = [("regemm", lambda r: r["speedup"]), ("regemm against plain", lambda r: r["plain_speedup"])]
    if ab:
        summaries.append((ab[0], lambda r: r[ab[0]]["speedup"]))
    for name, speedup in summaries:
        sp = [speedup(r) for r in records]
        print(f"\n{name} speed-up: geo-mean {np.exp(np.mean(np.log(sp))):.2f}, min {min(sp):.2f}, max {max(sp):.2f}, "
              f"cells below 1.0: {sum(s < 1.0 for s in sp)} of {len(sp)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, block=args.block, records=records), f,
                      indent=1)


if __name__ == "__main__":
    main()
