"""The public ops (docs/spec.md §6)."""

from __future__ import annotations

import jax
import jax.export  # a submodule, an attribute of jax only once imported (jax < 0.8)
import jax.numpy as jnp

import math
from collections.abc import Sequence

from . import _backward, _ffi, _fused, _mlp_block, _narrow
from ._args import _array, check_act, prepare
from ._targets import gemm_shape


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
    return _fused.fused(cfg, a, b, bias, c)


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
    return _fused.fused(cfg, a, b, bias, c)


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
    out = gemm_shape(a2.shape, b2.shape, cfg.trans_a, cfg.trans_b, *([c2.shape] if c2 is not None else []))
    for name, x in (("gy", gy), ("z", z)):
        x = _array(name, x)
        if x.dtype != a2.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but a has {a2.dtype}: mixed dtypes are not supported")
        if tuple(x.shape) != out:
            raise ValueError(f"{name} must have the output's shape {out}, got {tuple(x.shape)}")
    grads = _backward.backward(cfg, a2, b2, gy, z, from_y=False)
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
    return dense_layer(x, w, b, act=act, leaky_slope=leaky_slope, save=save, precision=precision)


def dense_layer(x, w, b=None, *, act="none", leaky_slope=0.01, save="auto", precision=None, w_transposed=False,
                names=("x", "w", "b")):  # fmt: skip
    """`dense`, with w stored [N, K] where w_transposed (Equinox's layout, read transposed in place), and
    the names the caller gives x, w and b, for the errors."""
    nx, nw, nb = names
    layout = "[N, K]" if w_transposed else "[K, N]"
    x, w = _array(nx, x), _array(nw, w)
    b = None if b is None else _array(nb, b)
    if x.ndim < 1:
        raise ValueError(f"{nx} must have rank >= 1 ([..., K]), got shape {x.shape}")
    if w.ndim != 2:
        raise ValueError(f"{nw} must have rank 2 ({layout}), got shape {w.shape}")
    if b is not None and b.ndim != 1:
        raise ValueError(f"{nb} must have rank 1 ([N]), got shape {b.shape}")
    k = w.shape[1] if w_transposed else w.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"{nx} {x.shape} has K={x.shape[-1]} but {nw} {w.shape} has K={k}: {nw} must be {layout}")
    cfg, a, w2, bias, _ = prepare(
        _rows(x), w, b, None, act=act, leaky_slope=leaky_slope, alpha=1.0, beta=0.0, trans_a=False,
        trans_b=w_transposed, bias_kind=None if b is None else "per_col", save=save, precision=precision,
        return_z=False, names=(nx, nw, nb, "c"),
    )  # fmt: skip
    y = _fused.fused(cfg, a, w2, bias, None)
    return jnp.reshape(y, x.shape[:-1] + (y.shape[-1],))


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
    weights = _sequence("weights", weights)
    check_act("act", act)
    check_act("final_act", final_act)
    acts = [act] * (len(weights) - 1) + [final_act]
    names = ["act"] * (len(weights) - 1) + ["final_act"]
    return mlp_block(x, weights, biases, acts=acts, leaky_slope=leaky_slope, save=save, precision=precision,
                     act_names=names)  # fmt: skip


def _sequence(name, xs):
    if not isinstance(xs, Sequence) or isinstance(xs, str):
        raise TypeError(f"{name} must be a list or tuple, got {type(xs).__name__}")
    return list(xs)


def _rows(x):
    """x [..., K] as [rows, K] (a reshape; the rows spelled out, as -1 is undefined where K == 0)."""
    return jnp.reshape(x, (math.prod(x.shape[:-1]), x.shape[-1]))


def mlp_block(x, weights, biases, *, acts, leaky_slope=0.01, save="auto", precision=None, weights_transposed=False,
              act_names=None):  # fmt: skip
    """`mlp` with an activation per layer (acts), and weights stored [N, K] when
    weights_transposed (Equinox's layout: read transposed in place, never copied). act_names:
    what the caller calls each layer's activation, for the errors."""
    weights = _sequence("weights", weights)
    if not weights:
        raise ValueError("weights must hold at least one [K, N] matrix, got none")
    biases = [None] * len(weights) if biases is None else _sequence("biases", biases)
    act_names = act_names or ["act"] * len(weights)
    if len(biases) != len(weights):
        raise ValueError(f"biases must have one entry (an [N] vector or None) per weight: got {len(biases)} for {len(weights)} weights")
    h = _array("x", x)
    if h.ndim < 1:
        raise ValueError(f"x must have rank >= 1 ([..., K]), got shape {h.shape}")
    layout = "[N, K]" if weights_transposed else "[K, N]"
    cfgs, ws, bs = [], [], []
    for i, (w, b) in enumerate(zip(weights, biases)):
        check_act(act_names[i], acts[i])
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
            act_name=act_names[i],
        )  # fmt: skip
        cfgs.append(cfg)
        ws.append(w2)
        bs.append(b2)
        h = jax.ShapeDtypeStruct(h.shape[:-1] + (n,), h.dtype)
    x = _rows(_array("x", x))
    spec = _mlp_block.MlpSpec(tuple(cfgs))
    nspec = _narrow.chosen(spec, x, ws, save)
    if nspec is not None:  # the whole stack in one kernel per direction (docs/spec.md §8)
        y = _narrow.mlp(nspec, x, tuple(ws), tuple(bs))
    else:
        y = _mlp_block.mlp(spec, x, tuple(ws), tuple(bs))
    return jnp.reshape(y, h.shape)


def disabled_export_checks():
    """The `disabled_checks` that `jax.export.export` needs for a function using jax_regemm:
    one per custom-call target (versioned names; README, "Export")."""
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in _ffi.TARGET_NAMES]
