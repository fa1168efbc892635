"""Transforms compose (docs/spec.md §1, §2): jit, grad, vmap, vmap∘grad, grad∘vmap,
jit∘vmap∘grad, nested vmap with different in_axes (a weight shared by one
level and batched by the other), all against jax_regemm.reference (itself
checked against the float64 NumPy reference in test_forward); and vmap over
shared weights never materializes a broadcast of the weights (lowered HLO)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import PLAIN_GEMM_CALLS, TRANS, assert_rel, f64, np_gemm_bias_act

import jax_regemm as rg
from jax_regemm import reference as R

B, M, K, N = 3, 5, 7, 6  # distinct: a [B, K, N] (or [B, M, K]) tensor can only be a broadcast weight
DT = jnp.float64


def ours(act="gelu", kind="per_col", **kw):
    return lambda a, b, bias, c=None: rg.gemm_bias_act(a, b, bias, act=act, c=c, **kw)


def theirs(act="gelu", kind="per_col", **kw):
    return lambda a, b, bias, c=None: R.gemm_bias_act(a, b, bias, act=act, c=c, bias_kind=kind, **kw)


def close(got, want, what=""):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape, (what, g.shape, w.shape)
        assert_rel(g, w, g.dtype, what=what)


def loss_of(f):
    return lambda *args: jnp.sum(jnp.sin(f(*args)) * 1.3)


# ---------------------------------------------------------------------------
# jit, grad, vmap and their compositions
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("act", ["gelu", "relu", "silu"])
def test_jit_matches_eager_and_reference(x64, rand, act):
    a, b, bias, c = rand.operands(M, N, K, DT, bias_shape=(N,), with_c=True)
    f, r = ours(act, beta=0.5), theirs(act, beta=0.5)
    eager = f(a, b, bias, c)
    jitted = jax.jit(f)(a, b, bias, c)
    np.testing.assert_array_equal(f64(eager), f64(jitted))
    close(jitted, r(a, b, bias, c))
    close(jitted, np_gemm_bias_act(a, b, bias, act=act, c=c, beta=0.5, bias_kind="per_col")[0])
    g = jax.jit(jax.grad(loss_of(f), argnums=(0, 1, 2, 3)))(a, b, bias, c)
    close(g, jax.grad(loss_of(r), argnums=(0, 1, 2, 3))(a, b, bias, c), "jit∘grad")


_VMAP_AXES = [
    (0, None, None, None),  # examples against shared weights
    (None, 0, None, None),  # one input against a batch of weights
    (0, 0, None, None),
    (0, 0, 0, 0),
    (None, None, 0, None),  # only the bias batched
    (None, None, None, 0),  # only C batched
    (1, None, None, 2),  # batch dims not leading
    (0, 2, 0, None),
]


def _batched(rand, axes, kind="per_col", trans=(False, False)):
    """Operands with a batch dim of size B inserted where `axes` says."""
    ta, tb = trans
    a, b, bias, c = rand.operands(M, N, K, DT, trans_a=ta, trans_b=tb, bias_shape={"per_col": (N,), "per_row": (M,),
                                  "scalar": ()}[kind], with_c=True)  # fmt: skip
    out = []
    for x, ax in zip((a, b, bias, c), axes):
        if ax is None:
            out.append(x)
        else:
            xb = rand.normal((B,) + x.shape, DT)
            out.append(jnp.moveaxis(xb, 0, ax))
    return out


@pytest.mark.parametrize("kind", ["per_col", "per_row", "scalar"])
@pytest.mark.parametrize("axes", _VMAP_AXES, ids=str)
def test_vmap(x64, rand, axes, kind):
    args = _batched(rand, axes, kind)
    f, r = ours("tanh", kind, beta=-0.6), theirs("tanh", kind, beta=-0.6)
    got = jax.vmap(f, in_axes=axes)(*args)
    close(got, jax.vmap(r, in_axes=axes)(*args), "vmap")
    close(jax.jit(jax.vmap(f, in_axes=axes))(*args), got, "jit∘vmap")
    # and against a Python loop over the batch in NumPy float64
    for i in range(B):
        one = [x if ax is None else jnp.take(x, i, axis=ax) for x, ax in zip(args, axes)]
        want, _ = np_gemm_bias_act(*one[:3], act="tanh", c=one[3], beta=-0.6, bias_kind=kind)
        assert_rel(got[i], want, DT, what=f"entry {i}")


_VG_CASES = [((0, None, None, None), t) for t in TRANS] + [
    (ax, t) for ax in [(None, 0, None, None), (0, 0, 0, 0), (1, None, None, 2)] for t in (TRANS[0], TRANS[3])
]


@pytest.mark.parametrize("axes,trans", _VG_CASES, ids=lambda v: str(v).replace(" ", ""))
def test_vmap_grad_and_grad_vmap(x64, rand, axes, trans):
    """Per-example gradients (vmap∘grad), the gradient of a batched loss (grad∘vmap),
    and jit∘vmap∘grad, each vs the reference under the same transforms."""
    ta, tb = trans
    args = _batched(rand, axes, "per_row", trans)
    f = ours("gelu", "per_row", beta=0.7, alpha=1.1, trans_a=ta, trans_b=tb)
    r = theirs("gelu", "per_row", beta=0.7, alpha=1.1, trans_a=ta, trans_b=tb)
    wrt = (0, 1, 2, 3)

    vg = jax.vmap(jax.grad(loss_of(f), argnums=wrt), in_axes=axes)(*args)
    close(vg, jax.vmap(jax.grad(loss_of(r), argnums=wrt), in_axes=axes)(*args), "vmap∘grad")
    jvg = jax.jit(jax.vmap(jax.grad(loss_of(f), argnums=wrt), in_axes=axes))(*args)
    close(jvg, vg, "jit∘vmap∘grad")

    gv = jax.grad(lambda *x: jnp.sum(jax.vmap(loss_of(f), in_axes=axes)(*x)), argnums=wrt)(*args)
    close(gv, jax.grad(lambda *x: jnp.sum(jax.vmap(loss_of(r), in_axes=axes)(*x)), argnums=wrt)(*args), "grad∘vmap")
    close(jax.jit(jax.grad(lambda *x: jnp.sum(jax.vmap(loss_of(f), in_axes=axes)(*x)), argnums=wrt))(*args), gv)


@pytest.mark.parametrize("save", ["z", "y", "recompute"])
def test_vmap_grad_every_save_policy(x64, rand, save):
    act = "sigmoid"
    args = _batched(rand, (0, None, None, None))
    f, r = ours(act, save=save, beta=0.3), theirs(act, beta=0.3)
    for outer in ("vmap∘grad", "grad∘vmap"):
        if outer == "vmap∘grad":
            g = jax.vmap(jax.grad(loss_of(f), argnums=(0, 1, 2, 3)), in_axes=(0, None, None, None))
            h = jax.vmap(jax.grad(loss_of(r), argnums=(0, 1, 2, 3)), in_axes=(0, None, None, None))
        else:
            g = jax.grad(lambda *x: jnp.sum(jax.vmap(loss_of(f), in_axes=(0, None, None, None))(*x)), argnums=(0, 1, 2, 3))
            h = jax.grad(lambda *x: jnp.sum(jax.vmap(loss_of(r), in_axes=(0, None, None, None))(*x)), argnums=(0, 1, 2, 3))
        close(g(*args), h(*args), outer)


def test_grad_of_grad_under_vmap(x64, rand):
    """vmap of second-order gradients (a Hessian-vector product, a gradient of a gradient norm)."""
    args = _batched(rand, (0, None, None, None))
    f, r = ours("silu"), theirs("silu")

    def hvp(f):  # reverse over reverse: d/db <grad_b loss, v>
        g = jax.grad(loss_of(f), argnums=1)
        return lambda a, b, bias, c: jax.grad(lambda b: jnp.vdot(g(a, b, bias, c), jnp.cos(b)))(b)

    close(jax.vmap(hvp(f), in_axes=(0, None, None, None))(*args), jax.vmap(hvp(r), in_axes=(0, None, None, None))(*args))
    gg = lambda f: jax.grad(lambda a, b, bias, c: jnp.sum(jax.grad(loss_of(f), argnums=0)(a, b, bias, c) ** 2), argnums=1)
    close(jax.vmap(gg(f), in_axes=(0, None, None, None))(*args), jax.vmap(gg(r), in_axes=(0, None, None, None))(*args))


# ---------------------------------------------------------------------------
# nested vmap
# ---------------------------------------------------------------------------


def test_nested_vmap_weight_shared_by_inner_batched_by_outer(x64, rand):
    """Outer level: a batch of weights (B over axis 0) and of biases; inner level: a batch of
    examples (over axis 1 of A) against the outer level's weight. A is shared by the outer level."""
    B2 = 4
    a = rand.normal((M, B2, K), DT)  # inner batch on axis 1, shared by the outer level
    b = rand.normal((B, K, N), DT)  # outer batch on axis 0, shared by the inner level
    bias = rand.normal((N, B), DT)  # outer batch on axis 1
    f, r = ours("gelu"), theirs("gelu")

    def nest(f):
        inner = jax.vmap(lambda a, b, bias: f(a, b, bias), in_axes=(1, None, None), out_axes=1)
        return jax.vmap(inner, in_axes=(None, 0, 1), out_axes=0)

    got = nest(f)(a, b, bias)
    assert got.shape == (B, M, B2, N)
    close(got, nest(r)(a, b, bias), "nested vmap")
    for i in range(B):
        for j in range(B2):
            want, _ = np_gemm_bias_act(a[:, j], b[i], bias[:, i], act="gelu", bias_kind="per_col")
            assert_rel(got[i, :, j], want, DT)
    close(jax.jit(nest(f))(a, b, bias), got, "jit nested")

    wrt = (0, 1, 2)
    lf = lambda a, b, bias: jnp.sum(jnp.cos(nest(f)(a, b, bias)))
    lr = lambda a, b, bias: jnp.sum(jnp.cos(nest(r)(a, b, bias)))
    close(jax.grad(lf, argnums=wrt)(a, b, bias), jax.grad(lr, argnums=wrt)(a, b, bias), "grad∘nested vmap")

    # per-example gradients at both levels: vmap(vmap(grad))
    def nest_grad(f):
        g = jax.grad(lambda a, b, bias: jnp.sum(jnp.cos(f(a, b, bias))), argnums=(0, 1, 2))
        inner = jax.vmap(g, in_axes=(1, None, None), out_axes=0)
        return jax.vmap(inner, in_axes=(None, 0, 1), out_axes=0)

    close(jax.jit(nest_grad(f))(a, b, bias), nest_grad(r)(a, b, bias), "jit∘vmap∘vmap∘grad")


