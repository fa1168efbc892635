"""The Flax (linen, nnx) and Equinox layers against the frameworks' own layers.

For identical parameters each layer must give the framework layer's output
followed by the activation, and the same gradients (in f64, so that the only
differences are rounding: docs/spec.md §5); parameter trees must match the originals
(checkpoints load both ways); and the Equinox layer, applied per example under
`jax.vmap`, must lower to one GEMM over the batch with the weight shared by
stride.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_regemm as rg
from conftest import PLAIN_GEMM_CALLS

eqx = pytest.importorskip("equinox")
nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
serialization = pytest.importorskip("flax.serialization")
import jax_regemm.equinox as rg_eqx  # noqa: E402
import jax_regemm.flax as rg_flax  # noqa: E402
import jax_regemm.nnx as rg_nnx  # noqa: E402

K, N = 24, 16
TOL64 = 1e-12


@pytest.fixture(autouse=True)
def _true_f32():
    """Layers are compared with the frameworks' own at tight tolerances: true f32 matmuls on
    both sides (the GPU default is TF32, whose ~1e-4 rounding differs between the two)."""
    with jax.default_matmul_precision("highest"):
        yield


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def assert_trees_close(got, want, tol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert rel(g, w) <= tol, rel(g, w)


def act(name, z):
    return rg.reference.act_fwd(name, z)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def normal(seed, shape, dtype=jnp.float64):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def value_and_grads(f, params, x, seed=99):
    """f's output and the gradients of a random projection of it w.r.t. (params, x)."""
    y = f(params, x)
    r = normal(seed, y.shape, y.dtype)
    grads = jax.grad(lambda p, x: jnp.sum(f(p, x) * r), argnums=(0, 1))(params, x)
    return y, grads


# ---------------------------------------------------------------------------
# flax.linen
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("activation", rg.ACTIVATIONS)
@pytest.mark.parametrize("use_bias", [True, False])
def test_flax_dense_matches_nn_dense(x64, activation, use_bias):
    ours = rg_flax.Dense(N, use_bias=use_bias, param_dtype=jnp.float64, activation=activation)
    theirs = nn.Dense(N, use_bias=use_bias, param_dtype=jnp.float64)
    x = normal(0, (2, 3, K))
    params = theirs.init(jax.random.key(1), x)
    params = jax.tree.map(lambda p: p + normal(2, p.shape), params)  # a random (nonzero) bias too
    assert_trees_close(ours.init(jax.random.key(1), x), theirs.init(jax.random.key(1), x), 0)  # same init

    got = value_and_grads(ours.apply, params, x)
    want = value_and_grads(lambda p, x: act(activation, theirs.apply(p, x)), params, x)
    assert_trees_close(got, want, TOL64)


def test_flax_mlp_tree_and_serialization_round_trip():
    """An MLP checkpoint written from nn.Dense layers loads into ours and gives the same function."""

    class Reference(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Dense(32)(x), approximate=True)
            x = nn.gelu(nn.Dense(32)(x), approximate=True)
            return nn.Dense(10)(x)

    ours = rg_flax.MLP((32, 32, 10), activation="gelu")
    x = normal(0, (8, K), jnp.float32)
    ref_params = Reference().init(jax.random.key(3), x)
    our_params = ours.init(jax.random.key(3), x)
    assert_trees_close(our_params, ref_params, 0)

    blob = serialization.to_bytes(jax.tree.map(lambda p: p + 0.1, ref_params))
    loaded = serialization.from_bytes(our_params, blob)
    assert_trees_close(loaded, jax.tree.map(lambda p: p + 0.1, ref_params), 0)
    assert rel(jax.jit(ours.apply)(loaded, x), Reference().apply(loaded, x)) < 1e-5


def test_flax_dense_vmap_over_params_and_inputs():
    """An ensemble (vmap over stacked params) and a vmap over inputs both match the loop."""
    layer = rg_flax.Dense(N, activation="silu")
    x = normal(0, (5, 4, K), jnp.float32)
    keys = jax.random.split(jax.random.key(4), 3)
    stacked = jax.vmap(lambda k: layer.init(k, x[0]))(keys)
    got = jax.jit(jax.vmap(layer.apply, in_axes=(0, None)))(stacked, x[0])
    for i in range(3):
        assert rel(got[i], layer.apply(jax.tree.map(lambda p: p[i], stacked), x[0])) < 1e-6
    params = jax.tree.map(lambda p: p[0], stacked)
    got = jax.vmap(layer.apply, in_axes=(None, 0))(params, x)
    assert rel(got, layer.apply(params, x)) < 1e-6


