"""The MLP block: its layers' fused forwards, and one linear primitive for its JVP.

h_0 = x [M, K_0], h_l = act_l(h_{l-1} @ W_l + b_l). The JVP is one primitive over the
whole stack (`regemm_mlp_lin`), so its transpose, the backward, sees every layer: layer l's
dgrad GEMM and layer l-1's backward epilogue are one call (regemm_dgrad_dact: gZ_{l-1} =
(gZ_l W_l^T) act'_{l-1}(S_{l-1}) and the bias gradient), as layer-by-layer transposes get it
only at lowering (the fold across layers written one op at a time, _fold). Forward mode
evaluates the primitive in plain JAX, as for regemm_fused_lin.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from . import _ffi
from ._backward import one_buffer
from ._epilogues import DactSpec, DgradDactSpec, bias_grad, dact, dgrad_dact
from ._fused import fused, matmul
from ._primitive import define, explicit, fold_rows, same_varying_axes, unfold_rows
from ._programs import lin_ref, residual_kind


@dataclasses.dataclass(frozen=True)
class MlpSpec:
    cfgs: tuple  # each layer's Config (2-D operands; bias per column or none)


def _mlp_kinds(spec):
    return tuple(residual_kind(c) for c in spec.cfgs)


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
        (dh,) = lin_ref(h, w, *res, dh, dw, *([db] if db is not None else []), cfg=cfg, kind=kind, has=has)
    return [dh]


def _mlp_residual(cfg, kind, h, w, s, b):
    """S_l (Z or Y of the layer), recomputed where the save policy keeps neither."""
    if kind != "recompute":
        return s
    return fused(dataclasses.replace(cfg, act="none", return_z=False), h, w, b, None)


def _mm_typed(x, y, t, **kw):
    """matmul with the sharding type of the cotangent t (an undefined primal) where it has one."""
    typ = explicit(t.aval)
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
        gz, gb = one_buffer(g), None
    else:
        s = _mlp_residual(cfg, kinds[top], h, w, s, b)
        dspec = DactSpec(cfg.act, cfg.slope, kinds[top] == "y", cfg.bias_kind if want_b else "none", cfg.bias_shape[-1:])
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
            dspec = DactSpec(below.act, below.slope, kinds[l - 1] == "y", "per_col" if want_b else "none", ())
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
            ddspec = DgradDactSpec(dspec, cfg.alpha, False, not tb, cfg.exact_f32, in_place)
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
        flat, size = fold_rows(args, dims, rows)
        (out,) = _mlp_lin_p.bind(*flat, spec=spec)
        return [unfold_rows(out, size)], [0]
    outs = jax.vmap(partial(_mlp_lin_ref, spec=spec), in_axes=tuple(dims))(*args)
    return outs, [0] * len(outs)


_mlp_lin_p = define("regemm_mlp_lin", _mlp_lin_ref, batch=_mlp_lin_batch, transpose=_mlp_lin_transpose)


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
    (dh,) = _mlp_lin_p.bind(*same_varying_axes(res + tangent_args), spec=spec)
    return h, dh
