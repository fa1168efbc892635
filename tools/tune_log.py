"""What the GPU tuner sees: every candidate's time for chosen layers.

Runs the forward (and, with --bwd, the forward+backward) of act(x @ w + b) once
per shape and activation with REGEMM_TUNE_LOG=1, so that the tuner prints each
way it timed (device time plus its host charge per extra launch) and its choice
(stderr), then prints the winners (rg.tuned()).

    python tools/tune_log.py --layers 128:1024:1024,4096:4096:1024 --acts relu,gelu
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("REGEMM_TUNE_LOG", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_regemm as rg  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="128:1024:1024,1024:1024:1024,2048:1024:1024,4096:4096:1024")
    p.add_argument("--acts", default="none,relu,gelu,sigmoid")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bwd", action="store_true")
    args = p.parse_args()
    dt = jnp.dtype(args.dtype)
    for shape in args.layers.split(","):
        m, k, n = (int(v) for v in shape.split(":"))
        ks = jax.random.split(jax.random.PRNGKey(m + k + n), 4)
        x = jax.random.normal(ks[0], (m, k), dt)
        w = (jax.random.normal(ks[1], (k, n)) / k**0.5).astype(dt)
        b = (0.1 * jax.random.normal(ks[2], (n,))).astype(dt)
        gy = jax.random.normal(ks[3], (m, n), dt)
        for act in args.acts.split(","):
            f = lambda x, w, b, act=act: rg.dense(x, w, b, act=act)
            jax.block_until_ready(jax.jit(f)(x, w, b))
            if args.bwd:
                g = lambda x, w, b, gy, f=f: jax.vjp(f, x, w, b)[1](gy)
                jax.block_until_ready(jax.jit(g)(x, w, b, gy))
    for sig, label in sorted(rg.tuned().items()):
        print(f"{label:34s} {sig}")


if __name__ == "__main__":
    main()
