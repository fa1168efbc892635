"""The differentiable ops: JAX primitives around the FFI calls.

- `regemm_fused`: Y (, Z) = act(alpha op(A) op(B) + beta C + bias), the fused
  forward GEMM. A plain GEMM is the same op with act none.
- `regemm_fused_lin`: its JVP, linear in the tangents:
      dZ = alpha (op(dA) op(B) + op(A) op(dB)) + beta dC + dbias,  dY = act'(S) dZ
  with S the residual the save policy keeps: Z, Y, or nothing (Z recomputed
  from A, B, bias, C). Forward mode evaluates it in plain JAX. Reverse mode
  transposes it, and its transpose is the fused backward: the dact kernel
  (gZ = gY act'(S) with the bias gradient in one pass), then the dgrad and
  wgrad GEMMs, for only the cotangents asked for. So jvp, grad, and every
  mix of them (jacfwd, hessian, linearize) work, with one JVP rule.
- `regemm_dact`: gZ = gY act'(S) with the bias gradient; its derivatives are
  its reference's (needed past first order only). Where gY is the result of a
  plain GEMM lowered in the same program (the dgrad of the layer above, in a
  stack of separate layers), it lowers as `regemm_dgrad_dact`, the GEMM with
  this epilogue, as `rg.mlp`'s backward runs it.
- `regemm_bias_grad`: the bias gradient of a layer of act none, which no call
  makes (its gZ is gY): the reference's sum, behind a partitioning rule.

Each primitive has a plain-JAX reference (`_fused_ref`, `_lin_ref`,
`_dact_ref`): the output types (shapes, shardings in types, shard_map's
varying axes) are the reference's, so the ops type as `jnp` does, and the
derivatives past first order run on it. The FFI calls appear only at
lowering, behind their partitioning rules (_partition.py), so jit over a mesh
keeps the work local, except where one table (`_ON_XLA`) says XLA's own
program is as fast: on the GPU a plain GEMM (nothing to fuse: the backward's
dgrad and wgrad) lowers to XLA's dot, and an op whose rows are not whole
16-byte vectors, or small, or a 16-bit forward outside a derivative whose
epilogue XLA folds into its GEMM (a bias, relu), to plain JAX. The ops' vmap rules add a leading batch
dim (the kernels broadcast by stride), folding a batch of A against a shared B
into M.
"""

from __future__ import annotations

import dataclasses
import math
import os
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import api_util, dispatch
from jax._src import core as _core
from jax._src.interpreters import partial_eval as pe
from jax.extend.core import Primitive
from jax.sharding import NamedSharding
from jax.interpreters import ad, batching, mlir

from . import _ffi, _fold, _partition, reference
from ._args import Config


