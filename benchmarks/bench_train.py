"""Whole training steps, jax_regemm against plain Flax, side by side in one process.

The step a user writes: a Flax MLP (every hidden layer Dense + activation, a
linear last layer), a mean-squared loss, optax AdamW, all in one jax.jit.
Plain is `nn.Dense` followed by the activation; ours is `jax_regemm.flax.MLP`
(the same parameters, the same initial values). The floor is the plain step
with no bias and no activation: its GEMMs, the loss and AdamW only, which no
epilogue fusion can beat without a faster GEMM. Each step is timed two ways:
device time (profiler timeline of one step, devtime.py) and wall clock (a
pipelined loop of steps, blocked once at the end, per step; the sides' loops take turns). Also the
compiled step's temporary memory. Median of repeats after warm-up.

--ab NAME=VAR=VALUE adds a side: ours with the environment variable VAR set to
VALUE while its step is lowered and while it runs (an A/B in the same process):
variables read at lowering (REGEMM_DACT, REGEMM_PLAIN_GEMM) and those the CUDA
module reads at every call (REGEMM_TUNE_MARGIN, REGEMM_FUSED_DGRAD,
REGEMM_VARIANT, ...; they are part of the tuner's signatures, so each side
keeps its own picks). Every run of such a side is blocked on before the
variable is restored, its wall-clock loops included (one block a loop).

--dense adds side "dense": the plain MLP with each `nn.Dense` + activation
swapped for `jax_regemm.flax.Dense` (a user's per-layer swap; its backward
folds across layers at lowering, jax_regemm/_fold.py). An --ab side
whose NAME starts with "dense" runs that model too.

--no-bias: every Dense layer without bias on both sides (the backward without
the bias gradient: where the fused dgrad kernel pays, docs/performance.md).

--devices N: data-parallel over N devices, as a user scales with JAX's
partitioner: the batch (x, y) sharded over a mesh axis "data", the parameters
and optimizer state replicated, the same jitted step. Each record then carries
the count of each collective in the compiled steps (ours must add none).

--donate: the wall-clock loops run the step with its parameters and optimizer
state donated (`donate_argnums`), as a training loop does. Then a step's buffers
keep their addresses, and XLA replays the CUDA graph of a captured step without
recording our custom calls again (it records a custom call anew, calling its
handler, when its buffers are at addresses its cache of recordings has not seen).

    python benchmarks/bench_train.py --out benchmarks/results/h100_train.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import plain as PLAIN
from devtime import device_times_ms, named_jit, turns

ACT = PLAIN.ACT  # jax.nn's activations (plain.py)
# (batch rows, width, layers)
# "floor": the shapes of ../shared/baselines/xla_train_step_floor_h100_2026-11-25.txt.
SHAPES = {"quick": [(8192, 1024, 4), (32768, 512, 12)],
          "full": [(8192, 1024, 4), (32768, 512, 12), (4096, 4096, 4), (16384, 2048, 6)],
          "floor": [(8192, 3072, 4), (4096, 2048, 8), (32768, 512, 12), (16384, 1024, 8)]}  # fmt: skip
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


class PlainMLP(nn.Module):
    width: int
    layers: int
    act: str  # "floor": no bias and no activation
    dtype: object
    use_bias: bool = True
    regemm_dense: bool = False  # each nn.Dense + activation as one jax_regemm.flax.Dense: a user's per-layer swap

    @nn.compact
    def __call__(self, x):
        from jax_regemm.flax import Dense

        floor = self.act == "floor"
        for i in range(self.layers):
            act = "none" if floor or i == self.layers - 1 else self.act
            kw = dict(use_bias=self.use_bias and not floor, dtype=self.dtype, param_dtype=self.dtype, name=f"Dense_{i}")
            if self.regemm_dense:
                x = Dense(self.width, activation=act, **kw)(x)
            else:
                x = nn.Dense(self.width, **kw)(x)
                x = x if act == "none" else ACT[act](x)
        return x


def ours_mlp(width, layers, act, dtype, use_bias=True):
    from jax_regemm.flax import MLP

    return MLP(features=[width] * layers, activation=act, dtype=dtype, param_dtype=dtype, use_bias=use_bias)


def make_step(model, opt):
    def step(params, opt_state, x, y):
        def loss(p):
            return jnp.mean((model.apply(p, x).astype(jnp.float32) - y) ** 2)

        l, g = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, l

    return step


def wall_ms(steps, x, y, n=30, repeats=5, envs=None):
    """{side: (compiled step, (params, opt_state))} -> {side: median ms per step of a
    pipelined loop of n steps}, each side's loops run with envs[side] = (VAR, VALUE)
    set, if given. The sides' loops take turns, repeat by repeat: run one side's loops
    after the other's and the later side meets a hotter GPU (on an H100 the 4096x4096x4
    bf16 loops run at the power cap, the SM clock at 1590-1725 MHz instead of 1980),
    which cost the last side up to 4% a step. The order is a fresh shuffle each repeat
    (devtime.turns), so that no side always follows the same one."""
    envs = envs or {}
    state = {}
    for side, (step, (params, opt_state)) in steps.items():
        params, opt_state = jax.tree.map(jnp.copy, (params, opt_state))  # the step may donate them
        with _env(*envs.get(side, ("", ""))):
            for _ in range(3):
                params, opt_state, l = step(params, opt_state, x, y)
            jax.block_until_ready(l)
        state[side] = (params, opt_state)
    ts = {side: [] for side in steps}
    for side in turns(steps, repeats):
        step = steps[side][0]
        params, opt_state = state[side]
        with _env(*envs.get(side, ("", ""))):
            t0 = time.perf_counter()
            for _ in range(n):
                params, opt_state, l = step(params, opt_state, x, y)
            jax.block_until_ready(l)
            ts[side].append((time.perf_counter() - t0) / n * 1e3)
        state[side] = (params, opt_state)
    return {side: statistics.median(t) for side, t in ts.items()}


def _with_env(fn, var, value):
    """fn, run with VAR=VALUE set and blocked on before it is restored."""
    if not var:
        return fn

    def run(*args):
        with _env(var, value):
            return jax.block_until_ready(fn(*args))

    return run


@contextlib.contextmanager
def _env(var, value):
    old = os.environ.get(var)
    if var:
        os.environ[var] = value
    try:
        yield
    finally:
        if var and old is None:
            os.environ.pop(var)
        elif var:
            os.environ[var] = old


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(compiled):
    """The count of each collective in a compiled step's HLO."""
    text = compiled.as_text()
    return {c: text.count(f" {c}(") + text.count(f" {c}-start(") for c in COLLECTIVES}


