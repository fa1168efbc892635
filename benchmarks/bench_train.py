"""Whole training steps, jax_regemm against plain Flax, side by side in one process.

The step a user writes: a Flax MLP (every hidden layer Dense + activation, a
linear last layer), a mean-squared loss, optax AdamW, all in one jax.jit.
Plain is `nn.Dense` followed by the activation; ours is `jax_regemm.flax.MLP`
(the same parameters, the same initial values). Each step is timed two ways:
device time (profiler timeline of one step, devtime.py) and wall clock (a
pipelined loop of steps, blocked once at the end, per step). Also the
compiled step's temporary memory. Median of repeats after warm-up.

    python benchmarks/bench_train.py --out benchmarks/results/h100_train.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_regemm as rg
from devtime import device_times_ms, named_jit

ACT = {"gelu": lambda x: nn.gelu(x, approximate=True), "relu": nn.relu, "silu": nn.silu}
# (batch rows, width, layers)
SHAPES = {"quick": [(8192, 1024, 4), (32768, 512, 12)], "full": [(8192, 1024, 4), (32768, 512, 12), (4096, 4096, 4), (16384, 2048, 6)]}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


class PlainMLP(nn.Module):
    width: int
    layers: int
    act: str
    dtype: object

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = nn.Dense(self.width, dtype=self.dtype, param_dtype=self.dtype, name=f"Dense_{i}")(x)
            if i < self.layers - 1:
                x = ACT[self.act](x)
        return x


def ours_mlp(width, layers, act, dtype):
    from jax_regemm.flax import MLP

    return MLP(features=[width] * layers, activation=act, dtype=dtype, param_dtype=dtype)


def make_step(model, opt):
    def step(params, opt_state, x, y):
        def loss(p):
            return jnp.mean((model.apply(p, x).astype(jnp.float32) - y) ** 2)

        l, g = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, l

    return step


def wall_ms(step, state, x, y, n=30, repeats=5):
    params, opt_state = state
    for _ in range(3):
        params, opt_state, l = step(params, opt_state, x, y)
    jax.block_until_ready(l)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            params, opt_state, l = step(params, opt_state, x, y)
        jax.block_until_ready(l)
        ts.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(ts)


def run(shapes, acts, dtypes, repeats):
    records = []
    for rows, width, layers in shapes:
        for dname in dtypes:
            dtype = DTYPES[dname]
            rng = np.random.default_rng(0)
            x = jnp.asarray(rng.standard_normal((rows, width)), dtype)
            y = jnp.asarray(rng.standard_normal((rows, width)), jnp.float32)
            for act in acts:
                plain = PlainMLP(width, layers, act, dtype)
                ours = ours_mlp(width, layers, act, dtype)
                params = plain.init(jax.random.PRNGKey(0), x[:1])
                params_ours = jax.tree.map(lambda v: v, {"params": {k: v for k, v in params["params"].items()}})
                opt = optax.adamw(1e-3)
                tag = f"{rows}x{width}x{layers}_{dname}_{act}"
                steps, cases, mem = {}, {}, {}
                for side, model, p in (("xla", plain, params), ("regemm", ours, params_ours)):
                    step = named_jit(make_step(model, opt), f"{tag}_{side}")
                    st = (p, opt.init(p))
                    steps[side] = (step, st)
                    cases[side] = (step, [(st[0], st[1], x, y)])
                    mem[side] = step.lower(st[0], st[1], x, y).compile().memory_analysis().temp_size_in_bytes
                dev = device_times_ms(cases, repeats=repeats)
                wall = {side: wall_ms(step, st, x, y) for side, (step, st) in steps.items()}
                rec = dict(shape=[rows, width, layers], dtype=dname, act=act,
                           xla_ms=dev["xla"], regemm_ms=dev["regemm"], speedup=dev["xla"] / dev["regemm"],
                           xla_wall_ms=wall["xla"], regemm_wall_ms=wall["regemm"],
                           wall_speedup=wall["xla"] / wall["regemm"],
                           xla_temp_bytes=mem["xla"], regemm_temp_bytes=mem["regemm"])  # fmt: skip
                records.append(rec)
                print(f"{tag:28s} device {rec['xla_ms']:8.3f} / {rec['regemm_ms']:8.3f} ms = {rec['speedup']:.3f}x   "
                      f"wall {rec['xla_wall_ms']:8.3f} / {rec['regemm_wall_ms']:8.3f} = {rec['wall_speedup']:.3f}x   "
                      f"temp {mem['regemm'] / max(mem['xla'], 1):.2f}x", flush=True)  # fmt: skip
    return records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="quick", choices=sorted(SHAPES))
    ap.add_argument("--acts", default="gelu,relu,silu")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    records = run(SHAPES[args.grid], args.acts.split(","), args.dtypes.split(","), args.repeats)
    geo = float(np.exp(np.mean([np.log(r["speedup"]) for r in records])))
    geo_wall = float(np.exp(np.mean([np.log(r["wall_speedup"]) for r in records])))
    print(f"geo-mean speed-up: device {geo:.3f}x, wall {geo_wall:.3f}x ({len(records)} steps)")
    if args.out:
        meta = dict(label=args.label, device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                    geo_mean_speedup=geo, geo_mean_wall_speedup=geo_wall)  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)


if __name__ == "__main__":
    main()
