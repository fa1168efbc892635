"""The fused narrow MLP (docs/spec.md §8, jax_regemm/_narrow.py): values and every gradient
against the reference for each width, depth, activation and dtype, the transformations, and
where it runs. The reference is the chain of reference dense layers in the input dtype (f32
accumulation, HIGHEST, each layer stored in bf16/f16: §8's semantics), differentiated by JAX:
against a float32 chain a relu stack's gx differs by 5% in bf16 from the rounding of h alone
(masks flip), in the reference itself as in the kernels.

On CUDA, `rg.mlp` runs a stack the kernels take as one kernel per direction (REGEMM_NARROW,
which the suite's conftest turns off, is turned on here). On the CPU the same primitives lower
to the per-layer program: the tests there choose them by hand (`narrow` fixture), so their rules
(the JVP, its transpose, the folded batch, export) are tested on every platform."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_regemm as rg
from jax_regemm import _narrow, api
from blocks import HI, cuda_module
from conftest import assert_rel, on_cpu, rel_err, tol

ACTS = ("none", "relu", "leaky_relu", "gelu", "gelu_erf", "sigmoid", "tanh", "silu")
FWD, BWD = "regemm_narrow_mlp_v1", "regemm_narrow_mlp_bwd_v1"


def assert_close(got, ref, truth, dtype, what):
    """A result of the stack (its gradients above all) against the float32 chain (`truth`), as close as the tolerance of
    §5, or as the reference in the input dtype (`ref`) is: a stack's gradient can be worse
    conditioned than one layer's (leaky_relu's gx in bf16: 3.5% in the reference itself, its
    masks flipped by the rounding of h), and the kernels may not be worse than twice that."""
    assert got.dtype == dtype
    bound = max(tol(dtype), 2 * rel_err(ref, truth))
    e = rel_err(got, truth)
    assert e < bound, f"{what}: relative Frobenius error {e:.3e} >= {bound:.1e} ({jnp.dtype(dtype).name})"


def grads(f, argnums, *args):
    """Every gradient of f's loss, jitted (the references too: op by op they take seconds on a GPU)."""
    return jax.tree.leaves(jax.jit(jax.grad(loss_of(f), argnums=argnums))(*args))


@pytest.fixture
def narrow(monkeypatch):
    """The narrow path chosen: on CUDA by the switch, on the CPU by hand (its per-layer program)."""
    monkeypatch.setenv("REGEMM_NARROW", "on")
    if on_cpu():
        monkeypatch.setattr(_narrow, "chosen", _narrow.spec_of)


def block(rand, dims, dtype, bias=True):
    """x-free weights and biases of a stack K0 -> ... -> N_out: Z O(1) at every layer."""
    ws = [rand.normal((k, n), dtype, 1.0 / np.sqrt(k)) for k, n in zip(dims, dims[1:])]
    bs = [rand.normal((n,), dtype, 0.3) if (bias is True or bias[i]) else None for i, n in enumerate(dims[1:])]
    return ws, bs


def f32(tree):  # (the reference's dtype where a test needs f32: forward mode)
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def loss_of(f):
    return lambda x, ws, bs: jnp.sum(jnp.sin(f(x, ws, bs).astype(jnp.float32)))


def check(x, ws, bs, act, final_act, slope=0.01):
    """rg.mlp's y and gradients (x, every weight, every bias) against the reference."""
    ours = lambda x, ws, bs: rg.mlp(x, ws, bs, act=act, final_act=final_act, leaky_slope=slope)
    ref = lambda x, ws, bs: rg.reference.mlp(x, ws, bs, act=act, final_act=final_act, leaky_slope=slope,
                                             precision=HI)  # fmt: skip
    # (the narrow path is what is tested; on CUDA its derivative takes the fused backward where it fits)
    assert primitives(ours, x, ws, bs) == (1, 0)
    y = jax.jit(ours)(x, ws, bs)
    assert y.dtype == x.dtype and y.shape == x.shape[:-1] + ws[-1].shape[-1:]
    assert_close(y, jax.jit(ref)(x, ws, bs), jax.jit(ref)(*f32((x, ws, bs))), x.dtype, "y")
    g = grads(ours, (0, 1, 2), x, ws, bs)
    gr, gt = grads(ref, (0, 1, 2), x, ws, bs), grads(ref, (0, 1, 2), *f32((x, ws, bs)))
    names = ["gx"] + [f"gW{i}" for i in range(len(ws))] + [f"gb{i}" for i, b in enumerate(bs) if b is not None]
    for name, a, b, t in zip(names, g, gr, gt):
        assert_close(a, b, t, x.dtype, name)


