"""The program a user writes, the baseline of every benchmark here.

`act(x @ w + b)` in the input dtype with jax.nn's activations (what flax's `nn.Dense(dtype=...)`
followed by an activation computes), default XLA flags. Never the reference (`rg.reference`),
whose f32 epilogue makes XLA's program 2-2.5x its GEMMs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# docs/spec.md §3's names, as jax.nn writes them (leaky_relu's slope 0.01, the library's default).
ACT = {
    "none": lambda z: z,
    "relu": jax.nn.relu,
    "leaky_relu": lambda z: jax.nn.leaky_relu(z, 0.01),
    "gelu": lambda z: jax.nn.gelu(z, approximate=True),
    "gelu_erf": lambda z: jax.nn.gelu(z, approximate=False),
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "silu": jax.nn.silu,
}


def dense(x, w, b=None, *, act="none", precision=None):
    """act(x @ w + b) in x's dtype."""
    z = jnp.dot(x, w, precision=precision)
    return ACT[act](z if b is None else z + b)


def mlp(x, weights, biases=None, *, act="relu", final_act="none", precision=None):
    """The plain MLP block: `dense` per layer, `act` on the hidden layers, `final_act` on the last."""
    biases = [None] * len(weights) if biases is None else biases
    for i, (w, b) in enumerate(zip(weights, biases)):
        x = dense(x, w, b, act=final_act if i == len(weights) - 1 else act, precision=precision)
    return x
