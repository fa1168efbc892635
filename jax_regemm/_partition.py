"""Partitioning rules of the FFI calls, for jit over a mesh.

A custom call is opaque to XLA's partitioner: without a rule every device
gathers its operands and runs the whole call. Each call here is wrapped in
`jax.experimental.custom_partitioning` with a Shardy rule naming its factors
(batch dims, M, K, N) and a partition callback that keeps the work local:

- gemm: batch, M or N sharded -> the local GEMM with the whole epilogue, no
  collective. K sharded (on both operands alike) -> local partial products,
  their sum over K's mesh axes (psum), then beta*C + bias and the activation,
  which must see the reduced Z. The output is sharded as the batch, M and N
  were; this is what XLA does for plain `act(x @ w + b)`.
- dact: batch, M or N sharded -> local gZ; the bias gradient's local sums are
  summed over the mesh axes of the dims the bias kind reduces, in its dtype.
- bias_grad (no call: a layer of act none): the local sums, summed as dact's.
- dgrad_dact: planned as the GEMM with S in C's place, the bias gradient as dact's.
- layer_backward: a layer's wgrad and the dgrad_dact call that follows it (and may
  write over the S the wgrad reads), as one op: the local wgrad, then the call, then
  dW summed over the devices that split the rows (below).
- rows: a call over the rows of x whose other operands are whole (the fused narrow MLP):
  each device's rows, the results without rows (weight gradients) summed over the devices.

On one device, and inside shard_map (every axis manual), the wrapper lowers
the local function directly: nothing changes there. Operands and results use
the canonical forms of _ffi (every operand with the same batch rank; a
batch dim of size 1 is broadcast by stride and never sharded).
"""

from __future__ import annotations

from functools import partial

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from . import _ffi, _programs, reference
from ._targets import BIAS_FACTOR, BIAS_REDUCED, DACT, DGRAD_DACT, GEMM, factors, gemm_factors

# ---------------------------------------------------------------------------
# specs
# ---------------------------------------------------------------------------


def _axes(entry):
    """A PartitionSpec entry as a tuple of mesh axis names (() when not sharded)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _spec_of(shape_info, rank):
    sharding = getattr(shape_info, "sharding", None)
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return [_axes(e) for e in spec + (None,) * (rank - len(spec))]


def _dedupe(entries):
    """Each mesh axis shards one factor at most: later factors lose a clash."""
    used, out = set(), []
    for axes in entries:
        if set(axes) & used:
            axes = ()
        used |= set(axes)
        out.append(axes)
    return out


def _batch_specs(shapes, specs, nb):
    """Per batch dim: the axes of the first operand that has it at full size (size-1 dims are broadcast)."""
    out = []
    for i in range(nb):
        full = max(s[i] for s in shapes)
        out.append(next((sp[i] for s, sp in zip(shapes, specs) if s[i] == full and full != 1), ()))
    return out


def _operand_spec(shape, batch, tail):
    """Spec of an operand: the batch axes where its dim is not broadcast, then its own dims."""
    return P(*[_entry(b) if shape[i] != 1 else None for i, b in enumerate(batch)], *[_entry(t) for t in tail])


def _sharding_rule_factors(shapes, nb, tails, out_tails):
    """A Shardy rule string: batch dims as b<i> (u<j> where an operand broadcasts a size-1 dim)."""
    u = 0
    ops = []
    for shape, tail in zip(shapes, tails):
        dims = []
        for i in range(nb):
            if shape[i] == 1 and max(s[i] for s in shapes) != 1:
                dims.append(f"u{u}")
                u += 1
            else:
                dims.append(f"b{i}")
        ops.append(" ".join(dims + list(tail)))
    outs = [" ".join([f"b{i}" for i in range(nb)] + list(t)) for t in out_tails]
    return ", ".join(ops) + " -> " + ", ".join(outs)


class _Attrs(dict):
    """The static attributes of a partitioned call: its FFI attributes (_targets), which optional
    operands are present, the operands' shapes (the rule names their dims). A dict that hashes
    (custom_partitioning's static argument)."""

    def __hash__(self):
        return hash(tuple(sorted((k, v) for k, v in self.items())))


def _shardings(mesh, specs):
    """NamedShardings of one spec, or of a tuple of specs."""
    return tuple(NamedSharding(mesh, s) for s in specs) if isinstance(specs, tuple) else NamedSharding(mesh, specs)


def _partitioned(local, plan, rule):
    """custom_partitioning of local(attrs, *operands) (attrs: _Attrs), from plan(attrs, mesh, arg_infos) ->
    (operand specs, result spec or specs, a device's lowering of the operands' shards) and the Shardy
    rule(attrs) string: the partition and the inference callbacks both read the plan."""
    cp = custom_partitioning(local, static_argnums=(0,))

    def partition(attrs, mesh, arg_infos, result_infos):
        arg_specs, out_specs, lower = plan(attrs, mesh, arg_infos)
        return mesh, lower, _shardings(mesh, out_specs), tuple(NamedSharding(mesh, s) for s in arg_specs)

    def infer(attrs, mesh, arg_infos, result_infos):
        return _shardings(mesh, plan(attrs, mesh, arg_infos)[1])

    cp.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=lambda attrs, mesh, value_types, result_types: rule(attrs))  # fmt: skip
    return cp


