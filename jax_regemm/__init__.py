"""jax_regemm: Y = act(alpha op(A) @ op(B) + beta C + bias) as one fused kernel.

XLA FFI custom calls (CPU and CUDA) behind JAX primitives with JVP, transpose,
batching and partitioning rules, so jit, grad, jvp, vmap, shard_map, sharded
jit and jax.export compose. Layers live in jax_regemm.flax, jax_regemm.nnx and
jax_regemm.equinox (imported on demand; this module imports no framework).
"""

from . import reference
from ._ffi import kernels
from .api import dense, disabled_export_checks, gemm_bias_act, gemm_bias_act_bwd, gemm_bias_act_fwd, mlp
from .reference import ACTIVATIONS, BIAS_KINDS
from .tuning import autotune, tuned

SAVE_POLICIES = ("auto", "z", "y", "recompute")

__all__ = [
    "ACTIVATIONS",
    "BIAS_KINDS",
    "SAVE_POLICIES",
    "autotune",
    "dense",
    "disabled_export_checks",
    "gemm_bias_act",
    "gemm_bias_act_bwd",
    "gemm_bias_act_fwd",
    "kernels",
    "mlp",
    "reference",
    "tuned",
]
__version__ = "0.1.0"
