"""The CUDA backend against the pure-JAX reference, on the GPU.

Every activation x bias kind x dtype x transpose x save policy is covered
pairwise (each pair of values meets in at least one case, with the odd sizes
1, 7, 33, 129 among the shapes) rather than as the full product, which would
take an hour of compiles. Errors are relative Frobenius errors against a
float64 reference on upcast inputs (docs/spec.md §5): f32 with precision=HIGHEST
< 1e-5, f32 default (TF32 allowed) < 5e-3, bf16 < 2e-2, f16 < 5e-3. Inputs are
fresh random numbers, never zeros. The whole module is skipped without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_regemm as rg
from jax_regemm import reference as ref


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


if not _gpus():
    pytest.skip("no GPU: the CUDA backend tests need one", allow_module_level=True)

pytestmark = pytest.mark.gpu

ACTS = rg.ACTIVATIONS
KINDS = ("none", "scalar", "per_row", "per_col")
TRANS = ((False, False), (True, False), (False, True), (True, True))
# name -> (dtype, precision, tolerance)
MODES = {
    "f32_exact": (jnp.float32, lax.Precision.HIGHEST, 1e-5),
    "f32": (jnp.float32, None, 5e-3),
    "bf16": (jnp.bfloat16, None, 2e-2),
    "f16": (jnp.float16, None, 5e-3),
    "f64": (jnp.float64, None, 1e-12),
}
MODE_NAMES = tuple(MODES)
SAVES = ("auto", "z", "y", "recompute")
# (M, N, K): odd sizes, ones, and sizes that straddle the 64-wide tiles.
SHAPES = ((33, 7, 129), (1, 129, 33), (129, 33, 7), (7, 1, 1), (65, 64, 63), (130, 257, 9), (2, 3, 1000))


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def rel(out, want):
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    assert out.shape == want.shape, (out.shape, want.shape)
    assert np.all(np.isfinite(out)), "non-finite values in the output"
    return float(np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-300))


def up(x):
    return None if x is None else jnp.asarray(x, jnp.float64)


class Rand:
    """Fresh random inputs (never zeros), scaled so that Z is O(1)."""

    def __init__(self, seed):
        self.key = jax.random.key(seed)

    def normal(self, shape, dtype, scale=1.0):
        self.key, k = jax.random.split(self.key)
        return (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)


def operands(r, m, n, k, dtype, *, trans_a, trans_b, kind, with_c, batch=()):
    a = r.normal(batch + ((k, m) if trans_a else (m, k)), dtype)
    b = r.normal(batch + ((n, k) if trans_b else (k, n)), dtype, 1.0 / np.sqrt(max(k, 1)))
    bias = {"none": None, "scalar": r.normal((), dtype), "per_row": r.normal((m,), dtype),
            "per_col": r.normal((n,), dtype)}[kind]  # fmt: skip
    c = r.normal(batch + (m, n), dtype) if with_c else None
    return a, b, bias, c


def reference(a, b, bias, c, *, kind, **kw):
    """float64 reference (Y, Z) on upcast inputs."""
    return ref.gemm_bias_act(up(a), up(b), up(bias), c=up(c), bias_kind=kind if bias is not None else "per_col",
                             precision=lax.Precision.HIGHEST, return_z=True, **kw)  # fmt: skip


def test_cuda_extension_is_built():
    kernels = rg.kernels()
    assert "cuda" in kernels, "GPU present but jax_regemm._regemm_cuda was not built"
    assert {"cuda_simt", "cublas"} <= set(kernels["cuda"]["gemm"])
    assert "cuda_dact" in kernels["cuda"]["dact"]
    assert jnp.ones(1).devices().pop().platform == "gpu"


# ---------------------------------------------------------------------------
# forward: act x bias kind x dtype, transposes / shapes / C / Z cycled
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("act", ACTS)
def test_forward(act, kind, mode):
    i_act, i_kind, i_mode = ACTS.index(act), KINDS.index(kind), MODE_NAMES.index(mode)
    trans_a, trans_b = TRANS[(i_act + i_kind) % 4]  # every act x transpose and kind x transpose per dtype
    m, n, k = SHAPES[(i_act + 2 * i_kind + 3 * i_mode) % len(SHAPES)]
    with_c = (i_act + i_kind + i_mode) % 2 == 0
    store_z = (i_act + i_mode) % 2 == 1
    dtype, precision, tol = MODES[mode]
    a, b, bias, c = operands(Rand(1000 * i_act + 100 * i_kind + i_mode), m, n, k, dtype, trans_a=trans_a,
                             trans_b=trans_b, kind=kind, with_c=with_c)  # fmt: skip
    kw = dict(act=act, leaky_slope=0.1, alpha=0.75, beta=-1.25 if with_c else 0.0, trans_a=trans_a, trans_b=trans_b)
    bk = None if kind == "none" else kind
    if store_z:
        y, z = rg.gemm_bias_act_fwd(a, b, bias, c=c, bias_kind=bk, precision=precision, **kw)
    else:
        y, z = rg.gemm_bias_act(a, b, bias, c=c, bias_kind=bk, precision=precision, **kw), None
    y_ref, z_ref = reference(a, b, bias, c, kind=kind, **kw)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel(y, y_ref) < tol, (act, kind, mode, (m, n, k), rel(y, y_ref))
    if z is not None:
        assert rel(z, z_ref) < tol, rel(z, z_ref)


@pytest.mark.parametrize("mode", ("f32_exact", "f32", "bf16", "f16"))
@pytest.mark.parametrize("trans", TRANS)
def test_forward_large_tiles(trans, mode):
    """Big enough for the 128 x 128 tile, with ragged edges on every side."""
    m, n, k = 2051, 2053, 67
    dtype, precision, tol = MODES[mode]
    a, b, bias, c = operands(Rand(7), m, n, k, dtype, trans_a=trans[0], trans_b=trans[1], kind="per_col",
                             with_c=True)  # fmt: skip
    kw = dict(act="gelu", beta=0.5, trans_a=trans[0], trans_b=trans[1])
    y, z = rg.gemm_bias_act_fwd(a, b, bias, c=c, bias_kind="per_col", precision=precision, **kw)
    y_ref, z_ref = reference(a, b, bias, c, kind="per_col", **kw)
    assert rel(y, y_ref) < tol and rel(z, z_ref) < tol, (rel(y, y_ref), rel(z, z_ref))


@pytest.mark.parametrize("backend", ("cublas", "cuda_simt"))
@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize("trans", TRANS)
def test_plain_gemm(trans, mode, backend, monkeypatch):
    """act none, no bias, no C: cuBLAS (strided batched, every transpose) and the SIMT kernel
    (which a program reaches with REGEMM_PLAIN_GEMM=regemm; by default XLA's dot runs it)."""
    monkeypatch.setenv("REGEMM_BACKEND", backend)  # read by the registry at every call
    monkeypatch.setenv("REGEMM_PLAIN_GEMM", "regemm")  # read at lowering
    dtype, precision, tol = MODES[mode]
    m, n, k = 33, 129, 65
    r = Rand(11)
    a = r.normal((3,) + ((k, m) if trans[0] else (m, k)), dtype)  # batched A
    b = r.normal((k, n)[:: -1 if trans[1] else 1], dtype)  # shared B: batch stride 0
    f = jax.jit(lambda a, b: rg.gemm_bias_act(a, b, act="none", alpha=-1.5, trans_a=trans[0], trans_b=trans[1],
                                              precision=precision))  # fmt: skip
    y = f(a, b)
    y_ref, _ = reference(a, b, None, None, kind="none", act="none", alpha=-1.5, trans_a=trans[0], trans_b=trans[1])
    assert rel(y, y_ref) < tol, rel(y, y_ref)
    y2 = jax.vmap(lambda b: f(a[0], b))(jnp.stack([b, -b]))  # batched B against a shared A
    assert rel(y2[0], y_ref[0]) < tol and rel(y2[1], -y_ref[0]) < tol


@pytest.mark.parametrize("backend", ("cublas", "cuda_simt"))
@pytest.mark.parametrize("mode", ("f32_exact", "f32", "f64"))
def test_fused_f32_f64_backends(mode, backend, monkeypatch):
    """f32/f64 problems with an epilogue: cuBLAS's GEMM + the epilogue pass (16-byte
    vectors where N allows, single elements where not) and the SIMT kernel; every
    activation, bias kinds and transposes cycled, a batch (vmap) sharing C and bias, Z."""
    monkeypatch.setenv("REGEMM_BACKEND", backend)
    dtype, precision, tol = MODES[mode]
    for i, act in enumerate(ACTS):
        kind, trans = KINDS[i % 4], TRANS[(i // 2) % 4]
        m, n, k = ((33, 64, 17), (16, 7, 9))[i % 2]  # N = 64: vector path; N = 7: scalar
        r = Rand(500 + i)
        a, b, bias, c = operands(r, m, n, k, dtype, trans_a=trans[0], trans_b=trans[1], kind=kind, with_c=True,
                                 batch=(2,))  # fmt: skip
        c = c[0]  # shared by the batch (stride 0)
        kw = dict(act=act, leaky_slope=0.1, alpha=0.75, beta=-1.25, trans_a=trans[0], trans_b=trans[1])
        bk = None if kind == "none" else kind
        y, z = jax.vmap(lambda a, b: rg.gemm_bias_act_fwd(a, b, bias, c=c, bias_kind=bk, precision=precision,
                                                           **kw))(a, b)  # fmt: skip
        for j in range(2):
            y_ref, z_ref = reference(a[j], b[j], bias, c, kind=kind, **kw)
            assert rel(y[j], y_ref) < tol and rel(z[j], z_ref) < tol, (act, kind, j, rel(y[j], y_ref), rel(z[j], z_ref))


@pytest.mark.parametrize("mode", ("f32_exact", "f32"))
@pytest.mark.parametrize("act", ("none", "relu"))
def test_dense_layer_f32_cublaslt(act, mode, monkeypatch):
    """f32 act none/relu with a per-column bias and no C or Z (the plain dense layer):
    one cuBLASLt matmul with its BIAS / RELU_BIAS epilogue; every transpose, odd sizes."""
    monkeypatch.setenv("REGEMM_BACKEND", "cublas")  # f32 TF32 would go to CUTLASS
    dtype, precision, tol = MODES[mode]
    for i, (trans, (m, n, k)) in enumerate(zip(TRANS, ((33, 64, 17), (129, 257, 65), (1, 7, 3), (64, 1, 128)))):
        a, b, bias, _ = operands(Rand(700 + i), m, n, k, dtype, trans_a=trans[0], trans_b=trans[1], kind="per_col",
                                 with_c=False)  # fmt: skip
        kw = dict(act=act, alpha=0.75, trans_a=trans[0], trans_b=trans[1])
        y = rg.gemm_bias_act(a, b, bias, precision=precision, **kw)
        y_ref, _ = reference(a, b, bias, None, kind="per_col", **kw)
        assert rel(y, y_ref) < tol, (trans, (m, n, k), rel(y, y_ref))


# ---------------------------------------------------------------------------
# gradients: act x save policy, dtypes / bias kinds / transposes cycled
# ---------------------------------------------------------------------------


def check_grads(act, kind, mode, trans, save, m, n, k, *, with_c, seed, alpha=1.0, beta=0.0):
    dtype, precision, tol = MODES[mode]
    r = Rand(seed)
    a, b, bias, c = operands(r, m, n, k, dtype, trans_a=trans[0], trans_b=trans[1], kind=kind, with_c=with_c)
    # The cotangent gY, in the output dtype so that both sides see the same one, and
    # positive: gBias is a sum of gZ = gY act'(Z), and with random signs a sum can
    # cancel to near zero, where no rounding of gZ to f16/bf16 meets a relative
    # tolerance (seen: an f16 per-row sum of 129 terms, sum -0.153 of |terms| 74,
    # 1.3e-2 off the f64 truth -- the CPU backend gives the same bits).
    cot = (0.25 + jnp.abs(r.normal((m, n), jnp.float32))).astype(dtype)
    kw = dict(act=act, leaky_slope=0.1, alpha=alpha, beta=beta, trans_a=trans[0], trans_b=trans[1])
    bk = None if kind == "none" else kind

    # (the cotangent is an argument: arrays closed over by a jitted function become constants)
    def ours(a, b, bias, c, cot):
        y = rg.gemm_bias_act(a, b, bias, c=c, bias_kind=bk, save=save, precision=precision, **kw)
        return jnp.sum(y.astype(jnp.float64) * cot.astype(jnp.float64))

    def theirs(a, b, bias, c, cot):
        y = ref.gemm_bias_act(a, b, bias, c=c, bias_kind=kind if bias is not None else "per_col",
                              precision=lax.Precision.HIGHEST, **kw)  # fmt: skip
        return jnp.sum(y * cot.astype(jnp.float64))

    argnums = tuple(i for i, x in enumerate((a, b, bias, c)) if x is not None)
    got = jax.jit(jax.grad(ours, argnums=argnums))(a, b, bias, c, cot)
    want = jax.grad(theirs, argnums=argnums)(up(a), up(b), up(bias), up(c), cot)
    for i, g, w in zip(argnums, got, want):
        assert g.dtype == dtype and g.shape == w.shape
        e = rel(g, w)
        assert e < tol, (("gA", "gB", "gBias", "gC")[i], act, kind, mode, trans, save, e)


GRAD_CASES = [
    (act, save)
    for act in ACTS
    for save in SAVES
    if not (save == "y" and act not in ref.GRAD_FROM_Y)
]


@pytest.mark.parametrize("act,save", GRAD_CASES)
def test_grads(act, save):
    i, j = ACTS.index(act), SAVES.index(save)
    mode = MODE_NAMES[(i + j) % len(MODE_NAMES)]
    kind = KINDS[(i + 3 * j) % 4]
    trans = TRANS[(2 * i + j) % 4]
    m, n, k = SHAPES[(i + j) % len(SHAPES)]
    check_grads(act, kind, mode, trans, save, m, n, k, with_c=(i + j) % 2 == 0, seed=100 * i + j, alpha=1.25,
                beta=0.5)  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_grads_dtype_bias(mode, kind):
    """Every dtype x bias kind (Z stash, silu), every transpose per dtype."""
    i, j = MODE_NAMES.index(mode), KINDS.index(kind)
    check_grads("silu", kind, mode, TRANS[j], "z", 65, 33, 129, with_c=j % 2 == 1, seed=7 + 10 * i + j)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ("f32", "bf16", "f16", "f64"))
def test_dact_kernel(mode, kind):
    """The backward epilogue itself, every activation (act' from Z, and from Y
    where it can be): gZ and gBias against the float64 reference, through vmap
    (a batch of 2 in one call). N = 520 lets every dtype take 16-byte vectors,
    N = 130 does not; both span several tiles each way, one row per thread.
    The tiling's other cases, fewer acts each: 6 x 24 is one tile (every bias
    kind's gradient written by the tile kernel), 37 x 24 one column tile (so
    per-row), 1100 x 1040 4-16 rows per thread (by dtype) with a partial last
    tile, 4224 x 1040 16 rows per thread. Positive gY keeps the bias sums
    well-conditioned (a sum that cancels to near 0 has no relative accuracy in
    bf16, whoever adds it up), and small enough that a sum of all of them fits
    in f16."""
    dtype, _, tol = MODES[mode]
    r = Rand(11 + 7 * MODE_NAMES.index(mode) + KINDS.index(kind))
    cases = (((300, 520), ACTS), ((261, 130), ACTS), ((6, 24), ("gelu", "relu")), ((37, 24), ("silu",)),
             ((1100, 1040), ("tanh",)), ((4224, 1040), ("gelu",)))  # fmt: skip
    for (m, n), acts in cases:
        blen = {"none": (), "scalar": (1,), "per_row": (m,), "per_col": (n,)}[kind]
        scale = 0.05 * min(1.0, 156000 / (m * n))
        for act in acts:
            for from_y in (False, True) if act in ref.GRAD_FROM_Y else (False,):
                gy = (scale * (jnp.abs(r.normal((2, m, n), jnp.float32)) + 0.1)).astype(dtype)
                s = r.normal((2, m, n), dtype, 2.0)
                if from_y:  # a Y the activation can produce
                    s = ref.act_fwd(act, s.astype(jnp.float32)).astype(dtype)
                spec = rg._epilogues.DactSpec(act, 0.01, from_y, kind, blen)
                gz, gb = jax.jit(jax.vmap(lambda g, s: rg._epilogues.dact(spec, g, s)))(gy, s)
                want = lambda g, s: ref.dact(up(g), up(s), act=act, from_y=from_y, bias_kind=kind)
                gz_r, gb_r = jax.vmap(want)(gy, s)
                what = (act, from_y, m, n)
                assert gz.dtype == dtype and rel(gz, gz_r) < tol, what
                if kind == "none":
                    assert gb is None
                else:
                    assert gb.dtype == dtype and rel(gb, gb_r.reshape(gb.shape)) < tol, what


# ---------------------------------------------------------------------------
# vmap / jit / grad composition, batch strides
# ---------------------------------------------------------------------------


def test_vmap_jit_grad_composition():
    r = Rand(5)
    B, m, n, k = 4, 33, 17, 9
    xs = r.normal((B, m, k), jnp.float32)
    w = r.normal((k, n), jnp.float32, 0.3)
    bias = r.normal((n,), jnp.float32)
    hi = lax.Precision.HIGHEST

    def f(x, w, bias):
        return rg.gemm_bias_act(x, w, bias, act="gelu", precision=hi)

    def f_ref(x, w, bias):
        return ref.gemm_bias_act(up(x), up(w), up(bias), act="gelu", bias_kind="per_col", precision=hi)

    # vmap over x, shared weight (folds into one GEMM), inside jit
    y = jax.jit(jax.vmap(f, in_axes=(0, None, None)))(xs, w, bias)
    assert rel(y, jax.vmap(f_ref, in_axes=(0, None, None))(xs, w, bias)) < 1e-5
    # grad of a jitted vmapped loss
    loss = lambda fn: (lambda w, bias: jnp.sum(jax.vmap(fn, in_axes=(0, None, None))(xs, w, bias) ** 2))
    g = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(w, bias)
    g_ref = jax.grad(loss(f_ref), argnums=(0, 1))(up(w), up(bias))
    assert rel(g[0], g_ref[0]) < 1e-5 and rel(g[1], g_ref[1]) < 1e-5
    # vmap of grad: per-example gradients
    pe = jax.jit(jax.vmap(jax.grad(lambda x, w, b: jnp.sum(f(x, w, b) ** 2), argnums=1), in_axes=(0, None, None)))
    pe_ref = jax.vmap(jax.grad(lambda x, w, b: jnp.sum(f_ref(x, w, b) ** 2), argnums=1), in_axes=(0, None, None))
    assert rel(pe(xs, w, bias), pe_ref(xs, w, bias)) < 1e-5
    # batched weight and bias against a shared x (stride 0 for A), trans_b
    ws = r.normal((B, n, k), jnp.float32, 0.3)
    bs = r.normal((B, m), jnp.float32)
    h = lambda x, w, b: rg.gemm_bias_act(x, w, b, act="tanh", trans_b=True, bias_kind="per_row", precision=hi)
    h_ref = lambda x, w, b: ref.gemm_bias_act(up(x), up(w), up(b), act="tanh", trans_b=True, bias_kind="per_row")
    y = jax.vmap(h, in_axes=(None, 0, 0))(xs[0], ws, bs)
    assert rel(y, jax.vmap(h_ref, in_axes=(None, 0, 0))(xs[0], ws, bs)) < 1e-5
    # two vmaps whose batch dims cannot merge: the handler's outer loop
    y = jax.vmap(jax.vmap(h, in_axes=(0, None, None)), in_axes=(None, 0, 0))(xs, ws, bs)
    y_r = jax.vmap(jax.vmap(h_ref, in_axes=(0, None, None)), in_axes=(None, 0, 0))(xs, ws, bs)
    assert y.shape == (B, B, m, n) and rel(y, y_r) < 1e-5
    gg = jax.grad(lambda ws: jnp.sum(jax.vmap(jax.vmap(h, in_axes=(0, None, None)), in_axes=(None, 0, 0))(xs, ws, bs)))
    gg_r = jax.grad(
        lambda ws: jnp.sum(jax.vmap(jax.vmap(h_ref, in_axes=(0, None, None)), in_axes=(None, 0, 0))(xs, ws, bs))
    )
    assert rel(gg(ws), gg_r(up(ws))) < 1e-5


def test_explicit_batch_dims_and_broadcast_c():
    r = Rand(6)
    a = r.normal((2, 3, 17, 8), jnp.bfloat16)
    b = r.normal((1, 3, 8, 19), jnp.bfloat16, 0.3)  # broadcast along the first batch dim
    c = r.normal((19,), jnp.bfloat16)[None, :].repeat(17, 0)  # [M, N]: broadcast over both batch dims
    y = rg.gemm_bias_act(a, b, None, c=c, beta=2.0, act="silu")
    y_ref, _ = reference(a, b, None, jnp.broadcast_to(c, (2, 3, 17, 19)), kind="none", act="silu", beta=2.0)
    assert y.shape == (2, 3, 17, 19) and rel(y, y_ref) < 2e-2


# ---------------------------------------------------------------------------
# zero-sized and degenerate sizes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("m,n,k", [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0), (1, 1, 1)])
@pytest.mark.parametrize("kind", ("per_col", "per_row", "scalar"))
def test_zero_and_one_sizes(m, n, k, kind):
    r = Rand(3)
    a, b, bias, c = operands(r, m, n, k, jnp.float32, trans_a=False, trans_b=False, kind=kind, with_c=True)
    kw = dict(act="sigmoid", beta=1.5)
    hi = lax.Precision.HIGHEST
    y = rg.gemm_bias_act(a, b, bias, c=c, bias_kind=kind, precision=hi, **kw)
    y_ref, _ = reference(a, b, bias, c, kind=kind, **kw)
    assert y.shape == (m, n)
    if y.size:
        assert rel(y, y_ref) < 1e-5  # K = 0: Y = act(beta C + bias)
    loss = lambda f: (lambda a, b, bias, c: jnp.sum(f(a, b, bias, c) ** 2))
    ours = lambda a, b, bias, c: rg.gemm_bias_act(a, b, bias, c=c, bias_kind=kind, precision=hi, save="z", **kw)
    theirs = lambda a, b, bias, c: ref.gemm_bias_act(a, b, bias, c=c, bias_kind=kind, **kw)
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(a, b, bias, c)
    want = jax.grad(loss(theirs), argnums=(0, 1, 2, 3))(up(a), up(b), up(bias), up(c))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if w.size:  # (M = 0 or N = 0: gBias must come out as exact zeros)
            assert rel(g, w) < 1e-5, rel(g, w)


@pytest.mark.parametrize("mode", ("bf16", "f32"))
@pytest.mark.parametrize("case", ("unaligned", "small", "narrow"))
def test_default_runs_xla_program(case, mode, monkeypatch):
    """By default an op whose rows are not whole 16-byte vectors (K = 999, N = 1001), one with at
    most 512 rows of output, or a narrow one (N = 64, over 2^21 elements) lowers to XLA's
    own program on the GPU (the suite sets REGEMM_UNALIGNED=regemm and REGEMM_SMALL=regemm for the
    kernels): no regemm call, and the forward, Z and the gradients within the dtype's tolerance of
    the float64 reference."""
    monkeypatch.delenv("REGEMM_UNALIGNED", raising=False)  # read at lowering
    monkeypatch.delenv("REGEMM_SMALL", raising=False)
    if case == "unaligned":
        monkeypatch.setenv("REGEMM_SMALL", "regemm")  # the 200 rows below would be small too
    dtype, precision, tol = MODES[mode]
    r = Rand(5)
    m, n, k = {"unaligned": (200, 1001, 999), "small": (512, 1024, 768), "narrow": (65536, 64, 256)}[case]
    a, b, bias, c = operands(r, m, n, k, dtype, trans_a=False, trans_b=False, kind="per_col", with_c=False)
    ours = lambda a, b, bias: rg.gemm_bias_act(a, b, bias, act="gelu", precision=precision, save="z")
    text = jax.jit(jax.grad(lambda *x: jnp.sum(ours(*x) ** 2), argnums=(0, 1, 2))).lower(a, b, bias).as_text()
    assert "regemm_" not in text, text
    y, z = rg.gemm_bias_act_fwd(a, b, bias, act="gelu", precision=precision, return_z=True)
    y_ref, z_ref = reference(a, b, bias, None, kind="per_col", act="gelu")
    assert rel(y, y_ref) < tol and rel(z, z_ref) < tol, (rel(y, y_ref), rel(z, z_ref))
    loss = lambda f: (lambda a, b, bias: jnp.sum(jnp.sin(f(a, b, bias))))
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(a, b, bias)
    theirs = lambda a, b, bias: ref.gemm_bias_act(a, b, bias, act="gelu", precision=lax.Precision.HIGHEST)
    want = jax.grad(loss(theirs), argnums=(0, 1, 2))(up(a), up(b), up(bias))
    for g, w in zip(got, want):
        assert g.dtype == dtype and rel(g, w) < tol, rel(g, w)


def test_narrow_mlp_runs_xla_program(monkeypatch):
    """A narrow MLP (2^16 rows, 32 inputs, three hidden layers 64 wide, 16 outputs) lowers to XLA's
    own program by default, forward and backward (every layer is under 128 wide), with its numerics
    (docs/spec.md §1): the output and gradients are the plain program's, act(h @ w + b) per layer in
    bf16, to bf16's rounding where the two programs order their operations differently."""
    monkeypatch.delenv("REGEMM_SMALL", raising=False)  # read at lowering
    r = np.random.default_rng(11)
    dims = (32, 64, 64, 64, 16)
    x = jnp.asarray(r.standard_normal((65536, dims[0])), jnp.bfloat16)
    ws = [jnp.asarray(r.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for k, n in zip(dims, dims[1:])]
    bs = [jnp.asarray(r.standard_normal(n), jnp.bfloat16) for n in dims[1:]]
    loss = lambda f: (lambda x, ws, bs: jnp.sum(jnp.sin(f(x, ws, bs).astype(jnp.float32))))
    ours = lambda x, ws, bs: rg.mlp(x, ws, bs, act="relu")

    def plain(x, ws, bs):
        for i, (w, b) in enumerate(zip(ws, bs)):
            x = x @ w + b
            x = jax.nn.relu(x) if i < len(ws) - 1 else x
        return x

    grad = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))
    assert "regemm_" not in grad.lower(x, ws, bs).as_text()
    assert rel(jax.jit(ours)(x, ws, bs), jax.jit(plain)(x, ws, bs)) < 1e-2
    got = jax.tree.leaves(grad(x, ws, bs))
    want = jax.tree.leaves(jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, ws, bs))
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16 and rel(g, w) < 2e-2, rel(g, w)


