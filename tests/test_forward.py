"""Forward (docs/spec.md §1, §2, §5): the fused op and jax_regemm.reference against the
float64 NumPy reference of conftest, for every activation x bias shape x dtype x
transpose, with alpha/beta/C; bias-kind inference; caller batch dims with
broadcasting; dense; the Z stash (Y == act(Z)); precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ACTS,
    BIAS_VARIANT_LABELS,
    DTYPES,
    TRANS,
    assert_rel,
    assert_same_op,
    bias_shape_of,
    f64,
    infer_kind,
    np_act,
    np_gemm_bias_act,
    on_cpu,
    tol,
)

import jax_regemm as rg
from jax_regemm import _args
from jax_regemm import reference as R

M, K, N = 5, 7, 6  # odd and distinct: per-row and per-col biases cannot be confused


def _t(x, trans):
    return jnp.swapaxes(x, -1, -2) if trans else x


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bias", BIAS_VARIANT_LABELS)
@pytest.mark.parametrize("act", ACTS)
def test_forward_matrix(rand, x64, act, bias, dtype):
    """Every act x bias shape x dtype, each with the four transposes (with C, alpha,
    beta) and the plain call (no C, alpha 1), in one jitted program; and the
    reference module on the same inputs."""
    dt = DTYPES[dtype]
    bshape, kind = bias_shape_of(bias, M, N)
    a, b, bv, c = rand.operands(M, N, K, dt, bias_shape=bshape, with_c=True)
    alpha, beta, slope = rand.scalar(), rand.scalar(), 0.1

    def f(a, b, bv, c):
        outs = [rg.gemm_bias_act(a, b, bv, act=act, leaky_slope=slope)]
        for ta, tb in TRANS:
            outs.append(
                rg.gemm_bias_act(
                    _t(a, ta), _t(b, tb), bv, act=act, leaky_slope=slope, c=c, alpha=alpha, beta=beta,
                    trans_a=ta, trans_b=tb,
                )  # fmt: skip
            )
        return outs

    outs = jax.jit(f)(a, b, bv, c)
    want0, _ = np_gemm_bias_act(a, b, bv, act=act, slope=slope, bias_kind=kind)
    want, _ = np_gemm_bias_act(a, b, bv, act=act, slope=slope, c=c, alpha=alpha, beta=beta, bias_kind=kind)
    assert all(o.shape == (M, N) and o.dtype == dt for o in outs)
    assert_rel(outs[0], want0, dt, what="no C")
    for (ta, tb), o in zip(TRANS, outs[1:]):
        assert_rel(o, want, dt, what=f"trans_a={ta} trans_b={tb}")

    # jax_regemm.reference (explicit bias kind) on the same inputs, transposes included
    ref_kind = "per_col" if kind == "none" else kind
    assert_rel(R.gemm_bias_act(a, b, bv, act=act, leaky_slope=slope, bias_kind=ref_kind), want0, dt, what="reference")
    ta, tb = TRANS[int(rand.gen.integers(1, 4))]
    r = R.gemm_bias_act(
        _t(a, ta), _t(b, tb), bv, act=act, leaky_slope=slope, c=c, alpha=alpha, beta=beta, trans_a=ta, trans_b=tb,
        bias_kind=ref_kind,
    )  # fmt: skip
    assert r.dtype == dt
    assert_rel(r, want, dt, what=f"reference trans_a={ta} trans_b={tb}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_stash_y_equals_act_z(rand, x64, dtype):
    """gemm_bias_act_fwd: Z is the pre-activation (vs the float64 reference), and
    Y == act(Z) for every activation, Z the stash itself (Y is act of the f32/f64
    accumulator, Z its rounding: in 16-bit types they agree to the dtype's rounding)."""
    dt = DTYPES[dtype]
    a, b, bv, c = rand.operands(M, N, K, dt, bias_shape=(M, 1), with_c=True)
    for act in ACTS:
        y, z = rg.gemm_bias_act_fwd(a, b, bv, act=act, c=c, alpha=0.5, beta=2.0)
        want_y, want_z = np_gemm_bias_act(a, b, bv, act=act, c=c, alpha=0.5, beta=2.0, bias_kind="per_row")
        assert y.dtype == z.dtype == dt and y.shape == z.shape == (M, N)
        assert_rel(z, want_z, dt, what=f"Z {act}")
        assert_rel(y, want_y, dt, what=f"Y {act}")
        if dt in (jnp.float32, jnp.float64):
            # pointwise: act evaluated in the accumulator type (test_activations' tolerance); an
            # accelerator at default f32 precision (TF32) may use approximate math: the contract's TF32 bound
            rtol = 1e-12 if dt == jnp.float64 else 2e-5 if on_cpu() else tol(dt)
            np.testing.assert_allclose(f64(y), np_act(act, f64(z)), rtol=rtol, atol=1e-30, err_msg=act)
        else:
            assert_rel(y, np_act(act, f64(z)), dt, what=f"Y vs act(Z) {act}")
        y_only = rg.gemm_bias_act_fwd(a, b, bv, act=act, c=c, alpha=0.5, beta=2.0, return_z=False)
        assert_same_op(y_only, y, dt, what=f"Y without Z {act}")
        np.testing.assert_array_equal(f64(rg.gemm_bias_act(a, b, bv, act=act, c=c, alpha=0.5, beta=2.0)), f64(y_only))
        ry, rz = R.gemm_bias_act(a, b, bv, act=act, c=c, alpha=0.5, beta=2.0, bias_kind="per_row", return_z=True)
        assert_rel(rz, want_z, dt, what=f"reference Z {act}")
        assert_rel(ry, want_y, dt, what=f"reference Y {act}")


# ---------------------------------------------------------------------------
# bias-kind inference (docs/spec.md §2)
# ---------------------------------------------------------------------------

_INFER_CASES = [
    # (m, n, bias shape, explicit bias_kind, expected kind)
    (4, 4, (4,), None, "per_col"),  # length M == N: per-col unless told
    (4, 4, (4,), "per_row", "per_row"),
    (4, 4, (4,), "per_col", "per_col"),
    (4, 4, (4, 1), None, "per_row"),
    (4, 4, (1, 4), None, "per_col"),
    (4, 4, (), None, "scalar"),
    (4, 4, (1,), None, "scalar"),
    (3, 5, (3,), None, "per_row"),
    (3, 5, (5,), None, "per_col"),
    (3, 5, (1,), "scalar", "scalar"),
    (3, 5, (), "scalar", "scalar"),
    (1, 5, (1,), None, "scalar"),  # M == 1: (1,) is still a scalar
    (1, 5, (1,), "per_row", "per_row"),
    (1, 5, (1, 1), None, "per_row"),
    (3, 1, (1,), None, "per_col"),  # N == 1: (1,) is per-col (same numbers as scalar)
    (3, 1, (1,), "scalar", "scalar"),
    (3, 1, (3,), None, "per_row"),
    (1, 1, (1,), None, "per_col"),
    (1, 1, (1, 1), "per_row", "per_row"),
]


@pytest.mark.parametrize("m,n,shape,given,expected", _INFER_CASES)
def test_bias_kind_inference(rand, x64, m, n, shape, given, expected):
    assert _args.infer_bias_kind(shape, m, n, given) == expected
    if given is None:
        assert infer_kind(shape, m, n) == expected
    dt = jnp.float64
    a, b, bv, _ = rand.operands(m, n, 3, dt, bias_shape=shape)
    y = rg.gemm_bias_act(a, b, bv, act="tanh", bias_kind=given)
    want, _ = np_gemm_bias_act(a, b, bv, act="tanh", bias_kind=expected)
    assert_rel(y, want, dt, what=f"{shape} -> {expected}")
    g = jax.grad(lambda bv: jnp.sum(jnp.sin(rg.gemm_bias_act(a, b, bv, act="tanh", bias_kind=given))))(bv)
    assert g.shape == bv.shape


def test_m_equals_n_per_row_differs_from_per_col(rand, x64):
    """The M == N rule matters: the two readings give different outputs."""
    a, b, bv, _ = rand.operands(4, 4, 3, jnp.float64, bias_shape=(4,))
    col = rg.gemm_bias_act(a, b, bv, act="none")
    row = rg.gemm_bias_act(a, b, bv, act="none", bias_kind="per_row")
    assert_rel(col, np_gemm_bias_act(a, b, bv, act="none", bias_kind="per_col")[0], jnp.float64)
    assert_rel(row, np_gemm_bias_act(a, b, bv, act="none", bias_kind="per_row")[0], jnp.float64)
    assert rel_gap(col, row) > 1e-3


def rel_gap(x, y):
    return float(np.linalg.norm(f64(x) - f64(y)) / np.linalg.norm(f64(y)))


# ---------------------------------------------------------------------------
# leading batch dims from the caller (docs/spec.md §2)
# ---------------------------------------------------------------------------

_BATCH_CASES = [
    # (batch of A, batch of B, batch of C or None)
    ((3,), (), None),
    ((), (3,), None),
    ((3,), (3,), (3,)),
    ((2, 1), (3,), (2, 3)),
    ((2, 1), (1, 3), ()),
    ((2, 3), (), (1, 3)),
    ((1,), (4,), (4,)),
    ((2, 1, 2), (3, 1), (1,)),
]


@pytest.mark.parametrize("trans", TRANS, ids=lambda t: f"ta{int(t[0])}tb{int(t[1])}")
@pytest.mark.parametrize("ba,bb,bc", _BATCH_CASES)
def test_caller_batch_dims(rand, x64, ba, bb, bc, trans):
    ta, tb = trans
    dt = jnp.float32
    for kind_shape, kind in (((M, 1), "per_row"), ((N,), "per_col"), ((), "scalar")):
        a, b, bv, c = rand.operands(
            M, N, K, dt, trans_a=ta, trans_b=tb, bias_shape=kind_shape, with_c=bc is not None, batch_a=ba,
            batch_b=bb, batch_c=bc or (),
        )  # fmt: skip
        kw = dict(act="silu", c=c, alpha=0.8, beta=-1.5, trans_a=ta, trans_b=tb)
        y = rg.gemm_bias_act(a, b, bv, **kw)
        want, want_z = np_gemm_bias_act(a, b, bv, act="silu", c=c, alpha=0.8, beta=-1.5, trans_a=ta, trans_b=tb,
                                         bias_kind=kind)  # fmt: skip
        assert y.shape == want.shape, (y.shape, want.shape)
        assert_rel(y, want, dt, what=f"batch {ba} {bb} {bc} {kind}")
        y2, z2 = jax.jit(lambda a, b, bv, c: rg.gemm_bias_act_fwd(a, b, bv, **kw))(a, b, bv, c)
        assert_rel(y2, want, dt, what="fwd Y")
        assert_rel(z2, want_z, dt, what="fwd Z")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("trans", [(False, False), (True, True)], ids=lambda t: f"ta{int(t[0])}tb{int(t[1])}")
def test_tall_layers(rand, dtype, trans):
    """Layers tall enough (M >= 512 and past the one-thread size) that the CPU runs the
    matmul and the activation per block of rows, one block per thread (onednn_gemm.cc,
    run_rows; an M that does not divide evenly): each block's rows of A (stored either
    way; B is whole in every block), C, a per-row bias and the outputs, a batch of two,
    with and without the Z stash, against float64."""
    ta, tb = trans
    dt = DTYPES[dtype]
    m, k, n = 777, 136, 104
    for kind_shape, kind in (((m, 1), "per_row"), ((n,), "per_col")):
        for ba, act in (((), "gelu_erf"), ((2,), "relu")):
            a, b, bv, c = rand.operands(m, n, k, dt, trans_a=ta, trans_b=tb, bias_shape=kind_shape, with_c=True,
                                        batch_a=ba, batch_b=ba, batch_c=ba)  # fmt: skip
            kw = dict(act=act, c=c, alpha=0.8, beta=-1.5, trans_a=ta, trans_b=tb)
            want, want_z = np_gemm_bias_act(a, b, bv, bias_kind=kind, **kw)
            y, z = jax.jit(lambda a, b, bv, c: rg.gemm_bias_act_fwd(a, b, bv, **kw))(a, b, bv, c)
            assert_rel(y, want, dt, what=f"Y {kind} {act} batch {ba}")
            assert_rel(z, want_z, dt, what=f"Z {kind} {act} batch {ba}")
            assert_rel(rg.gemm_bias_act(a, b, bv, **kw), want, dt, what=f"Y alone {kind} {act} batch {ba}")


def test_caller_batch_bad_broadcast(rand):
    a, b, _, _ = rand.operands(M, N, K, jnp.float32, batch_a=(2,), batch_b=(3,))
    with pytest.raises(ValueError, match=r"batch dims do not broadcast.*\(2, 5, 7\).*\(3, 7, 6\)"):
        rg.gemm_bias_act(a, b)


# ---------------------------------------------------------------------------
# dense, precision, misc
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(), (1,), (3,), (2, 3), (2, 0)])
@pytest.mark.parametrize("act", ["none", "gelu", "relu"])
def test_dense(rand, x64, lead, act):
    dt = jnp.float32
    x, w, b = rand.normal(lead + (K,), dt), rand.normal((K, N), dt, 0.5), rand.normal((N,), dt)
    y = rg.dense(x, w, b, act=act)
    want, _ = np_gemm_bias_act(x.reshape(-1, K), w, b, act=act, bias_kind="per_col")
    assert y.shape == lead + (N,) and y.dtype == dt
    assert_rel(y.reshape(-1, N), want, dt, what="dense")
    assert_rel(R.dense(x, w, b, act=act).reshape(-1, N), want, dt, what="reference.dense")
    y0 = rg.dense(x, w, act=act)
    assert_rel(y0.reshape(-1, N), np_gemm_bias_act(x.reshape(-1, K), w, act=act)[0], dt, what="dense no bias")


