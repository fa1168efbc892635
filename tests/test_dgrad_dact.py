"""The dgrad_dact target (the step of rg.mlp's backward) against float64 NumPy:
gZ = (alpha op(A) op(B)) * act'(S) and the bias gradient of gZ, for every
activation, S = Z or Y, bias kinds, transposes and batch dims (broadcast by stride)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ACTS, BIAS_KINDS, Y_ACTS, assert_rel, f64, np_act, np_act_grad
from jax_regemm import _ffi


def _np_case(a, b, z, *, act, from_y, kind, alpha, ta, tb, dtype):
    op = lambda x, t: np.swapaxes(x, -1, -2) if t else x
    gy = alpha * np.matmul(op(f64(a), ta), op(f64(b), tb))
    gy = f64(jnp.asarray(gy, dtype))  # the GEMM's output is stored in the dtype, as gY is
    zz = f64(z)
    s = f64(jnp.asarray(np_act(act, zz), dtype)) if from_y else zz
    gz = gy * np_act_grad(act, zz)
    axes = {"per_col": (-2,), "per_row": (-1,), "scalar": (-2, -1)}.get(kind)
    gb = None if axes is None else np.sum(gz, axis=axes).reshape(gz.shape[:-2] + (-1,))
    return s, gz, gb


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dgrad_dact_every_activation(rand, act, dtype):
    m, n, k = 37, 24, 40
    a, b, z = rand.normal((m, k), dtype), rand.normal((n, k), dtype), rand.normal((m, n), dtype)
    for from_y in (False, True) if act in Y_ACTS else (False,):
        if act == "leaky_relu" and from_y:
            continue
        s, gz_ref, gb_ref = _np_case(a, b, z, act=act, from_y=from_y, kind="per_col", alpha=1.0, ta=False, tb=True,
                                     dtype=dtype)  # fmt: skip
        f = jax.jit(lambda a, b, s: _ffi.dgrad_dact(a, b, s, act=act, slope=0.01, from_y=from_y, bias_kind="per_col",
                                                    bias_len=n, alpha=1.0, trans_a=False, trans_b=True,
                                                    exact_f32=True))  # fmt: skip
        gz, gb = f(a, b, jnp.asarray(s, dtype))
        assert gz.dtype == dtype and gb.shape == (n,)
        assert_rel(gz, gz_ref, dtype, jax.lax.Precision.HIGHEST, f"gZ {act} from_y={from_y}")
        assert_rel(gb, gb_ref, dtype, jax.lax.Precision.HIGHEST, f"gBias {act} from_y={from_y}")


@pytest.mark.parametrize("kind", BIAS_KINDS)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_dgrad_dact_bias_kinds_transposes_batches(rand, kind, ta, tb):
    """A [2, 3, ..] batch with B shared (stride 0) and S per entry; alpha != 1; f32 at 67 MFLOP
    where the CPU GEMM runs multi-threaded."""
    dtype = jnp.float32
    m, n, k = 130, 96, 270
    a = rand.normal((2, 3) + ((k, m) if ta else (m, k)), dtype)
    b = rand.normal((1, 1) + ((n, k) if tb else (k, n)), dtype)
    z = rand.normal((2, 3, m, n), dtype)
    alpha = rand.scalar()
    s, gz_ref, gb_ref = _np_case(a, b, z, act="gelu", from_y=False, kind=kind, alpha=alpha, ta=ta, tb=tb, dtype=dtype)
    bias_len = {"per_col": n, "per_row": m, "scalar": 1}.get(kind, 0)
    gz, gb = jax.jit(lambda a, b, s: _ffi.dgrad_dact(
        a, b, s, act="gelu", slope=0.01, from_y=False, bias_kind=kind, bias_len=bias_len, alpha=alpha, trans_a=ta,
        trans_b=tb, exact_f32=True))(a, b, z)  # fmt: skip
    assert gz.shape == (2, 3, m, n)
    assert_rel(gz, gz_ref, dtype, jax.lax.Precision.HIGHEST, "gZ")
    if kind == "none":
        assert gb is None
    else:
        assert gb.shape == (2, 3, bias_len)
        assert_rel(gb, gb_ref, dtype, jax.lax.Precision.HIGHEST, "gBias")
