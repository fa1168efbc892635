"""flax.linen layers: `Dense` (a drop-in `nn.Dense` with an activation) and `MLP`.

`Dense` subclasses `flax.linen.Dense`, so it has the same fields, defaults,
initialisers and parameter names (`kernel` [in, out], `bias` [out]): a
checkpoint of an `nn.Dense` loads into it and vice versa. It adds the
activation and the residual policy, and computes act(x @ kernel + bias) as one
fused `jax_regemm.dense` call instead of a dot_general, an add and an
elementwise op.

Imported on demand (`import jax_regemm.flax`): `import jax_regemm` alone does
not import Flax.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from .api import dense, mlp_block


class Dense(nn.Dense):
    """`nn.Dense` followed by `activation`, fused into one kernel.

    Extra attributes (all other attributes are `nn.Dense`'s):
      activation: one of `jax_regemm.ACTIVATIONS` (default "none": exactly nn.Dense).
      save: residual kept for the backward, one of `jax_regemm.SAVE_POLICIES`.
      leaky_slope: the slope of "leaky_relu".
    """

    activation: str = "none"
    save: str = "auto"
    leaky_slope: float = 0.01

    @nn.compact
    def __call__(self, inputs):
        if self.dot_general is not None or self.dot_general_cls is not None:
            raise ValueError("jax_regemm.flax.Dense computes the product itself: dot_general is not supported")
        # The same param calls as nn.Dense, in the same order: same names, shapes and RNG use.
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return dense(
            inputs, kernel, bias, act=self.activation, leaky_slope=self.leaky_slope, save=self.save,
            precision=self.precision,
        )  # fmt: skip


class _DenseParams(nn.Dense):
    """`Dense`'s parameters alone (same names, shapes, initialisers and RNG use), for `MLP`."""

    @nn.compact
    def __call__(self, in_features):
        kernel = self.param("kernel", self.kernel_init, (in_features, self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        return kernel, bias


class MLP(nn.Module):
    """A stack of dense layers: `activation` after each hidden layer, `final_activation` last.

    The parameters are those of an MLP written with `nn.Dense` (`Dense_0/kernel`,
    `Dense_0/bias`, ...: checkpoints load either way). The stack is one `jax_regemm.mlp_block`,
    whose backward folds each hidden layer's act' into the dgrad GEMM of the layer above.
    """

    features: Sequence[int]
    activation: str = "relu"
    final_activation: str = "none"
    save: str = "auto"
    use_bias: bool = True
    dtype: object = None
    param_dtype: object = jnp.float32
    precision: object = None

    @nn.compact
    def __call__(self, x):
        kernels, biases = [], []
        k = jnp.shape(x)[-1]
        for i, f in enumerate(self.features):
            kernel, bias = _DenseParams(f, use_bias=self.use_bias, param_dtype=self.param_dtype, name=f"Dense_{i}")(k)
            kernels.append(kernel)
            biases.append(bias)
            k = f
        # Each Dense promotes its input with its parameters; here the one promotion covers all.
        present = [b for b in biases if b is not None]
        x, *rest = nn.dtypes.promote_dtype(x, *kernels, *present, dtype=self.dtype)
        kernels, present = rest[: len(kernels)], iter(rest[len(kernels) :])
        biases = [None if b is None else next(present) for b in biases]
        acts = [self.activation] * (len(self.features) - 1) + [self.final_activation]
        names = ["activation"] * (len(self.features) - 1) + ["final_activation"]
        return mlp_block(x, kernels, biases, acts=acts, save=self.save, precision=self.precision, act_names=names)