def test_dense_vector_input(rand, x64):
    x, w, b = rand.normal((K,), jnp.float64), rand.normal((K, N), jnp.float64), rand.normal((N,), jnp.float64)
    y = rg.dense(x, w, b, act="tanh")
    assert y.shape == (N,)
    assert_rel(y, np_gemm_bias_act(x[None], w, b, act="tanh", bias_kind="per_col")[0][0], jnp.float64)


def test_precision_highest_is_exact_f32(rand):
    """precision=HIGHEST (argument or context) is true f32 on every backend (docs/spec.md §5)."""
    a, b, bv, c = rand.operands(33, 40, 129, jnp.float32, bias_shape=(40,), with_c=True)
    want, _ = np_gemm_bias_act(a, b, bv, act="gelu", c=c, beta=0.5, bias_kind="per_col")
    hi, lo = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT
    for prec in (hi, "highest", "float32", "HIGHEST", (hi, hi), (lo, hi), ("highest", "default")):
        y = rg.gemm_bias_act(a, b, bv, act="gelu", c=c, beta=0.5, precision=prec)
        assert_rel(y, want, jnp.float32, precision="highest", what=f"precision={prec}")
    with jax.default_matmul_precision("highest"):
        y = jax.jit(lambda a, b, bv, c: rg.gemm_bias_act(a, b, bv, act="gelu", c=c, beta=0.5))(a, b, bv, c)
    assert_rel(y, want, jnp.float32, precision="highest", what="default_matmul_precision('highest')")
    # the kernels are told: exact_f32 set for HIGHEST (either operand), unset for the default
    lower = lambda **kw: jax.jit(lambda a, b: rg.gemm_bias_act(a, b, **kw)).lower(a, b).as_text()
    assert "exact_f32 = true" in lower(precision="highest")
    assert "exact_f32 = true" in lower(precision=("default", "highest"))
    assert "exact_f32 = false" in lower(precision="tensorfloat32")
    if jax.config.jax_default_matmul_precision is None:
        assert "exact_f32 = false" in lower()
    with jax.default_matmul_precision("float32"):
        assert "exact_f32 = true" in lower()
    # the default precision is within the tolerance docs/spec.md §5 gives it (TF32 where the device has it)
    y = rg.gemm_bias_act(a, b, bv, act="gelu", c=c, beta=0.5)
    assert_rel(y, want, jnp.float32, what="default precision")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_larger_shapes_multiple_blocks(rand, x64, dtype):
    """Shapes past the CPU kernel's blocking (K > 256, M and N over several tiles), every act."""
    dt = DTYPES[dtype]
    m, n, k = 131, 97, 300
    a, b, bv, c = rand.operands(m, n, k, dt, trans_a=True, bias_shape=(m, 1), with_c=True)
    f = jax.jit(
        lambda a, b, bv, c: [rg.gemm_bias_act(a, b, bv, act=act, c=c, beta=0.25, trans_a=True) for act in ACTS]
    )
    for act, y in zip(ACTS, f(a, b, bv, c)):
        want, _ = np_gemm_bias_act(a, b, bv, act=act, c=c, beta=0.25, trans_a=True, bias_kind="per_row")
        assert_rel(y, want, dt, what=act)


