"""Property tests: random problems (shapes with 1 and odd sizes, act, bias shape,
dtype, transposes, alpha/beta, C, caller batch dims) against the float64 NumPy
reference, within docs/spec.md §5's tolerance for the dtype; and random f64 gradient
problems against jax.grad of jax_regemm.reference.

Hypothesis draws the problem and a seed; the numbers come from NumPy's
generator with that seed (fast, and a failure prints its reproduction blob)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import ACTS, DTYPES, Y_ACTS, Rand, assert_rel, bias_variants, infer_kind, np_gemm_bias_act
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_regemm as rg
from jax_regemm import reference as R

SIZES = st.sampled_from([1, 1, 2, 3, 5, 7, 8, 9, 13, 17, 31])
SCALARS = st.sampled_from([1.0, -1.0, 0.5, 2.0, -0.75, 0.0, 1.3])
BATCH = st.sampled_from([((), (), ()), ((2,), (), (2,)), ((), (3,), ()), ((2, 1), (1, 3), (2, 3)), ((1,), (2,), ())])


@st.composite
def problems(draw, dtypes=tuple(DTYPES)):
    m, n, k = draw(SIZES), draw(SIZES), draw(SIZES)
    label, shape, kind = draw(st.sampled_from(bias_variants(m, n)))
    explicit = draw(st.booleans())  # pass bias_kind, or let it be inferred
    if not explicit and shape is not None:
        # inference would read some shapes differently when M == N or N == 1 (docs/spec.md §2):
        # the reference must then use the inferred kind
        kind = infer_kind(shape, m, n)
    return dict(
        m=m, n=n, k=k, bias_shape=shape, kind=kind, explicit=explicit and shape is not None,
        act=draw(st.sampled_from(ACTS)), dtype=draw(st.sampled_from(dtypes)),
        trans_a=draw(st.booleans()), trans_b=draw(st.booleans()),
        alpha=draw(SCALARS), beta=draw(SCALARS), with_c=draw(st.booleans()),
        slope=draw(st.sampled_from([0.01, 0.3])), batch=draw(BATCH), seed=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip


def _operands(p, dtype):
    ba, bb, bc = p["batch"]
    return Rand(p["seed"]).operands(
        p["m"], p["n"], p["k"], dtype, trans_a=p["trans_a"], trans_b=p["trans_b"], bias_shape=p["bias_shape"],
        with_c=p["with_c"], batch_a=ba, batch_b=bb, batch_c=bc,
    )  # fmt: skip


@settings(max_examples=200, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems())
def test_random_forward_vs_float64(p):
    dt = DTYPES[p["dtype"]]
    with jax.enable_x64(dt == jnp.float64):
        a, b, bias, c = _operands(p, dt)
        kw = dict(act=p["act"], leaky_slope=p["slope"], c=c, alpha=p["alpha"], beta=p["beta"], trans_a=p["trans_a"],
                  trans_b=p["trans_b"])  # fmt: skip
        y, z = rg.gemm_bias_act_fwd(a, b, bias, bias_kind=p["kind"] if p["explicit"] else None, **kw)
        want_y, want_z = np_gemm_bias_act(a, b, bias, slope=p["slope"], bias_kind=p["kind"],
                                          **{k: v for k, v in kw.items() if k != "leaky_slope"})  # fmt: skip
        assert y.shape == want_y.shape and y.dtype == dt
        mag = lambda x: None if x is None else np.abs(np.asarray(x, np.float64))
        summands, _ = np_gemm_bias_act(mag(a), mag(b), mag(bias), bias_kind=p["kind"], act="none", c=mag(c),
                                       alpha=abs(p["alpha"]), beta=abs(p["beta"]), trans_a=p["trans_a"],
                                       trans_b=p["trans_b"])  # fmt: skip
        assert_rel(y, want_y, dt, what=f"Y {p}", summands=summands, k=p["k"])
        assert_rel(z, want_z, dt, what=f"Z {p}", summands=summands, k=p["k"])


@settings(max_examples=60, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems(dtypes=("f64",)), save=st.sampled_from(["z", "y", "recompute", "auto"]))
def test_random_grads_vs_reference(p, save):
    if save == "y" and p["act"] not in Y_ACTS:
        save = "recompute"
    with jax.enable_x64(True):
        a, b, bias, c = _operands(p, jnp.float64)
        kw = dict(act=p["act"], leaky_slope=p["slope"], alpha=p["alpha"], beta=p["beta"], trans_a=p["trans_a"],
                  trans_b=p["trans_b"])  # fmt: skip
        w = Rand(p["seed"] + 1).normal(np.broadcast_shapes(*(x.shape[:-2] for x in (a, b, c) if x is not None))
                                       + (p["m"], p["n"]), jnp.float64)  # fmt: skip
        ref_kind = "per_col" if p["kind"] == "none" else p["kind"]
        given_kind = p["kind"] if p["explicit"] else None
        loss = lambda a, b, bias, c: jnp.sum(w * rg.gemm_bias_act(a, b, bias, c=c, save=save, bias_kind=given_kind, **kw))
        ref = lambda a, b, bias, c: jnp.sum(w * R.gemm_bias_act(a, b, bias, c=c, bias_kind=ref_kind, **kw))
        args = (a, b, bias, c)
        wrt = tuple(i for i, x in enumerate(args) if x is not None)
        got = jax.jit(jax.grad(loss, argnums=wrt))(*args)
        want = jax.jit(jax.grad(ref, argnums=wrt))(*args)
        for i, g, r in zip(wrt, got, want):
            assert g.shape == args[i].shape
            assert_rel(g, r, jnp.float64, what=f"grad {'A B bias C'.split()[i]} {p} save={save}")
