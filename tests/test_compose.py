"""jax_regemm composes with the rest of JAX: forward-mode and second-order
derivatives for every activation, jax.export round trips, errors in the
dense layer's words, and, with 8 host devices (in a subprocess: the device
count is fixed at start-up), the shardings and collectives of sharded jit,
Explicit-axis meshes and shard_map, each against plain `jnp` doing the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_rel
from jax.test_util import check_grads

import jax_regemm as rg
from jax_regemm import reference as R

M, K, N = 6, 5, 4
DT = jnp.float64


# ---------------------------------------------------------------------------
# forward mode and second order
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("act", rg.ACTIVATIONS)
@pytest.mark.parametrize("save", ["auto", "z", "recompute"])
def test_check_grads_second_order_both_modes(x64, rand, act, save):
    """check_grads(order=2, modes=("fwd", "rev")) on every operand, with C and a bias."""
    a, b, bias, c = rand.operands(M, N, K, DT, bias_shape=(N,), with_c=True)
    if act in ("relu", "leaky_relu"):  # keep Z away from the kink: finite differences straddle it
        c = c + jnp.where(c >= 0, 1.0, -1.0)
    f = lambda a, b, bias, c: rg.gemm_bias_act(a, b, bias, c=c, beta=0.5, alpha=1.5, act=act, save=save)
    check_grads(f, (a, b, bias, c), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("kind", ["scalar", "per_row", "per_col"])
@pytest.mark.parametrize("trans", [(False, False), (True, True)])
def test_jvp_every_bias_kind_and_layout(x64, rand, kind, trans):
    ta, tb = trans
    shape = {"scalar": (), "per_row": (M,), "per_col": (N,)}[kind]
    a, b, bias, _ = rand.operands(M, N, K, DT, bias_shape=shape, trans_a=ta, trans_b=tb)
    tangents = tuple(rand.normal(x.shape, DT) for x in (a, b, bias))
    kw = dict(act="silu", trans_a=ta, trans_b=tb, bias_kind=kind)
    got = jax.jvp(lambda a, b, bias: rg.gemm_bias_act(a, b, bias, **kw), (a, b, bias), tangents)
    want = jax.jvp(lambda a, b, bias: R.gemm_bias_act(a, b, bias, **kw), (a, b, bias), tangents)
    for g, w in zip(got, want):
        assert_rel(g, w, DT)


def test_jvp_of_the_z_output_and_hessian(x64, rand):
    """The Z output has a true tangent (needed by "JVP of JVP"), and jax.hessian agrees."""
    a, b, bias, _ = rand.operands(M, N, K, DT, bias_shape=(N,))
    da = rand.normal(a.shape, DT)
    (y, z), (dy, dz) = jax.jvp(lambda a: rg.gemm_bias_act_fwd(a, b, bias, act="gelu"), (a,), (da,))
    (yr, zr), (dyr, dzr) = jax.jvp(lambda a: R.gemm_bias_act(a, b, bias, act="gelu", return_z=True), (a,), (da,))
    for g, w in ((y, yr), (z, zr), (dy, dyr), (dz, dzr)):
        assert_rel(g, w, DT)
    h = jax.hessian(lambda b: jnp.sum(rg.gemm_bias_act(a, b, bias, act="tanh") ** 3))(b)
    hr = jax.hessian(lambda b: jnp.sum(R.gemm_bias_act(a, b, bias, act="tanh") ** 3))(b)
    assert_rel(h, hr, DT)


def test_checkpoint(x64, rand):
    """jax.checkpoint around a layer: gradients as the reference's."""
    x, w, b, _ = rand.operands(M, N, K, DT, bias_shape=(N,))
    f = jax.checkpoint(lambda x, w, b: jnp.sum(jnp.sin(rg.dense(x, w, b, act="silu"))))
    r = lambda x, w, b: jnp.sum(jnp.sin(R.dense(x, w, b, act="silu")))
    for g, gr in zip(jax.grad(f, argnums=(0, 1, 2))(x, w, b), jax.grad(r, argnums=(0, 1, 2))(x, w, b)):
        assert_rel(g, gr, DT)


