"""Shared helpers for the core test suite (docs/spec.md §1-§5, §7).

- An independent float64 NumPy reference of the fused op and of every
  activation and its derivative, written from docs/spec.md §1-§3 with NumPy and the
  standard library only (it imports nothing from jax_regemm, so that comparing
  the package -- kernels *and* jax_regemm.reference -- against it means something).
- The relative Frobenius error and the docs/spec.md §5 tolerances by dtype (f32 on a
  GPU at default precision counts as TF32).
- `rand`: a random input factory, seeded per test from its node id (every
  test draws different numbers, reproducibly; set REGEMM_TEST_SEED to vary
  them); every call draws fresh numbers.
- `x64`: a fixture enabling 64-bit types for the test's duration.
- `assert_tuner_kept`: the GPU tuner's choices, read off REGEMM_TUNE_LOG's
  lines, against its margin rule.
"""

from __future__ import annotations

import hashlib
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

ACTS = ("none", "relu", "leaky_relu", "gelu", "gelu_erf", "sigmoid", "tanh", "silu")
Y_ACTS = ("none", "relu", "leaky_relu", "sigmoid", "tanh")  # act' derivable from Y (docs/spec.md §4)
BIAS_KINDS = ("none", "scalar", "per_row", "per_col")
DTYPES = {"f32": jnp.float32, "f64": jnp.float64, "bf16": jnp.bfloat16, "f16": jnp.float16}
TRANS = [(False, False), (True, False), (False, True), (True, True)]


def on_cpu() -> bool:
    return jax.default_backend() == "cpu"


# The suite's odd sizes (3, 5, 7, 33, ...) run on regemm's kernels on the GPU too: by
# default an op whose rows are not whole 16-byte vectors lowers to XLA's own program
# there (jax_regemm._route.ON_XLA, "unaligned"), which would leave the kernels' odd-size
# paths untested. test_grads' cross-lowering tests and test_gpu's check the default.
os.environ.setdefault("REGEMM_UNALIGNED", "regemm")
# Likewise its small sizes: by default an op with at most 512 rows of output or 2^21 elements
# lowers to XLA's own program on the GPU ("small"); test_grads' and test_gpu's tests of that
# check the default.
os.environ.setdefault("REGEMM_SMALL", "regemm")
# And a 16-bit forward outside a derivative whose epilogue XLA folds into its GEMM (a per-column
# bias, relu: "xla_epilogue"); test_grads' test of that checks the default.
os.environ.setdefault("REGEMM_XLA_EPILOGUE", "regemm")
# And the dtypes this machine runs on the CPU's portable GEMM alone (bf16 and f16 without
# AVX-512, f64: "portable"); test_route's test of that checks the default.
os.environ.setdefault("REGEMM_PORTABLE", "regemm")
# And the MLP blocks the fused narrow kernels take on CUDA (one kernel for the whole stack):
# the suite's MLP tests count and test the per-layer calls; tests/test_narrow.py turns it on.
os.environ.setdefault("REGEMM_NARROW", "off")

# A plain GEMM (alpha op(A) op(B): the backward's dgrad and wgrad GEMMs) is a
# regemm call on the CPU and XLA's own dot on the GPU (jax_regemm._route.plain):
# the regemm calls a program has per plain GEMM in it.
PLAIN_GEMM_CALLS = 0 if jax.default_backend() == "gpu" else 1


# ---------------------------------------------------------------------------
# float64 NumPy reference
# ---------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715
_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def f64(x) -> np.ndarray:
    """Any array (bf16/f16 included) as a float64 NumPy array."""
    return np.asarray(np.asarray(x).astype(np.float64))


def np_sigmoid(z):
    """1 / (1 + exp(-z)) without overflow: exp of -|z| only."""
    z = np.asarray(z, np.float64)
    with np.errstate(over="ignore", under="ignore"):
        e = np.exp(-np.abs(z))
        return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _gelu_u(z):
    return _SQRT_2_OVER_PI * (z + _GELU_A * z**3)


def np_act(name: str, z, slope: float = 0.01) -> np.ndarray:
    """act(z) of docs/spec.md §3 in float64. gelu's 0.5 (1 + tanh u) is written as its
    identity sigmoid(2u), which keeps relative accuracy in the negative tail."""
    z = np.asarray(z, np.float64)
    with np.errstate(all="ignore"):
        if name == "none":
            return z.copy()
        if name == "relu":
            return np.where(np.isnan(z), z, np.maximum(z, 0.0))
        if name == "leaky_relu":
            return np.where(z > 0, z, slope * z)
        if name == "gelu":
            return z * np_sigmoid(2.0 * _gelu_u(z))
        if name == "gelu_erf":
            return 0.5 * z * _erfc(-z / math.sqrt(2.0))
        if name == "sigmoid":
            return np_sigmoid(z)
        if name == "tanh":
            return np.tanh(z)
        if name == "silu":
            return z * np_sigmoid(z)
    raise ValueError(name)


