"""The public ops (SPEC §6)."""

from __future__ import annotations

import jax.numpy as jnp

from . import _ops
from ._args import _array, prepare


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
    bias_kind: str | None = None,
    save: str = "auto",
    precision=None,
):
    """Y = act(alpha * op(A) @ op(B) + beta * C + bias), one fused kernel.

    a: [..., M, K] ([..., K, M] with trans_a); b: [..., K, N] ([..., N, K] with
    trans_b); leading batch dims broadcast. bias: scalar, per-row or per-column
    (inferred from its shape, or `bias_kind`). `save` picks the residual kept for
    the backward: "z", "y" (none beyond the output), "recompute", or "auto".
    """
    cfg, a, b, bias, c = prepare(
        a, b, bias, c, act=act, leaky_slope=leaky_slope, alpha=alpha, beta=beta, trans_a=trans_a,
        trans_b=trans_b, bias_kind=bias_kind, save=save, precision=precision, return_z=False,
    )  # fmt: skip
    return _ops.fused(cfg, a, b, bias, c)


def gemm_bias_act_fwd(
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
    bias_kind: str | None = None,
    precision=None,
    return_z: bool = True,
):
    """The forward with the Z stash: (Y, Z), Z = the pre-activation (Y alone if not return_z)."""
    cfg, a, b, bias, c = prepare(
        a, b, bias, c, act=act, leaky_slope=leaky_slope, alpha=alpha, beta=beta, trans_a=trans_a,
        trans_b=trans_b, bias_kind=bias_kind, save="z", precision=precision, return_z=return_z,
    )  # fmt: skip
    return _ops.fused(cfg, a, b, bias, c)


def gemm_bias_act_bwd(
    a,
    b,
    gy,
    z,
    bias=None,
    c=None,
    *,
    act: str = "relu",
    leaky_slope: float = 0.01,
    alpha: float = 1.0,
    beta: float = 0.0,
    trans_a: bool = False,
    trans_b: bool = False,
    bias_kind: str | None = None,
    precision=None,
):
    """The explicit backward from a Z stash: (gA, gB, gBias, gC).

    `bias` and `c` are needed only for their shapes (gBias / gC are None when
    they are None).
    """
    cfg, a2, b2, bias2, c2 = prepare(
        a, b, bias, c, act=act, leaky_slope=leaky_slope, alpha=alpha, beta=beta, trans_a=trans_a,
        trans_b=trans_b, bias_kind=bias_kind, save="z", precision=precision, return_z=False,
    )  # fmt: skip
    shapes = (a.shape, b.shape, None if bias is None else bias.shape, None if c is None else c.shape)
    # gY and Z must be the forward's output: checked here, at trace time, not by the handler.
    m = a2.shape[-1] if cfg.trans_a else a2.shape[-2]
    n = b2.shape[-2] if cfg.trans_b else b2.shape[-1]
    out = jnp.broadcast_shapes(a2.shape[:-2], b2.shape[:-2], *([c2.shape[:-2]] if c2 is not None else [])) + (m, n)
    for name, x in (("gy", gy), ("z", z)):
        x = _array(name, x)
        if x.dtype != a2.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but a has {a2.dtype}: mixed dtypes are not supported")
        if tuple(x.shape) != out:
            raise ValueError(f"{name} must have the output's shape {out}, got {tuple(x.shape)}")
    grads = _ops.backward(cfg, a2, b2, gy, z, from_y=False)
    return tuple(None if g is None else jnp.reshape(g, s) for g, s in zip(grads, shapes))


def dense(
    x,
    w,
    b=None,
    *,
    act: str = "none",
    leaky_slope: float = 0.01,
    save: str = "auto",
    precision=None,
):
    """act(x @ w + b) for x [..., K], w [K, N], b [N]: the dense layer's core.

    The leading dims of x fold into the GEMM's M (a reshape, no copy).
    """
    if getattr(x, "ndim", 2) < 1:
        raise ValueError(f"x must have rank >= 1 ([..., K]), got shape {jnp.shape(x)}")
    lead = x.shape[:-1]
    x2 = jnp.reshape(x, (-1, x.shape[-1]))
    y = gemm_bias_act(
        x2, w, b, act=act, leaky_slope=leaky_slope, bias_kind=None if b is None else "per_col", save=save,
        precision=precision,
    )  # fmt: skip
    return jnp.reshape(y, lead + (y.shape[-1],))
