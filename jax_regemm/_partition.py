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

from . import _ffi, reference

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


# ---------------------------------------------------------------------------
# gemm
# ---------------------------------------------------------------------------
# Static description of one call: the FFI attributes, which optional operands
# are present, and the operands' shapes (the rule names their dims).


def _gemm_tails(attrs, shapes):
    ta, tb = attrs["trans_a"], attrs["trans_b"]
    tails = [("k", "m") if ta else ("m", "k"), ("n", "k") if tb else ("k", "n")]
    if attrs["has_bias"]:
        tails.append({"per_col": ("n",), "per_row": ("m",), "scalar": ("s",)}[attrs["bias_kind"]])
    if attrs["has_c"]:
        tails.append(("m", "n"))
    return tails


def _gemm_local(attrs, *args):
    a, b, *rest = args
    bias = rest.pop(0) if attrs["has_bias"] else None
    c = rest.pop(0) if attrs["has_c"] else None
    y, z = _ffi.gemm(a, b, bias, c, **_gemm_ffi_attrs(attrs))
    return (y, z) if attrs["store_z"] else y


def _gemm_ffi_attrs(attrs):
    keys = ("act", "slope", "alpha", "beta", "trans_a", "trans_b", "bias_kind", "store_z", "exact_f32")
    return {k: attrs[k] for k in keys}


def _gemm_plan(attrs, mesh, arg_infos):
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
    arg_specs = [_operand_spec(s, batch, [named[f] for f in t]) for s, t in zip(shapes, _gemm_tails(attrs, shapes))]
    out_spec = P(*[_entry(x) for x in batch], _entry(m), _entry(n))
    return arg_specs, out_spec, k


def _gemm_partition(attrs, mesh, arg_infos, result_infos):
    arg_specs, out_spec, k = _gemm_plan(attrs, mesh, arg_infos)
    n_out = 2 if attrs["store_z"] else 1
    out_shardings = tuple([NamedSharding(mesh, out_spec)] * n_out)
    arg_shardings = tuple(NamedSharding(mesh, s) for s in arg_specs)
    lower = partial(_gemm_local, attrs) if not k else _no_context_mesh(partial(_gemm_k_sharded, attrs, k))
    return mesh, lower, out_shardings if n_out == 2 else out_shardings[0], arg_shardings


def _gemm_infer(attrs, mesh, arg_infos, result_infos):
    _, out_spec, _ = _gemm_plan(attrs, mesh, arg_infos)
    s = NamedSharding(mesh, out_spec)
    return (s, s) if attrs["store_z"] else s


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
    y, z = epilogue(z, bias, c, act=attrs["act"], slope=attrs["slope"], beta=attrs["beta"],
                    bias_kind=attrs["bias_kind"], dtype=a.dtype)  # fmt: skip
    return (y, z) if attrs["store_z"] else y


def _k_summed_product(attrs, k_axes, a, b):
    """alpha op(A) op(B) with K split over k_axes: each device's partial product (a plain GEMM), summed
    over the devices in the accumulation type (the epilogue that follows must see the whole sum)."""
    plain = dict(act="none", slope=0.0, alpha=attrs["alpha"], beta=0.0, trans_a=attrs["trans_a"],
                 trans_b=attrs["trans_b"], bias_kind="none", store_z=False, exact_f32=attrs["exact_f32"])  # fmt: skip
    partial_product, _ = _ffi.gemm(a, b, None, None, **plain)
    return jax.lax.psum(partial_product.astype(reference._acc_dtype(a.dtype)), k_axes)


def epilogue(z, bias, c, *, act, slope, beta, bias_kind, dtype):
    """(Y, Z) in `dtype` from alpha op(A) op(B) in the accumulation type, with the
    canonical operands (bias [..., L] or None, C or None): the kernels' epilogue in
    plain JAX, for the K-sharded partition and the op's reference (_ops)."""
    if c is not None:
        z = z + beta * c.astype(z.dtype)
    if bias is not None:
        z = z + bias_broadcast(bias.astype(z.dtype), bias_kind)
    return reference.act_fwd(act, z, slope).astype(dtype), z.astype(dtype)


def bias_broadcast(bias, kind):
    """A canonical bias [..., L] as an array that broadcasts against [..., M, N]."""
    return bias[..., None, :] if kind == "per_col" else bias[..., :, None]  # per_row; scalar: L = 1


def _gemm_rule(attrs, mesh, value_types, result_types):
    shapes = attrs["shapes"]
    nb = len(shapes[0]) - 2
    n_out = 2 if attrs["store_z"] else 1
    return _sharding_rule_factors(shapes, nb, _gemm_tails(attrs, shapes), [("m", "n")] * n_out)


