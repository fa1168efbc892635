"""Rough timings of the CUDA backend's kernels (docs/performance.md).

Median wall time of a jitted call (after warm-up, synchronised each time),
so it includes a launch (~10-20 us); fine for the millisecond-scale shapes
here. Prints one line per case with the achieved rate (TFLOP/s for GEMMs,
GB/s for the memory-bound backward epilogue). Not a benchmark suite: see
benchmarks/ for that.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_regemm as rg


def timeit(f, *args, reps=15):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def rand(shape, dtype, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def main():
    print("device:", jax.devices()[0].device_kind, "| kernels:", rg.kernels().get("cuda"))
    m = n = k = 4096
    for name, dtype, prec, backend in [
        ("SIMT fwd f32 exact, gelu+bias+Z", jnp.float32, "highest", None),
        ("SIMT fwd bf16, gelu+bias+Z", jnp.bfloat16, None, "cuda_simt"),
        ("plain GEMM f32 exact (cuBLAS)", jnp.float32, "highest", "cublas"),
        ("plain GEMM f32 TF32 (cuBLAS)", jnp.float32, None, "cublas"),
        ("plain GEMM bf16 (cuBLAS)", jnp.bfloat16, None, "cublas"),
        ("XLA jnp.dot f32 HIGHEST (for scale)", jnp.float32, "highest", "xla"),
    ]:
        if backend and backend != "xla":
            os.environ["REGEMM_BACKEND"] = backend
        else:
            os.environ.pop("REGEMM_BACKEND", None)
        a, b, bias = rand((m, k), dtype, 1), rand((k, n), dtype, 2), rand((n,), dtype, 3)
        if backend == "xla":
            f = jax.jit(lambda a, b, bias: jnp.dot(a, b, precision=prec))
        elif name.startswith("plain"):
            f = jax.jit(lambda a, b, bias: rg.gemm_bias_act(a, b, act="none", precision=prec))
        else:
            f = jax.jit(lambda a, b, bias: rg.gemm_bias_act_fwd(a, b, bias, act="gelu", precision=prec))
        t = timeit(f, a, b, bias)
        print(f"{name:40s} {m}x{n}x{k}: {t * 1e3:8.3f} ms  {2 * m * n * k / t / 1e12:7.1f} TFLOP/s")
    os.environ.pop("REGEMM_BACKEND", None)

    # Backward epilogue, per-col bias (the dense layer's): reads gY and Z, writes gZ.
    for dtype in (jnp.float32, jnp.bfloat16):
        mm, nn = 16384, 8192
        gy, z = rand((mm, nn), dtype, 4), rand((mm, nn), dtype, 5)
        from jax_regemm import _epilogues

        spec = _epilogues.DactSpec("gelu", 0.01, False, "per_col", (nn,))
        f = jax.jit(lambda gy, z: _epilogues.dact(spec, gy, z))
        t = timeit(f, gy, z)
        nbytes = 3 * mm * nn * np.dtype(dtype).itemsize
        print(f"dact gelu per-col {np.dtype(dtype).name:8s} {mm}x{nn}: {t * 1e3:8.3f} ms  {nbytes / t / 1e9:7.0f} GB/s")


if __name__ == "__main__":
    main()
