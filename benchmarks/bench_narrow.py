"""Narrow MLPs (neural fields, small policies: widths 16-128 on 2^16-2^22 rows) against plain Flax.

A cell is rows x in x width x hidden x out: `hidden` layers Dense(width) + activation on an
input of `in` features, then a linear Dense(out). Plain is flax's nn.Dense (input dtype) + the
jax.nn activation (plain.py); ours is jax_regemm.flax.MLP with the same parameters. Per cell, in
one process, all jitted:
  - "step": a training step (mean-squared loss, optax Adam): device time (the profiler's GPU
    timeline, devtime.py), wall clock of a pipelined loop with the train state not donated and
    donated (sides in a shuffled order each repeat), and the compiled step's temporary memory;
  - "infer": the forward alone: device time and wall clock.
Speed-up = plain / ours. --ab NAME=VAR=VALUE adds a side: ours with VAR=VALUE set while its
programs are lowered and run (e.g. kernels=REGEMM_SMALL=regemm: every layer on regemm's calls).

    python benchmarks/bench_narrow.py [--cells 2^20x32x64x4x16,...] [--modes step,infer]
        [--acts relu] [--dtypes bfloat16] [--ab NAME=VAR=VALUE] [--json results/h200_narrow.json]
"""

from __future__ import annotations

import argparse
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import plain as PLAIN
from bench_train import _env, _with_env, make_step, wall_ms
from devtime import device_times_ms, named_jit, pipelined_ms

# The four cells (2^18/2^20 rows, widths 32-128), then widths 16-128 at 2^16-2^22 rows.
CELLS = ("2^18x32x64x4x16,2^20x32x64x4x16,2^18x64x128x6x16,2^20x32x32x3x16,"
         "2^20x32x16x4x16,2^20x32x128x4x16,2^18x32x128x4x16,2^22x32x64x4x16,"
         "2^16x32x16x4x16,2^16x32x64x4x16,2^16x32x128x4x16")  # fmt: skip


def parse_cell(text):
    rows, k, width, hidden, out = text.split("x")
    rows = 2 ** int(rows[2:]) if rows.startswith("2^") else int(rows)
    return rows, int(k), int(width), int(hidden), int(out)


class PlainNarrow(nn.Module):
    """The narrow MLP as a user writes it in flax."""

    width: int
    hidden: int
    out: int
    act: str
    dtype: object

    @nn.compact
    def __call__(self, x):
        for _ in range(self.hidden):
            x = PLAIN.ACT[self.act](nn.Dense(self.width, dtype=self.dtype, param_dtype=self.dtype)(x))
        return nn.Dense(self.out, dtype=self.dtype, param_dtype=self.dtype)(x)


def _sides(cell, act, dtype, ab):
    from jax_regemm.flax import MLP

    rows, k, width, hidden, out = cell
    ours = MLP(features=[width] * hidden + [out], activation=act, dtype=dtype, param_dtype=dtype)
    sides = {"plain": (PlainNarrow(width, hidden, out, act, dtype), "", ""), "ours": (ours, "", "")}
    for name, var, value in ab:
        sides[name] = (ours, var, value)
    return sides


def _device(cases):
    """Device times; on the CPU, where a call blocks until done, the wall clock."""
    return pipelined_ms(cases) if jax.default_backend() == "cpu" else device_times_ms(cases)


def _step_cell(cell, act, dtype, ab):
    rows, k, width, hidden, out = cell
    x = jax.random.normal(jax.random.PRNGKey(1), (rows, k), dtype)
    y = jax.random.normal(jax.random.PRNGKey(2), (rows, out), jnp.float32)
    opt = optax.adam(1e-3)
    sides = _sides(cell, act, dtype, ab)
    params = sides["plain"][0].init(jax.random.PRNGKey(0), x[:1])  # the same names and values on every side
    steps, donated, cases, mem = {}, {}, {}, {}
    for name, (model, var, value) in sides.items():
        state = (params, opt.init(params))
        with _env(var, value):  # read when the step is lowered
            step = named_jit(make_step(model, opt), f"step_{name}").lower(*state, x, y).compile()
            don = named_jit(make_step(model, opt), f"donated_{name}", donate_argnums=(0, 1)).lower(*state, x, y).compile()
        steps[name], donated[name] = (step, state), (don, state)
        cases[name] = (_with_env(step, var, value), [(*state, x, y)])
        mem[name] = step.memory_analysis().temp_size_in_bytes
    envs = {n: (v, val) for n, (_, v, val) in sides.items() if v}
    dev = _device(cases)
    return dict(device_ms=dev, wall_ms=wall_ms(steps, x, y, envs=envs),
                wall_donated_ms=wall_ms(donated, x, y, envs=envs), temp_bytes=mem)  # fmt: skip