def test_grad_computes_only_what_is_asked(rand):
    """grad with respect to w alone: the forward, the dact pass without a bias gradient, one wgrad GEMM."""
    x, w, b, _ = rand.operands(M, N, K, jnp.float32, bias_shape=(N,))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(rg.dense(x, w, b, act="gelu"))))(w))
    assert jaxpr.count("regemm_fused[") == 2 and jaxpr.count("regemm_dact[") == 1, jaxpr
    assert "bias_kind='none'" in jaxpr.split("regemm_dact[")[1].split("]")[0]


# ---------------------------------------------------------------------------
# jax.export
# ---------------------------------------------------------------------------


def test_export_round_trip_symbolic_batch(rand):
    """A jitted forward and a gradient export with a symbolic batch, serialize,
    deserialize and run; without the documented disabled checks export refuses."""
    x, w, b, _ = rand.operands(8, N, K, jnp.float32, bias_shape=(N,))
    f = jax.jit(lambda x, w, b: rg.dense(x, w, b, act="gelu"))
    g = jax.jit(jax.grad(lambda x, w, b: jnp.sum(rg.dense(x, w, b, act="gelu") ** 2), argnums=1))
    with pytest.raises(ValueError, match="custom calls"):
        jax.export.export(f)(x, w, b)
    (batch,) = jax.export.symbolic_shape("B")
    spec = (jax.ShapeDtypeStruct((batch, K), x.dtype), w, b)
    for fn, ref in ((f, lambda x, w, b: R.dense(x, w, b, act="gelu")),
                    (g, jax.grad(lambda x, w, b: jnp.sum(R.dense(x, w, b, act="gelu") ** 2), argnums=1))):  # fmt: skip
        exp = jax.export.export(fn, disabled_checks=rg.disabled_export_checks())(*spec)
        back = jax.export.deserialize(exp.serialize())
        for rows in (8, 3):
            xr = rand.normal((rows, K), jnp.float32)
            assert_rel(back.call(xr, w, b), ref(xr, w, b), jnp.float32)
    names = {str(c) for c in rg.disabled_export_checks()}
    assert len(names) == 3 and all("_v1" in n for n in names), names


# ---------------------------------------------------------------------------
# errors in the user's words
# ---------------------------------------------------------------------------


def test_dense_errors_name_x_w_b(rand):
    x, w = rand.normal((M, K)), rand.normal((K, N))
    with pytest.raises(ValueError, match=r"w must have rank 2 \(\[K, N\]\), got shape \(2, 5, 4\)"):
        rg.dense(x, rand.normal((2, K, N)))
    with pytest.raises(TypeError, match="x must be an array, got list"):
        rg.dense([[1.0] * K], w)
    with pytest.raises(ValueError, match=r"contraction sizes differ: x \(6, 5\).*w \(4, 4\)"):
        rg.dense(x, rand.normal((N, N)))
    with pytest.raises(ValueError, match=r"b of shape \(3,\) does not fit"):
        rg.dense(x, w, rand.normal((3,)))
    with pytest.raises(TypeError, match="b has dtype float16 but x has float32"):
        rg.dense(x, w, rand.normal((N,), jnp.float16))


@pytest.mark.parametrize("name", ["alpha", "beta", "leaky_slope"])
@pytest.mark.parametrize("value,err", [(float("nan"), ValueError), (float("inf"), ValueError), ("2", TypeError),
                                       (True, TypeError), (jnp.float32(2.0), TypeError)])  # fmt: skip
def test_scalars_must_be_finite_numbers(rand, name, value, err):
    a, b, _, c = rand.operands(M, N, K, jnp.float32, with_c=True)
    with pytest.raises(err, match=name):
        rg.gemm_bias_act(a, b, c=c, act="leaky_relu", **{name: value})


# ---------------------------------------------------------------------------
# sharding: 8 host devices, against plain jnp in the same process
# ---------------------------------------------------------------------------

