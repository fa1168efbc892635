"""rg.mlp, the MLP block: values and gradients against the pure-JAX reference, the
transformations, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_regemm as rg
from blocks import HI, random_block, custom_calls, cuda_module, rel, stack
from conftest import PLAIN_GEMM_CALLS


@pytest.mark.parametrize("act,final_act", [("gelu", "none"), ("relu", "sigmoid"), ("silu", "tanh")])
@pytest.mark.parametrize("save", ["auto", "z", "recompute"])
def test_mlp_value_and_grads(act, final_act, save):
    k = jax.random.split(jax.random.PRNGKey(hash((act, save)) % 2**31), 2)
    ws, bs = random_block(k[0], [24, 40, 32, 16])
    x = jax.random.normal(k[1], (2, 9, 24))
    loss = lambda f: lambda x, ws, bs: jnp.sum(jnp.sin(f(x, ws, bs)))
    ours = lambda x, ws, bs: rg.mlp(x, ws, bs, act=act, final_act=final_act, save=save, precision=HI)
    ref = lambda x, ws, bs: rg.reference.mlp(x, ws, bs, act=act, final_act=final_act, precision=HI)
    y, yr = jax.jit(ours)(x, ws, bs), ref(x, ws, bs)
    assert y.shape == (2, 9, 16) and rel(y, yr) < 1e-5
    g = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(x, ws, bs)
    gr = jax.grad(loss(ref), argnums=(0, 1, 2))(x, ws, bs)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gr)):
        assert rel(a, b) < 1e-5


def test_mlp_jvp_vmap_and_no_bias():
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    ws, _ = random_block(k[0], [8, 12, 6], bias=False)
    x, t = jax.random.normal(k[1], (5, 8)), jax.random.normal(k[2], (5, 8))
    f = lambda x: rg.mlp(x, ws, act="gelu_erf", precision=HI)
    fr = lambda x: rg.reference.mlp(x, ws, act="gelu_erf", precision=HI)
    (y, ty), (yr, tyr) = jax.jvp(f, (x,), (t,)), jax.jvp(fr, (x,), (t,))
    assert rel(y, yr) < 1e-5 and rel(ty, tyr) < 1e-5
    assert rel(jax.vmap(f)(x[:, None, :])[:, 0], yr) < 1e-5


def test_mlp_bf16():
    k = jax.random.split(jax.random.PRNGKey(4), 2)
    ws, bs = random_block(k[0], [64, 128, 64], jnp.bfloat16)
    x = jax.random.normal(k[1], (32, 64), jnp.bfloat16)
    y = rg.mlp(x, ws, bs, act="gelu")
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (x, ws, bs))
    yr = rg.reference.mlp(*f32, act="gelu", precision=HI)
    assert y.dtype == jnp.bfloat16 and rel(y, yr) < 2e-2


def test_mlp_errors_name_the_argument():
    ws, bs = random_block(jax.random.PRNGKey(5), [8, 12, 6])
    x = jnp.ones((3, 8))
    with pytest.raises(ValueError, match="at least one"):
        rg.mlp(x, [])
    with pytest.raises(ValueError, match=r"weights\[1\] has shape \(7, 6\)"):
        rg.mlp(x, [ws[0], jnp.ones((7, 6))])
    with pytest.raises(ValueError, match=r"biases\[0\] must have shape \(12,\)"):
        rg.mlp(x, ws, [jnp.ones(6), bs[1]])
    with pytest.raises(ValueError, match="one entry"):
        rg.mlp(x, ws, bs[:1])
    with pytest.raises(TypeError, match=r"weights\[0\] must be an array"):
        rg.mlp(x, [[1.0]])
    with pytest.raises(TypeError, match=r"weights\[1\] has dtype bfloat16 but x has float32"):
        rg.mlp(x, [ws[0], ws[1].astype(jnp.bfloat16)])
    with pytest.raises(ValueError, match="unknown activation|act"):
        rg.mlp(x, ws, bs, act="swish")


@pytest.mark.parametrize("save", ["auto", "z", "recompute"])
def test_mlp_backward_folds_act_grad_into_dgrad(save):
    """The block's backward: one dgrad_dact call per hidden layer (its act' and bias gradient
    folded into the dgrad GEMM of the layer above), a dact pass only for the last layer's own
    activation, and nothing asked for that is not needed (no dgrad GEMM of layer 0 when x's
    gradient is not taken)."""
    ws, bs = random_block(jax.random.PRNGKey(6), [16, 24, 32, 8])
    x = jnp.ones((10, 16))
    grad_w = jax.grad(lambda ws, bs: jnp.sum(rg.mlp(x, ws, bs, act="silu", final_act="tanh", save=save) ** 2), argnums=(0, 1))
    calls = custom_calls(grad_w, ws, bs)
    fwd = 3 + 3 * (save == "recompute")  # recompute: each layer's Z again, in the backward
    wgrads = 3 * PLAIN_GEMM_CALLS
    assert calls == {"regemm_gemm_v1": fwd + wgrads, "regemm_dact_v1": 1, "regemm_dgrad_dact_v1": 2}, calls
    grad_x = jax.grad(lambda x: jnp.sum(rg.mlp(x, ws, bs, act="relu") ** 2))
    want = {"regemm_gemm_v1": 3 + PLAIN_GEMM_CALLS, "regemm_dact_v1": 0, "regemm_dgrad_dact_v1": 2}  # + layer 0's dgrad
    assert custom_calls(grad_x, x) == want


# (Only CUTLASS's fused dgrad writes in place: a build without it runs cuBLAS's GEMM and a pass.)
@pytest.mark.skipif(cuda_module() is None or not rg._ffi.cutlass_dtypes(), reason="needs the CUTLASS dgrad on a GPU")
@pytest.mark.parametrize("act,save,dtype,per_layer,aliased", [("relu", "auto", jnp.float32, False, True),
                                                              ("gelu", "recompute", jnp.bfloat16, False, True),
                                                              ("silu", "auto", jnp.float32, False, False),
                                                              ("relu", "auto", jnp.float32, True, True),
                                                              ("silu", "auto", jnp.float32, True, False)])  # fmt: skip
def test_mlp_backward_writes_gz_over_s(monkeypatch, act, save, dtype, per_layer, aliased):
    """On one GPU the backward's dgrad_dact calls write gZ over S where S is Y (relu: after the
    wgrad that reads Y, an operand the call follows) or recomputed by rg.mlp, not over a stashed
    Z, in rg.mlp and in the calls the lowering folds for rg.dense layers: each call aliases gZ to S
    or none does, no [M, N] copy is made, the gradients are the same bits as with
    REGEMM_IN_PLACE=0 and match the reference, and the relu step's compiled temporaries are below
    those with REGEMM_IN_PLACE=0 (2^24-element layers: the backward's first call is the peak)."""
    from conftest import dgrad_dact_in_place

    m, d, layers = 32768, 512, 4
    ws, bs = random_block(jax.random.PRNGKey(10), [d] * (layers + 1), dtype)
    x = jax.random.normal(jax.random.PRNGKey(11), (m, d), dtype)
    block = stack(per_layer, act, save)
    loss = lambda x, ws, bs: jnp.sum(block(x, ws, bs).astype(jnp.float32) ** 2)
    monkeypatch.setenv("REGEMM_TUNE", "0")  # the rule's way (fused at K = 512) on both sides

    def compiled(in_place):
        monkeypatch.setenv("REGEMM_IN_PLACE", "1" if in_place else "0")
        c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, ws, bs).compile()
        return c, c.as_text(), c.memory_analysis().temp_size_in_bytes

    c_on, text, temp_on = compiled(True)
    calls, in_place, copies = dgrad_dact_in_place(text, (m, d))
    assert len(calls) == layers - 1, calls
    assert in_place == [aliased] * (layers - 1), calls
    assert copies == 0
    c_off, _, temp_off = compiled(False)
    assert temp_on < temp_off if act == "relu" else temp_on <= temp_off, (temp_on, temp_off)
    g_on, g_off = c_on(x, ws, bs), c_off(x, ws, bs)
    for a, b in zip(jax.tree.leaves(g_on), jax.tree.leaves(g_off)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (x, ws, bs))
    # (jitted: op by op at 2^24-element layers the reference took 2 minutes of the GPU suite)
    gr = jax.jit(jax.grad(lambda *a: jnp.sum(rg.reference.mlp(*a, act=act, precision=HI) ** 2), argnums=(0, 1, 2)))(*f32)
    # Four layers deep at the default precision (bf16, TF32): relu's mask flips where Z rounds
    # across 0 (f32 relu's gradient of x 1.7e-2 on the H100); an S overwritten early is O(1).
    for a, b in zip(jax.tree.leaves(g_on), jax.tree.leaves(gr)):
        assert rel(a, b) < 5e-2, rel(a, b)


