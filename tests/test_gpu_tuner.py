"""The GPU's GEMM tuner (ffi/cuda/tuner.cu) and the ways it chooses among.

- Every way (cuBLASLt with its own epilogue or ours as a pass, several of its
  algorithms; the CUTLASS choices; the SIMT kernel) computes the op: each is
  forced with REGEMM_VARIANT and checked against the float64 reference.
- A signature is timed once; REGEMM_TUNE=0 times nothing; winners go to and
  come back from the REGEMM_TUNE_CACHE file; a damaged file costs nothing but
  a new timing.
- Under CUDA-graph capture nothing is timed; rg.autotune times a program's
  GEMMs beforehand, and the captured program then finds them.
Skipped without a GPU and the CUDA module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_regemm as rg
from jax_regemm import reference as ref


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


if not _gpus() or rg._ffi._regemm_cuda is None:
    pytest.skip("no GPU or no CUDA module: the tuner tests need both", allow_module_level=True)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _plain_gemms_on_regemm(monkeypatch):
    """Tests of the tuner's ways: a plain GEMM among them runs on the kernels, not XLA's dot."""
    monkeypatch.setenv("REGEMM_PLAIN_GEMM", "regemm")
cuda = rg._ffi._regemm_cuda
HOPPER = any(h in _gpus()[0].device_kind for h in ("H100", "H200", "H800", "GH200"))
CUTLASS = HOPPER and "cutlass_sm90" in rg.kernels()["cuda"]["gemm"]
TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 5e-3, "float32_exact": 1e-5}


def _rel(out, want):
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    assert out.shape == want.shape and np.all(np.isfinite(out))
    return float(np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-300))


def _problem(seed, dtype, m, n, k, *, act, kind, with_c, trans_a=False, trans_b=False):
    keys = jax.random.split(jax.random.key(seed), 4)
    nrm = lambda key, shape, s=1.0: (s * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    a = nrm(keys[0], (k, m) if trans_a else (m, k))
    b = nrm(keys[1], (n, k) if trans_b else (k, n), 1.0 / np.sqrt(k))
    bias = {"none": None, "scalar": nrm(keys[2], ()), "per_row": nrm(keys[2], (m,)), "per_col": nrm(keys[2], (n,))}[kind]
    c = nrm(keys[3], (m, n)) if with_c else None
    kw = dict(act=act, alpha=0.75, beta=-0.5 if with_c else 0.0, trans_a=trans_a, trans_b=trans_b)
    return (a, b, bias, c), kw


def _reference(args, kw, kind):
    a, b, bias, c = (None if x is None else jnp.asarray(x, jnp.float32) for x in args)
    return ref.gemm_bias_act(a, b, bias, c=c, bias_kind=kind if bias is not None else "per_col",
                             precision=lax.Precision.HIGHEST, return_z=True, **kw)  # fmt: skip


def _forward(args, kw, kind, store_z, precision=None):
    a, b, bias, c = args
    bk = None if kind == "none" else kind
    if store_z:
        f = jax.jit(lambda a, b, bias, c: rg.gemm_bias_act_fwd(a, b, bias, c=c, bias_kind=bk, precision=precision, **kw))
        return f(a, b, bias, c)
    f = jax.jit(lambda a, b, bias, c: rg.gemm_bias_act(a, b, bias, c=c, bias_kind=bk, precision=precision, **kw))
    return f(a, b, bias, c), None


# (dtype, exact f32, M, N, K, act, bias kind, C, Z, trans_a, trans_b, the ways that must exist)
_CUTLASS_WAYS = ["cutlass_sm90/coop128x256", "cutlass_sm90/ping128x128+pass", "cutlass_sm90/streamk128x128",
                 "cutlass_sm90/ping128x128c1"]
CASES = [
    # cuBLASLt's GELU_AUX_BIAS with C through beta; CUTLASS fused and split; SIMT
    ("bfloat16", False, 264, 392, 136, "gelu", "per_col", True, True, False, False,
     ["cublas/lt#0", "cublas/lt+pass#0", "cuda_simt/simt"] + (_CUTLASS_WAYS if CUTLASS else [])),
    ("bfloat16", False, 200, 136, 72, "relu", "per_col", False, False, False, True, ["cublas/lt#0", "cublas/lt+pass#0"]),
    ("float16", False, 129, 264, 40, "none", "per_col", False, False, True, False, ["cublas/lt#0", "cublas/lt+pass#0"]),
    ("float32", False, 136, 200, 96, "gelu", "none", False, True, True, True, ["cublas/lt#0", "cublas/lt+pass#0"]),
    ("bfloat16", False, 96, 104, 64, "sigmoid", "scalar", True, True, False, False, ["cublas/lt+pass#0"]),
    ("bfloat16", False, 64, 72, 40, "silu", "per_row", False, False, True, True, ["cublas/lt+pass#0"]),
    ("float32", True, 65, 72, 33, "relu", "per_col", True, False, False, False, ["cublas/lt#0", "cuda_simt/simt"]),
    ("bfloat16", False, 136, 264, 72, "none", "none", False, False, True, False,
     ["cublas/lt#0"] + (["cutlass_sm90/streamk128x128"] if CUTLASS else [])),
]
WAYS = [(case, way) for case in CASES for way in case[-1] + ["cublas/lt#1", "cublas/lt+pass#1"]]


@pytest.mark.parametrize("case,way", WAYS, ids=[f"{c[0]}-{c[5]}-{c[6]}-{w}" for c, w in WAYS])
def test_every_way_computes_the_op(case, way, monkeypatch):
    dtype, exact, m, n, k, act, kind, with_c, store_z, ta, tb, must = case
    monkeypatch.setenv("REGEMM_VARIANT", way)
    cuda.forget_tuned()
    args, kw = _problem(CASES.index(case), dtype, m, n, k, act=act, kind=kind, with_c=with_c,
                        trans_a=ta, trans_b=tb)  # fmt: skip
    y, z = _forward(args, kw, kind, store_z, precision="highest" if exact else None)
    ran = set(rg.tuned().values())
    if way in must:
        assert ran == {way}, ran
    y_ref, z_ref = _reference(args, kw, kind)
    tol = TOL["float32_exact" if exact else dtype]
    assert _rel(y, y_ref) < tol, (way, ran, _rel(y, y_ref))
    if store_z:
        assert _rel(z, z_ref) < tol, (way, ran, _rel(z, z_ref))


# Every CUTLASS tile configuration for every dtype and layout (CASES reaches
# each configuration in one layout only): its own kernel object each.
_CONFIG_WAYS = [f"cutlass_sm90/{c}" for c in ("coop128x256", "ping128x128", "streamk128x128", "ping128x128c1")]


def _check_forced_way(way, seed, dtype, m, n, k, act, with_c, monkeypatch, ta=False, tb=False):
    """The forward (Y and Z) with REGEMM_VARIANT=way: that way runs, and matches the reference."""
    monkeypatch.setenv("REGEMM_VARIANT", way)
    cuda.forget_tuned()
    args, kw = _problem(seed, dtype, m, n, k, act=act, kind="per_col", with_c=with_c, trans_a=ta, trans_b=tb)
    y, z = _forward(args, kw, "per_col", store_z=True)
    ran = set(rg.tuned().values())
    assert ran == {way}, ran
    y_ref, z_ref = _reference(args, kw, "per_col")
    assert _rel(y, y_ref) < TOL[dtype], (way, act, _rel(y, y_ref))
    assert _rel(z, z_ref) < TOL[dtype], (way, act, _rel(z, z_ref))
    return np.asarray(y), np.asarray(z)


@pytest.mark.skipif(not CUTLASS, reason="needs a Hopper GPU and the CUTLASS kernels")
@pytest.mark.parametrize("way", _CONFIG_WAYS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_every_config_kernel(way, dtype, ta, tb, monkeypatch):
    _check_forced_way(way, _CONFIG_WAYS.index(way), dtype, 264, 200, 136, "silu", True, monkeypatch, ta, tb)


# Every activation in every configuration's fused epilogue: the cheap ones are
# inline, the costly ones out-of-line calls in the configurations with
# kActCall and inline in the others (cutlass_epilogue.cuh).
@pytest.mark.skipif(not CUTLASS, reason="needs a Hopper GPU and the CUTLASS kernels")
@pytest.mark.parametrize("way", _CONFIG_WAYS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("act", rg.ACTIVATIONS)
def test_every_activation_in_every_config(way, dtype, act, monkeypatch):
    seed = 8 * _CONFIG_WAYS.index(way) + rg.ACTIVATIONS.index(act)
    _check_forced_way(way, seed, dtype, 200, 264, 136, act, False, monkeypatch)


# The kernels of one costly activation (ffi/cuda/cutlass/cutlass_kernels.h, kOneActs:
# ping128x128c1, every dtype and layout, built without C): each runs where
# its activation is asked for without C, matches the reference, and gives the
# bits of the every-activation kernel (REGEMM_CUTLASS_ONE_ACT=0), which computes
# the same expressions as out-of-line calls; with a C the every-activation
# kernel runs.
@pytest.mark.skipif(not CUTLASS, reason="needs a Hopper GPU and the CUTLASS kernels")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("act", ["gelu", "gelu_erf", "sigmoid", "silu"])
def test_one_act_kernels(dtype, ta, tb, act, monkeypatch):
    way, seed = "cutlass_sm90/ping128x128c1", 40 + rg.ACTIVATIONS.index(act)
    n0 = cuda.cutlass_one_act_launches()
    y1, z1 = _check_forced_way(way, seed, dtype, 264, 392, 136, act, False, monkeypatch, ta, tb)
    assert cuda.cutlass_one_act_launches() == n0 + 1
    _check_forced_way(way, seed, dtype, 264, 392, 136, act, True, monkeypatch, ta, tb)  # with C
    assert cuda.cutlass_one_act_launches() == n0 + 1
    monkeypatch.setenv("REGEMM_CUTLASS_ONE_ACT", "0")
    y0, z0 = _check_forced_way(way, seed, dtype, 264, 392, 136, act, False, monkeypatch, ta, tb)
    assert cuda.cutlass_one_act_launches() == n0 + 1
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(z1, z0)


def _gelu_layer(seed=0, m=192, n=256, k=128):
    args, kw = _problem(seed, "bfloat16", m, n, k, act="gelu", kind="per_col", with_c=False)
    return args[:3], jax.jit(lambda a, b, bias: rg.gemm_bias_act(a, b, bias, act="gelu"))


def test_times_a_signature_once():
    cuda.forget_tuned()
    (a, b, bias), f = _gelu_layer()
    n0 = cuda.tuning_count()
    y = f(a, b, bias)
    assert cuda.tuning_count() == n0 + 1
    (label,) = rg.tuned().values()
    assert "/" in label, label  # entry/variant: something was timed and won
    (a2, b2, bias2), _ = _gelu_layer(seed=1)  # same signature, other values
    y2 = f(a2, b2, bias2)
    assert cuda.tuning_count() == n0 + 1
    kw = dict(act="gelu", alpha=1.0, beta=0.0, trans_a=False, trans_b=False)
    for out, args in ((y, (a, b, bias, None)), (y2, (a2, b2, bias2, None))):
        assert _rel(out, _reference(args, kw, "per_col")[0]) < TOL["bfloat16"]


@pytest.mark.parametrize("margin", [None, "0", "1000"])
def test_the_rules_way_keeps_ties(margin, capfd, monkeypatch):
    """The tuner keeps the rule's way (what runs untimed) unless another is faster than it by
    more than REGEMM_TUNE_MARGIN percent (default 3; 0: the fastest; 1000: the rule's way
    whenever it runs), checked on the times it logs; at 4 tiles of 128x128 the rule's way is
    CUTLASS's stream-K kernel (cutlass_dispatch.cu). The result against the reference."""
    from conftest import assert_tuner_kept

    monkeypatch.setenv("REGEMM_TUNE_LOG", "1")
    if margin is None:
        monkeypatch.delenv("REGEMM_TUNE_MARGIN", raising=False)
    else:
        monkeypatch.setenv("REGEMM_TUNE_MARGIN", margin)
    cuda.forget_tuned()
    (a, b, bias), f = _gelu_layer(m=232)
    capfd.readouterr()
    y = f(a, b, bias).block_until_ready()
    ((times, rule, chose, pct),) = assert_tuner_kept(capfd.readouterr().err).values()
    assert pct == float(margin or 3) and len(times) > 1 and rule in times, (times, rule)
    if CUTLASS:
        assert rule == "cutlass_sm90/streamk128x128", rule
    if margin == "1000":
        assert chose == rule
    if margin == "0":
        assert times[chose] == min(times.values()), (times, chose)
    assert list(rg.tuned().values()) == [chose]
    kw = dict(act="gelu", alpha=1.0, beta=0.0, trans_a=False, trans_b=False)
    assert _rel(y, _reference((a, b, bias, None), kw, "per_col")[0]) < TOL["bfloat16"]


