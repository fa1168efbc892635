"""Sharding: jit over meshes of host devices (in subprocesses: the device count is fixed at start-up),
Explicit axes and shard_map, each against plain jnp doing the same (docs/spec.md §6b); the partitioned
layer backward and the bias gradients' sums over devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_regemm as rg


# ---------------------------------------------------------------------------
# sharding (docs/spec.md §1): 4 host devices, in a subprocess (the device count is fixed at start-up)
# ---------------------------------------------------------------------------

_SHARDING_SCRIPT = r"""
import json, os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_regemm as rg
from jax_regemm import reference as R

mesh = jax.make_mesh((4,), ("data",))
rng = np.random.default_rng(int(os.environ["SEED"]))
x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
w = jnp.asarray(rng.standard_normal((8, 6)) / 3, jnp.float32)
b = jnp.asarray(rng.standard_normal((6,)), jnp.float32)
put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
xs, ws, bs = put(x, P("data", None)), put(w, P()), put(b, P())
rel = lambda u, v: float(np.linalg.norm(np.asarray(u, np.float64) - np.asarray(v, np.float64)) / np.linalg.norm(np.asarray(v, np.float64)))
out = {}
out["jit"] = rel(jax.jit(lambda x, w, b: rg.dense(x, w, b, act="gelu"))(xs, ws, bs), R.dense(x, w, b, act="gelu"))
loss = lambda d: (lambda x, w, b: jnp.sum(d(x, w, b, act="gelu") ** 2))
g = jax.jit(jax.grad(loss(rg.dense), argnums=(0, 1, 2)))(xs, ws, bs)
gr = jax.grad(loss(R.dense), argnums=(0, 1, 2))(x, w, b)
out["grad"] = max(rel(u, v) for u, v in zip(g, gr))
sm = jax.jit(jax.shard_map(lambda x, w, b: rg.dense(x, w, b, act="gelu"), mesh=mesh,
                           in_specs=(P("data"), P(), P()), out_specs=P("data")))
