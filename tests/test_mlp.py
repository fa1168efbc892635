"""rg.mlp, the MLP block: values and gradients against the pure-JAX reference, the
transformations, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_regemm as rg
from conftest import PLAIN_GEMM_CALLS

HI = jax.lax.Precision.HIGHEST


def _block(key, dims, dtype=jnp.float32, bias=True):
    keys = jax.random.split(key, 2 * len(dims))
    ws = [(jax.random.normal(keys[2 * i], (k, n)) / np.sqrt(k)).astype(dtype) for i, (k, n) in enumerate(zip(dims, dims[1:]))]
    bs = [jax.random.normal(keys[2 * i + 1], (n,), dtype) if bias else None for i, n in enumerate(dims[1:])]
    return ws, bs


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("act,final_act", [("gelu", "none"), ("relu", "sigmoid"), ("silu", "tanh")])
@pytest.mark.parametrize("save", ["auto", "z", "recompute"])
def test_mlp_value_and_grads(act, final_act, save):
    k = jax.random.split(jax.random.PRNGKey(hash((act, save)) % 2**31), 2)
    ws, bs = _block(k[0], [24, 40, 32, 16])
    x = jax.random.normal(k[1], (2, 9, 24))
    loss = lambda f: lambda x, ws, bs: jnp.sum(jnp.sin(f(x, ws, bs)))
    ours = lambda x, ws, bs: rg.mlp(x, ws, bs, act=act, final_act=final_act, save=save, precision=HI)
    ref = lambda x, ws, bs: rg.reference.mlp(x, ws, bs, act=act, final_act=final_act, precision=HI)
    y, yr = jax.jit(ours)(x, ws, bs), ref(x, ws, bs)
    assert y.shape == (2, 9, 16) and _rel(y, yr) < 1e-5
    g = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(x, ws, bs)
    gr = jax.grad(loss(ref), argnums=(0, 1, 2))(x, ws, bs)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gr)):
        assert _rel(a, b) < 1e-5


def test_mlp_jvp_vmap_and_no_bias():
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    ws, _ = _block(k[0], [8, 12, 6], bias=False)
    x, t = jax.random.normal(k[1], (5, 8)), jax.random.normal(k[2], (5, 8))
    f = lambda x: rg.mlp(x, ws, act="gelu_erf", precision=HI)
    fr = lambda x: rg.reference.mlp(x, ws, act="gelu_erf", precision=HI)
    (y, ty), (yr, tyr) = jax.jvp(f, (x,), (t,)), jax.jvp(fr, (x,), (t,))
    assert _rel(y, yr) < 1e-5 and _rel(ty, tyr) < 1e-5
    assert _rel(jax.vmap(f)(x[:, None, :])[:, 0], yr) < 1e-5


def test_mlp_bf16():
    k = jax.random.split(jax.random.PRNGKey(4), 2)
    ws, bs = _block(k[0], [64, 128, 64], jnp.bfloat16)
    x = jax.random.normal(k[1], (32, 64), jnp.bfloat16)
    y = rg.mlp(x, ws, bs, act="gelu")
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (x, ws, bs))
    yr = rg.reference.mlp(*f32, act="gelu", precision=HI)
    assert y.dtype == jnp.bfloat16 and _rel(y, yr) < 2e-2


def test_mlp_errors_name_the_argument():
    ws, bs = _block(jax.random.PRNGKey(5), [8, 12, 6])
    x = jnp.ones((3, 8))
    with pytest.raises(ValueError, match="at least one"):
        rg.mlp(x, [])
    with pytest.raises(ValueError, match=r"weights\[1\] has shape \(7, 6\)"):
        rg.mlp(x, [ws[0], jnp.ones((7, 6))])
    with pytest.raises(ValueError, match=r"biases\[0\] must have shape \(12,\)"):
        rg.mlp(x, ws, [jnp.ones(6), bs[1]])
    with pytest.raises(ValueError, match="one entry"):
        rg.mlp(x, ws, bs[:1])
    with pytest.raises(TypeError, match=r"weights\[0\] must be an array"):
        rg.mlp(x, [[1.0]])
    with pytest.raises(TypeError, match=r"weights\[1\] has dtype bfloat16 but x has float32"):
        rg.mlp(x, [ws[0], ws[1].astype(jnp.bfloat16)])
    with pytest.raises(ValueError, match="unknown activation|act"):
        rg.mlp(x, ws, bs, act="swish")


def _custom_calls(f, *args, compiled=False):
    """The regemm calls in f's lowered program, or in the compiled one (where XLA has removed
    the GEMMs a fold left unread)."""
    lowered = jax.jit(f).lower(*args)
    hlo, call = (lowered.compile().as_text(), 'custom_call_target="{}"') if compiled else (lowered.as_text(), "@{}(")
    return {t: hlo.count(call.format(t)) for t in ("regemm_gemm_v1", "regemm_dact_v1", "regemm_dgrad_dact_v1")}


@pytest.mark.parametrize("save", ["auto", "z", "recompute"])
def test_mlp_backward_folds_act_grad_into_dgrad(save):
    """The block's backward: one dgrad_dact call per hidden layer (its act' and bias gradient
    folded into the dgrad GEMM of the layer above), a dact pass only for the last layer's own
    activation, and nothing asked for that is not needed (no dgrad GEMM of layer 0 when x's
    gradient is not taken)."""
    ws, bs = _block(jax.random.PRNGKey(6), [16, 24, 32, 8])
    x = jnp.ones((10, 16))
    grad_w = jax.grad(lambda ws, bs: jnp.sum(rg.mlp(x, ws, bs, act="silu", final_act="tanh", save=save) ** 2), argnums=(0, 1))
    calls = _custom_calls(grad_w, ws, bs)
    fwd = 3 + 3 * (save == "recompute")  # recompute: each layer's Z again, in the backward
    wgrads = 3 * PLAIN_GEMM_CALLS
    assert calls == {"regemm_gemm_v1": fwd + wgrads, "regemm_dact_v1": 1, "regemm_dgrad_dact_v1": 2}, calls
    grad_x = jax.grad(lambda x: jnp.sum(rg.mlp(x, ws, bs, act="relu") ** 2))
    want = {"regemm_gemm_v1": 3 + PLAIN_GEMM_CALLS, "regemm_dact_v1": 0, "regemm_dgrad_dact_v1": 2}  # + layer 0's dgrad
    assert _custom_calls(grad_x, x) == want


def _cuda_module():
    if jax.default_backend() != "gpu":
        return None
    try:
        from jax_regemm import _regemm_cuda
    except ImportError:
        return None
    return _regemm_cuda


def _stack(per_layer, act, save):
    """The block of the in-place tests as rg.mlp, or as rg.dense layers (the fold at lowering)."""
    if not per_layer:
        return lambda x, ws, bs: rg.mlp(x, ws, bs, act=act, save=save)

    def run(x, ws, bs):
        for i, (w, b) in enumerate(zip(ws, bs)):
            x = rg.dense(x, w, b, act=act if i < len(ws) - 1 else "none", save=save)
        return x

    return run


@pytest.mark.skipif(_cuda_module() is None, reason="needs a GPU and the CUDA module")
@pytest.mark.parametrize("act,save,dtype,per_layer,aliased", [("relu", "auto", jnp.float32, False, True),
                                                              ("gelu", "recompute", jnp.bfloat16, False, True),
                                                              ("silu", "auto", jnp.float32, False, False),
                                                              ("relu", "auto", jnp.float32, True, True),
                                                              ("silu", "auto", jnp.float32, True, False)])  # fmt: skip
def test_mlp_backward_writes_gz_over_s(monkeypatch, act, save, dtype, per_layer, aliased):
    """On one GPU the backward's dgrad_dact calls write gZ over S where S is Y (relu: after the
    wgrad that reads Y, an operand the call follows) or recomputed by rg.mlp, not over a stashed
    Z, in rg.mlp and in the calls the lowering folds for rg.dense layers: each call aliases gZ to S
    or none does, no [M, N] copy is made, the gradients are the same bits as with
    REGEMM_IN_PLACE=0 and match the reference, and the relu step's compiled temporaries are below
    those with REGEMM_IN_PLACE=0 (2^24-element layers: the backward's first call is the peak)."""
    from conftest import dgrad_dact_in_place

    m, d, layers = 32768, 512, 4
    ws, bs = _block(jax.random.PRNGKey(10), [d] * (layers + 1), dtype)
    x = jax.random.normal(jax.random.PRNGKey(11), (m, d), dtype)
    block = _stack(per_layer, act, save)
    loss = lambda x, ws, bs: jnp.sum(block(x, ws, bs).astype(jnp.float32) ** 2)
    monkeypatch.setenv("REGEMM_TUNE", "0")  # the rule's way (fused at K = 512) on both sides

    def compiled(in_place):
        monkeypatch.setenv("REGEMM_IN_PLACE", "1" if in_place else "0")
        c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, ws, bs).compile()
        return c, c.as_text(), c.memory_analysis().temp_size_in_bytes

    c_on, text, temp_on = compiled(True)
    calls, in_place, copies = dgrad_dact_in_place(text, (m, d))
    assert len(calls) == layers - 1, calls
    assert in_place == [aliased] * (layers - 1), calls
    assert copies == 0
    c_off, _, temp_off = compiled(False)
    assert temp_on < temp_off if act == "relu" else temp_on <= temp_off, (temp_on, temp_off)
    g_on, g_off = c_on(x, ws, bs), c_off(x, ws, bs)
    for a, b in zip(jax.tree.leaves(g_on), jax.tree.leaves(g_off)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (x, ws, bs))
    gr = jax.grad(lambda *a: jnp.sum(rg.reference.mlp(*a, act=act, precision=HI) ** 2), argnums=(0, 1, 2))(*f32)
    # Four layers deep at the default precision (bf16, TF32): relu's mask flips where Z rounds
    # across 0 (f32 relu's gradient of x 1.7e-2 on the H100); an S overwritten early is O(1).
    for a, b in zip(jax.tree.leaves(g_on), jax.tree.leaves(gr)):
        assert _rel(a, b) < 5e-2, _rel(a, b)


