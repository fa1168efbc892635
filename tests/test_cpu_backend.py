"""The CPU backend: the oneDNN GEMM is the one that runs where its wheel is installed,
and its large-problem paths hold docs/spec.md §5 against the float64 NumPy reference with every
feature: transposes, alpha, beta*C, every bias kind, the Z stash, a batch sharing B and a
batch of distinct B. Problems under a few MFLOP run on the calling thread (the other tests
are mostly that small); larger ones split their output into blocks of at least 256 rows
and columns, a task each on XLA's thread pool (bands of rows; f32 also columns, where
threads are left; at half the size where that leaves one block), and one left in one
block runs on oneDNN's OpenMP team. The shapes below take each way on any machine of 2 or
more cores, with uneven last blocks."""

from __future__ import annotations

import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_rel, f64, np_gemm_bias_act, on_cpu

import jax_regemm as rg

pytestmark = pytest.mark.skipif(not on_cpu(), reason="the CPU backend")

# Above the single-thread threshold of every dtype (2*M*N*K >= 16 MFLOP), and but for "team"
# enough work for two blocks (32 MFLOP each in f32, 128 in 16-bit). "bands": bands of
# rows (16-bit: of a non-transposed A, else oneDNN's team); "columns": blocks of columns in
# f32 (16-bit: the team); "narrow": blocks of 128, where blocks of 256 would leave one (16-bit:
# bands of a non-transposed A, else the team); "team": one block in every dtype.
SHAPES = {"narrow": (400, 640, 500), "bands": (1030, 256, 500), "columns": (300, 256, 771), "team": (200, 512, 200)}


def _wheel_installed():
    try:
        importlib.metadata.distribution("onednn-cpu-gomp")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _wheel_installed(), reason="the onednn-cpu-gomp wheel is not installed")
def test_onednn_kernel_registered():
    """A build that found the wheel registers the oneDNN GEMM (a build that silently
    missed it would fall back to the packed kernel, 2-4x slower than XLA)."""
    assert "cpu_onednn" in rg.kernels()["cpu"]["gemm"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("shape,bias_kind", [("team", "per_col"), ("team", "per_row"), ("team", "scalar"),
                                             ("narrow", "per_row"), ("bands", "per_row"), ("columns", "per_col")])
def test_large_gemm_every_feature(rand, dtype, trans_a, trans_b, shape, bias_kind):
    m, k, n = SHAPES[shape]
    a, b, _, c = rand.operands(m, n, k, dtype, trans_a=trans_a, trans_b=trans_b, with_c=True)
    blen = {"per_col": n, "per_row": m, "scalar": 1}[bias_kind]
    bias = jnp.asarray(rand.gen.standard_normal(blen), dtype)
    alpha, beta = rand.scalar(), rand.scalar()
    y, z = jax.jit(lambda a, b, bias, c: rg.gemm_bias_act_fwd(
        a, b, bias, act="gelu", c=c, alpha=alpha, beta=beta, trans_a=trans_a, trans_b=trans_b,
        bias_kind=bias_kind, return_z=True))(a, b, bias, c)  # fmt: skip
    yr, zr = np_gemm_bias_act(f64(a), f64(b), f64(bias), act="gelu", c=f64(c), alpha=alpha, beta=beta,
                              trans_a=trans_a, trans_b=trans_b, bias_kind=bias_kind)
    assert_rel(y, yr, dtype, what="Y")
    assert_rel(z, zr, dtype, what="Z")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", ["team", "columns"])
def test_large_batches(rand, dtype, shape):
    """vmap over A with B shared (one GEMM of batch*M rows: bands) and over both (a batched
    GEMM: each block spans every problem of the batch)."""
    m, k, n = SHAPES[shape]
    a, b, bias, _ = rand.operands(m, n, k, dtype, bias_shape=(n,), batch_a=(3,), batch_b=(3,))
    shared = jax.vmap(lambda a: rg.gemm_bias_act(a, b[0], bias, act="silu"))(a)
    each = jax.vmap(lambda a, b: rg.gemm_bias_act(a, b, bias, act="silu"))(a, b)
    ref_shared, _ = np_gemm_bias_act(f64(a), f64(b[0]), f64(bias), act="silu", bias_kind="per_col")
    ref_each, _ = np_gemm_bias_act(f64(a), f64(b), f64(bias), act="silu", bias_kind="per_col")
    assert_rel(shared, ref_shared, dtype, what="B shared")
    assert_rel(each, ref_each, dtype, what="B per example")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", ["bands", "columns"])
def test_large_z_without_act(rand, dtype, shape):
    """act none with the Z stash: each block's Z copied into Y."""
    m, k, n = SHAPES[shape]
    a, b, bias, _ = rand.operands(m, n, k, dtype, bias_shape=(n,))
    y, z = jax.jit(lambda a, b, bias: rg.gemm_bias_act_fwd(a, b, bias, act="none", return_z=True))(a, b, bias)
    yr, _ = np_gemm_bias_act(f64(a), f64(b), f64(bias), act="none", bias_kind="per_col")
    assert_rel(y, yr, dtype, what="Y")
    assert_rel(z, yr, dtype, what="Z")