def test_the_first_listed_way_is_the_rule_without_a_rule_way(capfd, monkeypatch):
    """An entry that names no rule_way (cuBLAS's, the SIMT kernel's: registry.h) runs the first
    way it lists: with REGEMM_BACKEND=cublas an f32 gelu layer's rule is cuBLAS's entry, and the
    tuner must take the first cuBLAS way it times as the rule's way (the margin then keeps it on
    a tie, assert_tuner_kept). The result against the reference."""
    from conftest import assert_tuner_kept

    monkeypatch.setenv("REGEMM_TUNE_LOG", "1")
    monkeypatch.setenv("REGEMM_BACKEND", "cublas")
    cuda.forget_tuned()
    args, kw = _problem(0, "float32", 256, 192, 128, act="gelu", kind="per_col", with_c=False)
    capfd.readouterr()
    y, _ = _forward(args, kw, "per_col", False)
    y = y.block_until_ready()
    ((times, rule, chose, pct),) = assert_tuner_kept(capfd.readouterr().err).values()
    assert len(times) > 1 and all(w.startswith("cublas/") for w in times), times
    assert rule == next(iter(times)), (rule, list(times))
    assert _rel(y, _reference(args, kw, "per_col")[0]) < TOL["float32"]


def test_timing_holds_are_released(monkeypatch):
    """Each round of timed runs waits behind a hold until the host has queued it. Where the
    device is slower than the host, the host releases a round before the device reaches its
    hold, which must then end at once, not at its 50 ms limit (a timing of 10 rounds took
    ~0.45 s longer so). One limit reached is allowed: a host thread descheduled for 50 ms."""
    monkeypatch.setenv("REGEMM_TUNE_REPS", "10")
    cuda.forget_tuned()
    (a, b, bias), f = _gelu_layer(m=1024, n=2048, k=2048)
    n0, t0 = cuda.tuner_hold_timeouts(), cuda.tuning_count()
    y = f(a, b, bias).block_until_ready()
    assert cuda.tuning_count() == t0 + 1
    assert cuda.tuner_hold_timeouts() - n0 <= 1, cuda.tuner_hold_timeouts() - n0
    kw = dict(act="gelu", alpha=1.0, beta=0.0, trans_a=False, trans_b=False)
    assert _rel(y, _reference((a, b, bias, None), kw, "per_col")[0]) < TOL["bfloat16"]


