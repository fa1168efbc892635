"""The XLA FFI custom calls, registered once per platform, and their raw calls.

Both platforms export the same targets, described once in _targets (versioned names,
attributes, results: what jax.export records). Each
call is bound as the primitive `regemm_call`, whose lowering adds one result
the program never sees: the handler's device workspace, sized per platform
(0 bytes on the CPU; on the GPU the CUDA module says how much,
ffi/cuda/workspace.h). XLA allocates it like any temporary, so it stays valid
when XLA captures the call into a CUDA graph and replays it.
Batching: operands carry leading batch dims and vmap adds more ("expand_dims":
an unbatched operand gets a size-1 dim, which the handler reads with stride 0,
never a copy).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax._src import core as _core
from jax._src import dispatch
from jax.interpreters import batching, mlir

try:  # public in the JAX versions this targets; the private path is a fallback
    from jax.core import ShapedArray
except ImportError:  # pragma: no cover
    from jax._src.core import ShapedArray

from . import _env, _onednn
from ._targets import CUDA_TARGETS, DACT, DGRAD_DACT, GEMM, NARROW_MLP, NARROW_MLP_BWD, TARGETS, gemm_shape

_onednn.preload()  # the CPU extension links libdnnl.so.3 from the onednn-cpu-gomp wheel
from . import _regemm_cpu  # noqa: E402

try:  # built only where a CUDA toolkit was found
    from . import _regemm_cuda
except ImportError:
    _regemm_cuda = None


CPU_TARGET_NAMES = tuple(t.name for t in TARGETS)
TARGET_NAMES = CPU_TARGET_NAMES + tuple(t.name for t in CUDA_TARGETS)


def _register():
    # The names are spelled in C++ and in _targets.
    if set(_regemm_cpu.registrations()) != set(CPU_TARGET_NAMES):
        raise ImportError(f"jax_regemm: the CPU extension exports {sorted(_regemm_cpu.registrations())}, not {CPU_TARGET_NAMES}")
    if _regemm_cuda is not None and set(_regemm_cuda.registrations()) != set(TARGET_NAMES):
        raise ImportError(f"jax_regemm: the CUDA extension exports {sorted(_regemm_cuda.registrations())}, not {TARGET_NAMES}")
    for name, capsule in _regemm_cpu.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    if _regemm_cuda is not None:
        from jaxlib.xla_client import CustomCallTargetTraits

        # XLA takes the CUDA-graph (command buffer) trait from the registration,
        # so the handlers that declare it are registered with it.
        graph_safe = set(_regemm_cuda.command_buffer_compatible())
        for name, capsule in _regemm_cuda.registrations().items():
            traits = {"traits": CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE} if name in graph_safe else {}
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA", **traits)


_register()


def cutlass_dtypes() -> list:
    """The dtypes this build has CUTLASS sm90 kernels of (none without the CUDA module or the headers)."""
    return list(_regemm_cuda.cutlass_dtypes()) if _regemm_cuda is not None else []


def kernels() -> dict:
    """Names of the registered kernels of each op, per platform."""
    out = {"cpu": _regemm_cpu.kernels()}
    if _regemm_cuda is not None:
        out["cuda"] = _regemm_cuda.kernels()
    return out


# ---------------------------------------------------------------------------
# regemm_call: one FFI call, with its workspace added at lowering
# ---------------------------------------------------------------------------

_call_p = Primitive("regemm_call")
_call_p.multiple_results = True


def _call(target, results, *args, in_place=False, **params):
    """Binds `target` (a _targets.Target) on args; results: ShapeDtypeStructs; params: its
    attributes (typed here, as the target says); in_place: the caller allows the first result
    over an operand (_in_place says which, if any)."""
    results = tuple((tuple(r.shape), np.dtype(r.dtype)) for r in results)
    attrs = tuple(sorted(target.attributes(params).items()))
    return _call_p.bind(*args, target=target.name, results=results, attrs=attrs, in_place=in_place)


def _call_abstract(*avals, target, results, attrs, in_place):
    return [ShapedArray(shape, dtype) for shape, dtype in results]


def _call_batch(args, dims, *, target, results, attrs, in_place):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [jnp.expand_dims(a, 0) if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    results = tuple(((size,) + shape, dtype) for shape, dtype in results)
    out = _call_p.bind(*args, target=target, results=results, attrs=attrs, in_place=in_place)
    return out, [0] * len(results)


_WORKSPACE_DTYPES = ("float32", "float64", "bfloat16", "float16")


def _sized(target, size_of, *dims, any_size=None):
    """size_of(*dims); a symbolic dim (jax.export) may be among them only if the size does not depend on it,
    or where `any_size` (a size that serves every value of the dims) is given: then that."""
    if all(isinstance(d, (int, np.integer)) for d in dims):
        return size_of(*dims)
    if any_size is not None:
        return any_size
    sizes = {size_of(*[d if isinstance(d, (int, np.integer)) else probe for d in dims]) for probe in (1, 2)}
    if len(sizes) == 1:
        return sizes.pop()
    raise ValueError(
        f"jax_regemm: {target} on CUDA sizes its workspace from these dims, which must be static: {dims}. "
        "Export for CUDA with symbolic dims where the workspace does not depend on them: not M or N where a "
        "bias gradient is taken (the partial sums of the bias gradient are in the workspace)"
    )


def _workspace_bytes(platform, target, avals_in, attrs):
    """Bytes of workspace the target's handler needs on `platform` (ffi/cuda/workspace.h)."""
    if platform != "cuda" or _regemm_cuda is None or np.dtype(avals_in[0].dtype).name not in _WORKSPACE_DTYPES:
        return 0  # (an unsupported dtype: the handler says so, with the shapes)
    dtype = np.dtype(avals_in[0].dtype).name
    if target == NARROW_MLP.name:
        return 0
    if target == NARROW_MLP_BWD.name:  # the partial sums of the resident blocks: any M
        x, w0, w_last = avals_in[0], avals_in[1], avals_in[(len(avals_in) - 1) // 2]
        width = w0.shape[0] if attrs["w_transposed"] else w0.shape[1]
        n_out = w_last.shape[0] if attrs["w_transposed"] else w_last.shape[1]
        size = _regemm_cuda.narrow_bwd_workspace_bytes(dtype, x.shape[1], width, (len(avals_in) - 1) // 2, n_out,
                                                       attrs["act"])  # fmt: skip
        if size < 0:
            raise ValueError(f"jax_regemm: {target} does not run this stack (the lowering should have routed it)")
        return size
    if target == GEMM.name:
        a, b = avals_in[:2]
        ta, tb = attrs["trans_a"], attrs["trans_b"]
        *batch, m, n = gemm_shape(a.shape, b.shape, ta, tb)
        k = a.shape[-2] if ta else a.shape[-1]
        size = lambda *dims: _regemm_cuda.gemm_call_workspace_bytes(dtype, *dims, ta, tb)
        return _sized(target, size, m, n, k, math.prod(batch), math.prod(b.shape[:-2]),
                      any_size=_regemm_cuda.gemm_workspace_bytes())  # fmt: skip
    if target == DGRAD_DACT.name:
        a, b, s = avals_in[:3]  # (not the operand it follows)
        *batch, m, n = gemm_shape(a.shape, b.shape, attrs["trans_a"], attrs["trans_b"], s.shape)
        size = lambda m, n, batch: _regemm_cuda.dgrad_dact_workspace_bytes(dtype, m, n, batch, attrs["bias_kind"])
        return _sized(target, size, m, n, math.prod(batch))
    gy, s = avals_in
    if attrs["bias_kind"] == "none":
        return 0  # the partial bias sums are the whole workspace
    batch = math.prod(jnp.broadcast_shapes(gy.shape[:-2], s.shape[:-2]))
    size = lambda m, n, batch: _regemm_cuda.dact_workspace_bytes(dtype, m, n, batch, attrs["bias_kind"])
    return _sized(target, size, gy.shape[-2], gy.shape[-1], batch)


def _in_place(platform, target, avals_in, attrs):
    """Which operand the call writes its first result over, for the lowering to alias:
    {operand: result}. regemm_dgrad_dact on CUDA writes gZ over S where a kernel runs it so (the
    fused kernel, where the rule runs it: ffi/cuda/cutlass/cutlass_registry.cu), saving one M x N buffer at
    the backward's peak; asked only by a caller whose program reads S no more (else XLA copies S
    for the call, or where S is a parameter of the program). REGEMM_IN_PLACE=off turns it off
    (read at lowering)."""
    if platform != "cuda" or target != DGRAD_DACT.name or _regemm_cuda is None or not _env.flag("REGEMM_IN_PLACE"):
        return {}
    a, b, s = avals_in[:3]
    gz = gemm_shape(a.shape, b.shape, attrs["trans_a"], attrs["trans_b"], s.shape)
    dtype = np.dtype(a.dtype).name
    if dtype not in _WORKSPACE_DTYPES or s.shape != gz or s.dtype != a.dtype or not _core.is_constant_shape(gz):
        return {}
    if a.shape[:-2] != gz[:-2] or b.shape[:-2] != gz[:-2]:
        return {}  # a broadcast operand (stride 0): not as the kernel's TMA descriptors
    *batch, m, n = gz
    k = a.shape[-2] if attrs["trans_a"] else a.shape[-1]
    if not isinstance(k, (int, np.integer)):
        return {}
    keys = ("act", "slope", "from_y", "bias_kind", "trans_a", "trans_b", "exact_f32")
    ok = _regemm_cuda.dgrad_dact_in_place(dtype, m, n, k, math.prod(batch), *(attrs[x] for x in keys))
    return {2: 0} if ok else {}


def dgrad_dact_in_place(a, b, s, **attrs):
    """Whether dgrad_dact(a, b, s) lowered for CUDA, asked to, writes gZ over S (_in_place): where
    S has another reader the caller orders it first."""
    return bool(_in_place("cuda", DGRAD_DACT.name, [a, b, s], attrs))


def _call_lowering(platform):
    def lower(ctx, *args, target, results, attrs, in_place):
        attrs = dict(attrs)
        ws = _workspace_bytes(platform, target, ctx.avals_in, attrs)
        aliases = _in_place(platform, target, ctx.avals_in, attrs) if in_place else {}
        ctx = ctx.replace(avals_out=[*ctx.avals_out, ShapedArray((ws,), np.uint8)])
        return jax.ffi.ffi_lowering(target, operand_output_aliases=aliases or None)(ctx, *args, **attrs)[:-1]

    return lower


_call_p.def_impl(partial(dispatch.apply_primitive, _call_p))  # eager: compile the one call, as jax.ffi does
_call_p.def_abstract_eval(_call_abstract)
batching.primitive_batchers[_call_p] = _call_batch
mlir.register_lowering(_call_p, _call_lowering("cpu"), platform="cpu")
mlir.register_lowering(_call_p, _call_lowering("cuda"), platform="cuda")


def gemm(a, b, bias, c, **params):
    """(Y, Z or None) = the GEMM target. All operands have the same number of batch dims;
    params: its attributes (act, slope, alpha, beta, trans_a, trans_b, bias_kind, store_z, exact_f32)."""
    batch_from = [bias.shape[:-1] + (1, 1)] if bias is not None else []  # bias [..., L]
    shape = gemm_shape(a.shape, b.shape, params["trans_a"], params["trans_b"], *batch_from,
                       *([c.shape] if c is not None else []))  # fmt: skip
    ones = (1,) * (a.ndim - 2)
    params = dict(params)
    if bias is None:
        bias = jnp.zeros(ones + (0,), a.dtype)
        params["bias_kind"] = "none"
    if c is None:
        c = jnp.zeros(ones + (0, 0), a.dtype)
    params["has_c"] = bool(c.size)
    store_z = params["store_z"]
    y_t = jax.ShapeDtypeStruct(shape, a.dtype)
    z_t = jax.ShapeDtypeStruct(shape[:-2] + (shape[-2:] if store_z else (0, 0)), a.dtype)
    y, z = _call(GEMM, (y_t, z_t), a, b, bias, c, **params)
    return y, (z if store_z else None)


def dact(gy, s, *, bias_len, in_place=False, **params):
    """(gZ, gBias or None) = the dact target; params: act, slope, from_y, bias_kind (and what else a
    caller's attributes hold: a K-sharded dgrad_dact passes its own, whose in_place is not the dact's:
    it writes over no operand)."""
    del in_place
    batch = gemm_shape(gy.shape, s.shape, False, False)[:-2]
    has_bias = params["bias_kind"] != "none"
    gz_t = jax.ShapeDtypeStruct(batch + gy.shape[-2:], gy.dtype)
    gb_t = jax.ShapeDtypeStruct(batch + (bias_len if has_bias else 0,), gy.dtype)
    gz, gbias = _call(DACT, (gz_t, gb_t), gy, s, **params)
    return gz, (gbias if has_bias else None)


def dgrad_dact(a, b, s, after=None, *, bias_len, in_place=False, **params):
    """(gZ, gBias or None) = the dgrad_dact target: gZ = (alpha op(A) op(B)) * act'(S); params: act, slope,
    from_y, bias_kind, alpha, trans_a, trans_b, exact_f32. in_place: the program reads S no more after
    the call (gZ may be written over it, _in_place); after: a value the call must follow, never read
    (the other reader of S, ordered first)."""
    gz = gemm_shape(a.shape, b.shape, params["trans_a"], params["trans_b"], s.shape)
    has_bias = params["bias_kind"] != "none"
    gz_t = jax.ShapeDtypeStruct(gz, a.dtype)
    gb_t = jax.ShapeDtypeStruct(gz[:-2] + (bias_len if has_bias else 0,), a.dtype)
    operands = (a, b, s) + (() if after is None else (after,))
    gz, gbias = _call(DGRAD_DACT, (gz_t, gb_t), *operands, in_place=bool(in_place), **params)
    return gz, (gbias if has_bias else None)
