"""Bad input (docs/spec.md §7): a TypeError/ValueError naming the argument and the shapes,
raised at trace time (eagerly, under jax.jit, under jax.eval_shape, which only
traces); handler-side failures come back as errors, never an abort. And
zero-sized dimensions, forward and gradients."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ACTS, DTYPES, assert_rel, assert_same_op, f64, np_gemm_bias_act

import jax_regemm as rg
from jax_regemm import reference as R

M, K, N = 3, 4, 5
F32 = jnp.float32


_RNG = np.random.default_rng(7)


def _arr(shape, dtype=F32):
    return jnp.asarray(_RNG.standard_normal(shape), dtype)


def raises_everywhere(exc, match, fn, *args):
    """`fn(*args)` raises exc(match) eagerly, inside jax.jit and under jax.eval_shape (trace time)."""
    with pytest.raises(exc, match=match):
        fn(*args)
    arrays = [isinstance(x, (jax.Array, np.ndarray)) for x in args]
    if all(arrays):  # everything traceable: the same error while tracing under jit
        with pytest.raises(exc, match=match):
            jax.jit(fn).lower(*args)
        with pytest.raises(exc, match=match):
            jax.eval_shape(fn, *args)


def gba(**kw):
    return lambda a, b, *rest: rg.gemm_bias_act(a, b, *rest, **kw)


# ---------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a_shape,b_shape,kw,match",
    [
        ((K,), (K, N), {}, r"a must have rank >= 2.*\(4,\)"),
        ((), (K, N), {}, r"a must have rank >= 2.*\(\)"),
        ((M, K), (K,), {}, r"b must have rank >= 2.*\(4,\)"),
        ((M, K), (K + 1, N), {}, r"contraction sizes differ: a \(3, 4\).*K=4, b \(5, 5\).*K=5"),
        ((K, M), (K, N), {}, r"contraction sizes differ: a \(4, 3\) \(trans_a=False\)"),
        ((M, K), (K, N), {"trans_a": True}, r"a \(3, 4\) \(trans_a=True\) has K=3"),
        ((M, K), (K, N), {"trans_b": True}, r"b \(4, 5\) \(trans_b=True\) has K=5"),
        ((2, M, K), (3, K, N), {}, r"batch dims do not broadcast: a \(2, 3, 4\), b \(3, 4, 5\)"),
    ],
)
def test_bad_operand_shapes(a_shape, b_shape, kw, match):
    raises_everywhere(ValueError, match, gba(**kw), _arr(a_shape), _arr(b_shape))


@pytest.mark.parametrize(
    "bias_shape,kind,match",
    [
        ((4,), None, r"bias of shape \(4,\) fits no bias kind for an output of \[3, 5\]"),
        ((M, N), None, r"bias of shape \(3, 5\) fits no bias kind"),
        ((N, 1), None, r"bias of shape \(5, 1\) fits no bias kind"),
        ((1, M), None, r"bias of shape \(1, 3\) fits no bias kind"),
        ((2,), None, r"fits no bias kind.*use \(\), \(1,\), \(3,\), \(3, 1\), \(5,\) or \(1, 5\)"),
        ((1, 1, N), None, r"bias must have rank <= 2, got shape \(1, 1, 5\)"),
        ((N,), "per_row", r"bias of shape \(5,\) does not fit bias_kind='per_row' for an output of \[3, 5\]"),
        ((M,), "per_col", r"bias of shape \(3,\) does not fit bias_kind='per_col'"),
        ((M,), "scalar", r"bias of shape \(3,\) does not fit bias_kind='scalar'"),
        ((M, 1), "per_col", r"does not fit bias_kind='per_col'"),
        ((N,), "per_elem", r"bias_kind must be one of .*'per_elem'"),
    ],
)
def test_bad_bias(bias_shape, kind, match):
    raises_everywhere(ValueError, match, gba(bias_kind=kind), _arr((M, K)), _arr((K, N)), _arr(bias_shape))


def test_bias_kind_without_bias():
    with pytest.raises(ValueError, match=r"bias_kind='per_col' given but bias is None"):
        rg.gemm_bias_act(_arr((M, K)), _arr((K, N)), bias_kind="per_col")


@pytest.mark.parametrize("c_shape", [(N, M), (M,), (M, N + 1), (1, N)])
def test_bad_c_shape(c_shape):
    f = lambda a, b, c: rg.gemm_bias_act(a, b, c=c, beta=1.0)
    raises_everywhere(ValueError, rf"c must have shape \[\.\.\., 3, 5\], got \({c_shape[0]},", f, _arr((M, K)), _arr((K, N)),
                      _arr(c_shape))  # fmt: skip


def test_bad_c_batch():
    f = lambda a, b, c: rg.gemm_bias_act(a, b, c=c, beta=1.0)
    raises_everywhere(ValueError, r"batch dims do not broadcast: a \(2, 3, 4\), b \(4, 5\), c \(3, 3, 5\)", f,
                      _arr((2, M, K)), _arr((K, N)), _arr((3, M, N)))  # fmt: skip


# ---------------------------------------------------------------------------
# dtypes, non-arrays
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "which,dtype",
    [("b", jnp.float16), ("b", jnp.bfloat16), ("bias", jnp.float16), ("c", jnp.bfloat16), ("b", jnp.float64)],
)
def test_mixed_dtypes(x64, which, dtype):
    ops = {"a": _arr((M, K)), "b": _arr((K, N)), "bias": _arr((N,)), "c": _arr((M, N))}
    ops[which] = ops[which].astype(dtype)
    f = lambda a, b, bias, c: rg.gemm_bias_act(a, b, bias, c=c)
    match = rf"{which} has dtype {jnp.dtype(dtype).name} but a has float32: mixed dtypes"
    raises_everywhere(TypeError, match, f, ops["a"], ops["b"], ops["bias"], ops["c"])


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.complex64, jnp.bool_, jnp.uint16])
@pytest.mark.parametrize("which", ["a", "b"])
def test_unsupported_dtype(which, dtype):
    a, b = _arr((M, K)), _arr((K, N))
    if which == "a":
        a = a.astype(dtype)
        b = b.astype(dtype)  # both: the error must be the dtype, not the mix
    else:
        b = b.astype(dtype)
    match = rf"{which}: unsupported dtype {jnp.dtype(dtype).name}" if which == "a" else rf"b(: unsupported dtype| has dtype) {jnp.dtype(dtype).name}"
    raises_everywhere(TypeError, match, gba(), a, b)


@pytest.mark.parametrize(
    "args,match",
    [
        (([[1.0, 2.0]], "B"), r"a must be an array, got list"),
        ((3.0, "B"), r"a must be an array, got float"),
        ((None, "B"), r"a must be an array, got NoneType"),
        (("A", "oops"), r"b must be an array, got str"),
        (("A", "B", [1.0] * N), r"bias must be an array, got list"),
        (("A", "B", 2.0), r"bias must be an array, got float"),
    ],
)
def test_non_array_inputs(args, match):
    sub = {"A": _arr((M, K)), "B": _arr((K, N))}
    args = [sub.get(x, x) if isinstance(x, str) and x in sub else x for x in args]
    with pytest.raises(TypeError, match=match):
        rg.gemm_bias_act(*args)


def test_non_array_c():
    with pytest.raises(TypeError, match=r"c must be an array, got list"):
        rg.gemm_bias_act(_arr((M, K)), _arr((K, N)), c=[[0.0] * N] * M)


# ---------------------------------------------------------------------------
# attributes: act, slope, save, alpha/beta
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("act", ["swish", "ReLU", "", None])
def test_unknown_act(act):
    raises_everywhere(ValueError, rf"unknown activation {re.escape(repr(act))}; expected one of", gba(act=act),
                      _arr((M, K)), _arr((K, N)))  # fmt: skip


@pytest.mark.parametrize("act", [a for a in ACTS if a not in ("none", "relu", "leaky_relu", "sigmoid", "tanh")])
def test_save_y_invalid_for_act(act):
    raises_everywhere(ValueError, rf"save='y' cannot derive act' from the output for act='{act}'", gba(act=act, save="y"),
                      _arr((M, K)), _arr((K, N)))  # fmt: skip


@pytest.mark.parametrize("slope", [0.0, -0.3])
def test_save_y_leaky_relu_needs_positive_slope(x64, slope):
    a, b = _arr((M, K), jnp.float64), _arr((K, N), jnp.float64)
    raises_everywhere(ValueError, r"save='y' cannot derive act' from the output for leaky_slope <= 0",
                      gba(act="leaky_relu", leaky_slope=slope, save="y"), a, b)  # fmt: skip
    # "auto" falls back to the Z stash, and is right
    loss = lambda a, b: jnp.sum(jnp.sin(rg.gemm_bias_act(a, b, act="leaky_relu", leaky_slope=slope)))
    ref = lambda a, b: jnp.sum(jnp.sin(R.gemm_bias_act(a, b, act="leaky_relu", leaky_slope=slope)))
    for g, r in zip(jax.grad(loss, argnums=(0, 1))(a, b), jax.grad(ref, argnums=(0, 1))(a, b)):
        assert_rel(g, r, jnp.float64)


@pytest.mark.parametrize("save", ["Z", "none", "", "stash", None])
def test_unknown_save_policy(save):
    raises_everywhere(ValueError, rf"save must be one of .*got {re.escape(repr(save))}", gba(save=save), _arr((M, K)),
                      _arr((K, N)))  # fmt: skip


@pytest.mark.parametrize("slope", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_slope(slope):
    raises_everywhere(ValueError, r"leaky_slope must be finite", gba(act="leaky_relu", leaky_slope=slope), _arr((M, K)),
                      _arr((K, N)))  # fmt: skip


@pytest.mark.parametrize("name", ["alpha", "beta", "leaky_slope"])
def test_traced_scalars_rejected(name):
    """alpha, beta and the slope are static attributes: a traced value is a TypeError at trace time."""
    a, b, c = _arr((M, K)), _arr((K, N)), _arr((M, N))
    f = lambda a, b, c, s: rg.gemm_bias_act(a, b, c=c, act="leaky_relu", **{name: s})
    with pytest.raises(TypeError, match=rf"{name} must be a Python number \(static\), got .*Tracer"):
        jax.jit(f).lower(a, b, c, 0.5)
    with pytest.raises(TypeError, match=rf"{name} must be a Python number \(static\), got ArrayImpl"):
        rg.gemm_bias_act(a, b, c=c, **{name: jnp.ones(3)})


@pytest.mark.parametrize("precision", ["bogus", "fp33", 3, ("highest",), (None, "highest", "highest")])
def test_invalid_precision(precision):
    """An invalid precision is a ValueError, as for jnp.dot (for every dtype)."""
    for dt in (F32, jnp.bfloat16):
        with pytest.raises(ValueError, match=r"precision"):
            rg.gemm_bias_act(_arr((M, K), dt), _arr((K, N), dt), precision=precision)
    with pytest.raises(ValueError):
        jnp.dot(_arr((M, K)), _arr((K, N)), precision=precision)


# ---------------------------------------------------------------------------
# the other entry points
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gy_shape,z_shape,dt,exc,match",
    [
        ((M, N + 1), (M, N), F32, ValueError, r"gy must have the output's shape \(3, 5\), got \(3, 6\)"),
        ((M, N), (M - 1, N), F32, ValueError, r"z must have the output's shape \(3, 5\), got \(2, 5\)"),
        ((2, M, N), (M, N), F32, ValueError, r"gy must have the output's shape \(3, 5\), got \(2, 3, 5\)"),
        ((M, N), (M, N), jnp.float16, TypeError, r"gy has dtype float16 but a has float32"),
    ],
)
def test_bwd_bad_gy_z(gy_shape, z_shape, dt, exc, match):
    f = lambda a, b, gy, z: rg.gemm_bias_act_bwd(a, b, gy, z, act="gelu")
    raises_everywhere(exc, match, f, _arr((M, K)), _arr((K, N)), _arr(gy_shape, dt), _arr(z_shape))


def test_bwd_bad_operands():
    f = lambda a, b, gy, z: rg.gemm_bias_act_bwd(a, b, gy, z, act="gelu")
    raises_everywhere(ValueError, r"contraction sizes differ", f, _arr((M, K)), _arr((K + 1, N)), _arr((M, N)), _arr((M, N)))
    with pytest.raises(TypeError, match=r"z must be an array, got list"):
        rg.gemm_bias_act_bwd(_arr((M, K)), _arr((K, N)), _arr((M, N)), [[0.0] * N] * M, act="gelu")
    with pytest.raises(ValueError, match=r"unknown activation 'elu'"):
        rg.gemm_bias_act_bwd(_arr((M, K)), _arr((K, N)), _arr((M, N)), _arr((M, N)), act="elu")


def test_fwd_bad_input():
    raises_everywhere(ValueError, r"bias of shape \(4,\) fits no bias kind", lambda a, b, bias: rg.gemm_bias_act_fwd(a, b, bias),
                      _arr((M, K)), _arr((K, N)), _arr((4,)))  # fmt: skip


def test_dense_bad_input():
    raises_everywhere(ValueError, r"x must have rank >= 1 \(\[\.\.\., K\]\), got shape \(\)", lambda x, w: rg.dense(x, w),
                      _arr(()), _arr((K, N)))  # fmt: skip
    raises_everywhere(ValueError, r"x \(2, 5\) has K=5 but w \(4, 5\) has K=4", lambda x, w: rg.dense(x, w),
                      _arr((2, K + 1)), _arr((K, N)))  # fmt: skip
    raises_everywhere(ValueError, r"b of shape \(4,\) does not fit bias_kind='per_col'", lambda x, w, b: rg.dense(x, w, b),
                      _arr((2, K)), _arr((K, N)), _arr((4,)))  # fmt: skip
    raises_everywhere(ValueError, r"unknown activation", lambda x, w: rg.dense(x, w, act="mish"), _arr((2, K)), _arr((K, N)))


# ---------------------------------------------------------------------------
# handler-side failures: an error with a message, never an abort
# ---------------------------------------------------------------------------


def _raw_gemm(a, b, bias, c, out_shape, **attrs):
    base = dict(act="relu", slope=np.float64(0.01), alpha=np.float64(1.0), beta=np.float64(0.0), trans_a=False,
                trans_b=False, bias_kind="none", has_c=False, store_z=False, exact_f32=False)  # fmt: skip
    base.update(attrs)
    y_t = jax.ShapeDtypeStruct(out_shape, a.dtype)
    z_t = jax.ShapeDtypeStruct((0, 0), a.dtype)
    return rg._ffi._call(rg._targets.GEMM, (y_t, z_t), a, b, bias, c, **base)  # the raw call, workspace added


@pytest.mark.parametrize(
    "case,match",
    [
        ("act", r"regemm: unknown activation 'bogus'"),
        ("kind", r"regemm: unknown bias kind 'diag'"),
        ("k", r"regemm: contraction sizes differ: A \[3, 4\], B \[5, 5\]"),
        ("bias", r"regemm: bias: shape \[4\] does not fit the problem"),
        ("y", r"regemm: Y: shape \[3, 6\] does not fit the problem"),
        ("dtype", r"regemm: B: element type differs"),
        ("int", r"regemm: A: unsupported element type"),
    ],
)
def test_handler_errors_are_errors(case, match):
    """The raw custom call with inconsistent operands: XLA reports the handler's error."""
    a, b, bias, c, out = _arr((M, K)), _arr((K, N)), jnp.zeros((0,), F32), jnp.zeros((0, 0), F32), (M, N)
    attrs = {}
    if case == "act":
        attrs["act"] = "bogus"
    elif case == "kind":
        attrs["bias_kind"] = "diag"
    elif case == "k":
        b = _arr((K + 1, N))
    elif case == "bias":
        bias, attrs["bias_kind"] = _arr((4,)), "per_col"
    elif case == "y":
        out = (M, N + 1)
    elif case == "dtype":
        b = b.astype(jnp.float16)
    elif case == "int":
        a, b, bias, c = (x.astype(jnp.int32) for x in (a, b, bias, c))
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(_raw_gemm(a, b, bias, c, out, **attrs))


