"""Activations (docs/spec.md §3): the kernels' act and act', and jax_regemm.reference's,
against float64 closed forms at many points, |z| up to 1e30, and NaN.

The kernels are reached through the public API with K = 1 and B = [[1]], so
that Z is exactly the point z: Y = act(z) from the forward, act'(z) as the
gradient w.r.t. A (gY = 1) through every save policy, and from
gemm_bias_act_bwd (the explicit Z-stash backward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ACTS, DTYPES, Y_ACTS, eps, f64, np_act, np_act_grad, on_cpu, tol

import jax_regemm as rg
from jax_regemm import reference as R

SLOPE = 0.01

_BIG = [1e30, 1e20, 1e10, 1e5, 1e3, 100.0, 40.0, 30.5, 30.0, 29.5, 20.0, 10.0, 5.0, 3.0, 2.0]
_SMALL = [1.0, 0.75, 0.5, 0.1, 1e-3, 1e-8, 1e-30]
POINTS = np.unique(
    np.concatenate([np.array(_BIG + _SMALL), -np.array(_BIG + _SMALL), [0.0], np.linspace(-8, 8, 97)])
)


def points(dtype) -> np.ndarray:
    """The test points representable in `dtype` (no overflow to inf), as float64, plus -0.0."""
    p = POINTS
    p = p[np.abs(p) <= float(jnp.finfo(dtype).max)]
    p = np.unique(f64(jnp.asarray(p, dtype)))
    return np.concatenate([p, [-0.0]])


HI = jax.lax.Precision.HIGHEST  # f32: Z must be exactly the point (no TF32 rounding of A on GPUs)


def fwd_rtol(dtype):
    """Pointwise relative tolerance of act(z): rounding to the dtype, plus the
    conditioning of exp/erfc in the float32 accumulator (|2u| eps for gelu's tail).

    16-bit outputs: one ulp on the CPU (f32 math, then one rounding); on an
    accelerator, whose epilogue may use approximate exp/tanh for 16-bit outputs,
    docs/spec.md §5's tolerance of the dtype, read pointwise."""
    d = jnp.dtype(dtype)
    if d.name in ("float64", "float32"):
        return {"float64": 1e-12, "float32": 2e-5}[d.name]
    return eps(d) if on_cpu() else tol(d)


def deriv_atol(dtype):
    """A few ulp (act' is O(1)); on an accelerator, 16-bit types get fwd_rtol's allowance."""
    d = jnp.dtype(dtype)
    return 4 * eps(d) if on_cpu() or d.name in ("float64", "float32") else max(4 * eps(d), fwd_rtol(d))


def check_points(got, ref, dtype, *, deriv: bool, what: str):
    got, ref = f64(got), f64(ref)
    assert got.shape == ref.shape
    finite = np.isfinite(ref)
    assert np.all(np.isfinite(got[finite])), f"{what}: inf/NaN where the math is finite at z={ref[~np.isfinite(got) & finite]}"
    rtol = fwd_rtol(dtype)
    # act' is O(1) in magnitude and some are differences of O(1) terms (zero crossings):
    # an absolute floor of a few ulp; act itself keeps relative accuracy down to the
    # smallest normal number.
    atol = deriv_atol(dtype) if deriv else float(jnp.finfo(dtype).tiny)
    err = np.abs(got - ref)
    bad = err > rtol * np.abs(ref) + atol
    assert not bad.any(), f"{what}: mismatch at {np.flatnonzero(bad)[:8]}: got {got[bad][:8]}, want {ref[bad][:8]}"


def _col(z, dtype):
    return jnp.asarray(z, dtype)[:, None]


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("act", ACTS)
def test_kernel_act_and_grad_closed_form(x64, act, dtype):
    dt = DTYPES[dtype]
    z = points(dt)
    a, one = _col(z, dt), jnp.ones((1, 1), dt)
    y, zs = rg.gemm_bias_act_fwd(a, one, act=act, leaky_slope=SLOPE, precision=HI)
    np.testing.assert_array_equal(f64(zs)[:, 0], z)  # Z is exactly the point
    check_points(y[:, 0], np_act(act, z, SLOPE), dt, deriv=False, what=f"act {act}")

    ga, gb, _, _ = rg.gemm_bias_act_bwd(a, one, jnp.ones_like(y), zs, act=act, leaky_slope=SLOPE, precision=HI)
    check_points(ga[:, 0], np_act_grad(act, z, SLOPE), dt, deriv=True, what=f"act' {act} (bwd)")
    assert gb.shape == (1, 1) and gb.dtype == dt

    # the custom_vjp: act' from the stashed Z and from a recomputed Z
    for save in ("z", "recompute"):
        g = jax.grad(lambda a: jnp.sum(rg.gemm_bias_act(a, one, act=act, leaky_slope=SLOPE, save=save, precision=HI)))(a)
        check_points(g[:, 0], np_act_grad(act, z, SLOPE), dt, deriv=True, what=f"act' {act} (save={save})")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("act", Y_ACTS)
def test_kernel_grad_from_y(x64, act, dtype):
    """save="y": act' read off Y. Y is rounded to the dtype, so the reference is the
    closed form at z, with an absolute tolerance of a few ulp of Y."""
    dt = DTYPES[dtype]
    z = points(dt)
    a, one = _col(z, dt), jnp.ones((1, 1), dt)
    g = jax.grad(lambda a: jnp.sum(rg.gemm_bias_act(a, one, act=act, leaky_slope=SLOPE, save="y", precision=HI)))(a)
    got, ref = f64(g[:, 0]), np_act_grad(act, z, SLOPE)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref, rtol=fwd_rtol(dt), atol=deriv_atol(dt), err_msg=act)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("act", ACTS)