def _sum_to(x, shape):
    """Sums x over the leading dims where `shape` (same rank) has 1: the VJP of a broadcast."""
    axes = tuple(i for i, (d, s) in enumerate(zip(x.shape, shape)) if s == 1 and d != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _types_of(ref, *avals, **params):
    """The output types of `ref` (plain JAX) on `avals`: a primitive's abstract evaluation."""
    fun = partial(ref, **params)
    debug = api_util.debug_info("jax_regemm", fun, avals, {})
    return pe.abstract_eval_fun(fun, *avals, debug_info=debug)


def _same_varying_axes(args):
    """Inside shard_map, every operand varying over the same manual axes (as jnp's
    ops make theirs): then the transpose of that cast sums the cotangent of an
    operand that was invariant (a replicated weight) over those axes."""
    insert = getattr(_core, "auto_insert_reshard", None) or getattr(_core, "standard_insert_pvary", None)
    return list(insert(*args)) if insert is not None and args else list(args)


def _primitive(name, ref, lower):
    p = Primitive(name)
    p.multiple_results = True
    p.def_impl(partial(dispatch.apply_primitive, p))  # eager: compile the one op
    p.def_abstract_eval(partial(_types_of, ref))
    mlir.register_lowering(p, mlir.lower_fun(lower, multiple_results=True))
    if lower is not ref:  # lowers through custom_partitioning, which needs the devices then
        dispatch.prim_requires_devices_during_lowering.add(p)
    return p


# Which ops lower to XLA's own program instead of a regemm call, by default: per platform,
# per op, the dtypes. "gemm" is a plain GEMM (nothing to fuse: the backward's dgrad and
# wgrad), "dact" the backward epilogue (regemm_dact, and regemm_dgrad_dact as XLA's dot
# and fusion), "unaligned" any of the ops whose operand rows are not whole 16-byte
# vectors (_unaligned_on_xla). Measured on the H100 (benchmarks/results/): XLA's GEMM is at
# least as fast and a cheaper launch (h100_layers_plain_gemm.md, h100_train_floor.md);
# XLA pads an unaligned GEMM, where regemm's TMA and vector kernels cannot run and its
# fallbacks (the SIMT GEMM, cuBLASLt's unaligned paths, the scalar dact) ran at 0.47-0.86
# of XLA's speed (h100_unaligned.md); the backward epilogue stays regemm's: on XLA, whole
# training steps ran 0.98x of XLA's speed against 1.13x (h100_train_dact_xla.md). "small" is
# any of the ops with at most _SMALL_ROWS rows of output (batch x M) or _SMALL_ELEMENTS
# elements: there a call's host cost is most of an uncaptured program's time and XLA's own
# GEMMs for few rows (split-K, Triton) run as fast or faster on the device; regemm's calls
# lost by wall clock in 64 of 84 such layers, 0.73-0.96 of XLA's speed by shape (H100,
# h100_small_layers.md). On the
# CPU oneDNN's bf16 and f16 GEMMs are several times faster than XLA's, and in f32 the
# layers measured the same either way (cpu_plain_gemm.md). "xla_epilogue" is a 16-bit
# forward outside a derivative whose epilogue XLA folds into its own GEMM (_xla_epilogue: a
# per-column bias, relu): the same single kernel as regemm's call at a cheaper launch, and an
# inference program's layer of 25-100 us is bound by the host (h200_linear_on_xla.md). In a
# derivative's forward the call stays: there the peak holds every layer's residuals, and
# XLA's GEMM brought its 32 MiB cuBLAS workspace to it (4096x2048x8 bf16 steps 16 MiB more,
# over XLA's own in half the runs), and relu' must be decided on Z rounded once (_kink_decided_on_z).
# In f32 XLA adds the bias in a kernel of its own (h100_train_ws_linear_79c5c6c.md).
_GPU_DTYPES = ("float32", "bfloat16", "float16")
_ON_XLA = {
    "cuda": {"gemm": _GPU_DTYPES + ("float64",), "dact": (), "unaligned": _GPU_DTYPES, "small": _GPU_DTYPES,
             "xla_epilogue": ("bfloat16", "float16")},
    "cpu": {"gemm": (), "dact": (), "unaligned": (), "small": (), "xla_epilogue": ()},
}
_SMALL_ROWS, _SMALL_ELEMENTS = 512, 2**21
# Per op, the variable that overrides the table on every platform: "xla" or "regemm"
# (A/B of a lowering choice, and tests of the kernels at odd and small sizes; read when a
# program is lowered).
_ON_XLA_VARIABLE = {"gemm": "REGEMM_PLAIN_GEMM", "dact": "REGEMM_DACT", "unaligned": "REGEMM_UNALIGNED",
                    "small": "REGEMM_SMALL", "xla_epilogue": "REGEMM_XLA_EPILOGUE"}  # fmt: skip


def _on_xla(op, platform, dtype):
    forced = os.environ.get(_ON_XLA_VARIABLE[op], "auto")
    if forced in ("xla", "regemm"):
        return forced == "xla"
    return dtype.name in _ON_XLA[platform][op]


def _unaligned_on_xla(platform, dtype, *row_lengths):
    """Whether an op with rows of these lengths (elements, as stored) lowers to XLA's own
    program for being unaligned: some row is not a whole number of 16-byte vectors, which
    the GPU kernels' TMA descriptors and vector loads need (ffi/cuda/cutlass_dispatch.cu, dact.cu)."""
    per_vector = max(16 // dtype.itemsize, 1)
    return any(n % per_vector for n in row_lengths) and _on_xla("unaligned", platform, dtype)


def _small_on_xla(platform, dtype, *shapes):
    """Whether an op lowers to XLA's own program for being small: at most _SMALL_ROWS rows of
    output or _SMALL_ELEMENTS elements, counted over its batch dims. shapes: the output's, or
    operands with the output's rows (the largest count is taken), the last with its columns.
    A symbolic dim (jax.export's shape polymorphism) leaves the size to run time: not small.
    Under a mesh these are the global shapes, before partitioning (a device's share is smaller)."""
    if not _on_xla("small", platform, dtype) or not all(_core.is_constant_shape(s) for s in shapes):
        return False
    rows = max(math.prod(s[:-1]) for s in shapes)
    return rows <= _SMALL_ROWS or rows * shapes[-1][-1] <= _SMALL_ELEMENTS


def _lowering(pick, platform):
    """The lowering rule of the function pick(platform, *operands, **params) returns for the
    call (an op's reference or its FFI call)."""

    def lower(*args, **params):
        return pick(platform, *args, **params)(*args, **params)

    return mlir.lower_fun(lower, multiple_results=True)


def _register_uncached(p, rule, platform=None):
    """register_lowering for a rule that reads its operands' producers: uncached, as JAX lowers a
    cacheable equation as an out-of-line function whose operands are its parameters. A JAX
    without the `cacheable` argument lowers equations inline."""
    try:
        mlir.register_lowering(p, rule, platform=platform, cacheable=False)
    except TypeError:
        mlir.register_lowering(p, rule, platform=platform)


def _lower_per_platform(p, pick, rule=None):
    """p's lowering on each platform of _ON_XLA: _lowering(pick, platform), or
    rule(that lowering, platform, ctx, *operands, **params), which reads its operands' producers
    or the program's devices."""
    for platform in _ON_XLA:
        base = _lowering(pick, platform)
        if rule is None:
            mlir.register_lowering(p, base, platform=platform)
        else:
            _register_uncached(p, partial(rule, base, platform), platform)


def _precision(cfg):
    return lax.Precision.HIGHEST if cfg.exact_f32 else None


def _op(x, trans):
    return jnp.swapaxes(x, -1, -2) if trans else x


# ---------------------------------------------------------------------------
# regemm_fused
# ---------------------------------------------------------------------------


def _split(cfg, args):
    """(a, b, bias, c) from the primitive's flat operands (absent ones are not passed)."""
    a, b, *rest = args
    bias = rest.pop(0) if cfg.bias_kind != "none" else None
    c = rest.pop(0) if cfg.c_shape else None
    return a, b, bias, c


def _fused_ref(*args, cfg):
    a, b, bias, c = _split(cfg, args)
    acc = reference._acc_dtype(a.dtype)
    z = cfg.alpha * jnp.matmul(
        _op(a, cfg.trans_a), _op(b, cfg.trans_b), precision=_precision(cfg), preferred_element_type=acc,
        out_sharding=cfg.out_sharding,
    )  # fmt: skip
    return _fused_outputs(cfg, z, bias, c, a.dtype)


def _fused_outputs(cfg, z, bias, c, dtype):
    """[Y] or [Y, Z] (cfg.return_z) in `dtype` from the product z: the epilogue in z's type."""
    y, z = _partition.epilogue(z, bias, c, act=cfg.act, slope=cfg.slope, beta=cfg.beta, bias_kind=cfg.bias_kind,
                               dtype=dtype)  # fmt: skip
    return [y, z] if cfg.return_z else [y]


def _fused_lower(*args, cfg):
    a, b, bias, c = _split(cfg, args)
    y, z = _partition.gemm(
        a, b, bias, c, act=cfg.act, slope=cfg.slope, alpha=cfg.alpha, beta=cfg.beta, trans_a=cfg.trans_a,
        trans_b=cfg.trans_b, bias_kind=cfg.bias_kind, store_z=cfg.return_z, exact_f32=cfg.exact_f32,
    )  # fmt: skip
    return [y, z] if cfg.return_z else [y]


_fused_p = _primitive("regemm_fused", _fused_ref, _fused_lower)


def plain(cfg):
    """alpha op(A) op(B) and nothing else: no bias, C, activation or Z stash to fuse."""
    return cfg.act == "none" and cfg.bias_kind == "none" and not cfg.c_shape and not cfg.return_z


def _kink_decided_on_z(cfg):
    """Whether a kink's act' will be decided on this op's Z, which must then be the product and
    bias rounded once, as the kernels and the reference have it: relu or leaky_relu in a
    derivative's forward or with Z asked for, and a Z the backward recomputes (act none with
    save="recompute": its layer's act is not known here, so every recompute). XLA's program
    rounds the product first, and where its GEMM fusion is Triton's act' flipped near 0: bf16
    gradients 3.6e-2 off the reference's (2048x1024x1024 relu, H100; SPEC's bound is 2e-2)."""
    if cfg.act == "none":
        return cfg.save == "recompute"
    return cfg.act in ("relu", "leaky_relu") and (cfg.differentiated or cfg.return_z)


def _xla_epilogue(cfg):
    """A forward outside a derivative whose epilogue XLA folds into its own GEMM ("xla_epilogue"
    in _ON_XLA): act none or relu, a per-column bias or none, nothing else (no C, alpha 1, no Z
    asked for), and no kink decided on its Z."""
    return (cfg.act in ("none", "relu") and cfg.bias_kind in ("none", "per_col") and not cfg.c_shape
            and cfg.alpha == 1.0 and not cfg.return_z and not cfg.differentiated and not _kink_decided_on_z(cfg))  # fmt: skip


def _xla_gemm(a, b, *, cfg):
    """A plain GEMM as XLA's own dot: XLA's autotuned GEMM (split-K for the narrow
    wgrads of deep narrow MLPs), a cheaper launch than a custom call, and a node XLA
    can fuse and schedule around."""
    precision = lax.Precision.HIGHEST if cfg.exact_f32 else lax.Precision.DEFAULT
    mm = partial(jnp.matmul, _op(a, cfg.trans_a), _op(b, cfg.trans_b), precision=precision,
                 out_sharding=cfg.out_sharding)  # fmt: skip
    if cfg.alpha == 1.0:  # the product in a's dtype, accumulated in f32 (as nn.Dense's)
        return [mm()]
    return [(cfg.alpha * mm(preferred_element_type=reference._acc_dtype(a.dtype))).astype(a.dtype)]


def _xla_folded(*args, cfg):
    """The fused op as the program a user writes: the product in a's dtype (_xla_gemm), then the
    epilogue in it, which XLA folds into its own GEMM where it can (a bias, relu, gelu)."""
    a, b, bias, c = _split(cfg, args)
    (z,) = _xla_gemm(a, b, cfg=cfg)
    return _fused_outputs(cfg, z, bias, c, a.dtype)


def _xla_fused(*args, cfg):
    """The lowering where regemm's calls cannot run fast, rows that are not whole 16-byte vectors
    and few rows of output (_ON_XLA): _xla_folded, or the reference's program (Z in f32) where a
    kink is decided on Z."""
    return (_fused_ref if _kink_decided_on_z(cfg) else _xla_folded)(*args, cfg=cfg)


def _pick_fused(platform, a, b, *rest, cfg):
    if plain(cfg) and _on_xla("gemm", platform, a.dtype):
        return _xla_gemm
    n = b.shape[-2] if cfg.trans_b else b.shape[-1]
    rows = (a.shape[-1], b.shape[-1], n) + tuple(cfg.c_shape[-1:])  # as stored: A, B, Y and Z, C
    if _unaligned_on_xla(platform, a.dtype, *rows) or _small_on_xla(platform, a.dtype, _out_shape(cfg, a, b)):
        return _xla_fused
    if _xla_epilogue(cfg) and _on_xla("xla_epilogue", platform, a.dtype):
        return _xla_folded
    return _fused_lower


# ---------------------------------------------------------------------------
# The fold across layers written one op at a time (_fold): the records of plain GEMMs
# ---------------------------------------------------------------------------


def _fused_rule(base, platform, ctx, *args, cfg):
    """regemm_fused's lowering: `base`, with a plain 2-D GEMM's result recorded for a dact that
    reads it (_fold, _dact_rule)."""
    outs = base(ctx, *args, cfg=cfg)
    a, b = ctx.avals_in[:2]
    if plain(cfg) and a.ndim == 2 and b.ndim == 2 and cfg.out_sharding is None:
        y, wrapper = outs[0], None
        if _fold.partitioned(ctx):  # a wgrad a fold may run in one op with its call (_lower_layer_backward)
            outs = [*outs]
            outs[0], wrapper = _fold.rewirable(y)
        _fold.gemm_results(ctx)[y] = (tuple(args[:2]), (a, b), cfg, ctx.avals_out[0], wrapper)
    return outs


_lower_per_platform(_fused_p, _pick_fused, _fused_rule)


def fused(cfg: Config, a, b, bias, c):
    """Y, or (Y, Z) when cfg.return_z: the differentiable, batchable fused op."""
    args = _same_varying_axes([a, b] + [x for x in (bias, c) if x is not None])
    outs = _fused_p.bind(*args, cfg=cfg)
    return tuple(outs) if cfg.return_z else outs[0]


def _residual_kind(cfg):
    """What the backward reads beside A and B: "z", "y", "recompute" (bias and C, to recompute Z) or "none"."""
    if cfg.act == "none":
        return "none"
    return "z" if cfg.return_z else cfg.save


def _fused_jvp(primals, tangents, *, cfg):
    a, b, bias, c = _split(cfg, primals)
    kind = _residual_kind(cfg)
    fwd = dataclasses.replace(cfg, return_z=cfg.return_z or kind == "z", differentiated=True)
    outs = _fused_p.bind(*primals, cfg=fwd)
    y = outs[0]
    res = [a, b] + {"z": [outs[-1]], "y": [y], "recompute": [x for x in (bias, c) if x is not None], "none": []}[kind]
    has = tuple(type(t) is not ad.Zero for t in tangents)  # of (dA, dB, dbias, dC), among the operands that exist
    lin_tangents = [t for t in tangents if type(t) is not ad.Zero]
    primal_out = outs if cfg.return_z else [y]
    if not lin_tangents:
        return primal_out, [ad.Zero.from_primal_value(o) for o in primal_out]
    return primal_out, _lin_p.bind(*_same_varying_axes(res + lin_tangents), cfg=cfg, kind=kind, has=has)


ad.primitive_jvps[_fused_p] = _fused_jvp


def _lead(x, d):
    """x with its batched dim (d) first, or a broadcast (size-1) leading dim where it has none."""
    return jnp.expand_dims(x, 0) if d is None else jnp.moveaxis(x, d, 0)


def _fused_batch(args, dims, *, cfg):
    a, b, bias, c = _split(cfg, args)
    da, db, dbias, dc = _split(cfg, dims)
    na = None  # not batched
    foldable = (
        da is not na and db is na and a.ndim == 3 and not cfg.trans_a
        and (bias is None or (dbias is na and cfg.bias_kind != "per_row"))
        and (c is None or dc is not na) and len(cfg.c_shape) in (0, 2)
    )  # fmt: skip
    if foldable:  # [B, M, K] @ [K, N] -> one GEMM of B*M rows (the weight's gradient: one wgrad GEMM)
        a = jnp.moveaxis(a, da, 0)
        nbat, m = a.shape[0], a.shape[1]
        args2 = [a.reshape(nbat * m, a.shape[2]), b] + ([bias] if bias is not None else [])
        if c is not None:  # [B, M, N] -> [B*M, N] (N spelled out: a -1 is undefined when B*M == 0)
            c = jnp.moveaxis(c, dc, 0)
            args2.append(c.reshape(nbat * m, c.shape[-1]))
            cfg = dataclasses.replace(cfg, c_shape=tuple(args2[-1].shape))
        outs = _fused_p.bind(*args2, cfg=cfg)
        return [o.reshape(nbat, m, o.shape[-1]) for o in outs], [0] * len(outs)
    # Otherwise one more leading batch dim: an operand without it gets a size-1 dim, read by stride.
    args2 = [_lead(x, d) for x, d in zip(args, dims)]
    _, _, bias2, c2 = _split(cfg, args2)
    cfg = dataclasses.replace(
        cfg, bias_shape=() if bias2 is None else tuple(bias2.shape), c_shape=() if c2 is None else tuple(c2.shape)
    )
    outs = _fused_p.bind(*args2, cfg=cfg)
    return outs, [0] * len(outs)


batching.primitive_batchers[_fused_p] = _fused_batch


# ---------------------------------------------------------------------------
# regemm_fused_lin: the JVP, whose transpose is the fused backward
# ---------------------------------------------------------------------------


def _split_lin(cfg, kind, has, args):
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


def _out_shape(cfg, a, b):
    m = a.shape[-1] if cfg.trans_a else a.shape[-2]
    n = b.shape[-2] if cfg.trans_b else b.shape[-1]
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2], *([cfg.c_shape[:-2]] if cfg.c_shape else []))
    return batch + (m, n)


