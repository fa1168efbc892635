"""The plain-JAX programs of the ops: each primitive's reference, and XLA's own programs.

A primitive's reference gives its output types (abstract evaluation), the derivatives past
first order, and the program its call lowers to where the routing (_route) says XLA's own
program is at least as fast. The references keep the kernels' numerics: the product
accumulated in f32 (f64 for f64) and rounded once with the epilogue. The XLA programs
(`xla_gemm`, `xla_folded`) are what a user writes: the product in the input dtype, then the
epilogue in it, which XLA folds into its own GEMM where it can.

Operands here are the canonical ones (_args.prepare): every operand with the same number of
batch dims, the bias as a [..., L] vector of its kind. `cfg` is an _args.Config.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax.numpy as jnp
from jax import lax

from . import reference
from ._targets import gemm_shape

acc_dtype = reference._acc_dtype


def op(x, trans):
    """op(x): x, or x transposed in its last two dims."""
    return jnp.swapaxes(x, -1, -2) if trans else x


def precision(cfg):
    return lax.Precision.HIGHEST if cfg.exact_f32 else None


def split(cfg, args):
    """(a, b, bias, c) from a forward primitive's flat operands (absent ones are not passed)."""
    a, b, *rest = args
    bias = rest.pop(0) if cfg.bias_kind != "none" else None
    c = rest.pop(0) if cfg.c_shape else None
    return a, b, bias, c


def out_shape(cfg, a, b):
    return gemm_shape(a.shape, b.shape, cfg.trans_a, cfg.trans_b, *([cfg.c_shape] if cfg.c_shape else []))


def bias_broadcast(bias, kind):
    """A canonical bias [..., L] as an array that broadcasts against [..., M, N]."""
    return bias[..., None, :] if kind == "per_col" else bias[..., :, None]  # per_row; scalar: L = 1


def epilogue(z, bias, c, *, act, slope, beta, bias_kind, dtype):
    """(Y, Z) in `dtype` from alpha op(A) op(B) in z's type, with the canonical operands (bias
    [..., L] or None, C or None): the kernels' epilogue in plain JAX."""
    if c is not None and beta != 0:  # beta = 0 reads no C, as BLAS (docs/spec.md §2)
        z = z + beta * c.astype(z.dtype)
    if bias is not None:
        z = z + bias_broadcast(bias.astype(z.dtype), bias_kind)
    return reference.act_fwd(act, z, slope).astype(dtype), z.astype(dtype)


def scaled(alpha, product):
    """alpha * product; zeros for alpha = 0, which reads no product, as BLAS (docs/spec.md §2)."""
    return alpha * product if alpha != 0 else jnp.zeros_like(product)


def fused_outputs(cfg, z, bias, c, dtype):
    """[Y] or [Y, Z] (cfg.return_z) in `dtype` from the product z: the epilogue in z's type."""
    y, z = epilogue(z, bias, c, act=cfg.act, slope=cfg.slope, beta=cfg.beta, bias_kind=cfg.bias_kind, dtype=dtype)
    return [y, z] if cfg.return_z else [y]


def fused_ref(*args, cfg):
    """regemm_fused's reference: the product accumulated in f32 (f64), the epilogue on it, rounded once."""
    a, b, bias, c = split(cfg, args)
    z = scaled(cfg.alpha, jnp.matmul(op(a, cfg.trans_a), op(b, cfg.trans_b), precision=precision(cfg),
                                     preferred_element_type=acc_dtype(a.dtype), out_sharding=cfg.out_sharding))  # fmt: skip
    return fused_outputs(cfg, z, bias, c, a.dtype)


def xla_product(a, b, *, alpha, trans_a, trans_b, exact_f32, out_sharding=None):
    """alpha op(A) op(B) in a's dtype as XLA's own dot (accumulated in f32, as nn.Dense's)."""
    prec = lax.Precision.HIGHEST if exact_f32 else lax.Precision.DEFAULT
    mm = partial(jnp.matmul, op(a, trans_a), op(b, trans_b), precision=prec, out_sharding=out_sharding)
    if alpha == 1.0:
        return mm()
    return scaled(alpha, mm(preferred_element_type=acc_dtype(a.dtype))).astype(a.dtype)


def xla_gemm(a, b, *, cfg):
    """A plain GEMM as XLA's own dot: XLA's autotuned GEMM (split-K for the narrow
    wgrads of deep narrow MLPs), a cheaper launch than a custom call, and a node XLA
    can fuse and schedule around."""
    return [xla_product(a, b, alpha=cfg.alpha, trans_a=cfg.trans_a, trans_b=cfg.trans_b, exact_f32=cfg.exact_f32,
                        out_sharding=cfg.out_sharding)]  # fmt: skip