# ---------------------------------------------------------------------------
# determinism, 64-bit indexing
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ("per_col", "per_row", "scalar"))
def test_bias_gradient_is_deterministic(kind):
    r = Rand(8)
    m, n, k = 4099, 257, 31  # many tiles in both directions
    a, b, bias, _ = operands(r, m, n, k, jnp.float32, trans_a=False, trans_b=False, kind=kind, with_c=False)
    cot = r.normal((m, n), jnp.float32)
    g = jax.jit(jax.grad(lambda bias, a, b, cot: jnp.sum(rg.gemm_bias_act(a, b, bias, act="gelu", bias_kind=kind) * cot)))
    first = np.asarray(g(bias, a, b, cot))
    for _ in range(3):
        assert np.array_equal(np.asarray(g(bias, a, b, cot)), first)
    want = jax.grad(lambda bias: jnp.sum(ref.gemm_bias_act(up(a), up(b), bias, act="gelu", bias_kind=kind) * up(cot)))
    assert rel(first, want(up(bias))) < 5e-3


def _free_gpu_bytes():
    stats = jax.devices("gpu")[0].memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    return limit - stats.get("bytes_in_use", 0)


def test_past_2_31_elements():
    """Y, Z, gY and gZ of 70000 x 32768 = 2.29e9 elements (> 2^31): the last rows
    sit past 32-bit element offsets in every kernel (forward, backward epilogue,
    cuBLAS dgrad/wgrad). Checked on sampled rows and on the bias gradient."""
    m, n, k = 70000, 32768, 8
    if _free_gpu_bytes() < 40 * 2**30:
        pytest.skip("needs about 40 GB of free GPU memory")
    r = Rand(9)
    dt = jnp.bfloat16
    a = r.normal((m, k), dt)
    b = r.normal((k, n), dt, 0.5)
    bias = r.normal((n,), dt)
    y, z = jax.jit(lambda a, b, bias: rg.gemm_bias_act_fwd(a, b, bias, act="relu"))(a, b, bias)
    rows = np.array([0, 1, 65535, m - 2, m - 1])
    a64, b64, bias64 = (np.asarray(x, np.float64) for x in (a, b, bias))
    z_rows = a64[rows] @ b64 + bias64
    assert rel(z[rows], z_rows) < 2e-2 and rel(y[rows], np.maximum(z_rows, 0)) < 2e-2
    del y, z
    cot = r.normal((m, n), dt)

    def loss(a, b, bias, cot):  # cot as an argument: a closed-over array would be a 4.6 GB HLO constant
        return jnp.sum(rg.gemm_bias_act(a, b, bias, act="relu", save="z").astype(jnp.float32) * cot.astype(jnp.float32))

    ga, gb, gbias = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(a, b, bias, cot)
    _, z = jax.jit(lambda a, b, bias: rg.gemm_bias_act_fwd(a, b, bias, act="relu"))(a, b, bias)
    gz = jnp.where(z > 0, cot, jnp.zeros_like(cot))  # exact in bf16
    del z
    gbias_ref = jnp.sum(gz, axis=0, dtype=jnp.float32)
    gb_ref = jnp.matmul(a.T, gz, preferred_element_type=jnp.float32)
    gz_rows = np.asarray(gz[rows], np.float64)
    del gz
    assert rel(gbias, gbias_ref) < 2e-2, rel(gbias, gbias_ref)
    assert rel(gb, gb_ref) < 2e-2, rel(gb, gb_ref)
    assert rel(ga[rows], gz_rows @ b64.T) < 2e-2