def _act_prime(cfg, kind, a, b, s, bias, c):
    """act'(Z) in the accumulation type, from the residual."""
    acc = reference._acc_dtype(a.dtype)
    if kind == "recompute":
        s = _fused_ref(*[x for x in (a, b, bias, c) if x is not None], cfg=dataclasses.replace(cfg, return_z=True))[1]
    if kind == "y":
        return reference.act_grad_from_y(cfg.act, s.astype(acc), cfg.slope)
    return reference.act_grad(cfg.act, s.astype(acc), cfg.slope)


def _lin_ref(*args, cfg, kind, has):
    (a, b, s, bias, c), (da, db, dbias, dc) = _split_lin(cfg, kind, has, args)
    acc = reference._acc_dtype(a.dtype)
    mm = partial(jnp.matmul, precision=_precision(cfg), preferred_element_type=acc)
    dz = jnp.zeros(_out_shape(cfg, a, b), acc)
    if da is not None:
        dz = dz + cfg.alpha * mm(_op(da, cfg.trans_a), _op(b, cfg.trans_b))
    if db is not None:
        dz = dz + cfg.alpha * mm(_op(a, cfg.trans_a), _op(db, cfg.trans_b))
    if dc is not None:
        dz = dz + cfg.beta * dc.astype(acc)
    if dbias is not None:
        dz = dz + _partition.bias_broadcast(dbias.astype(acc), cfg.bias_kind)
    dy = dz if kind == "none" else _act_prime(cfg, kind, a, b, s, bias, c) * dz
    outs = [dy, dz] if cfg.return_z else [dy]
    return [o.astype(a.dtype) for o in outs]


