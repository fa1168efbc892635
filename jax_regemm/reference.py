"""Pure-JAX reference of every jax_regemm op, for tests and for users.

Written straight from docs/spec.md §1-§3 with plain `jnp` operations, sharing no code
with the kernels, so that comparing the two means something. Accumulates in
f32 (f64 for f64 inputs) like the kernels do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

ACTIVATIONS = ("none", "relu", "leaky_relu", "gelu", "gelu_erf", "sigmoid", "tanh", "silu")
BIAS_KINDS = ("none", "scalar", "per_row", "per_col")
# act' can be written in terms of y = act(z) for these (docs/spec.md §4, save="y").
GRAD_FROM_Y = ("none", "relu", "leaky_relu", "sigmoid", "tanh")


def act_fwd(name: str, z, slope=0.01):
    """act(z) of docs/spec.md §3."""
    if name == "none":
        return z
    if name == "relu":  # jax.nn.relu: its derivative at 0 is 0, as in docs/spec.md §3 (jnp.maximum's is 1/2)
        return jax.nn.relu(z)
    if name == "leaky_relu":
        return jnp.where(z > 0, z, slope * z)
    if name == "gelu":
        # jax.nn.gelu(z, approximate=True) = 0.5 z (1 + tanh u), written as z s(2u) (the
        # same function): 1 + tanh u cancels for negative z, in the value and in its
        # jax.grad (off by ~1e-11 relative at z = -5 in float64, where float64 gradient
        # checks hold the reference to 1e-12).
        u2 = 2 * jnp.sqrt(2 / jnp.pi).astype(z.dtype) * (z + 0.044715 * z**3)
        return z * jax.nn.sigmoid(u2)
    if name == "gelu_erf":
        return jax.nn.gelu(z, approximate=False)
    if name == "sigmoid":
        return jax.nn.sigmoid(z)
    if name == "tanh":
        return jnp.tanh(z)
    if name == "silu":
        return z * jax.nn.sigmoid(z)
    raise ValueError(f"unknown activation {name!r}")


def act_grad(name: str, z, slope=0.01):
    """act'(z) of docs/spec.md §3, in closed form; NaN in gives NaN out."""
    return jnp.where(jnp.isnan(z), z, _act_grad(name, z, slope))


def _act_grad(name, z, slope):
    one = jnp.ones_like(z)
    if name == "none":
        return one
    if name == "relu":
        return jnp.where(z > 0, one, 0 * one)
    if name == "leaky_relu":
        return jnp.where(z > 0, one, slope * one)
    # Stable forms: s (1 - s) as s(z) s(-z), 1 + tanh(u) as 2 s(2u), 1 - tanh(u)^2
    # as 4 s(2u) s(-2u): each factor is accurate to a few ulp in relative terms,
    # where 1 - s or 1 + tanh would cancel (gelu' at z = -4.9 is -3.6e-6, and
    # the cancelling form was off by 5e-12 relative in float64 there).
    sig = jax.nn.sigmoid
    if name == "gelu":
        # Past |z| = 30, gelu' is 1 or 0 to the last bit of float64, while the formula
        # would form 0 * inf once z^3 overflows (|z| > ~1e13 in float32): clamp, then select.
        c, k = jnp.sqrt(2 / jnp.pi).astype(z.dtype), 0.044715
        zc = jnp.clip(z, -30, 30)
        u2 = 2 * c * (zc + k * zc**3)
        s, s_neg = sig(u2), sig(-u2)  # 0.5 (1 + tanh u) and 0.5 (1 - tanh u)
        g = s + 2 * zc * s * s_neg * c * (1 + 3 * k * zc * zc)
        return jnp.where(z > 30, one, jnp.where(z < -30, 0 * one, g))
    if name == "gelu_erf":
        return 0.5 * lax.erfc(-z / jnp.sqrt(2).astype(z.dtype)) + z * jnp.exp(-0.5 * z * z) / jnp.sqrt(
            2 * jnp.pi
        ).astype(z.dtype)
    if name == "sigmoid":
        return sig(z) * sig(-z)
    if name == "tanh":
        return 4 * sig(2 * z) * sig(-2 * z)
    if name == "silu":
        return sig(z) * (1 + z * sig(-z))
    raise ValueError(f"unknown activation {name!r}")


def act_grad_from_y(name: str, y, slope=0.01):
    """act'(z) written in terms of y = act(z), for the names in GRAD_FROM_Y; NaN in gives NaN out."""
    return jnp.where(jnp.isnan(y), y, _act_grad_from_y(name, y, slope))


def _act_grad_from_y(name, y, slope):
    one = jnp.ones_like(y)
    if name == "none":
        return one
    if name == "relu":
        return jnp.where(y > 0, one, 0 * one)
    if name == "leaky_relu":
        return jnp.where(y > 0, one, slope * one)
    if name == "sigmoid":
        return y * (1 - y)
    if name == "tanh":
        return 1 - y * y
    raise ValueError(f"act' of {name!r} cannot be derived from y")


def _acc_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def bias_broadcast(bias, kind: str):
    """The bias as an array that broadcasts against [..., M, N]."""
    if bias is None or kind == "none":
        return 0
    if kind == "scalar":
        return jnp.reshape(bias, ())
    if kind == "per_row":
        return jnp.reshape(bias, (-1, 1))
    if kind == "per_col":
        return jnp.reshape(bias, (-1,))
    raise ValueError(f"unknown bias kind {kind!r}")


