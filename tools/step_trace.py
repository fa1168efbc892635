"""Where one training step's device time goes, kernel by kernel: benchmarks/bench_train.py's
step (Flax MLP + optax AdamW) for its floor (no bias, no activation), XLA's MLP and ours, each
kernel name's device time summed over the step (the profiler's timeline, tools/kernel_trace.py).

    python tools/step_trace.py 32768x512x12:bf16:relu [--sides floor,xla,ours,ours_nobias] [--list]

ours_nobias: jax_regemm's MLP with use_bias=False (the backward without the bias gradient).
Environment variables that choose a lowering (REGEMM_FUSED_DGRAD=1, ...) apply to every side
that is ours.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]
from bench_train import DTYPES, PlainMLP, make_step, ours_mlp  # noqa: E402
from kernel_trace import trace  # noqa: E402


def model_of(side, width, layers, act, dtype):
    if side == "floor":
        return PlainMLP(width, layers, "floor", dtype)
    if side == "xla":
        return PlainMLP(width, layers, act, dtype)
    if side == "ours":
        return ours_mlp(width, layers, act, dtype)
    from jax_regemm.flax import MLP

    return MLP(features=[width] * layers, activation=act, dtype=dtype, param_dtype=dtype, use_bias=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("steps", help="ROWSxWIDTHxLAYERS:DTYPE:ACT, comma-separated")
    p.add_argument("--sides", default="floor,xla,ours")
    p.add_argument("--list", action="store_true", help="also every kernel of ours in order (gap, duration)")
    args = p.parse_args()
    for spec in args.steps.split(","):
        shape, dname, act = spec.split(":")
        rows, width, layers = (int(v) for v in shape.split("x"))
        dtype = DTYPES[dname]
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((rows, width)), dtype)
        y = jnp.asarray(rng.standard_normal((rows, width)), jnp.float32)
        opt = optax.adamw(1e-3)
        for side in args.sides.split(","):
            model = model_of(side, width, layers, act, dtype)
            params = model.init(jax.random.PRNGKey(0), x[:1])
            run, _, _ = trace(jax.jit(make_step(model, opt)), (params, opt.init(params), x, y))
            t0, t1 = run[0][0], max(e[1] for e in run)
            busy = collections.defaultdict(lambda: [0.0, 0])
            for s, e, name in run:  # kernels of one kind share a name up to their numbers
                b = busy[re.sub(r"\d+", "#", name)[:70]]
                b[0] += (e - s) / 1e3
                b[1] += 1
            total = sum(v[0] for v in busy.values())
            print(f"== {spec} {side}: span {(t1 - t0) / 1e3:.1f} us, kernels {total:.1f} us, {len(run)} kernels")
            for name, (us, count) in sorted(busy.items(), key=lambda kv: -kv[1][0])[:25]:
                print(f"  {us:8.1f} us {count:4d}x  {name}")
            if args.list and side.startswith("ours"):
                end = t0
                for s, e, name in run:
                    print(f"    +{(s - end) / 1e3:6.1f} {(e - s) / 1e3:7.1f}  {name[:100]}")
                    end = max(end, e)


if __name__ == "__main__":
    main()
