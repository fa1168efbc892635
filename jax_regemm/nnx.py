"""flax.nnx layers: `Linear` (a drop-in `nnx.Linear` with an activation) and `MLP`.

`Linear` subclasses `flax.nnx.Linear`: the constructor builds the parameters
(`kernel` [in, out], `bias` [out]) with nnx's own code, so the state has the
same names, shapes, initial values and RNG use, and `nnx.update` moves state
between the two. It adds the activation and the residual policy and computes
act(x @ kernel + bias) as one fused `jax_regemm.dense` call.

Imported on demand (`import jax_regemm.nnx`): `import jax_regemm` alone does
not import Flax.
"""

from __future__ import annotations

from typing import Sequence

from flax import nnx
from jax import lax

from .api import dense, mlp_block


class Linear(nnx.Linear):
    """`nnx.Linear` followed by `activation`, fused into one kernel.

    Extra keyword arguments (all others are `nnx.Linear`'s):
      activation: one of `jax_regemm.ACTIVATIONS` (default "none": exactly nnx.Linear).
      save: residual kept for the backward, one of `jax_regemm.SAVE_POLICIES`.
      leaky_slope: the slope of "leaky_relu".
    """

    def __init__(self, in_features: int, out_features: int, *, activation: str = "none", save: str = "auto",
                 leaky_slope: float = 0.01, **kwargs):  # fmt: skip
        if kwargs.get("dot_general", lax.dot_general) is not lax.dot_general:
            raise ValueError("jax_regemm.nnx.Linear computes the product itself: dot_general is not supported")
        if kwargs.get("preferred_element_type") is not None:
            raise ValueError("jax_regemm.nnx.Linear: preferred_element_type is not supported")
        super().__init__(in_features, out_features, **kwargs)
        self.activation = activation
        self.save = save
        self.leaky_slope = leaky_slope

    def __call__(self, inputs, out_sharding=None):
        if out_sharding is not None:
            raise ValueError("jax_regemm.nnx.Linear: out_sharding is not supported")
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return dense(
            inputs, kernel, bias, act=self.activation, leaky_slope=self.leaky_slope, save=self.save,
            precision=self.precision,
        )  # fmt: skip


class MLP(nnx.Module):
    """`Linear` layers of sizes features[0] -> features[1] -> ... -> features[-1].

    `activation` follows each hidden layer, `final_activation` the last; other
    keyword arguments (use_bias, dtype, param_dtype, precision, initialisers)
    go to every `Linear`. The state is `layers/0/kernel`, `layers/0/bias`, ...
    The stack runs as one `jax_regemm.mlp_block`, whose backward folds each hidden
    layer's act' into the dgrad GEMM of the layer above.
    """

    def __init__(self, features: Sequence[int], *, activation: str = "relu", final_activation: str = "none",
                 save: str = "auto", rngs: nnx.Rngs, **linear_kwargs):  # fmt: skip
        if len(features) < 2:
            raise ValueError(f"features must list at least the input and output sizes, got {features}")
        n = len(features) - 1
        self.layers = nnx.List(
            Linear(features[i], features[i + 1], activation=final_activation if i == n - 1 else activation,
                   save=save, rngs=rngs, **linear_kwargs)  # fmt: skip
            for i in range(n)
        )

    def __call__(self, x):
        first = self.layers[0]  # the layers share dtype, precision, save and slope (linear_kwargs)
        kernels = [layer.kernel[...] for layer in self.layers]
        biases = [layer.bias[...] if layer.bias is not None else None for layer in self.layers]
        present = [b for b in biases if b is not None]
        x, *rest = first.promote_dtype((x, *kernels, *present), dtype=first.dtype)
        kernels, present = rest[: len(kernels)], iter(rest[len(kernels) :])
        biases = [None if b is None else next(present) for b in biases]
        return mlp_block(
            x, kernels, biases, acts=[layer.activation for layer in self.layers], leaky_slope=first.leaky_slope,
            act_names=["activation"] * (len(self.layers) - 1) + ["final_activation"],
            save=first.save, precision=first.precision,
        )  # fmt: skip