def _target_rule(target):
    """The Shardy rule of a call of `target`: its factors (_targets.factors) over the operands' batch dims."""

    def rule(attrs):
        shapes = attrs["shapes"]
        tails, outs = factors(target, attrs)
        return _sharding_rule_factors(shapes, len(shapes[0]) - 2, tails, outs)

    return rule


# ---------------------------------------------------------------------------
# gemm
# ---------------------------------------------------------------------------


def _gemm_local(attrs, *args):
    a, b, *rest = args
    bias = rest.pop(0) if attrs["has_bias"] else None
    c = rest.pop(0) if attrs["has_c"] else None
    y, z = _ffi.gemm(a, b, bias, c, **attrs)
    return (y, z) if attrs["store_z"] else y


def _gemm_specs(attrs, mesh, arg_infos):
    """(arg specs, output spec, K's mesh axes)."""
    shapes = [tuple(x.shape) for x in arg_infos]
    nb = len(shapes[0]) - 2
    specs = [_spec_of(x, len(s)) for x, s in zip(arg_infos, shapes)]
    sa, sb = specs[0], specs[1]
    ta, tb = attrs["trans_a"], attrs["trans_b"]
    m, ka = (sa[-1], sa[-2]) if ta else (sa[-2], sa[-1])
    kb, n = (sb[-1], sb[-2]) if tb else (sb[-2], sb[-1])
    k = ka if ka == kb else ()  # operands that disagree on K: K is gathered
    batch = _batch_specs(shapes, specs, nb)
    *batch, m, n, k = _dedupe(batch + [m, n, k])
    named = {"m": m, "n": n, "k": k, "s": ()}
    tails = gemm_factors(ta, tb, attrs["bias_kind"] if attrs["has_bias"] else "none", attrs["has_c"])
    arg_specs = [_operand_spec(s, batch, [named[f] for f in t]) for s, t in zip(shapes, tails)]
    out_spec = P(*[_entry(x) for x in batch], _entry(m), _entry(n))
    return arg_specs, out_spec, k


def _gemm_plan(attrs, mesh, arg_infos):
    arg_specs, out_spec, k = _gemm_specs(attrs, mesh, arg_infos)
    lower = partial(_gemm_local, attrs) if not k else _no_context_mesh(partial(_gemm_k_sharded, attrs, k))
    return arg_specs, (out_spec, out_spec) if attrs["store_z"] else out_spec, lower


def _no_context_mesh(fn):
    """fn traced without the caller's mesh: the partition callback runs while the program's
    jit compiles, inside its `jax.set_mesh`, and under Explicit axes (jax 0.11) the psum's
    reduction region then carried sharding annotations that XLA's all-reduce rejects."""

    def traced(*args):
        with jax.sharding.use_abstract_mesh(_EMPTY_MESH):
            return fn(*args)

    return traced


_EMPTY_MESH = jax.sharding.AbstractMesh((), ())


def _gemm_k_sharded(attrs, k_axes, *args):
    """K split over k_axes: local products, their sum, then the epilogue (it must see the whole Z)."""
    a, b, *rest = args
    bias = rest.pop(0) if attrs["has_bias"] else None
    c = rest.pop(0) if attrs["has_c"] else None
    z = _k_summed_product(attrs, k_axes, a, b)
    y, z = _programs.epilogue(z, bias, c, act=attrs["act"], slope=attrs["slope"], beta=attrs["beta"],
                              bias_kind=attrs["bias_kind"], dtype=a.dtype)  # fmt: skip
    return (y, z) if attrs["store_z"] else y