def primitives(f, *args):
    """How many binds of the forward and the backward primitive f's jaxpr has (every platform)."""
    jaxpr = str(jax.make_jaxpr(f)(*args))
    return len(re.findall(r"regemm_narrow_mlp\[", jaxpr)), len(re.findall(r"regemm_narrow_mlp_bwd\[", jaxpr))


def calls(f, *args):
    """How many calls of the forward and the backward target f's lowered program has."""
    hlo = jax.jit(f).lower(*args).as_text()
    return hlo.count(f"@{FWD}("), hlo.count(f"@{BWD}(")


gpu_only = pytest.mark.skipif(cuda_module() is None, reason="the fused narrow MLP runs on CUDA")


@pytest.mark.parametrize("width,hidden", [(16, 2), (32, 3), (64, 4), (128, 1), (64, 8), (16, 1)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_widths_and_depths(narrow, rand, width, hidden, dtype):
    ws, bs = block(rand, [32] + [width] * hidden + [16], dtype)
    x = rand.normal((1000, 32), dtype)
    check(x, ws, bs, "relu", "none")


@pytest.mark.parametrize("act", ACTS)
def test_every_hidden_activation(narrow, rand, act):
    ws, bs = block(rand, [24, 32, 32, 32, 8], jnp.bfloat16)
    check(rand.normal((777, 24), jnp.bfloat16), ws, bs, act, "none", slope=0.2)


def off_the_kinks(x, ws, bs, act, delta=1e-2):
    """x's rows whose every output z is at least delta from 0 (in the float32 chain): a kinked
    output activation's gradient jumps there, so one ulp of h (f16's 1e-3) decides its value, and
    a few such rows of 513 moved gx by 1-3% whichever program computed it (the reference against
    the float32 chain too, so `assert_close`'s bound is luck there, not tolerance)."""
    z = rg.reference.mlp(*f32((x, ws, bs)), act=act, final_act="none", precision=HI)
    return x[np.asarray(jnp.min(jnp.abs(z), axis=-1) > delta)]


@pytest.mark.parametrize("final_act", ACTS)
def test_every_output_activation(narrow, rand, final_act):
    ws, bs = block(rand, [16, 64, 64, 24], jnp.float16)
    x = rand.normal((513, 16), jnp.float16)
    if final_act in ("relu", "leaky_relu"):
        x = off_the_kinks(x, ws, bs, "gelu")
        assert x.shape[0] > 256, x.shape
    check(x, ws, bs, "gelu", final_act, slope=0.3)


@pytest.mark.parametrize("m,k0,n_out", [(1, 3, 1), (15, 1, 3), (4097, 33, 17), (300, 200, 128), (64, 8, 127)])
def test_odd_sizes(narrow, rand, m, k0, n_out):
    ws, bs = block(rand, [k0, 32, 32, n_out], jnp.bfloat16)
    check(rand.normal((m, k0), jnp.bfloat16), ws, bs, "silu", "tanh")


def test_some_layers_without_bias(narrow, rand):
    ws, bs = block(rand, [20, 64, 64, 64, 5], jnp.bfloat16, bias=[False, True, False, True])
    check(rand.normal((999, 20), jnp.bfloat16), ws, bs, "leaky_relu", "sigmoid", slope=0.1)


def test_batch_dims_and_weights_transposed(narrow, rand):
    """x [..., K0] as rows; Equinox's layout ([N, K] weights, read in place) gives the same numbers."""
    ws, bs = block(rand, [16, 32, 32, 8], jnp.bfloat16)
    x = rand.normal((3, 50, 16), jnp.bfloat16)
    f = lambda x, ws, bs: rg.mlp(x, ws, bs, act="gelu")
    ft = lambda x, wts, bs: api.mlp_block(x, wts, bs, acts=["gelu", "gelu", "none"], weights_transposed=True)
    wts = [w.T for w in ws]
    np.testing.assert_array_equal(np.asarray(jax.jit(ft)(x, wts, bs), np.float32), np.asarray(jax.jit(f)(x, ws, bs), np.float32))
    gx, gw = jax.jit(jax.grad(loss_of(f), argnums=(0, 1)))(x, ws, bs)
    gxt, gwt = jax.jit(jax.grad(loss_of(ft), argnums=(0, 1)))(x, wts, bs)
    np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(gxt, np.float32))
    for a, b in zip(gw, gwt):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b.T, np.float32))


