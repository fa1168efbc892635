"""Gradients (docs/spec.md §1 backward, §4 residual policies, §5): jax.test_util.check_grads
(rev, x64) for every act x bias kind x save policy, order 2 for a subset;
alpha/beta/C, transposes and caller batch dims; the bias gradient of every
bias shape; gemm_bias_act_bwd vs jax.grad of the reference; gradients in
low-precision dtypes; what each save policy keeps; the split backward (XLA
drops the GEMMs whose results are unused)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ACTS,
    BIAS_KINDS,
    BIAS_VARIANT_LABELS,
    DTYPES,
    PLAIN_GEMM_CALLS,
    TRANS,
    Y_ACTS,
    assert_rel,
    bias_shape_of,
    f64,
    np_act_grad,
    np_gemm_bias_act,
)
from jax.test_util import check_grads

import jax_regemm as rg
from jax_regemm import reference as R

M, K, N = 3, 4, 5
KINKED = ("relu", "leaky_relu")
_KIND_SHAPE = {"none": None, "scalar": (), "per_row": (M,), "per_col": (N,)}


def saves_for(act):
    return ["z", "recompute", "auto"] + (["y"] if act in Y_ACTS else [])


def draw(rand, act, *, kind="per_col", with_c=True, trans=(False, False), alpha=1.0, beta=0.0, batch_a=(),
         batch_b=(), batch_c=(), m=M, n=N, k=K):  # fmt: skip
    """f64 operands (A, B, bias, C) with Z at least 0.02 away from the kinks of relu/leaky_relu."""
    shape = {"none": None, "scalar": (), "per_row": (m,), "per_col": (n,)}[kind]
    ta, tb = trans
    for _ in range(200):
        a, b, bias, c = rand.operands(
            m, n, k, jnp.float64, trans_a=ta, trans_b=tb, bias_shape=shape, with_c=with_c, batch_a=batch_a,
            batch_b=batch_b, batch_c=batch_c,
        )  # fmt: skip
        if act not in KINKED:
            return a, b, bias, c
        _, z = np_gemm_bias_act(a, b, bias, act="none", c=c, alpha=alpha, beta=beta, trans_a=ta, trans_b=tb,
                                bias_kind=kind)  # fmt: skip
        if np.min(np.abs(z)) > 0.02:
            return a, b, bias, c
    raise AssertionError("no draw with Z off the kink")


def args_of(*xs):
    return tuple(x for x in xs if x is not None)


def fn(act, kind, has_c, **kw):
    """f(a, b, [bias], [c]) -> Y, for check_grads."""

    def f(a, b, *rest):
        rest = list(rest)
        bias = rest.pop(0) if kind != "none" else None
        c = rest.pop(0) if has_c else None
        return rg.gemm_bias_act(a, b, bias, act=act, c=c, **kw)

    return f


# ---------------------------------------------------------------------------
# check_grads, order 1: every act x bias kind x save policy
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BIAS_KINDS)
@pytest.mark.parametrize("act", ACTS)
def test_check_grads_order1(x64, rand, act, kind):
    alpha, beta = rand.scalar(), rand.scalar()
    a, b, bias, c = draw(rand, act, kind=kind, alpha=alpha, beta=beta)
    for save in saves_for(act):
        f = fn(act, kind, True, alpha=alpha, beta=beta, save=save, leaky_slope=0.2)
        check_grads(f, args_of(a, b, bias, c), order=1, modes=["rev"])
    # and without C (alpha only)
    f = fn(act, kind, False, alpha=alpha, leaky_slope=0.2)
    check_grads(f, args_of(a, b, bias), order=1, modes=["rev"])


# ---------------------------------------------------------------------------
# check_grads, order 2 (grad of grad): a representative subset
# ---------------------------------------------------------------------------

_ORDER2 = [
    ("gelu", "z", "per_col"),
    ("gelu", "recompute", "per_row"),
    ("gelu", "auto", "scalar"),
    ("gelu_erf", "z", "per_row"),
    ("silu", "auto", "per_col"),
    ("silu", "recompute", "none"),
    ("tanh", "y", "per_row"),
    ("tanh", "z", "scalar"),
    ("sigmoid", "y", "per_col"),
    ("sigmoid", "recompute", "per_row"),
    ("relu", "y", "per_col"),
    ("leaky_relu", "z", "per_row"),
    ("none", "auto", "scalar"),
    ("none", "recompute", "per_col"),
]


@pytest.mark.parametrize("act,save,kind", _ORDER2)
def test_check_grads_order2(x64, rand, act, save, kind):
    a, b, bias, c = draw(rand, act, kind=kind, alpha=0.7, beta=-1.3)
    f = fn(act, kind, True, alpha=0.7, beta=-1.3, save=save)
    check_grads(f, args_of(a, b, bias, c), order=2, modes=["rev"])


@pytest.mark.parametrize("trans", TRANS, ids=lambda t: f"ta{int(t[0])}tb{int(t[1])}")
def test_check_grads_order2_transposed_batched(x64, rand, trans):
    a, b, bias, c = draw(rand, "gelu", kind="per_row", trans=trans, batch_a=(2,))
    f = fn("gelu", "per_row", True, beta=0.5, trans_a=trans[0], trans_b=trans[1], save="z")
    check_grads(f, (a, b, bias, c), order=2, modes=["rev"])


@pytest.mark.parametrize("act", ["tanh", "none", "relu"])
def test_check_grads_fwd_stash_both_outputs(x64, rand, act):
    """Differentiating through both outputs of gemm_bias_act_fwd (Y and Z), orders 1 and 2."""
    a, b, bias, c = draw(rand, act, kind="per_col")

    def f(a, b, bias, c):
        y, z = rg.gemm_bias_act_fwd(a, b, bias, act=act, c=c, beta=0.4)
        return y * jnp.sin(z)

    check_grads(f, (a, b, bias, c), order=2, modes=["rev"])
    g = jax.grad(lambda *x: jnp.sum(f(*x)), argnums=(0, 1, 2, 3))(a, b, bias, c)

    def fr(a, b, bias, c):
        y, z = R.gemm_bias_act(a, b, bias, act=act, c=c, beta=0.4, bias_kind="per_col", return_z=True)
        return y * jnp.sin(z)

    gr = jax.grad(lambda *x: jnp.sum(fr(*x)), argnums=(0, 1, 2, 3))(a, b, bias, c)
    for x, y in zip(g, gr):
        assert_rel(x, y, jnp.float64)


# ---------------------------------------------------------------------------
# alpha/beta/C, transposes, caller batch dims
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("trans", TRANS, ids=lambda t: f"ta{int(t[0])}tb{int(t[1])}")
@pytest.mark.parametrize("act", ["gelu", "leaky_relu", "sigmoid", "none"])
def test_check_grads_transposes_alpha_beta_c(x64, rand, act, trans):
    ta, tb = trans
    alpha, beta = rand.scalar(), rand.scalar()
    for kind in ("per_row", "per_col", "scalar"):
        a, b, bias, c = draw(rand, act, kind=kind, trans=trans, alpha=alpha, beta=beta)
        for save in ("z", "recompute") + (("y",) if act in Y_ACTS else ()):
            f = fn(act, kind, True, alpha=alpha, beta=beta, trans_a=ta, trans_b=tb, save=save)
            check_grads(f, (a, b, bias, c), order=1, modes=["rev"])


_BATCHES = [((2,), (), ()), ((), (2,), (2,)), ((2, 1), (3,), (1, 3)), ((2,), (2,), ())]


@pytest.mark.parametrize("ba,bb,bc", _BATCHES)
def test_check_grads_caller_batch(x64, rand, ba, bb, bc):
    """Broadcast batch dims: the gradient of a broadcast operand is summed back to its shape."""
    for act, kind, trans in (("silu", "per_col", (False, False)), ("tanh", "per_row", (True, True))):
        a, b, bias, c = draw(rand, act, kind=kind, trans=trans, batch_a=ba, batch_b=bb, batch_c=bc)
        f = fn(act, kind, True, beta=0.9, trans_a=trans[0], trans_b=trans[1])
        check_grads(f, (a, b, bias, c), order=1, modes=["rev"])
        g = jax.grad(lambda *x: jnp.sum(f(*x) ** 2), argnums=(0, 1, 2, 3))(a, b, bias, c)
        assert [x.shape for x in g] == [a.shape, b.shape, bias.shape, c.shape]


# ---------------------------------------------------------------------------
# the bias gradient, every bias shape
# ---------------------------------------------------------------------------


def _np_bias_sums(gz, kind):
    """[..., M, N] -> [..., L]: the canonical bias gradient, batch dims kept."""
    return {"per_col": lambda: gz.sum(-2), "per_row": lambda: gz.sum(-1), "scalar": lambda: gz.sum((-2, -1))[..., None]}[kind]()


def _np_bias_grad(gz, kind, shape):
    return _np_bias_sums(gz, kind).reshape(shape)


@pytest.mark.parametrize("bias", [v for v in BIAS_VARIANT_LABELS if v != "none"])
@pytest.mark.parametrize("act", ACTS)
def test_bias_grad_every_kind(x64, rand, act, bias):
    shape, kind = bias_shape_of(bias, M, N)
    a, b, bv, c = rand.operands(M, N, K, jnp.float64, bias_shape=shape, with_c=True)
    w = rand.normal((M, N), jnp.float64)  # a random cotangent
    want_fn = lambda bv: jnp.sum(w * R.gemm_bias_act(a, b, bv, act=act, c=c, beta=0.6, bias_kind=kind))
    want = jax.grad(want_fn)(bv)
    _, z = np_gemm_bias_act(a, b, bv, act=act, c=c, beta=0.6, bias_kind=kind)
    closed = _np_bias_grad(f64(w) * np_act_grad(act, z), kind, shape)
    for save in saves_for(act):
        g = jax.grad(lambda bv: jnp.sum(w * rg.gemm_bias_act(a, b, bv, act=act, c=c, beta=0.6, save=save)))(bv)
        assert g.shape == bv.shape and g.dtype == bv.dtype
        assert_rel(g, want, jnp.float64, what=f"vs reference save={save}")
        assert_rel(g, closed, jnp.float64, what=f"vs closed form save={save}")


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_bias_grad_sum_accuracy(rand, dtype):
    """reference.bias_grad, the bias gradient of every backward without a dact call (a layer with
    act none, rg.mlp's top layer), against float64 NumPy: every kind, rows that the GPU sums in
    two stages (2048; a batch of 1024; its two-stage sum is checked on every platform) and in one
    (1000). Each element within half a unit of the dtype plus f32's accumulation error; a 16-bit
    running sum of these rows misses that several times over."""
    dt = DTYPES[dtype]
    for shape in ((2048, 40), (3, 1024, 24), (1000, 16)):
        g = rand.normal(shape, dt, 1.0)
        g64 = np.asarray(g.astype(jnp.float32), np.float64)
        for kind in ("per_col", "per_row", "scalar"):
            want = _np_bias_sums(g64, kind)
            bound = float(jnp.finfo(dt).eps) / 2 * np.abs(want) + 1e-6 * _np_bias_sums(np.abs(g64), kind)
            ways = {"bias_grad": R.bias_grad}
            if R._stageable(g, kind):
                ways["two stages"] = R._bias_grad_two_stages
            assert R._stageable(g, kind) == (dt != jnp.float32 and kind != "per_row" and shape[-2] != 1000)
            for name, fn in ways.items():
                got = np.asarray(jax.jit(lambda g: fn(g, kind))(g).astype(jnp.float32), np.float64)
                assert got.shape == want.shape
                err = np.max(np.abs(got - want) / bound)
                assert np.all(np.abs(got - want) <= bound), f"{name} {kind} {shape}: {err:.2f}x the bound"


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_bias_grad_large_many_chunks(x64, rand, dtype):
    """Shapes large enough that the backward epilogue splits rows into several chunks
    (per-chunk partial bias sums, combined in order) and the GEMMs into several tiles."""
    dt = DTYPES[dtype]
    m, n, k = 700, 200, 48
    for kind, shape in (("per_col", (n,)), ("per_row", (m, 1)), ("scalar", ())):
        a, b, bias, c = rand.operands(m, n, k, dt, bias_shape=shape, with_c=True)
        w = rand.normal((m, n), dt)
        for save in ("z", "recompute"):
            loss = lambda *x: jnp.sum(w * rg.gemm_bias_act(x[0], x[1], x[2], act="gelu", c=x[3], beta=0.5, save=save))
            got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(a, b, bias, c)
            up = [x.astype(jnp.float64) for x in (a, b, bias, c)]
            ref = jax.grad(lambda *x: jnp.sum(w.astype(jnp.float64) * R.gemm_bias_act(
                x[0], x[1], x[2], act="gelu", c=x[3], beta=0.5, bias_kind=kind)), argnums=(0, 1, 2, 3))(*up)  # fmt: skip
            for name, g, r in zip("A B bias C".split(), got, ref):
                assert g.shape == r.shape
                assert_rel(g, r, dt, what=f"g{name} {kind} save={save}")


# ---------------------------------------------------------------------------
# gemm_bias_act_bwd vs jax.grad of the reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BIAS_KINDS)
@pytest.mark.parametrize("act", ACTS)
def test_explicit_bwd_matches_reference(x64, rand, act, kind):
    for ta, tb in TRANS:
        for has_c in (True, False):
            shape = _KIND_SHAPE[kind]
            a, b, bias, c = rand.operands(M, N, K, jnp.float64, trans_a=ta, trans_b=tb, bias_shape=shape,
                                          with_c=has_c)  # fmt: skip
            kw = dict(act=act, alpha=-0.8, beta=1.7, trans_a=ta, trans_b=tb)
            y, z = rg.gemm_bias_act_fwd(a, b, bias, c=c, **kw)
            gy = rand.normal(y.shape, jnp.float64)
            ga, gb, gbias, gc = rg.gemm_bias_act_bwd(a, b, gy, z, bias, c, **kw)
            ref_kind = "per_col" if kind == "none" else kind
            _, vjp = jax.vjp(lambda a, b, bias, c: R.gemm_bias_act(a, b, bias, c=c, bias_kind=ref_kind, **kw),
                             a, b, bias, c)  # fmt: skip
            ra, rb, rbias, rc = vjp(gy)
            assert_rel(ga, ra, jnp.float64, what="gA")
            assert_rel(gb, rb, jnp.float64, what="gB")
            assert ga.shape == a.shape and gb.shape == b.shape
            if bias is None:
                assert gbias is None
            else:
                assert gbias.shape == bias.shape
                assert_rel(gbias, rbias, jnp.float64, what="gBias")
            if c is None:
                assert gc is None
            else:
                assert gc.shape == c.shape
                assert_rel(gc, rc, jnp.float64, what="gC")
                np.testing.assert_allclose(f64(gc), 1.7 * f64(gy) * np_act_grad(act, f64(z)), rtol=1e-12, atol=1e-15)


def test_explicit_bwd_batched_under_jit(x64, rand):
    a, b, bias, c = rand.operands(M, N, K, jnp.float64, bias_shape=(1, N), with_c=True, batch_a=(2,), batch_c=(2,))
    kw = dict(act="gelu", beta=0.3)
    y, z = rg.gemm_bias_act_fwd(a, b, bias, c=c, **kw)
    gy = rand.normal(y.shape, jnp.float64)
    got = jax.jit(lambda *x: rg.gemm_bias_act_bwd(*x, **kw))(a, b, gy, z, bias, c)
    _, vjp = jax.vjp(lambda a, b, bias, c: R.gemm_bias_act(a, b, bias, c=c, bias_kind="per_col", **kw), a, b, bias, c)
    for g, r in zip(got, vjp(gy)):
        assert g.shape == r.shape
        assert_rel(g, r, jnp.float64)


# ---------------------------------------------------------------------------
# gradients in the working dtypes, vs float64
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("act", ACTS)
def test_grads_low_precision_vs_f64(x64, rand, act, dtype):
    """Gradients of every input in f32/bf16/f16 vs the float64 gradient of the same
    (rounded) inputs, within docs/spec.md §5's tolerance of the dtype."""
    dt = DTYPES[dtype]
    m, n, k = 12, 10, 24
    a, b, bias, c = draw(rand, act, kind="per_col", m=m, n=n, k=k)
    a, b, bias, c = (x.astype(dt) for x in (a, b, bias, c))
    w = rand.normal((m, n), dt)
    wrt = (0, 1, 2, 3)
    for save in saves_for(act):
        loss = lambda a, b, bias, c: jnp.sum(w * rg.gemm_bias_act(a, b, bias, act=act, c=c, beta=0.5, save=save))
        got = jax.grad(loss, argnums=wrt)(a, b, bias, c)
        up = [x.astype(jnp.float64) for x in (a, b, bias, c)]
        ref = jax.grad(
            lambda a, b, bias, c: jnp.sum(
                w.astype(jnp.float64) * R.gemm_bias_act(a, b, bias, act=act, c=c, beta=0.5, bias_kind="per_col")
            ),
            argnums=wrt,
        )(*up)
        for name, g, r in zip("A B bias C".split(), got, ref):
            assert g.dtype == dt
            assert_rel(g, r, dt, what=f"g{name} save={save}")


# ---------------------------------------------------------------------------
# residual policies (docs/spec.md §4) and the split backward (docs/spec.md §6)
# ---------------------------------------------------------------------------


def _calls(text, target):
    """The custom calls to `target` in lowered (StableHLO) or compiled (HLO) text."""
    return [ln for ln in text.splitlines() if re.search(rf'(@|custom_call_target="){target}\b', ln)]


def _fwd_gemm_calls(text):
    return [ln for ln in _calls(text, rg._targets.GEMM.name) if 'act = "none"' not in ln]


@pytest.mark.parametrize(
    "act,save,stores_z,from_y,fused",
    [
        ("relu", "y", False, True, 1),
        ("relu", "auto", False, True, 1),
        ("relu", "z", True, False, 1),
        ("relu", "recompute", False, False, 2),
        ("gelu", "auto", True, False, 1),
        ("gelu", "z", True, False, 1),
        ("gelu", "recompute", False, False, 2),
        ("tanh", "y", False, True, 1),
        ("sigmoid", "auto", False, True, 1),
    ],
)
def test_save_policy_residuals(rand, act, save, stores_z, from_y, fused):
    """What the forward keeps: "z" stores Z, "y" stores nothing beyond Y and takes act' from
    Y, "recompute" stores nothing and runs one more GEMM; "auto" is "y" where valid."""
    a, b, bias, _ = rand.operands(M, N, K, jnp.float32, bias_shape=(N,))
    loss = lambda a, b, bias: jnp.sum(rg.gemm_bias_act(a, b, bias, act=act, save=save) ** 2)  # Y itself is used
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(a, b, bias).as_text()
    fwd = _fwd_gemm_calls(text)
    assert len(fwd) == 1, fwd
    assert ("store_z = true" in fwd[0]) == stores_z
    dact = _calls(text, rg._targets.DACT.name)
    assert len(dact) == 1 and (f"from_y = {str(from_y).lower()}" in dact[0])
    # the fused GEMMs (the forward; recompute: Z again, with the bias), then dgrad and wgrad
    assert len(_calls(text, rg._targets.GEMM.name)) == fused + 2 * PLAIN_GEMM_CALLS
    # and the forward alone (no grad) never stores Z
    text = jax.jit(lambda a, b, bias: rg.gemm_bias_act(a, b, bias, act=act, save=save)).lower(a, b, bias).as_text()
    assert "store_z = false" in _calls(text, rg._targets.GEMM.name)[0]


def _compiled_gemms(f, argnums, *args):
    text = jax.jit(jax.grad(f, argnums=argnums)).lower(*args).compile().as_text()
    return len(_calls(text, rg._targets.GEMM.name)), len(_calls(text, rg._targets.DACT.name))


@pytest.mark.parametrize("save", ["z", "y", "recompute"])
@pytest.mark.parametrize("trans", TRANS, ids=lambda t: f"ta{int(t[0])}tb{int(t[1])}")
def test_backward_split_drops_unused(rand, trans, save):
    """The backward is separate custom calls: grad w.r.t. B alone compiles to no dgrad GEMM,
    grad w.r.t. A alone to no wgrad GEMM, grad w.r.t. the bias alone to no GEMM at all."""
    ta, tb = trans
    act = "relu" if save == "y" else "gelu"
    a, b, bias, c = rand.operands(M, N, K, jnp.float32, trans_a=ta, trans_b=tb, bias_shape=(M,), with_c=True)
    f = lambda a, b, bias, c: jnp.sum(rg.gemm_bias_act(a, b, bias, act=act, c=c, beta=0.5, trans_a=ta, trans_b=tb,
                                                       save=save) ** 2)  # fmt: skip
    fused = 2 if save == "recompute" else 1  # the forward; recompute: Z again, with the bias and C
    p = PLAIN_GEMM_CALLS  # per plain GEMM (dgrad, wgrad)
    assert _compiled_gemms(f, (0, 1), a, b, bias, c) == (fused + 2 * p, 1)
    assert _compiled_gemms(f, 1, a, b, bias, c) == (fused + p, 1)
    assert _compiled_gemms(f, 0, a, b, bias, c) == (fused + p, 1)
    assert _compiled_gemms(f, 2, a, b, bias, c) == (fused, 1)
    assert _compiled_gemms(f, 3, a, b, bias, c) == (fused, 1)
    # and the gradients are right
    got = jax.grad(f, argnums=(0, 1, 2, 3))(a, b, bias, c)
    fr = lambda a, b, bias, c: jnp.sum(R.gemm_bias_act(a, b, bias, act=act, c=c, beta=0.5, trans_a=ta, trans_b=tb,
                                                       bias_kind="per_row") ** 2)  # fmt: skip
    for g, r in zip(got, jax.grad(fr, argnums=(0, 1, 2, 3))(a, b, bias, c)):
        assert_rel(g, r, jnp.float32)


def _lowered_for_cuda(f, *args):
    """f's StableHLO as lowered for the CUDA platform (no GPU needed)."""
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_plain_gemms_are_xla_dots_on_cuda(rand, monkeypatch):
    """On the GPU a GEMM with nothing to fuse (the backward's dgrad and wgrad) lowers to XLA's
    own dot; the fused forward stays a regemm call. REGEMM_PLAIN_GEMM=regemm keeps every GEMM a
    regemm call. A weight shared by a vmapped batch stays one dot, never broadcast."""
    a, b, bias, _ = rand.operands(M, N, K, jnp.float32, bias_shape=(N,))
    loss = lambda a, b, bias: jnp.sum(rg.gemm_bias_act(a, b, bias, act="gelu") ** 2)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    text = _lowered_for_cuda(grad, a, b, bias)
    assert len(_calls(text, rg._targets.GEMM.name)) == 1 and text.count("stablehlo.dot_general") == 2, text
    assert len(_calls(text, rg._targets.DACT.name)) == 1
    # alpha != 1 and the transposes, as dots (the forward of act none without a bias or C)
    text = _lowered_for_cuda(lambda a, b: rg.gemm_bias_act(b, a, act="none", alpha=-2.0, trans_a=True, trans_b=True), a, b)
    assert not _calls(text, rg._targets.GEMM.name) and text.count("stablehlo.dot_general") == 1, text
    batched = rand.normal((3, M, K), jnp.float32)
    text = _lowered_for_cuda(lambda x: jax.grad(lambda b: jnp.sum(jax.vmap(lambda x: loss(x, b, bias))(x)))(b), batched)
    assert f"{3}x{K}x{N}" not in text and text.count("stablehlo.dot_general") == 1, text  # the wgrad over 3 x M rows
    monkeypatch.setenv("REGEMM_PLAIN_GEMM", "regemm")  # read at lowering: a new function, not a cached lowering
    text = _lowered_for_cuda(jax.grad(lambda *args: loss(*args), argnums=(0, 1, 2)), a, b, bias)
    assert len(_calls(text, rg._targets.GEMM.name)) == 3 and "stablehlo.dot_general" not in text
    # REGEMM_PLAIN_GEMM=xla: XLA's dots on the CPU too (there the default is regemm's GEMM)
    monkeypatch.setenv("REGEMM_PLAIN_GEMM", "xla")
    fresh = jax.grad(lambda *args: loss(*args), argnums=(0, 1, 2))
    text = jax.jit(fresh).trace(a, b, bias).lower(lowering_platforms=("cpu",)).as_text()
    assert len(_calls(text, rg._targets.GEMM.name)) == 1 and text.count("stablehlo.dot_general") == 2, text


def _layer_loss(a, b, bias):
    return jnp.sum(jnp.sin(rg.gemm_bias_act(a, b, bias, act="gelu")))


def _block_loss(x, ws, bs):
    return jnp.sum(jnp.sin(rg.mlp(x, ws, bs, act="silu", final_act="tanh")))


def _fresh_grad(f):
    """grad of f as a new function: a new lowering, which reads the lowering variables again."""
    return jax.grad(lambda *args: f(*args), argnums=(0, 1, 2))


def _regemm_calls(text):
    return sum(len(_calls(text, t)) for t in (rg._targets.GEMM.name, rg._targets.DACT.name, rg._targets.DGRAD_DACT.name))


def _check_xla_program_on_cpu(variable, fns, monkeypatch):
    """With `variable`=xla the CPU lowers each (loss, args)'s gradient to XLA's own program, no
    regemm call, and its values are the regemm calls' (both run here)."""
    want = [jax.jit(_fresh_grad(f))(*args) for f, args in fns]  # regemm's calls on the CPU
    monkeypatch.setenv(variable, "xla")
    for (f, args), w in zip(fns, want):
        g = _fresh_grad(f)
        assert _regemm_calls(jax.jit(g).trace(*args).lower(lowering_platforms=("cpu",)).as_text()) == 0
        for got, r in zip(jax.tree.leaves(jax.jit(g)(*args)), jax.tree.leaves(w)):
            assert_rel(got, r, jnp.float32)


def test_dact_on_xla_by_variable(rand, monkeypatch):
    """REGEMM_DACT=xla: the backward epilogue (dact, and rg.mlp's dgrad_dact) lowers to XLA's own
    program on every platform, with the same gradients as the regemm calls (run here)."""
    a, b, bias, _ = rand.operands(M, N, K, jnp.float32, bias_shape=(N,))
    ws = [rand.normal((K, 24), jnp.float32, 0.3), rand.normal((24, N), jnp.float32, 0.3)]
    bs = [rand.normal((24,), jnp.float32), rand.normal((N,), jnp.float32)]
    fns = [(_layer_loss, (a, b, bias)), (_block_loss, (a, ws, bs))]
    want = [jax.jit(_fresh_grad(f))(*args) for f, args in fns]  # the default: regemm's calls on the CPU
    monkeypatch.setenv("REGEMM_DACT", "xla")  # read at lowering: new functions below
    for (f, args), w in zip(fns, want):
        for platform in ("cpu", "cuda"):
            text = jax.jit(_fresh_grad(f)).trace(*args).lower(lowering_platforms=(platform,)).as_text()
            assert not _calls(text, rg._targets.DACT.name) and not _calls(text, rg._targets.DGRAD_DACT.name), platform
        for g, r in zip(jax.tree.leaves(jax.jit(_fresh_grad(f))(*args)), jax.tree.leaves(w)):
            assert_rel(g, r, jnp.float32)


def test_unaligned_ops_are_xla_programs_on_cuda(rand, monkeypatch):
    """On the GPU an op whose rows are not whole 16-byte vectors lowers to its reference, which
    XLA pads: no regemm call in the layer's forward or backward, nor in rg.mlp's, while an aligned
    layer keeps its calls. REGEMM_UNALIGNED=xla does the same on the CPU, with the gradients of
    the regemm calls (both run here); =regemm (the suite's setting) keeps every call."""
    monkeypatch.delenv("REGEMM_UNALIGNED", raising=False)  # the default, read at lowering
    layer, block, grad, regemm_calls = _layer_loss, _block_loss, _fresh_grad, _regemm_calls
    for dt, (m, n, k) in ((jnp.float32, (M, N, K)), (jnp.bfloat16, (16, 12, 16))):  # rows of N: unaligned
        a, b, bias, _ = rand.operands(m, n, k, dt, bias_shape=(n,))
        text = _lowered_for_cuda(grad(layer), a, b, bias)
        assert regemm_calls(text) == 0 and text.count("stablehlo.dot_general") == 3, (dt, m, n, k, text)
    a, b, bias, _ = rand.operands(16, 16, 12, jnp.bfloat16, bias_shape=(16,))  # rows of K only: the dact's are whole
    text = _lowered_for_cuda(grad(layer), a, b, bias)
    assert not _calls(text, rg._targets.GEMM.name) and len(_calls(text, rg._targets.DACT.name)) == 1, text
    a, b, bias, _ = rand.operands(3, 8, 4, jnp.float32, bias_shape=(8,))  # f32 rows of 4 and 8: aligned
    text = _lowered_for_cuda(grad(layer), a, b, bias)
    assert len(_calls(text, rg._targets.GEMM.name)) == 1 and len(_calls(text, rg._targets.DACT.name)) == 1, text
    x = rand.normal((M, K), jnp.float32)
    ws = [rand.normal((K, 6), jnp.float32, 0.3), rand.normal((6, N), jnp.float32, 0.3)]  # rows of 6 and 5
    bs = [rand.normal((6,), jnp.float32), rand.normal((N,), jnp.float32)]
    assert regemm_calls(_lowered_for_cuda(grad(block), x, ws, bs)) == 0
    fns = [(layer, rand.operands(M, N, K, jnp.float32, bias_shape=(N,))[:3]), (block, (x, ws, bs))]
    _check_xla_program_on_cpu("REGEMM_UNALIGNED", fns, monkeypatch)
    monkeypatch.setenv("REGEMM_UNALIGNED", "regemm")
    a, b, bias, _ = rand.operands(M, N, K, jnp.float32, bias_shape=(N,))
    text = _lowered_for_cuda(grad(layer), a, b, bias)
    assert len(_calls(text, rg._targets.GEMM.name)) == 1 and len(_calls(text, rg._targets.DACT.name)) == 1, text


def test_small_ops_are_xla_programs_on_cuda(rand, monkeypatch):
    """On the GPU an op with at most 512 rows of output or 2^21 elements (counted over its batch
    dims) lowers to XLA's own program: no regemm call in the layer's forward or backward, nor in
    rg.mlp's; past both (or 3 x 200 rows under vmap, or a symbolic batch) the calls stay. The CPU keeps its calls;
    REGEMM_SMALL=xla takes the CPU to XLA's program too, with the gradients of the regemm calls
    (both run here)."""
    monkeypatch.delenv("REGEMM_SMALL", raising=False)  # the default, read at lowering
    layer, block, grad, regemm_calls = _layer_loss, _block_loss, _fresh_grad, _regemm_calls
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    k = 64
    for m, n, calls in ((512, 8192, 0), (513, 4096, 2), (4096, 512, 0), (4097, 512, 2), (1, 8, 0)):
        text = _lowered_for_cuda(grad(layer), spec(m, k), spec(k, n), spec(n))
        assert regemm_calls(text) == calls, (m, n, text)
    # a batch of 3 x 200 rows under vmap: 600 rows of output, folded into one GEMM of 600 rows
    batched = lambda x, b, bias: jnp.sum(jax.vmap(lambda x: layer(x, b, bias))(x))
    assert regemm_calls(_lowered_for_cuda(grad(batched), spec(3, 200, k), spec(k, 4096), spec(4096))) == 2
    # a batch of weights (no fold): 3 GEMMs of 200 rows, one call of 600 rows of output
    per_weight = lambda x, b, bias: jnp.sum(jax.vmap(lambda x, b: layer(x, b, bias))(x, b))
    assert regemm_calls(_lowered_for_cuda(grad(per_weight), spec(3, 200, k), spec(3, k, 4096), spec(4096))) == 2
    # a symbolic batch (jax.export): its size is known at run time only, so the calls stay
    (rows,) = jax.export.symbolic_shape("B")
    export = jax.export.export(jax.jit(grad(layer)), platforms=("cuda",), disabled_checks=rg.disabled_export_checks())
    assert regemm_calls(export(spec(rows, k), spec(k, 8), spec(8)).mlir_module()) == 2
    ws, bs = [spec(k, 4096), spec(4096, 4096)], [spec(4096), spec(4096)]
    assert regemm_calls(_lowered_for_cuda(grad(block), spec(512, k), ws, bs)) == 0
    assert regemm_calls(_lowered_for_cuda(grad(block), spec(1024, k), ws, bs)) == 4  # 2 fwd, dact, dgrad_dact
    x = rand.normal((M, K), jnp.float32)
    ws = [rand.normal((K, 8), jnp.float32, 0.3), rand.normal((8, 4), jnp.float32, 0.3)]
    bs = [rand.normal((8,), jnp.float32), rand.normal((4,), jnp.float32)]
    fns = [(layer, rand.operands(M, 4, K, jnp.float32, bias_shape=(4,))[:3]), (block, (x, ws, bs))]
    for f, args in fns:  # the CPU keeps its calls
        assert regemm_calls(jax.jit(grad(f)).trace(*args).lower(lowering_platforms=("cpu",)).as_text()) > 0
    _check_xla_program_on_cpu("REGEMM_SMALL", fns, monkeypatch)


@pytest.mark.parametrize("save", ("auto", "recompute"))
@pytest.mark.parametrize("act", ("relu", "leaky_relu"))
def test_kinked_act_on_xla_program_is_the_plain_program(rand, act, save, monkeypatch):
    """A bf16 relu or leaky_relu layer lowered to XLA's own program (REGEMM_SMALL=xla here; by
    default the GPU's small, narrow and unaligned ops) is the program a user writes, with its
    numerics (docs/spec.md §1): the product in bf16 (no f32 product in the forward or the
    backward, where the reference's f32 products cost narrow MLPs 0.6 ms of a 1.4 ms step), act'
    decided on that Z, and the forward and gradients of sum(sin(y)) those of plain
    act(x @ w + b), to bf16's rounding of the few elements whose order of operations differs."""
    monkeypatch.setenv("REGEMM_SMALL", "xla")
    m, k, n = 64, 32, 48
    a, b, bias, _ = rand.operands(m, n, k, jnp.bfloat16, bias_shape=(n,))
    loss = lambda a, b, bias: jnp.sum(jnp.sin(rg.dense(a, b, bias, act=act, save=save)))
    g = _fresh_grad(loss)
    text = jax.jit(g).trace(a, b, bias).lower(lowering_platforms=("cpu",)).as_text()
    assert _regemm_calls(text) == 0
    assert not re.findall(r"dot_general.*-> tensor<\d+x\d+xf32>", text), text
    # leaky_relu as docs/spec.md §3 has it, act' = slope at z = 0 (jax.nn's is 1 there; in bf16 a few
    # z + b are exactly 0)
    act_fn = {"relu": jax.nn.relu, "leaky_relu": lambda z: jnp.where(z > 0, z, 0.01 * z)}[act]
    plain = lambda a, b, bias: jnp.sum(jnp.sin(act_fn(a @ b + bias)))
    y = jax.jit(lambda a, b, bias: rg.dense(a, b, bias, act=act, save=save))(a, b, bias)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(act_fn(a @ b + bias), np.float32))
    for got, w in zip(jax.jit(g)(a, b, bias), jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(a, b, bias)):
        assert got.dtype == jnp.bfloat16
        assert_rel(got, w.astype(jnp.float32), jnp.bfloat16, what=act)