def _k_summed_product(attrs, k_axes, a, b):
    """alpha op(A) op(B) with K split over k_axes: each device's partial product (a plain GEMM), summed
    over the devices in the accumulation type (the epilogue that follows must see the whole sum)."""
    plain = dict(act="none", slope=0.0, alpha=attrs["alpha"], beta=0.0, trans_a=attrs["trans_a"],
                 trans_b=attrs["trans_b"], bias_kind="none", store_z=False, exact_f32=attrs["exact_f32"])  # fmt: skip
    partial_product, _ = _ffi.gemm(a, b, None, None, **plain)
    return jax.lax.psum(partial_product.astype(reference._acc_dtype(a.dtype)), k_axes)


_gemm_cp = _partitioned(lambda attrs, *args: _gemm_local(attrs, *args), _gemm_plan, _target_rule(GEMM))


def gemm(a, b, bias, c, **attrs):
    """_ffi.gemm, partitioned over the mesh: (Y, Z or None)."""
    args = [a, b] + [x for x in (bias, c) if x is not None]
    attrs = _Attrs(attrs, has_bias=bias is not None, has_c=c is not None, shapes=tuple(tuple(x.shape) for x in args))
    out = _gemm_cp(attrs, *args)
    return tuple(out) if attrs["store_z"] else (out, None)


# ---------------------------------------------------------------------------
# dact
# ---------------------------------------------------------------------------


def _bias_len(kind, s):
    """The bias gradient's length for S of this shape (a shard's, under a mesh)."""
    return {"per_col": s.shape[-1], "per_row": s.shape[-2], "scalar": 1}.get(kind, 0)


def _dact_local(attrs, gy, s):
    gz, gbias = _ffi.dact(gy, s, bias_len=_bias_len(attrs["bias_kind"], gy), **attrs)
    return (gz, gbias) if attrs["bias_kind"] != "none" else gz


def _dact_specs(attrs, mesh, arg_infos):
    """(arg specs, gZ spec, gBias spec or None, the mesh axes the bias gradient's local sums are summed over)."""
    shapes = [tuple(x.shape) for x in arg_infos]
    nb = len(shapes[0]) - 2
    specs = [_spec_of(x, len(s)) for x, s in zip(arg_infos, shapes)]
    m = specs[0][-2] if all(sp[-2] == specs[0][-2] for sp in specs) else ()
    n = specs[0][-1] if all(sp[-1] == specs[0][-1] for sp in specs) else ()
    batch = _batch_specs(shapes, specs, nb)
    *batch, m, n = _dedupe(batch + [m, n])
    arg_specs = [_operand_spec(s, batch, [m, n]) for s in shapes]
    gz_spec = P(*[_entry(x) for x in batch], _entry(m), _entry(n))
    gb_spec, reduce_axes = _bias_grad_specs(attrs["bias_kind"], batch, m, n)
    return arg_specs, gz_spec, gb_spec, reduce_axes


def _bias_grad_specs(kind, batch, m, n):
    """(gBias spec or None, the mesh axes its local sums are summed over) for gZ sharded as batch, m, n."""
    if kind == "none":
        return None, ()
    named = {"m": m, "n": n, "s": ()}
    gb_spec = P(*[_entry(x) for x in batch], _entry(named[BIAS_FACTOR[kind][0]]))
    return gb_spec, sum((named[d] for d in BIAS_REDUCED[kind]), ())


def _device_sum(grad, axes):
    """A local gradient (a bias's, a weight's) summed over the mesh axes of the dims it reduces
    (the whole sum spans the devices along those dims).

    Summed in its own dtype, as plain jnp's gradients are: XLA combines those sums into one
    all-reduce. Bias gradients summed in f32 made a second one, complete only after the
    backward's last call, which split the step's CUDA graphs around it. Each device's part is
    already in its dtype (accumulated in f32 and rounded once), so over two devices the result
    is one addition rounded once; over more, NCCL rounds at each step of its ring, as in plain
    jnp's program."""
    return jax.lax.psum(grad, axes) if axes else grad


def _summed_bias_grad(out, gb_spec, reduce_axes):
    """A local call's (gZ, gBias) with gBias summed over the devices (_device_sum); gZ alone where
    there is no bias."""
    if gb_spec is None:
        return out
    gz, gbias = out
    return gz, _device_sum(gbias, reduce_axes)


def _with_bias_grad(gz_spec, gb_spec):
    return gz_spec if gb_spec is None else (gz_spec, gb_spec)