def _lin_transpose(cts, *args, cfg, kind, has):
    (a, b, s, bias, c), tangents = _split_lin(cfg, kind, has, args)
    ct_y, ct_z = (cts[0], cts[1]) if cfg.return_z else (cts[0], None)
    ct_y = None if type(ct_y) is ad.Zero else ct_y
    ct_z = None if type(ct_z) is ad.Zero else ct_z
    need = tuple(t is not None and ad.is_undefined_primal(t) for t in tangents)
    n_res = len(args) - sum(has)
    if (ct_y is None and ct_z is None) or not any(need):
        return [None] * len(args)
    if ct_y is None:
        ct_y = jnp.zeros_like(ct_z)
    if kind == "recompute":
        s = fused(dataclasses.replace(cfg, act="none", return_z=False), a, b, bias, c)
    types = [_explicit(t.aval) if ad.is_undefined_primal(t) else None for t in tangents[:2]]
    grads = backward(cfg, a, b, ct_y, s, kind == "y", ct_z, need=need, types=types)
    out = [None] * n_res + [g for g, t in zip(grads, tangents) if t is not None]
    return out


def _lin_jvp(primals, tangents, **params):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    _, t_out = jax.jvp(partial(_lin_ref, **params), tuple(primals), tuple(tangents))
    return _lin_p.bind(*primals, **params), t_out


def _lin_batch(args, dims, **params):
    outs = jax.vmap(partial(_lin_ref, **params), in_axes=tuple(dims))(*args)
    return outs, [0] * len(outs)


_lin_p = _primitive("regemm_fused_lin", _lin_ref, _lin_ref)
ad.primitive_transposes[_lin_p] = _lin_transpose
ad.primitive_jvps[_lin_p] = _lin_jvp
batching.primitive_batchers[_lin_p] = _lin_batch


def _explicit(aval):
    """aval's sharding where shardings are types (its mesh, or the context mesh, has Explicit axes:
    a weight made outside the mesh has an unsharded type there), the type to give its gradient;
    else None. As jnp's own transposes type a gradient by its primal."""
    explicit = lambda mesh: any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ()))
    sharding = getattr(aval, "sharding", None)
    if sharding is None or explicit(getattr(sharding, "mesh", None)):
        return sharding
    context = getattr(jax.sharding, "get_abstract_mesh", lambda: None)()
    return NamedSharding(context, sharding.spec) if explicit(context) else None


def matmul(x, y, *, trans_x, trans_y, alpha, exact_f32, out_sharding=None):
    """alpha * op(x) @ op(y): the dgrad and wgrad GEMMs (differentiable, linear)."""
    cfg = Config(
        act="none", alpha=alpha, trans_a=trans_x, trans_b=trans_y, save="y", exact_f32=exact_f32,
        out_sharding=out_sharding,
    )  # fmt: skip
    return fused(cfg, x, y, None, None)