_gemm_cp = custom_partitioning(lambda attrs, *args: _gemm_local(attrs, *args), static_argnums=(0,))
_gemm_cp.def_partition(
    partition=_gemm_partition, infer_sharding_from_operands=_gemm_infer, sharding_rule=_gemm_rule
)


class _Attrs(dict):
    """The static attributes: a dict that hashes (custom_partitioning's static argument)."""

    def __hash__(self):
        return hash(tuple(sorted((k, v) for k, v in self.items())))


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
    kind = attrs["bias_kind"]
    bias_len = _bias_len(kind, gy)
    gz, gbias = _ffi.dact(gy, s, bias_len=bias_len, **_dact_ffi_attrs(attrs))
    return (gz, gbias) if attrs["bias_kind"] != "none" else gz


def _dact_ffi_attrs(attrs):
    return {k: attrs[k] for k in ("act", "slope", "from_y", "bias_kind")}


_BIAS_TAIL = {"per_col": ("n",), "per_row": ("m",), "scalar": ("s",)}
_REDUCED = {"per_col": ("m",), "per_row": ("n",), "scalar": ("m", "n")}  # the dims the bias gradient sums over


def _dact_plan(attrs, mesh, arg_infos):
    shapes = [tuple(x.shape) for x in arg_infos]
    nb = len(shapes[0]) - 2
    specs = [_spec_of(x, len(s)) for x, s in zip(arg_infos, shapes)]
    m = specs[0][-2] if all(sp[-2] == specs[0][-2] for sp in specs) else ()
    n = specs[0][-1] if all(sp[-1] == specs[0][-1] for sp in specs) else ()
    batch = _batch_specs(shapes, specs, nb)
    *batch, m, n = _dedupe(batch + [m, n])
    named = {"m": m, "n": n, "s": ()}
    arg_specs = [_operand_spec(s, batch, [m, n]) for s in shapes]
    gz_spec = P(*[_entry(x) for x in batch], _entry(m), _entry(n))
    kind = attrs["bias_kind"]
    gb_spec = None if kind == "none" else P(*[_entry(x) for x in batch], _entry(named[_BIAS_TAIL[kind][0]]))
    reduce_axes = () if kind == "none" else sum((named[d] for d in _REDUCED[kind]), ())
    return arg_specs, gz_spec, gb_spec, reduce_axes


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


def _dact_partition(attrs, mesh, arg_infos, result_infos):
    arg_specs, gz_spec, gb_spec, reduce_axes = _dact_plan(attrs, mesh, arg_infos)

    def lower(gy, s):
        return _summed_bias_grad(_dact_local(attrs, gy, s), gb_spec, reduce_axes)

    outs = NamedSharding(mesh, gz_spec) if gb_spec is None else (NamedSharding(mesh, gz_spec), NamedSharding(mesh, gb_spec))
    return mesh, _no_context_mesh(lower), outs, tuple(NamedSharding(mesh, s) for s in arg_specs)


def _dact_infer(attrs, mesh, arg_infos, result_infos):
    _, gz_spec, gb_spec, _ = _dact_plan(attrs, mesh, arg_infos)
    return NamedSharding(mesh, gz_spec) if gb_spec is None else (NamedSharding(mesh, gz_spec), NamedSharding(mesh, gb_spec))


def _dact_rule(attrs, mesh, value_types, result_types):
    shapes = attrs["shapes"]
    nb = len(shapes[0]) - 2
    outs = [("m", "n")] + ([_BIAS_TAIL[attrs["bias_kind"]]] if attrs["bias_kind"] != "none" else [])
    return _sharding_rule_factors(shapes, nb, [("m", "n"), ("m", "n")], outs)


_dact_cp = custom_partitioning(lambda attrs, gy, s: _dact_local(attrs, gy, s), static_argnums=(0,))
_dact_cp.def_partition(partition=_dact_partition, infer_sharding_from_operands=_dact_infer, sharding_rule=_dact_rule)


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


def _bias_grad_partition(attrs, mesh, arg_infos, result_infos):
    arg_specs, _, gb_spec, reduce_axes = _dact_plan(attrs, mesh, arg_infos)

    def lower(gz):
        return _device_sum(_bias_grad_local(attrs, gz), reduce_axes)

    return mesh, _no_context_mesh(lower), NamedSharding(mesh, gb_spec), (NamedSharding(mesh, arg_specs[0]),)


def _bias_grad_infer(attrs, mesh, arg_infos, result_infos):
    return NamedSharding(mesh, _dact_plan(attrs, mesh, arg_infos)[2])


def _bias_grad_rule(attrs, mesh, value_types, result_types):
    (shape,) = attrs["shapes"]
    return _sharding_rule_factors([shape], len(shape) - 2, [("m", "n")], [_BIAS_TAIL[attrs["bias_kind"]]])