def test_nested_vmap_two_levels_both_batched(x64, rand):
    """Both levels batch A and C (different axes); B is batched by the inner level only."""
    B2 = 2
    a = rand.normal((B, B2, M, K), DT)
    b = rand.normal((K, B2, N), DT)  # inner batch on axis 1
    c = rand.normal((M, N, B), DT)  # outer batch on the last axis
    bias = rand.normal((M,), DT)
    f, r = ours("leaky_relu", "per_row", beta=2.0), theirs("leaky_relu", "per_row", beta=2.0)

    def nest(f):
        inner = jax.vmap(lambda a, b, c: f(a, b, bias, c), in_axes=(0, 1, None))
        return jax.vmap(inner, in_axes=(0, None, 2))

    got = nest(f)(a, b, c)
    close(got, nest(r)(a, b, c))
    for i in range(B):
        for j in range(B2):
            want, _ = np_gemm_bias_act(a[i, j], b[:, j], bias, act="leaky_relu", c=c[..., i], beta=2.0,
                                       bias_kind="per_row")  # fmt: skip
            assert_rel(got[i, j], want, DT)
    lf = lambda *x: jnp.sum(nest(f)(*x) ** 2)
    lr = lambda *x: jnp.sum(nest(r)(*x) ** 2)
    close(jax.grad(lf, argnums=(0, 1, 2))(a, b, c), jax.grad(lr, argnums=(0, 1, 2))(a, b, c))