def _one_buffer_lower(ctx, g):
    # An argument of the function being lowered is one buffer already, and a barrier on an
    # entry parameter costs a copy of it (single layers with the cotangent as the program's
    # input, 65536x256x256 none: 0.108 -> 0.148 ms bf16, 0.203 -> 0.277 f32).
    if _fold.is_argument(g):
        return [g]
    return mlir.lower_fun(lambda x: [lax.optimization_barrier(x)], multiple_results=True)(ctx, g)


_one_buffer_p = Primitive("regemm_one_buffer")
_one_buffer_p.def_impl(lambda g: g)
_one_buffer_p.def_abstract_eval(lambda g: g)
ad.deflinear(_one_buffer_p, lambda ct: [_one_buffer_p.bind(ct)])
batching.defvectorized(_one_buffer_p)
_register_uncached(_one_buffer_p, _one_buffer_lower)


def _one_buffer(g):
    """g, written once: a layer's gZ where act is none is the cotangent itself, read by three ops
    (the dgrad GEMM, or the dgrad_dact call of the layer below it folds into; the wgrad GEMM; the
    bias reduction). Else XLA fuses g's producer (a loss's gradient) into each op that can take it
    and writes a copy for each that cannot (steps of f32 Dense layers held one or two [M, N]
    buffers more, and ran 1-3% slower: results/h100_train_floor_dense.md). An optimization
    barrier, where g is made in the program (_one_buffer_lower)."""
    return _one_buffer_p.bind(g)


def backward(cfg: Config, a, b, gy, s, from_y, gz_extra=None, need=(True, True, True, True), types=(None, None)):
    """(gA, gB, gBias, gC) of `fused` given gY and S = Z (or Y when from_y); None where not `need`ed.
    types: gA's and gB's sharding types under a mesh of Explicit axes (a GEMM contracting a
    sharded dim needs one), else None."""
    need_a, need_b, need_bias, need_c = need
    has_bias = cfg.bias_kind != "none"
    want_bias = has_bias and need_bias
    if cfg.act == "none":  # act' = 1: no elementwise pass at all
        gz, gbias = _one_buffer(gy), None
    else:
        spec = _DactSpec(cfg.act, cfg.slope, from_y, cfg.bias_kind if want_bias else "none", cfg.bias_shape[-1:])
        gz, gbias = dact(spec, gy, s)
    if gz_extra is not None:  # the caller also differentiates through Z
        gz, gbias = gz + gz_extra, None
    if want_bias and gbias is None:
        gbias = bias_grad(gz, cfg.bias_kind)

    # op(A) [M,K], op(B) [K,N]: g op(A) = alpha gZ op(B)^T, g op(B) = alpha op(A)^T gZ,
    # mapped back through the transposes without materialising any of them.
    mm = partial(matmul, alpha=cfg.alpha, exact_f32=cfg.exact_f32)
    ga = gb = None
    same_rank = [t if t is not None and len(t.spec) <= x.ndim and x.ndim == 2 else None for t, x in zip(types, (a, b))]
    if need_a:
        if cfg.trans_a:
            ga = mm(b, gz, trans_x=cfg.trans_b, trans_y=True, out_sharding=same_rank[0])
        else:
            ga = mm(gz, b, trans_x=False, trans_y=not cfg.trans_b, out_sharding=same_rank[0])
        ga = _sum_to(ga, a.shape)
    if need_b:
        if cfg.trans_b:
            gb = mm(gz, a, trans_x=True, trans_y=cfg.trans_a, out_sharding=same_rank[1])
        elif not cfg.trans_a and all(d == 1 for d in b.shape[:-2]) and a.shape[:-2] == gz.shape[:-2] and a.ndim > 2:
            # B shared by the batch: one GEMM contracting over batch x M, not one per entry then a sum.
            k, n = a.shape[-1], gz.shape[-1]
            gb = mm(a.reshape(-1, k), gz.reshape(-1, n), trans_x=True, trans_y=False).reshape(b.shape)
        else:
            gb = mm(a, gz, trans_x=not cfg.trans_a, trans_y=False, out_sharding=same_rank[1])
        gb = _sum_to(gb, b.shape)
    gbias = _sum_to(gbias, cfg.bias_shape) if want_bias else None
    gc = _sum_to(cfg.beta * gz, cfg.c_shape) if cfg.c_shape and need_c else None
    return ga, gb, gbias, gc


# ---------------------------------------------------------------------------
# regemm_dact: the backward epilogue
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _DactSpec:
    act: str
    slope: float
    from_y: bool
    bias_kind: str
    bias_len: tuple  # (L,) or ()


def _dact_ref(gy, s, *, spec):
    gz, gbias = reference.dact(gy, s, act=spec.act, leaky_slope=spec.slope, from_y=spec.from_y, bias_kind=spec.bias_kind)
    return [gz] if gbias is None else [gz, gbias]


def _dact_lower(gy, s, *, spec):
    gz, gbias = _partition.dact(gy, s, act=spec.act, slope=spec.slope, from_y=spec.from_y, bias_kind=spec.bias_kind)
    return [gz] if gbias is None else [gz, gbias]


def _epilogue_primitive(name, ref, lower, operands, rule=None):
    """A backward-epilogue primitive: derivatives from its reference (needed past first order
    only), vmap as one more leading batch dim (the kernels broadcast by stride). The first
    `operands` arguments are the ones its kernels read (dgrad_dact's `after` is not).
    Returns the primitive and its lowering choice, pick(platform, *operands, spec=)."""
    p = _primitive(name, ref, lower)

    def pick(platform, *args, spec):
        args = args[:operands]
        dtype = args[0].dtype
        if _on_xla("dact", platform, dtype):
            return ref
        rows = (x.shape[-1] for x in args)  # gY and S; or A, B and S
        # gZ has S's rows and columns (and gY's rows, or A's: a vmap may have batched them, not S)
        if _unaligned_on_xla(platform, dtype, *rows) or _small_on_xla(platform, dtype, args[0].shape, args[-1].shape):
            return ref
        return lower

    _lower_per_platform(p, pick, rule)

    def jvp(primals, tangents, *, spec):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        _, t_out = jax.jvp(partial(ref, spec=spec), tuple(primals), tuple(tangents))
        return p.bind(*primals, spec=spec), t_out

    def batch(args, dims, *, spec):
        outs = p.bind(*[_lead(x, d) for x, d in zip(args, dims)], spec=spec)
        return outs, [0] * len(outs)

    ad.primitive_jvps[p] = jvp
    batching.primitive_batchers[p] = batch
    return p, pick


