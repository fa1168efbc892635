"""One description per FFI target: its versioned name, operands, attributes and results.

The C++ binding of each target (ffi/regemm/handlers.h) and this description must agree:
the attribute names and types below are the ones the handler binds, in its order, and a
change to any of them is a new target version (docs/spec.md, "Export"). Everything in
Python reads them from here: the call (_ffi.call), the workspace and in-place queries
(_ffi), and the partitioning rules (_partition, from `factors`).

`gemm_shape` is the one place that computes a GEMM's output shape from its operands'
shapes and transposes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


def gemm_shape(a_shape, b_shape, trans_a, trans_b, *batch_from):
    """The output shape of op(A) @ op(B): the broadcast batch of A, B and `batch_from` (shapes
    whose last two dims are not batch dims: C, S), then op(A)'s rows and op(B)'s columns."""
    m = a_shape[-1] if trans_a else a_shape[-2]
    n = b_shape[-2] if trans_b else b_shape[-1]
    batch = jnp.broadcast_shapes(*(tuple(s[:-2]) for s in (a_shape, b_shape, *batch_from)))
    return tuple(batch) + (m, n)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # the custom-call target (ffi/regemm/module_util.h)
    operands: tuple  # operand names, in the handler's order
    results: tuple  # result names, in the handler's order (the workspace, added at lowering, not among them)
    attrs: tuple  # ((name, type), ...) as the handler binds them

    def attributes(self, params):
        """The call's attributes, typed as the handler binds them, from `params` (which may hold more)."""
        return {k: t(params[k]) for k, t in self.attrs}


_f64 = np.float64

GEMM = Target(
    "regemm_gemm_v1", ("a", "b", "bias", "c"), ("y", "z"),
    (("act", str), ("slope", _f64), ("alpha", _f64), ("beta", _f64), ("trans_a", bool), ("trans_b", bool),
     ("bias_kind", str), ("has_c", bool), ("store_z", bool), ("exact_f32", bool)),
)  # fmt: skip
DACT = Target("regemm_dact_v1", ("gy", "s"), ("gz", "gbias"),
              (("act", str), ("slope", _f64), ("from_y", bool), ("bias_kind", str)))  # fmt: skip
DGRAD_DACT = Target(
    "regemm_dgrad_dact_v1", ("a", "b", "s", "after"), ("gz", "gbias"),
    (("act", str), ("slope", _f64), ("from_y", bool), ("bias_kind", str), ("alpha", _f64), ("trans_a", bool),
     ("trans_b", bool), ("exact_f32", bool)),
)  # fmt: skip
# The fused narrow MLP (ffi/cuda/narrow/narrow_mlp.cu; CUDA only): x, every weight, every bias
# ([0] where a layer has none), for the backward then gy; results y, or gx, every gW, every gb
# (empty where not wanted).
_NARROW_ATTRS = (("act", str), ("final_act", str), ("slope", _f64), ("w_transposed", bool))
NARROW_MLP = Target("regemm_narrow_mlp_v1", ("x", "weights", "biases"), ("y",), _NARROW_ATTRS)
NARROW_MLP_BWD = Target("regemm_narrow_mlp_bwd_v1", ("x", "weights", "biases", "gy"), ("gx", "gws", "gbs"),
                        _NARROW_ATTRS)  # fmt: skip
TARGETS = (GEMM, DACT, DGRAD_DACT)  # on every platform
CUDA_TARGETS = (NARROW_MLP, NARROW_MLP_BWD)  # on CUDA alone

# The sharding factors of each target's operands and results (the dims a partitioning rule
# names; _partition): m, n and k of the GEMM, s the scalar bias's one element.
BIAS_FACTOR = {"per_col": ("n",), "per_row": ("m",), "scalar": ("s",)}
BIAS_REDUCED = {"per_col": ("m",), "per_row": ("n",), "scalar": ("m", "n")}  # what the bias gradient sums over


def gemm_factors(trans_a, trans_b, bias_kind="none", has_c=False):
    """The factors of op(A) @ op(B)'s operands A, B (and the bias, C where present)."""
    tails = [("k", "m") if trans_a else ("m", "k"), ("n", "k") if trans_b else ("k", "n")]
    if bias_kind != "none":
        tails.append(BIAS_FACTOR[bias_kind])
    if has_c:
        tails.append(("m", "n"))
    return tails


def factors(target, params):
    """(operand factors, result factors) of a call of `target` with these attributes; the
    optional operands as `params` says (has_bias, has_c), results without the empty ones."""
    kind = params["bias_kind"]
    gbias = [BIAS_FACTOR[kind]] if kind != "none" else []
    if target is GEMM:
        ops = gemm_factors(params["trans_a"], params["trans_b"], kind if params["has_bias"] else "none",
                           params["has_c"])  # fmt: skip
        return ops, [("m", "n")] * (2 if params["store_z"] else 1)
    if target is DACT:
        return [("m", "n"), ("m", "n")], [("m", "n")] + gbias
    if target is DGRAD_DACT:  # S has C's place: [.., M, N]
        return gemm_factors(params["trans_a"], params["trans_b"], has_c=True), [("m", "n")] + gbias
    raise ValueError(target)