def test_alpha_zero_and_beta_only(rand, x64):
    """alpha = 0 leaves beta C + bias; beta without C is ignored (no C term)."""
    a, b, bv, c = rand.operands(M, N, K, jnp.float64, bias_shape=(), with_c=True)
    y = rg.gemm_bias_act(a, b, bv, act="sigmoid", c=c, alpha=0.0, beta=3.0)
    np.testing.assert_allclose(f64(y), np_act("sigmoid", 3.0 * f64(c) + float(bv)), rtol=1e-14)
    y = rg.gemm_bias_act(a, b, bv, act="sigmoid", beta=3.0)
    assert_rel(y, np_gemm_bias_act(a, b, bv, act="sigmoid", bias_kind="scalar")[0], jnp.float64)


def test_numpy_inputs(rand, x64):
    """NumPy arrays are arrays too."""
    a, b, bv, c = rand.operands(M, N, K, jnp.float32, bias_shape=(N,), with_c=True)
    an, bn, bvn, cn = (np.asarray(x) for x in (a, b, bv, c))
    y = rg.gemm_bias_act(an, bn, bvn, act="relu", c=cn, beta=1.0)
    assert_rel(y, np_gemm_bias_act(a, b, bv, act="relu", c=c, beta=1.0, bias_kind="per_col")[0], jnp.float32)