def test_dact_handler_errors_are_errors():
    gy, s = _arr((M, N)), _arr((M, N + 1))
    call = lambda gy, s, **kw: rg._ffi._call(
        rg._targets.DACT, (jax.ShapeDtypeStruct(gy.shape, gy.dtype), jax.ShapeDtypeStruct((0,), gy.dtype)),
        gy, s, slope=np.float64(0.01), bias_kind="none", **kw)  # fmt: skip
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"regemm: Z/Y: shape \[3, 6\] does not fit"):
        jax.block_until_ready(call(gy, s, act="gelu", from_y=False))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"act' cannot be derived from Y for 'gelu'"):
        jax.block_until_ready(call(gy, _arr((M, N)), act="gelu", from_y=True))


# ---------------------------------------------------------------------------
# zero-sized dimensions
# ---------------------------------------------------------------------------

_ZERO = [(0, 5, 4), (3, 0, 4), (3, 5, 0), (0, 0, 0), (0, 5, 0), (1, 1, 0)]


@pytest.mark.parametrize("dtype", ["f32", "f64", "f16"])
@pytest.mark.parametrize("m,n,k", _ZERO)
def test_zero_sized_forward(x64, rand, m, n, k, dtype):
    """M, N or K = 0; K = 0 gives Y = act(beta C + bias) (docs/spec.md §7)."""
    dt = DTYPES[dtype]
    both = ((False, False), (True, True))
    for i, (kind, shape) in enumerate((("per_col", (n,)), ("per_row", (m, 1)), ("scalar", ()), ("none", None))):
        for ta, tb in both if dtype == "f32" else both[i % 2 : i % 2 + 1]:  # other dtypes: alternate
            a, b, bias, c = rand.operands(m, n, k, dt, trans_a=ta, trans_b=tb, bias_shape=shape, with_c=True)
            kw = dict(act="gelu", c=c, alpha=1.5, beta=-0.7, trans_a=ta, trans_b=tb,
                      bias_kind=kind if kind != "none" else None)  # fmt: skip
            y, z = rg.gemm_bias_act_fwd(a, b, bias, **kw)
            want_y, want_z = np_gemm_bias_act(a, b, bias, act="gelu", c=c, alpha=1.5, beta=-0.7, trans_a=ta,
                                              trans_b=tb, bias_kind=kind)  # fmt: skip
            assert y.shape == z.shape == (m, n) and y.dtype == dt
            if m * n:
                assert np.all(np.isfinite(f64(y)))
                assert_rel(y, want_y, dt, what=f"{kind} Y")
                assert_rel(z, want_z, dt, what=f"{kind} Z")
            y_only = rg.gemm_bias_act(a, b, bias, **kw)
            assert_same_op(y_only, y, dt, what=f"{kind} Y without Z")
            np.testing.assert_array_equal(f64(jax.jit(lambda *x: rg.gemm_bias_act(*x, **kw))(a, b, bias)), f64(y_only))