y = sm(xs, ws, bs)
out["shard_map"] = rel(y, R.dense(x, w, b, act="gelu"))
out["shard_map_sharding"] = str(y.sharding.spec)
print("RESULT" + json.dumps(out))
"""


def test_sharding_data_parallel(rand, tmp_path):
    """jit over data-sharded inputs and shard_map over a 4-device host mesh: the same numbers
    as the reference (values and gradients)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, SEED=str(rand.seed))
    proc = subprocess.run([sys.executable, "-c", _SHARDING_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT")[-1])
    assert out["jit"] < 1e-5 and out["shard_map"] < 1e-5 and out["grad"] < 1e-5, out
    assert "data" in out["shard_map_sharding"]




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



_ONE_GPU_SCRIPT = r"""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import jax_regemm as rg
from jax_regemm import _ffi, _partition, _targets
_ffi._in_place = lambda platform, target, avals, attrs: {2: 0} if platform == "cuda" and target == _targets.DGRAD_DACT.name else {}
ops = []
_lb = _partition.layer_backward
_partition.layer_backward = lambda *a, **k: (ops.append(k["in_place"]), _lb(*a, **k))[1]
m, d = 4096, 1024
ws, bs = [jnp.ones((d, d)) / d] * 4, [jnp.zeros(d)] * 4
dense = lambda x, ws, bs: [x := rg.dense(x, w, b, act="relu" if i < 3 else "none") for i, (w, b) in enumerate(zip(ws, bs))][-1]
mesh = jax.make_mesh((2,), ("d",), axis_types=(AxisType.Auto,))
for name, block in (("mlp", lambda x, ws, bs: rg.mlp(x, ws, bs, act="relu")), ("dense", dense)):
    for where, x in (("one", jnp.ones((m, d))), ("two", jax.device_put(jnp.ones((m, d)), NamedSharding(mesh, P("d"))))):
        f = jax.grad(lambda x, ws, bs: jnp.sum(block(x, ws, bs) ** 2), argnums=(1, 2))
        ops.clear()
        lowered = jax.jit(f).trace(x, ws, bs).lower(lowering_platforms=("cuda",))
        assert lowered.compiler_ir().operation.verify()  # (the wgrad's result read after the op that makes it)
        text = lowered.as_text()
        operands = lambda target: sorted({l.split("(", 1)[1].split(")")[0].count("%") for l in text.splitlines()
                                          if f"@{target}(" in l})  # partitioned: in JAX's partitioner calls
        print(name, where, text.count("@regemm_dgrad_dact_v1("), text.count("output_operand_aliases"),
              operands("regemm_dgrad_dact_v1"), operands("CustomSPMDPartitioning"), "".join("FT"[x] for x in ops))
"""


def test_gz_over_y_after_the_wgrad_on_one_gpu_and_partitioned(tmp_path):
    """rg.mlp's and the fold's dgrad_dact calls lowered for CUDA (the CUDA module's in-place answer
    stubbed, two host devices): over Y, after the wgrad (a fourth operand), in a program of one
    device, whatever the process's device count; partitioned over two devices, each call is one
    partitioner op with the wgrad (_partition.layer_backward: five operands, asked to write over Y),
    and the program stays valid where it reads the wgrad's result from that op."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _ONE_GPU_SCRIPT], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # the installed package, not the source tree  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = {tuple(line.split()[:2]): line.split(None, 2)[2].strip() for line in proc.stdout.splitlines()}
    for name in ("mlp", "dense"):
        assert got[(name, "one")] == "3 3 [4] []", got
        # the top layer's bias gradient (one operand), the forward's ops of three operands, then ours
        assert got[(name, "two")] == "0 0 [] [1, 3, 5] TTT", got


_PARTITIONED_SCRIPT = r"""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import jax_regemm as rg
from jax_regemm import _ffi, _partition, _targets
_ffi.dgrad_dact_in_place = lambda *a, **k: True  # as the CUDA module answers where the fused kernel runs
calls = []
_lb = _partition.layer_backward
_partition.layer_backward = lambda *a, **k: (calls.append(k["in_place"]), _lb(*a, **k))[1]
rng = np.random.default_rng(0)
m, d, layers = 64, 32, 4
ws = [jnp.asarray(rng.standard_normal((d, d)) / 6, jnp.float32) for _ in range(layers)]
bs = [jnp.asarray(rng.standard_normal(d) / 6, jnp.float32) for _ in range(layers)]
x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
def dense(x, ws, bs, bias=True):
    for i, (w, b) in enumerate(zip(ws, bs)):
        x = rg.dense(x, w, b if bias else None, act="relu" if i < layers - 1 else "none")
    return x
blocks = {"dense": dense, "dense_nobias": lambda x, ws, bs: dense(x, ws, bs, False),
          "mlp": lambda x, ws, bs: rg.mlp(x, ws, bs, act="relu")}
meshes = {"data2": (jax.make_mesh((2,), ("d",), axis_types=(AxisType.Auto,)), P("d"), P()),
          "data2_model2": (jax.make_mesh((2, 2), ("d", "t"), axis_types=(AxisType.Auto,) * 2), P("d"), P(None, "t"))}
for name, block in blocks.items():
    f = jax.jit(jax.grad(lambda x, ws, bs: jnp.sum(block(x, ws, bs) ** 2), argnums=(0, 1, 2)))
    want = f(x, ws, bs)
    for mname, (mesh, xs, wspec) in meshes.items():
        calls.clear()
        put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))
        got = f(put(x, xs), [put(w, wspec) for w in ws], bs)
        err = max(float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        print(name, mname, len(calls), all(calls), f"{err:.1e}")
# Compiled only (the CPU runs no call in place): asked to write over S inside the partitioned op, the calls alias
# gZ to S there and XLA copies no S for them.
_ffi._in_place = lambda platform, target, avals, attrs: {2: 0} if target == _targets.DGRAD_DACT.name else {}
mesh = meshes["data2"][0]
f = jax.jit(jax.grad(lambda x, ws, bs: jnp.sum(blocks["mlp"](x, ws, bs) ** 2), argnums=(1, 2)))
text = f.lower(jax.device_put(x, NamedSharding(mesh, P("d"))), ws, bs).compile().as_text()
found = [l for l in text.splitlines() if 'custom_call_target="regemm_dgrad_dact_v1"' in l]
print("aliased", len(found), sum("output_to_operand_aliasing" in l for l in found),
      sum(" copy(" in l and f"f32[{m // 2},{d}]" in l for l in text.splitlines()))
"""


def test_partitioned_layer_backward_matches_one_device(tmp_path):
    """On four host devices, the backward of relu layers (rg.dense with and without bias, rg.mlp)
    with the batch sharded, and with the weights' columns sharded too (the dgrad GEMM's K split): each
    folded call runs with the wgrad that reads its S as one partitioned op (rg.mlp's asked to write
    over S, as the CUDA module would allow), and the gradients match the one-device program's. Compiled
    with the calls aliasing gZ to S (as on a GPU), XLA keeps the aliases inside the op and copies no S."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _PARTITIONED_SCRIPT], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    *lines, aliased = [line.split() for line in proc.stdout.splitlines()]
    assert aliased == ["aliased", "3", "3", "0"], proc.stdout
    assert len(lines) == 6, proc.stdout
    for name, mesh, ops, in_place, err in lines:
        assert ops == "3" and in_place == str(name == "mlp"), (name, mesh, ops, in_place)
        assert float(err) < 1e-5, (name, mesh, err)


def walk_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            yield from walk_eqns(v) if hasattr(v, "eqns") else walk_eqns(v.jaxpr) if hasattr(v, "jaxpr") else ()