def run(shapes, acts, dtypes, repeats, ab, use_bias=True, devices=1, donate=False):
    records = []
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,)) if devices > 1 else None
    put = (lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))) if mesh else (lambda v, spec: v)
    for rows, width, layers in shapes:
        for dname in dtypes:
            dtype = DTYPES[dname]
            rng = np.random.default_rng(0)
            x0 = jnp.asarray(rng.standard_normal((1, width)), dtype)  # for init
            x = put(jnp.asarray(rng.standard_normal((rows, width)), dtype), P("data"))
            y = put(jnp.asarray(rng.standard_normal((rows, width)), jnp.float32), P("data"))
            for act in acts:
                plain = PlainMLP(width, layers, act, dtype, use_bias)
                floor = PlainMLP(width, layers, "floor", dtype)
                params = put(plain.init(jax.random.PRNGKey(0), x0), P())
                opt = optax.adamw(1e-3)
                tag = f"{rows}x{width}x{layers}_{dname}_{act}" + ("" if use_bias else "_nobias")
                sides = {"floor": (floor, put(floor.init(jax.random.PRNGKey(0), x0), P()), "", ""),
                         "xla": (plain, params, "", ""),
                         "regemm": (ours_mlp(width, layers, act, dtype, use_bias), params, "", "")}  # fmt: skip
                for name, var, value in ab:
                    model = PlainMLP(width, layers, act, dtype, use_bias, True) if name.startswith("dense") else sides["regemm"][0]
                    sides[name] = (model, params, var, value)
                steps, cases, mem, coll = {}, {}, {}, {}
                for side, (model, p, var, value) in sides.items():
                    st = (p, put(opt.init(p), P()))
                    with _env(var, value):  # read when the step is lowered
                        step = named_jit(make_step(model, opt), f"{tag}_{side}").lower(st[0], st[1], x, y).compile()
                        looped = step
                        if donate:
                            looped = named_jit(make_step(model, opt), f"{tag}_{side}_donated", donate_argnums=(0, 1))
                            looped = looped.lower(st[0], st[1], x, y).compile()
                    steps[side] = (looped, st)
                    cases[side] = (_with_env(step, var, value), [(st[0], st[1], x, y)])
                    mem[side] = step.memory_analysis().temp_size_in_bytes
                    coll[side] = collectives(step)
                dev = device_times_ms(cases, repeats=repeats)
                wall = wall_ms(steps, x, y, envs={n: (v, val) for n, (_, _, v, val) in sides.items() if v})
                rec = dict(shape=[rows, width, layers], dtype=dname, act=act, bias=use_bias,
                           xla_ms=dev["xla"], regemm_ms=dev["regemm"], floor_ms=dev["floor"],
                           speedup=dev["xla"] / dev["regemm"],
                           xla_over_floor=dev["xla"] / dev["floor"], regemm_over_floor=dev["regemm"] / dev["floor"],
                           xla_wall_ms=wall["xla"], regemm_wall_ms=wall["regemm"], floor_wall_ms=wall["floor"],
                           wall_speedup=wall["xla"] / wall["regemm"],
                           xla_temp_bytes=mem["xla"], regemm_temp_bytes=mem["regemm"], devices=devices,
                           donated=donate)  # fmt: skip
                if mesh:
                    rec.update(xla_collectives=coll["xla"], regemm_collectives=coll["regemm"])
                for name, var, value in ab:
                    rec[name] = dict(env=f"{var}={value}", ms=dev[name], wall_ms=wall[name], temp_bytes=mem[name],
                                     over_floor=dev[name] / dev["floor"], speedup=dev["xla"] / dev[name])  # fmt: skip
                records.append(rec)
                extra = "".join(f"   {n} {dev[n]:.3f} ms ({dev[n] / dev['floor']:.3f}x floor)" for n, _, _ in ab)
                print(f"{tag:28s} device {rec['xla_ms']:8.3f} / {rec['regemm_ms']:8.3f} ms = {rec['speedup']:.3f}x   "
                      f"floor {rec['floor_ms']:.3f} ms: xla {rec['xla_over_floor']:.3f}x ours {rec['regemm_over_floor']:.3f}x   "
                      f"wall {rec['xla_wall_ms']:8.3f} / {rec['regemm_wall_ms']:8.3f} = {rec['wall_speedup']:.3f}x   "
                      f"temp {mem['regemm'] / max(mem['xla'], 1):.2f}x{extra}", flush=True)  # fmt: skip
                if mesh:
                    print(f"{'':28s} collectives xla {coll['xla']} ours {coll['regemm']}", flush=True)
    return records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="quick", choices=sorted(SHAPES))
    ap.add_argument("--acts", default="gelu,relu,silu")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--label", default="")
    ap.add_argument("--no-bias", action="store_true", help="Dense layers without bias on both sides (the floor has none anyway)")
    ap.add_argument("--ab", action="append", default=[], help="NAME=VAR=VALUE: ours with VAR=VALUE (lowered and run), as side NAME")
    ap.add_argument("--dense", action="store_true", help="adds side 'dense': each layer a jax_regemm.flax.Dense (a user's per-layer swap)")
    ap.add_argument("--devices", type=int, default=1, help="data-parallel over this many devices (the batch sharded)")
    ap.add_argument("--donate", action="store_true", help="the wall-clock loops donate params and optimizer state")
    args = ap.parse_args()
    ab = [("dense", "", "")] * args.dense + [tuple(a.split("=", 2)) for a in args.ab]
    records = run(SHAPES[args.grid], args.acts.split(","), args.dtypes.split(","), args.repeats, ab, not args.no_bias,
                  args.devices, args.donate)  # fmt: skip
    geo = float(np.exp(np.mean([np.log(r["speedup"]) for r in records])))
    geo_wall = float(np.exp(np.mean([np.log(r["wall_speedup"]) for r in records])))
    geo_floor = {k: float(np.exp(np.mean([np.log(r[f"{k}_over_floor"]) for r in records]))) for k in ("xla", "regemm")}
    print(f"geo-mean speed-up: device {geo:.3f}x, wall {geo_wall:.3f}x ({len(records)} steps); "
          f"step/floor: xla {geo_floor['xla']:.3f}x, ours {geo_floor['regemm']:.3f}x")
    for name, _, _ in ab:
        g = float(np.exp(np.mean([np.log(r[name]["speedup"]) for r in records])))
        gf = float(np.exp(np.mean([np.log(r[name]["over_floor"]) for r in records])))
        print(f"  {name}: speed-up {g:.3f}x, step/floor {gf:.3f}x")
    if args.out:
        meta = dict(label=args.label, device=str(jax.devices()[0].device_kind), devices=args.devices,
                    donated=args.donate, jax=jax.__version__,
                    geo_mean_speedup=geo, geo_mean_wall_speedup=geo_wall,
                    geo_mean_xla_over_floor=geo_floor["xla"], geo_mean_regemm_over_floor=geo_floor["regemm"])  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)


if __name__ == "__main__":
    main()
