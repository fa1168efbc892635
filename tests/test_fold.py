"""The fold across layers written one op at a time (jax_regemm/_fold.py): a layer's dact whose gY is the
dgrad GEMM of the layer above lowers as one regemm_dgrad_dact call, as rg.mlp's backward runs it;
rg.dense, the Flax, nnx and Equinox layers, values against the reference and the calls in the program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from blocks import HI, random_block, custom_calls, rel, stack
from conftest import PLAIN_GEMM_CALLS, tol

import jax_regemm as rg


def test_dense_fold_writes_gz_over_y_where_the_call_can_follow_its_readers(monkeypatch):
    """The decision of the fold's lowering for CUDA, where the kernel would write gZ over S (the
    CUDA module's answer stubbed, so that it runs here): over Y of a relu layer, after the wgrad
    that reads Y (one more operand); with only biases differentiated, no wgrad and no operand
    more; never where another reader of Y comes first that the call cannot follow, nor over a
    stashed Z (silu), nor over an S the program takes as an argument (rg.mlp's calls neither)."""
    from jax_regemm import _ffi, _targets

    def in_place(platform, target, avals, attrs):
        return {2: 0} if platform == "cuda" and target == _targets.DGRAD_DACT.name else {}

    monkeypatch.setattr(_ffi, "_in_place", in_place)
    m, d, layers = 4096, 1024, 4  # past the small-op rule's bound, so the calls are regemm's
    ws, bs = random_block(jax.random.PRNGKey(21), [d] * (layers + 1))
    x = jax.random.normal(jax.random.PRNGKey(22), (m, d))

    def calls(f, act="relu"):
        block = stack(True, act, "auto")
        lowered = jax.jit(f(block)).trace(ws, bs).lower(lowering_platforms=("cuda",)).as_text()
        found = [line for line in lowered.splitlines() if "@regemm_dgrad_dact_v1(" in line]
        assert len(found) == layers - 1, found
        return [("output_operand_aliases" in line, line.split("(", 1)[1].split(")")[0].count("%")) for line in found]

    loss = lambda block: lambda ws, bs: jnp.sum(block(x, ws, bs) ** 2)
    assert calls(lambda block: jax.grad(loss(block), argnums=(0, 1))) == [(True, 4)] * (layers - 1)
    assert calls(lambda block: jax.grad(loss(block), argnums=1)) == [(True, 3)] * (layers - 1)
    assert calls(lambda block: jax.grad(loss(block), argnums=(0, 1)), act="silu") == [(False, 3)] * (layers - 1)

    def read_first(block):  # a sum of layer 1's Y returned beside the loss: the call cannot follow it
        def f(ws, bs):
            y1 = rg.dense(rg.dense(x, ws[0], bs[0], act="relu"), ws[1], bs[1], act="relu")
            return jnp.sum(block(y1, ws[2:], bs[2:]) ** 2), jnp.sum(jnp.tanh(y1))

        return jax.grad(f, argnums=(0, 1), has_aux=True)

    assert calls(read_first) == [(True, 4), (False, 3), (True, 4)]  # in order from the top: layer 1's is second

    # The backward compiled apart from its forward (layers and rg.mlp): S is the program's
    # argument, which stays, and the call follows nothing.
    for per_layer in (True, False):
        _, backward = jax.vjp(lambda ws, bs: jnp.sum(stack(per_layer, "relu", "auto")(x, ws, bs) ** 2), ws, bs)
        lowered = jax.jit(lambda f: f(jnp.float32(1))).trace(backward).lower(lowering_platforms=("cuda",)).as_text()
        found = [line for line in lowered.splitlines() if "@regemm_dgrad_dact_v1(" in line]
        assert len(found) == layers - 1, found
        assert [("output_operand_aliases" in line, line.split("(", 1)[1].split(")")[0].count("%")) for line in found] \
            == [(False, 3)] * (layers - 1), found


# ---------------------------------------------------------------------------
# The same fold for layers written one op at a time (jax_regemm/_fold.py)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("save", ["auto", "recompute"])
@pytest.mark.parametrize("lead", [(40,), (4, 10)])
def test_dense_layers_fold_act_grad_into_dgrad(save, lead):
    """Three rg.dense layers (gelu, relu, none), differentiated: each hidden layer's act' and bias
    gradient run in the dgrad GEMM of the layer above (one dgrad_dact call each, no dact pass, no
    GEMM left for the folded dgrads), also where x has two leading dims (rg.dense's reshapes lie
    between the GEMM and the dact), and the gradients match the reference."""
    ws, bs = random_block(jax.random.PRNGKey(12), [16, 24, 32, 8])
    x = jax.random.normal(jax.random.PRNGKey(13), lead + (16,))
    acts = ["gelu", "relu", "none"]

    def loss(f):
        def run(x, ws, bs):
            for w, b, act in zip(ws, bs, acts):
                x = f(x, w, b, act)
            return jnp.sum(x**2)

        return run

    ours = loss(lambda x, w, b, act: rg.dense(x, w, b, act=act, save=save))
    ref = loss(lambda x, w, b, act: rg.reference.gemm_bias_act(x, w, b, act=act, precision=HI))
    fwd = 3 + 2 * (save == "recompute")  # recompute: each hidden layer's Z again
    want = {"regemm_gemm_v1": fwd + 4 * PLAIN_GEMM_CALLS, "regemm_dact_v1": 0, "regemm_dgrad_dact_v1": 2}
    grads = jax.grad(ours, argnums=(0, 1, 2))
    assert custom_calls(grads, x, ws, bs, compiled=True) == want

    for a, b in zip(jax.tree.leaves(jax.jit(grads)(x, ws, bs)), jax.tree.leaves(jax.grad(ref, argnums=(0, 1, 2))(x, ws, bs))):
        assert rel(a, b) < tol(jnp.float32), rel(a, b)


def test_dense_fold_keeps_a_gemm_read_elsewhere():
    """A hand-written backward whose gY, a plain GEMM's result, is also returned: the dact still
    folds (the GEMM runs on its own as well), and both results match float64 NumPy."""
    k = jax.random.split(jax.random.PRNGKey(14), 5)
    p, q = jax.random.normal(k[0], (24, 20)), jax.random.normal(k[1], (20, 32))
    a, b = jax.random.normal(k[2], (24, 16)), jax.random.normal(k[3], (16, 32))
    bias = jax.random.normal(k[4], (32,))

    def f(p, q, a, b, bias):
        gy = rg.gemm_bias_act(p, q, act="none", precision=HI)
        _, z = rg.gemm_bias_act_fwd(a, b, bias, act="gelu", precision=HI, return_z=True)
        ga, gb, gbias, _ = rg.gemm_bias_act_bwd(a, b, gy, z, bias, act="gelu", precision=HI)
        return ga, gbias, gy

    args = (p, q, a, b, bias)
    calls = custom_calls(f, *args, compiled=True)
    assert calls["regemm_dgrad_dact_v1"] == 1 and calls["regemm_dact_v1"] == 0, calls
    ga, gbias, gy = jax.jit(f)(*args)
    p, q, a, b, bias = (np.asarray(v, np.float64) for v in args)
    gy64 = p @ q
    z = a @ b + bias
    t = np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3))
    dgelu = 0.5 * (1 + t) + 0.5 * z * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * z**2)
    gz = gy64 * dgelu
    for got, want in ((gy, gy64), (ga, gz @ b.T), (gbias, gz.sum(0))):
        assert rel(got, want) < 1e-5, rel(got, want)


