"""Equinox layers: `Linear` (a drop-in `eqx.nn.Linear` with an activation) and `MLP`.

`Linear` subclasses `equinox.nn.Linear`: the constructor is Equinox's own, so
`weight` [out, in] and `bias` [out] have the same shapes, initial values
(uniform in ±1/sqrt(in) from the same key) and order, and a file written by
`eqx.tree_serialise_leaves` from one loads into the other. The new fields are
static. The product is act(W x + b) computed as one fused kernel, with x as the
row vector of a [1, in] @ W^T GEMM (W read transposed in place: trans_b).

Equinox users apply a layer per example and batch it with `jax.vmap`. Because
x is the GEMM's row operand and W has no batch dim, that vmap becomes one
GEMM whose rows are the batch, with W shared by stride: no loop, no copy of W.

Imported on demand (`import jax_regemm.equinox`): `import jax_regemm` alone
does not import Equinox.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .api import dense_layer, mlp_block


class Linear(eqx.nn.Linear):
    """`eqx.nn.Linear` followed by `activation`, fused into one kernel.

    Extra keyword arguments (all others are `eqx.nn.Linear`'s):
      activation: one of `jax_regemm.ACTIVATIONS` (default "none": exactly eqx.nn.Linear).
      save: residual kept for the backward, one of `jax_regemm.SAVE_POLICIES`.
      leaky_slope: the slope of "leaky_relu".
    """

    activation: str = eqx.field(static=True, default="none")
    save: str = eqx.field(static=True, default="auto")
    leaky_slope: float = eqx.field(static=True, default=0.01)

    def __init__(self, in_features, out_features, use_bias=True, dtype=None, *, activation="none", save="auto",
                 leaky_slope=0.01, key):  # fmt: skip
        super().__init__(in_features, out_features, use_bias, dtype, key=key)
        self.activation = activation
        self.save = save
        self.leaky_slope = leaky_slope

    @jax.named_scope("jax_regemm.equinox.Linear")
    def __call__(self, x, *, key=None):
        """x: [in_features] (or [] for "scalar"; extra leading dims are allowed) -> [out_features]."""
        del key
        if self.in_features == "scalar":
            if jnp.shape(x) != ():
                raise ValueError(f"x must have scalar shape, got {jnp.shape(x)}")
            x = jnp.reshape(x, (1,))
        elif jnp.ndim(x) < 1:
            raise ValueError(f"x must have shape [..., {self.in_features}] (in_features), got shape {jnp.shape(x)}")
        dtype = jnp.result_type(x, self.weight)  # what `weight @ x` would promote to
        y = dense_layer(
            jnp.asarray(x).astype(dtype), self.weight.astype(dtype), None if self.bias is None else self.bias.astype(dtype),
            act=self.activation, leaky_slope=self.leaky_slope, save=self.save, w_transposed=True,
            names=("x", "weight", "bias"),
        )  # fmt: skip
        return jnp.squeeze(y, -1) if self.out_features == "scalar" else y


class MLP(eqx.Module):
    """`eqx.nn.MLP` with `Linear` layers and activations named by string.

    Same constructor (in_size, out_size, width_size, depth, use_bias,
    use_final_bias, dtype, key) and the same key use as `eqx.nn.MLP`, so the
    same key gives the same weights, and its array leaves come in the same
    order (a serialised `eqx.nn.MLP` loads into it). Each activation is fused
    into its layer's kernel, and the stack runs as one `jax_regemm.mlp_block`, whose
    backward folds each hidden layer's act' into the dgrad GEMM of the layer above
    (under `jax.vmap` too: the examples become the GEMMs' rows).
    """

    layers: tuple[Linear, ...]
    in_size: int | str = eqx.field(static=True)
    out_size: int | str = eqx.field(static=True)
    width_size: int = eqx.field(static=True)
    depth: int = eqx.field(static=True)

    def __init__(self, in_size, out_size, width_size, depth, activation="relu", final_activation="none",
                 use_bias=True, use_final_bias=True, dtype=None, *, save="auto", key):  # fmt: skip
        keys = jax.random.split(key, depth + 1)
        sizes = [in_size] + [width_size] * depth + [out_size]
        self.layers = tuple(
            Linear(sizes[i], sizes[i + 1], use_final_bias if i == depth else use_bias, dtype,
                   activation=final_activation if i == depth else activation, save=save, key=keys[i])  # fmt: skip
            for i in range(depth + 1)
        )
        self.in_size, self.out_size, self.width_size, self.depth = in_size, out_size, width_size, depth

    def __call__(self, x, *, key=None):
        del key
        first, last = self.layers[0], self.layers[-1]
        if first.in_features == "scalar" or last.out_features == "scalar":
            for layer in self.layers:  # the scalar shapes: layer by layer
                x = layer(x)
            return x
        dtype = jnp.result_type(x, *[layer.weight for layer in self.layers])  # what `weight @ x` promotes to
        weights = [layer.weight.astype(dtype) for layer in self.layers]
        biases = [None if layer.bias is None else layer.bias.astype(dtype) for layer in self.layers]
        return mlp_block(
            x.astype(dtype), weights, biases, acts=[layer.activation for layer in self.layers],
            act_names=["activation"] * (len(self.layers) - 1) + ["final_activation"],
            leaky_slope=first.leaky_slope, save=first.save, weights_transposed=True,
        )  # fmt: skip