def _dact_plan(attrs, mesh, arg_infos):
    arg_specs, gz_spec, gb_spec, reduce_axes = _dact_specs(attrs, mesh, arg_infos)

    def lower(gy, s):
        return _summed_bias_grad(_dact_local(attrs, gy, s), gb_spec, reduce_axes)

    return arg_specs, _with_bias_grad(gz_spec, gb_spec), _no_context_mesh(lower)


_dact_cp = _partitioned(lambda attrs, gy, s: _dact_local(attrs, gy, s), _dact_plan, _target_rule(DACT))


def dact(gy, s, **attrs):
    """_ffi.dact, partitioned over the mesh: (gZ, gBias or None)."""
    attrs = _Attrs(attrs, shapes=(tuple(gy.shape), tuple(s.shape)))
    out = _dact_cp(attrs, gy, s)
    return tuple(out) if attrs["bias_kind"] != "none" else (out, None)


# ---------------------------------------------------------------------------
# bias_grad: a bias gradient no call makes (a layer of act none, whose gZ is its cotangent)
# ---------------------------------------------------------------------------
# reference.bias_grad, planned as dact with gZ alone: each device sums its rows, then
# _device_sum. Left to XLA's partitioner, the f32 two-stage sum's second stage crossed the
# devices in f32, an all-reduce apart from the bf16 weight gradients'.


def _bias_grad_local(attrs, gz):
    return reference.bias_grad(gz, attrs["bias_kind"])


def _bias_grad_plan(attrs, mesh, arg_infos):
    arg_specs, _, gb_spec, reduce_axes = _dact_specs(attrs, mesh, arg_infos)

    def lower(gz):
        return _device_sum(_bias_grad_local(attrs, gz), reduce_axes)

    return arg_specs[:1], gb_spec, _no_context_mesh(lower)


def _bias_grad_rule(attrs):
    (shape,) = attrs["shapes"]
    return _sharding_rule_factors([shape], len(shape) - 2, [("m", "n")], [BIAS_FACTOR[attrs["bias_kind"]]])


_bias_grad_cp = _partitioned(_bias_grad_local, _bias_grad_plan, _bias_grad_rule)


def bias_grad(gz, kind):
    """reference.bias_grad, partitioned over the mesh: [..., L] in gZ's dtype."""
    return _bias_grad_cp(_Attrs(bias_kind=kind, shapes=(tuple(gz.shape),)), gz)


# ---------------------------------------------------------------------------
# dgrad_dact: a GEMM whose output goes through dact (rg.mlp's backward)
# ---------------------------------------------------------------------------
# Planned as the GEMM with S in C's place (S is [.., M, N] like C). Batch, M or
# N sharded -> the local call; the bias gradient's local sums are summed over
# the mesh axes of the dims it reduces. K sharded -> local partial products,
# their sum, then dact on the whole gY.


def _dgrad_dact_local(attrs, a, b, s, after=None):
    gz, gbias = _ffi.dgrad_dact(a, b, s, after, bias_len=_bias_len(attrs["bias_kind"], s), **attrs)
    return (gz, gbias) if attrs["bias_kind"] != "none" else gz


def _dgrad_dact_specs(attrs, mesh, arg_infos):
    """(arg specs, gZ spec, gBias spec or None, K's mesh axes, the bias gradient's reduced mesh axes)."""
    arg_specs, gz_spec, k = _gemm_specs(dict(attrs, has_bias=False, has_c=True), mesh, arg_infos)
    *batch, m, n = [_axes(e) for e in gz_spec]
    gb_spec, reduce_axes = _bias_grad_specs(attrs["bias_kind"], batch, m, n)
    return arg_specs, gz_spec, gb_spec, k, reduce_axes


def _dgrad_dact_sharded(attrs, k, gb_spec, reduce_axes, a, b, s, after=None):
    """A device's share of dgrad_dact: the local call (following `after`), or with K split the whole
    gY first (act' multiplies it), then dact; the bias gradient summed over the devices."""
    if k:
        gy = _k_summed_product(attrs, k, a, b).astype(a.dtype)
        out = _dact_local(attrs, gy, s)
    else:
        out = _dgrad_dact_local(attrs, a, b, s, after)
    return _summed_bias_grad(out, gb_spec, reduce_axes)


