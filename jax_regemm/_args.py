"""Trace-time checks and normalisation of user arguments (docs/spec.md §2, §7).

Everything a user can get wrong is caught here, with the argument and the
shapes named, before anything is lowered. The result is a static `Config`
(hashable: a primitive parameter) and operands in canonical form: every
operand with the same number of leading batch dims, the bias as a [..., L]
vector of its kind.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .reference import ACTIVATIONS, GRAD_FROM_Y

DTYPES = (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)
SAVE_POLICIES = ("auto", "z", "y", "recompute")
_BIAS_KINDS = ("scalar", "per_row", "per_col")


@dataclasses.dataclass(frozen=True)
class Config:
    """Static description of one fused op; mirrors the C++ GemmProblem attributes."""

    act: str = "relu"
    slope: float = 0.01
    alpha: float = 1.0
    beta: float = 0.0
    trans_a: bool = False
    trans_b: bool = False
    bias_kind: str = "none"
    save: str = "z"  # resolved: "z", "y" or "recompute"
    exact_f32: bool = False
    return_z: bool = False
    bias_shape: tuple = ()  # canonical [1.., L]: the bias gradient is summed to it
    c_shape: tuple = ()  # C's shape after lifting: gC is summed to it
    out_sharding: object = None  # under a mesh of Explicit axes: Y's sharding type where JAX cannot infer it
    differentiated: bool = False  # the forward of a derivative (bound by a JVP rule): its peak holds the residuals


def _array(name, x):
    """x as a JAX value: a NumPy array becomes one as jnp would take it (float64 is float32 with x64
    off), so that its dtype is compared as plain jnp compares it."""
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    if isinstance(x, jax.Array) or hasattr(x, "aval"):
        return x
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def _flag(name, x):
    """A static boolean (a Python or NumPy bool: not a string, whose truth says nothing)."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(x).__name__} {x!r}")
    return bool(x)


def check_act(name, act):
    """act, one of ACTIVATIONS, else a ValueError naming the argument."""
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ValueError(f"{name}: unknown activation {act!r}; expected one of {ACTIVATIONS}")
    return act


def _dtype_ok(name, x):
    if x.dtype not in [np.dtype(d) for d in DTYPES]:
        raise TypeError(f"{name}: unsupported dtype {x.dtype} (supported: float32, float64, bfloat16, float16)")


def _precision(p) -> lax.Precision:
    if isinstance(p, lax.Precision):
        return p
    if isinstance(p, str):
        try:
            return lax.Precision(p.lower())  # the names jnp.dot takes: "highest", "float32", "tensorfloat32", ...
        except ValueError:
            pass
    raise ValueError(
        f"precision must be None, a jax.lax.Precision, one of its names (e.g. 'highest', 'float32', "
        f"'tensorfloat32', 'default') or a pair of those, got {p!r}"
    )


def exact_f32(precision) -> bool:
    """True when f32 must be computed in true f32 (no TF32), as jnp.dot decides.
    An invalid precision is a ValueError, as it is for jnp.dot."""
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
        if precision is None:
            return False
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2:
            raise ValueError(f"precision: a pair (lhs, rhs) is expected, got {precision!r}")
        # XLA goes by the higher of the two operand precisions
        return lax.Precision.HIGHEST in (_precision(precision[0]), _precision(precision[1]))
    return _precision(precision) == lax.Precision.HIGHEST


def infer_bias_kind(bias_shape, m, n, bias_kind: Optional[str], name: str = "bias") -> str:
    """Bias kind from its shape (docs/spec.md §2), or check the explicit `bias_kind`."""
    shape = tuple(bias_shape)
    fits = {
        "scalar": shape in ((), (1,)),
        "per_row": shape in ((m,), (m, 1)),
        "per_col": shape in ((n,), (1, n)),
    }
    if bias_kind is not None:
        if bias_kind not in _BIAS_KINDS:
            raise ValueError(f"bias_kind must be one of {_BIAS_KINDS}, got {bias_kind!r}")
        if not fits[bias_kind]:
            raise ValueError(f"{name} of shape {shape} does not fit bias_kind={bias_kind!r} for an output of [{m}, {n}]")
        return bias_kind
    if fits["scalar"] and not (shape == (1,) and n == 1):
        return "scalar"
    if fits["per_col"]:  # a 1-D bias of length M == N is per-column
        return "per_col"
    if fits["per_row"]:
        return "per_row"
    raise ValueError(
        f"{name} of shape {shape} fits no bias kind for an output of [{m}, {n}]: "
        f"use (), (1,), ({m},), ({m}, 1), ({n},) or (1, {n})"
    )