def test_way_variables_are_part_of_the_signature(monkeypatch):
    """A variable that changes the candidates, set between two calls of one
    compiled program, gets a signature (and a winner) of its own; unset, the
    first winner is found again without timing."""
    monkeypatch.delenv("REGEMM_VARIANT", raising=False)
    cuda.forget_tuned()
    (a, b, bias), f = _gelu_layer(m=216)
    f(a, b, bias).block_until_ready()
    n0 = cuda.tuning_count()
    ((plain_sig, plain_label),) = rg.tuned().items()
    way = "cublas/lt#0"
    monkeypatch.setenv("REGEMM_VARIANT", way)
    y = f(a, b, bias)
    tuned = rg.tuned()
    assert len(tuned) == 2 and tuned[plain_sig] == plain_label, tuned
    assert tuned[plain_sig + " REGEMM_VARIANT=" + way] == way, tuned
    kw = dict(act="gelu", alpha=1.0, beta=0.0, trans_a=False, trans_b=False)
    assert _rel(y, _reference((a, b, bias, None), kw, "per_col")[0]) < TOL["bfloat16"]
    monkeypatch.delenv("REGEMM_VARIANT")
    f(a, b, bias).block_until_ready()
    assert cuda.tuning_count() == n0 and len(rg.tuned()) == 2


