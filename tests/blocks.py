"""Helpers of the MLP-block tests (test_mlp.py, test_fold.py, test_sharding.py): random blocks, the
error of a result, the regemm calls in a program."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_regemm as rg

HI = jax.lax.Precision.HIGHEST


def random_block(key, dims, dtype=jnp.float32, bias=True):
    keys = jax.random.split(key, 2 * len(dims))
    ws = [(jax.random.normal(keys[2 * i], (k, n)) / np.sqrt(k)).astype(dtype) for i, (k, n) in enumerate(zip(dims, dims[1:]))]
    bs = [jax.random.normal(keys[2 * i + 1], (n,), dtype) if bias else None for i, n in enumerate(dims[1:])]
    return ws, bs


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def custom_calls(f, *args, compiled=False):
    """The regemm calls in f's lowered program, or in the compiled one (where XLA has removed
    the GEMMs a fold left unread)."""
    lowered = jax.jit(f).lower(*args)
    hlo, call = (lowered.compile().as_text(), 'custom_call_target="{}"') if compiled else (lowered.as_text(), "@{}(")
    return {t: hlo.count(call.format(t)) for t in ("regemm_gemm_v1", "regemm_dact_v1", "regemm_dgrad_dact_v1")}


def cuda_module():
    if jax.default_backend() != "gpu":
        return None
    try:
        from jax_regemm import _regemm_cuda
    except ImportError:
        return None
    return _regemm_cuda


def stack(per_layer, act, save):
    """The block of the in-place tests as rg.mlp, or as rg.dense layers (the fold at lowering)."""
    if not per_layer:
        return lambda x, ws, bs: rg.mlp(x, ws, bs, act=act, save=save)

    def run(x, ws, bs):
        for i, (w, b) in enumerate(zip(ws, bs)):
            x = rg.dense(x, w, b, act=act if i < len(ws) - 1 else "none", save=save)
        return x

    return run
