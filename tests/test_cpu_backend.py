"""The CPU backend: the oneDNN GEMM is the one that runs where its wheel is installed,
and its large-problem path (oneDNN's OpenMP team; problems under a few MFLOP run on the
calling thread, and the other tests are mostly that small) holds SPEC §5 against the
float64 NumPy reference with every feature: transposes, alpha, beta*C, every bias kind,
the Z stash, a batch sharing B and a batch of distinct B."""

from __future__ import annotations

import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_rel, f64, np_gemm_bias_act, on_cpu

import jax_regemm as rg

pytestmark = pytest.mark.skipif(not on_cpu(), reason="the CPU backend")

# 2*M*N*K = 67 MFLOP: above the single-thread threshold of every dtype.
M, K, N = 320, 256, 410


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
@pytest.mark.parametrize("bias_kind", ["per_col", "per_row", "scalar"])
def test_large_gemm_every_feature(rand, dtype, trans_a, trans_b, bias_kind):
    a, b, _, c = rand.operands(M, N, K, dtype, trans_a=trans_a, trans_b=trans_b, with_c=True)
    blen = {"per_col": N, "per_row": M, "scalar": 1}[bias_kind]
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
def test_large_batches(rand, dtype):
    """vmap over A with B shared (one GEMM of batch*M rows) and over both (a batched GEMM)."""
    a, b, bias, _ = rand.operands(M, N, K, dtype, bias_shape=(N,), batch_a=(3,), batch_b=(3,))
    shared = jax.vmap(lambda a: rg.gemm_bias_act(a, b[0], bias, act="silu"))(a)
    each = jax.vmap(lambda a, b: rg.gemm_bias_act(a, b, bias, act="silu"))(a, b)
    ref_shared, _ = np_gemm_bias_act(f64(a), f64(b[0]), f64(bias), act="silu", bias_kind="per_col")
    ref_each, _ = np_gemm_bias_act(f64(a), f64(b), f64(bias), act="silu", bias_kind="per_col")
    assert_rel(shared, ref_shared, dtype, what="B shared")
    assert_rel(each, ref_each, dtype, what="B per example")