# ---------------------------------------------------------------------------
# a jitted training step with XLA command buffers (CUDA graphs) on
# ---------------------------------------------------------------------------

_TRAIN_SCRIPT = textwrap.dedent(
    r"""
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_regemm as rg

    out = sys.argv[1]
    key = jax.random.key(0)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    x = jax.random.normal(k1, (256, 64), jnp.float32)
    t = jax.random.normal(k2, (256, 16), jnp.float32)
    params = {
        "w1": jax.random.normal(k3, (64, 128), jnp.float32) / 8, "b1": jnp.full((128,), 0.1, jnp.float32),
        "w2": jax.random.normal(k4, (128, 16), jnp.float32) / 11, "b2": jax.random.normal(k5, (16,), jnp.float32),
    }

    def loss(p):
        h = rg.dense(x, p["w1"], p["b1"], act="gelu", precision="highest")            # Z stash, dact per-col
        y = rg.gemm_bias_act(h, p["w2"], p["b2"], act="tanh", save="y", precision="highest")  # act' from Y
        return jnp.mean((y - t) ** 2)

    grad_fn = jax.jit(jax.value_and_grad(loss))

    @jax.jit
    def step(p):
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l

    hlo = grad_fn.lower(params).compile().as_text()
    # The computations XLA turned into command buffers, and the custom calls in them.
    blocks = re.findall(r"\n(%?command_buffer[^\n]*\{.*?\n\})", hlo, re.S)
    captured = sorted(set(re.findall(r'custom_call_target="(regemm_[a-z]+)"', "".join(blocks))))
    names = sorted(set(re.findall(r"\n(%?[\w.-]*command[\w.-]*) ", hlo)))  # for the failure message
    # The same gradient three times: XLA may run the first op by op (its warm-up)
    # and replays the recorded CUDA graph after that.
    b2_grads = [np.asarray(grad_fn(params)[1]["b2"]) for _ in range(3)]
    losses = []
    for _ in range(4):
        params, l = step(params)
        losses.append(float(l))
    np.savez(out, b2_grads=np.stack(b2_grads), **{k: np.asarray(v) for k, v in params.items()})
    captured_calls = int(rg._ffi._regemm_cuda.captured_calls()) if rg._ffi._regemm_cuda else -1
    print(json.dumps({"losses": losses, "command_buffers": len(blocks), "captured": captured,
                      "names": names, "captured_calls": captured_calls}))
    """
)