@pytest.mark.parametrize("act", ("none", "relu"))
def test_16bit_inference_with_xla_epilogue_is_xla_program_on_cuda(rand, act, monkeypatch):
    """On the GPU a 16-bit forward outside a derivative whose epilogue XLA folds into its own GEMM
    (act none or relu, a per-column bias) lowers to XLA's program: no regemm call. An f32 one, one
    with another bias kind, a C or an alpha, one asked for Z, gelu, the forward of a gradient (its
    peak holds the residuals, and relu' is decided on Z rounded once: rg.mlp's layers too), and the
    Z a relu layer with save="recompute" recomputes keep their calls. REGEMM_XLA_EPILOGUE=xla does
    the same on the CPU, with the regemm calls' values (both run here)."""
    monkeypatch.delenv("REGEMM_XLA_EPILOGUE", raising=False)  # the default, read at lowering
    m, k, n = 1024, 64, 4096  # not small (_SMALL_ROWS, _SMALL_ELEMENTS)
    spec = lambda dt, *shape: jax.ShapeDtypeStruct(shape, dt)
    bf16 = jnp.bfloat16
    gemms = lambda f, *args: _calls(_lowered_for_cuda(f, *args), rg._targets.GEMM.name)

    def fwd_calls(dt, bias_shape, alpha=1.0, with_c=False, a=act):
        f = lambda x, w, bias, c: rg.gemm_bias_act(x, w, bias, c=c, alpha=alpha, beta=1.0, act=a)
        return len(gemms(f, spec(dt, m, k), spec(dt, k, n), spec(dt, *bias_shape), spec(dt, m, n) if with_c else None))

    assert fwd_calls(bf16, (n,)) == 0 and fwd_calls(jnp.float16, (n,)) == 0
    assert fwd_calls(jnp.float32, (n,)) == 1
    assert fwd_calls(bf16, (m, 1)) == 1  # per-row
    assert fwd_calls(bf16, (n,), alpha=0.5) == 1
    assert fwd_calls(bf16, (n,), with_c=True) == 1
    assert fwd_calls(bf16, (n,), a="gelu") == 1
    x, w, b = spec(bf16, m, k), spec(bf16, k, n), spec(bf16, n)
    with_z = lambda x, w, b: rg.gemm_bias_act_fwd(x, w, b, act=act, return_z=True)
    assert len(gemms(with_z, x, w, b)) == 1
    layer = lambda x, w, b: jnp.sum(jnp.sin(rg.dense(x, w, b, act=act)))
    assert len(gemms(jax.grad(layer, argnums=(0, 1, 2)), x, w, b)) == 1
    ws, bs = [spec(bf16, k, n), spec(bf16, n, n)], [spec(bf16, n), spec(bf16, n)]
    block = lambda x, ws, bs: rg.mlp(x, ws, bs, act="relu" if act == "relu" else "gelu")  # the top layer's: none
    assert len(gemms(block, x, ws, bs)) == (0 if act == "relu" else 1)
    assert len(gemms(jax.grad(lambda *a: jnp.sum(jnp.sin(block(*a))), argnums=(0, 1, 2)), x, ws, bs)) == 2
    recompute = lambda x, w, b: jnp.sum(jnp.sin(rg.dense(x, w, b, act="relu", save="recompute")))
    calls = gemms(jax.grad(recompute, argnums=(0, 1, 2)), x, w, b)
    assert len(calls) == 2 and sum('act = "none"' in ln for ln in calls) == 1, calls  # the forward, then Z again

    a, b, bias, _ = rand.operands(48, 40, 32, bf16, bias_shape=(40,))
    f = lambda a, b, bias: rg.dense(a, b, bias, act=act)
    want = jax.jit(lambda *x: f(*x))(a, b, bias)  # regemm's call on the CPU
    monkeypatch.setenv("REGEMM_XLA_EPILOGUE", "xla")
    g = jax.jit(lambda *x: f(*x))
    assert not _calls(g.trace(a, b, bias).lower(lowering_platforms=("cpu",)).as_text(), rg._targets.GEMM.name)
    up = lambda x: x.astype(jnp.float32)
    got = g(a, b, bias)
    assert got.dtype == bf16
    assert_rel(got, R.gemm_bias_act(up(a), up(b), up(bias), act=act, precision=jax.lax.Precision.HIGHEST), bf16)
    assert_rel(got, up(want), bf16, what="on XLA against the regemm call")


