"""The routing: which program each op lowers to, regemm's call or XLA's own.

Decided per op when a program is lowered, from what is known then: the platform, the
dtype, the shapes, the op's configuration (activation, bias, C, Z asked for), and whether
it is the forward of a derivative. The answer is a program name, which the primitive
maps to its lowering: "regemm" (the FFI call behind its partitioning rule), "xla_gemm"
(XLA's dot), "xla_folded" (the product in the input dtype, then the epilogue, as a user
writes it), or "reference" (alpha = 0: no product). A backward epilogue's are "regemm" and
"xla" (the program a user's backward is). An op on XLA's program has that program's
numerics (docs/spec.md §1): the product rounded to the input dtype before the epilogue, so a
kink's act' is decided on that Z. (It was the reference's, Z in f32 rounded once, until the
narrow MLPs: their f32 products cost the 2^20-row steps 0.6 ms of 1.4; h200_narrow.md.)

The table below says which classes of op go to XLA's program by default, per platform;
each class has a switch (_env: auto, xla or regemm) that overrides it on every platform,
for A/B and for the kernel tests at odd and small sizes. Measured on the H100 and H200
(benchmarks/results/, docs/performance.md):

- "gemm", a plain GEMM (nothing to fuse: the backward's dgrad and wgrad): XLA's GEMM is
  at least as fast and a cheaper launch.
- "unaligned", rows that are not whole 16-byte vectors: XLA pads such a GEMM, where
  regemm's TMA and vector kernels cannot run and its fallbacks ran at 0.47-0.86 of XLA's speed.
- "small", too small in some dimension for regemm's tiles: at most _SMALL_ROWS rows of
  output or _SMALL_ELEMENTS elements (over the batch dims), where a call's host cost is most
  of an uncaptured program's time and XLA's own GEMMs for few rows (split-K, Triton) run as
  fast or faster (regemm's calls lost by wall clock in 64 of 84 such layers); or narrow,
  fewer than _NARROW output columns, where regemm's 128-wide tiles compute mostly padding
  and its epilogue stores part-empty subtiles while XLA picks tiles that fit (narrow MLPs of
  widths 16-64 on regemm's calls: training steps at 0.34-0.79 of the plain program's speed;
  on XLA's, 0.96-1.03; benchmarks/results/h200_narrow.md). A narrow contraction alone (a
  first layer on 32 features) keeps the call: routing those too ran no faster and held 1.14x
  the temporaries at 2^20 x 32 -> 128.
- "xla_epilogue", a 16-bit forward outside a derivative whose epilogue XLA folds into its
  own GEMM (act none or relu, a per-column bias): the same single kernel at a cheaper
  launch. In a derivative's forward the call stays: there the peak holds every layer's
  residuals, and XLA's GEMM brought its 32 MiB cuBLAS workspace to it.
- "dact", the backward epilogue: regemm's everywhere (on XLA, whole training steps ran
  0.98x of XLA's speed against 1.13x).
- "portable", a dtype this machine runs on the portable GEMM alone (the CPU's packed kernel:
  oneDNN has no kernel for bf16 and f16 on CPUs without AVX-512, nor any for f64): XLA's dot
  ran bf16 layers 13-23x faster on an AVX2-only EPYC (benchmarks/results/cpu_portable.md).
  The CPU's entry is read from the extension on first use (which kernels run each dtype here).
On the CPU every other class stays regemm's: oneDNN's 16-bit GEMMs are several times faster
than XLA's, and f32 layers measured the same either way.
"""

from __future__ import annotations

import functools
import math

from jax._src import core as _core

from . import _env
from ._targets import gemm_shape

_GPU_DTYPES = ("float32", "bfloat16", "float16")
_PORTABLE_KERNELS = {"cpu_packed"}  # correct for every problem, fast for none
# None: read from the extension on first use (_portable_dtypes).
ON_XLA = {
    "cuda": {"gemm": _GPU_DTYPES + ("float64",), "dact": (), "unaligned": _GPU_DTYPES, "small": _GPU_DTYPES,
             "xla_epilogue": ("bfloat16", "float16"), "portable": ()},
    "cpu": {"gemm": (), "dact": (), "unaligned": (), "small": (), "xla_epilogue": (), "portable": None},
}  # fmt: skip
PLATFORMS = tuple(ON_XLA)
SWITCH = {"gemm": "REGEMM_PLAIN_GEMM", "dact": "REGEMM_DACT", "unaligned": "REGEMM_UNALIGNED",
          "small": "REGEMM_SMALL", "xla_epilogue": "REGEMM_XLA_EPILOGUE", "portable": "REGEMM_PORTABLE"}  # fmt: skip


@functools.cache
def _portable_dtypes():
    """The dtypes whose GEMMs this machine's CPU extension runs on the portable kernel alone."""
    from . import _regemm_cpu  # loaded by then (_ffi, after oneDNN's library)

    return tuple(dt for dt, names in _regemm_cpu.gemm_kernels_by_dtype().items() if set(names) <= _PORTABLE_KERNELS)


_SMALL_ROWS, _SMALL_ELEMENTS, _NARROW = 512, 2**21, 128