def test_k_zero_is_act_of_beta_c_plus_bias(x64, rand):
    a, b = jnp.zeros((M, 0)), jnp.zeros((0, N))
    c, bias = rand.normal((M, N), jnp.float64), rand.normal((M, 1), jnp.float64)
    for act in ACTS:
        y = rg.gemm_bias_act(a, b, bias, act=act, c=c, beta=2.5)
        want, _ = np_gemm_bias_act(jnp.zeros((M, 1)), jnp.zeros((1, N)), bias, act=act, c=c, beta=2.5,
                                   bias_kind="per_row")  # fmt: skip
        assert_rel(y, want, jnp.float64, what=act)


@pytest.mark.parametrize("save", ["z", "y", "recompute"])
@pytest.mark.parametrize("m,n,k", _ZERO)
def test_zero_sized_grads(x64, rand, m, n, k, save):
    """Gradients with zero-sized dims: shapes right, values equal to the reference's
    (e.g. K = 0: gA, gB empty, gBias and gC from act'(beta C + bias))."""
    act = "tanh" if save == "y" else "silu"
    for kind, shape in (("per_col", (n,)), ("per_row", (m,)), ("scalar", (1,))):
        a, b, bias, c = rand.operands(m, n, k, jnp.float64, bias_shape=shape, with_c=True)
        kw = dict(act=act, c=c, beta=0.9, alpha=1.2)
        loss = lambda a, b, bias, c: jnp.sum(jnp.sin(rg.gemm_bias_act(a, b, bias, bias_kind=kind, save=save,
                                                                      **{**kw, "c": c})))  # fmt: skip
        ref = lambda a, b, bias, c: jnp.sum(jnp.sin(R.gemm_bias_act(a, b, bias, bias_kind=kind, **{**kw, "c": c})))
        got = jax.grad(loss, argnums=(0, 1, 2, 3))(a, b, bias, c)
        want = jax.grad(ref, argnums=(0, 1, 2, 3))(a, b, bias, c)
        for name, g, w in zip("A B bias C".split(), got, want):
            assert g.shape == w.shape, (name, g.shape, w.shape)
            assert np.all(np.isfinite(f64(g)))
            if g.size:
                np.testing.assert_allclose(f64(g), f64(w), rtol=1e-12, atol=1e-14, err_msg=f"g{name} {kind}")
        jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(a, b, bias, c)
        for g, w in zip(jitted, got):
            np.testing.assert_array_equal(f64(g), f64(w))