def np_act_grad(name: str, z, slope: float = 0.01) -> np.ndarray:
    """act'(z) of docs/spec.md §3 in float64, closed forms; NaN in gives NaN out."""
    z = np.asarray(z, np.float64)
    with np.errstate(all="ignore"):
        if name == "none":
            g = np.ones_like(z)
        elif name == "relu":
            g = np.where(z > 0, 1.0, 0.0)
        elif name == "leaky_relu":
            g = np.where(z > 0, 1.0, slope)
        elif name == "gelu":
            # d/dz z s(2u) = s + 2 z s (1 - s) u',  u' = sqrt(2/pi) (1 + 3a z^2)
            x = 2.0 * _gelu_u(z)
            s, one_minus_s = np_sigmoid(x), np_sigmoid(-x)
            du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_A * z * z)
            g = s + np.where(one_minus_s == 0, 0.0, 2.0 * z * s * one_minus_s * du)
        elif name == "gelu_erf":
            # Phi(z) + z phi(z)
            g = 0.5 * _erfc(-z / math.sqrt(2.0)) + z * np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
        elif name == "sigmoid":
            g = np_sigmoid(z) * np_sigmoid(-z)
        elif name == "tanh":
            g = 1.0 / np.cosh(z) ** 2
        elif name == "silu":
            s = np_sigmoid(z)
            g = s * (1.0 + z * np_sigmoid(-z))
        else:
            raise ValueError(name)
    return np.where(np.isnan(z), z, g)


def np_bias(bias, kind: str):
    """The bias in float64 as something that broadcasts against [..., M, N]."""
    if bias is None or kind == "none":
        return 0.0
    b = f64(bias)
    if kind == "scalar":
        return b.reshape(())
    if kind == "per_row":
        return b.reshape(-1, 1)
    if kind == "per_col":
        return b.reshape(-1)
    raise ValueError(kind)


def np_gemm_bias_act(
    a, b, bias=None, *, act="relu", slope=0.01, c=None, alpha=1.0, beta=0.0, trans_a=False, trans_b=False,
    bias_kind="none",
):  # fmt: skip
    """(Y, Z) of docs/spec.md §1 in float64; leading batch dims broadcast like np.matmul."""
    a64, b64 = f64(a), f64(b)
    opa = np.swapaxes(a64, -1, -2) if trans_a else a64
    opb = np.swapaxes(b64, -1, -2) if trans_b else b64
    z = alpha * np.matmul(opa, opb)
    if c is not None:
        z = z + beta * f64(c)
    z = z + np_bias(bias, bias_kind)
    return np_act(act, z, slope), z


def infer_kind(shape, m, n) -> str:
    """docs/spec.md §2's rule, restated: (),(1,) scalar; (N,),(1,N) per-col (so length M == N is per-col); (M,),(M,1) per-row."""
    shape = tuple(shape)
    if shape == ():
        return "scalar"
    if shape == (1,) and n != 1:
        return "scalar"
    if shape in ((n,), (1, n)):
        return "per_col"
    if shape in ((m,), (m, 1)):
        return "per_row"
    raise ValueError(shape)


def bias_variants(m: int, n: int):
    """(label, bias shape or None, kind) for every accepted bias shape of an [M, N] output."""
    return [
        ("none", None, "none"),
        ("scalar()", (), "scalar"),
        ("scalar(1,)", (1,), "scalar"),
        ("per_row(M,)", (m,), "per_row"),
        ("per_row(M,1)", (m, 1), "per_row"),
        ("per_col(N,)", (n,), "per_col"),
        ("per_col(1,N)", (1, n), "per_col"),
    ]


BIAS_VARIANT_LABELS = [v[0] for v in bias_variants(5, 6)]


def bias_shape_of(label: str, m: int, n: int):
    return {v[0]: v[1:] for v in bias_variants(m, n)}[label]


# ---------------------------------------------------------------------------
# errors and tolerances (docs/spec.md §5)
# ---------------------------------------------------------------------------


def rel_err(got, ref, floor=0.0) -> float:
    """Relative Frobenius error ||got - ref||_F / max(||ref||_F, floor) (in float64)."""
    got, ref = f64(got), f64(ref)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    den = max(np.linalg.norm(ref.ravel()), floor)
    num = np.linalg.norm((got - ref).ravel())
    if den == 0.0:
        return float(num)
    return float(num / den)