def _dact_rule(base, platform, ctx, gy, s, *, spec):
    """regemm_dact's lowering: as regemm_dgrad_dact of the GEMM that made gY where one did (the
    fold across layers written one op at a time, _fold), else `base`."""
    found = _fold.gemm_of(ctx, gy)
    if found is not None:
        (a, b), (a_aval, b_aval), cfg, *_ = found
        avals = (a_aval, b_aval, ctx.avals_in[1])
        ddspec = _DgradDactSpec(spec, cfg.alpha, cfg.trans_a, cfg.trans_b, cfg.exact_f32)
        same = _out_shape(cfg, a_aval, b_aval) == ctx.avals_in[0].shape and a_aval.dtype == ctx.avals_in[0].dtype
        if same and _dgrad_dact_pick(platform, *avals, spec=ddspec) is _dgrad_dact_lower:
            wgrad = _fold.partitioned_wgrad(ctx, a, b, s, ddspec)
            if wgrad is not None:
                ddspec = dataclasses.replace(ddspec, in_place=_fold.writes_over_s(platform, avals, ddspec))
                return _lower_layer_backward(ctx, avals, (a, b, s), wgrad, ddspec)
            after = _fold.in_place_after(platform, ctx, a, b, s, avals, ddspec)
            if after is not None:
                ddspec = dataclasses.replace(ddspec, in_place=True)
                avals += tuple(aval for _, aval in after)
            lower = mlir.lower_fun(_dgrad_dact_lower, multiple_results=True)
            return lower(ctx.replace(avals_in=avals), a, b, s, *(v for v, _ in after or ()), spec=ddspec)
    return base(ctx, gy, s, spec=spec)


_dact_p, _dact_pick = _epilogue_primitive("regemm_dact", _dact_ref, _dact_lower, operands=2, rule=_dact_rule)


def dact(spec: _DactSpec, gy, s):
    """(gZ, gBias or None)."""
    outs = _dact_p.bind(*_same_varying_axes([gy, s]), spec=spec)
    return (outs[0], outs[1] if len(outs) > 1 else None)


# ---------------------------------------------------------------------------
# regemm_bias_grad: a bias gradient that no call makes
# ---------------------------------------------------------------------------
# A layer of act none has gZ = gY and no backward epilogue: its bias gradient is
# reference.bias_grad, a primitive only so that it lowers behind its partitioning rule
# (summed over devices in its dtype, with the weight gradients: _partition.bias_grad).


def _bias_grad_ref(gz, *, kind):
    return [reference.bias_grad(gz, kind)]


def _bias_grad_lower(gz, *, kind):
    return [_partition.bias_grad(gz, kind)]


_bias_grad_p = _primitive("regemm_bias_grad", _bias_grad_ref, _bias_grad_lower)
ad.primitive_jvps[_bias_grad_p] = lambda primals, tangents, *, kind: (  # linear: its tangent in plain JAX
    _bias_grad_p.bind(*primals, kind=kind), _bias_grad_ref(ad.instantiate_zeros(tangents[0]), kind=kind))
batching.primitive_batchers[_bias_grad_p] = lambda args, dims, *, kind: (_bias_grad_p.bind(_lead(args[0], dims[0]), kind=kind), [0])


def bias_grad(gz, kind):
    """reference.bias_grad(gz, kind), partitioned as the calls' bias gradients are."""
    return _bias_grad_p.bind(gz, kind=kind)[0]


# ---------------------------------------------------------------------------
# regemm_dgrad_dact: a dgrad GEMM with the backward epilogue of the layer below
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _DgradDactSpec:
    dact: _DactSpec
    alpha: float
    trans_a: bool
    trans_b: bool
    exact_f32: bool
    in_place: bool = False  # the program reads S no more: gZ may be written over it (_ffi._in_place)

    def ffi_attrs(self):
        """The dgrad_dact target's attributes (_partition.dgrad_dact; _ffi's in-place query)."""
        d = self.dact
        return dict(act=d.act, slope=d.slope, from_y=d.from_y, bias_kind=d.bias_kind, alpha=self.alpha,
                    trans_a=self.trans_a, trans_b=self.trans_b, exact_f32=self.exact_f32,
                    in_place=self.in_place)  # fmt: skip


def _dgrad_dact_ref(a, b, s, *after, spec):
    acc = reference._acc_dtype(a.dtype)
    gy = spec.alpha * jnp.matmul(_op(a, spec.trans_a), _op(b, spec.trans_b), precision=lax.Precision.HIGHEST
                                 if spec.exact_f32 else None, preferred_element_type=acc)  # fmt: skip
    return _dact_ref(gy.astype(a.dtype), s, spec=spec.dact)


def _dgrad_dact_lower(a, b, s, *after, spec):
    gz, gbias = _partition.dgrad_dact(a, b, s, *after, **spec.ffi_attrs())
    return [gz] if gbias is None else [gz, gbias]


def _dgrad_dact_rule(base, platform, ctx, a, b, s, *after, spec):
    """regemm_dgrad_dact's lowering: a call asked to write gZ over S after a value (rg.mlp's, over
    Y, after the wgrad that reads it) does so in a program of one GPU (_fold.one_gpu); partitioned,
    it runs as one op with that wgrad (_lower_layer_backward); elsewhere it neither follows the value
    nor writes over S. Nor over an S the function being lowered takes as an argument (XLA would copy
    it for the call)."""
    if after and _fold.partitioned(ctx) and not _fold.is_argument(s):
        found = _fold.gemm_of(ctx, after[0])
        if found is not None and _fold.rewirable_now(found) and found[4].results[0] == after[0]:
            return _lower_layer_backward(ctx, ctx.avals_in[:3], (a, b, s), found, spec)
    if (after and not _fold.one_gpu(platform, ctx)) or (spec.in_place and _fold.is_argument(s)):
        ctx = ctx.replace(avals_in=ctx.avals_in[:3])
        return base(ctx, a, b, s, spec=dataclasses.replace(spec, in_place=False))
    return base(ctx, a, b, s, *after, spec=spec)


