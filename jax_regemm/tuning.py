"""The GPU's GEMM tuner from Python (ffi/cuda/tuner.cu says how it chooses).

On first sight of a GEMM (shape, dtype, layouts, activation, bias, ...) the
CUDA handler times every way the registered kernels offer to run it and keeps
the fastest, in the process and, with REGEMM_TUNE_CACHE=<file>, on disk. It
never times while XLA captures calls into a CUDA graph. XLA (jax 0.11.2)
runs a program it captures (5 or more commands: a training step, an MLP) op
by op the first time, so the tuner sees its GEMMs there, during the first
step; a GEMM first seen under capture runs the registry's rule for the life
of that graph. `autotune` tunes a program's GEMMs explicitly beforehand (and
keeps the timing out of the first step).
"""

from __future__ import annotations

import jax

from . import _ffi

# Larger than any program: XLA forms no CUDA graph (command buffer), so every
# regemm call runs, and is timed, as a plain call.
_NO_GRAPHS = {"xla_gpu_graph_min_graph_size": 1 << 30}


def autotune(fn, *args, **kwargs):
    """Runs fn(*args, **kwargs) once with CUDA graphs off, so that the GPU tuner
    times every jax_regemm GEMM it contains; returns its result.

    Call it once before a jitted program that XLA captures into CUDA graphs (a
    training step): its GEMMs are then timed before its first step, whatever
    XLA does on that step. On the CPU it only runs fn. Each GEMM signature is
    timed once per process (or once per REGEMM_TUNE_CACHE file).

    fn: a function, or a jax.jit of one (its compiler options are kept; one
    with static arguments: pass a function that closes over them instead).
    """
    if hasattr(fn, "lower"):  # already jitted: nesting it in another jit would drop (or clash with) its options
        compiled = fn.lower(*args, **kwargs).compile(compiler_options=_NO_GRAPHS)
    else:
        compiled = jax.jit(fn).lower(*args, **kwargs).compile(compiler_options=_NO_GRAPHS)
    return jax.block_until_ready(compiled(*args, **kwargs))


def tuned() -> dict:
    """{GEMM signature: "entry/variant"} the GPU tuner has chosen in this
    process ("rule" where there was nothing to time); empty without CUDA."""
    return dict(_ffi._regemm_cuda.tuned()) if _ffi._regemm_cuda is not None else {}
