"""The Equinox pattern: a per-example layer batched with jax.vmap.

Times jax.vmap(jax_regemm.equinox.Linear) against the same GEMM called once on
the whole batch (rg.gemm_bias_act with trans_b) and against eqx.nn.Linear +
activation under vmap (plain XLA), forward and grad w.r.t. the parameters, in
one process, median of repeats after warm-up. Equal times for the first two
mean the vmap became one GEMM over the batch (forward and backward).

    python benchmarks/eqx_vmap.py [--batch 2048 --fin 512 --fout 512]
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp

import jax_regemm as rg
from devtime import host_median_ms as median_ms
import jax_regemm.equinox as rg_eqx


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--fin", type=int, default=512)
    p.add_argument("--fout", type=int, default=512)
    p.add_argument("--act", default="gelu")
    a = p.parse_args()
    key = jax.random.key(0)
    ours = rg_eqx.Linear(a.fin, a.fout, activation=a.act, key=key)
    theirs = eqx.nn.Linear(a.fin, a.fout, key=key)
    x = jax.random.normal(jax.random.key(1), (a.batch, a.fin))
    act = lambda z: rg.reference.act_fwd(a.act, z)

    def batched(m, x):  # the whole batch in one call, by hand
        return rg.gemm_bias_act(x, m.weight, m.bias, act=a.act, trans_b=True)

    variants = {
        "vmap(jax_regemm.equinox.Linear)": lambda m, x: jax.vmap(m)(x),
        "one batched gemm_bias_act call": batched,
        "vmap(eqx.nn.Linear) + act (XLA)": lambda m, x: act(jax.vmap(m)(x)),
    }
    models = {"vmap(eqx.nn.Linear) + act (XLA)": theirs}
    print(f"device: {jax.devices()[0]}  batch={a.batch} in={a.fin} out={a.fout} act={a.act} f32")
    print("| variant | fwd ms | grad(params) ms |")
    print("| --- | --- | --- |")
    for name, f in variants.items():
        m = models.get(name, ours)
        params, static = eqx.partition(m, eqx.is_array)
        fwd = jax.jit(lambda p, x, f=f, s=static: f(eqx.combine(p, s), x))
        grad = jax.jit(jax.grad(lambda p, x, f=f, s=static: jnp.sum(f(eqx.combine(p, s), x) ** 2)))
        print(f"| {name} | {median_ms(fwd, params, x):.3f} | {median_ms(grad, params, x):.3f} |")


if __name__ == "__main__":
    main()
