"""The transformer MLP block, Dense(4d, act) -> Dense(d), forward+backward, against the
sum of its six GEMMs (issue 24's block target: ours / GEMMs <= 1.05) and against XLA.

Three programs per cell, all jitted, in one process, fed fresh random inputs:
  - ours:  jax.vjp of rg.mlp(x, [w1, w2], [b1, b2], act=act), pulled back with a random g;
  - xla:   the same with the plain-JAX reference (act(x @ w + b) per layer);
  - gemms: the six GEMMs of that forward+backward alone, as jnp dots: x@w1, h@w2,
           g@w2^T, h^T@g, gh@w1^T, x^T@gh (no bias, no activation, no elementwise pass).
Device time (the profiler's GPU timeline, devtime.py) and wall clock, medians; on the
CPU backend wall clock alone.

    python benchmarks/bench_block.py [--shapes 8192x1024,...] [--acts gelu,relu]
        [--dtypes bfloat16,float32] [--json results/h100_block.json]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_regemm as rg
from devtime import device_times_ms, host_median_ms, named_jit


def inputs(key, m, d, dtype):
    k = jax.random.split(key, 6)
    x = jax.random.normal(k[0], (m, d), dtype)
    w1 = (jax.random.normal(k[1], (d, 4 * d)) / np.sqrt(d)).astype(dtype)
    b1 = jax.random.normal(k[2], (4 * d,), dtype)
    w2 = (jax.random.normal(k[3], (4 * d, d)) / np.sqrt(4 * d)).astype(dtype)
    b2 = jax.random.normal(k[4], (d,), dtype)
    g = jax.random.normal(k[5], (m, d), dtype)
    return x, w1, b1, w2, b2, g


def block_vjp(mlp, act):
    def fn(x, w1, b1, w2, b2, g):
        y, pull = jax.vjp(lambda x, w1, b1, w2, b2: mlp(x, [w1, w2], [b1, b2], act=act, final_act="none"),
                          x, w1, b1, w2, b2)
        return y, pull(g)
    return fn


def gemms(x, w1, b1, w2, b2, g):
    h = x @ w1
    y = h @ w2
    gh = g @ w2.T
    return y, gh @ w1.T, x.T @ gh, h.T @ g


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192x1024,16384x1024,8192x2048,4096x4096")
    p.add_argument("--acts", default="gelu,relu")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--json")
    args = p.parse_args()
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    print("| M x d | dtype | act | ours ms | xla ms | gemms ms | ours/gemms | xla/gemms | speed-up (xla/ours) | wall: ours, xla, gemms ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    records = []
    for shape in args.shapes.split(","):
        m, d = map(int, shape.split("x"))
        for dtype in args.dtypes.split(","):
            sets = [inputs(jax.random.PRNGKey(s), m, d, dtype) for s in range(3)]
            for act in args.acts.split(","):
                cases = {
                    f"ours_{act}": (named_jit(block_vjp(rg.mlp, act), f"ours_{act}"), sets),
                    f"xla_{act}": (named_jit(block_vjp(rg.reference.mlp, act), f"xla_{act}"), sets),
                    "gemms": (named_jit(gemms, "gemms"), sets),
                }
                w = {k: host_median_ms(fn, *s[0], repeats=30) for k, (fn, s) in cases.items()}
                # On the CPU the call blocks until done: wall clock is the device time.
                t = w if jax.default_backend() == "cpu" else device_times_ms(cases)
                to, tx, tg = t[f"ours_{act}"], t[f"xla_{act}"], t["gemms"]
                rec = dict(shape=shape, dtype=dtype, act=act, ours_ms=to, xla_ms=tx, gemms_ms=tg,
                           ours_over_gemms=to / tg, xla_over_gemms=tx / tg, speedup=tx / to,
                           wall_ours_ms=w[f"ours_{act}"], wall_xla_ms=w[f"xla_{act}"], wall_gemms_ms=w["gemms"])
                records.append(rec)
                print(f"| {shape} | {dtype} | {act} | {to:.3f} | {tx:.3f} | {tg:.3f} | {to / tg:.3f} | {tx / tg:.3f} | "
                      f"{tx / to:.3f} | {rec['wall_ours_ms']:.3f}, {rec['wall_xla_ms']:.3f}, {rec['wall_gemms_ms']:.3f} |",
                      flush=True)
    geo = lambda k: float(np.exp(np.mean([np.log(r[k]) for r in records])))
    print(f"\ngeo-mean: ours/gemms {geo('ours_over_gemms'):.3f}, xla/gemms {geo('xla_over_gemms'):.3f}, "
          f"speed-up {geo('speedup'):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, records=records), f, indent=1)


if __name__ == "__main__":
    main()
