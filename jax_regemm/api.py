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


def mlp(
    x,
    weights,
    biases=None,
    *,
    act: str = "relu",
    final_act: str = "none",
    leaky_slope: float = 0.01,
    save: str = "auto",
    precision=None,
):
    """The MLP block: h_0 = x, h_l = act_l(h_{l-1} @ weights[l-1] + biases[l-1]), with act_l = act
    for the hidden layers and final_act for the last; returns h_L.

    x [..., K_0], weights[l] [K_l, K_{l+1}], biases None or a list of [K_{l+1}] vectors or None
    each. Each layer is one fused kernel keeping what its backward needs (`save`, as for
    `dense`). The backward runs over the whole stack: each layer's dgrad GEMM and the
    backward epilogue of the layer below it (act' and the bias gradient) are one call.
    """
    weights = list(weights)
    acts = [act] * (len(weights) - 1) + [final_act]
    return mlp_block(x, weights, biases, acts=acts, leaky_slope=leaky_slope, save=save, precision=precision)


def mlp_block(x, weights, biases, *, acts, leaky_slope=0.01, save="auto", precision=None, weights_transposed=False):
    """`mlp` with an activation per layer (acts), and weights stored [N, K] when
    weights_transposed (Equinox's layout: read transposed in place, never copied)."""
    weights = list(weights)
    if not weights:
        raise ValueError("weights must hold at least one [K, N] matrix, got none")
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"biases must have one entry (an [N] vector or None) per weight: got {len(biases)} for {len(weights)} weights")
    h = _array("x", x)
    if h.ndim < 1:
        raise ValueError(f"x must have rank >= 1 ([..., K]), got shape {h.shape}")
    layout = "[N, K]" if weights_transposed else "[K, N]"
    cfgs, ws, bs = [], [], []
    for i, (w, b) in enumerate(zip(weights, biases)):
        w = _array(f"weights[{i}]", w)
        if w.dtype != h.dtype:
            raise TypeError(f"weights[{i}] has dtype {w.dtype} but x has {h.dtype}: mixed dtypes are not supported")
        if w.ndim != 2:
            raise ValueError(f"weights[{i}] must have rank 2 ({layout}), got shape {w.shape}")
        k, n = w.shape[::-1] if weights_transposed else w.shape
        if h.ndim < 1 or h.shape[-1] != k:
            what = "x" if i == 0 else f"layer {i - 1}'s output"
            raise ValueError(f"weights[{i}] has shape {w.shape} but {what} has shape {h.shape}: its K must be {h.shape[-1:] or '?'}")
        if b is not None:
            b = _array(f"biases[{i}]", b)
            if b.dtype != h.dtype:
                raise TypeError(f"biases[{i}] has dtype {b.dtype} but x has {h.dtype}: mixed dtypes are not supported")
            if b.shape != (n,):
                raise ValueError(f"biases[{i}] must have shape ({n},) for weights[{i}] of shape {w.shape}, got {b.shape}")
        # The layer's static description from its operands' types (a [0, K] stand-in for its input).
        cfg, _, w2, b2, _ = prepare(
            jnp.zeros((0, k), h.dtype), w, b, None, act=acts[i], leaky_slope=leaky_slope, alpha=1.0, beta=0.0,
            trans_a=False, trans_b=weights_transposed, bias_kind=None if b is None else "per_col", save=save,
            precision=precision, return_z=False, names=("x", f"weights[{i}]", f"biases[{i}]", "c"),
        )  # fmt: skip
        cfgs.append(cfg)
        ws.append(w2)
        bs.append(b2)
        h = jax.ShapeDtypeStruct(h.shape[:-1] + (n,), h.dtype)
    x = jnp.reshape(x, (-1, x.shape[-1]))
    y = _ops.mlp(_ops.MlpSpec(tuple(cfgs)), x, tuple(ws), tuple(bs))
    return jnp.reshape(y, h.shape)


def disabled_export_checks():
    """The `disabled_checks` that `jax.export.export` needs for a function using jax_regemm:
    one per custom-call target (versioned names; README, "Export")."""
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in _ffi.TARGETS]