def test_vmap_of_fwd_bwd_and_dense(x64, rand):
    a = rand.normal((B, M, K), DT)
    b, bias, c = rand.normal((K, N), DT), rand.normal((N,), DT), rand.normal((B, M, N), DT)
    kw = dict(act="gelu_erf", beta=0.5)
    y, z = jax.vmap(lambda a, c: rg.gemm_bias_act_fwd(a, b, bias, c=c, **kw))(a, c)
    ry, rz = R.gemm_bias_act(a, b, bias, c=c, bias_kind="per_col", return_z=True, **kw)
    close((y, z), (ry, rz), "vmap fwd")
    gy = rand.normal(y.shape, DT)
    got = jax.vmap(lambda a, gy, z, c: rg.gemm_bias_act_bwd(a, b, gy, z, bias, c, **kw), in_axes=(0, 0, 0, 0))(a, gy, z, c)
    want = jax.vmap(
        lambda a, gy, c: jax.vjp(lambda a, b, bias, c: R.gemm_bias_act(a, b, bias, c=c, bias_kind="per_col", **kw),
                                 a, b, bias, c)[1](gy)  # fmt: skip
    )(a, gy, c)
    close(got, want, "vmap bwd")
    x = rand.normal((B, 2, K), DT)
    close(jax.vmap(lambda x: rg.dense(x, b, bias, act="relu"))(x), R.dense(x, b, bias, act="relu"), "vmap dense")