def test_zero_sized_batch(x64, rand):
    """A zero-sized batch dim (from the caller and from vmap)."""
    a, b, bias, c = rand.operands(M, N, K, jnp.float64, bias_shape=(N,), with_c=True, batch_a=(0,), batch_c=(0,))
    y = rg.gemm_bias_act(a, b, bias, c=c, beta=1.0, act="relu")
    assert y.shape == (0, M, N)
    y = jax.vmap(lambda a, c: rg.gemm_bias_act(a, b, bias, c=c, beta=1.0, act="relu"))(a, c)
    assert y.shape == (0, M, N)
    g = jax.grad(lambda b, bias: jnp.sum(rg.gemm_bias_act(a, b, bias, c=c, beta=1.0, act="gelu") ** 2), argnums=(0, 1))(b, bias)
    np.testing.assert_array_equal(f64(g[0]), 0.0)
    np.testing.assert_array_equal(f64(g[1]), 0.0)


def test_zero_sized_rows_under_vmap(x64, rand):
    """vmap over examples with M = 0 rows each (the batch folds into M = B * 0)."""
    a, b, bias, c = rand.operands(0, N, K, jnp.float64, bias_shape=(N,), with_c=True, batch_a=(3,), batch_c=(3,))
    f = lambda a, c: rg.gemm_bias_act(a, b, bias, c=c, beta=1.0, act="gelu")
    assert jax.vmap(f)(a, c).shape == (3, 0, N)
    g = jax.grad(lambda b, bias: jnp.sum(jax.vmap(lambda a, c: rg.gemm_bias_act(a, b, bias, c=c, beta=1.0, act="gelu"))(a, c)),
                 argnums=(0, 1))(b, bias)  # fmt: skip
    assert g[0].shape == b.shape and g[1].shape == bias.shape
    np.testing.assert_array_equal(f64(g[0]), 0.0)