def test_partitioned_bias_gradient_summed_in_its_dtype():
    """Partitioned, a bias gradient is summed over devices in its own dtype, as plain jnp's is (XLA then
    combines it with the weight gradients' all-reduce), not in f32: a call's (dact, dgrad_dact) and the one no
    call makes (a layer of act none, _partition.bias_grad), whose local sum accumulates in f32."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from jax_regemm import _partition

    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,))
    gz, gb = jnp.ones((1024, 8), jnp.bfloat16), jnp.ones((8,), jnp.bfloat16)
    call = lambda gz, gb: _partition._summed_bias_grad((gz, gb), P(), ("d",))[1]
    info = jax.ShapeDtypeStruct(gz.shape, gz.dtype, sharding=NamedSharding(mesh, P("d")))
    attrs = _partition._Attrs(bias_kind="per_col", shapes=(gz.shape,))
    _, out_spec, none_layer = _partition._bias_grad_plan(attrs, mesh, (info,))
    assert out_spec == P(None)
    for name, local in (("call", call), ("act none", lambda gz, gb: none_layer(gz))):
        f = jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())
        eqns = [(e.primitive.name, [v.aval.dtype for v in e.invars]) for e in walk_eqns(jax.make_jaxpr(f)(gz, gb).jaxpr)]
        assert [dtypes for n, dtypes in eqns if n.startswith("psum")] == [[jnp.bfloat16]], (name, eqns)
        if name == "call":
            assert not any(n == "convert_element_type" for n, _ in eqns), eqns


@pytest.mark.parametrize("block", ["mlp", "dense"])
def test_act_none_bias_gradient_is_the_partitioned_op(block):
    """The top layer of act none takes its bias gradient from regemm_bias_grad (partitioned as the calls'),
    in rg.mlp's backward and in a layer's, and it is reference.bias_grad's."""
    k = jax.random.split(jax.random.PRNGKey(11), 3)
    x = jax.random.normal(k[0], (64, 32), jnp.float32)
    w = jax.random.normal(k[1], (32, 32), jnp.float32) / 6
    b = jax.random.normal(k[2], (32,), jnp.float32)
    if block == "mlp":
        f = lambda b: jnp.sum(rg.mlp(x, [w, w], [b, b], act="relu") ** 2)
    else:
        f = lambda b: jnp.sum(rg.dense(rg.dense(x, w, b, act="relu"), w, b, act="none") ** 2)
    names = [e.primitive.name for e in walk_eqns(jax.make_jaxpr(jax.grad(f))(b).jaxpr)]
    assert names.count("regemm_bias_grad") == 1, names
    want = jax.grad(lambda b: jnp.sum((jax.nn.relu(x @ w + b) @ w + b) ** 2))(b)
    got = jax.grad(f)(b)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-2  # TF32 on a GPU


_ROWS_SCRIPT = r"""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jax_regemm import _partition

def local(scale, x, w, gy):  # a stand-in for the narrow MLP's backward call: gx over the rows, gW over all of them
    return x @ w * scale, (x.T @ gy) * scale

def call(x, w, gy):
    return _partition.rows(local, 2.0, [x, w, gy], [(x.shape[0], w.shape[1]), w.shape], [True, False, True], [True, False])

rng = np.random.default_rng(int(os.environ["SEED"]))
x, w, gy = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((64, 8), (8, 5), (64, 5)))
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))  # (Explicit axes: the per-layer block)
put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
f = jax.jit(call)
hlo = f.lower(put(x, P("data")), put(w, P()), put(gy, P("data"))).compile().as_text()
rows, gw = f(put(x, P("data")), put(w, P()), put(gy, P("data")))
want_rows, want_gw = local(2.0, x, w, gy)
print(float(np.abs(np.asarray(rows) - np.asarray(want_rows)).max()), float(np.abs(np.asarray(gw) - np.asarray(want_gw)).max()),
      str(rows.sharding.spec), "all-reduce" in hlo, "all-gather" in hlo)
"""


def test_rows_partitioned_call_runs_each_devices_rows(rand, tmp_path):
    """_partition.rows (the fused narrow MLP's calls under jit over a mesh): with x's rows sharded each
    device runs its rows, the row results stay sharded as x, and the others (weight gradients) are the
    sum over every row, one all-reduce, the rows never gathered."""
    env = dict(os.environ, SEED=str(rand.seed))
    proc = subprocess.run([sys.executable, "-c", _ROWS_SCRIPT], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    err_rows, err_gw, spec, all_reduce, all_gather = proc.stdout.split()[-5:]
    assert float(err_rows) < 1e-5 and float(err_gw) < 1e-4, proc.stdout
    assert "data" in spec and all_reduce == "True" and all_gather == "False", proc.stdout
