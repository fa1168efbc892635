"""The backward epilogues: the primitives `regemm_dact`, `regemm_bias_grad`, `regemm_dgrad_dact`.

- `regemm_dact`: gZ = gY act'(S) with the bias gradient, in one pass; its derivatives are its
  reference's (needed past first order only). Where gY is the result of a plain GEMM lowered in
  the same program (the dgrad of the layer above, in a stack of separate layers), it lowers as
  `regemm_dgrad_dact`, the GEMM with this epilogue, as `rg.mlp`'s backward runs it (the fold
  across layers written one op at a time: _fold).
- `regemm_bias_grad`: the bias gradient of a layer of act none, which no call makes (its gZ is
  gY): the reference's sum, a primitive only so that it lowers behind its partitioning rule
  (summed over devices in its dtype, with the weight gradients: _partition.bias_grad).
- `regemm_dgrad_dact`: a dgrad GEMM with the backward epilogue of the layer below.

Each lowers per platform to the program the routing names (_route.epilogue_program): regemm's
call behind its partitioning rule, or the reference.
"""

from __future__ import annotations

import dataclasses

from jax.interpreters import mlir

from . import _fold, _partition, _programs, _route
from ._fused import matmul
from ._primitive import define, same_varying_axes


@dataclasses.dataclass(frozen=True)
class DactSpec:
    act: str
    slope: float
    from_y: bool
    bias_kind: str
    bias_len: tuple  # (L,) or ()


@dataclasses.dataclass(frozen=True)
class DgradDactSpec:
    dact: DactSpec
    alpha: float
    trans_a: bool
    trans_b: bool
    exact_f32: bool
    in_place: bool = False  # the program reads S no more: gZ may be written over it (_ffi._in_place)

    def ffi_attrs(self):
        """The dgrad_dact target's attributes (_targets.DGRAD_DACT), and whether it may write over S."""
        d = self.dact
        return dict(act=d.act, slope=d.slope, from_y=d.from_y, bias_kind=d.bias_kind, alpha=self.alpha,
                    trans_a=self.trans_a, trans_b=self.trans_b, exact_f32=self.exact_f32,
                    in_place=self.in_place)  # fmt: skip


def _epilogue_pick(operands):
    """The routing of a backward epilogue whose kernels read its first `operands` operands (dgrad_dact's
    `after` is not read)."""

    def pick(platform, *args, spec):
        args = args[:operands]
        return _route.epilogue_program(platform, args[0].dtype, *(x.shape for x in args), gemm=operands == 3)

    return pick


def _two(outs):
    return (outs[0], outs[1] if len(outs) > 1 else None)


# ---------------------------------------------------------------------------
# regemm_dact
# ---------------------------------------------------------------------------


def _dact_lower(gy, s, *, spec):
    gz, gbias = _partition.dact(gy, s, act=spec.act, slope=spec.slope, from_y=spec.from_y, bias_kind=spec.bias_kind)
    return [gz] if gbias is None else [gz, gbias]


def _dact_rule(base, platform, ctx, gy, s, *, spec):
    """regemm_dact's lowering: as regemm_dgrad_dact of the GEMM that made gY where one did (the
    fold across layers written one op at a time, _fold), else `base`."""
    found = _fold.gemm_of(ctx, gy)
    if found is not None:
        (a, b), (a_aval, b_aval), cfg, *_ = found
        avals = (a_aval, b_aval, ctx.avals_in[1])
        ddspec = DgradDactSpec(spec, cfg.alpha, cfg.trans_a, cfg.trans_b, cfg.exact_f32)
        same = _programs.out_shape(cfg, a_aval, b_aval) == ctx.avals_in[0].shape and a_aval.dtype == ctx.avals_in[0].dtype
        if same and _dgrad_dact_pick(platform, *avals, spec=ddspec) == "regemm":
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


_dact_p = define("regemm_dact", _programs.dact_ref, programs={"regemm": _dact_lower, "xla": _programs.dact_ref},
                 pick=_epilogue_pick(2), rule=_dact_rule)  # fmt: skip


def dact(spec: DactSpec, gy, s):
    """(gZ, gBias or None)."""
    return _two(_dact_p.bind(*same_varying_axes([gy, s]), spec=spec))


# ---------------------------------------------------------------------------
# regemm_bias_grad
# ---------------------------------------------------------------------------


def _bias_grad_lower(gz, *, kind):
    return [_partition.bias_grad(gz, kind)]


_bias_grad_p = define("regemm_bias_grad", _programs.bias_grad_ref,
                      programs={"regemm": _bias_grad_lower, "xla": _programs.bias_grad_ref},
                      pick=lambda platform, gz, *, kind: _route.epilogue_program(platform, gz.dtype, gz.shape))  # fmt: skip


def bias_grad(gz, kind):
    """reference.bias_grad(gz, kind), partitioned as the calls' bias gradients are."""
    return _bias_grad_p.bind(gz, kind=kind)[0]


# ---------------------------------------------------------------------------
# regemm_dgrad_dact
# ---------------------------------------------------------------------------


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
        gz, gb, dw = _partition.layer_backward(a, b, s, wa, wb, wgrad=matmul, w_alpha=wcfg.alpha,
                                               w_trans_a=wcfg.trans_a, w_trans_b=wcfg.trans_b,
                                               w_exact_f32=wcfg.exact_f32, **spec.ffi_attrs())  # fmt: skip
        return [gz] + ([] if gb is None else [gb]) + [dw]

    sub = ctx.replace(avals_in=(*avals, *w_avals), avals_out=[*ctx.avals_out, dw_aval])
    outs = mlir.lower_fun(both, multiple_results=True)(sub, *operands, wa, wb)
    dw = outs[-1][0] if isinstance(outs[-1], (list, tuple)) else outs[-1]
    wrapper.operands[0] = dw
    wrapper.move_after(dw.owner)
    return outs[:-1]


_dgrad_dact_pick = _epilogue_pick(3)
_dgrad_dact_p = define("regemm_dgrad_dact", _programs.dgrad_dact_ref,
                       programs={"regemm": _dgrad_dact_lower, "xla": _programs.dgrad_dact_xla},
                       pick=_dgrad_dact_pick, rule=_dgrad_dact_rule)  # fmt: skip


def dgrad_dact(spec: DgradDactSpec, a, b, s, after=None):
    """(gZ, gBias or None): gZ = (alpha op(a) op(b)) * act'(s); after: a value the call follows
    (never read; in programs of one GPU only, _dgrad_dact_rule)."""
    return _two(_dgrad_dact_p.bind(*same_varying_axes([a, b, s] + ([] if after is None else [after])), spec=spec))
