"""The REGEMM_* switches (jax_regemm/_env.py, docs/environment.md): one table, checked at lowering."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import jax_regemm as rg
from jax_regemm import _env

ROOT = pathlib.Path(__file__).resolve().parents[1]
_SOURCES = ["jax_regemm", "ffi", "tools", "tests", "benchmarks", "examples", "CMakeLists.txt", "pyproject.toml"]
# Names that are not switches: the C++ macros and CMake's template fields.
_NOT_SWITCHES = {"REGEMM_HD", "REGEMM_CUDA_CHECK", "REGEMM_CUBLAS_CHECK", "REGEMM_LAUNCH_CHECK", "REGEMM_ACT_CASE",
                 "REGEMM_ISA", "REGEMM_ISAS", "REGEMM_X86_ISAS", "REGEMM_DT", "REGEMM_TA", "REGEMM_TB",
                 "REGEMM_CFG", "REGEMM_ACT", "REGEMM_SLOT", "REGEMM_CUTLASS_NVCC_FLAGS", "REGEMM_NOT_SET",
                 "REGEMM_NARROW_FWD", "REGEMM_NARROW_BWD", "REGEMM_NARROW_OUT", "REGEMM_GMMA_FAMILY",
                 "REGEMM_SM90A"}  # fmt: skip


def _lower(x):
    return jax.jit(lambda x: rg.dense(x, jnp.ones((4, 8)), act="relu")).lower(x)


def test_unknown_switch_raises_at_lowering(monkeypatch):
    monkeypatch.setenv("REGEMM_SMAL", "xla")
    with pytest.raises(ValueError, match=r"REGEMM_SMAL is not a jax_regemm switch; the switches are .*REGEMM_SMALL"):
        _lower(jnp.ones((2, 4)))


@pytest.mark.parametrize("name,value,allowed", [("REGEMM_SMALL", "XLA!", "auto, xla, regemm"),
                                                ("REGEMM_IN_PLACE", "maybe", "1, on, true, yes, 0, off, false, no"),
                                                ("REGEMM_BACKEND", "cutlass", "cutlass_sm90, cublas, cuda_simt"),
                                                ("REGEMM_TUNE_REPS", "99", "an integer 1-32")])  # fmt: skip
def test_bad_value_raises_naming_the_allowed_ones(monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}: expected {allowed}")):
        _lower(jnp.ones((2, 4)))


@pytest.mark.parametrize("value,want", [("XLA", "xla"), (" regemm ", "regemm"), ("Auto", "auto")])
def test_route_values_any_case(monkeypatch, value, want):
    monkeypatch.setenv("REGEMM_SMALL", value)
    assert _env.route("REGEMM_SMALL") == want


@pytest.mark.parametrize("value,want", [("0", False), ("OFF", False), ("False", False), ("no", False),
                                        ("1", True), ("On", True), ("TRUE", True), ("yes", True)])  # fmt: skip
def test_flag_spellings(monkeypatch, value, want):
    monkeypatch.setenv("REGEMM_IN_PLACE", value)
    assert _env.flag("REGEMM_IN_PLACE") is want


@pytest.mark.parametrize("value", [None, "", " "])
def test_flag_default_where_unset_or_empty(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("REGEMM_IN_PLACE", raising=False)
    else:
        monkeypatch.setenv("REGEMM_IN_PLACE", value)
        monkeypatch.setenv("REGEMM_FUSED_DGRAD", value)  # (an empty value of any switch passes the check)
    assert _env.flag("REGEMM_IN_PLACE") is True


def test_the_route_switch_changes_the_program(monkeypatch):
    """REGEMM_PLAIN_GEMM=xla puts a plain GEMM on XLA's dot on the CPU, whose default is regemm's call."""
    x, w = jnp.ones((1024, 64)), jnp.ones((64, 64))
    lowered = lambda: jax.jit(lambda x, w: rg.gemm_bias_act(x, w, act="none")).lower(x, w).as_text()  # a new function:
    monkeypatch.setenv("REGEMM_PLAIN_GEMM", "regemm")  # (JAX caches a function's lowering, not the environment)
    assert rg._targets.GEMM.name in lowered()
    monkeypatch.setenv("REGEMM_PLAIN_GEMM", "xla")
    text = lowered()
    assert rg._targets.GEMM.name not in text and "dot_general" in text


def test_docs_environment_is_the_table():
    doc = (ROOT / "docs" / "environment.md").read_text()
    assert doc == _env.markdown(), "docs/environment.md is stale: python -m jax_regemm._env > docs/environment.md"


def test_every_switch_the_sources_read_is_in_the_table():
    known = {s.name for s in _env.SWITCHES}
    found = set()
    for top in _SOURCES:
        path = ROOT / top
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "results" not in p.parts]
        for p in files:
            if p.name == pathlib.Path(__file__).name:  # (its bad names on purpose)
                continue
            if p.suffix in (".py", ".h", ".cu", ".cuh", ".cc", ".sh", ".cmake", ".txt", ".toml", ".in"):
                found |= set(re.findall(r"\bREGEMM_[A-Z0-9_]*[A-Z0-9]\b", p.read_text(errors="ignore")))
    missing = found - known - _NOT_SWITCHES
    assert not missing, f"REGEMM_* names read by the sources but not described in jax_regemm/_env.py: {sorted(missing)}"
    unused = known - found
    assert not unused, f"switches described but read nowhere: {sorted(unused)}"