def test_kernel_nan_in_nan_out(x64, act, dtype):
    dt = DTYPES[dtype]
    z = np.array([np.nan, 1.0, -1.0, np.nan, 0.5])
    nan = np.isnan(z)
    a, one = _col(z, dt), jnp.ones((1, 1), dt)
    y, zs = rg.gemm_bias_act_fwd(a, one, act=act, precision=HI)
    assert np.array_equal(np.isnan(f64(y[:, 0])), nan), f"act {act}: {y[:, 0]}"
    # act none: act' = 1 does not read Z at all (the backward skips the elementwise pass)
    gnan = nan if act != "none" else np.zeros_like(nan)
    ga, *_ = rg.gemm_bias_act_bwd(a, one, jnp.ones_like(y), zs, act=act, precision=HI)
    assert np.array_equal(np.isnan(f64(ga[:, 0])), gnan), f"act' {act}: {ga[:, 0]}"
    saves = ("z", "recompute") + (("y",) if act in Y_ACTS else ())
    for save in saves:
        g = jax.grad(lambda a: jnp.sum(rg.gemm_bias_act(a, one, act=act, save=save, precision=HI)))(a)
        assert np.array_equal(np.isnan(f64(g[:, 0])), gnan), f"act' {act} save={save}: {g[:, 0]}"


@pytest.mark.parametrize("slope", [0.2, 0.0, -0.5, 1.5])
def test_kernel_leaky_relu_slope(x64, rand, slope):
    z = np.concatenate([f64(rand.normal((32,), jnp.float64)), [0.0, -1e30, 1e30]])
    a, one = _col(z, jnp.float64), jnp.ones((1, 1), jnp.float64)
    y, zs = rg.gemm_bias_act_fwd(a, one, act="leaky_relu", leaky_slope=slope, precision=HI)
    np.testing.assert_array_equal(f64(y[:, 0]), np_act("leaky_relu", z, slope))
    g = jax.grad(lambda a: jnp.sum(rg.gemm_bias_act(a, one, act="leaky_relu", leaky_slope=slope, precision=HI)))(a)
    np.testing.assert_array_equal(f64(g[:, 0]), np_act_grad("leaky_relu", z, slope))


def test_kernel_relu_grad_at_zero_is_zero(x64):
    """docs/spec.md §3: relu'(0) = 0 (1 only if z > 0), whatever the save policy."""
    for dt in (jnp.float32, jnp.float64):
        a, one = jnp.zeros((3, 1), dt).at[1, 0].set(-0.0), jnp.ones((1, 1), dt)
        for save in ("z", "y", "recompute"):
            g = jax.grad(lambda a: jnp.sum(rg.gemm_bias_act(a, one, act="relu", save=save, precision=HI)))(a)
            np.testing.assert_array_equal(f64(g), 0.0)