def test_flax_dense_bf16_compute_dtype():
    x = normal(0, (8, K), jnp.float32)
    ours = rg_flax.Dense(N, dtype=jnp.bfloat16, activation="relu")
    params = ours.init(jax.random.key(5), x)
    y = ours.apply(params, x)
    assert y.dtype == jnp.bfloat16
    assert rel(y, jax.nn.relu(nn.Dense(N).apply(params, x))) < 2e-2


def test_flax_dense_rejects_what_it_cannot_do():
    x = normal(0, (2, K), jnp.float32)
    with pytest.raises(ValueError, match="activation"):
        rg_flax.Dense(N, activation="swish").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="dot_general"):
        rg_flax.Dense(N, dot_general=jax.lax.dot_general).init(jax.random.key(0), x)


# ---------------------------------------------------------------------------
# flax.nnx
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("activation", rg.ACTIVATIONS)
@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_linear_matches_nnx_linear(x64, activation, use_bias):
    kw = dict(use_bias=use_bias, param_dtype=jnp.float64)
    ours = rg_nnx.Linear(K, N, activation=activation, rngs=nnx.Rngs(0), **kw)
    theirs = nnx.Linear(K, N, rngs=nnx.Rngs(0), **kw)
    assert_trees_close(nnx.state(ours), nnx.state(theirs), 0)  # same init, same state tree
    nnx.update(theirs, jax.tree.map(lambda p: p + normal(1, p.shape), nnx.state(theirs)))
    nnx.update(ours, nnx.state(theirs))

    def apply(model, act_name):
        graphdef = nnx.graphdef(model)
        return lambda s, x: act(act_name, nnx.merge(graphdef, s)(x))

    x = normal(2, (2, 3, K))
    got = value_and_grads(apply(ours, "none"), nnx.state(ours), x)
    want = value_and_grads(apply(theirs, activation), nnx.state(theirs), x)
    assert_trees_close(got, want, TOL64)


def test_nnx_mlp_state_and_serialization_round_trip():
    """State of our MLP has the structure of one built from nnx.Linear; it survives to_bytes/from_bytes."""

    class Reference(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(K, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)])

        def __call__(self, x):
            return self.layers[1](jax.nn.tanh(self.layers[0](x)))

    ours = rg_nnx.MLP([K, 32, 10], activation="tanh", rngs=nnx.Rngs(7))
    ref = Reference(nnx.Rngs(7))
    assert_trees_close(nnx.state(ours), nnx.state(ref), 0)

    trained = jax.tree.map(lambda p: p + 0.1, nnx.to_pure_dict(nnx.state(ref)))
    blob = serialization.to_bytes(trained)
    state = nnx.state(ours)
    nnx.replace_by_pure_dict(state, serialization.from_bytes(nnx.to_pure_dict(state), blob))
    nnx.update(ours, state)
    nnx.update(ref, state)
    x = normal(0, (8, K), jnp.float32)
    assert rel(nnx.jit(lambda m, x: m(x))(ours, x), ref(x)) < 1e-5


# ---------------------------------------------------------------------------
# Equinox
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("activation", rg.ACTIVATIONS)
@pytest.mark.parametrize("use_bias", [True, False])
def test_equinox_linear_matches_eqx_linear(x64, activation, use_bias):
    key = jax.random.key(0)
    ours = rg_eqx.Linear(K, N, use_bias, jnp.float64, activation=activation, key=key)
    theirs = eqx.nn.Linear(K, N, use_bias, jnp.float64, key=key)
    assert_trees_close(jax.tree.leaves(ours), jax.tree.leaves(theirs), 0)  # same init

    def f(model, act_name):
        return lambda m, x: act(act_name, jax.vmap(m)(x))

    x = normal(1, (6, K))
    got = value_and_grads(f(ours, "none"), ours, x)
    want = value_and_grads(f(theirs, activation), theirs, x)
    assert_trees_close(jax.tree.leaves(got), jax.tree.leaves(want), TOL64)


@pytest.mark.parametrize("shape", [("scalar", N), (K, "scalar"), ("scalar", "scalar")])
def test_equinox_linear_scalar_features(x64, shape):
    key = jax.random.key(3)
    ours = rg_eqx.Linear(*shape, dtype=jnp.float64, activation="sigmoid", key=key)
    theirs = eqx.nn.Linear(*shape, dtype=jnp.float64, key=key)
    x = normal(4, (5,) if shape[0] == "scalar" else (5, K))
    got, want = jax.vmap(ours)(x), jax.nn.sigmoid(jax.vmap(theirs)(x))
    assert got.shape == want.shape
    assert rel(got, want) < TOL64
    if shape[0] == "scalar":
        with pytest.raises(ValueError, match="scalar"):
            ours(jnp.ones(3))


