"""The transformer MLP block, Dense(4d, act) -> Dense(d), against the program a user writes.

Per cell (T x d tokens x model width, dtype, activation), all jitted, in one process:
  - plain: what a user writes, flax's nn.Dense(4d, dtype) + jax.nn activation + nn.Dense(d, dtype)
           (plain.py: act(x @ w1 + b1) @ w2 + b2 in the input dtype);
  - ours:  jax_regemm's block (rg.mlp; in a step, jax_regemm.flax.MLP);
  - gemms: the six GEMMs of its forward+backward alone, as jnp dots (x@w1, h@w2, g@w2^T, h^T@g,
           gh@w1^T, x^T@gh): no bias, no activation, the floor no epilogue fusion can beat.
Mode "vjp": the forward+backward (jax.vjp pulled back with a random g). Mode "step": a whole
training step (mean-squared loss, optax AdamW), the train state not donated and, for the wall
clock, donated too (`donate_argnums`, as a training loop does).
Device time (the profiler's GPU timeline, devtime.py) and wall clock (pipelined calls, the sides
in a shuffled order each repeat), medians. The speed-up is plain / ours, first in every row.

    python benchmarks/bench_block.py [--shapes 8192x1024,...] [--acts gelu,relu]
        [--dtypes bfloat16,float32] [--modes vjp,step] [--json results/h200_block.json]
"""

from __future__ import annotations

import argparse
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_regemm as rg
import plain as PLAIN
from bench_train import make_step, wall_ms
from devtime import device_times_ms, named_jit, pipelined_ms


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
                          x, w1, b1, w2, b2)  # fmt: skip
        return y, pull(g)

    return fn


def gemms(x, w1, b1, w2, b2, g):
    h = x @ w1
    y = h @ w2
    gh = g @ w2.T
    return y, gh @ w1.T, x.T @ gh, h.T @ g


class PlainBlock(nn.Module):
    """The block as a user writes it in flax."""

    d: int
    act: str
    dtype: object

    @nn.compact
    def __call__(self, x):
        h = PLAIN.ACT[self.act](nn.Dense(4 * self.d, dtype=self.dtype, param_dtype=self.dtype)(x))
        return nn.Dense(self.d, dtype=self.dtype, param_dtype=self.dtype)(h)


def _device(cases):
    """Device times; on the CPU, where a call blocks until done, the wall clock."""
    return pipelined_ms(cases) if jax.default_backend() == "cpu" else device_times_ms(cases)


def _vjp_cell(m, d, dtype, act):
    sets = [inputs(jax.random.PRNGKey(s), m, d, dtype) for s in range(3)]
    cases = {"plain": (named_jit(block_vjp(PLAIN.mlp, act), f"plain_{act}"), sets),
             "ours": (named_jit(block_vjp(rg.mlp, act), f"ours_{act}"), sets),
             "gemms": (named_jit(gemms, "gemms"), sets)}  # fmt: skip
    return _device(cases), pipelined_ms(cases)


def _step_cell(m, d, dtype, act):
    from jax_regemm.flax import MLP

    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (m, d), dtype)
    y = jax.random.normal(jax.random.PRNGKey(1), (m, d), jnp.float32)
    opt = optax.adamw(1e-4)
    models = {"plain": PlainBlock(d, act, dtype),
              "ours": MLP(features=[4 * d, d], activation=act, dtype=dtype, param_dtype=dtype)}  # fmt: skip
    steps, donated, cases = {}, {}, {}
    for name, model in models.items():
        params = model.init(key, x)
        state = (params, opt.init(params))
        step = make_step(model, opt)
        steps[name] = (named_jit(step, f"step_{name}_{act}"), state)
        donated[name] = (named_jit(step, f"donated_{name}_{act}", donate_argnums=(0, 1)), state)
        cases[name] = (steps[name][0], [(*state, x, y)])
    dev = _device(cases)
    wall = wall_ms(steps, x, y)
    wall_donated = wall_ms(donated, x, y)
    return dev, wall, wall_donated


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192x1024,16384x2048,8192x4096")
    p.add_argument("--acts", default="gelu,relu")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--modes", default="vjp,step")
    p.add_argument("--json")
    args = p.parse_args()
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}; speed-up = plain / ours")
    records = []
    for mode in args.modes.split(","):
        if mode == "vjp":
            print("\n| T x d | dtype | act | speed-up device | speed-up wall | plain ms | ours ms | gemms ms "
                  "| ours / gemms | plain / gemms |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        else:
            print("\n| T x d | dtype | act | speed-up device | wall | wall, donated | plain ms | ours ms |"
                  "\n| --- | --- | --- | --- | --- | --- | --- | --- |")
        for shape in args.shapes.split(","):
            m, d = map(int, shape.split("x"))
            for dtype in args.dtypes.split(","):
                for act in args.acts.split(","):
                    rec = dict(mode=mode, shape=shape, dtype=dtype, act=act)
                    if mode == "vjp":
                        dev, wall = _vjp_cell(m, d, dtype, act)
                        rec.update(plain_ms=dev["plain"], ours_ms=dev["ours"], gemms_ms=dev["gemms"],
                                   speedup=dev["plain"] / dev["ours"], speedup_wall=wall["plain"] / wall["ours"],
                                   ours_over_gemms=dev["ours"] / dev["gemms"],
                                   plain_over_gemms=dev["plain"] / dev["gemms"], wall_ms=wall)  # fmt: skip
                        print(f"| {shape} | {dtype} | {act} | {rec['speedup']:.3f} | {rec['speedup_wall']:.3f} | "
                              f"{dev['plain']:.3f} | {dev['ours']:.3f} | {dev['gemms']:.3f} | "
                              f"{rec['ours_over_gemms']:.3f} | {rec['plain_over_gemms']:.3f} |", flush=True)
                    else:
                        dev, wall, wd = _step_cell(m, d, dtype, act)
                        rec.update(plain_ms=dev["plain"], ours_ms=dev["ours"], speedup=dev["plain"] / dev["ours"],
                                   speedup_wall=wall["plain"] / wall["ours"], speedup_wall_donated=wd["plain"] / wd["ours"],
                                   wall_ms=wall, wall_donated_ms=wd)  # fmt: skip
                        print(f"| {shape} | {dtype} | {act} | {rec['speedup']:.3f} | {rec['speedup_wall']:.3f} | "
                              f"{rec['speedup_wall_donated']:.3f} | {dev['plain']:.3f} | {dev['ours']:.3f} |", flush=True)
                    records.append(rec)
    for mode in args.modes.split(","):
        rs = [r for r in records if r["mode"] == mode]
        geo = lambda k: float(np.exp(np.mean([np.log(r[k]) for r in rs])))
        keys = ["speedup", "speedup_wall"] + (["ours_over_gemms", "plain_over_gemms"] if mode == "vjp"
                                              else ["speedup_wall_donated"])  # fmt: skip
        print(f"{mode} geo-means: " + ", ".join(f"{k} {geo(k):.3f}" for k in keys)
              + f"; lowest speed-up {min(r['speedup'] for r in rs):.3f} (device), {min(r['speedup_wall'] for r in rs):.3f} (wall)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, baseline="plain.py",
                           records=records), f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