def test_only_the_gradients_asked_for(narrow, rand):
    ws, bs = block(rand, [16, 32, 32, 8], jnp.bfloat16)
    x = rand.normal((300, 16), jnp.bfloat16)
    f = lambda x, ws, bs: rg.mlp(x, ws, bs, act="relu")
    ref = lambda x, ws, bs: rg.reference.mlp(x, ws, bs, act="relu", precision=HI)
    for argnums in (0, 1, 2, (1, 2)):
        g = jax.tree.leaves(jax.jit(jax.grad(loss_of(f), argnums=argnums))(x, ws, bs))
        gr, gt = grads(ref, argnums, x, ws, bs), grads(ref, argnums, *f32((x, ws, bs)))
        assert len(g) == len(gr)
        for a, b, t in zip(g, gr, gt):
            assert_close(a, b, t, jnp.bfloat16, f"argnums={argnums}")


def test_forward_mode_and_second_order(narrow, rand):
    """jvp, and grad of grad: through the reference (f32 accumulation, each layer rounded)."""
    ws, bs = block(rand, [8, 16, 16, 4], jnp.float16)
    x, t = rand.normal((64, 8), jnp.float16), rand.normal((64, 8), jnp.float16)
    f = lambda x, ws, bs: rg.mlp(x, ws, bs, act="tanh")
    fr = lambda x, ws, bs: rg.reference.mlp(x, ws, bs, act="tanh", precision=HI)
    jvp = jax.jit(lambda f, x, ws, bs: jax.jvp(lambda x: f(x, ws, bs), (x,), (t.astype(x.dtype),)), static_argnums=0)
    got, ref, truth = jvp(f, x, ws, bs), jvp(fr, x, ws, bs), jvp(fr, *f32((x, ws, bs)))
    for what, a, b, c in zip(("y", "jvp"), got, ref, truth):
        assert_close(a, b, c, jnp.float16, what)
    gg = jax.jit(lambda f, x, ws, bs: jax.grad(lambda x: jnp.sum(jax.grad(loss_of(f))(x, ws, bs).astype(jnp.float32) ** 2))(x),
                 static_argnums=0)  # fmt: skip
    assert_close(gg(f, x, ws, bs), gg(fr, x, ws, bs), gg(fr, *f32((x, ws, bs))), jnp.float16, "grad of grad")


def test_vmap_folds_rows_and_per_example_gradients(narrow, rand):
    ws, bs = block(rand, [16, 32, 32, 8], jnp.bfloat16)
    xs = rand.normal((4, 100, 16), jnp.bfloat16)
    f = lambda x, ws, bs: rg.mlp(x, ws, bs, act="silu")
    ref = lambda x, ws, bs: rg.reference.mlp(x, ws, bs, act="silu", precision=HI)
    each = lambda f: jax.vmap(f, in_axes=(0, None, None))
    assert_close(jax.jit(each(f))(xs, ws, bs), jax.jit(each(ref))(xs, ws, bs), jax.jit(each(ref))(*f32((xs, ws, bs))),
                 jnp.bfloat16, "vmap")  # fmt: skip
    # grad of the vmapped loss: the weight gradients summed over the batch (the folded backward)
    g = grads(each(f), (1, 2), xs, ws, bs)
    gr, gt = grads(each(ref), (1, 2), xs, ws, bs), grads(each(ref), (1, 2), *f32((xs, ws, bs)))
    for a, b, c in zip(g, gr, gt):
        assert_close(a, b, c, jnp.bfloat16, "grad of vmap")
    # vmap of the gradient: one weight gradient per example
    per = lambda f, *args: jax.tree.leaves(jax.jit(jax.vmap(jax.grad(loss_of(f), argnums=(1, 2)), in_axes=(0, None, None)))(*args))
    pg = per(f, xs, ws, bs)
    pgr, pgt = per(ref, xs, ws, bs), per(ref, *f32((xs, ws, bs)))
    for a, b, c in zip(pg, pgr, pgt):
        assert a.shape == (4,) + b.shape[1:]
        assert_close(a, b, c, jnp.bfloat16, "vmap of grad")