def test_dense_fold_writes_gz_over_y_where_the_call_can_follow_its_readers(monkeypatch):
    """The decision of the fold's lowering for CUDA, where the kernel would write gZ over S (the
    CUDA module's answer stubbed, so that it runs here): over Y of a relu layer, after the wgrad
    that reads Y (one more operand); with only biases differentiated, no wgrad and no operand
    more; never where another reader of Y comes first that the call cannot follow, nor over a
    stashed Z (silu), nor over an S the program takes as an argument (rg.mlp's calls neither)."""
    from jax_regemm import _ffi

    def in_place(platform, target, avals, attrs):
        return {2: 0} if platform == "cuda" and target == _ffi.DGRAD_DACT_TARGET else {}

    monkeypatch.setattr(_ffi, "_in_place", in_place)
    m, d, layers = 4096, 1024, 4  # past the small-op rule's bound, so the calls are regemm's
    ws, bs = _block(jax.random.PRNGKey(21), [d] * (layers + 1))
    x = jax.random.normal(jax.random.PRNGKey(22), (m, d))

    def calls(f, act="relu"):
        block = _stack(True, act, "auto")
        lowered = jax.jit(f(block)).trace(ws, bs).lower(lowering_platforms=("cuda",)).as_text()
        found = [line for line in lowered.splitlines() if "@regemm_dgrad_dact_v1(" in line]
        assert len(found) == layers - 1, found
        return [("output_operand_aliases" in line, line.split("(", 1)[1].split(")")[0].count("%")) for line in found]

    loss = lambda block: lambda ws, bs: jnp.sum(block(x, ws, bs) ** 2)
    assert calls(lambda block: jax.grad(loss(block), argnums=(0, 1))) == [(True, 4)] * (layers - 1)
    assert calls(lambda block: jax.grad(loss(block), argnums=1)) == [(True, 3)] * (layers - 1)
    assert calls(lambda block: jax.grad(loss(block), argnums=(0, 1)), act="silu") == [(False, 3)] * (layers - 1)

    def read_first(block):  # a sum of layer 1's Y returned beside the loss: the call cannot follow it
        def f(ws, bs):
            y1 = rg.dense(rg.dense(x, ws[0], bs[0], act="relu"), ws[1], bs[1], act="relu")
            return jnp.sum(block(y1, ws[2:], bs[2:]) ** 2), jnp.sum(jnp.tanh(y1))

        return jax.grad(f, argnums=(0, 1), has_aux=True)

    assert calls(read_first) == [(True, 4), (False, 3), (True, 4)]  # in order from the top: layer 1's is second

    # The backward compiled apart from its forward (layers and rg.mlp): S is the program's
    # argument, which stays, and the call follows nothing.
    for per_layer in (True, False):
        _, backward = jax.vjp(lambda ws, bs: jnp.sum(_stack(per_layer, "relu", "auto")(x, ws, bs) ** 2), ws, bs)
        lowered = jax.jit(lambda f: f(jnp.float32(1))).trace(backward).lower(lowering_platforms=("cuda",)).as_text()
        found = [line for line in lowered.splitlines() if "@regemm_dgrad_dact_v1(" in line]
        assert len(found) == layers - 1, found
        assert [("output_operand_aliases" in line, line.split("(", 1)[1].split(")")[0].count("%")) for line in found] \
            == [(False, 3)] * (layers - 1), found