_bias_grad_cp = custom_partitioning(_bias_grad_local, static_argnums=(0,))
_bias_grad_cp.def_partition(
    partition=_bias_grad_partition, infer_sharding_from_operands=_bias_grad_infer, sharding_rule=_bias_grad_rule
)


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


def _dgrad_dact_ffi_attrs(attrs):
    keys = ("act", "slope", "from_y", "bias_kind", "alpha", "trans_a", "trans_b", "exact_f32", "in_place")
    return {k: attrs[k] for k in keys}


def _dgrad_dact_local(attrs, a, b, s, after=None):
    kind = attrs["bias_kind"]
    bias_len = _bias_len(kind, s)
    gz, gbias = _ffi.dgrad_dact(a, b, s, after, bias_len=bias_len, **_dgrad_dact_ffi_attrs(attrs))
    return (gz, gbias) if kind != "none" else gz


def _dgrad_dact_plan(attrs, mesh, arg_infos):
    """(arg specs, gZ spec, gBias spec or None, K's mesh axes, the bias gradient's reduced mesh axes)."""
    gemm_attrs = dict(attrs, has_bias=False, has_c=True)
    arg_specs, gz_spec, k = _gemm_plan(gemm_attrs, mesh, arg_infos)
    *batch, m, n = [_axes(e) for e in gz_spec]
    kind = attrs["bias_kind"]
    if kind == "none":
        return arg_specs, gz_spec, None, k, ()
    named = {"m": m, "n": n, "s": ()}
    gb_spec = P(*[_entry(x) for x in batch], _entry(named[_BIAS_TAIL[kind][0]]))
    return arg_specs, gz_spec, gb_spec, k, sum((named[d] for d in _REDUCED[kind]), ())


def _dgrad_dact_sharded(attrs, k, gb_spec, reduce_axes, a, b, s, after=None):
    """A device's share of dgrad_dact: the local call (following `after`), or with K split the whole
    gY first (act' multiplies it), then dact; the bias gradient summed over the devices."""
    if k:
        gy = _k_summed_product(attrs, k, a, b).astype(a.dtype)
        out = _dact_local(_Attrs(_dact_ffi_attrs(attrs)), gy, s)
    else:
        out = _dgrad_dact_local(attrs, a, b, s, after)
    return _summed_bias_grad(out, gb_spec, reduce_axes)


def _dgrad_dact_partition(attrs, mesh, arg_infos, result_infos):
    arg_specs, gz_spec, gb_spec, k, reduce_axes = _dgrad_dact_plan(attrs, mesh, arg_infos)

    def lower(a, b, s):
        return _dgrad_dact_sharded(attrs, k, gb_spec, reduce_axes, a, b, s)

    gz_s = NamedSharding(mesh, gz_spec)
    outs = gz_s if gb_spec is None else (gz_s, NamedSharding(mesh, gb_spec))
    return mesh, _no_context_mesh(lower), outs, tuple(NamedSharding(mesh, s) for s in arg_specs)


def _dgrad_dact_infer(attrs, mesh, arg_infos, result_infos):
    _, gz_spec, gb_spec, _, _ = _dgrad_dact_plan(attrs, mesh, arg_infos)
    return NamedSharding(mesh, gz_spec) if gb_spec is None else (NamedSharding(mesh, gz_spec), NamedSharding(mesh, gb_spec))


def _dgrad_dact_rule(attrs, mesh, value_types, result_types):
    shapes = attrs["shapes"]
    nb = len(shapes[0]) - 2
    kind = attrs["bias_kind"]
    outs = [("m", "n")] + ([_BIAS_TAIL[kind]] if kind != "none" else [])
    tails = _gemm_tails(dict(attrs, has_bias=False, has_c=True), shapes)
    return _sharding_rule_factors(shapes, nb, tails, outs)


_dgrad_dact_cp = custom_partitioning(lambda attrs, a, b, s: _dgrad_dact_local(attrs, a, b, s), static_argnums=(0,))
_dgrad_dact_cp.def_partition(
    partition=_dgrad_dact_partition, infer_sharding_from_operands=_dgrad_dact_infer, sharding_rule=_dgrad_dact_rule
)


def dgrad_dact(a, b, s, after=None, **attrs):
    """_ffi.dgrad_dact, partitioned over the mesh: (gZ, gBias or None). `after` (a value the call
    follows, _ffi.dgrad_dact) only in programs of one device, which are not partitioned."""
    if after is not None:
        return _ffi.dgrad_dact(a, b, s, after, bias_len=_bias_len(attrs["bias_kind"], s), **_dgrad_dact_ffi_attrs(attrs))
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


