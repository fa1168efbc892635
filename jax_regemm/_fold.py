"""The fold across layers written one op at a time, at lowering.

Reverse mode through layers of their own (rg.dense; the Flax, nnx and Equinox Dense)
runs, per layer, the dgrad GEMM of the layer above (a plain GEMM, gY = alpha gZ op(W)),
then this layer's dact over gY: the GEMM writes gY and the dact pass reads it back.
rg.mlp makes the two one regemm_dgrad_dact call, as its transpose sees both layers. Here
the lowering finds the same pair: each plain 2-D GEMM lowered records its result with
its operands, and a dact whose gY is such a result (or a reshape of one: rg.dense
flattens leading dims) lowers as regemm_dgrad_dact of the GEMM's operands. The GEMM, its
result then unread, is dead code that XLA removes. In reverse mode a cotangent is read
only by the transpose of the op that made its primal, so gY is the dact's alone; were it
read elsewhere too (a hand-written backward), the GEMM would stay: the same results, one
GEMM more. The records live in the module's lowering context, one table per program.

As in rg.mlp, the folded call writes gZ over S where S is Y of the layer (relu, leaky_relu,
sigmoid, tanh from Y) on one GPU (_ffi._in_place): the backward's first call then holds one
[M, N] buffer fewer. Y is also the input of the layer above, read by its forward (done
before: the call depends on it through the cotangent) and by its wgrad (not ordered with
the call: both read the layer above's gZ). The lowering finds S's readers so far; a wgrad
among them becomes an operand the call follows, never reads (ordering the read first: else
XLA copies S for the call), and any other reader the call does not depend on (a program that
returns Y, say) keeps gZ in a buffer of its own, as does an S the function being lowered takes
as an argument (a loop body's residual, a backward compiled apart from its forward).

Partitioned over several devices, the wgrad's result is all-reduced: a call following it
would wait for the collective. There the wgrad and the call run as one partitioned op
(_partition.layer_backward), whose local body orders them as one GPU does; the program then
reads the wgrad's result from that op. As the wgrad was lowered first and its later readers
are lowered from its value, a plain GEMM's result in a partitioned program passes through an
identity op (rewirable) whose operand the fold makes the new op's result; XLA drops the old
GEMM. rg.mlp's calls, which take their wgrad as `after`, do the same (_dgrad_dact_rule).

The lowering rules that use these helpers are _fused._fused_rule and _epilogues._dact_rule and
_dgrad_dact_rule; is_argument also decides where _backward.one_buffer puts no barrier."""

import dataclasses

from jax._src.lib.mlir.dialects import hlo

from . import _ffi

_GEMMS = "jax_regemm.plain_gemm_results"  # the table's key in ModuleContext.cached_primitive_lowerings


def gemm_results(ctx):
    """{result value: ((A, B) values, (A, B) avals, Config, result aval, wrapper)} of the plain GEMMs lowered
    so far; wrapper: the identity op the program reads the result through in a partitioned program
    (rewirable), else None."""
    return ctx.module_context.cached_primitive_lowerings.setdefault(_GEMMS, {})


def partitioned(ctx):
    """Whether XLA partitions the program being lowered over several devices (jit with shardings;
    not a shard_map body, whose axes are manual)."""
    axis_context = ctx.module_context.axis_context
    return getattr(axis_context, "num_devices", 0) > 1 and not hasattr(axis_context, "manual_axes")


def rewirable(value):
    """(value through an identity reshape, that reshape): a later fold may make another op the
    reshape's operand, the one place the program reads the value from (layer_backward)."""
    op = hlo.ReshapeOp(value.type, value)
    return op.result, op.operation


def _reshaped_from(value):
    """The op that made `value`, if a reshape (an ir.Operation); else None (a block argument too)."""
    op = value.owner
    op = getattr(op, "operation", None)  # an OpView or an Operation; a Block has none
    return op if op is not None and op.name == "stablehlo.reshape" else None


def gemm_of(ctx, value):
    """The record of the plain GEMM whose result `value` is, through reshapes; else None."""
    table = gemm_results(ctx)
    while value not in table:
        op = _reshaped_from(value)
        if op is None:
            return None
        value = op.operands[0]
    return table[value]