_ONE_GPU_SCRIPT = r"""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import jax_regemm as rg
from jax_regemm import _ffi, _partition
_ffi._in_place = lambda platform, target, avals, attrs: {2: 0} if platform == "cuda" and target == _ffi.DGRAD_DACT_TARGET else {}
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
from jax_regemm import _ffi, _partition
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
_ffi._in_place = lambda platform, target, avals, attrs: {2: 0} if target == _ffi.DGRAD_DACT_TARGET else {}
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


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            yield from _eqns(v) if hasattr(v, "eqns") else _eqns(v.jaxpr) if hasattr(v, "jaxpr") else ()


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
    _, none_layer, out, _ = _partition._bias_grad_partition(attrs, mesh, (info,), None)
    assert out.spec == P(None)
    for name, local in (("call", call), ("act none", lambda gz, gb: none_layer(gz))):
        f = jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())
        eqns = [(e.primitive.name, [v.aval.dtype for v in e.invars]) for e in _eqns(jax.make_jaxpr(f)(gz, gb).jaxpr)]
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
    names = [e.primitive.name for e in _eqns(jax.make_jaxpr(jax.grad(f))(b).jaxpr)]
    assert names.count("regemm_bias_grad") == 1, names
    want = jax.grad(lambda b: jnp.sum((jax.nn.relu(x @ w + b) @ w + b) ** 2))(b)
    got = jax.grad(f)(b)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-2  # TF32 on a GPU


def test_mlp_bf16_grads_deep():
    """Five bf16 layers: the folded backward's gradients against the f32 reference."""
    k = jax.random.split(jax.random.PRNGKey(7), 2)
    ws, bs = _block(k[0], [64, 96, 128, 96, 80, 32], jnp.bfloat16)
    x = jax.random.normal(k[1], (48, 64), jnp.bfloat16)
    loss = lambda f: lambda x, ws, bs: jnp.sum(f(x, ws, bs).astype(jnp.float32) ** 2)
    g = jax.jit(jax.grad(loss(lambda *a: rg.mlp(*a, act="gelu")), argnums=(0, 1, 2)))(x, ws, bs)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (x, ws, bs))
    gr = jax.grad(loss(lambda *a: rg.reference.mlp(*a, act="gelu", precision=HI)), argnums=(0, 1, 2))(*f32)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gr)):
        assert a.dtype == jnp.bfloat16 and _rel(a, b) < 5e-2, _rel(a, b)


