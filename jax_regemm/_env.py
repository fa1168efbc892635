"""Every REGEMM_* environment variable, read and checked in one place.

Each switch is described once below: when it is read, the values it takes, its
default and what it does. docs/environment.md is this table written out
(`python -m jax_regemm._env` prints it; a test keeps the two equal), and a test
checks that no source reads a REGEMM_* name missing here.

When they are read:
- "lowering": by jax_regemm's Python when a program is lowered (`route`, `flag`, `choice`;
  REGEMM_NARROW also when it is traced);
- "call": by the CUDA handlers at every call (ffi/regemm/env.h: the same on/off
  spellings as here, in any case);
- "build": by the package's build (pip / CMake), never at run time;
- "dev": by the repository's test and device scripts only.

Every time a program is lowered, `check()` validates every REGEMM_* variable that
is set: an unknown name, or a value outside a switch's spellings, raises a
ValueError naming what is allowed. So the handlers, which read their switches
at call time in C++, only ever see values that passed here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")
_ROUTE = ("auto", "xla", "regemm")
_TRISTATE = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class Switch:
    name: str
    read: str  # "lowering", "call", "build" or "dev"
    values: tuple  # the spellings taken (case-insensitive); () for a free value checked by `check`
    default: str
    doc: str
    check: object = None  # for free values: a function of the value, True where valid
    shown: str = ""  # how docs/environment.md shows free values

    def valid(self, value: str) -> bool:
        v = value.strip().lower()
        if self.values:
            return v in self.values
        return self.check is None or self.check(value)


def _int_in(lo, hi):
    def ok(v):
        try:
            return lo <= int(v) <= hi
        except ValueError:
            return False

    return ok


def _nonneg_float(v):
    try:
        return math.isfinite(float(v)) and float(v) >= 0
    except ValueError:
        return False


_ROUTE_DOC = ("as XLA's own program (`xla`) or as regemm's calls (`regemm`), on every platform; `auto`: "
              "the routing table's choice (jax_regemm/_route.py, docs/architecture.md)")  # fmt: skip

SWITCHES = (
    # --- read when a program is lowered (Python) --------------------------------------------
    Switch("REGEMM_PLAIN_GEMM", "lowering", _ROUTE, "auto",
           "GEMMs with nothing to fuse (act none, no bias, no C, no Z: the backward's dgrad and wgrad) "
           + _ROUTE_DOC + ". auto: XLA's dot on the GPU, regemm's on the CPU."),
    Switch("REGEMM_DACT", "lowering", _ROUTE, "auto",
           "The backward epilogue (gZ = gY act'(S) and the bias gradient, with the dgrad GEMM folded into it) "
           + _ROUTE_DOC + ". auto: regemm's everywhere."),
    Switch("REGEMM_UNALIGNED", "lowering", _ROUTE, "auto",
           "Ops whose rows are not whole 16-byte vectors (K or N odd in bf16) " + _ROUTE_DOC
           + ". auto: XLA's on the GPU (its padded GEMM beats regemm's unaligned fallbacks), regemm's on the CPU. "
           "The test suite sets regemm, to test the kernels at odd sizes."),
    Switch("REGEMM_SMALL", "lowering", _ROUTE, "auto",
           "Ops with at most 512 rows of output or 2^21 elements, or narrow ones (fewer than 128 output columns) " + _ROUTE_DOC
           + ". auto: XLA's on the GPU (a custom call's host cost is most of a small program's time; regemm's "
           "128-wide tiles compute mostly padding in a narrow one), regemm's on the CPU. The test suite sets regemm."),
    Switch("REGEMM_XLA_EPILOGUE", "lowering", _ROUTE, "auto",
           "16-bit forwards outside a derivative of act none or relu with a per-column bias (an epilogue XLA "
           "folds into its own GEMM) " + _ROUTE_DOC + ". auto: XLA's on the GPU, regemm's on the CPU. "
           "The test suite sets regemm."),
    Switch("REGEMM_PORTABLE", "lowering", _ROUTE, "auto",
           "Ops of a dtype whose GEMMs this machine runs on the portable kernel alone (the CPU's packed GEMM, "
           "where oneDNN has no kernel for the dtype here: bf16 and f16 without AVX-512, f64) " + _ROUTE_DOC
           + ". auto: XLA's (its dot ran bf16 layers 13-23x faster on an AVX2-only CPU). The test suite sets regemm."),
    Switch("REGEMM_NARROW", "lowering", _TRISTATE, "auto",
           "MLP blocks the fused narrow-MLP kernels take (bf16/f16, hidden widths 16-128, docs/spec.md §8) on "
           "CUDA: auto, the whole stack in one kernel outside a derivative, and its derivative through the fused "
           "backward where that is the faster (jax_regemm/_narrow.py, `fused_backward_wins`), else layer by layer; "
           "on, both kernels wherever they fit; off, layer by layer. Read when the program is traced and lowered. "
           "The test suite sets off (its per-layer call counts); tests/test_narrow.py sets on."),
    Switch("REGEMM_IN_PLACE", "lowering", ON + OFF, "on",
           "The backward's dgrad calls may write gZ over the S they read (Y of the layer below, or a "
           "recomputed Z) where the fused kernel runs them: one [M, N] buffer less at the backward's peak."),
    # --- read by the CUDA handlers at every call ----------------------------------------------
    Switch("REGEMM_TUNE", "call", ON + OFF, "on",
           "Time the ways of running each new call signature and keep the fastest; off: the rule picks."),
    Switch("REGEMM_TUNE_LOG", "call", ON + OFF, "off", "Print each timed candidate and the choice (stderr)."),
    Switch("REGEMM_TUNE_MARGIN", "call", (), "3", "How much faster (percent) than the rule's way another way "
           "must be to be kept instead; 0: the fastest.", _nonneg_float, "a number >= 0"),
    Switch("REGEMM_TUNE_REPS", "call", (), "3-10 by size", "Timed runs per candidate.", _int_in(1, 32),
           "an integer 1-32"),
    Switch("REGEMM_TUNE_CACHE", "call", (), "unset", "A JSON file that keeps the tuner's choices across "
           "processes (per GPU model and cuBLASLt version).", None, "a file path"),
    Switch("REGEMM_BACKEND", "call", ("cutlass_sm90", "cublas", "cuda_simt"), "unset",
           "Only that kernel family, tuned among its ways, wherever it supports the problem."),
    Switch("REGEMM_VARIANT", "call", (), "unset", "That way wherever it applies, untimed (labels as "
           "`rg.tuned()` shows them).", lambda v: "/" in v, "kernel/way"),
    Switch("REGEMM_USE_CUTLASS", "call", ON + OFF, "on", "off: never the CUTLASS sm90 kernels."),
    Switch("REGEMM_CUTLASS_CONFIG", "call", ("coop128x256", "ping128x128", "streamk128x128", "ping128x128c1"),
           "unset", "Only that CUTLASS tile configuration."),
    Switch("REGEMM_CUTLASS_SPLIT", "call", ON + OFF, "unset", "Costly activations (gelu, silu, sigmoid, "
           "tanh) after a CUTLASS GEMM: on, always as a pass of their own; off, always fused; unset, the rule."),
    Switch("REGEMM_CUTLASS_ONE_ACT", "call", ON + OFF, "on", "off: costly activations through the "
           "every-activation kernel, not the kernels compiled for each one (for A/B)."),
    Switch("REGEMM_CUTLASS_F32_BT", "call", ("transpose", "swap"), "transpose", "An f32 x @ w GEMM on CUTLASS: "
           "transpose W first (one pass), or swap: compute Y^T = W^T X^T in the register-A kernel."),
    Switch("REGEMM_CUTLASS_TMA_STRIDE0", "call", ON + OFF, "off", "on: TMA kernels for operands broadcast "
           "by a zero batch stride (a developer switch)."),
    Switch("REGEMM_NARROW_WGMMA", "call", ON + OFF, "on", "The fused narrow MLP's kernels on sm90a's warpgroup "
           "MMA (wgmma) where this build and GPU have them and they are the faster (the forward from 64 wide); "
           "off: on mma.sync everywhere (for A/B)."),
    Switch("REGEMM_FUSED_DGRAD", "call", ON + OFF, "unset", "The dgrad GEMM with the layer below's act': on, "
           "always the CUTLASS kernel with act' in its epilogue; off, always the GEMM then the dact pass; "
           "unset, the tuner times them (the rule: fused up to K = 2048)."),
    # --- read by the build ---------------------------------------------------------------------------
    Switch("REGEMM_CUDA", "build", _TRISTATE, "auto", "Build the CUDA extension: auto (where nvcc and cuBLAS "
           "are found), on (an error if they are not), off."),
    Switch("REGEMM_ONEDNN", "build", _TRISTATE, "auto", "CPU GEMMs on oneDNN from its PyPI wheels."),
    Switch("REGEMM_CUTLASS", "build", _TRISTATE, "auto", "Build the CUTLASS sm90 kernels (auto: where the "
           "CUTLASS headers are found, e.g. the nvidia-cutlass wheel). A CMake option "
           "(-C cmake.define.REGEMM_CUTLASS=OFF); at run time, REGEMM_USE_CUTLASS."),
    Switch("REGEMM_CUTLASS_DIR", "build", (), "the nvidia-cutlass wheel's", "A CUTLASS source root for the "
           "build (and ffi/cuda/cutlass/prebuild.sh).", None, "a directory"),
    Switch("REGEMM_CUTLASS_DTYPES", "build", (), "bf16;f16;f32", "The dtypes of the CUTLASS kernels built "
           "(a quicker developer build; a dtype left out runs on cuBLASLt, and its CUTLASS tests skip).",
           lambda v: set(v.replace(",", ";").split(";")) <= {"bf16", "f16", "f32"}, "a list of bf16, f16, f32"),
    Switch("REGEMM_CUTLASS_PREBUILT", "build", (), ".cutlass_prebuilt", "A directory of CUTLASS kernel objects "
           "built by ffi/cuda/cutlass/prebuild.sh, linked where their stamp matches the sources.", None,
           "a directory"),
    Switch("REGEMM_CUBLAS_ROOT", "build", (), "the nvidia-cublas wheel's", "A directory with include/cublas_v2.h "
           "and lib/libcublas.so*.", None, "a directory"),
    Switch("REGEMM_NATIVE", "build", ON + OFF, "off", "Tune the CPU fallback kernels for the build machine "
           "(-march=native)."),
    # --- the repository's scripts -------------------------------------------------------------------
    Switch("REGEMM_TEST_SEED", "dev", (), "0", "Varies every test's random inputs (tests/conftest.py).",
           _int_in(0, 2**31), "an integer"),
    Switch("REGEMM_TEST_SHARD", "dev", (), "unset", "i/n: the test suite's every n-th test from the i-th "
           "(tests/conftest.py; tools/gpu_check.sh runs the suite so in n calls).",
           lambda v: bool(re.fullmatch(r"[1-9][0-9]*/[1-9][0-9]*", v)) and int(v.split("/")[0]) <= int(v.split("/")[1]),
           "i/n with 1 <= i <= n"),
    Switch("REGEMM_JAX", "dev", ON + OFF, "off", "tests/cutlass_device.sh: also install the package and run "
           "the JAX tests and benchmark."),
    Switch("REGEMM_SKIP_INSTALL", "dev", ON + OFF, "off", "tools/device_install.sh: only set up the path."),
)  # fmt: skip

_BY_NAME = {s.name: s for s in SWITCHES}


def allowed(s: Switch) -> str:
    return ", ".join(s.values) if s.values else s.shown or "any value"


def check(environ=None) -> None:
    """Every REGEMM_* variable that is set: a known name with a valid value, else a ValueError."""
    environ = os.environ if environ is None else environ
    for name, value in environ.items():
        if not name.startswith("REGEMM_"):
            continue
        s = _BY_NAME.get(name)
        if not value.strip():  # set but empty: unset, as the handlers read it
            continue
        if s is None:
            raise ValueError(f"{name} is not a jax_regemm switch; the switches are {', '.join(_BY_NAME)} "
                             "(docs/environment.md)")  # fmt: skip
        if not s.valid(value):
            raise ValueError(f"{name}={value!r}: expected {allowed(s)} (docs/environment.md)")


def _value(name: str) -> str | None:
    check()
    v = os.environ.get(name, "").strip().lower()
    return v or None  # (empty: unset)


def route(name: str) -> str:
    """A routing switch's value: "auto", "xla" or "regemm"."""
    assert _BY_NAME[name].values == _ROUTE
    return _value(name) or "auto"


