"""The public ops (SPEC §6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _ffi, _ops
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
    x, w = _array("x", x), _array("w", w)
    if x.ndim < 1:
        raise ValueError(f"x must have rank >= 1 ([..., K]), got shape {x.shape}")
    if w.ndim != 2:
        raise ValueError(f"w must have rank 2 ([K, N]), got shape {w.shape}")
    if b is not None and _array("b", b).ndim != 1:
        raise ValueError(f"b must have rank 1 ([N]), got shape {b.shape}")
    lead = x.shape[:-1]
    x2 = jnp.reshape(x, (-1, x.shape[-1]))
    cfg, a, w2, bias, _ = prepare(
        x2, w, b, None, act=act, leaky_slope=leaky_slope, alpha=1.0, beta=0.0, trans_a=False, trans_b=False,
        bias_kind=None if b is None else "per_col", save=save, precision=precision, return_z=False,
        names=("x", "w", "b", "c"),
    )  # fmt: skip
    y = _ops.fused(cfg, a, w2, bias, None)
    return jnp.reshape(y, lead + (y.shape[-1],))


def disabled_export_checks():
    """The `disabled_checks` that `jax.export.export` needs for a function using jax_regemm:
    one per custom-call target (versioned names; README, "Export")."""
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in _ffi.TARGETS]
