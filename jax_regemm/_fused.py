"""The fused forward and its JVP: the primitives `regemm_fused` and `regemm_fused_lin`.

- `regemm_fused`: Y (, Z) = act(alpha op(A) op(B) + beta C + bias). A plain GEMM is the
  same op with act none (`matmul`: the backward's dgrad and wgrad GEMMs).
- `regemm_fused_lin`: its JVP, linear in the tangents:
      dZ = alpha (op(dA) op(B) + op(A) op(dB)) + beta dC + dbias,  dY = act'(S) dZ
  with S the residual the save policy keeps: Z, Y, or nothing (Z recomputed from A, B,
  bias, C). Forward mode evaluates it in plain JAX. Reverse mode transposes it, and its
  transpose is the fused backward (_backward). So jvp, grad, and every mix of them
  (jacfwd, hessian, linearize) work, with one JVP rule.

regemm_fused lowers per platform to the program the routing names (_route): regemm's call
behind its partitioning rule (_partition.gemm), XLA's dot, or plain JAX. Its vmap rule adds a
leading batch dim (the kernels broadcast by stride), folding a batch of A against a shared B
into M.
"""

from __future__ import annotations

import dataclasses

from jax.interpreters import ad

from . import _fold, _partition, _programs, _route
from ._args import Config
from ._primitive import define, lead, same_varying_axes


def _fused_lower(*args, cfg):
    a, b, bias, c = _programs.split(cfg, args)
    y, z = _partition.gemm(
        a, b, bias, c, act=cfg.act, slope=cfg.slope, alpha=cfg.alpha, beta=cfg.beta, trans_a=cfg.trans_a,
        trans_b=cfg.trans_b, bias_kind=cfg.bias_kind, store_z=cfg.return_z, exact_f32=cfg.exact_f32,
    )  # fmt: skip
    return [y, z] if cfg.return_z else [y]


_PROGRAMS = {"regemm": _fused_lower, "xla_gemm": _programs.xla_gemm, "xla_folded": _programs.xla_folded,
             "reference": _programs.fused_ref}  # fmt: skip


def _pick(platform, a, b, *rest, cfg):
    return _route.fused_program(platform, cfg, a.shape, b.shape, a.dtype)


def _fused_rule(base, platform, ctx, *args, cfg):
    """regemm_fused's lowering: `base`, with a plain 2-D GEMM's result recorded for a dact that
    reads it (the fold across layers written one op at a time: _fold, _epilogues)."""
    outs = base(ctx, *args, cfg=cfg)
    a, b = ctx.avals_in[:2]
    if _route.plain(cfg) and a.ndim == 2 and b.ndim == 2 and cfg.out_sharding is None:
        y, wrapper = outs[0], None
        if _fold.partitioned(ctx):  # a wgrad a fold may run in one op with its call (_epilogues)
            outs = [*outs]
            outs[0], wrapper = _fold.rewirable(y)
        _fold.gemm_results(ctx)[y] = (tuple(args[:2]), (a, b), cfg, ctx.avals_out[0], wrapper)
    return outs


def _fused_jvp(primals, tangents, *, cfg):
    a, b, bias, c = _programs.split(cfg, primals)
    kind = _programs.residual_kind(cfg)
    fwd = dataclasses.replace(cfg, return_z=cfg.return_z or kind == "z", differentiated=True)
    outs = fused_p.bind(*primals, cfg=fwd)
    y = outs[0]
    res = [a, b] + {"z": [outs[-1]], "y": [y], "recompute": [x for x in (bias, c) if x is not None], "none": []}[kind]
    has = tuple(type(t) is not ad.Zero for t in tangents)  # of (dA, dB, dbias, dC), among the operands that exist
    lin_tangents = [t for t in tangents if type(t) is not ad.Zero]
    primal_out = outs if cfg.return_z else [y]
    if not lin_tangents:
        return primal_out, [ad.Zero.from_primal_value(o) for o in primal_out]
    return primal_out, lin_p.bind(*same_varying_axes(res + lin_tangents), cfg=cfg, kind=kind, has=has)


def _fused_batch(args, dims, *, cfg):
    a, b, bias, c = _programs.split(cfg, args)
    da, db, dbias, dc = _programs.split(cfg, dims)
    na = None  # not batched
    foldable = (
        da is not na and db is na and a.ndim == 3 and not cfg.trans_a
        and (bias is None or (dbias is na and cfg.bias_kind != "per_row"))
        and (c is None or dc is not na) and len(cfg.c_shape) in (0, 2)
    )  # fmt: skip
    if foldable:  # [B, M, K] @ [K, N] -> one GEMM of B*M rows (the weight's gradient: one wgrad GEMM)
        a = lead(a, da)
        nbat, m = a.shape[0], a.shape[1]
        args2 = [a.reshape(nbat * m, a.shape[2]), b] + ([bias] if bias is not None else [])
        if c is not None:  # [B, M, N] -> [B*M, N] (N spelled out: a -1 is undefined when B*M == 0)
            c = lead(c, dc)
            args2.append(c.reshape(nbat * m, c.shape[-1]))
            cfg = dataclasses.replace(cfg, c_shape=tuple(args2[-1].shape))
        outs = fused_p.bind(*args2, cfg=cfg)
        return [o.reshape(nbat, m, o.shape[-1]) for o in outs], [0] * len(outs)
    # Otherwise one more leading batch dim: an operand without it gets a size-1 dim, read by stride.
    args2 = [lead(x, d) for x, d in zip(args, dims)]
    _, _, bias2, c2 = _programs.split(cfg, args2)
    cfg = dataclasses.replace(
        cfg, bias_shape=() if bias2 is None else tuple(bias2.shape), c_shape=() if c2 is None else tuple(c2.shape)
    )
    outs = fused_p.bind(*args2, cfg=cfg)
    return outs, [0] * len(outs)


fused_p = define("regemm_fused", _programs.fused_ref, programs=_PROGRAMS, pick=_pick, rule=_fused_rule,
                 jvp=_fused_jvp, batch=_fused_batch)  # fmt: skip
# Its transpose, the fused backward, is _backward's (it reads the backward epilogues' primitives).
lin_p = define("regemm_fused_lin", _programs.lin_ref, batch="ref")


def fused(cfg: Config, a, b, bias, c):
    """Y, or (Y, Z) when cfg.return_z: the differentiable, batchable fused op."""
    args = same_varying_axes([a, b] + [x for x in (bias, c) if x is not None])
    outs = fused_p.bind(*args, cfg=cfg)
    return tuple(outs) if cfg.return_z else outs[0]


def matmul(x, y, *, trans_x, trans_y, alpha, exact_f32, out_sharding=None):
    """alpha * op(x) @ op(y): the dgrad and wgrad GEMMs (differentiable, linear)."""
    cfg = Config(
        act="none", alpha=alpha, trans_a=trans_x, trans_b=trans_y, save="y", exact_f32=exact_f32,
        out_sharding=out_sharding,
    )  # fmt: skip
    return fused(cfg, x, y, None, None)
