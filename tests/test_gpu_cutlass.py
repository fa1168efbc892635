"""The CUTLASS sm90 forward kernels through the public API, on the GPU, against
the pure-JAX reference (docs/spec.md §5 tolerances). Skips without a Hopper GPU or a
CUDA module built with the CUTLASS kernels.

REGEMM_BACKEND=cutlass_sm90 makes the registry prefer the CUTLASS entry
wherever it supports the problem (it does for every case here: 16-byte rows,
sm_90); the module skips unless the registry lists it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_regemm as rg  # noqa: E402

pytestmark = pytest.mark.gpu


def _hopper():
    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return False
    return bool(devs) and any(h in devs[0].device_kind for h in ("H100", "H200", "H800", "GH200"))


if not _hopper() or "cutlass_sm90" not in str(rg.kernels()):
    pytest.skip("needs a Hopper GPU and the CUTLASS kernels", allow_module_level=True)

ACTS = ["none", "relu", "leaky_relu", "gelu", "gelu_erf", "sigmoid", "tanh", "silu"]
BIAS = ["none", "scalar", "per_row", "per_col"]
TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 5e-3}  # f32 at default precision = TF32


@pytest.fixture(autouse=True)
def _force_cutlass(monkeypatch):
    monkeypatch.setenv("REGEMM_BACKEND", "cutlass_sm90")
    monkeypatch.setenv("REGEMM_PLAIN_GEMM", "regemm")  # a plain GEMM too on the kernel, not XLA's dot


def _rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def _case(dtype, m, n, k, act, bias_kind, has_c, store_z, trans_a, trans_b, batch=(), seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    a = jax.random.normal(keys[0], batch + ((k, m) if trans_a else (m, k)), jnp.float32).astype(dtype)
    b = (jax.random.normal(keys[1], batch + ((n, k) if trans_b else (k, n))) / np.sqrt(k)).astype(dtype)
    blen = {"none": 0, "scalar": 1, "per_row": m, "per_col": n}[bias_kind]
    bias = None if bias_kind == "none" else (0.5 * jax.random.normal(keys[2], batch + (blen,))).astype(dtype)
    c = (jax.random.normal(keys[3], batch + (m, n))).astype(dtype) if has_c else None
    kinds = None if bias_kind == "none" else bias_kind
    ref_kind = bias_kind if bias is not None else "per_col"
    beta = -0.5 if has_c else 0.0
    common = dict(act=act, leaky_slope=0.2, alpha=1.25, beta=beta, trans_a=trans_a, trans_b=trans_b)

    # The public ops take unbatched operands; a batch goes through vmap (the
    # handler then sees batch strides, per-entry biases included).
    def fused(a, b, bias, c):
        if store_z:
            return rg.gemm_bias_act_fwd(a, b, bias, c=c, bias_kind=kinds, **common)
        return rg.gemm_bias_act(a, b, bias, c=c, bias_kind=kinds, **common), None

    def ref(a, b, bias, c):
        up = lambda x: None if x is None else x.astype(jnp.float32)
        return rg.reference.gemm_bias_act(up(a), up(b), up(bias), c=up(c), bias_kind=ref_kind, precision="highest",
                                          return_z=True, **common)

    for _ in batch:
        fused, ref = jax.vmap(fused), jax.vmap(ref)
    y, z = jax.jit(fused)(a, b, bias, c)
    yr, zr = ref(a, b, bias, c)
    tol = TOL[jnp.dtype(dtype).name]
    assert y.dtype == a.dtype
    assert _rel(y, yr) < tol
    if store_z:
        assert _rel(z, zr) < tol


_LAYOUTS = list(itertools.product([False, True], [False, True]))


@pytest.mark.parametrize("act,bias_kind", list(itertools.product(ACTS, BIAS)))
def test_bf16_every_act_and_bias(act, bias_kind):
    i = ACTS.index(act) * 4 + BIAS.index(bias_kind)
    ta, tb = _LAYOUTS[i % 4]
    _case(jnp.bfloat16, 264, 392, 136, act, bias_kind, has_c=i % 3 == 0, store_z=i % 2 == 0, trans_a=ta, trans_b=tb, seed=i)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
@pytest.mark.parametrize("trans_a,trans_b", _LAYOUTS)
@pytest.mark.parametrize("act", ["gelu", "silu", "leaky_relu"])
def test_f16_f32_layouts(dtype, trans_a, trans_b, act):
    _case(dtype, 200, 136, 72, act, "per_col", has_c=True, store_z=True, trans_a=trans_a, trans_b=trans_b)


@pytest.mark.parametrize("shape", [(1000, 520, 264), (2048, 1024, 1024), (136, 8, 8)])
def test_sizes(shape):
    m, n, k = shape
    _case(jnp.bfloat16, m, n, k, "gelu_erf", "per_row", has_c=False, store_z=True, trans_a=False, trans_b=False)


@pytest.mark.parametrize("bias_kind", ["per_row", "per_col", "scalar"])
def test_batched(bias_kind):
    _case(jnp.bfloat16, 136, 200, 96, "tanh", bias_kind, has_c=True, store_z=True, trans_a=True, trans_b=False, batch=(3,))


@pytest.mark.parametrize("dtype,act", [(jnp.bfloat16, "sigmoid"), (jnp.float16, "gelu_erf")])
def test_grad_program_reads_y(dtype, act):
    """Y inside a grad program: the loss squares it, so the gradients depend on
    Y's values (a loss linear in Y, as in tests/test_gpu.py, needs only Z). Y,
    the loss and every gradient against the reference. These are the sanitize
    workload's 16-bit cases, whose Y initcheck reports as never written there
    (tools/sanitize_workload.py)."""
    m, n, k = 264, 392, 136
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    a = jax.random.normal(keys[0], (m, k)).astype(dtype)
    b = (jax.random.normal(keys[1], (k, n)) / np.sqrt(k)).astype(dtype)
    bias = (0.5 * jax.random.normal(keys[2], (n,))).astype(dtype)
    c = jax.random.normal(keys[3], (m, n)).astype(dtype)
    common = dict(act=act, alpha=1.5, beta=0.5, bias_kind="per_col")

    def value_and_grad(f):
        def loss(a, b, bias, c):
            y = f(a, b, bias, c)
            return jnp.sum(y.astype(jnp.float32) ** 2), y

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)

    ours = jax.jit(value_and_grad(lambda a, b, bias, c: rg.gemm_bias_act(a, b, bias, c=c, save="z", **common)))
    theirs = jax.jit(value_and_grad(  # (jitted: op by op the reference took a minute of the GPU suite)
        lambda a, b, bias, c: rg.reference.gemm_bias_act(a, b, bias, c=c, precision="highest", **common)))
    up = lambda x: x.astype(jnp.float32)
    (loss, y), grads = ours(a, b, bias, c)
    (loss_ref, y_ref), grads_ref = theirs(up(a), up(b), up(bias), up(c))
    tol = TOL[jnp.dtype(dtype).name]
    assert _rel(y, y_ref) < tol
    assert _rel(loss, loss_ref) < tol
    for name, g, g_ref in zip(("gA", "gB", "gBias", "gC"), grads, grads_ref):
        assert g.dtype == dtype and g.shape == g_ref.shape, name
        assert _rel(g, g_ref) < tol, name


def test_large_problem_workspace_share():
    """A forward call with 2^22 output elements or more gets a workspace sized by the problem
    (ffi/cuda/workspace.h: 8 MiB, or B^T and 1 MiB where the f32 x @ w way transposes B), the
    lowering gives the call that buffer, and the kernels that run in it match the reference."""
    from jax_regemm import _ffi

    cuda = _ffi._regemm_cuda
    full, mib = cuda.gemm_workspace_bytes(), 1 << 20
    share = lambda t, m, n, k, ta=False, tb=False: cuda.gemm_call_workspace_bytes(t, m, n, k, 1, 1, ta, tb)
    assert share("bfloat16", 264, 392, 136) == full  # below 2^22: a library GEMM's
    assert share("bfloat16", 4096, 1024, 512) == 8 * mib + 256
    assert share("float32", 2048, 2048, 2048) == 17 * mib + 256  # B^T (16 MiB) and 1 MiB
    assert share("float32", 2048, 2048, 2048, tb=True) == 8 * mib + 256  # B already K-major: no B^T
    assert share("float32", 2048, 3072, 3072) == 8 * mib + 256  # B^T (36 MiB) fits no share: the kernel runs without
    for dtype, (m, n, k), want in [(jnp.bfloat16, (4096, 1024, 512), 8 * mib + 256),
                                   (jnp.float32, (2048, 2048, 2048), 17 * mib + 256)]:  # fmt: skip
        a = jax.ShapeDtypeStruct((m, k), dtype)
        b = jax.ShapeDtypeStruct((k, n), dtype)
        hlo = jax.jit(lambda a, b: rg.gemm_bias_act(a, b, None, act="gelu")).lower(a, b).as_text()
        assert f"tensor<{want}xui8>" in hlo, (dtype, want)
        _case(dtype, m, n, k, "gelu", "per_col", has_c=False, store_z=True, trans_a=False, trans_b=False)