def test_mlp_modules_run_the_folded_backward():
    """The MLP modules of flax.linen, nnx and Equinox (the latter under jax.vmap over examples,
    which folds the batch into the GEMMs' rows) differentiate through the block: one dgrad_dact
    call per hidden layer, and their gradients match plain nn.Dense / eqx.nn.MLP."""
    flax_nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    import jax_regemm.equinox as reqx
    import jax_regemm.flax as rflax
    import jax_regemm.nnx as rnnx

    from conftest import tol

    x = jax.random.normal(jax.random.PRNGKey(8), (12, 16))
    t = tol(jnp.float32)  # both sides at default precision (TF32 on a GPU)
    # flax.linen
    ours = rflax.MLP([24, 32, 8], activation="gelu")
    params = ours.init(jax.random.PRNGKey(9), x)
    loss = lambda p: jnp.sum(ours.apply(p, x) ** 2)
    assert _custom_calls(jax.grad(loss), params)["regemm_dgrad_dact_v1"] == 2

    class Plain(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            for i, f in enumerate([24, 32, 8]):
                x = flax_nn.Dense(f)(x)
                x = jax.nn.gelu(x, approximate=True) if i < 2 else x
            return x

    g = jax.grad(loss)(params)
    gr = jax.grad(lambda p: jnp.sum(Plain().apply(p, x) ** 2))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gr)):
        assert _rel(a, b) < t
    # nnx
    model = rnnx.MLP([16, 24, 8], activation="silu", rngs=nnx.Rngs(0))
    nloss = lambda m: jnp.sum(m(x) ** 2)
    gn = nnx.grad(nloss)(model)
    assert _custom_calls(lambda m: jax.tree.leaves(nnx.grad(nloss)(m)), model)["regemm_dgrad_dact_v1"] == 1
    ref = lambda m: jnp.sum(rg.reference.mlp(x, [l.kernel[...] for l in m.layers], [l.bias[...] for l in m.layers], act="silu") ** 2)  # fmt: skip
    for a, b in zip(jax.tree.leaves(gn), jax.tree.leaves(nnx.grad(ref)(model))):
        assert _rel(a, b) < t
    # Equinox, per example under vmap
    em = reqx.MLP(16, 8, 24, 2, activation="relu", key=jax.random.PRNGKey(10))
    pm = eqx.nn.MLP(16, 8, 24, 2, activation=jax.nn.relu, key=jax.random.PRNGKey(10))
    eloss = lambda m: jnp.sum(jax.vmap(m)(x) ** 2)
    assert _custom_calls(jax.grad(eloss), em)["regemm_dgrad_dact_v1"] == 2
    ge, gp = eqx.filter_grad(eloss)(em), eqx.filter_grad(eloss)(pm)
    for a, b in zip(jax.tree.leaves(ge), jax.tree.leaves(gp)):
        assert _rel(a, b) < t


