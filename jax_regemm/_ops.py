"""The differentiable ops: each FFI call wrapped in a jax.custom_vjp.

- `fused`: Y (, Z) = act(alpha op(A) op(B) + beta C + bias), bound as the
  primitive `regemm_fused` (see below) around the custom_vjp `_fused`. Its residual is
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
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

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
def _fused(cfg: Config, a, b, bias, c):
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
        return _fused(cfg, a, b, bias, c), (a, b, None)
    if cfg.return_z:
        y, z = _fused(cfg, a, b, bias, c)
        return (y, z), (a, b, z)
    if cfg.save == "z":
        y, z = _fused(dataclasses.replace(cfg, return_z=True), a, b, bias, c)
        return y, (a, b, z)
    y = _fused(cfg, a, b, bias, c)
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


_fused.defvjp(_fused_fwd, _fused_bwd)


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
# the primitive: where vmap meets the custom_vjp
# ---------------------------------------------------------------------------
#
# vmap of a custom_vjp vmaps its backward as a whole: a weight shared by the
# batch then gets one gradient per example, materialised [B, K, N] and summed.
# `regemm_fused` puts a batching rule in front: a batch of A against a shared
# B is folded into M (a reshape) before the custom_vjp sees it, so under
# grad(vmap(f)) -- the usual per-example model -- the backward is one dgrad and
# one wgrad GEMM over the whole batch. Its JVP is the custom_vjp's, so
# vmap(grad(f)) (per-example gradients) keeps exact per-example semantics.

try:  # public in the JAX versions this targets; the private path is a fallback
    from jax.core import ShapedArray
except ImportError:  # pragma: no cover
    from jax._src.core import ShapedArray

_fused_p = Primitive("regemm_fused")
_fused_p.multiple_results = True


def _split(cfg, args):
    """(a, b, bias, c) from the primitive's flat operands (absent ones are not passed)."""
    args = list(args)
    a, b = args[:2]
    rest = args[2:]
    bias = rest.pop(0) if cfg.bias_kind != "none" else None
    c = rest.pop(0) if cfg.c_shape else None
    return a, b, bias, c


def _fused_impl(*args, cfg):
    out = _fused(cfg, *_split(cfg, args))
    return list(out) if cfg.return_z else [out]


def _fused_abstract(*avals, cfg):
    a, b, bias, c = _split(cfg, avals)
    shapes = [a.shape[:-2], b.shape[:-2]] + ([bias.shape[:-1]] if bias is not None else [])
    shapes += [c.shape[:-2]] if c is not None else []
    batch = jnp.broadcast_shapes(*shapes)
    m = a.shape[-1] if cfg.trans_a else a.shape[-2]
    n = b.shape[-2] if cfg.trans_b else b.shape[-1]
    out = ShapedArray(batch + (m, n), a.dtype)
    return [out, out] if cfg.return_z else [out]


def _fused_jvp(primals, tangents, *, cfg):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    fn = lambda *args: _fused_impl(*args, cfg=cfg)
    return jax.jvp(fn, tuple(primals), tuple(tangents))


def _fused_batch(args, dims, *, cfg):
    a, b, bias, c = _split(cfg, args)
    da, db, dbias, dc = _split(cfg, dims)
    na = None  # batching.not_mapped
    foldable = (
        da is not na and db is na and a.ndim == 3 and not cfg.trans_a
        and (bias is None or (dbias is na and cfg.bias_kind != "per_row"))
        and (c is None or dc is not na) and len(cfg.c_shape) in (0, 2)
    )  # fmt: skip
    if foldable:  # [B, M, K] @ [K, N] -> one GEMM of B*M rows
        a = jnp.moveaxis(a, da, 0)
        nbat, m = a.shape[0], a.shape[1]
        args2 = [a.reshape(nbat * m, a.shape[2]), b]
        args2 += [bias] if bias is not None else []
        if c is not None:  # [B, M, N] -> [B*M, N] (N spelled out: a -1 is undefined when B*M == 0)
            c = jnp.moveaxis(c, dc, 0)
            args2.append(c.reshape(nbat * m, c.shape[-1]))
        if c is not None:  # C's (static) shape is part of the config: it is now [B*M, N]
            cfg = dataclasses.replace(cfg, c_shape=tuple(args2[-1].shape))
        outs = _fused_p.bind(*args2, cfg=cfg)
        return [o.reshape(nbat, m, o.shape[-1]) for o in outs], [0] * len(outs)
    in_axes = tuple(None if d is na else d for d in dims)
    outs = jax.vmap(partial(_fused_impl, cfg=cfg), in_axes=in_axes)(*args)
    return outs, [0] * len(outs)


_fused_p.def_impl(_fused_impl)
_fused_p.def_abstract_eval(_fused_abstract)
ad.primitive_jvps[_fused_p] = _fused_jvp
batching.primitive_batchers[_fused_p] = _fused_batch
mlir.register_lowering(_fused_p, mlir.lower_fun(_fused_impl, multiple_results=True))


def fused(cfg: Config, a, b, bias, c):
    """Y, or (Y, Z) when cfg.return_z: the differentiable, batchable fused op."""
    args = [a, b] + [x for x in (bias, c) if x is not None]
    outs = _fused_p.bind(*args, cfg=cfg)
    return tuple(outs) if cfg.return_z else outs[0]


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