def _infer_cell(cell, act, dtype, ab):
    rows, k, width, hidden, out = cell
    xs = [jax.random.normal(jax.random.PRNGKey(s), (rows, k), dtype) for s in range(3)]
    sides = _sides(cell, act, dtype, ab)
    params = sides["plain"][0].init(jax.random.PRNGKey(0), xs[0][:1])
    cases = {}
    for name, (model, var, value) in sides.items():
        with _env(var, value):
            fwd = named_jit(lambda p, x, model=model: model.apply(p, x), f"infer_{name}").lower(params, xs[0]).compile()
        cases[name] = (_with_env(fwd, var, value), [(params, x) for x in xs])
    return dict(device_ms=_device(cases), wall_ms=pipelined_ms(cases))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", default=CELLS)
    p.add_argument("--acts", default="relu")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--modes", default="step,infer")
    p.add_argument("--ab", action="append", default=[], help="NAME=VAR=VALUE: ours with VAR=VALUE, as side NAME")
    p.add_argument("--json")
    args = p.parse_args()
    ab = [tuple(a.split("=", 2)) for a in args.ab]
    others = [name for name, _, _ in ab]
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}; speed-up = plain / ours"
          + "".join(f"; {n}: {v}={val}" for n, v, val in ab))  # fmt: skip
    records = []
    for mode in args.modes.split(","):
        extra = "".join(f" {n} device | {n} wall |" for n in others)
        if mode == "step":
            print("\n| rows x in x width x hidden x out | dtype | act | speed-up device | wall | wall, donated | "
                  f"plain ms | ours ms | temp ours / plain |{extra}\n|" + " --- |" * (9 + 2 * len(others)))
        else:
            print(f"\n| rows x in x width x hidden x out | dtype | act | speed-up device | wall | plain ms | ours ms |"
                  f"{extra}\n|" + " --- |" * (7 + 2 * len(others)))
        for text in args.cells.split(","):
            cell = parse_cell(text)
            for dtype in args.dtypes.split(","):
                for act in args.acts.split(","):
                    r = (_step_cell if mode == "step" else _infer_cell)(cell, act, jnp.dtype(dtype), ab)
                    dev, wall = r["device_ms"], r["wall_ms"]
                    rec = dict(mode=mode, cell=text, dtype=dtype, act=act, **r,
                               speedup=dev["plain"] / dev["ours"], speedup_wall=wall["plain"] / wall["ours"])  # fmt: skip
                    cols = "".join(f" {dev['plain'] / dev[n]:.3f} | {wall['plain'] / wall[n]:.3f} |" for n in others)
                    if mode == "step":
                        wd, mem = r["wall_donated_ms"], r["temp_bytes"]
                        rec["speedup_wall_donated"] = wd["plain"] / wd["ours"]
                        print(f"| {text} | {dtype} | {act} | {rec['speedup']:.3f} | {rec['speedup_wall']:.3f} | "
                              f"{rec['speedup_wall_donated']:.3f} | {dev['plain']:.3f} | {dev['ours']:.3f} | "
                              f"{mem['ours'] / max(mem['plain'], 1):.2f} |{cols}", flush=True)  # fmt: skip
                    else:
                        print(f"| {text} | {dtype} | {act} | {rec['speedup']:.3f} | {rec['speedup_wall']:.3f} | "
                              f"{dev['plain']:.3f} | {dev['ours']:.3f} |{cols}", flush=True)  # fmt: skip
                    records.append(rec)
                    _write(args.json, ab, records)  # (after every cell: a call cut off keeps what it measured)
    for mode in args.modes.split(","):
        rs = [r for r in records if r["mode"] == mode]
        keys = ["speedup", "speedup_wall"] + (["speedup_wall_donated"] if mode == "step" else [])
        geo = {k: float(np.exp(np.mean([np.log(r[k]) for r in rs]))) for k in keys}
        print(f"{mode}: geo-mean " + ", ".join(f"{k} {v:.3f}" for k, v in geo.items())
              + "; lowest " + ", ".join(f"{k} {min(r[k] for r in rs):.3f}" for k in keys))


def _write(path, ab, records):
    if path:
        with open(path, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, baseline="plain.py",
                           ab={n: f"{v}={val}" for n, v, val in ab}, records=records), f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