# ---------------------------------------------------------------------------
# The same fold for layers written one op at a time (jax_regemm/_fold.py)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("save", ["auto", "recompute"])
@pytest.mark.parametrize("lead", [(40,), (4, 10)])
def test_dense_layers_fold_act_grad_into_dgrad(save, lead):
    """Three rg.dense layers (gelu, relu, none), differentiated: each hidden layer's act' and bias
    gradient run in the dgrad GEMM of the layer above (one dgrad_dact call each, no dact pass, no
    GEMM left for the folded dgrads), also where x has two leading dims (rg.dense's reshapes lie
    between the GEMM and the dact), and the gradients match the reference."""
    ws, bs = _block(jax.random.PRNGKey(12), [16, 24, 32, 8])
    x = jax.random.normal(jax.random.PRNGKey(13), lead + (16,))
    acts = ["gelu", "relu", "none"]

    def loss(f):
        def run(x, ws, bs):
            for w, b, act in zip(ws, bs, acts):
                x = f(x, w, b, act)
            return jnp.sum(x**2)

        return run

    ours = loss(lambda x, w, b, act: rg.dense(x, w, b, act=act, save=save))
    ref = loss(lambda x, w, b, act: rg.reference.gemm_bias_act(x, w, b, act=act, precision=HI))
    fwd = 3 + 2 * (save == "recompute")  # recompute: each hidden layer's Z again
    want = {"regemm_gemm_v1": fwd + 4 * PLAIN_GEMM_CALLS, "regemm_dact_v1": 0, "regemm_dgrad_dact_v1": 2}
    grads = jax.grad(ours, argnums=(0, 1, 2))
    assert _custom_calls(grads, x, ws, bs, compiled=True) == want
    from conftest import tol

    for a, b in zip(jax.tree.leaves(jax.jit(grads)(x, ws, bs)), jax.tree.leaves(jax.grad(ref, argnums=(0, 1, 2))(x, ws, bs))):
        assert _rel(a, b) < tol(jnp.float32), _rel(a, b)