def test_tolerance_table():
    """The helper's tolerances are docs/spec.md §5's."""
    assert tol(jnp.bfloat16) == 2e-2 and tol(jnp.float16) == 5e-3
    assert tol(jnp.float32, "highest") == 1e-5


def test_cuda_workspace_sized_by_the_problem(monkeypatch):
    """Lowered for CUDA, a forward call's workspace result is the size the CUDA module gives for its
    problem (ffi/cuda/workspace.h), asked with op(A)'s rows, op(B)'s columns, K, the batch and B's
    own batch, and the transposes; with a symbolic dim (jax.export) the full share, whatever it is.
    A stand-in module records the questions (no GPU needed)."""
    from jax_regemm import _ffi

    asked = []

    class Cuda:
        @staticmethod
        def gemm_workspace_bytes():
            return 1000

        @staticmethod
        def gemm_call_workspace_bytes(*q):
            asked.append(q)
            return 2000 + len(asked)

    monkeypatch.setattr(_ffi, "_regemm_cuda", Cuda)
    monkeypatch.setenv("REGEMM_PLAIN_GEMM", "regemm")  # the call, not XLA's dot, whatever the act
    sds = jax.ShapeDtypeStruct
    cases = [  # a, b, trans_a, trans_b, vmap's in_axes: (m, n, k, batch, batch_b)
        ((300, 70), (70, 90), False, False, None, (300, 90, 70, 1, 1)),
        ((70, 300), (90, 70), True, True, None, (300, 90, 70, 1, 1)),
        ((3, 300, 70), (3, 70, 90), False, False, (0, 0), (300, 90, 70, 3, 3)),
        ((3, 300, 70), (70, 90), False, False, (0, None), (900, 90, 70, 1, 1)),  # a shared weight: one GEMM
    ]
    for sa, sb, ta, tb, axes, want in cases:
        f = lambda a, b: rg.gemm_bias_act(a, b, None, act="gelu", trans_a=ta, trans_b=tb)
        f = jax.vmap(f, in_axes=axes) if axes else f
        text = jax.jit(f).trace(sds(sa, jnp.bfloat16), sds(sb, jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        assert asked[-1] == ("bfloat16",) + want + (ta, tb), asked[-1]
        assert f"tensor<{2000 + len(asked)}xui8>" in text
    n = len(asked)
    (b,) = jax.export.symbolic_shape("b")
    f = jax.jit(lambda a, w: rg.dense(a, w, None, act="gelu"))
    exp = jax.export.export(f, platforms=("cuda",), disabled_checks=rg.disabled_export_checks())
    exp = exp(sds((b, 70), jnp.float32), sds((70, 90), jnp.float32))
    assert len(asked) == n and "tensor<1000xui8>" in exp.mlir_module()