def test_flax_dense_layers_run_the_folded_backward():
    """A user's per-layer swap (nn.Dense + activation -> jax_regemm.flax.Dense with it): the step's
    backward folds each hidden layer's act' into the dgrad GEMM above, as rg.mlp's does, with
    nn.Dense's gradients."""
    flax_nn = pytest.importorskip("flax.linen")
    import jax_regemm.flax as rflax

    feats = [24, 32, 8]

    class Net(flax_nn.Module):
        ours: bool

        @flax_nn.compact
        def __call__(self, x):
            for i, f in enumerate(feats):
                act = "silu" if i < len(feats) - 1 else "none"
                if self.ours:
                    x = rflax.Dense(f, activation=act)(x)
                else:
                    x = flax_nn.Dense(f, precision=HI)(x)
                    x = jax.nn.silu(x) if act == "silu" else x
            return x

    x = jax.random.normal(jax.random.PRNGKey(15), (12, 16))
    params = Net(False).init(jax.random.PRNGKey(16), x)
    grad = lambda ours: jax.grad(lambda p: jnp.sum(Net(ours).apply(p, x) ** 2))
    assert custom_calls(grad(True), params, compiled=True)["regemm_dgrad_dact_v1"] == 2
    for a, b in zip(jax.tree.leaves(jax.jit(grad(True))(params)), jax.tree.leaves(grad(False)(params))):
        assert rel(a, b) < tol(jnp.float32), rel(a, b)