def test_host_marks():
    """The host timeline (host_marks.h): every handler call passes its phases in order, on one clock."""
    (a, b, bias), f = _gelu_layer(m=224)
    f(a, b, bias).block_until_ready()  # tuned, outside the record
    cuda.host_marks(True)
    f(a, b, bias).block_until_ready()
    marks = cuda.host_marks(False)
    names = ["begin", "started", "signed", "way", "launch", "end"]  # HostPhase
    phases = [names[p] for p, _ in marks]
    assert phases[:4] == names[:4] and phases[-1] == "end" and "launch" in phases, phases  # a way may launch twice
    times = [t for _, t in marks]
    assert times == sorted(times), marks
    f(a, b, bias).block_until_ready()
    assert cuda.host_marks(False) == []  # off: nothing recorded


def test_tuning_off(monkeypatch):
    monkeypatch.setenv("REGEMM_TUNE", "0")
    cuda.forget_tuned()
    (a, b, bias), f = _gelu_layer(m=200)
    n0 = cuda.tuning_count()
    f(a, b, bias).block_until_ready()
    assert cuda.tuning_count() == n0 and rg.tuned() == {}


def test_disk_cache(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    monkeypatch.setenv("REGEMM_TUNE_CACHE", str(path))
    cuda.forget_tuned()
    (a, b, bias), f = _gelu_layer(m=208)
    n0 = cuda.tuning_count()
    y = f(a, b, bias)
    assert cuda.tuning_count() == n0 + 1
    (label,) = rg.tuned().values()
    saved = json.loads(path.read_text())["entries"]
    assert list(saved.values()) == [label], saved
    cuda.forget_tuned()  # a new process, as far as the tuner knows: the winner comes from the file
    y2 = jax.jit(lambda a, b, bias: rg.gemm_bias_act(a, b, bias, act="gelu"))(a, b, bias)
    assert cuda.tuning_count() == n0 + 1 and list(rg.tuned().values()) == [label]
    assert _rel(y2, y) < 1e-6  # the same way, the same bits (up to nothing)
    path.write_text('{"entries": {\n"garbage')  # a damaged file: timed again, and rewritten whole
    cuda.forget_tuned()
    f(a, b, bias).block_until_ready()
    assert cuda.tuning_count() == n0 + 2
    assert list(json.loads(path.read_text())["entries"].values()) == list(rg.tuned().values())


_CAPTURE_SCRIPT = textwrap.dedent(
    r"""
    import json, os, sys
    import jax, jax.numpy as jnp
    import jax_regemm as rg
    cuda = rg._ffi._regemm_cuda
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (256, 128), jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (128, 256)) / 12).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[2], (256, 64)) / 16).astype(jnp.bfloat16)
    b = jnp.ones((256,), jnp.bfloat16)

    def loss(w1, w2, x):
        h = rg.dense(x, w1, b, act="gelu")
        return jnp.mean(rg.dense(h, w2, act="relu").astype(jnp.float32) ** 2)

    g = jax.grad(loss, argnums=(0, 1))
    step = jax.jit(g)
    # XLA runs a captured program's first execution op by op (its warm-up) and
    # records the CUDA graph on the second. Untimed warm-up, so that the
    # recording is the tuner's first sight of every GEMM:
    os.environ["REGEMM_TUNE"] = "0"
    jax.block_until_ready(step(w1, w2, x))
    del os.environ["REGEMM_TUNE"]
    for _ in range(3):
        jax.block_until_ready(step(w1, w2, x))
    out = {"captured_calls": cuda.captured_calls(), "timed_captured": cuda.tuning_count()}
    # A program of other shapes: rg.autotune times its GEMMs (graphs off) ...
    x2 = jnp.concatenate([x, x])
    rg.autotune(g, w1, w2, x2)
    out["timed_autotune"] = cuda.tuning_count()
    out["winners"] = sorted(set(rg.tuned().values()))
    # ... and the program itself, warm-up and recording included, times nothing more.
    step2 = jax.jit(lambda *a: g(*a))
    for _ in range(3):
        jax.block_until_ready(step2(w1, w2, x2))
    out["timed_after"] = cuda.tuning_count()
    out["captured_after"] = cuda.captured_calls()
    print(json.dumps(out))
    """
)


def test_capture_times_nothing_and_autotune_does(tmp_path):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1").strip()  # fmt: skip
    env.pop("REGEMM_TUNE", None)
    env.pop("REGEMM_TUNE_CACHE", None)
    script = tmp_path / "capture.py"
    script.write_text(_CAPTURE_SCRIPT)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["captured_calls"] > 0, out  # the recording ran the handlers under capture ...
    assert out["timed_captured"] == 0, out  # ... and they timed nothing there
    assert out["timed_autotune"] > 0 and out["winners"] and "rule" not in out["winners"], out
    assert out["timed_after"] == out["timed_autotune"] and out["captured_after"] > out["captured_calls"], out