def xla_folded(*args, cfg):
    """The fused op as the program a user writes: the product in a's dtype (xla_gemm), then the
    epilogue in it, which XLA folds into its own GEMM where it can (a bias, relu, gelu)."""
    a, b, bias, c = split(cfg, args)
    (z,) = xla_gemm(a, b, cfg=cfg)
    return fused_outputs(cfg, z, bias, c, a.dtype)


# ---------------------------------------------------------------------------
# regemm_fused_lin: the JVP of regemm_fused, linear in the tangents
# ---------------------------------------------------------------------------


def residual_kind(cfg):
    """What the backward reads beside A and B: "z", "y", "recompute" (bias and C, to recompute Z) or "none"."""
    if cfg.act == "none":
        return "none"
    return "z" if cfg.return_z else cfg.save


def split_lin(cfg, kind, has, args):
    """((a, b, s, bias, c), (dA, dB, dbias, dC)) from the flat operands: residuals, then present tangents."""
    args = list(args)
    a, b = args[:2]
    rest = args[2:]
    s = bias = c = None
    if kind in ("z", "y"):
        s = rest.pop(0)
    elif kind == "recompute":
        bias = rest.pop(0) if cfg.bias_kind != "none" else None
        c = rest.pop(0) if cfg.c_shape else None
    exists = [True, True, cfg.bias_kind != "none", bool(cfg.c_shape)]
    tangents = []
    it = iter(has)
    for e in exists:
        tangents.append(rest.pop(0) if e and next(it) else None)
    return (a, b, s, bias, c), tangents


def _act_prime(cfg, kind, a, b, s, bias, c):
    """act'(Z) in the accumulation type, from the residual."""
    acc = acc_dtype(a.dtype)
    if kind == "recompute":
        s = fused_ref(*[x for x in (a, b, bias, c) if x is not None], cfg=dataclasses.replace(cfg, return_z=True))[1]
    if kind == "y":
        return reference.act_grad_from_y(cfg.act, s.astype(acc), cfg.slope)
    return reference.act_grad(cfg.act, s.astype(acc), cfg.slope)


def lin_ref(*args, cfg, kind, has):
    """regemm_fused_lin's reference: dZ = alpha (op(dA) op(B) + op(A) op(dB)) + beta dC + dbias, dY = act'(S) dZ."""
    (a, b, s, bias, c), (da, db, dbias, dc) = split_lin(cfg, kind, has, args)
    acc = acc_dtype(a.dtype)
    mm = partial(jnp.matmul, precision=precision(cfg), preferred_element_type=acc)
    dz = jnp.zeros(out_shape(cfg, a, b), acc)
    if da is not None:
        dz = dz + cfg.alpha * mm(op(da, cfg.trans_a), op(b, cfg.trans_b))
    if db is not None:
        dz = dz + cfg.alpha * mm(op(a, cfg.trans_a), op(db, cfg.trans_b))
    if dc is not None:
        dz = dz + cfg.beta * dc.astype(acc)
    if dbias is not None:
        dz = dz + bias_broadcast(dbias.astype(acc), cfg.bias_kind)
    dy = dz if kind == "none" else _act_prime(cfg, kind, a, b, s, bias, c) * dz
    outs = [dy, dz] if cfg.return_z else [dy]
    return [o.astype(a.dtype) for o in outs]


# ---------------------------------------------------------------------------
# The backward epilogues
# ---------------------------------------------------------------------------


def dact_ref(gy, s, *, spec):
    """regemm_dact's reference: [gZ] or [gZ, gBias]."""
    gz, gbias = reference.dact(gy, s, act=spec.act, leaky_slope=spec.slope, from_y=spec.from_y, bias_kind=spec.bias_kind)
    return [gz] if gbias is None else [gz, gbias]


def dgrad_dact_ref(a, b, s, *after, spec):
    """regemm_dgrad_dact's reference: the dgrad GEMM (accumulated in f32, rounded), then dact_ref."""
    acc = acc_dtype(a.dtype)
    prec = lax.Precision.HIGHEST if spec.exact_f32 else None
    gy = spec.alpha * jnp.matmul(op(a, spec.trans_a), op(b, spec.trans_b), precision=prec, preferred_element_type=acc)
    return dact_ref(gy.astype(a.dtype), s, spec=spec.dact)


def dgrad_dact_xla(a, b, s, *after, spec):
    """regemm_dgrad_dact as the program a user's backward is: the dgrad product in the input dtype
    (XLA's own GEMM, which writes no f32 [M, N] as the reference's product may), then dact_ref,
    which XLA fuses into one elementwise pass and the bias gradient's reduction."""
    gy = xla_product(a, b, alpha=spec.alpha, trans_a=spec.trans_a, trans_b=spec.trans_b, exact_f32=spec.exact_f32)
    return dact_ref(gy, s, spec=spec.dact)


def bias_grad_ref(gz, *, kind):
    return [reference.bias_grad(gz, kind)]