def choice(name: str) -> str:
    """An auto/on/off switch read in Python: its value, or its default."""
    s = _BY_NAME[name]
    assert s.values == _TRISTATE and s.read == "lowering"
    return _value(name) or s.default


def flag(name: str) -> bool:
    """An on/off switch read in Python: its value, or its default."""
    s = _BY_NAME[name]
    assert s.values == ON + OFF
    v = _value(name)
    return (v if v is not None else s.default) in ON


def markdown() -> str:
    """docs/environment.md."""
    titles = {"lowering": "Read when a program is lowered", "call": "Read by the CUDA handlers at every call",
              "build": "Read by the build", "dev": "Read by the repository's scripts"}  # fmt: skip
    out = ["# Environment variables", "",
           "Every `REGEMM_*` variable, generated from `jax_regemm/_env.py` (`python -m jax_regemm._env`).",
           "On/off switches take 1, on, true, yes / 0, off, false, no, in any case; an empty value is unset.",
           "Whenever a program is lowered, every set `REGEMM_*` variable is checked: an unknown name or value",
           "raises a ValueError that names the allowed ones. A build option and a run-time switch never share",
           "a name.", ""]  # fmt: skip
    for read, title in titles.items():
        out += [f"## {title}", "", "| variable | values | default | effect |", "| --- | --- | --- | --- |"]
        for s in SWITCHES:
            if s.read == read:
                values = " / ".join(f"`{v}`" for v in s.values) if s.values else s.shown
                if s.values == ON + OFF:
                    values = "on / off"
                elif s.values == _TRISTATE:
                    values = "`AUTO` / `ON` / `OFF`"
                out.append(f"| `{s.name}` | {values} | {s.default} | {s.doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown())
