"""The routing's classes of op (jax_regemm/_route.py), as the GPU's table has them: which sizes are
small (few rows or elements) or narrow (fewer than 128 columns), which then lower to XLA's
program. Pure functions of shapes: these run on any machine."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jax_regemm import _route

BF16 = jnp.dtype(jnp.bfloat16)


@pytest.mark.parametrize(
    "out,want",
    [
        ((512, 4096), True),  # at most 512 rows
        ((513, 4096), False),
        ((2048, 1024), True),  # 2^21 elements
        ((2049, 1024), False),
        ((2**20, 64), True),  # narrow: a 64-wide layer of a neural field
        ((2**20, 127), True),  # fewer than 128 columns
        ((2**20, 128), False),  # 128 wide: regemm's tile
        ((8, 2**15, 128), False),  # rows counted over the batch dims
    ],
)
def test_small_on_the_gpu(out, want, monkeypatch):
    monkeypatch.delenv("REGEMM_SMALL", raising=False)
    assert _route.small("cuda", BF16, out) is want
    assert _route.small("cpu", BF16, out) is False  # the CPU keeps every op on regemm's calls


@pytest.mark.parametrize("value,want", [("regemm", False), ("xla", True)])
def test_the_switch_overrides_the_table(value, want, monkeypatch):
    monkeypatch.setenv("REGEMM_SMALL", value)
    assert _route.small("cuda", BF16, (2**20, 64)) is want
    assert _route.small("cpu", BF16, (2**20, 64)) is want