def test_dense_fold_keeps_a_gemm_read_elsewhere():
    """A hand-written backward whose gY, a plain GEMM's result, is also returned: the dact still
    folds (the GEMM runs on its own as well), and both results match float64 NumPy."""
    k = jax.random.split(jax.random.PRNGKey(14), 5)
    p, q = jax.random.normal(k[0], (24, 20)), jax.random.normal(k[1], (20, 32))
    a, b = jax.random.normal(k[2], (24, 16)), jax.random.normal(k[3], (16, 32))
    bias = jax.random.normal(k[4], (32,))

    def f(p, q, a, b, bias):
        gy = rg.gemm_bias_act(p, q, act="none", precision=HI)
        _, z = rg.gemm_bias_act_fwd(a, b, bias, act="gelu", precision=HI, return_z=True)
        ga, gb, gbias, _ = rg.gemm_bias_act_bwd(a, b, gy, z, bias, act="gelu", precision=HI)
        return ga, gbias, gy

    args = (p, q, a, b, bias)
    calls = _custom_calls(f, *args, compiled=True)
    assert calls["regemm_dgrad_dact_v1"] == 1 and calls["regemm_dact_v1"] == 0, calls
    ga, gbias, gy = jax.jit(f)(*args)
    p, q, a, b, bias = (np.asarray(v, np.float64) for v in args)
    gy64 = p @ q
    z = a @ b + bias
    t = np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3))
    dgelu = 0.5 * (1 + t) + 0.5 * z * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * z**2)
    gz = gy64 * dgelu
    for got, want in ((gy, gy64), (ga, gz @ b.T), (gbias, gz.sum(0))):
        assert _rel(got, want) < 1e-5, _rel(got, want)


def test_flax_dense_layers_run_the_folded_backward():
    """A user's per-layer swap (nn.Dense + activation -> jax_regemm.flax.Dense with it): the step's
    backward folds each hidden layer's act' into the dgrad GEMM above, as rg.mlp's does, with
    nn.Dense's gradients."""
    flax_nn = pytest.importorskip("flax.linen")
    import jax_regemm.flax as rflax
    from conftest import tol

    feats = [24, 32, 8]

    class Net(flax_nn.Module):
        ours: bool

        @flax_nn.compact
        def __call__(self, x):
            for i, f in enumerate(feats):
                act = "silu" if i < len(feats) - 1 else "none"
                if self.ours:
                    x = rflax.Dense(f, activation=act)(x)
                else:
                    x = flax_nn.Dense(f, precision=HI)(x)
                    x = jax.nn.silu(x) if act == "silu" else x
            return x

    x = jax.random.normal(jax.random.PRNGKey(15), (12, 16))
    params = Net(False).init(jax.random.PRNGKey(16), x)
    grad = lambda ours: jax.grad(lambda p: jnp.sum(Net(ours).apply(p, x) ** 2))
    assert _custom_calls(grad(True), params, compiled=True)["regemm_dgrad_dact_v1"] == 2
    for a, b in zip(jax.tree.leaves(jax.jit(grad(True))(params)), jax.tree.leaves(grad(False)(params))):
        assert _rel(a, b) < tol(jnp.float32), _rel(a, b)


