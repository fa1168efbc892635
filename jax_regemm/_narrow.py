"""The fused narrow MLP (docs/spec.md §8): the whole stack in one kernel per direction.

`mlp_block` runs a stack here when `spec_of` says the kernels take its shape: bf16 or f16,
every hidden layer 16, 32, 64 or 128 wide with one activation, an output of at most 128,
2-9 layers of plain x @ W + b (save="auto"). Three primitives, each with all its rules here:

- `regemm_narrow_mlp`: y of the stack (ffi/cuda/narrow: each block of rows through every
  layer on chip);
- `regemm_narrow_mlp_bwd`: (gx, every gW, every gb) of the stack at gy; the kernel recomputes
  the forward on chip, so nothing but x, the weights and the biases is kept for it;
- `regemm_narrow_mlp_lin`: the JVP, linear in the tangents; its transpose is the backward.

Each lowers on CUDA to its FFI target where the kernel fits (shared memory; the switch
REGEMM_NARROW not off), partitioned over a mesh as a call over rows (_partition.rows), and
elsewhere (the CPU, a stack too big) to the per-layer program: the chain of regemm_fused calls
and its fused backward (_mlp_block), so the same program runs on every platform. `chosen`
decides at trace time where `mlp_block` takes this path, and whether its derivative does. Forward mode and derivatives past the first evaluate the reference (plain JAX, f32
accumulation, each layer rounded to the input dtype as the kernels store it). A batch (vmap)
with shared weights folds into the rows.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching

from . import _env, _ffi, _mlp_block, _partition, reference
from ._primitive import define, explicit, fold_rows, same_varying_axes, unfold_rows
from ._targets import NARROW_MLP, NARROW_MLP_BWD

WIDTHS = (16, 32, 64, 128)  # the hidden widths the kernels are compiled for
MAX_OUT = 128
LAYERS = (2, 9)  # weight matrices: 1-8 hidden layers and the output layer
DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class NarrowSpec:
    mlp: _mlp_block.MlpSpec  # the per-layer description: the program where the kernel does not run
    act: str  # every hidden layer's
    final_act: str
    slope: float
    w_transposed: bool  # weights stored [N, K] (Equinox)
    has_bias: tuple  # per layer
    width: int  # every hidden layer's
    n_out: int  # the output layer's
    fused_backward: bool = True  # the derivative through the fused backward; else the per-layer block's

    def attrs(self):
        return dict(act=self.act, final_act=self.final_act, slope=self.slope, w_transposed=self.w_transposed)


def spec_of(spec: _mlp_block.MlpSpec, x, weights, save) -> NarrowSpec | None:
    """The narrow description of an MLP block (cfgs of its layers, x [M, K0]), or None where the
    kernels do not take it."""
    cfgs = spec.cfgs
    if save != "auto" or np.dtype(x.dtype).name not in DTYPES or x.ndim != 2 or not LAYERS[0] <= len(cfgs) <= LAYERS[1]:
        return None
    plain = all(c.alpha == 1.0 and not c.c_shape and c.bias_kind in ("none", "per_col") and not c.trans_a
                and not c.exact_f32 and c.trans_b == cfgs[0].trans_b and c.slope == cfgs[0].slope for c in cfgs)  # fmt: skip
    hidden = cfgs[:-1]
    widths = [w.shape[-2] if cfgs[0].trans_b else w.shape[-1] for w in weights]
    if not plain or len({c.act for c in hidden}) != 1 or len(set(widths[:-1])) != 1:
        return None
    if widths[0] not in WIDTHS or not 1 <= widths[-1] <= MAX_OUT or x.shape[-1] < 1:
        return None
    return NarrowSpec(spec, hidden[0].act, cfgs[-1].act, cfgs[0].slope, cfgs[0].trans_b,
                      tuple(c.bias_kind != "none" for c in cfgs), widths[0], widths[-1])  # fmt: skip


def chosen(spec: _mlp_block.MlpSpec, x, weights, save) -> NarrowSpec | None:
    """The NarrowSpec where `mlp_block` runs the stack as the fused narrow MLP: the kernels take
    its shape, the program is traced for CUDA (the default backend; lowered elsewhere too, it runs
    there on the per-layer program) and, under REGEMM_NARROW=auto, the fused forward is the
    faster. Its derivative takes the fused backward where that kernel fits and (auto) wins, else
    the per-layer block's (whose forward keeps the residuals)."""
    nspec = spec_of(spec, x, weights, save)
    if nspec is None or jax.default_backend() != "gpu" or not kernel_runs("cuda", nspec, x):
        return None
    typed = [explicit(getattr(a, "aval", a)) for a in (x, *weights)]
    if any(t is not None and any(t.spec) for t in typed):
        return None  # (shardings in types, Explicit axes: the per-layer block types every result as jnp's)
    auto = _env.choice("REGEMM_NARROW") == "auto"
    if auto and not fused_forward_wins(nspec, x):
        return None
    fused = kernel_runs("cuda", nspec, x, backward=True) and (not auto or fused_backward_wins(nspec, x))
    return dataclasses.replace(nspec, fused_backward=fused)


