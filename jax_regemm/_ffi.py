"""The XLA FFI custom calls, registered once per platform, and their raw calls.

Both platforms export the same targets (regemm_gemm, regemm_dact) under the
same names, so one lowering serves CPU and GPU alike. Batching: operands carry
leading batch dims and vmap adds more (vmap_method="expand_dims": an unbatched
operand gets a size-1 dim, which the handler reads with stride 0, never a copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _regemm_cpu

try:  # built only where a CUDA toolkit was found
    from . import _regemm_cuda
except ImportError:
    _regemm_cuda = None


def _register():
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


def kernels() -> dict:
    """Names of the registered kernels of each op, per platform."""
    out = {"cpu": _regemm_cpu.kernels()}
    if _regemm_cuda is not None:
        out["cuda"] = _regemm_cuda.kernels()
    return out


def _batch_shape(*arrays_and_ranks):
    return jnp.broadcast_shapes(*(x.shape[: x.ndim - r] for x, r in arrays_and_ranks if x is not None))


def gemm(a, b, bias, c, *, act, slope, alpha, beta, trans_a, trans_b, bias_kind, store_z, exact_f32):
    """(Y, Z or None) = regemm_gemm. All operands have the same number of batch dims."""
    nb = a.ndim - 2
    m = a.shape[-1] if trans_a else a.shape[-2]
    n = b.shape[-2] if trans_b else b.shape[-1]
    batch = _batch_shape((a, 2), (b, 2), (bias, 1), (c, 2))
    ones = (1,) * nb
    if bias is None:
        bias = jnp.zeros(ones + (0,), a.dtype)
        bias_kind = "none"
    if c is None:
        c = jnp.zeros(ones + (0, 0), a.dtype)
    y_t = jax.ShapeDtypeStruct(batch + (m, n), a.dtype)
    z_t = jax.ShapeDtypeStruct(batch + ((m, n) if store_z else (0, 0)), a.dtype)
    y, z = jax.ffi.ffi_call("regemm_gemm", (y_t, z_t), vmap_method="expand_dims")(
        a,
        b,
        bias,
        c,
        act=act,
        slope=np.float64(slope),
        alpha=np.float64(alpha),
        beta=np.float64(beta),
        trans_a=bool(trans_a),
        trans_b=bool(trans_b),
        bias_kind=bias_kind,
        has_c=bool(c.size),
        store_z=bool(store_z),
        exact_f32=bool(exact_f32),
    )
    return y, (z if store_z else None)


def dact(gy, s, *, act, slope, from_y, bias_kind, bias_len):
    """(gZ, gBias or None) = regemm_dact."""
    batch = _batch_shape((gy, 2), (s, 2))
    gz_t = jax.ShapeDtypeStruct(batch + gy.shape[-2:], gy.dtype)
    gb_t = jax.ShapeDtypeStruct(batch + (bias_len if bias_kind != "none" else 0,), gy.dtype)
    gz, gbias = jax.ffi.ffi_call("regemm_dact", (gz_t, gb_t), vmap_method="expand_dims")(
        gy, s, act=act, slope=np.float64(slope), from_y=bool(from_y), bias_kind=bias_kind
    )
    return gz, (gbias if bias_kind != "none" else None)