def _dgrad_dact_plan(attrs, mesh, arg_infos):
    arg_specs, gz_spec, gb_spec, k, reduce_axes = _dgrad_dact_specs(attrs, mesh, arg_infos)

    def lower(a, b, s):
        return _dgrad_dact_sharded(attrs, k, gb_spec, reduce_axes, a, b, s)

    return arg_specs, _with_bias_grad(gz_spec, gb_spec), _no_context_mesh(lower)


_dgrad_dact_cp = _partitioned(lambda attrs, a, b, s: _dgrad_dact_local(attrs, a, b, s), _dgrad_dact_plan,
                              _target_rule(DGRAD_DACT))  # fmt: skip


def dgrad_dact(a, b, s, after=None, **attrs):
    """_ffi.dgrad_dact, partitioned over the mesh: (gZ, gBias or None). `after` (a value the call
    follows, _ffi.dgrad_dact) only in programs of one device, which are not partitioned."""
    if after is not None:
        return _ffi.dgrad_dact(a, b, s, after, bias_len=_bias_len(attrs["bias_kind"], s), **attrs)
    attrs = _Attrs(attrs, shapes=(tuple(a.shape), tuple(b.shape), tuple(s.shape)))
    out = _dgrad_dact_cp(attrs, a, b, s)
    return tuple(out) if attrs["bias_kind"] != "none" else (out, None)


# ---------------------------------------------------------------------------
# layer_backward: a layer's wgrad, then the dgrad_dact call that follows it
# ---------------------------------------------------------------------------
# dW = w_alpha op(WA) op(WB), the wgrad of the layer above, reads S (Y of the layer
# below); the dgrad_dact call writes gZ over S on one GPU, following the wgrad. Under
# the partitioner that order would follow the wgrad's all-reduce, so both run in one
# partitioned op: its local body runs the local wgrad, the call following it (in place
# where asked), then sums dW over the devices that split the rows (as XLA does for
# plain jnp's wgrad, in its dtype) and the bias gradient as dgrad_dact does. Without
# it, XLA's scheduler may run every layer's dgrad_dact before any wgrad, keeping every
# layer's Y and gZ at once (results/h100_train_memory_peaks_3edea1e.md). 2-D operands.
# The wgrad is the caller's function (attrs["wgrad"]: the lowering the program gives a
# plain GEMM on its platform), so this module imports no primitive.


def _wgrad_dims(attrs):
    """Where WA and WB keep the contracted rows and their other dim: ((wa rows, wa other), (wb rows, wb other))."""
    return ((-2, -1) if attrs["w_trans_a"] else (-1, -2)), ((-1, -2) if attrs["w_trans_b"] else (-2, -1))


def _wgrad_tails(attrs):
    """The rule's factors of WA and WB: the contracted rows m (gZ's rows), dW's dims p and q."""
    tails = []
    for (r, o), other in zip(_wgrad_dims(attrs), ("p", "q")):
        tail = [None, None]
        tail[r], tail[o] = "m", other
        tails.append(tuple(tail))
    return tails


def _wgrad_local(attrs, wa, wb):
    return attrs["wgrad"](wa, wb, trans_x=attrs["w_trans_a"], trans_y=attrs["w_trans_b"], alpha=attrs["w_alpha"],
                          exact_f32=attrs["w_exact_f32"])  # fmt: skip


def _layer_backward_sharded(attrs, k, gb_spec, reduce_axes, rows, a, b, s, wa, wb):
    """A device's share: the local wgrad, then the call following it (with K split, the whole gY
    first: no call to follow, nor one over S), then dW summed over the devices that split the rows."""
    dw = _wgrad_local(attrs, wa, wb)
    out = _dgrad_dact_sharded(attrs, k, gb_spec, reduce_axes, a, b, s, None if k else dw)
    return (*(out if isinstance(out, tuple) else (out,)), _device_sum(dw, rows))


def _layer_backward_plan(attrs, mesh, arg_infos):
    dd_specs, gz_spec, gb_spec, k, reduce_axes = _dgrad_dact_specs(attrs, mesh, arg_infos[:3])
    rows = _axes(gz_spec[-2])
    (ra, oa), (rb, ob) = _wgrad_dims(attrs)
    other_a, other_b = _spec_of(arg_infos[3], 2)[oa], _spec_of(arg_infos[4], 2)[ob]
    _, other_a, other_b = _dedupe([rows, other_a, other_b])
    specs = []
    for r, o, other in ((ra, oa, other_a), (rb, ob, other_b)):
        entries = [None, None]
        entries[r], entries[o] = _entry(rows), _entry(other)
        specs.append(P(*entries))
    dw_spec = P(_entry(other_a), _entry(other_b))
    outs = (gz_spec, *([] if gb_spec is None else [gb_spec]), dw_spec)
    lower = partial(_layer_backward_sharded, attrs, k, gb_spec, reduce_axes, rows)
    return dd_specs + specs, outs, _no_context_mesh(lower)