def fused_forward_wins(nspec, x) -> bool:
    """Whether the fused forward beats the per-layer program (XLA's GEMMs at these widths), as
    measured on an H200 (bf16 relu, plain / fused device time in one process, benchmarks/results/
    h200_narrow.md): from 2^16 rows at every width, 1.44-1.53x at 2^16 rows (16 and 64 wide), 1.08x
    at 2^16 x 128 (where the weight load is 18 us of 41), 1.63-2.53x from 2^18. Fewer rows are not
    measured."""
    return x.shape[0] >= 2**16


def fused_backward_wins(nspec, x) -> bool:
    """Whether a training step is faster with the fused backward than through the per-layer
    block, as measured on an H200 (bf16 relu Adam steps, plain / ours device time,
    benchmarks/results/h200_narrow.md, 4928c87): fused 1.36x at 2^20 x 64 x 4 hidden, 1.38x at
    2^18, 1.22x at 2^16, 1.62x at 2^20 x 32 x 3, 1.44x at 2^20 x 16 x 4, where the per-layer step
    measured 0.96-1.03x. So wherever the kernel takes the stack (`kernel_runs`: widths 16-64 and
    the dW tiles its warps keep) from 2^16 rows, as the forward; fewer rows are not measured."""
    return x.shape[0] >= 2**16


def _split(nspec, args):
    """(x, weights, biases with None where absent, rest) of a primitive's operands."""
    n = len(nspec.has_bias)
    x, ws, rest = args[0], list(args[1 : 1 + n]), list(args[1 + n :])
    bs = [rest.pop(0) if has else None for has in nspec.has_bias]
    return x, ws, bs, rest


def _layers(nspec, x, ws, bs):
    """h_L on the reference: f32 accumulation, each layer rounded to x's dtype."""
    h = x
    for cfg, w, b in zip(nspec.mlp.cfgs, ws, bs):
        h = reference.gemm_bias_act(h, w, b, act=cfg.act, leaky_slope=cfg.slope, trans_b=nspec.w_transposed,
                                    bias_kind="per_col")  # fmt: skip
    return h


# --- the forward ----------------------------------------------------------------------------


def _fwd_ref(*args, nspec):
    x, ws, bs, _ = _split(nspec, args)
    return [_layers(nspec, x, ws, bs)]


def _fwd_layers(*args, nspec):  # the per-layer program
    x, ws, bs, _ = _split(nspec, args)
    return [_mlp_block.mlp(nspec.mlp, x, tuple(ws), tuple(bs))]


def _operands(nspec, x, ws, bs):
    """The FFI operands: x, every weight, every bias ([0] where a layer has none)."""
    return [x, *ws, *(b if b is not None else jnp.zeros((0,), x.dtype) for b in bs)]


def _fwd_call(nspec, x, *rest):  # the call on one device's rows (_partition.rows)
    return _ffi._call(NARROW_MLP, (jax.ShapeDtypeStruct((x.shape[0], nspec.n_out), x.dtype),), x, *rest,
                      **nspec.attrs())  # fmt: skip


def _fwd_kernel(*args, nspec):
    x, ws, bs, _ = _split(nspec, args)
    ops = _operands(nspec, x, ws, bs)
    (y,) = _partition.rows(_fwd_call, nspec, ops, [(x.shape[0], nspec.n_out)], [True] + [False] * (len(ops) - 1),
                           [True])  # fmt: skip
    return [y]


def _dims(nspec, x):
    return int(x.shape[-1]), nspec.width, len(nspec.has_bias), nspec.n_out


def kernel_runs(platform, nspec, x, backward=False):
    """Whether a call lowers to the kernel: on CUDA, where it fits (shared memory, and for the
    backward a workspace), the switch not off, the rows static."""
    cuda = _ffi._regemm_cuda
    if platform != "cuda" or cuda is None or _env.choice("REGEMM_NARROW") == "off":
        return False
    if not all(isinstance(d, (int, np.integer)) for d in x.shape):
        return False  # (symbolic rows: the workspace is sized from the device's resident blocks, any M)
    k0, width, layers, n_out = _dims(nspec, x)
    need = cuda.narrow_smem_bytes(k0, width, layers, n_out, backward)
    if need < 0 or need > cuda.narrow_smem_limit():
        return False
    if backward:
        return cuda.narrow_bwd_workspace_bytes(np.dtype(x.dtype).name, k0, width, layers, n_out, nspec.act) >= 0
    return True