# ---------------------------------------------------------------------------
# no broadcast of shared weights (lowered HLO)
# ---------------------------------------------------------------------------


def _count(text, target):
    return len(re.findall(rf'(@{target}\(|custom_call_target="{target}")', text))


def _no_materialized(text, shape):
    """No op produces an array of `shape` (the shared operand with the batch dim added)."""
    mlir = "tensor<" + "x".join(map(str, shape)) + "xf32>"
    hlo = "f32[" + ",".join(map(str, shape)) + "]"
    bad = [ln.strip()[:200] for ln in text.splitlines() if mlir in ln or hlo in ln]
    assert not bad, f"{shape} materialized:\n" + "\n".join(bad)


@pytest.mark.parametrize("trans", TRANS, ids=lambda t: f"ta{int(t[0])}tb{int(t[1])}")
@pytest.mark.parametrize("kind", ["per_col", "per_row", "scalar", "none"])
def test_vmap_shared_weights_not_materialized(rand, kind, trans):
    ta, tb = trans
    dt = jnp.float32
    a = rand.normal((B,) + ((K, M) if ta else (M, K)), dt)
    w = rand.normal((N, K) if tb else (K, N), dt)
    bias = None if kind == "none" else rand.normal({"per_col": (N,), "per_row": (M,), "scalar": ()}[kind], dt)
    c = rand.normal((B, M, N), dt)
    f = lambda a, w, bias, c: rg.gemm_bias_act(a, w, bias, act="relu", c=c, beta=0.5, trans_a=ta, trans_b=tb)
    vf = jax.vmap(f, in_axes=(0, None, None, 0))
    lowered = jax.jit(vf).lower(a, w, bias, c)
    text, compiled = lowered.as_text(), lowered.compile().as_text()
    wshape = (B,) + w.shape
    for t in (text, compiled):
        _no_materialized(t, wshape)
        if bias is not None and bias.ndim:
            _no_materialized(t, (B,) + bias.shape)
        assert _count(t, rg._targets.GEMM.name) == 1
    y = vf(a, w, bias, c)
    want = R.gemm_bias_act(a, w, bias, act="relu", c=c, beta=0.5, trans_a=ta, trans_b=tb,
                           bias_kind="per_col" if kind == "none" else kind)  # fmt: skip
    assert_rel(y, want, dt)

    # vmap over the weights with the input shared: no [B, M, K] copy of the input
    vf2 = jax.vmap(f, in_axes=(None, 0, None, None))
    ws = rand.normal((B,) + w.shape, dt)
    lowered = jax.jit(vf2).lower(a[0], ws, bias, c[0])
    for t in (lowered.as_text(), lowered.compile().as_text()):
        _no_materialized(t, (B,) + a.shape[1:])
        assert _count(t, rg._targets.GEMM.name) == 1