# ---------------------------------------------------------------------------
# jax_regemm.reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("act", ACTS)
def test_reference_act_closed_form(x64, act, dtype):
    """reference.act_fwd / act_grad / act_grad_from_y vs the float64 closed forms.

    The reference is plain jnp (e.g. gelu is jax.nn.gelu, 0.5 z (1 + tanh u)), so it
    is held to absolute accuracy in the tails, but it must be finite where the math is."""
    dt = DTYPES[dtype]
    z = points(dt)
    zj = jnp.asarray(z, dt)
    # gelu' as 0.5 (1 + t) + 0.5 z (1 - t^2) u' carries an absolute error ~ eps |z|^3 before t
    # saturates (|z| ~ 10): some 200 ulp in float64, where the float32 result is exact to rounding.
    tol = {"rtol": fwd_rtol(dt) * 10, "atol": (256 if dt == jnp.float64 else 32) * eps(dt)}
    f, g = f64(R.act_fwd(act, zj, SLOPE)), f64(R.act_grad(act, zj, SLOPE))
    assert np.all(np.isfinite(f)), f"reference act {act} not finite at {z[~np.isfinite(f)]}"
    assert np.all(np.isfinite(g)), f"reference act' {act} not finite at {z[~np.isfinite(g)]}"
    np.testing.assert_allclose(f, np_act(act, z, SLOPE), **tol, err_msg=f"reference act {act}")
    np.testing.assert_allclose(g, np_act_grad(act, z, SLOPE), **tol, err_msg=f"reference act' {act}")
    if act in Y_ACTS:
        gy = f64(R.act_grad_from_y(act, jnp.asarray(f, dt), SLOPE))
        np.testing.assert_allclose(gy, np_act_grad(act, z, SLOPE), **tol, err_msg=f"reference act'(y) {act}")
    # NaN in, NaN out
    nan = jnp.asarray([np.nan, 1.0], dt)
    assert np.isnan(f64(R.act_fwd(act, nan, SLOPE))[0])
    assert np.isnan(f64(R.act_grad(act, nan, SLOPE))[0])
    if act in Y_ACTS:
        assert np.isnan(f64(R.act_grad_from_y(act, nan, SLOPE))[0])


@pytest.mark.parametrize("act", ACTS)
def test_reference_autodiff_equals_closed_form(x64, act):
    """act' via jax.grad of the reference's act equals docs/spec.md §3's closed form (in float64,
    at every point: jax.grad of a plain-jnp gelu forms inf * 0 past |z| ~ 1e100)."""
    z = points(jnp.float64)
    g = jax.vmap(jax.grad(lambda x: R.act_fwd(act, x, SLOPE)))(jnp.asarray(z))
    np.testing.assert_allclose(f64(g), np_act_grad(act, z, SLOPE), rtol=1e-9, atol=1e-12, err_msg=act)
    # and the reference's own closed form is what its autodiff says, in float32 too (moderate z)
    z32 = jnp.asarray(np.linspace(-8, 8, 65), jnp.float32)
    g32 = jax.vmap(jax.grad(lambda x: R.act_fwd(act, x, SLOPE)))(z32)
    np.testing.assert_allclose(f64(g32), f64(R.act_grad(act, z32, SLOPE)), rtol=1e-5, atol=1e-6, err_msg=act)


def test_gelu_matches_jax_nn(x64, rand):
    """docs/spec.md §3: gelu == jax.nn.gelu(approximate=True), gelu_erf == jax.nn.gelu(approximate=False)."""
    z = rand.normal((64,), jnp.float64, 3.0)
    a, one = z[:, None], jnp.ones((1, 1), jnp.float64)
    for act, approx in (("gelu", True), ("gelu_erf", False)):
        y = rg.gemm_bias_act(a, one, act=act, precision=HI)[:, 0]
        np.testing.assert_allclose(f64(y), f64(jax.nn.gelu(z, approximate=approx)), rtol=1e-13, atol=1e-14)
