"""How every jax_regemm primitive is defined: `define` registers all of a primitive's rules.

Each primitive has a plain-JAX reference (_programs) that gives its output types (shapes,
shardings in types, shard_map's varying axes come out as they would from `jnp`) and, by
default, its derivatives past first order. Its lowering is one program on every platform, or
per platform the program the routing names (_route), optionally wrapped by a rule that reads
the operands' producers (the fold across layers, _fold).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax._src import api_util, dispatch
from jax._src import core as _core
from jax._src.interpreters import partial_eval as pe
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding

from ._route import PLATFORMS


def _types_of(ref, *avals, **params):
    """The output types of `ref` (plain JAX) on `avals`: a primitive's abstract evaluation."""
    fun = partial(ref, **params)
    debug = api_util.debug_info("jax_regemm", fun, avals, {})
    return pe.abstract_eval_fun(fun, *avals, debug_info=debug)


def same_varying_axes(args):
    """Inside shard_map, every operand varying over the same manual axes (as jnp's ops make
    theirs): then the transpose of that cast sums the cotangent of an operand that was
    invariant (a replicated weight) over those axes."""
    insert = getattr(_core, "auto_insert_reshard", None) or getattr(_core, "standard_insert_pvary", None)
    return list(insert(*args)) if insert is not None and args else list(args)


def lead(x, d):
    """x with its batched dim (d) first, or a broadcast (size-1) leading dim where it has none."""
    return jnp.expand_dims(x, 0) if d is None else jnp.moveaxis(x, d, 0)


def sum_to(x, shape):
    """Sums x over the leading dims where `shape` (same rank) has 1: the VJP of a broadcast."""
    axes = tuple(i for i, (d, s) in enumerate(zip(x.shape, shape)) if s == 1 and d != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def fold_rows(args, dims, rows):
    """A vmap over shared weights as more rows: each operand where `rows` is true (its leading
    dim is the rows) with the batch (its dim in `dims`, or broadcast where None) folded into its
    rows; the others as they are. Returns (operands, batch size); `unfold_rows` undoes it."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    flat = []
    for a, d, r in zip(args, dims, rows):
        if r:
            a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
            a = a.reshape((size * a.shape[1],) + a.shape[2:])
        flat.append(a)
    return flat, size


def unfold_rows(x, size):
    """x [size * M, ...] as [size, M, ...]: a result of operands folded by `fold_rows`."""
    return x.reshape((size, x.shape[0] // size) + x.shape[1:])


def explicit(aval):
    """aval's sharding where shardings are types (its mesh, or the context mesh, has Explicit axes:
    a weight made outside the mesh has an unsharded type there), the type to give its gradient;
    else None. As jnp's own transposes type a gradient by its primal."""
    is_explicit = lambda mesh: any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ()))
    sharding = getattr(aval, "sharding", None)
    if sharding is None or is_explicit(getattr(sharding, "mesh", None)):
        return sharding
    context = getattr(jax.sharding, "get_abstract_mesh", lambda: None)()
    return NamedSharding(context, sharding.spec) if is_explicit(context) else None


def register_uncached(p, rule, platform=None):
    """register_lowering for a rule that reads its operands' producers: uncached, as JAX lowers a
    cacheable equation as an out-of-line function whose operands are its parameters."""
    mlir.register_lowering(p, rule, platform=platform, cacheable=False)


def _ref_jvp(p, ref):
    """The JVP rule that evaluates the tangent on the reference (plain JAX), the primal on p."""

    def jvp(primals, tangents, **params):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        _, t_out = jax.jvp(partial(ref, **params), tuple(primals), tuple(tangents))
        return p.bind(*primals, **params), t_out

    return jvp


def _lead_batch(p):
    """The batching rule of a primitive whose kernels take any leading batch dims (broadcast by
    stride): one more leading dim, size 1 where an operand is not batched."""

    def batch(args, dims, **params):
        outs = p.bind(*[lead(x, d) for x, d in zip(args, dims)], **params)
        return outs, [0] * len(outs)

    return batch


def _ref_batch(ref):
    """The batching rule that vmaps the reference (for primitives whose lowering is the reference)."""

    def batch(args, dims, **params):
        outs = jax.vmap(partial(ref, **params), in_axes=tuple(dims))(*args)
        return outs, [0] * len(outs)

    return batch


def define(name, ref, *, programs=None, pick=None, rule=None, jvp=None, batch="lead", transpose=None):
    """A primitive of multiple results, with all of its rules:

    - impl: compile the one op (eager); abstract eval: `ref`'s output types;
    - lowering: `ref` on every platform, or per platform `programs[pick(platform, *operands, **params)]`
      (`programs`: {name: function of the operands and params}); `rule(base, platform, ctx, *operands,
      **params)` wraps that lowering (`base`) where it reads the operands' producers (uncached);
    - jvp: `jvp`, or the tangent of `ref` with the primal from the primitive;
    - batching: a rule, "lead" (_lead_batch) or "ref" (_ref_batch);
    - transpose: `transpose`, for a primitive linear in its tangents."""
    p = Primitive(name)
    p.multiple_results = True
    p.def_impl(partial(dispatch.apply_primitive, p))
    p.def_abstract_eval(partial(_types_of, ref))
    if programs is None:
        mlir.register_lowering(p, mlir.lower_fun(ref, multiple_results=True))
    else:  # lowers through custom_partitioning, which needs the devices then
        dispatch.prim_requires_devices_during_lowering.add(p)
        for platform in PLATFORMS:

            def lower(*args, platform=platform, **params):
                return programs[pick(platform, *args, **params)](*args, **params)

            base = mlir.lower_fun(lower, multiple_results=True)
            if rule is None:
                mlir.register_lowering(p, base, platform=platform)
            else:
                register_uncached(p, partial(rule, base, platform), platform)
    ad.primitive_jvps[p] = jvp or _ref_jvp(p, ref)
    batching.primitive_batchers[p] = {"lead": _lead_batch(p), "ref": _ref_batch(ref)}.get(batch, batch)
    if transpose is not None:
        ad.primitive_transposes[p] = transpose
    return p
