"""CPU: jax_regemm vs XLA's own act(x @ w + b), same process, median of repeats.

    python benchmarks/cpu_vs_xla.py [--size 512] [--acts relu,gelu]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_regemm as rg
from devtime import host_median_ms as median_ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--acts", default="none,relu,gelu,sigmoid,silu")
    args = p.parse_args()
    n = args.size
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (n, n), jnp.float32)
    w = jax.random.normal(k[1], (n, n), jnp.float32) / np.sqrt(n)
    b = jax.random.normal(k[2], (n,), jnp.float32)
    print(f"device: {jax.devices()[0]}  M=K=N={n} f32")
    print("| act | mode | regemm ms | xla ms | regemm/xla |")
    print("| --- | --- | --- | --- | --- |")
    for act in args.acts.split(","):
        ours = jax.jit(lambda x, w, b: rg.dense(x, w, b, act=act))
        xla = jax.jit(lambda x, w, b: rg.reference.dense(x, w, b, act=act))
        loss = lambda f: jax.jit(jax.grad(lambda x, w, b: jnp.sum(f(x, w, b) ** 2), argnums=(0, 1, 2)))
        for mode, fo, fx in (("fwd", ours, xla), ("fwd+bwd", loss(ours), loss(xla))):
            to, tx = median_ms(fo, x, w, b), median_ms(fx, x, w, b)
            print(f"| {act} | {mode} | {to:.3f} | {tx:.3f} | {to / tx:.2f} |")


if __name__ == "__main__":
    main()