# ---------------------------------------------------------------------------
# errors in the user's words, and inputs as plain jnp takes them
# ---------------------------------------------------------------------------


def test_dense_names_the_shape_as_passed():
    """x's leading dims fold into M; the error shows x as the user passed it, not the folded [M, K]."""
    raises_everywhere(ValueError, r"x \(2, 3, 5\) has K=5 but w \(6, 4\) has K=6", lambda x, w: rg.dense(x, w),
                      _arr((2, 3, 5)), _arr((6, 4)))  # fmt: skip


@pytest.mark.parametrize("flag", ["trans_a", "trans_b"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_trans_flags_must_be_bool(flag, value):
    """A string's truth says nothing about the user's intent: trans_a="no" is an error, not True."""
    raises_everywhere(TypeError, rf"{flag} must be True or False", gba(**{flag: value}), _arr((M, K)), _arr((K, N)))


def test_mlp_names_its_activation_arguments():
    x, ws = _arr((2, K)), [_arr((K, N)), _arr((N, 3))]
    with pytest.raises(ValueError, match=r"final_act: unknown activation 'softmax'"):
        rg.mlp(x, ws, final_act="softmax")
    with pytest.raises(ValueError, match=r"^act: unknown activation 'mish'"):
        rg.mlp(x, ws, act="mish")


@pytest.mark.parametrize("weights", [None, 3, "w"])
def test_mlp_weights_must_be_a_sequence(weights):
    with pytest.raises(TypeError, match=r"weights must be a list or tuple"):
        rg.mlp(_arr((2, K)), weights)


def test_mlp_biases_must_be_a_sequence():
    with pytest.raises(TypeError, match=r"biases must be a list or tuple"):
        rg.mlp(_arr((2, K)), [_arr((K, N))], biases=_arr((N,)))


def test_dense_and_mlp_with_k_zero(rand):
    """K = 0: Y = act(bias) for every row, as plain jnp gives (docs/spec.md §7)."""
    x, w, b = jnp.zeros((2, 3, 0)), jnp.zeros((0, N)), rand.normal((N,), F32)
    want = np.broadcast_to(f64(jax.nn.gelu(b)), (2, 3, N))
    np.testing.assert_allclose(f64(rg.dense(x, w, b, act="gelu")), want, rtol=1e-6)
    w2 = rand.normal((N, 3), F32)
    y = rg.mlp(x, [w, w2], [b, None], act="gelu")
    np.testing.assert_allclose(f64(y), f64(jax.nn.gelu(b)[None, None] @ w2 + 0 * y), rtol=1e-5, atol=1e-6)
    assert y.shape == (2, 3, 3)
    g = jax.grad(lambda b: jnp.sum(rg.dense(x, w, b, act="gelu") ** 2))(b)
    want_g = jax.grad(lambda b: jnp.sum(jnp.broadcast_to(jax.nn.gelu(b), (2, 3, N)) ** 2))(b)
    np.testing.assert_allclose(f64(g), f64(want_g), rtol=1e-5)


def test_numpy_float64_inputs_as_jnp_takes_them(rand):
    """With x64 off, JAX reads a float64 NumPy array as float32: so do dense, mlp and their gradients."""
    assert not jax.config.jax_enable_x64
    x64_np = np.asarray(rand.normal((4, K), F32), np.float64)
    w, b = rand.normal((K, N), F32), rand.normal((N,), F32)
    plain = lambda x, w, b: jax.nn.relu(jnp.asarray(x) @ w + b)
    assert_rel(rg.dense(x64_np, w, b, act="relu"), plain(x64_np, w, b), F32)
    assert_rel(rg.mlp(x64_np, [np.asarray(w, np.float64)], [b], final_act="relu"), plain(x64_np, w, b), F32)
    g = jax.grad(lambda w: jnp.sum(rg.dense(x64_np, w, b, act="relu")))(w)
    assert_rel(g, jax.grad(lambda w: jnp.sum(plain(x64_np, w, b)))(w), F32)


def test_equinox_linear_errors_name_its_fields():
    eqx = pytest.importorskip("equinox")
    from jax_regemm.equinox import Linear

    layer = Linear(K, N, activation="relu", key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 4\] \(in_features\), got shape \(\)"):
        layer(jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"x \(3,\) has K=3 but weight \(5, 4\) has K=4: weight must be \[N, K\]"):
        layer(_arr((3,)))
    assert eqx is not None


@pytest.mark.parametrize("route", ["auto", "xla"])
def test_alpha_zero_and_beta_zero_read_nothing(monkeypatch, rand, route):
    """alpha = 0 reads no product and beta = 0 no C, as BLAS (docs/spec.md §2): a NaN there stays out of
    Y, on regemm's call and on XLA's program alike."""
    monkeypatch.setenv("REGEMM_SMALL", route)
    a, b = rand.normal((M, K), F32), rand.normal((K, N), F32)
    c, bias = rand.normal((M, N), F32), rand.normal((N,), F32)
    nan_a = a.at[1, 2].set(jnp.nan)
    nan_c = c.at[0, 0].set(jnp.nan)
    y = jax.jit(lambda a, c: rg.gemm_bias_act(a, b, bias, act="tanh", c=c, alpha=0.0, beta=2.0))(nan_a, c)
    assert_rel(y, jnp.tanh(2.0 * c + bias), F32)
    y = jax.jit(lambda a, c: rg.gemm_bias_act(a, b, bias, act="tanh", c=c, alpha=1.5, beta=0.0))(a, nan_c)
    assert_rel(y, jnp.tanh(1.5 * (a @ b) + bias), F32)
    want = R.gemm_bias_act(nan_a, b, bias, act="tanh", c=nan_c, alpha=0.0, beta=0.0, bias_kind="per_col")
    assert_rel(want, jnp.broadcast_to(jnp.tanh(bias), (M, N)), F32)


# ---------------------------------------------------------------------------
# dense's errors, in its words
# ---------------------------------------------------------------------------

_CM, _CK, _CN = 6, 5, 4  # the shapes these messages name


def test_dense_errors_name_x_w_b(rand):
    x, w = rand.normal((_CM, _CK)), rand.normal((_CK, _CN))
    with pytest.raises(ValueError, match=r"w must have rank 2 \(\[K, N\]\), got shape \(2, 5, 4\)"):
        rg.dense(x, rand.normal((2, _CK, _CN)))
    with pytest.raises(TypeError, match="x must be an array, got list"):
        rg.dense([[1.0] * _CK], w)
    with pytest.raises(ValueError, match=r"x \(6, 5\) has K=5 but w \(4, 4\) has K=4"):
        rg.dense(x, rand.normal((_CN, _CN)))
    with pytest.raises(ValueError, match=r"b of shape \(3,\) does not fit"):
        rg.dense(x, w, rand.normal((3,)))
    with pytest.raises(TypeError, match="b has dtype float16 but x has float32"):
        rg.dense(x, w, rand.normal((_CN,), jnp.float16))


@pytest.mark.parametrize("name", ["alpha", "beta", "leaky_slope"])
@pytest.mark.parametrize("value,err", [(float("nan"), ValueError), (float("inf"), ValueError), ("2", TypeError),
                                       (True, TypeError), (jnp.float32(2.0), TypeError)])  # fmt: skip
def test_scalars_must_be_finite_numbers(rand, name, value, err):
    a, b, _, c = rand.operands(_CM, _CN, _CK, jnp.float32, with_c=True)
    with pytest.raises(err, match=name):
        rg.gemm_bias_act(a, b, c=c, act="leaky_relu", **{name: value})