def _lower_layer_backward(ctx, avals, operands, wgrad, spec):
    """A folded dgrad_dact call on `operands` and the wgrad recorded as `wgrad` (which reads S) as one
    partitioned op (_partition.layer_backward: the wgrad, then the call following it); the program then
    reads the wgrad's result from it (through the wgrad's wrapper, moved after it) and XLA drops the
    wgrad as lowered first. Returns the call's results."""
    (wa, wb), w_avals, wcfg, dw_aval, wrapper = wgrad

    def both(a, b, s, wa, wb):
        gz, gb, dw = _partition.layer_backward(a, b, s, wa, wb, w_alpha=wcfg.alpha, w_trans_a=wcfg.trans_a,
                                               w_trans_b=wcfg.trans_b, w_exact_f32=wcfg.exact_f32,
                                               **spec.ffi_attrs())  # fmt: skip
        return [gz] + ([] if gb is None else [gb]) + [dw]

    sub = ctx.replace(avals_in=(*avals, *w_avals), avals_out=[*ctx.avals_out, dw_aval])
    outs = mlir.lower_fun(both, multiple_results=True)(sub, *operands, wa, wb)
    dw = outs[-1][0] if isinstance(outs[-1], (list, tuple)) else outs[-1]
    wrapper.operands[0] = dw
    wrapper.move_after(dw.owner)
    return outs[:-1]


_dgrad_dact_p, _dgrad_dact_pick = _epilogue_primitive("regemm_dgrad_dact", _dgrad_dact_ref, _dgrad_dact_lower,
                                                      operands=3, rule=_dgrad_dact_rule)  # fmt: skip


def dgrad_dact(spec: _DgradDactSpec, a, b, s, after=None):
    """(gZ, gBias or None): gZ = (alpha op(a) op(b)) * act'(s); after: a value the call follows
    (never read; in programs of one GPU only, _dgrad_dact_rule)."""
    outs = _dgrad_dact_p.bind(*_same_varying_axes([a, b, s] + ([] if after is None else [after])), spec=spec)
    return (outs[0], outs[1] if len(outs) > 1 else None)


# ---------------------------------------------------------------------------
# The MLP block: its layers' fused forwards, one linear primitive for its JVP
# ---------------------------------------------------------------------------
# h_0 = x [M, K_0], h_l = act_l(h_{l-1} @ W_l + b_l). The JVP is one primitive
# over the whole stack (`regemm_mlp_lin`), so its transpose, the backward, sees
# every layer: layer l's dgrad GEMM and layer l-1's backward epilogue are one
# call (regemm_dgrad_dact: gZ_{l-1} = (gZ_l W_l^T) act'_{l-1}(S_{l-1}) and the
# bias gradient), as layer-by-layer transposes get it only at lowering (the fold
# across layers written one op at a time, above). Forward mode evaluates the
# primitive in plain JAX, as for regemm_fused_lin.


@dataclasses.dataclass(frozen=True)
class MlpSpec:
    cfgs: tuple  # each layer's Config (2-D operands; bias per column or none)


def _mlp_kinds(spec):
    return tuple(_residual_kind(c) for c in spec.cfgs)


def _mlp_split(spec, args):
    """Per layer (h_{l-1}, W_l, S_l or None, b_l or None (recompute only)), then the tangents
    (dx, then dW_l and db_l (where the layer has a bias) per layer)."""
    args = list(args)
    layers = []
    for cfg, kind in zip(spec.cfgs, _mlp_kinds(spec)):
        h, w = args.pop(0), args.pop(0)
        s = args.pop(0) if kind in ("z", "y") else None
        b = args.pop(0) if kind == "recompute" and cfg.bias_kind != "none" else None
        layers.append((h, w, s, b))
    dx = args.pop(0)
    dws, dbs = [], []
    for cfg in spec.cfgs:
        dws.append(args.pop(0))
        dbs.append(args.pop(0) if cfg.bias_kind != "none" else None)
    assert not args
    return layers, dx, dws, dbs


def _mlp_lin_ref(*args, spec):
    layers, dh, dws, dbs = _mlp_split(spec, args)
    for cfg, kind, (h, w, s, b), dw, db in zip(spec.cfgs, _mlp_kinds(spec), layers, dws, dbs):
        res = [s] if kind in ("z", "y") else [b] if b is not None else []
        has = (True, True) + ((True,) if cfg.bias_kind != "none" else ())
        (dh,) = _lin_ref(h, w, *res, dh, dw, *([db] if db is not None else []), cfg=cfg, kind=kind, has=has)
    return [dh]


def _mlp_residual(cfg, kind, h, w, s, b):
    """S_l (Z or Y of the layer), recomputed where the save policy keeps neither."""
    if kind != "recompute":
        return s
    return fused(dataclasses.replace(cfg, act="none", return_z=False), h, w, b, None)


def _mm_typed(x, y, t, **kw):
    """matmul with the sharding type of the cotangent t (an undefined primal) where it has one."""
    typ = _explicit(t.aval)
    return matmul(x, y, out_sharding=typ if typ is not None and len(typ.spec) <= 2 else None, **kw)