def _fwd_pick(platform, *args, nspec):
    return "kernel" if kernel_runs(platform, nspec, args[0]) else "layers"


def _fold_batch(p, ref, rows_in, rows_out):
    """The batching rule of primitive p whose row operands (x, gy, dx: `rows_in(nspec, n)` says
    which) carry the batch, its weights shared: the batch folds into the rows (`rows_out(nspec,
    **params)`: the results that have them). Else (a batch of weights, or the backward asked for
    weight or bias gradients, which are per example under vmap and would sum over a folded
    batch) `ref`, vmapped."""

    def batch(args, dims, *, nspec, **params):
        rows = rows_in(nspec, len(args))
        per_example = any(params.get("want_w", ())) or any(params.get("want_b", ()))  # (sums over rows: no fold)
        if per_example or any(d is not None for d, r in zip(dims, rows) if not r):
            outs = jax.vmap(partial(ref, nspec=nspec, **params), in_axes=tuple(dims))(*args)
            return outs, [0] * len(outs)
        flat, size = fold_rows(args, dims, rows)
        outs = p.bind(*flat, nspec=nspec, **params)
        out_rows = rows_out(nspec, **params)
        return [unfold_rows(o, size) if r else o for o, r in zip(outs, out_rows)], [0 if r else None for r in out_rows]

    return batch


def _rows_fwd(nspec, n):
    return [True] + [False] * (n - 1)


_fwd_p = define("regemm_narrow_mlp", _fwd_ref, programs={"kernel": _fwd_kernel, "layers": _fwd_layers},
                pick=_fwd_pick, batch=None)  # fmt: skip


# --- the backward ---------------------------------------------------------------------------


def _bwd_ref(*args, nspec, want_x, want_w, want_b):
    x, ws, bs, (gy,) = _split(nspec, args)
    _, vjp = jax.vjp(lambda x, ws, bs: _layers(nspec, x, ws, bs), x, ws, bs)
    gx, gws, gbs = vjp(gy)
    return _pick_wanted(nspec, gx, gws, gbs, want_x, want_w, want_b)


def _pick_wanted(nspec, gx, gws, gbs, want_x, want_w, want_b):
    out = [gx] if want_x else []
    out += [g for g, want in zip(gws, want_w) if want]
    out += [g for g, has, want in zip(gbs, nspec.has_bias, want_b) if has and want]
    return out


def _bwd_layers(*args, nspec, want_x, want_w, want_b):  # the per-layer backward (it recomputes the forward)
    x, ws, bs, (gy,) = _split(nspec, args)
    _, vjp = jax.vjp(lambda x, ws, bs: _mlp_block.mlp(nspec.mlp, x, tuple(ws), tuple(bs)), x, ws, bs)
    gx, gws, gbs = vjp(gy)
    return _pick_wanted(nspec, gx, gws, gbs, want_x, want_w, want_b)


def _bwd_shapes(nspec, x, ws, bs, want_x, any_w, want_b):
    """The backward call's results: gx, every gW, every gb, each empty ([0, 0], [0]) where not wanted."""
    out = [x.shape if want_x else (0, 0)]
    out += [w.shape if any_w else (0, 0) for w in ws]
    out += [b.shape if b is not None and want else (0,) for b, want in zip(bs, want_b)]
    return [tuple(s) for s in out]


def _bwd_call(static, x, *rest):  # the call on one device's rows (_partition.rows)
    nspec, want_x, any_w, want_b = static
    n = len(nspec.has_bias)
    ws, bs = rest[:n], [b if b.shape[0] else None for b in rest[n : 2 * n]]
    results = [jax.ShapeDtypeStruct(s, x.dtype) for s in _bwd_shapes(nspec, x, ws, bs, want_x, any_w, want_b)]
    return _ffi._call(NARROW_MLP_BWD, results, x, *rest, **nspec.attrs())


def _bwd_kernel(*args, nspec, want_x, want_w, want_b):
    x, ws, bs, (gy,) = _split(nspec, args)
    static = (nspec, want_x, any(want_w), want_b)
    ops = _operands(nspec, x, ws, bs) + [gy]
    shapes = _bwd_shapes(nspec, x, ws, bs, want_x, any(want_w), want_b)
    outs = _partition.rows(_bwd_call, static, ops, shapes, [True] + [False] * (len(ops) - 2) + [True],
                           [want_x] + [False] * (len(shapes) - 1))  # fmt: skip
    n = len(ws)
    gx, gws, gbs = outs[0], outs[1 : 1 + n], outs[1 + n :]
    return _pick_wanted(nspec, gx, gws, gbs, want_x, want_w, want_b)