def _layer_backward_plan(attrs, mesh, arg_infos):
    """(arg specs, gZ spec, gBias spec or None, dW spec, K's mesh axes, the bias gradient's reduced axes, the rows' axes)."""
    dd_specs, gz_spec, gb_spec, k, reduce_axes = _dgrad_dact_plan(attrs, mesh, arg_infos[:3])
    rows = _axes(gz_spec[-2])
    (ra, oa), (rb, ob) = _wgrad_dims(attrs)
    other_a, other_b = _spec_of(arg_infos[3], 2)[oa], _spec_of(arg_infos[4], 2)[ob]
    _, other_a, other_b = _dedupe([rows, other_a, other_b])
    specs = []
    for r, o, other in ((ra, oa, other_a), (rb, ob, other_b)):
        entries = [None, None]
        entries[r], entries[o] = _entry(rows), _entry(other)
        specs.append(P(*entries))
    return dd_specs + specs, gz_spec, gb_spec, P(_entry(other_a), _entry(other_b)), k, reduce_axes, rows


def _wgrad_local(attrs, wa, wb):
    from . import _ops  # (the lowering the program gives a plain GEMM on this platform)

    return _ops.matmul(wa, wb, trans_x=attrs["w_trans_a"], trans_y=attrs["w_trans_b"], alpha=attrs["w_alpha"],
                       exact_f32=attrs["w_exact_f32"])  # fmt: skip


def _layer_backward_sharded(attrs, k, gb_spec, reduce_axes, rows, a, b, s, wa, wb):
    """A device's share: the local wgrad, then the call following it (with K split, the whole gY
    first: no call to follow, nor one over S), then dW summed over the devices that split the rows."""
    dw = _wgrad_local(attrs, wa, wb)
    out = _dgrad_dact_sharded(attrs, k, gb_spec, reduce_axes, a, b, s, None if k else dw)
    return (*(out if isinstance(out, tuple) else (out,)), _device_sum(dw, rows))


def _layer_backward_partition(attrs, mesh, arg_infos, result_infos):
    arg_specs, gz_spec, gb_spec, dw_spec, k, reduce_axes, rows = _layer_backward_plan(attrs, mesh, arg_infos)
    lower = partial(_layer_backward_sharded, attrs, k, gb_spec, reduce_axes, rows)

    outs = _layer_backward_out_shardings(mesh, gz_spec, gb_spec, dw_spec)
    return mesh, _no_context_mesh(lower), outs, tuple(NamedSharding(mesh, s) for s in arg_specs)


def _layer_backward_out_shardings(mesh, gz_spec, gb_spec, dw_spec):
    return tuple(NamedSharding(mesh, s) for s in [gz_spec, *([] if gb_spec is None else [gb_spec]), dw_spec])


def _layer_backward_infer(attrs, mesh, arg_infos, result_infos):
    _, gz_spec, gb_spec, dw_spec, *_ = _layer_backward_plan(attrs, mesh, arg_infos)
    return _layer_backward_out_shardings(mesh, gz_spec, gb_spec, dw_spec)


def _layer_backward_rule(attrs, mesh, value_types, result_types):
    """dgrad_dact's factors (A, B, S), then the wgrad's (_wgrad_tails); results gZ, gBias, dW."""
    shapes = attrs["shapes"]
    kind = attrs["bias_kind"]
    tails = _gemm_tails(dict(attrs, has_bias=False, has_c=True), shapes[:3]) + _wgrad_tails(attrs)
    outs = [("m", "n")] + ([_BIAS_TAIL[kind]] if kind != "none" else []) + [("p", "q")]
    return _sharding_rule_factors(shapes, 0, tails, outs)


_layer_backward_cp = custom_partitioning(
    lambda attrs, *args: _layer_backward_sharded(attrs, (), None, (), (), *args), static_argnums=(0,)
)
_layer_backward_cp.def_partition(
    partition=_layer_backward_partition, infer_sharding_from_operands=_layer_backward_infer,
    sharding_rule=_layer_backward_rule,
)  # fmt: skip


def layer_backward(a, b, s, wa, wb, *, w_alpha, w_trans_a, w_trans_b, w_exact_f32, **attrs):
    """(gZ, gBias or None, dW): dW = w_alpha op(WA) op(WB), then _ffi.dgrad_dact(a, b, s) following it
    (writing gZ over S where attrs["in_place"]), partitioned over the mesh as one op. 2-D operands."""
    args = (a, b, s, wa, wb)
    attrs = _Attrs(attrs, w_alpha=float(w_alpha), w_trans_a=bool(w_trans_a), w_trans_b=bool(w_trans_b),
                   w_exact_f32=bool(w_exact_f32), shapes=tuple(tuple(x.shape) for x in args))  # fmt: skip
    out = tuple(_layer_backward_cp(attrs, *args))
    return out if attrs["bias_kind"] != "none" else (out[0], None, out[1])
