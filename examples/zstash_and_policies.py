"""The explicit Z-stash API, and what each residual policy keeps for the backward.

    python examples/zstash_and_policies.py [--m 1024 --k 512 --n 2048]

1. `gemm_bias_act_fwd` returns Y = act(Z) and the pre-activation Z; later,
   `gemm_bias_act_bwd` turns (gY, Z) into (gA, gB, gBias, gC) without redoing
   the forward. Checked here against `jax.vjp` of the pure-JAX reference.
2. Under `jax.grad` the policy `save=` decides the residuals: "z" keeps Z
   (an extra M x N array), "y" keeps only Y (which is the layer's output and,
   in a network, the next layer's input, so it costs nothing extra),
   "recompute" keeps only the inputs and pays one more GEMM in the backward.
   The table reads the residuals straight out of the `jax.vjp` closure and
   counts the GEMMs of the forward + backward: jax_regemm calls, and on the GPU
   XLA's own dots, which run the plain dgrad and wgrad GEMMs there.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_regemm as rg
from jax_regemm.reference import GRAD_FROM_Y


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def zstash_demo(x, w, b, act="gelu"):
    # True f32 on both sides: on a GPU the default precision is TF32 (errors near 1e-4).
    with jax.default_matmul_precision("highest"):
        _zstash_check(x, w, b, act)


def _zstash_check(x, w, b, act):
    y, z = rg.gemm_bias_act_fwd(x, w, b, act=act)  # forward, keeping Z
    gy = jax.random.normal(jax.random.key(9), y.shape, y.dtype)  # some upstream gradient
    ga, gw, gb, gc = rg.gemm_bias_act_bwd(x, w, gy, z, b, act=act)  # backward from the stash
    assert gc is None  # no C was given

    ref = lambda x, w, b: rg.reference.gemm_bias_act(x, w, b, act=act, bias_kind="per_col", return_z=True)
    (y_ref, z_ref), vjp = jax.vjp(ref, x, w, b)
    want = vjp((gy, jnp.zeros_like(z_ref)))
    errors = {"Y": rel(y, y_ref), "Z": rel(z, z_ref)}
    errors.update({f"g{name}": rel(g, r) for name, g, r in zip(("A", "B", "bias"), (ga, gw, gb), want)})
    print(f"Z stash, act={act}: relative error vs jax.vjp of the reference")
    for name, err in errors.items():
        print(f"  {name:5s} {err:.2e}")
    assert max(errors.values()) < 1e-5, errors


def residuals(x, w, b, act, save):
    """(description, extra bytes) of what jax.vjp keeps beyond the inputs and the output."""
    f = lambda x, w, b: rg.dense(x, w, b, act=act, save=save)
    y, vjp = jax.vjp(f, x, w, b)
    kept, extra = [], 0
    for r in jax.tree.leaves(vjp):
        if r is y:
            kept.append("Y")
        elif any(r is i for i in (x, w, b)):
            kept.append({id(x): "x", id(w): "w", id(b): "b"}[id(r)])
        else:
            kept.append("Z" if r.shape == y.shape else f"{r.dtype}{list(r.shape)}")
            extra += r.size * r.dtype.itemsize
    return ", ".join(kept), extra


def gemm_calls(x, w, b, act, save):
    """GEMMs in the lowered value_and_grad (forward + dgrad + wgrad [+ recompute]): regemm
    calls and XLA dots."""
    loss = lambda x, w, b: jnp.sum(rg.dense(x, w, b, act=act, save=save))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, w, b).as_text()
    return text.count(f"@{rg._targets.GEMM.name}(") + text.count("stablehlo.dot_general")


def policy_table(x, w, b, acts=("relu", "tanh", "gelu", "silu")):
    """Prints the table; returns its rows as (act, save, resolved, kept, extra bytes, GEMM calls)."""
    m, n = x.shape[0], w.shape[1]
    print(f"\nResidual policies, one layer x[{m},{x.shape[1]}] @ w[{x.shape[1]},{n}] + b, f32")
    print("| act | save | resolves to | residuals | beyond inputs and Y | GEMMs fwd+bwd |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for act in acts:
        for save in rg.SAVE_POLICIES:
            if save == "y" and act not in GRAD_FROM_Y:
                continue  # act' cannot be derived from Y: a ValueError says so
            resolved = ("y" if act in GRAD_FROM_Y else "z") if save == "auto" else save
            kept, extra = residuals(x, w, b, act, save)
            rows.append((act, save, resolved, kept, extra, gemm_calls(x, w, b, act, save)))
            print("| {} | {} | {} | {} | {:.2f} MiB | {} |".format(*rows[-1][:4], extra / 2**20, rows[-1][5]))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, default=1024)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--n", type=int, default=2048)
    args = p.parse_args(argv)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (args.m, args.k), jnp.float32)
    w = jax.random.normal(keys[1], (args.k, args.n), jnp.float32) / np.sqrt(args.k)
    b = jax.random.normal(keys[2], (args.n,), jnp.float32)
    zstash_demo(x, w, b)
    return policy_table(x, w, b)


if __name__ == "__main__":
    main()