def _number(name, x):
    """A static, finite real number (a Python or NumPy scalar; not a string, not an array)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a Python number (static), got {type(x).__name__} {x!r}")
    if not np.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return float(x)


def prepare(a, b, bias, c, *, act, leaky_slope, alpha, beta, trans_a, trans_b, bias_kind, save, precision, return_z,
            names=("a", "b", "bias", "c"), act_name="act"):  # fmt: skip
    """Checks the arguments; returns (Config, a, b, bias [..., L] or None, c or None).
    `names`: what the caller calls a, b, bias and c (dense says x, w, b), and `act_name` the
    activation's argument, for the errors."""
    na, nb_, nbias, nc = names
    trans_a, trans_b = _flag("trans_a", trans_a), _flag("trans_b", trans_b)
    a = _array(na, a)
    b = _array(nb_, b)
    bias = None if bias is None else _array(nbias, bias)
    c = None if c is None else _array(nc, c)
    _dtype_ok(na, a)
    for name, x in ((nb_, b), (nbias, bias), (nc, c)):
        if x is None:
            continue
        _dtype_ok(name, x)
        if x.dtype != a.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but {na} has {a.dtype}: mixed dtypes are not supported")
    if a.ndim < 2:
        raise ValueError(f"{na} must have rank >= 2 ([..., M, K]), got shape {a.shape}")
    if b.ndim < 2:
        raise ValueError(f"{nb_} must have rank >= 2 ([..., K, N]), got shape {b.shape}")
    m, k = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if trans_b else (b.shape[-2], b.shape[-1])
    if k != kb:
        raise ValueError(
            f"contraction sizes differ: {na} {a.shape} (trans_a={trans_a}) has K={k}, "
            f"{nb_} {b.shape} (trans_b={trans_b}) has K={kb}"
        )
    check_act(act_name, act)
    slope, alpha, beta = _number("leaky_slope", leaky_slope), _number("alpha", alpha), _number("beta", beta)
    if save not in SAVE_POLICIES:
        raise ValueError(f"save must be one of {SAVE_POLICIES}, got {save!r}")
    y_ok = act in GRAD_FROM_Y and not (act == "leaky_relu" and slope <= 0)
    if save == "y" and not y_ok:
        why = "leaky_slope <= 0" if act == "leaky_relu" else f"act={act!r}"
        raise ValueError(f"save='y' cannot derive act' from the output for {why}; use 'z' or 'recompute'")
    if save == "auto":
        save = "y" if y_ok else "z"

    batch_shapes = [a.shape[:-2], b.shape[:-2]]
    if c is not None:
        if c.ndim < 2 or c.shape[-2:] != (m, n):
            raise ValueError(f"{nc} must have shape [..., {m}, {n}], got {c.shape}")
        batch_shapes.append(c.shape[:-2])
    try:
        batch = jnp.broadcast_shapes(*batch_shapes)
    except ValueError:
        raise ValueError(
            f"batch dims do not broadcast: {na} {a.shape}, {nb_} {b.shape}" + (f", {nc} {c.shape}" if c is not None else "")
        ) from None
    nb = len(batch)

    def lift(x, rank):  # leading 1s up to the common batch rank: a reshape, never a copy
        return None if x is None else jnp.reshape(x, (1,) * (nb + rank - x.ndim) + x.shape)

    kind = "none"
    if bias is not None:
        if bias.ndim > 2:
            raise ValueError(f"{nbias} must have rank <= 2, got shape {bias.shape}")
        kind = infer_bias_kind(bias.shape, m, n, bias_kind, nbias)
        bias = jnp.reshape(bias, (1,) * nb + (-1,))
    elif bias_kind is not None and bias_kind != "none":
        raise ValueError(f"bias_kind={bias_kind!r} given but {nbias} is None")

    cfg = Config(
        act=act,
        slope=slope,
        alpha=alpha,
        beta=beta,
        trans_a=bool(trans_a),
        trans_b=bool(trans_b),
        bias_kind=kind,
        save=save,
        exact_f32=exact_f32(precision) and a.dtype == jnp.float32,  # validates precision for every dtype
        return_z=bool(return_z),
        bias_shape=() if bias is None else tuple(bias.shape),
        c_shape=() if c is None else (1,) * (nb + 2 - c.ndim) + tuple(c.shape),
    )
    return cfg, lift(a, 2), lift(b, 2), bias, lift(c, 2)