def _run_train(tmp_path, name, xla_flags):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    # The rule's kernels in both runs: the uncaptured run would otherwise time
    # and pick its own (the tuner never times under capture), and the bits
    # compared below would come from different kernels.
    env["REGEMM_TUNE"] = "0"
    script = tmp_path / "train.py"
    script.write_text(_TRAIN_SCRIPT)
    out = tmp_path / f"{name}.npz"
    p = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    return info, np.load(out)


def test_training_step_with_command_buffers(tmp_path):
    graphs, res_g = _run_train(
        tmp_path, "graphs", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    )
    plain, res_p = _run_train(tmp_path, "plain", "--xla_gpu_enable_command_buffer=")
    info = f"graphs run: {json.dumps(graphs)}; plain run: {json.dumps(plain)}"
    # The regemm calls really ran under CUDA-graph capture (counted by the handlers
    # themselves: XLA's optimized HLO no longer shows command buffers), and only then ...
    assert graphs["captured_calls"] > 0, "no regemm call was captured into a CUDA graph; " + info
    assert plain["captured_calls"] == 0, info
    # ... training runs and learns ...
    assert graphs["losses"][-1] < graphs["losses"][0]
    # ... and gives what the uncaptured run gives. The last layer's bias gradient
    # comes from the backward epilogue's fixed-order reduction, captured (graph
    # replays over the workspace result) or not: bit-identical by construction.
    for g in list(res_g["b2_grads"]) + list(res_p["b2_grads"]):
        assert np.array_equal(g, res_p["b2_grads"][0])
    np.testing.assert_allclose(graphs["losses"], plain["losses"], rtol=1e-5)
    for k in ("w1", "b1", "w2", "b2"):
        np.testing.assert_allclose(res_g[k], res_p[k], rtol=1e-4, atol=1e-6)
