"""A small workload that runs every CUDA kernel of the backend once, for
compute-sanitizer (memcheck, racecheck, initcheck): tiny shapes, all dtypes,
both SIMT tiles, every bias kind of the backward epilogue, the cuBLAS GEMMs
(every transpose), the CUTLASS kernels on a Hopper GPU (16-byte rows: in
"plain" mode the tuner runs every configuration, the kernels of one activation
included), batches, rg.mlp's backward (dgrad_dact), the fused narrow MLP's
kernels, K = 0 and M = 0.

    python tools/sanitize_workload.py plain    # XLA command buffers off
    python tools/sanitize_workload.py graphs   # every regemm call captured into a CUDA graph
    python tools/sanitize_workload.py plain initcheck   # the tool it runs under (default memcheck)

Under racecheck and initcheck every GEMM runs on the SIMT kernel
(REGEMM_BACKEND=cuda_simt): the sm90 GEMMs of CUTLASS and cuBLASLt store their
output through the copy engine (TMA), which initcheck does not see
(tools/tma_sanitizer_repro.cu), and racecheck fails in a process that runs
them (tools/gpu_check.sh says more). Everything else,
the backward epilogue on 16-byte rows of bf16 and f16 included, runs under all
three tools; the epilogue pass that reads the TMA GEMMs' output runs alone in
tools/sanitize_pass.cu.

In "graphs" mode every handler runs under CUDA-graph capture, with the
workspace XLA allocates for the call (ffi/cuda/workspace.h) used by the
backward epilogue's partial sums, cuBLAS and CUTLASS. Prints "workload ok" last.
"""

from __future__ import annotations

import itertools
import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "plain"
TOOL = sys.argv[2] if len(sys.argv) > 2 else "memcheck"
if TOOL in ("racecheck", "initcheck"):
    os.environ["REGEMM_BACKEND"] = "cuda_simt"
_FLAGS = {
    "plain": "--xla_gpu_enable_command_buffer=",
    "graphs": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
}[MODE]
# No autotuning in XLA: it would run many candidate kernels of its own under the
# sanitizer. regemm's tuner does time its GEMMs in "plain" mode (so every way it
# chooses among runs under the sanitizer), with one timed run per candidate.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0 " + _FLAGS).strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("REGEMM_TUNE_REPS", "1")
# Plain GEMMs (act none, no bias, no C) on regemm's kernels, not XLA's dot: this
# workload is there to run every kernel of the backend.
os.environ.setdefault("REGEMM_PLAIN_GEMM", "regemm")
# And the odd sizes on the kernels' unaligned paths, not XLA's padded GEMM.
os.environ.setdefault("REGEMM_UNALIGNED", "regemm")
# And its small sizes on the kernels, not XLA's own program.
os.environ.setdefault("REGEMM_SMALL", "regemm")
# And the fused narrow MLP wherever it fits, not only where it is the faster.
os.environ.setdefault("REGEMM_NARROW", "on")
# "narrow" as a third argument: the narrow MLP's part alone (a developer's quick check).
ONLY_NARROW = len(sys.argv) > 3 and sys.argv[3] == "narrow"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_regemm as rg  # noqa: E402

assert jax.devices()[0].platform == "gpu", jax.devices()
# Inputs from NumPy, copied to the device: the workload itself should run no
# XLA kernels beyond the programs under test (initcheck reports on everything).
RNG = np.random.default_rng(0)


def rand(shape, dtype):
    return jnp.asarray(RNG.standard_normal(shape, np.float32)).astype(dtype)