def test_checkpoint_and_export(narrow, rand):
    ws, bs = block(rand, [16, 32, 32, 8], jnp.bfloat16)
    x = rand.normal((200, 16), jnp.bfloat16)
    f = lambda x, ws, bs: rg.mlp(x, ws, bs, act="gelu", final_act="relu")
    g = jax.jit(jax.grad(loss_of(f), argnums=(0, 1, 2)))(x, ws, bs)
    gc = jax.jit(jax.grad(loss_of(jax.checkpoint(f)), argnums=(0, 1, 2)))(x, ws, bs)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gc)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    exp = jax.export.export(jax.jit(f), disabled_checks=rg.disabled_export_checks())(x, ws, bs)
    back = jax.export.deserialize(exp.serialize())
    np.testing.assert_array_equal(np.asarray(back.call(x, ws, bs), np.float32), np.asarray(jax.jit(f)(x, ws, bs), np.float32))


def test_what_the_kernels_do_not_take_runs_per_layer(narrow, rand):
    """f32, a width outside 16/32/64/128, two hidden widths, save="z": the per-layer block."""
    assert _narrow.spec_of is not None
    for dims, dtype, save in (([16, 32, 32, 8], jnp.float32, "auto"), ([16, 48, 48, 8], jnp.bfloat16, "auto"),
                              ([16, 32, 64, 8], jnp.bfloat16, "auto"), ([16, 32, 32, 8], jnp.bfloat16, "z"),
                              ([16, 32, 32, 200], jnp.bfloat16, "auto"), ([16, 8], jnp.bfloat16, "auto")):  # fmt: skip
        ws, bs = block(rand, dims, dtype)
        x = rand.normal((64, 16), dtype)
        f = lambda x: rg.mlp(x, ws, bs, act="relu", save=save)
        assert primitives(jax.grad(lambda x: jnp.sum(f(x))), x) == (0, 0), (dims, dtype, save)
        assert_rel(jax.jit(f)(x), jax.jit(lambda x: rg.reference.mlp(x, ws, bs, act="relu", precision=HI))(x), dtype,
                   what=str(dims))  # fmt: skip


@gpu_only
def test_one_kernel_per_direction(narrow, rand):
    ws, bs = block(rand, [32, 64, 64, 64, 16], jnp.bfloat16)
    x = rand.normal((4096, 32), jnp.bfloat16)
    f = lambda x, ws, bs: rg.mlp(x, ws, bs, act="relu")
    assert calls(f, x, ws, bs) == (1, 0)
    assert calls(jax.grad(loss_of(f), argnums=(0, 1, 2)), x, ws, bs) == (1, 1)
    hlo = jax.jit(jax.grad(loss_of(f), argnums=(0, 1, 2))).lower(x, ws, bs).as_text()
    assert "regemm_gemm_v1" not in hlo and "regemm_dgrad_dact_v1" not in hlo
    assert "narrow_mlp" in rg.kernels()["cuda"]
    # (the default build is for sm_90a: on Hopper the wgmma forms run)
    hopper = getattr(jax.devices()[0], "compute_capability", "") == "9.0"
    assert ("narrow_mlp_sm90a_wgmma" in rg.kernels()["cuda"]["narrow_mlp"]) == hopper


@gpu_only
def test_switch_off_runs_per_layer(narrow, rand, monkeypatch):
    monkeypatch.setenv("REGEMM_NARROW", "off")
    ws, bs = block(rand, [32, 64, 64, 16], jnp.bfloat16)
    x = rand.normal((512, 32), jnp.bfloat16)
    assert calls(lambda x: rg.mlp(x, ws, bs), x) == (0, 0)


# Stacks (width, hidden layers, K0, N_out, act, dtype) the wgmma kernels take (the backward: 16-64
# wide, 1-4 hidden relu/gelu, K0 <= 64, N_out <= 16; the forward: from 64 wide), and one each
# kernel leaves to mma.sync.
WGMMA_STACKS = [(16, 1, 32, 16, "relu", jnp.bfloat16), (32, 3, 20, 8, "gelu", jnp.float16),
                (64, 4, 32, 16, "relu", jnp.bfloat16), (64, 2, 64, 3, "gelu", jnp.bfloat16),
                (64, 3, 40, 16, "silu", jnp.float16), (128, 2, 72, 24, "relu", jnp.bfloat16)]


