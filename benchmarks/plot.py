"""Benchmark JSON -> the PNG figures the README shows.

    python benchmarks/plot.py results.json --out benchmarks/results/

Input: a list of records {"kind": "layer"|"mlp", "m", "k", "n", "depth" (mlp only),
"dtype": "bf16"|"f32_default"|"f32_highest", "act", "mode": "fwd"|"fwd_bwd",
"regemm_ms", "xla_ms", "matmul_ms"}. One pair of figures per (kind, dtype, mode):

- speedup_<kind>_<dtype>_<mode>.png: xla_ms / regemm_ms, bars per activation,
  grouped by shape (> 1: jax_regemm is faster than XLA's own act(x @ w + b)).
- vs_matmul_<kind>_<dtype>_<mode>.png: time / matmul_ms for jax_regemm and for
  XLA side by side (1 = the epilogue is free: as fast as the bare GEMM).

Narrow MLPs (bench_narrow.py's records: "cell", "mode" step|infer, "speedup", ...) give one
figure, narrow.png: plain / ours per cell, the step and the inference forward.

Training steps (bench_train.py's records: "shape" [rows, width, layers], "dtype", "act",
"xla_ms", "regemm_ms", "floor_ms") give one figure, train_vs_floor.png: each step's time
over its floor (the same step with no bias and no activation), XLA's and ours.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def shape_label(r):
    label = f"{r['m']}x{r['k']}x{r['n']}"
    return f"{label} d{r['depth']}" if r["kind"] == "mlp" else label


def grouped_bars(ax, records, value, acts, shapes):
    """Bars of value(record) per activation, grouped by shape; missing points are left out."""
    by_key = {(shape_label(r), r["act"]): r for r in records}
    width = 0.8 / len(acts)
    x = np.arange(len(shapes))
    for i, act in enumerate(acts):
        heights = [value(by_key[s, act]) if (s, act) in by_key else np.nan for s in shapes]
        ax.bar(x + (i - (len(acts) - 1) / 2) * width, heights, width, label=act)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, shapes, rotation=30, ha="right")
    ax.grid(axis="y", alpha=0.3)


def ratio(num, den):
    return lambda r: r[num] / r[den] if r.get(num) and r.get(den) else np.nan


def plot_group(records, title, out_dir, stem):
    acts = list(dict.fromkeys(r["act"] for r in records))  # in the benchmark's order
    shapes = sorted({shape_label(r) for r in records}, key=lambda s: [int(t) for t in s.replace(" d", "x").split("x")])
    written = []

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(shapes) + 2), 4))
    grouped_bars(ax, records, ratio("xla_ms", "regemm_ms"), acts, shapes)
    ax.set_ylabel("speed-up over XLA (xla ms / regemm ms)")
    ax.set_title(f"{title}: speed-up over XLA")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    written.append(out_dir / f"speedup_{stem}.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(2 * max(5, 1.1 * len(shapes) + 1.5), 4), sharey=True)
    for ax, who in zip(axes, ("regemm", "xla")):
        grouped_bars(ax, records, ratio(f"{who}_ms", "matmul_ms"), acts, shapes)
        ax.set_title(f"{who} time / plain matmul time")
    axes[0].set_ylabel("time / matmul time (1 = epilogue is free)")
    axes[1].legend(fontsize="small", ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    written.append(out_dir / f"vs_matmul_{stem}.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def _save_bars(fig, ax, x, labels, ylabel, title, path):
    """The finish of a bar figure over labelled cells (a line at 1.0), saved to path: [path]."""
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def plot_train(records, out_dir):
    """Step time / floor time per training step, XLA's and ours, with the 1.05 target."""
    labels = [f"{'x'.join(map(str, r['shape']))} {r['dtype']} {r['act']}" for r in records]
    x = np.arange(len(records))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(records) + 2), 4))
    for i, (who, name) in enumerate((("xla", "XLA"), ("regemm", "jax_regemm"))):
        ax.bar(x + (i - 0.5) * 0.4, [r[f"{who}_ms"] / r["floor_ms"] for r in records], 0.4, label=name)
    ax.axhline(1.05, color="gray", linewidth=0.8, linestyle="--", label="target 1.05")
    return _save_bars(fig, ax, x, labels, "step time / floor time (device)",
                      "training steps against their floor (GEMMs, loss and AdamW only)", out_dir / "train_vs_floor.png")


def plot_narrow(records, out_dir):
    """bench_narrow.py's records: plain / ours per cell, the training step (device, wall donated) and
    the inference forward (device), with every --ab side's step speed-up beside them."""
    cells = list(dict.fromkeys(f"{r['cell']} {r['dtype']} {r['act']}" for r in records))
    pick = lambda mode: {f"{r['cell']} {r['dtype']} {r['act']}": r for r in records if r["mode"] == mode}
    step, infer = pick("step"), pick("infer")
    sides = sorted({n for r in step.values() for n in r["device_ms"]} - {"plain", "ours"})
    bars = [("step, device", lambda c: step[c]["speedup"] if c in step else np.nan),
            ("step, wall donated", lambda c: step[c].get("speedup_wall_donated", np.nan) if c in step else np.nan),
            ("inference, device", lambda c: infer[c]["speedup"] if c in infer else np.nan)]
    bars += [(f"step, device: {n}", lambda c, n=n: step[c]["device_ms"]["plain"] / step[c]["device_ms"][n]
              if c in step else np.nan) for n in sides]  # fmt: skip
    x, width = np.arange(len(cells)), 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cells) + 2), 4))
    for i, (name, value) in enumerate(bars):
        ax.bar(x + (i - (len(bars) - 1) / 2) * width, [value(c) for c in cells], width, label=name)
    return _save_bars(fig, ax, x, cells, "speed-up (plain flax / jax_regemm)",
                      "narrow MLPs: rows x in x width x hidden x out", out_dir / "narrow.png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=pathlib.Path, help="benchmark JSON (a list of records)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = p.parse_args(argv)
    records = json.loads(args.results.read_text())
    if isinstance(records, dict):  # bench_gpu.py writes {"meta": ..., "records": [...]}
        records = records.get("records", [])
    if not isinstance(records, list) or not records:
        raise SystemExit(f"{args.results}: expected a non-empty JSON list of records")
    args.out.mkdir(parents=True, exist_ok=True)
    if "cell" in records[0]:  # bench_narrow.py's narrow MLPs
        written = plot_narrow(records, args.out)
        print(*written, sep="\n")
        return written
    if "floor_ms" in records[0]:  # bench_train.py's training steps
        written = plot_train(records, args.out)
        print(*written, sep="\n")
        return written

    groups = defaultdict(list)
    for r in records:
        groups[r["kind"], r["dtype"], r["mode"]].append(r)
    written = []
    for (kind, dtype, mode), recs in sorted(groups.items()):
        written += plot_group(recs, f"{kind}, {dtype}, {mode}", args.out, f"{kind}_{dtype}_{mode}")
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