def test_plain_gemm_on_xla_matches_the_reference(rand):
    """The dot the CUDA lowering emits for a plain GEMM (alpha, transposes, f32 and bf16), run here."""
    from jax_regemm import _args, _programs

    for dt in (jnp.float32, jnp.bfloat16):
        for ta, tb in TRANS:
            a, b, _, _ = rand.operands(M, N, K, dt, trans_a=ta, trans_b=tb)
            for alpha in (1.0, -0.75):
                cfg = _args.Config(act="none", alpha=alpha, trans_a=ta, trans_b=tb)
                (y,) = jax.jit(lambda a, b: _programs.xla_gemm(a, b, cfg=cfg))(a, b)
                want, _ = np_gemm_bias_act(a, b, None, act="none", alpha=alpha, trans_a=ta, trans_b=tb)
                assert y.dtype == dt
                assert_rel(y, want, dt)


def test_backward_act_none_has_no_elementwise_pass(rand):
    """act none: act' = 1, so the backward is the two GEMMs (and a bias sum), no dact call."""
    a, b, bias, _ = rand.operands(M, N, K, jnp.float32, bias_shape=(N,))
    f = lambda a, b, bias: jnp.sum(jnp.cos(rg.gemm_bias_act(a, b, bias, act="none")))
    assert _compiled_gemms(f, (0, 1, 2), a, b, bias) == (1 + 2 * PLAIN_GEMM_CALLS, 0)
