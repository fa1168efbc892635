"""The fused backward: the transpose of `regemm_fused_lin` (_fused), and `backward`.

Given gY: the backward epilogue (gZ = gY act'(S) with the bias gradient, one regemm_dact call;
none for act none), then the dgrad and wgrad GEMMs as separate ops, for only the cotangents
asked for, so that XLA drops the ones whose results are unused.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _fold
from ._args import Config
from ._epilogues import DactSpec, bias_grad, dact
from ._fused import fused, lin_p, matmul
from ._primitive import explicit, register_uncached, sum_to
from ._programs import split_lin


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
register_uncached(_one_buffer_p, _one_buffer_lower)


def one_buffer(g):
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
        gz, gbias = one_buffer(gy), None
    else:
        spec = DactSpec(cfg.act, cfg.slope, from_y, cfg.bias_kind if want_bias else "none", cfg.bias_shape[-1:])
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
        ga = sum_to(ga, a.shape)
    if need_b:
        if cfg.trans_b:
            gb = mm(gz, a, trans_x=True, trans_y=cfg.trans_a, out_sharding=same_rank[1])
        elif not cfg.trans_a and all(d == 1 for d in b.shape[:-2]) and a.shape[:-2] == gz.shape[:-2] and a.ndim > 2:
            # B shared by the batch: one GEMM contracting over batch x M, not one per entry then a sum.
            k, n = a.shape[-1], gz.shape[-1]
            gb = mm(a.reshape(-1, k), gz.reshape(-1, n), trans_x=True, trans_y=False).reshape(b.shape)
        else:
            gb = mm(a, gz, trans_x=not cfg.trans_a, trans_y=False, out_sharding=same_rank[1])
        gb = sum_to(gb, b.shape)
    gbias = sum_to(gbias, cfg.bias_shape) if want_bias else None
    gc = sum_to(cfg.beta * gz, cfg.c_shape) if cfg.c_shape and need_c else None
    return ga, gb, gbias, gc


def _lin_transpose(cts, *args, cfg, kind, has):
    """regemm_fused_lin's transpose rule: the fused backward."""
    (a, b, s, bias, c), tangents = split_lin(cfg, kind, has, args)
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
    types = [explicit(t.aval) if ad.is_undefined_primal(t) else None for t in tangents[:2]]
    grads = backward(cfg, a, b, ct_y, s, kind == "y", ct_z, need=need, types=types)
    return [None] * n_res + [g for g, t in zip(grads, tangents) if t is not None]


ad.primitive_transposes[lin_p] = _lin_transpose
