"""The routing's classes of op (jax_regemm/_route.py), as the GPU's table has them: which sizes are
small (few rows or elements) or narrow (fewer than 128 columns), which then lower to XLA's
program. Pure functions of shapes: these run on any machine."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jax_regemm import _route

BF16 = jnp.dtype(jnp.bfloat16)


@pytest.mark.parametrize(
    "out,want",
    [
        ((512, 4096), True),  # at most 512 rows
        ((513, 4096), False),
        ((2048, 1024), True),  # 2^21 elements
        ((2049, 1024), False),
        ((2**20, 64), True),  # narrow: a 64-wide layer of a neural field
        ((2**20, 127), True),  # fewer than 128 columns
        ((2**20, 128), False),  # 128 wide: regemm's tile
        ((8, 2**15, 128), False),  # rows counted over the batch dims
    ],
)
def test_small_on_the_gpu(out, want, monkeypatch):
    monkeypatch.delenv("REGEMM_SMALL", raising=False)
    assert _route.small("cuda", BF16, out) is want
    assert _route.small("cpu", BF16, out) is False  # the CPU keeps every op on regemm's calls


@pytest.mark.parametrize("value,want", [("regemm", False), ("xla", True)])
def test_the_switch_overrides_the_table(value, want, monkeypatch):
    monkeypatch.setenv("REGEMM_SMALL", value)
    assert _route.small("cuda", BF16, (2**20, 64)) is want
    assert _route.small("cpu", BF16, (2**20, 64)) is want


def test_portable_dtypes_are_the_cpus_packed_ones(monkeypatch):
    """"portable" on the CPU is every dtype whose GEMMs the extension runs on its packed kernel
    alone on this machine (f64 always: oneDNN has none; bf16 and f16 where oneDNN's need AVX-512
    or AMX that the CPU lacks), read from the extension; on the GPU, none."""
    from jax_regemm import _ffi

    monkeypatch.delenv("REGEMM_PORTABLE", raising=False)
    by_dtype = _ffi._regemm_cpu.gemm_kernels_by_dtype()
    assert set(by_dtype) == {"float32", "float64", "bfloat16", "float16"}
    assert by_dtype["float64"] == ["cpu_packed"]
    for name, kernels in by_dtype.items():
        assert "cpu_packed" in kernels
        assert _route.on_xla("portable", "cpu", jnp.dtype(name)) is (kernels == ["cpu_packed"])
        assert _route.on_xla("portable", "cuda", jnp.dtype(name)) is False


def test_a_portable_dtype_lowers_to_xla_on_the_cpu(monkeypatch):
    """By default an f64 layer (the packed kernel's dtype everywhere) takes its GEMMs on XLA's program
    on the CPU, forward and backward (the backward epilogue, elementwise, keeps its vectorized call),
    with the reference's values; REGEMM_PORTABLE=regemm keeps the GEMM calls."""
    import jax
    import numpy as np

    import jax_regemm as rg
    from jax_regemm import reference

    with jax.enable_x64(True):
        r = np.random.default_rng(3)
        # (on the CPU where the default backend is a GPU too: lowered for it, run on its device)
        cpu = jax.devices("cpu")[0]
        x, w, b = (jax.device_put(r.standard_normal(s), cpu) for s in ((64, 32), (32, 48), (48,)))
        loss = lambda f: (lambda x, w, b: jnp.sum(jnp.sin(f(x, w, b))))
        ours = lambda x, w, b: rg.dense(x, w, b, act="gelu")
        grad = lambda: jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))  # (a new one: the switch is read when lowered)
        calls = lambda: grad().trace(x, w, b).lower(lowering_platforms=("cpu",)).as_text().count("regemm_gemm_")
        monkeypatch.delenv("REGEMM_PORTABLE", raising=False)
        assert calls() == 0
        got = grad()(x, w, b)
        assert all(g.devices() == {cpu} for g in got)
        theirs = lambda x, w, b: reference.gemm_bias_act(x, w, b, act="gelu")
        for g, want in zip(got, jax.grad(loss(theirs), argnums=(0, 1, 2))(x, w, b)):
            np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12)
        monkeypatch.setenv("REGEMM_PORTABLE", "regemm")
        assert calls() > 0