def test_cotangent_of_a_layer_without_activation_is_one_buffer():
    """A layer without activation passes its cotangent on as gZ to three readers: an optimization
    barrier keeps it one buffer where the program makes it (a loss's gradient), and none is put on
    a cotangent that is the program's input (a barrier on an entry parameter copies it)."""
    k = jax.random.split(jax.random.PRNGKey(17), 4)
    x, w = jax.random.normal(k[0], (64, 32)), jax.random.normal(k[1], (32, 48))
    b, gy = jax.random.normal(k[2], (48,)), jax.random.normal(k[3], (64, 48))
    made = jax.jit(jax.grad(lambda x, w, b: jnp.sum(rg.dense(x, w, b) ** 2), argnums=(0, 1, 2)))
    given = jax.jit(lambda x, w, b, gy: jax.vjp(lambda *a: rg.dense(*a), x, w, b)[1](gy))
    assert "optimization_barrier" in made.lower(x, w, b).as_text()
    assert "optimization_barrier" not in given.lower(x, w, b, gy).as_text()

    gx, gw, gb = given(x, w, b, gy)
    x64, w64, gy64 = (np.asarray(v, np.float64) for v in (x, w, gy))
    for got, want in ((gx, gy64 @ w64.T), (gw, x64.T @ gy64), (gb, gy64.sum(0))):
        assert rel(got, want) < tol(jnp.float32), rel(got, want)


def test_nnx_and_equinox_layers_run_the_folded_backward():
    """Stacks of jax_regemm.nnx.Linear and jax_regemm.equinox.Linear (the latter per example under
    jax.vmap) fold too: one dgrad_dact call per hidden layer, no dact pass, gradients as plain JAX."""
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    import jax_regemm.equinox as reqx
    import jax_regemm.nnx as rnnx

    x = jax.random.normal(jax.random.PRNGKey(18), (12, 16))
    acts = ["silu", "gelu", "none"]
    dims = [16, 24, 32, 8]
    ref_act = {"silu": jax.nn.silu, "gelu": lambda z: jax.nn.gelu(z, approximate=True), "none": lambda z: z}

    # Equinox: weight [out, in], applied per example
    ks = jax.random.split(jax.random.PRNGKey(19), 3)
    layers = [reqx.Linear(k, n, activation=a, key=key) for k, n, a, key in zip(dims, dims[1:], acts, ks)]

    def eqx_loss(layers, ours=True):
        def one(xi):
            for layer, a in zip(layers, acts):
                xi = layer(xi) if ours else ref_act[a](jnp.dot(layer.weight, xi, precision=HI) + layer.bias)
            return xi

        return jnp.sum(jax.vmap(one)(x) ** 2)

    grad = jax.grad(eqx_loss)
    assert custom_calls(grad, layers, compiled=True)["regemm_dgrad_dact_v1"] == 2
    assert custom_calls(grad, layers, compiled=True)["regemm_dact_v1"] == 0
    got, want = jax.jit(grad)(layers), jax.grad(lambda ls: eqx_loss(ls, ours=False))(layers)
    for a, b in zip(jax.tree.leaves(eqx.filter(got, eqx.is_array)), jax.tree.leaves(eqx.filter(want, eqx.is_array))):
        assert rel(a, b) < tol(jnp.float32), rel(a, b)

    # nnx: kernel [in, out]
    rngs = nnx.Rngs(20)
    model = [rnnx.Linear(k, n, activation=a, rngs=rngs) for k, n, a in zip(dims, dims[1:], acts)]
    graphdef, state = nnx.split(model)

    def nnx_loss(state, ours=True):
        h = x
        for layer, a in zip(nnx.merge(graphdef, state), acts):
            h = layer(h) if ours else ref_act[a](jnp.dot(h, layer.kernel[...], precision=HI) + layer.bias[...])
        return jnp.sum(h**2)

    grad = jax.grad(nnx_loss)
    assert custom_calls(grad, state, compiled=True)["regemm_dgrad_dact_v1"] == 2
    got, want = jax.jit(grad)(state), jax.grad(lambda s: nnx_loss(s, ours=False))(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel(a, b) < tol(jnp.float32), rel(a, b)
