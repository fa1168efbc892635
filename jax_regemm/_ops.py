"""The differentiable ops: each FFI call wrapped in a jax.custom_vjp.

- `fused`: Y (, Z) = act(alpha op(A) op(B) + beta C + bias). Its residual is
  chosen by the save policy: Z, Y (nothing beyond the output) or nothing
  (recompute Z in the backward). A plain GEMM is `fused` with act none.
- `dact`: gZ = gY act'(Z or Y) with the bias-gradient reduction in the same
  pass; its own VJP (needed only for second order) is the reference's.

The backward of `fused` is split into separate calls (dact, dgrad GEMM,
wgrad GEMM) so XLA drops the ones whose results are unused. Every rule calls
the custom_vjp functions themselves, never the raw FFI calls, so gradients of
gradients work to any order.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from . import _ffi, reference
from ._args import Config


def _sum_to(x, shape):
    """Sums x over the leading dims where `shape` (same rank) has 1: the VJP of a broadcast."""
    axes = tuple(i for i, (d, s) in enumerate(zip(x.shape, shape)) if s == 1 and d != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


# ---------------------------------------------------------------------------
# fused forward
# ---------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused(cfg: Config, a, b, bias, c):
    y, z = _ffi.gemm(
        a,
        b,
        bias,
        c,
        act=cfg.act,
        slope=cfg.slope,
        alpha=cfg.alpha,
        beta=cfg.beta,
        trans_a=cfg.trans_a,
        trans_b=cfg.trans_b,
        bias_kind=cfg.bias_kind,
        store_z=cfg.return_z,
        exact_f32=cfg.exact_f32,
    )
    return (y, z) if cfg.return_z else y


def _fused_fwd(cfg, a, b, bias, c):
    if cfg.act == "none":  # act' = 1: the backward needs no residual beyond A and B
        return fused(cfg, a, b, bias, c), (a, b, None)
    if cfg.return_z:
        y, z = fused(cfg, a, b, bias, c)
        return (y, z), (a, b, z)
    if cfg.save == "z":
        y, z = fused(dataclasses.replace(cfg, return_z=True), a, b, bias, c)
        return y, (a, b, z)
    y = fused(cfg, a, b, bias, c)
    if cfg.save == "recompute":
        return y, (a, b, bias, c)
    return y, (a, b, y)  # save == "y": the output is the residual


def _fused_bwd(cfg, res, ct):
    gy, gz_extra = ct if cfg.return_z else (ct, None)
    if len(res) == 4:  # recompute Z: one more GEMM instead of an M x N residual
        a, b, bias, c = res
        s = fused(dataclasses.replace(cfg, act="none", return_z=False), a, b, bias, c)
        from_y = False
    else:
        a, b, s = res
        from_y = cfg.save == "y" and not cfg.return_z
    ga, gb, gbias, gc = backward(cfg, a, b, gy, s, from_y, gz_extra)
    return ga, gb, gbias, gc


fused.defvjp(_fused_fwd, _fused_bwd)


def matmul(x, y, *, trans_x, trans_y, alpha, exact_f32):
    """alpha * op(x) @ op(y): the dgrad and wgrad GEMMs (differentiable, linear)."""
    cfg = Config(act="none", alpha=alpha, trans_a=trans_x, trans_b=trans_y, save="y", exact_f32=exact_f32)
    return fused(cfg, x, y, None, None)


def backward(cfg: Config, a, b, gy, s, from_y, gz_extra=None):
    """(gA, gB, gBias, gC) of `fused`, given gY and S = Z (or Y when from_y)."""
    has_bias = cfg.bias_kind != "none"
    if cfg.act == "none":  # act' = 1: no elementwise pass at all
        gz, gbias = gy, None
    else:
        gz, gbias = dact(_DactSpec(cfg.act, cfg.slope, from_y, cfg.bias_kind, cfg.bias_shape[-1:]), gy, s)
    if gz_extra is not None:  # the caller also differentiates through Z
        gz, gbias = gz + gz_extra, None
    if has_bias and gbias is None:
        gbias = reference.bias_reduce(gz.astype(jnp.promote_types(gz.dtype, jnp.float32)), cfg.bias_kind)
        gbias = gbias.astype(gz.dtype)

    # op(A) [M,K], op(B) [K,N]: g op(A) = alpha gZ op(B)^T, g op(B) = alpha op(A)^T gZ,
    # mapped back through the transposes without materialising any of them.
    mm = partial(matmul, alpha=cfg.alpha, exact_f32=cfg.exact_f32)
    if cfg.trans_a:
        ga = mm(b, gz, trans_x=cfg.trans_b, trans_y=True)
    else:
        ga = mm(gz, b, trans_x=False, trans_y=not cfg.trans_b)
    if cfg.trans_b:
        gb = mm(gz, a, trans_x=True, trans_y=cfg.trans_a)
    elif not cfg.trans_a and all(d == 1 for d in b.shape[:-2]) and a.shape[:-2] == gz.shape[:-2] and a.ndim > 2:
        # B shared by the batch: one GEMM contracting over batch x M, not one per entry then a sum.
        k, n = a.shape[-1], gz.shape[-1]
        gb = mm(a.reshape(-1, k), gz.reshape(-1, n), trans_x=True, trans_y=False).reshape(b.shape)
    else:
        gb = mm(a, gz, trans_x=not cfg.trans_a, trans_y=False)
    ga, gb = _sum_to(ga, a.shape), _sum_to(gb, b.shape)
    if has_bias:
        gbias = _sum_to(gbias, cfg.bias_shape)
    gc = _sum_to(cfg.beta * gz, cfg.c_shape) if cfg.c_shape else None
    return ga, gb, gbias, gc


# ---------------------------------------------------------------------------
# backward epilogue
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _DactSpec:
    act: str
    slope: float
    from_y: bool
    bias_kind: str
    bias_len: tuple  # (L,) or ()


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def dact(spec: _DactSpec, gy, s):
    return _ffi.dact(
        gy,
        s,
        act=spec.act,
        slope=spec.slope,
        from_y=spec.from_y,
        bias_kind=spec.bias_kind,
        bias_len=spec.bias_len[0] if spec.bias_len else 0,
    )


def _reference_dact(spec, gy, s):
    return reference.dact(gy, s, act=spec.act, leaky_slope=spec.slope, from_y=spec.from_y, bias_kind=spec.bias_kind)


def _dact_fwd(spec, gy, s):
    return dact(spec, gy, s), (gy, s)


def _dact_bwd(spec, res, ct):
    _, vjp = jax.vjp(partial(_reference_dact, spec), *res)
    return vjp(ct)


dact.defvjp(_dact_fwd, _dact_bwd)