def _mlp_lin_transpose(cts, *args, spec):
    (g,) = cts
    layers, dx, dws, dbs = _mlp_split(spec, args)
    n_res = len(args) - 1 - len(dws) - sum(db is not None for db in dbs)
    undefined = lambda t: t is not None and ad.is_undefined_primal(t)
    out_dws = [None] * len(dws)
    out_dbs = [None] * len(dbs)
    out_dx = None
    if type(g) is ad.Zero:
        return [None] * len(args)
    kinds = _mlp_kinds(spec)
    # needed_below[l]: a cotangent is wanted from layer l or below (so gZ_l must be made)
    wanted = [undefined(dws[l]) or undefined(dbs[l]) for l in range(len(dws))]
    needed_below = [undefined(dx) or any(wanted[: l + 1]) for l in range(len(dws))]
    top = len(layers) - 1
    cfg, (h, w, s, b) = spec.cfgs[top], layers[top]
    if not needed_below[top]:
        return [None] * len(args)
    # gZ of the top layer: its own backward epilogue (a dact pass; none for act none)
    want_b = undefined(dbs[top])
    if cfg.act == "none":  # g itself, one buffer (the f32 32768x512x12 step held three: 896 -> 864.5 MiB)
        gz, gb = _one_buffer(g), None
    else:
        s = _mlp_residual(cfg, kinds[top], h, w, s, b)
        dspec = _DactSpec(cfg.act, cfg.slope, kinds[top] == "y", cfg.bias_kind if want_b else "none", cfg.bias_shape[-1:])
        gz, gb = dact(dspec, g, s)
    for l in range(top, -1, -1):
        cfg, (h, w, s, b) = spec.cfgs[l], layers[l]
        if undefined(dbs[l]):
            if gb is None:
                gb = bias_grad(gz, "per_col")
            out_dbs[l] = jnp.reshape(gb, dbs[l].aval.shape)
        mm = partial(_mm_typed, alpha=cfg.alpha, exact_f32=cfg.exact_f32)
        tb = cfg.trans_b  # W stored [N, K]: op(W) = W^T
        if undefined(dws[l]):  # g op(W) = h^T gZ
            out_dws[l] = mm(gz, h, dws[l], trans_x=True, trans_y=False) if tb else mm(h, gz, dws[l], trans_x=True, trans_y=False)
        if l == 0:
            if undefined(dx):  # gx = gZ op(W)^T
                out_dx = mm(gz, w, dx, trans_x=False, trans_y=not tb)
            break
        if not needed_below[l - 1]:
            break
        below, (hb, wb, sb, bb) = spec.cfgs[l - 1], layers[l - 1]
        want_b = undefined(dbs[l - 1])
        if below.act == "none":  # act' = 1: the plain dgrad GEMM
            gz, gb = matmul(gz, w, trans_x=False, trans_y=not tb, alpha=cfg.alpha, exact_f32=cfg.exact_f32), None
        else:  # the dgrad GEMM and the layer below's backward epilogue, one call
            sb = _mlp_residual(below, kinds[l - 1], hb, wb, sb, bb)
            dspec = _DactSpec(below.act, below.slope, kinds[l - 1] == "y", "per_col" if want_b else "none", ())
            # gZ is written over S (_ffi._in_place) where that lowers the step's peak: S is Y of
            # the layer below (the first call of the backward holds every layer's Y, the
            # cotangent and gZ: a buffer above the forward's peak) or recomputed here. Not over
            # Z: the forward's peak, Z and Y of every layer, is above the backward's, and the
            # fused kernel, the one way that runs in place, is slower than the composed way at
            # some of them (bf16 gelu at K = 512). Y is this layer's input h, which its wgrad
            # above reads: the call then takes that wgrad as an operand it follows, a data
            # dependence that orders the read first (else XLA copies S for the call); on one GPU,
            # or partitioned as one op with the wgrad, which the lowering decides (_dgrad_dact_rule).
            after = None
            in_place = kinds[l - 1] == "recompute" or (kinds[l - 1] == "y" and out_dws[l] is None)
            ddspec = _DgradDactSpec(dspec, cfg.alpha, False, not tb, cfg.exact_f32, in_place)
            if kinds[l - 1] == "y" and out_dws[l] is not None:
                if _ffi.dgrad_dact_in_place(gz, w, sb, **ddspec.ffi_attrs()):
                    ddspec, after = dataclasses.replace(ddspec, in_place=True), out_dws[l]
            gz, gb = dgrad_dact(ddspec, gz, w, sb, after)
    out = [None] * n_res + [out_dx]
    for cfg, dw, db in zip(spec.cfgs, out_dws, out_dbs):
        out.append(dw)
        if cfg.bias_kind != "none":
            out.append(db)
    return out


def _mlp_lin_jvp(primals, tangents, *, spec):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    _, t_out = jax.jvp(partial(_mlp_lin_ref, spec=spec), tuple(primals), tuple(tangents))
    return _mlp_lin_p.bind(*primals, spec=spec), t_out


def _mlp_row_operands(spec):
    """Which of regemm_mlp_lin's operands are [M, .] row blocks (x, the layers' inputs and S, dx);
    the others are weights and biases and their tangents."""
    rows = []
    for cfg, kind in zip(spec.cfgs, _mlp_kinds(spec)):
        rows += [True, False] + [True] * (kind in ("z", "y")) + [False] * (kind == "recompute" and cfg.bias_kind != "none")
    rows.append(True)  # dx
    for cfg in spec.cfgs:
        rows += [False] + [False] * (cfg.bias_kind != "none")
    return rows


def _mlp_lin_batch(args, dims, *, spec):
    rows = _mlp_row_operands(spec)
    if all(d is None for d, r in zip(dims, rows) if not r):
        # Weights shared by the batch (vmap over examples): the batch folds into M, so the
        # backward stays the folded one, with batch x M rows.
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        flat = []
        for x, d, r in zip(args, dims, rows):
            if r:
                x = jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
                m = x.shape[1]  # the same for every row operand
                x = x.reshape((size * m,) + x.shape[2:])
            flat.append(x)
        (out,) = _mlp_lin_p.bind(*flat, spec=spec)
        return [out.reshape((size, m) + out.shape[1:])], [0]
    outs = jax.vmap(partial(_mlp_lin_ref, spec=spec), in_axes=tuple(dims))(*args)
    return outs, [0] * len(outs)


_mlp_lin_p = _primitive("regemm_mlp_lin", _mlp_lin_ref, _mlp_lin_ref)
ad.primitive_transposes[_mlp_lin_p] = _mlp_lin_transpose
ad.primitive_jvps[_mlp_lin_p] = _mlp_lin_jvp
batching.primitive_batchers[_mlp_lin_p] = _mlp_lin_batch


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def mlp(spec: MlpSpec, x, weights, biases):
    """h_L of the block (x [M, K_0]; weights a tuple; biases a tuple with None where absent)."""
    h = x
    for cfg, w, b in zip(spec.cfgs, weights, biases):
        h = fused(cfg, h, w, b, None)
    return h


@mlp.defjvp
def _mlp_jvp(spec, primals, tangents):
    x, weights, biases = primals
    dx, dws, dbs = tangents
    h = x
    res = []
    for cfg, kind, w, b in zip(spec.cfgs, _mlp_kinds(spec), weights, biases):
        outs = fused(dataclasses.replace(cfg, return_z=kind == "z", differentiated=True), h, w, b, None)
        y = outs[0] if kind == "z" else outs
        res += [h, w] + {"z": [outs[-1] if kind == "z" else None], "y": [y], "recompute": [b] if b is not None else [],
                         "none": []}[kind]  # fmt: skip
        h = y
    tangent_args = [dx]
    for w_t, b_t, b in zip(dws, dbs, biases):
        tangent_args.append(w_t)
        if b is not None:
            tangent_args.append(b_t)
    (dh,) = _mlp_lin_p.bind(*_same_varying_axes(res + tangent_args), spec=spec)
    return h, dh