_SCRIPT = r"""
import json, os, re, sys
MESH = tuple(int(v) for v in os.environ["MESH"].split(","))  # (data, model)
if os.environ["PLATFORM"] == "cpu":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import jax_regemm as rg
if os.environ["PLATFORM"] == "gpu":  # true f32 on both sides: their values compared at 1e-5
    jax.config.update("jax_default_matmul_precision", "highest")

rng = np.random.default_rng(int(os.environ["SEED"]))
arr = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)
x, w1, b1, w2, b2 = arr(32, 16), arr(16, 24), arr(24), arr(24, 16), arr(16)
COLL = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

def collectives(f, *args):
    hlo = jax.jit(f).lower(*args).compile().as_text()
    return {k: len(re.findall(rf"\b{k}(-start)?\(", hlo)) for k in COLL}

def mlp(dense):  # column-parallel then row-parallel (Megatron), or plain data-parallel
    return lambda x, w1, b1, w2, b2: dense(dense(x, w1, b1, "gelu"), w2, b2, "none")

ours = mlp(lambda x, w, b, act: rg.dense(x, w, b, act=act))
block = lambda x, w1, b1, w2, b2: rg.mlp(x, [w1, w2], [b1, b2], act="gelu")  # its backward: dgrad_dact
plain = mlp(lambda x, w, b, act: jax.nn.gelu(x @ w + b, approximate=True) if act == "gelu" else x @ w + b)
step = lambda f: jax.grad(lambda *p: jnp.sum(f(*p) ** 2), argnums=(0, 1, 2, 3, 4))
rel = lambda u, v: float(jnp.linalg.norm(u - v) / jnp.linalg.norm(v))
LAYOUTS = {  # x, w1, b1, w2, b2
    "data": (P("data", None), P(), P(), P(), P()),
    "tensor": (P(), P(None, "model"), P("model"), P("model", None), P()),
    "both": (P("data", None), P(None, "model"), P("model"), P("model", None), P()),
    "data_unplaced": (P("data", None), None, None, None, None),  # parameters made outside the mesh, not placed
}
out = {}
for kind in ("auto", "explicit"):
    types = (AxisType.Explicit,) * 2 if kind == "explicit" else (AxisType.Auto,) * 2
    mesh = jax.make_mesh(MESH, ("data", "model"), axis_types=types)
    with jax.set_mesh(mesh):
        for name, specs in LAYOUTS.items():
            args = [v if s is None else jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip((x, w1, b1, w2, b2), specs)]
            rec = {}
            for tag, f in (("ours", ours), ("block", block), ("plain", plain)):
                try:
                    y = jax.jit(f)(*args)
                except Exception as e:  # noqa: BLE001
                    rec[tag] = {"error": type(e).__name__}  # Explicit axes, K sharded: jnp asks for out_sharding
                    continue
                g = jax.jit(step(f))(*args)
                rec[tag] = dict(
                    y_spec=str(y.sharding.spec), y_type=str(jax.typeof(y).sharding.spec),
                    g_specs=[str(v.sharding.spec) for v in g], coll_fwd=collectives(f, *args),
                    coll_step=collectives(step(f), *args), y=y, g=g)
            if any("error" in r for r in rec.values()):
                out[f"{kind}/{name}"] = {t: r if "error" in r else {} for t, r in rec.items()}
                continue
            for tag in ("ours", "block"):
                r = rec[tag]
                r["err_y"] = rel(r.pop("y"), rec["plain"]["y"])
                r["err_g"] = max(rel(u, v) for u, v in zip(r.pop("g"), rec["plain"]["g"]))
            del rec["plain"]["y"], rec["plain"]["g"]
            out[f"{kind}/{name}"] = rec

# shard_map: grad and jit(grad), data- and tensor-parallel, default checks
mesh = jax.make_mesh(MESH, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
dense_ours = lambda x, w, b, act: rg.dense(x, w, b, act=act)
def dense_plain(x, w, b, act):
    z = x @ w if b is None else x @ w + b
    return jax.nn.gelu(z, approximate=True) if act == "gelu" else z
def sm_loss(dense, tensor):
    def local(x, w1, b1, w2, b2):
        h = dense(x, w1, b1, "gelu")
        if tensor:  # row-parallel: partial products summed over "model", the bias added once after
            y = jax.lax.psum(dense(h, w2, None, "none"), "model") + b2
            return jnp.sum(y ** 2)
        return jax.lax.psum(jnp.sum(dense(h, w2, b2, "none") ** 2), "data")
    specs = (P(), P(None, "model"), P("model"), P("model", None), P()) if tensor else LAYOUTS["data"]
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P()), specs
for name in ("data", "tensor"):
    res = {}
    with jax.set_mesh(mesh):
        for tag, d in (("ours", dense_ours), ("plain", dense_plain)):
            f, specs = sm_loss(d, name == "tensor")
            args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip((x, w1, b1, w2, b2), specs)]
            grad = jax.grad(f, argnums=(0, 1, 2, 3, 4))
            res[tag] = (grad(*args), jax.jit(grad)(*args))
        out[f"shard_map/{name}"] = max(rel(u, v) for k in (0, 1) for u, v in zip(res["ours"][k], res["plain"][k]))
# rg.mlp inside shard_map, data-parallel: its folded backward on the local blocks
res = {}
with jax.set_mesh(mesh):
    for tag, m in (("ours", rg.mlp), ("plain", rg.reference.mlp)):
        local = lambda x, w1, b1, w2, b2, m=m: jax.lax.psum(jnp.sum(m(x, [w1, w2], [b1, b2], act="gelu") ** 2), "data")
        f = jax.shard_map(local, mesh=mesh, in_specs=LAYOUTS["data"], out_specs=P())
        args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip((x, w1, b1, w2, b2), LAYOUTS["data"])]
        grad = jax.grad(f, argnums=(0, 1, 2, 3, 4))
        res[tag] = (grad(*args), jax.jit(grad)(*args))
out["shard_map/block"] = max(rel(u, v) for k in (0, 1) for u, v in zip(res["ours"][k], res["plain"][k]))
print("RESULT" + json.dumps(out))
"""


