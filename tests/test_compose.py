"""jax_regemm composes with the rest of JAX: forward-mode and second-order
derivatives for every activation, jax.checkpoint, jax.export round trips.
Sharding is test_sharding.py's."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest
from conftest import assert_rel
from jax.test_util import check_grads

import jax_regemm as rg
from jax_regemm import reference as R

M, K, N = 6, 5, 4
DT = jnp.float64


# ---------------------------------------------------------------------------
# forward mode and second order
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("act", rg.ACTIVATIONS)
@pytest.mark.parametrize("save", ["auto", "z", "recompute"])
def test_check_grads_second_order_both_modes(x64, rand, act, save):
    """check_grads(order=2, modes=("fwd", "rev")) on every operand, with C and a bias."""
    a, b, bias, c = rand.operands(M, N, K, DT, bias_shape=(N,), with_c=True)
    if act in ("relu", "leaky_relu"):  # keep Z away from the kink: finite differences straddle it
        c = c + jnp.where(c >= 0, 1.0, -1.0)
    f = lambda a, b, bias, c: rg.gemm_bias_act(a, b, bias, c=c, beta=0.5, alpha=1.5, act=act, save=save)
    check_grads(f, (a, b, bias, c), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("kind", ["scalar", "per_row", "per_col"])
@pytest.mark.parametrize("trans", [(False, False), (True, True)])
def test_jvp_every_bias_kind_and_layout(x64, rand, kind, trans):
    ta, tb = trans
    shape = {"scalar": (), "per_row": (M,), "per_col": (N,)}[kind]
    a, b, bias, _ = rand.operands(M, N, K, DT, bias_shape=shape, trans_a=ta, trans_b=tb)
    tangents = tuple(rand.normal(x.shape, DT) for x in (a, b, bias))
    kw = dict(act="silu", trans_a=ta, trans_b=tb, bias_kind=kind)
    got = jax.jvp(lambda a, b, bias: rg.gemm_bias_act(a, b, bias, **kw), (a, b, bias), tangents)
    want = jax.jvp(lambda a, b, bias: R.gemm_bias_act(a, b, bias, **kw), (a, b, bias), tangents)
    for g, w in zip(got, want):
        assert_rel(g, w, DT)


def test_jvp_of_the_z_output_and_hessian(x64, rand):
    """The Z output has a true tangent (needed by "JVP of JVP"), and jax.hessian agrees."""
    a, b, bias, _ = rand.operands(M, N, K, DT, bias_shape=(N,))
    da = rand.normal(a.shape, DT)
    (y, z), (dy, dz) = jax.jvp(lambda a: rg.gemm_bias_act_fwd(a, b, bias, act="gelu"), (a,), (da,))
    (yr, zr), (dyr, dzr) = jax.jvp(lambda a: R.gemm_bias_act(a, b, bias, act="gelu", return_z=True), (a,), (da,))
    for g, w in ((y, yr), (z, zr), (dy, dyr), (dz, dzr)):
        assert_rel(g, w, DT)
    h = jax.hessian(lambda b: jnp.sum(rg.gemm_bias_act(a, b, bias, act="tanh") ** 3))(b)
    hr = jax.hessian(lambda b: jnp.sum(R.gemm_bias_act(a, b, bias, act="tanh") ** 3))(b)
    assert_rel(h, hr, DT)


def test_checkpoint(x64, rand):
    """jax.checkpoint around a layer: gradients as the reference's."""
    x, w, b, _ = rand.operands(M, N, K, DT, bias_shape=(N,))
    f = jax.checkpoint(lambda x, w, b: jnp.sum(jnp.sin(rg.dense(x, w, b, act="silu"))))
    r = lambda x, w, b: jnp.sum(jnp.sin(R.dense(x, w, b, act="silu")))
    for g, gr in zip(jax.grad(f, argnums=(0, 1, 2))(x, w, b), jax.grad(r, argnums=(0, 1, 2))(x, w, b)):
        assert_rel(g, gr, DT)


def test_grad_computes_only_what_is_asked(rand):
    """grad with respect to w alone: the forward, the dact pass without a bias gradient, one wgrad GEMM."""
    x, w, b, _ = rand.operands(M, N, K, jnp.float32, bias_shape=(N,))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(rg.dense(x, w, b, act="gelu"))))(w))
    assert jaxpr.count("regemm_fused[") == 2 and jaxpr.count("regemm_dact[") == 1, jaxpr
    assert "bias_kind='none'" in jaxpr.split("regemm_dact[")[1].split("]")[0]


# ---------------------------------------------------------------------------
# jax.export
# ---------------------------------------------------------------------------


def test_export_round_trip_symbolic_batch(rand):
    """A jitted forward and a gradient export with a symbolic batch, serialize,
    deserialize and run; without the documented disabled checks export refuses."""
    x, w, b, _ = rand.operands(8, N, K, jnp.float32, bias_shape=(N,))
    f = jax.jit(lambda x, w, b: rg.dense(x, w, b, act="gelu"))
    g = jax.jit(jax.grad(lambda x, w, b: jnp.sum(rg.dense(x, w, b, act="gelu") ** 2), argnums=1))
    with pytest.raises(ValueError, match="custom calls"):
        jax.export.export(f)(x, w, b)
    (batch,) = jax.export.symbolic_shape("B")
    spec = (jax.ShapeDtypeStruct((batch, K), x.dtype), w, b)
    for fn, ref in ((f, lambda x, w, b: R.dense(x, w, b, act="gelu")),
                    (g, jax.grad(lambda x, w, b: jnp.sum(R.dense(x, w, b, act="gelu") ** 2), argnums=1))):  # fmt: skip
        exp = jax.export.export(fn, disabled_checks=rg.disabled_export_checks())(*spec)
        back = jax.export.deserialize(exp.serialize())
        for rows in (8, 3):
            xr = rand.normal((rows, K), jnp.float32)
            assert_rel(back.call(xr, w, b), ref(xr, w, b), jnp.float32)
    names = {str(c) for c in rg.disabled_export_checks()}
    targets = ("gemm", "dact", "dgrad_dact", "narrow_mlp", "narrow_mlp_bwd")  # every target, versioned
    assert names == {f"custom_call:regemm_{t}_v1" for t in targets}, names