@gpu_only
@pytest.mark.parametrize("switch", ["on", "off"])
@pytest.mark.parametrize("width,hidden,k0,n_out,act,dtype", WGMMA_STACKS)
def test_wgmma_and_mma_sync_kernels(narrow, rand, monkeypatch, switch, width, hidden, k0, n_out, act, dtype):
    """Both forms of the kernels against the reference: sm90a's wgmma where they take the stack
    (REGEMM_NARROW_WGMMA on, the default) and mma.sync (off)."""
    monkeypatch.setenv("REGEMM_NARROW_WGMMA", switch)
    ws, bs = block(rand, [k0] + [width] * hidden + [n_out], dtype)
    check(rand.normal((3001, k0), dtype), ws, bs, act, "none")


@gpu_only
def test_gradients_are_deterministic(narrow, rand):
    """The weight gradients sum the blocks' partial sums in one order: the same bits every run."""
    ws, bs = block(rand, [32, 64, 64, 64, 16], jnp.bfloat16)
    x = rand.normal((50000, 32), jnp.bfloat16)
    grad = jax.jit(jax.grad(loss_of(lambda x, ws, bs: rg.mlp(x, ws, bs, act="gelu")), argnums=(1, 2)))
    first = [np.asarray(a, np.float32) for a in jax.tree.leaves(grad(x, ws, bs))]
    for _ in range(3):
        for a, b in zip(first, jax.tree.leaves(grad(x, ws, bs))):
            np.testing.assert_array_equal(a, np.asarray(b, np.float32))


@gpu_only
def test_flax_mlp_runs_the_kernel(narrow, rand):
    import flax.linen as nn  # noqa: F401

    from jax_regemm.flax import MLP

    model = MLP(features=[64, 64, 16], activation="relu", dtype=jnp.bfloat16)
    x = rand.normal((2048, 32), jnp.bfloat16)
    params = model.init(jax.random.PRNGKey(0), x)
    assert calls(lambda p: model.apply(p, x), params) == (1, 0)


def test_derivative_per_layer_where_the_fused_backward_does_not_fit(narrow, rand, monkeypatch):
    """A stack whose backward kernel does not fit (on CUDA: 128 wide and deep) keeps the fused
    forward outside a derivative and differentiates through the per-layer block."""
    import dataclasses

    monkeypatch.setattr(_narrow, "chosen", lambda *a: dataclasses.replace(_narrow.spec_of(*a), fused_backward=False))
    ws, bs = block(rand, [16, 32, 32, 8], jnp.bfloat16)
    x = rand.normal((300, 16), jnp.bfloat16)
    f = lambda x, ws, bs: rg.mlp(x, ws, bs, act="gelu")
    assert primitives(f, x, ws, bs) == (1, 0)
    assert primitives(jax.grad(loss_of(f)), x, ws, bs) == (0, 0)
    check(x, ws, bs, "gelu", "none")


@gpu_only
@pytest.mark.parametrize("rows,width,hidden", [(4096, 64, 3), (2**18, 64, 4), (2**20, 32, 3), (2**20, 32, 6),
                                               (2**20, 128, 1)])  # fmt: skip
def test_auto_fuses_each_direction_where_it_wins(narrow, monkeypatch, rows, width, hidden):
    """REGEMM_NARROW=auto (the default): the forward kernel where `fused_forward_wins`, the fused
    backward where besides `fused_backward_wins` (lowered, not run)."""
    monkeypatch.setenv("REGEMM_NARROW", "auto")
    ws = [jnp.zeros((k, n), jnp.bfloat16) for k, n in zip([32] + [width] * hidden, [width] * hidden + [16])]
    x = jax.ShapeDtypeStruct((rows, 32), jnp.bfloat16)
    f = lambda x, ws: rg.mlp(x, ws, act="relu")
    fwd = calls(f, x, ws)[0]
    # (a loss that reads y: under sum(y) alone the gradient needs no forward, and the program has none)
    n = calls(jax.grad(lambda x, ws: jnp.sum(jnp.sin(f(x, ws).astype(jnp.float32))), argnums=(0, 1)), x, ws)
    spec = _narrow.NarrowSpec(None, "relu", "none", 0.01, False, (False,) * (hidden + 1), width, 16)
    xs = jax.ShapeDtypeStruct((rows, 32), jnp.bfloat16)
    want_fwd = _narrow.fused_forward_wins(spec, xs)
    want_bwd = want_fwd and _narrow.fused_backward_wins(spec, xs) and _narrow.kernel_runs("cuda", spec, xs, backward=True)
    assert fwd == int(want_fwd) and n == ((1, 1) if want_bwd else (0, 0)), (fwd, n)