def _gpus():
    return jax.device_count("gpu") if jax.default_backend() == "gpu" else 0


# 8 host devices as a 2x4 mesh (CI); on a machine with two GPUs, the same programs over NCCL,
# data- and tensor-parallel (meshes 2x1 and 1x2)
@pytest.fixture(scope="module", params=[("cpu", "2,4"), ("gpu", "2,1"), ("gpu", "1,2")], ids=lambda p: f"{p[0]}-{p[1]}")
def sharded(request, tmp_path_factory):
    platform, mesh = request.param
    if platform == "gpu" and _gpus() < 2:
        pytest.skip("needs two GPUs")
    seed = int.from_bytes(request.node.nodeid.encode()[:4], "little") % 1000
    env = dict(os.environ, SEED=str(seed), PLATFORM=platform, MESH=mesh, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path_factory.mktemp("sharded"))  # the installed package, not the source tree  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT")[-1])


@pytest.mark.parametrize("op", ["ours", "block"])
@pytest.mark.parametrize("mesh", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ["data", "tensor", "both", "data_unplaced"])
def test_sharded_mlp_as_plain_jnp(sharded, op, mesh, layout):
    """A two-layer MLP (column- then row-parallel for "tensor"), as two `dense` layers ("ours")
    and as `rg.mlp` ("block", whose backward folds the gelu' into the second layer's dgrad), and
    its training step's gradient: the output sharding (and sharding type), the gradients'
    shardings and the count of each collective in the compiled HLO equal plain jnp's; the
    values agree. "data_unplaced": the parameters as made, outside the mesh (unsharded types under
    Explicit axes: the gradients take their types as jnp's transposes give them)."""
    rec = sharded[f"{mesh}/{layout}"]
    ours, plain = rec[op], rec["plain"]
    if "error" in plain:  # Explicit axes with K sharded: jnp raises (no out_sharding given); so do we
        assert ours == plain
        return
    assert ours["err_y"] < 1e-5 and ours["err_g"] < 1e-5, (ours["err_y"], ours["err_g"])
    for key in ("y_spec", "y_type", "g_specs", "coll_fwd", "coll_step"):
        assert ours[key] == plain[key], (key, ours[key], plain[key])


@pytest.mark.parametrize("layout", ["data", "tensor", "block"])
def test_grad_through_shard_map(sharded, layout):
    """grad and jit(grad) through shard_map with its default checks, as plain jnp ("block":
    rg.mlp, data-parallel)."""
    assert sharded[f"shard_map/{layout}"] < 1e-5