def _bwd_pick(platform, *args, nspec, want_x, want_w, want_b):
    return "kernel" if kernel_runs(platform, nspec, args[0], backward=True) else "layers"


def _bwd_out_rows(nspec, want_x, want_w, want_b):
    return [True] * want_x + [False] * (sum(want_w) + sum(h and w for h, w in zip(nspec.has_bias, want_b)))


_bwd_p = define("regemm_narrow_mlp_bwd", _bwd_ref, programs={"kernel": _bwd_kernel, "layers": _bwd_layers},
                pick=_bwd_pick, batch=None)  # fmt: skip


def _rows_bwd(nspec, n):
    return [True] + [False] * (n - 2) + [True]  # x, weights and biases, gy


# --- the JVP and its transpose --------------------------------------------------------------


def _lin_split(nspec, args):
    """(x, weights, biases, dx, dweights, dbiases) of regemm_narrow_mlp_lin's operands."""
    n_primal = 1 + len(nspec.has_bias) + sum(nspec.has_bias)
    x, ws, bs, _ = _split(nspec, args[:n_primal])
    dx, dws, dbs, _ = _split(nspec, args[n_primal:])
    return x, ws, bs, dx, dws, dbs


def _lin_ref(*args, nspec):
    x, ws, bs, dx, dws, dbs = _lin_split(nspec, args)
    _, dy = jax.jvp(lambda x, ws, bs: _layers(nspec, x, ws, bs), (x, ws, bs), (dx, dws, dbs))
    return [dy]


def _lin_transpose(cts, *args, nspec):
    (g,) = cts
    x, ws, bs, dx, dws, dbs = _lin_split(nspec, args)
    undefined = lambda t: t is not None and ad.is_undefined_primal(t)
    n_primal = 1 + len(ws) + sum(nspec.has_bias)
    if type(g) is ad.Zero or not any(undefined(t) for t in args[n_primal:]):
        return [None] * len(args)
    g = ad.instantiate_zeros(g)
    want_x = undefined(dx)
    want_w = tuple(undefined(t) for t in dws)
    want_b = tuple(undefined(t) for t in dbs)
    outs = list(_bwd_p.bind(*same_varying_axes(_operands_present(x, ws, bs) + [g]), nspec=nspec, want_x=want_x,
                            want_w=want_w, want_b=want_b))  # fmt: skip
    gx = outs.pop(0) if want_x else None
    gws = [outs.pop(0) if want else None for want in want_w]
    gbs = [outs.pop(0) if has and want else None for has, want in zip(nspec.has_bias, want_b)]
    return [None] * n_primal + [gx] + gws + [gb for gb, has in zip(gbs, nspec.has_bias) if has]


def _operands_present(x, ws, bs):
    return [x, *ws, *(b for b in bs if b is not None)]


def _rows_lin(nspec, n):
    n_primal = 1 + len(nspec.has_bias) + sum(nspec.has_bias)
    return [True] + [False] * (n_primal - 1) + [True] + [False] * (n - n_primal - 1)


_lin_p = define("regemm_narrow_mlp_lin", _lin_ref, transpose=_lin_transpose, batch=None)

# The batching rules, set here (define's batch=None): each binds its own primitive.
_y_rows = lambda nspec: [True]  # (y, dy: the one result, over the rows)
for _p, _ref, _rows_in, _rows_out in ((_fwd_p, _fwd_ref, _rows_fwd, _y_rows), (_bwd_p, _bwd_ref, _rows_bwd, _bwd_out_rows),
                                      (_lin_p, _lin_ref, _rows_lin, _y_rows)):  # fmt: skip
    batching.primitive_batchers[_p] = _fold_batch(_p, _ref, _rows_in, _rows_out)


# --- the op ---------------------------------------------------------------------------------


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def mlp(nspec: NarrowSpec, x, weights, biases):
    """h_L of the stack (x [M, K0]; weights a tuple; biases a tuple with None where absent)."""
    return _fwd_p.bind(*same_varying_axes(_operands_present(x, weights, biases)), nspec=nspec)[0]


@mlp.defjvp
def _mlp_jvp(nspec, primals, tangents):
    x, ws, bs = primals
    dx, dws, dbs = tangents
    if not nspec.fused_backward:
        return jax.jvp(partial(_mlp_block.mlp, nspec.mlp), (x, ws, bs), (dx, dws, dbs))
    y = mlp(nspec, x, ws, bs)
    primal_args = _operands_present(x, ws, bs)
    tangent_args = _operands_present(dx, dws, [t if b is not None else None for t, b in zip(dbs, bs)])
    (dy,) = _lin_p.bind(*same_varying_axes(primal_args + tangent_args), nspec=nspec)
    return y, dy