def case(m, n, k, dtype, act, kind, trans_a=False, trans_b=False, with_c=False, save="z", batch=()):
    a = rand(batch + ((k, m) if trans_a else (m, k)), dtype)
    b = rand(batch + ((n, k) if trans_b else (k, n)), dtype)
    bias = {"none": None, "scalar": rand((), dtype), "per_row": rand((m,), dtype), "per_col": rand((n,), dtype)}[kind]
    c = rand(batch + (m, n), dtype) if with_c else None
    kw = dict(act=act, bias_kind=None if kind == "none" else kind, trans_a=trans_a, trans_b=trans_b, beta=0.5)

    def loss(a, b, bias, c):
        y = rg.gemm_bias_act(a, b, bias, c=c, save=save, alpha=1.5, **kw)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    args = (a, b, bias, c)
    argnums = tuple(i for i, x in enumerate(args) if x is not None)
    y, z = jax.jit(lambda a, b, bias, c: rg.gemm_bias_act_fwd(a, b, bias, c=c, **kw))(*args)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(*args)
    for x in (y, z, *grads):
        assert np.all(np.isfinite(np.asarray(x, np.float32))), (m, n, k, dtype, act, kind)


def narrow_mlp():
    # The fused narrow MLP (ffi/cuda/narrow; shared memory is where it can go wrong, under every
    # tool: it has no TMA): each hidden width, bf16 and f16, ragged rows and odd K0 / N_out (the
    # weight load's element path; N_out = 16 and the hidden layers its 16-byte path), a layer
    # without bias, M = 0; forward and backward (its partial sums and their reduction); each on
    # wgmma where it takes the stack and on mma.sync (REGEMM_NARROW_WGMMA, read at every call).
    narrow = ((16, 3, jnp.bfloat16, "relu", 1000, 5), (32, 2, jnp.float16, "gelu", 333, 17),
              (64, 4, jnp.bfloat16, "silu", 700, 16), (128, 1, jnp.float16, "tanh", 129, 3),
              (128, 1, jnp.bfloat16, "relu", 300, 16), (32, 2, jnp.bfloat16, "leaky_relu", 0, 8),
              (64, 2, jnp.float16, "gelu", 515, 16), (32, 4, jnp.bfloat16, "relu", 257, 16))  # fmt: skip
    for (width, hidden, dtype, act, m, n_out), wgmma in itertools.product(narrow, ("on", "off")):
        os.environ["REGEMM_NARROW_WGMMA"] = wgmma
        dims = [7] + [width] * hidden + [n_out]
        ws = [rand((k, n), dtype) * (1 / k**0.5) for k, n in zip(dims, dims[1:])]
        bs = [rand((n,), dtype) if i != 1 else None for i, n in enumerate(dims[1:])]
        xn = rand((m, dims[0]), dtype)
        loss = lambda x, ws, bs: jnp.sum(rg.mlp(x, ws, bs, act=act, final_act="sigmoid").astype(jnp.float32) ** 2)
        fwd = lambda x, ws, bs: rg.mlp(x, ws, bs, act=act, final_act="sigmoid")
        assert "regemm_narrow_mlp_v1" in jax.jit(fwd).lower(xn, ws, bs).as_text(), (width, hidden)
        assert np.all(np.isfinite(np.asarray(jax.jit(fwd)(xn, ws, bs), np.float32))), (width, dtype, act)
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(xn, ws, bs).as_text()
        # (the backward kernel takes widths 16-64; 128 wide differentiates through the per-layer block)
        assert ("regemm_narrow_mlp_bwd_v1" in hlo) == (width <= 64), (width, hidden)
        for g in jax.tree.leaves(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xn, ws, bs)):
            assert np.all(np.isfinite(np.asarray(g, np.float32))), (width, dtype, act)
    os.environ.pop("REGEMM_NARROW_WGMMA")