def test_mlp_bf16_grads_deep():
    """Five bf16 layers: the folded backward's gradients against the f32 reference."""
    k = jax.random.split(jax.random.PRNGKey(7), 2)
    ws, bs = random_block(k[0], [64, 96, 128, 96, 80, 32], jnp.bfloat16)
    x = jax.random.normal(k[1], (48, 64), jnp.bfloat16)
    loss = lambda f: lambda x, ws, bs: jnp.sum(f(x, ws, bs).astype(jnp.float32) ** 2)
    g = jax.jit(jax.grad(loss(lambda *a: rg.mlp(*a, act="gelu")), argnums=(0, 1, 2)))(x, ws, bs)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (x, ws, bs))
    gr = jax.grad(loss(lambda *a: rg.reference.mlp(*a, act="gelu", precision=HI)), argnums=(0, 1, 2))(*f32)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gr)):
        assert a.dtype == jnp.bfloat16 and rel(a, b) < 5e-2, rel(a, b)


def test_mlp_modules_run_the_folded_backward():
    """The MLP modules of flax.linen, nnx and Equinox (the latter under jax.vmap over examples,
    which folds the batch into the GEMMs' rows) differentiate through the block: one dgrad_dact
    call per hidden layer, and their gradients match plain nn.Dense / eqx.nn.MLP."""
    flax_nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    import jax_regemm.equinox as reqx
    import jax_regemm.flax as rflax
    import jax_regemm.nnx as rnnx

    from conftest import tol

    x = jax.random.normal(jax.random.PRNGKey(8), (12, 16))
    t = tol(jnp.float32)  # both sides at default precision (TF32 on a GPU)
    # flax.linen
    ours = rflax.MLP([24, 32, 8], activation="gelu")
    params = ours.init(jax.random.PRNGKey(9), x)
    loss = lambda p: jnp.sum(ours.apply(p, x) ** 2)
    assert custom_calls(jax.grad(loss), params)["regemm_dgrad_dact_v1"] == 2

    class Plain(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            for i, f in enumerate([24, 32, 8]):
                x = flax_nn.Dense(f)(x)
                x = jax.nn.gelu(x, approximate=True) if i < 2 else x
            return x

    g = jax.grad(loss)(params)
    gr = jax.grad(lambda p: jnp.sum(Plain().apply(p, x) ** 2))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gr)):
        assert rel(a, b) < t
    # nnx
    model = rnnx.MLP([16, 24, 8], activation="silu", rngs=nnx.Rngs(0))
    nloss = lambda m: jnp.sum(m(x) ** 2)
    gn = nnx.grad(nloss)(model)
    assert custom_calls(lambda m: jax.tree.leaves(nnx.grad(nloss)(m)), model)["regemm_dgrad_dact_v1"] == 1
    ref = lambda m: jnp.sum(rg.reference.mlp(x, [l.kernel[...] for l in m.layers], [l.bias[...] for l in m.layers], act="silu") ** 2)  # fmt: skip
    for a, b in zip(jax.tree.leaves(gn), jax.tree.leaves(nnx.grad(ref)(model))):
        assert rel(a, b) < t
    # Equinox, per example under vmap
    em = reqx.MLP(16, 8, 24, 2, activation="relu", key=jax.random.PRNGKey(10))
    pm = eqx.nn.MLP(16, 8, 24, 2, activation=jax.nn.relu, key=jax.random.PRNGKey(10))
    eloss = lambda m: jnp.sum(jax.vmap(m)(x) ** 2)
    assert custom_calls(jax.grad(eloss), em)["regemm_dgrad_dact_v1"] == 2
    ge, gp = eqx.filter_grad(eloss)(em), eqx.filter_grad(eloss)(pm)
    for a, b in zip(jax.tree.leaves(ge), jax.tree.leaves(gp)):
        assert rel(a, b) < t