def _layer_backward_rule(attrs):
    """dgrad_dact's factors (A, B, S), then the wgrad's (_wgrad_tails); results gZ, gBias, dW."""
    dd_tails, dd_outs = factors(DGRAD_DACT, attrs)
    return _sharding_rule_factors(attrs["shapes"], 0, dd_tails + _wgrad_tails(attrs), dd_outs + [("p", "q")])


_layer_backward_cp = _partitioned(lambda attrs, *args: _layer_backward_sharded(attrs, (), None, (), (), *args),
                                  _layer_backward_plan, _layer_backward_rule)  # fmt: skip


def layer_backward(a, b, s, wa, wb, *, wgrad, w_alpha, w_trans_a, w_trans_b, w_exact_f32, **attrs):
    """(gZ, gBias or None, dW): dW = wgrad(WA, WB) = w_alpha op(WA) op(WB), then _ffi.dgrad_dact(a, b, s)
    following it (writing gZ over S where attrs["in_place"]), partitioned over the mesh as one op.
    2-D operands."""
    args = (a, b, s, wa, wb)
    attrs = _Attrs(attrs, wgrad=wgrad, w_alpha=float(w_alpha), w_trans_a=bool(w_trans_a), w_trans_b=bool(w_trans_b),
                   w_exact_f32=bool(w_exact_f32), shapes=tuple(tuple(x.shape) for x in args))  # fmt: skip
    out = tuple(_layer_backward_cp(attrs, *args))
    return out if attrs["bias_kind"] != "none" else (out[0], None, out[1])


# ---------------------------------------------------------------------------
# rows: a call over the rows of x (the fused narrow MLP), its other operands whole
# ---------------------------------------------------------------------------
# Data parallel: the rows split over the mesh axes that shard x's first dim, every other
# operand (the weights and biases) replicated, so each device runs the call on its rows. A
# result over the rows (y, gx) is sharded as x; any other (a weight's or a bias's gradient)
# is each device's sum over its rows, summed over the devices (_device_sum), as plain jnp's.


def _rows_plan(attrs, mesh, arg_infos):
    rows = _spec_of(arg_infos[0], len(attrs["shapes"][0]))[0]
    spec = lambda shape, row: P(*[_entry(rows) if row and i == 0 else None for i in range(len(shape))])
    arg_specs = [spec(s, r) for s, r in zip(attrs["shapes"], attrs["row_args"])]
    out_specs = tuple(spec(s, r) for s, r in zip(attrs["out_shapes"], attrs["row_outs"]))

    def lower(*args):
        outs = attrs["local"](attrs["static"], *args)
        return tuple(o if row else _device_sum(o, rows) for o, row in zip(outs, attrs["row_outs"]))

    return arg_specs, out_specs, _no_context_mesh(lower)


def _rows_rule(attrs):
    """Rows "m" where a row operand or result has them, a factor of its own for every other dim."""
    names = (f"d{i}" for i in range(10**6))
    side = lambda shapes, rows: ", ".join(" ".join("m" if r and i == 0 else next(names) for i in range(len(s)))
                                          for s, r in zip(shapes, rows))  # fmt: skip
    return side(attrs["shapes"], attrs["row_args"]) + " -> " + side(attrs["out_shapes"], attrs["row_outs"])


_rows_cp = _partitioned(lambda attrs, *args: tuple(attrs["local"](attrs["static"], *args)), _rows_plan, _rows_rule)


def rows(local, static, args, out_shapes, row_args, row_outs):
    """local(static, *args) (a tuple of results of `out_shapes`), partitioned over the mesh as a
    call over the rows of its first operand: `row_args`/`row_outs` say which operands and results
    have those rows first; the other results are summed over the devices that split them."""
    attrs = _Attrs(local=local, static=static, shapes=tuple(tuple(a.shape) for a in args),
                   out_shapes=tuple(tuple(s) for s in out_shapes), row_args=tuple(row_args), row_outs=tuple(row_outs))  # fmt: skip
    return tuple(_rows_cp(attrs, *args))