def test_grad_vmap_shared_weights_not_materialized(rand):
    """grad∘vmap over examples against shared weights: the weight gradient is reduced
    inside the GEMMs (no per-example [B, K, N] gradient, no broadcast weight)."""
    dt = jnp.float32
    a, w, bias = rand.normal((B, M, K), dt), rand.normal((K, N), dt), rand.normal((N,), dt)
    f = lambda a, w, bias: rg.gemm_bias_act(a, w, bias, act="gelu")
    loss = lambda a, w, bias: jnp.sum(jax.vmap(f, in_axes=(0, None, None))(a, w, bias) ** 2)
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(a, w, bias)
    for t in (lowered.as_text(), lowered.compile().as_text()):
        _no_materialized(t, (B, K, N))
        assert _count(t, rg._targets.GEMM.name) == 1 + 2 * PLAIN_GEMM_CALLS  # forward; dgrad, wgrad
    got = jax.grad(loss, argnums=(0, 1, 2))(a, w, bias)
    want = jax.grad(lambda a, w, bias: jnp.sum(R.gemm_bias_act(a, w, bias, act="gelu") ** 2), argnums=(0, 1, 2))(a, w, bias)
    close(got, want)


def test_caller_batch_shared_weights_not_materialized(rand):
    """Leading batch dims from the caller: a [B, M, K] against w [K, N] is read by stride."""
    dt = jnp.float32
    a, w, bias = rand.normal((2, B, M, K), dt), rand.normal((K, N), dt), rand.normal((M, 1), dt)
    lowered = jax.jit(lambda a, w, bias: rg.gemm_bias_act(a, w, bias, act="tanh")).lower(a, w, bias)
    for t in (lowered.as_text(), lowered.compile().as_text()):
        _no_materialized(t, (2, B, K, N))
        assert _count(t, rg._targets.GEMM.name) == 1


@pytest.mark.parametrize("mode", ["jvp", "linearize", "jacfwd"])
def test_forward_mode(x64, rand, mode):
    """Forward mode (more in test_compose), vs the reference."""
    a, b, bias, _ = rand.operands(M, N, K, DT, bias_shape=(N,))
    v = rand.normal(a.shape, DT)
    f = lambda a: rg.gemm_bias_act(a, b, bias, act="gelu")
    r = lambda a: R.gemm_bias_act(a, b, bias, act="gelu")
    if mode == "jvp":
        got, want = jax.jvp(f, (a,), (v,))[1], jax.jvp(r, (a,), (v,))[1]
    elif mode == "linearize":
        got, want = jax.linearize(f, a)[1](v), jax.linearize(r, a)[1](v)
    else:
        got, want = jax.jacfwd(f)(a), jax.jacfwd(r)(a)
    close(got, want, mode)


def test_jacrev(x64, rand):
    """Reverse-mode Jacobians work, vs the reference."""
    a, b, bias, _ = rand.operands(M, N, K, DT, bias_shape=(N,))
    f = lambda a, b: rg.gemm_bias_act(a, b, bias, act="gelu")
    r = lambda a, b: R.gemm_bias_act(a, b, bias, act="gelu")
    close(jax.jacrev(f, argnums=(0, 1))(a, b), jax.jacrev(r, argnums=(0, 1))(a, b), "jacrev")


# ---------------------------------------------------------------------------
# rg.autotune: runs a program once with CUDA graphs off (the tuner's timing run)
# ---------------------------------------------------------------------------


def test_autotune_runs_the_program(x64, rand):
    """A function, a jit of one with compiler options of its own (it would not
    nest in another jit that sets some), and a gradient: each result is the
    program's own."""
    a, b, bias, _ = rand.operands(M, N, K, DT, bias_shape=(N,))
    f = lambda a, b, bias: rg.gemm_bias_act(a, b, bias, act="gelu")
    jitted = jax.jit(f, compiler_options={"xla_gpu_graph_min_graph_size": 1})
    g = jax.grad(lambda b: jnp.sum(f(a, b, bias)))
    want = jax.jit(f)(a, b, bias)
    np.testing.assert_array_equal(f64(rg.autotune(f, a, b, bias)), f64(want))
    np.testing.assert_array_equal(f64(rg.autotune(jitted, a, b, bias)), f64(want))
    np.testing.assert_array_equal(f64(rg.autotune(g, b)), f64(jax.jit(g)(b)))
    assert isinstance(rg.tuned(), dict)