def test_equinox_mlp_matches_eqx_mlp_and_loads_its_checkpoint(tmp_path):
    """Same key -> same weights as eqx.nn.MLP; a file it wrote loads into ours; same function."""
    key = jax.random.key(5)
    theirs = eqx.nn.MLP(K, 10, 32, 2, key=key)  # relu hidden, identity last: our defaults
    theirs_arrays = jax.tree.leaves(eqx.filter(theirs, eqx.is_array))
    assert_trees_close(jax.tree.leaves(rg_eqx.MLP(K, 10, 32, 2, key=key)), theirs_arrays, 0)

    ours = rg_eqx.MLP(K, 10, 32, 2, key=jax.random.key(0))  # different weights, overwritten by the file

    path = tmp_path / "mlp.eqx"
    eqx.tree_serialise_leaves(path, theirs)
    loaded = eqx.tree_deserialise_leaves(path, ours)
    x = normal(1, (9, K), jnp.float32)
    assert rel(jax.jit(jax.vmap(loaded))(x), jax.vmap(theirs)(x)) < 1e-5

    buf = io.BytesIO()  # and back: ours -> eqx.nn.MLP
    eqx.tree_serialise_leaves(buf, loaded)
    buf.seek(0)
    back = eqx.tree_deserialise_leaves(buf, theirs)
    assert_trees_close(eqx.filter(back, eqx.is_array), eqx.filter(theirs, eqx.is_array), 0)


def _custom_calls(hlo_text, target):
    return re.findall(rf'custom_call_target="{target}"', hlo_text)


def test_equinox_vmap_is_one_gemm_with_the_weight_shared():
    """vmap of the per-example layer: one regemm_gemm with the batch folded into M ([B, K] x [N, K]^T),
    no loop, no copy of W."""
    b = 128
    layer = rg_eqx.Linear(K, N, activation="gelu", key=jax.random.key(0))
    x = normal(1, (b, K), jnp.float32)
    f = jax.jit(lambda m, x: jax.vmap(m)(x))
    hlo = f.lower(layer, x).compile().as_text()
    calls = [line for line in hlo.splitlines() if f'custom_call_target="{rg._targets.GEMM.name}"' in line]
    assert len(calls) == 1, hlo
    assert f"f32[{b},{K}]" in calls[0] and f"f32[{N},{K}]" in calls[0], calls[0]  # operands A and W
    assert "while" not in hlo and "dot(" not in hlo
    assert f"[{b},{N},{K}]" not in hlo and f"[{b},{K},{N}]" not in hlo  # W never broadcast over the batch
    assert rel(f(layer, x), jax.nn.gelu(jax.vmap(eqx.nn.Linear(K, N, key=jax.random.key(0)))(x))) < 1e-5


def test_equinox_vmap_mlp_one_gemm_per_layer():
    mlp = rg_eqx.MLP(K, 10, 32, 2, key=jax.random.key(0))
    hlo = jax.jit(jax.vmap(mlp)).lower(normal(1, (64, K), jnp.float32)).compile().as_text()
    assert len(_custom_calls(hlo, rg._targets.GEMM.name)) == 3 and "while" not in hlo


def test_equinox_vmap_weight_gradient_is_one_gemm():
    """grad of the vmapped per-example layer: the weight gradient is one GEMM contracting over the
    batch (no [B, N, K] per-example outer products), and no dgrad GEMM since x needs no gradient."""
    b = 128
    layer = rg_eqx.Linear(K, N, activation="relu", key=jax.random.key(0))
    x = normal(1, (b, K), jnp.float32)
    loss = lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2)
    params, static = eqx.partition(layer, eqx.is_array)
    grad_fn = jax.jit(jax.grad(lambda p, x: loss(eqx.combine(p, static), x)))
    hlo = grad_fn.lower(params, x).compile().as_text()
    assert f"[{b},{N},{K}]" not in hlo and f"[{b},{K},{N}]" not in hlo
    assert len(_custom_calls(hlo, rg._targets.GEMM.name)) == 1 + PLAIN_GEMM_CALLS, hlo  # forward; wgrad
    grads = eqx.filter_grad(loss)(layer, x)
    ref = eqx.filter_grad(lambda m, x: jnp.sum(jax.nn.relu(jax.vmap(m)(x)) ** 2))(
        eqx.nn.Linear(K, N, key=jax.random.key(0)), x
    )
    assert rel(grads.weight, ref.weight) < 1e-5 and rel(grads.bias, ref.bias) < 1e-5


# ---------------------------------------------------------------------------
# packaging
# ---------------------------------------------------------------------------


def test_import_jax_regemm_imports_no_framework(tmp_path):
    code = (
        "import sys, jax_regemm\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'equinox', 'optax'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