def bias_reduce(gz, kind: str):
    """Sum of gZ [..., M, N] over the bias kind's broadcast axes: [..., L]."""
    if kind == "scalar":
        return jnp.sum(gz, axis=(-2, -1))[..., None]
    if kind == "per_row":
        return jnp.sum(gz, axis=-1)
    if kind == "per_col":
        return jnp.sum(gz, axis=-2)
    raise ValueError(f"no bias gradient for bias kind {kind!r}")


_STAGE_ROWS = 512


def bias_grad(gz, kind: str):
    """The bias gradient of gZ: bias_reduce accumulated in f32 (f64 for f64), in gZ's dtype.

    On the GPU a 16-bit gZ summed over its rows (per_col, scalar) goes in two stages: sums of
    blocks of _STAGE_ROWS rows, an optimization barrier, then their sum. In one stage XLA emits
    convert-reduce-convert as one fusion that, in a backward program on the H100, ran 10-25%
    slower than XLA's own bf16 sum (the transpose of a bias broadcast); the two stages ran as
    fast as that one, and 3-5x more accurate (benchmarks/results/h100_bias_grad_reduce.md).
    On the CPU two stages ran 8-21% slower than one (bf16 layers), so it sums in one there."""
    one_stage = lambda g: bias_reduce(g.astype(_acc_dtype(g.dtype)), kind).astype(g.dtype)
    if not _stageable(gz, kind):
        return one_stage(gz)
    return lax.platform_dependent(gz, cuda=lambda g: _bias_grad_two_stages(g, kind), default=one_stage)


def _stageable(gz, kind):
    m = gz.shape[-2]
    return (_acc_dtype(gz.dtype) != gz.dtype and kind in ("per_col", "scalar") and isinstance(m, int)
            and m > _STAGE_ROWS and m % _STAGE_ROWS == 0)  # fmt: skip


def _bias_grad_two_stages(gz, kind):
    """bias_grad's sum on the GPU where _stageable: f32 sums of blocks of rows, then theirs."""
    blocks = gz.reshape(*gz.shape[:-2], gz.shape[-2] // _STAGE_ROWS, _STAGE_ROWS, gz.shape[-1])
    partial_sums = lax.optimization_barrier(jnp.sum(blocks.astype(_acc_dtype(gz.dtype)), axis=-2))
    return bias_reduce(partial_sums, kind).astype(gz.dtype)


def gemm_bias_act(
    a,
    b,
    bias=None,
    *,
    act: str = "relu",
    leaky_slope: float = 0.01,
    c=None,
    alpha: float = 1.0,
    beta: float = 0.0,
    trans_a: bool = False,
    trans_b: bool = False,
    bias_kind: str = "per_col",
    precision=None,
    return_z: bool = False,
):
    """Y = act(alpha * op(A) @ op(B) + beta * C + bias) (and Z) in plain JAX.

    `bias_kind` must be given explicitly here (no inference): the reference is
    the contract, not the convenience layer.
    """
    acc = _acc_dtype(a.dtype)
    opa = jnp.swapaxes(a, -1, -2) if trans_a else a
    opb = jnp.swapaxes(b, -1, -2) if trans_b else b
    z = jnp.matmul(opa, opb, precision=precision, preferred_element_type=acc)
    # alpha = 0 reads no product and beta = 0 no C, as BLAS (docs/spec.md §2): a NaN there stays out.
    z = alpha * z if alpha != 0 else jnp.zeros_like(z)
    if c is not None and beta != 0:
        z = z + beta * c.astype(acc)
    if bias is not None:
        z = z + bias_broadcast(bias.astype(acc), bias_kind)
    y = act_fwd(act, z, leaky_slope)
    y, z = y.astype(a.dtype), z.astype(a.dtype)
    return (y, z) if return_z else y


def dact(gy, s, *, act: str, leaky_slope: float = 0.01, from_y: bool = False, bias_kind: str = "none"):
    """gZ = gY * act'(S) with S = Z (or Y when from_y), and the bias gradient."""
    acc = _acc_dtype(gy.dtype)
    sv = s.astype(acc)
    d = act_grad_from_y(act, sv, leaky_slope) if from_y else act_grad(act, sv, leaky_slope)
    gz = (gy.astype(acc) * d).astype(gy.dtype)
    gbias = None if bias_kind == "none" else bias_grad(gz, bias_kind)
    return gz, gbias


def dense(x, w, b=None, *, act: str = "none", leaky_slope: float = 0.01, precision=None):
    """act(x @ w + b) for x [..., K], w [K, N], b [N]."""
    return gemm_bias_act(x, w, b, act=act, leaky_slope=leaky_slope, bias_kind="per_col", precision=precision)


def mlp(x, weights, biases=None, *, act: str = "relu", final_act: str = "none", leaky_slope: float = 0.01,
        precision=None):
    """The MLP block: act(... act(x @ w_1 + b_1) ...) with final_act on the last layer."""
    biases = [None] * len(weights) if biases is None else biases
    for i, (w, b) in enumerate(zip(weights, biases)):
        a = final_act if i == len(weights) - 1 else act
        x = dense(x, w, b, act=a, leaky_slope=leaky_slope, precision=precision)
    return x
