"""The backward epilogue alone (gZ = gY act'(S), bias gradient in the same
pass) against XLA's own fusion of the reference, in one process, device time.

It is memory-bound: it reads gY and S and writes gZ (3 x M x N elements; the
bias partials are ~1/128 of that), so its floor is those bytes over the copy
rate. Prints a markdown table with the achieved GB/s of each.

    python tools/bench_dact.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import jax_regemm as rg
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench_gpu, devtime
from devtime import device_times_ms, named_jit

SHAPES = [(16384, 4096), (8192, 4096), (65536, 256), (16384, 1024)]
CASES = [("relu", True, "per_col"), ("gelu", False, "per_col"), ("silu", False, "per_row"), ("sigmoid", True, "scalar")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--dtypes", default="bf16,f32")
    p.add_argument("--shapes", default="", help="override shapes: M:N,M:N")
    args = p.parse_args()
    dtypes = {"bf16": jnp.bfloat16, "f32": jnp.float32}
    rows = []
    for dname in args.dtypes.split(","):
        dt = dtypes[dname]
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] if args.shapes else SHAPES
        for m, n in shapes:
            keys = jax.random.split(jax.random.PRNGKey(m + n), 6)
            sets = [(jax.random.normal(keys[i], (m, n), dt), jax.random.normal(keys[i + 3], (m, n), dt)) for i in range(3)]
            cases = {}
            for act, from_y, kind in CASES:
                blen = {"per_col": (n,), "per_row": (m,), "scalar": (1,)}[kind]
                spec = rg._epilogues.DactSpec(act, 0.01, from_y, kind, blen)
                tag = f"{dname}_{m}_{n}_{act}_{kind}"
                ours = named_jit(lambda g, s, spec=spec: rg._epilogues.dact(spec, g, s), f"{tag}_regemm")
                ref = named_jit(lambda g, s, a=act, f=from_y, k=kind: rg.reference.dact(g, s, act=a, from_y=f, bias_kind=k),
                                f"{tag}_xla")  # fmt: skip
                cases[f"{tag}_regemm"] = (ours, sets)
                cases[f"{tag}_xla"] = (ref, sets)
            times = device_times_ms(cases, repeats=20)
            gbytes = 3 * m * n * jnp.dtype(dt).itemsize / 1e9
            for act, from_y, kind in CASES:
                tag = f"{dname}_{m}_{n}_{act}_{kind}"
                t, x = times[f"{tag}_regemm"], times[f"{tag}_xla"]
                rows.append(dict(dtype=dname, m=m, n=n, act=act, from_y=from_y, kind=kind, regemm_ms=t, xla_ms=x,
                                 regemm_gbs=gbytes / t * 1e3, xla_gbs=gbytes / x * 1e3))  # fmt: skip
    lines = ["| dtype | M N | act (S) | bias | regemm ms | GB/s | XLA ms | GB/s | XLA / regemm |", "|" + " --- |" * 9]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['m']} {r['n']} | {r['act']} ({'Y' if r['from_y'] else 'Z'}) | {r['kind']} | "
                     f"{r['regemm_ms']:.4f} | {r['regemm_gbs']:.0f} | {r['xla_ms']:.4f} | {r['xla_gbs']:.0f} | "
                     f"{r['xla_ms'] / r['regemm_ms']:.2f} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_dact.json"), "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "bench_dact.md"), "w") as f:
            f.write(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}\n\n{table}\n")


if __name__ == "__main__":
    main()
