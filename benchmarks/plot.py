"""Benchmark JSON -> the PNG figures the README shows.

    python benchmarks/plot.py results.json --out benchmarks/results/

Input: a list of records {"kind": "layer"|"mlp", "m", "k", "n", "depth" (mlp only),
"dtype": "bf16"|"f32_default"|"f32_highest", "act", "mode": "fwd"|"fwd_bwd",
"regemm_ms", "xla_ms", "matmul_ms"}. One pair of figures per (kind, dtype, mode):

- speedup_<kind>_<dtype>_<mode>.png: xla_ms / regemm_ms, bars per activation,
  grouped by shape (> 1: jax_regemm is faster than XLA's own act(x @ w + b)).
- vs_matmul_<kind>_<dtype>_<mode>.png: time / matmul_ms for jax_regemm and for
  XLA side by side (1 = the epilogue is free: as fast as the bare GEMM).
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