def main():
    if ONLY_NARROW:
        narrow_mlp()
        jax.effects_barrier()
        print(f"workload ok ({MODE}, the narrow MLP alone)")
        return
    # SIMT forward (small tile), backward epilogue per kind, cuBLAS dgrad/wgrad per transpose.
    for i, (dtype, kind) in enumerate(
        [(jnp.float32, "per_col"), (jnp.bfloat16, "per_row"), (jnp.float16, "scalar"), (jnp.float32, "none")]
    ):
        case(37, 70, 19, dtype, ("gelu", "relu", "silu", "tanh")[i], kind, trans_a=i % 2 == 1, trans_b=i >= 2,
             with_c=i % 2 == 0)  # fmt: skip
    with jax.enable_x64(True):
        case(33, 9, 65, jnp.float64, "gelu_erf", "per_col", trans_a=True, with_c=True)
    case(21, 45, 13, jnp.float32, "sigmoid", "per_row", save="y")  # act' from Y
    case(21, 45, 13, jnp.float32, "leaky_relu", "scalar", save="recompute")
    # The 128 x 128 tile (needs >= 256 of them), ragged edges.
    case(2050, 2049, 9, jnp.float32, "relu", "per_col", with_c=True)
    # CUTLASS (rows of 16 bytes; skipped by its can_run elsewhere; SIMT under racecheck and initcheck):
    # a costly activation in each 16-bit dtype; the backward epilogue's 16-byte vectors.
    case(264, 392, 136, jnp.bfloat16, "sigmoid", "per_col", with_c=True)
    case(200, 136, 72, jnp.float16, "gelu_erf", "per_row", trans_a=True, trans_b=True)
    # Batches: strided (grid.z), shared B (stride 0).
    case(17, 33, 8, jnp.bfloat16, "tanh", "per_col", trans_a=True, batch=(3,))
    w = rand((8, 12), jnp.float32)
    xs = rand((5, 9, 8), jnp.float32)
    g = jax.jit(jax.grad(lambda w: jnp.sum(jax.vmap(lambda x: rg.dense(x, w, act="silu"))(xs) ** 2)))(w)
    assert np.all(np.isfinite(np.asarray(g)))
    # rg.mlp's backward: dgrad_dact, bf16 rows of 16 bytes and f32 ragged ones, S = Z and S = Y;
    # by default (the GEMM into gZ then the backward epilogue in place, or for bf16 gelu
    # cuBLASLt's DGELU matmul: in "plain" mode the tuner runs both), then with the CUTLASS
    # kernel (opt-in: REGEMM_FUSED_DGRAD=1).
    for fused in ("", "1"):
        os.environ["REGEMM_FUSED_DGRAD"] = fused
        for dtype, dims, act in ((jnp.bfloat16, (64, 136, 72, 40), "gelu"), (jnp.float32, (19, 37, 23, 11), "relu")):
            ws = [rand((k, n), dtype) for k, n in zip(dims, dims[1:])]
            bs = [rand((n,), dtype) for n in dims[1:]]
            xb = rand((45, dims[0]), dtype)
            loss = lambda x, ws, bs: jnp.sum(rg.mlp(x, ws, bs, act=act).astype(jnp.float32) ** 2)
            for g in jax.tree.leaves(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xb, ws, bs)):
                assert np.all(np.isfinite(np.asarray(g, np.float32))), (dtype, act)
    # cuBLASLt's DGELU way (16-bit gelu from Z, gZ past the L2 cache: 68 MB), which the tuner
    # runs in "plain" mode. Under memcheck only: the SIMT GEMM the other tools force is slow here.
    os.environ["REGEMM_FUSED_DGRAD"] = ""
    if TOOL == "memcheck":
        m, n, k = 8300, 4104, 72
        a, w, s = rand((m, k), jnp.bfloat16), rand((n, k), jnp.bfloat16), rand((m, n), jnp.bfloat16)
        f = jax.jit(lambda a, w, s: rg._ffi.dgrad_dact(a, w, s, act="gelu", slope=0.01, from_y=False,
                                                      bias_kind="per_col", bias_len=n, alpha=1.0, trans_a=False,
                                                      trans_b=True, exact_f32=False))  # fmt: skip
        for out in f(a, w, s):
            assert np.all(np.isfinite(np.asarray(out, np.float32)))
    narrow_mlp()
    # K = 0 (Y = act(beta C + bias)) and M = 0 (gBias = 0).
    case(6, 5, 0, jnp.float32, "gelu", "per_col", with_c=True)
    case(0, 5, 3, jnp.float32, "gelu", "per_col")
    jax.effects_barrier()
    print(f"workload ok ({MODE})" + (f", GEMMs on {os.environ['REGEMM_BACKEND']}" if "REGEMM_BACKEND" in os.environ else ""))


if __name__ == "__main__":
    main()