def test_cotangent_of_a_layer_without_activation_is_one_buffer():
    """A layer without activation passes its cotangent on as gZ to three readers: an optimization
    barrier keeps it one buffer where the program makes it (a loss's gradient), and none is put on
    a cotangent that is the program's input (a barrier on an entry parameter copies it)."""
    k = jax.random.split(jax.random.PRNGKey(17), 4)
    x, w = jax.random.normal(k[0], (64, 32)), jax.random.normal(k[1], (32, 48))
    b, gy = jax.random.normal(k[2], (48,)), jax.random.normal(k[3], (64, 48))
    made = jax.jit(jax.grad(lambda x, w, b: jnp.sum(rg.dense(x, w, b) ** 2), argnums=(0, 1, 2)))
    given = jax.jit(lambda x, w, b, gy: jax.vjp(lambda *a: rg.dense(*a), x, w, b)[1](gy))
    assert "optimization_barrier" in made.lower(x, w, b).as_text()
    assert "optimization_barrier" not in given.lower(x, w, b, gy).as_text()
    from conftest import tol

    gx, gw, gb = given(x, w, b, gy)
    x64, w64, gy64 = (np.asarray(v, np.float64) for v in (x, w, gy))
    for got, want in ((gx, gy64 @ w64.T), (gw, x64.T @ gy64), (gb, gy64.sum(0))):
        assert _rel(got, want) < tol(jnp.float32), _rel(got, want)


def test_nnx_and_equinox_layers_run_the_folded_backward():
    """Stacks of jax_regemm.nnx.Linear and jax_regemm.equinox.Linear (the latter per example under
    jax.vmap) fold too: one dgrad_dact call per hidden layer, no dact pass, gradients as plain JAX."""
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    import jax_regemm.equinox as reqx
    import jax_regemm.nnx as rnnx
    from conftest import tol

    x = jax.random.normal(jax.random.PRNGKey(18), (12, 16))
    acts = ["silu", "gelu", "none"]
    dims = [16, 24, 32, 8]
    ref_act = {"silu": jax.nn.silu, "gelu": lambda z: jax.nn.gelu(z, approximate=True), "none": lambda z: z}

    # Equinox: weight [out, in], applied per example
    ks = jax.random.split(jax.random.PRNGKey(19), 3)
    layers = [reqx.Linear(k, n, activation=a, key=key) for k, n, a, key in zip(dims, dims[1:], acts, ks)]

    def eqx_loss(layers, ours=True):
        def one(xi):
            for layer, a in zip(layers, acts):
                xi = layer(xi) if ours else ref_act[a](jnp.dot(layer.weight, xi, precision=HI) + layer.bias)
            return xi

        return jnp.sum(jax.vmap(one)(x) ** 2)

    grad = jax.grad(eqx_loss)
    assert _custom_calls(grad, layers, compiled=True)["regemm_dgrad_dact_v1"] == 2
    assert _custom_calls(grad, layers, compiled=True)["regemm_dact_v1"] == 0
    got, want = jax.jit(grad)(layers), jax.grad(lambda ls: eqx_loss(ls, ours=False))(layers)
    for a, b in zip(jax.tree.leaves(eqx.filter(got, eqx.is_array)), jax.tree.leaves(eqx.filter(want, eqx.is_array))):
        assert _rel(a, b) < tol(jnp.float32), _rel(a, b)

    # nnx: kernel [in, out]
    rngs = nnx.Rngs(20)
    model = [rnnx.Linear(k, n, activation=a, rngs=rngs) for k, n, a in zip(dims, dims[1:], acts)]
    graphdef, state = nnx.split(model)

    def nnx_loss(state, ours=True):
        h = x
        for layer, a in zip(nnx.merge(graphdef, state), acts):
            h = layer(h) if ours else ref_act[a](jnp.dot(h, layer.kernel[...], precision=HI) + layer.bias[...])
        return jnp.sum(h**2)

    grad = jax.grad(nnx_loss)
    assert _custom_calls(grad, state, compiled=True)["regemm_dgrad_dact_v1"] == 2
    got, want = jax.jit(grad)(state), jax.grad(lambda s: nnx_loss(s, ours=False))(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _rel(a, b) < tol(jnp.float32), _rel(a, b)
