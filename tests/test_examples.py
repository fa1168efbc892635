"""Smoke tests of examples/ and benchmarks/plot.py: they run and deliver what they claim.

The examples are loaded from their files and their `main(argv)` called in this
process (one JAX start-up for all); the README's main command is also run as
a subprocess, exactly as a user types it.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(relpath):
    spec = importlib.util.spec_from_file_location(pathlib.Path(relpath).stem, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_digits():
    for name in ("optax", "sklearn", "tqdm"):
        pytest.importorskip(name)
    return load("examples/train_digits.py")


def test_readme_main_command_reaches_95_percent():
    """`python examples/train_digits.py`, run from the repository root as the README says."""
    for name in ("flax", "optax", "sklearn", "tqdm"):
        pytest.importorskip(name)
    out = subprocess.run(
        [sys.executable, "examples/train_digits.py"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    acc = float(re.search(r"test accuracy: ([0-9.]+)", out.stdout).group(1))
    assert acc >= 0.95, out.stdout


@pytest.mark.parametrize("framework", ["nnx", "equinox", "plain"])
def test_train_digits_each_framework(train_digits, framework):
    pytest.importorskip("equinox" if framework == "equinox" else "flax")
    acc, losses = train_digits.main(["--framework", framework])
    assert acc >= 0.95
    assert losses[-1] < losses[0] / 10


@pytest.mark.parametrize("act,save", [("gelu", "recompute"), ("tanh", "y"), ("leaky_relu", "z")])
def test_train_digits_other_activations_and_policies_learn(train_digits, act, save):
    acc, losses = train_digits.main(["--framework", "plain", "--epochs", "5", "--act", act, "--save", save])
    assert acc >= 0.85
    assert losses[-1] < losses[0] / 3


def test_zstash_and_policies():
    """The Z-stash check passes (it asserts inside) and the table shows each policy's effect."""
    rows = load("examples/zstash_and_policies.py").main(["--m", "64", "--k", "32", "--n", "48"])
    table = {(act, save): (resolved, kept, extra, calls) for act, save, resolved, kept, extra, calls in rows}
    z_bytes = 64 * 48 * 4
    assert table["gelu", "z"] == ("z", "x, w, Z", z_bytes, 3)
    assert table["gelu", "auto"] == table["gelu", "z"]
    assert table["tanh", "y"] == ("y", "x, w, Y", 0, 3)
    assert table["tanh", "auto"] == table["tanh", "y"]
    assert table["relu", "recompute"] == ("recompute", "x, w, b", 0, 4)  # one more GEMM, no M x N residual
    assert ("gelu", "y") not in table


def test_plot_writes_figures(tmp_path):
    pytest.importorskip("matplotlib")
    records = [
        {"kind": kind, "m": m, "k": 256, "n": 512, "dtype": dtype, "act": act, "mode": mode,
         "regemm_ms": 1.0 + 0.1 * i, "xla_ms": 1.5, "matmul_ms": 0.9, **({"depth": 4} if kind == "mlp" else {})}
        for i, act in enumerate(["none", "relu", "gelu"])
        for m in (1024, 4096)
        for kind in ("layer", "mlp")
        for dtype in ("bf16", "f32_default")
        for mode in ("fwd", "fwd_bwd")
    ]  # fmt: skip
    src = tmp_path / "results.json"
    src.write_text(json.dumps(records))
    written = load("benchmarks/plot.py").main([str(src), "--out", str(tmp_path / "figs")])
    assert len(written) == 2 * 2 * 2 * 2  # (speed-up, vs matmul) x kind x dtype x mode
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    # bench_train.py's records: one figure of each step against its floor
    steps = [{"shape": [8192, 1024, 4], "dtype": "bf16", "act": act, "xla_ms": 0.52, "regemm_ms": 0.47, "floor_ms": 0.35}
             for act in ("gelu", "relu")]  # fmt: skip
    src.write_text(json.dumps({"meta": {}, "records": steps}))
    (path,) = load("benchmarks/plot.py").main([str(src), "--out", str(tmp_path / "train")])
    assert path.name == "train_vs_floor.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # bench_narrow.py's JSON (the H200 run in results/): one figure of the cells
    (path,) = load("benchmarks/plot.py").main([str(ROOT / "benchmarks/results/h200_narrow.json"), "--out", str(tmp_path / "n")])
    assert path.name == "narrow.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_neural_field_fits_the_image(tmp_path):
    """examples/neural_field.py: a narrow MLP on a frequency encoding fits the bundled photo
    (32x32 pixels, 200 steps on the CPU in seconds) to over 22 dB PSNR, and saves the original
    beside the fit as one PNG of [32, 64, 3]."""
    for name in ("flax", "optax", "sklearn", "PIL"):
        pytest.importorskip(name)
    from PIL import Image

    out = tmp_path / "fit.png"
    psnr, losses = load("examples/neural_field.py").main(["--size", "32", "--steps", "200", "--out", str(out)])
    assert psnr > 22.0, psnr
    assert losses[-1] < losses[0] / 10
    assert np.asarray(Image.open(out)).shape == (32, 64, 3)