def _array(value):
    """The value `value` is a reshape of (through reshapes), or `value`."""
    while (op := _reshaped_from(value)) is not None:
        value = op.operands[0]
    return value


def is_argument(value):
    """Whether `value` (through reshapes) is an argument of the function being lowered: a buffer
    that XLA would copy for a call writing over it (an entry parameter, a loop body's operand)."""
    return getattr(_array(value).owner, "operation", None) is None


def _readers(value):
    """The ops lowered so far that read `value` or a reshape of the array it is (not the reshapes)."""
    ops, todo = [], [_array(value)]
    while todo:
        for use in todo.pop().uses:
            op = use.owner.operation
            if op.name == "stablehlo.reshape":
                todo.append(op.results[0])
            else:
                ops.append(op)
    return ops


def _made_before(values, ops):
    """The first results of those of `ops` that the values depend on (their producers, transitively)."""
    left = {op.results[0] for op in ops if len(op.results)}
    found, seen, todo = set(), set(), list(values)
    while todo and left:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        op = getattr(v.owner, "operation", None)  # None: a block argument
        if op is None or not len(op.results):
            continue
        if op.results[0] in left:
            left.discard(op.results[0])
            found.add(op.results[0])
        todo.extend(op.operands)
    return found


def one_gpu(platform, ctx):
    """Whether the program being lowered runs on one GPU: where a dgrad_dact call may follow the
    wgrad that reads its S as a value of the program (partitioned, see layer_backward)."""
    return platform == "cuda" and getattr(ctx.module_context.axis_context, "num_devices", 0) == 1


def in_place_after(platform, ctx, a, b, s, avals, ddspec):
    """The values (with their avals; none or one) a folded dgrad_dact call writing gZ over S must
    follow, or None where it does not write over S (the module's docstring)."""
    if not ddspec.dact.from_y or not one_gpu(platform, ctx):
        return None
    if is_argument(s):
        return None
    if not writes_over_s(platform, avals, ddspec):
        return None
    return _follows(ctx, a, b, s)


def writes_over_s(platform, avals, ddspec):
    """Whether a dgrad_dact call on these operands, asked to, writes gZ over S (the CUDA module
    says which of its ways can)."""
    asked = dataclasses.replace(ddspec, in_place=True)
    return platform == "cuda" and _ffi.dgrad_dact_in_place(*avals, **asked.ffi_attrs())


def partitioned_wgrad(ctx, a, b, s, ddspec):
    """In a partitioned program, the record of the wgrad that reads S (Y of the layer) and that a
    folded call on (a, b, s) runs in one op with (layer_backward: the wgrad, then the call following
    it), or None."""
    if not ddspec.dact.from_y or not partitioned(ctx) or is_argument(s):
        return None
    after = _follows(ctx, a, b, s)
    if not after:
        return None
    record = gemm_results(ctx)[after[0][0]]
    return record if rewirable_now(record) else None


def rewirable_now(record):
    """Whether a GEMM record's wrapper (rewirable) exists and nothing has read it yet: its operand
    may still become another op's result."""
    return record[4] is not None and not list(record[4].results[0].uses)


def _follows(ctx, a, b, s):
    """S's readers lowered so far, as the values of those a call on (a, b, s) must follow (with their
    avals; none or one), or None where a reader is not a wgrad the call could follow."""
    readers = _readers(s)
    before = _made_before([a, b], readers)
    table = gemm_results(ctx)
    after = []
    for op in readers:
        if len(op.results) and op.results[0] in before:
            continue
        gemm = _gemm_fed(table, op)
        if gemm is None:
            return None  # a reader the call cannot follow: S stays
        after.append((gemm, table[gemm][3]))
    return after if len(after) <= 1 else None  # the call follows one value (its handler's optional operand)


def _gemm_fed(table, op):
    """The result of the plain GEMM that `op` is or feeds alone (XLA's dot lowers as a transpose,
    the dot and a convert), if one is recorded; else None. The call follows that result (its
    operand S's reader itself, a transpose, would be made an array of its own)."""
    for _ in range(4):
        if len(op.results) and op.results[0] in table:  # (a call's first result: our GEMM on the CPU)
            return op.results[0]
        if len(op.results) != 1:
            return None
        v = op.results[0]
        uses = list(v.uses)
        if len(uses) != 1:
            return None
        op = uses[0].owner.operation
    return None