def _precision_is_highest(precision) -> bool:
    """As jnp.dot reads `precision` (XLA takes the higher of a pair)."""
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    ps = precision if isinstance(precision, (tuple, list)) else (precision,)
    return any(p is not None and lax.Precision(p.lower() if isinstance(p, str) else p) == lax.Precision.HIGHEST
               for p in ps)  # fmt: skip


def tol(dtype, precision=None) -> float:
    """docs/spec.md §5's relative Frobenius tolerance for outputs of this dtype.

    f32 is "exact" (< 1e-5) on CPU and with precision=HIGHEST; at the default
    precision on an accelerator it may be TF32 (< 5e-3), as XLA's own dot.
    f64 is not in the the contract's table: 1e-12 (its accumulation is f64)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64:
        return 1e-12
    if dtype == jnp.float32:
        return 1e-5 if on_cpu() or _precision_is_highest(precision) else 5e-3
    if dtype == jnp.bfloat16:
        return 2e-2
    if dtype == jnp.float16:
        return 5e-3
    raise ValueError(dtype)


def assert_rel(got, ref, dtype, precision=None, what="", summands=None, k=0):
    """docs/spec.md §5's check. Below the output dtype's smallest normal number a correctly
    rounded value is only absolutely accurate (f16: to 3e-8, half a subnormal step;
    hypothesis found Y = -8.2e-8, stored as -6.0e-8, relative error 0.27), so the
    norm of the reference is floored there. Normal-range outputs keep the
    relative tolerance unchanged.

    `summands`, where given: the magnitude of what each output sums (|alpha| |A| |B|
    + |bias| + |beta| |C|, K products). A sum that cancels is only accurate to the
    rounding of its terms, (K + 2) eps of that magnitude in any order of evaluation,
    eps the accumulator's (f32; f64 for f64) (hypothesis found alpha A B = -0.14547
    and bias 0.14485, Y = -6.19e-4, one f32 ulp of the terms off: relative error
    1.9e-5), so the reference's norm is floored at what that bound allows. Outputs
    that do not cancel (in f32 at K <= 31, by 2.5x or more) keep the relative
    tolerance unchanged."""
    floor = float(jnp.finfo(dtype).tiny)
    if summands is not None:
        eps = float(jnp.finfo(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32).eps)
        floor = max(floor, float(np.linalg.norm(f64(summands).ravel())) * (k + 2) * eps / tol(dtype, precision))
    e = rel_err(got, ref, floor=floor)
    t = tol(dtype, precision)
    assert e < t, f"{what}: relative Frobenius error {e:.3e} >= {t:.1e} ({jnp.dtype(dtype).name})"


_TUNE_TIME = re.compile(r"regemm tune: (.+?): (\S+) ([0-9.]+) us \(device [^)]*\)( the rule's way)?$")
_TUNE_CHOSE = re.compile(r"regemm tune: (.+?): chose (\S+) \(margin ([0-9.e+-]+)% over the rule's way, (.+)\)$")


def assert_tuner_kept(log: str, pick=lambda sig: True) -> dict:
    """Every signature the GPU tuner timed in `log` (REGEMM_TUNE_LOG=1's stderr) and `pick`
    selects kept the way the margin rule says (ffi/cuda/tuner.cu, time_candidates): the rule's
    way unless another was faster than it by more than the margin, else the fastest (to the
    log's 0.01 us). Returns {signature: (times {label: us}, the rule's way or None, chosen,
    margin %)}."""
    times, rule, out = {}, {}, {}
    for line in log.splitlines():
        if m := _TUNE_TIME.match(line):
            times.setdefault(m[1], {})[m[2]] = float(m[3])
            if m[4]:
                rule[m[1]] = m[2]
        elif (m := _TUNE_CHOSE.match(line)) and pick(m[1]):
            sig, chose, pct = m[1], m[2], float(m[3])
            t, r = times.pop(m[1]), rule.pop(m[1], None)
            assert (r or "not timed") == m[4], line
            fastest = min(t, key=t.get)
            keep = r is not None and t[fastest] >= t[r] * (1 - pct / 100)
            near = r is not None and abs(t[fastest] - t[r] * (1 - pct / 100)) < 0.02
            assert chose == (r if keep else fastest) or (near and chose in (r, fastest)), (sig, t, r, chose, pct)
            out[sig] = (t, r, chose, pct)
    return out


def dgrad_dact_in_place(hlo: str, shape) -> tuple:
    """In compiled HLO text: (its regemm_dgrad_dact calls, whether each writes gZ over S, the
    copies made of an array of `shape`)."""
    calls = [line for line in hlo.splitlines() if "regemm_dgrad_dact_v1" in line and "custom-call(" in line]
    aliased = [("output_to_operand_aliasing={{0}: (2" in line) for line in calls]
    dims = ",".join(map(str, shape))
    return calls, aliased, len(re.findall(rf"\[{dims}\]\{{[^}}]*\}} copy\(", hlo))


def assert_same_op(got, want, dtype, what=""):
    """One op reached through two calls that differ in what else they compute
    (with and without the Z stash). The CPU runs one kernel for both: bit for
    bit. The GPU tunes each call signature on its own (ffi/cuda/tuner.cu) and
    may run each with another kernel: equal to docs/spec.md §5's tolerance."""
    if on_cpu():
        np.testing.assert_array_equal(f64(got), f64(want), err_msg=what)
    else:
        assert_rel(got, want, dtype, what=what)


def eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


# ---------------------------------------------------------------------------
# random inputs
# ---------------------------------------------------------------------------


class Rand:
    """Fresh random arrays: every call advances the generator."""

    def __init__(self, seed: int):
        self.seed = seed
        self.gen = np.random.default_rng(seed)

    def normal(self, shape, dtype=jnp.float32, scale=1.0):
        x = self.gen.standard_normal(tuple(shape)) * scale
        return jnp.asarray(x, dtype=dtype)

    def uniform(self, shape, dtype=jnp.float32, lo=-1.0, hi=1.0):
        return jnp.asarray(self.gen.uniform(lo, hi, tuple(shape)), dtype=dtype)

    def scalar(self, lo=0.25, hi=1.75) -> float:
        """A random Python float of random sign with lo <= |v| < hi (alpha, beta and the like)."""
        return float(self.gen.uniform(lo, hi) * self.gen.choice([-1.0, 1.0]))

    def key(self):
        return jax.random.key(int(self.gen.integers(0, 2**31 - 1)))

    def operands(self, m, n, k, dtype, *, trans_a=False, trans_b=False, bias_shape=None, with_c=False,
                 batch_a=(), batch_b=(), batch_c=()):  # fmt: skip
        """A, B, bias, C of the given shapes (A/B stored transposed when asked).

        Scaled so that Z is O(1) for any K (activations are exercised on both sides)."""
        s = 1.0 / math.sqrt(max(k, 1)) ** 0.5
        a = self.normal(batch_a + ((k, m) if trans_a else (m, k)), dtype, s)
        b = self.normal(batch_b + ((n, k) if trans_b else (k, n)), dtype, s)
        bias = None if bias_shape is None else self.normal(bias_shape, dtype, 0.5)
        c = self.normal(batch_c + (m, n), dtype) if with_c else None
        return a, b, bias, c


def _seed_for(nodeid: str) -> int:
    base = int(os.environ.get("REGEMM_TEST_SEED", "0"))
    h = hashlib.sha256(nodeid.encode()).digest()
    return (int.from_bytes(h[:4], "little") + base) % (2**31)


@pytest.fixture
def rand(request) -> Rand:
    return Rand(_seed_for(request.node.nodeid))


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


# The GPU test files whose tests run the CUTLASS kernels of the dtype they are given: in a build
# with REGEMM_CUTLASS_DTYPES leaving that dtype out (docs/environment.md) they skip.
_CUTLASS_FILES = ("test_gpu_cutlass.py", "test_gpu_tuner.py", "test_dgrad_dact.py", "test_gpu.py")
_FLOAT_NAMES = ("bfloat16", "float16", "float32")


def _dtype_names(value):
    """The float dtype names a test parameter names (a dtype, a dtype's name, or a tuple holding them)."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    names = set()
    for v in values:
        try:
            name = np.dtype(v).name if not isinstance(v, str) else v
        except TypeError:
            continue
        if name in _FLOAT_NAMES:
            names.add(name)
    return names


@pytest.fixture(autouse=True)
def _cutlass_dtype_built(request):
    from jax_regemm import _ffi  # (a query of the build, not of the package's math)

    built = _ffi.cutlass_dtypes()
    callspec = getattr(request.node, "callspec", None)
    if not built or callspec is None or request.node.path.name not in _CUTLASS_FILES:
        return
    missing = set().union(*(_dtype_names(v) for v in callspec.params.values())) - set(built)
    if missing:
        pytest.skip(f"this build has no CUTLASS kernels of {sorted(missing)} (REGEMM_CUTLASS_DTYPES)")


def pytest_collection_modifyitems(config, items):
    """REGEMM_TEST_SHARD=i/n: every n-th test from the i-th (1-based) in collection order, the rest
    deselected: the suite in n calls of a device whose calls are too short for the whole
    (tools/gpu_check.sh, GPU_CHECK_SHARD)."""
    shard = os.environ.get("REGEMM_TEST_SHARD")
    if not shard:
        return
    i, n = (int(v) for v in shard.split("/"))
    config.hook.pytest_deselected(items=[t for j, t in enumerate(items) if j % n != i - 1])
    items[:] = items[i - 1 :: n]