def on_xla(op, platform, dtype):
    """Whether ops of class `op` lower to XLA's program on `platform` for `dtype`: the switch, else the table."""
    forced = _env.route(SWITCH[op])
    if forced != "auto":
        return forced == "xla"
    dtypes = ON_XLA[platform][op]
    return dtype.name in (_portable_dtypes() if dtypes is None else dtypes)


def unaligned(platform, dtype, *row_lengths):
    """Whether an op with rows of these lengths (elements, as stored) lowers to XLA's program for being
    unaligned: some row is not a whole number of 16-byte vectors, which the GPU kernels' TMA descriptors
    and vector loads need (ffi/cuda/cutlass/cutlass_dispatch.cu, ffi/cuda/epilogue/dact.cu)."""
    per_vector = max(16 // dtype.itemsize, 1)
    return any(n % per_vector for n in row_lengths) and on_xla("unaligned", platform, dtype)


def small(platform, dtype, *shapes):
    """Whether an op lowers to XLA's program for being small: at most _SMALL_ROWS rows of output or
    _SMALL_ELEMENTS elements, counted over its batch dims, or narrow, fewer than _NARROW columns of
    output. shapes: the output's, or operands with the output's rows (the largest count is taken), the
    last with its columns. A symbolic dim (jax.export's shape polymorphism) leaves the size to run
    time: not small. Under a mesh these are the global shapes, before partitioning (a device's share
    is smaller)."""
    if not on_xla("small", platform, dtype) or not all(_core.is_constant_shape(s) for s in shapes):
        return False
    rows, cols = max(math.prod(s[:-1]) for s in shapes), shapes[-1][-1]
    return rows <= _SMALL_ROWS or rows * cols <= _SMALL_ELEMENTS or cols < _NARROW


def plain(cfg):
    """alpha op(A) op(B) and nothing else: no bias, C, activation or Z stash to fuse."""
    return cfg.act == "none" and cfg.bias_kind == "none" and not cfg.c_shape and not cfg.return_z


def kink_decided_on_z(cfg):
    """Whether a kink's act' will be decided on this op's Z: relu or leaky_relu in a derivative's
    forward or with Z asked for, and a Z the backward recomputes (act none with save="recompute": its
    layer's act is not known here, so every recompute). Where both programs run equally fast (the
    xla_epilogue class) such an op keeps regemm's call, whose Z is the product and bias rounded once:
    XLA's program rounds the product first, and where its GEMM fusion is Triton's act' flipped near 0
    (bf16 gradients 3.6e-2 off the reference's at 2048x1024x1024 relu, H100, as the plain program's)."""
    if cfg.act == "none":
        return cfg.save == "recompute"
    return cfg.act in ("relu", "leaky_relu") and (cfg.differentiated or cfg.return_z)


def _xla_epilogue(cfg):
    """A forward outside a derivative whose epilogue XLA folds into its own GEMM: act none or relu,
    a per-column bias or none, nothing else (no C, alpha 1, no Z asked for)."""
    return (cfg.act in ("none", "relu") and cfg.bias_kind in ("none", "per_col") and not cfg.c_shape
            and cfg.alpha == 1.0 and not cfg.return_z and not cfg.differentiated and not kink_decided_on_z(cfg))  # fmt: skip


def fused_program(platform, cfg, a_shape, b_shape, dtype):
    """The program regemm_fused lowers to: "xla_gemm", "reference", "xla_folded" or "regemm"."""
    if cfg.alpha == 0:  # no product to compute: the reference reads none, as BLAS (docs/spec.md §2)
        return "reference"
    if on_xla("portable", platform, dtype):  # every op of the dtype (for a plain GEMM xla_folded is xla_gemm)
        return "xla_folded"
    if plain(cfg) and on_xla("gemm", platform, dtype):
        return "xla_gemm"
    out = gemm_shape(a_shape, b_shape, cfg.trans_a, cfg.trans_b, *([cfg.c_shape] if cfg.c_shape else []))
    rows = (a_shape[-1], b_shape[-1], out[-1]) + tuple(cfg.c_shape[-1:])  # as stored: A, B, Y and Z, C
    if unaligned(platform, dtype, *rows) or small(platform, dtype, out):
        return "xla_folded"
    if _xla_epilogue(cfg) and on_xla("xla_epilogue", platform, dtype):
        return "xla_folded"
    return "regemm"


def epilogue_program(platform, dtype, *shapes, gemm=False):
    """The program a backward epilogue (regemm_dact: gY and S; regemm_dgrad_dact: A, B and S, with its
    GEMM (`gemm`); regemm_bias_grad: gZ) lowers to: "xla" (the program a user's backward
    is: XLA's product in the input dtype, then the elementwise act' and the bias sum) or "regemm". gZ has
    S's rows and columns (and gY's rows, or A's)."""
    if on_xla("dact", platform, dtype) or (gemm and on_xla("portable", platform, dtype)):
        return "xla"
    if unaligned(platform, dtype, *(s[-1] for s in shapes)) or small(platform, dtype, shapes[0], shapes[-1]):
        return "xla"
    return "regemm"
