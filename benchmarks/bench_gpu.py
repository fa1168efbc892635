"""jax_regemm vs plain XLA, side by side in one process, device-side time.

Single layers act(x @ w + b) and 16-layer MLP stacks; every activation; bf16,
f32 at default precision (TF32 on Hopper) and f32 HIGHEST; forward and
forward+backward (vjp with a random cotangent: the training step's work).
Plain XLA is the code a user writes: act(jnp.dot(x, w) + b). The plain matmul
x @ w of each shape is timed too, so ratios read against the hardware's GEMM.
Also reports the residual bytes each layer keeps for its backward beyond x
and w (jax.ad_checkpoint.saved_residuals).

    python benchmarks/bench_gpu.py --grid quick --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_regemm as rg
import plain as PLAIN

try:  # what jax.ad_checkpoint.print_saved_residuals prints, as data
    from jax._src.ad_checkpoint import saved_residuals
except ImportError:  # pragma: no cover
    saved_residuals = None
import devtime
from devtime import device_times_ms, named_jit

DTYPES = {
    "bf16": (jnp.bfloat16, None),
    "f32_default": (jnp.float32, "default"),
    "f32_highest": (jnp.float32, "highest"),
}
LAYERS_QUICK = [(8192, 1024, 4096), (16384, 4096, 4096), (4096, 4096, 1024), (65536, 256, 256), (128, 1024, 1024)]
LAYERS_FULL = LAYERS_QUICK + [(1024, 1024, 1024), (2048, 1024, 1024)]
MLPS = [(2048, 1024, 16), (16384, 1024, 16), (65536, 256, 16)]  # (batch, width, depth)


def xla_layer(act):
    def f(x, w, b, precision):  # the plain program (plain.py)
        return PLAIN.dense(x, w, b, act=act, precision=precision)

    return f


def regemm_layer(act):
    def f(x, w, b, precision):
        return rg.dense(x, w, b, act=act, precision=precision)

    return f


def mlp(layer):
    def f(x, ws, bs, precision):
        for w, b in zip(ws, bs):
            x = layer(x, w, b, precision)
        return x

    return f


def fwd_bwd(f):
    def g(x, w, b, gy, precision):
        y, vjp = jax.vjp(lambda x, w, b: f(x, w, b, precision), x, w, b)
        return y, vjp(gy)

    return g


def layer_program(impl, act, mode, m, k, n, dtype_name, seed=0):
    """(jitted program, its arguments): one layer of `impl` ("regemm" or "xla"), forward or
    forward+backward, on fresh random inputs (tools/kernel_trace.py and tools/host_timeline.py time these)."""
    dtype, precision = DTYPES[dtype_name]
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], (m, k), dtype)
    w = (jax.random.normal(ks[1], (k, n)) / np.sqrt(k)).astype(dtype)
    b = (0.1 * jax.random.normal(ks[2], (n,))).astype(dtype)
    gy = jax.random.normal(ks[3], (m, n), dtype)
    layer = (regemm_layer if impl == "regemm" else xla_layer)(act)
    if mode == "fwd":
        return jax.jit(lambda x, w, b: layer(x, w, b, precision)), (x, w, b)
    g = fwd_bwd(layer)
    return jax.jit(lambda x, w, b, gy: g(x, w, b, gy, precision)), (x, w, b, gy)


def residual_bytes(f, x, w, b, precision):
    """Bytes saved for the backward beyond the arguments (x, w, b)."""
    res = saved_residuals(lambda x, w, b: f(x, w, b, precision), x, w, b)
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a, why in res if "argument" not in why))


def run_shape(kind, m, k, n, depth, dtype_name, acts, modes, repeats, n_sets):
    dtype, precision = DTYPES[dtype_name]
    keys = iter(jax.random.split(jax.random.PRNGKey(m * 7 + k * 3 + n), 64))
    scale = 1.0 / np.sqrt(k)

    def make_set():
        x = jax.random.normal(next(keys), (m, k), dtype)
        if kind == "layer":
            w = (jax.random.normal(next(keys), (k, n), jnp.float32) * scale).astype(dtype)
            b = (0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dtype)
        else:
            w = [(jax.random.normal(next(keys), (k, k), jnp.float32) * scale).astype(dtype) for _ in range(depth)]
            b = [(0.1 * jax.random.normal(next(keys), (k,), jnp.float32)).astype(dtype) for _ in range(depth)]
        gy = jax.random.normal(next(keys), (m, n), dtype)
        return x, w, b, gy

    sets = [make_set() for _ in range(n_sets)]
    tag = f"{kind}_{m}_{k}_{n}_{depth}_{dtype_name}"
    cases, meta = {}, {}
    mm = lambda x, w, b, precision: jnp.dot(x, w, precision=precision)
    mm_f = mlp(mm) if kind == "mlp" else mm
    cases[f"{tag}_matmul"] = (
        named_jit(lambda x, w, b, p=precision: mm_f(x, w, b, p), f"{tag}_matmul"),
        [s[:3] for s in sets],
    )
    for act in acts:
        for impl, layer in (("regemm", regemm_layer(act)), ("xla", xla_layer(act))):
            f = mlp(layer) if kind == "mlp" else layer
            for mode in modes:
                name = f"{tag}_{act}_{impl}_{mode}"
                if mode == "fwd":
                    fn = named_jit(lambda x, w, b, f=f, p=precision: f(x, w, b, p), name)
                    cases[name] = (fn, [s[:3] for s in sets])
                else:
                    g = fwd_bwd(f)
                    fn = named_jit(lambda x, w, b, gy, g=g, p=precision: g(x, w, b, gy, p), name)
                    cases[name] = (fn, sets)
                meta[name] = (act, impl, mode, f)
    # Every regemm GEMM timed by the tuner before the warm-up (rg.autotune, as
    # the README tells users of captured programs), whatever XLA does on a
    # captured program's first run.
    for name, (fn, arg_sets) in cases.items():
        if "_regemm_" in name:
            rg.autotune(fn, *arg_sets[0])
    times = device_times_ms(cases, repeats=repeats)
    walls = devtime.pipelined_ms(cases)
    x, w, b, _ = sets[0]
    records = []
    for act in acts:
        for mode in modes:
            r = dict(kind=kind, m=m, k=k, n=n, depth=depth, dtype=dtype_name, act=act, mode=mode)
            r["regemm_ms"] = times[f"{tag}_{act}_regemm_{mode}"]
            r["xla_ms"] = times[f"{tag}_{act}_xla_{mode}"]
            r["regemm_wall_ms"] = walls[f"{tag}_{act}_regemm_{mode}"]
            r["xla_wall_ms"] = walls[f"{tag}_{act}_xla_{mode}"]
            r["matmul_ms"] = times[f"{tag}_matmul"] * (1 if mode == "fwd" else 3)
            if kind == "layer" and mode == "fwd_bwd" and saved_residuals is not None:
                for impl in ("regemm", "xla"):
                    r[f"residual_bytes_{impl}"] = residual_bytes(meta[f"{tag}_{act}_{impl}_{mode}"][3], x, w, b, precision)
            records.append(r)
    return records


def table(records):
    lines = [
        "| kind | M K N (depth) | dtype | act | mode | matmul ms | XLA ms | regemm ms | regemm/matmul | XLA/matmul | speed-up vs XLA | wall: XLA ms, regemm ms, speed-up | residual B/elem regemm / XLA |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        shape = f"{r['m']} {r['k']} {r['n']}" + (f" ({r['depth']})" if r["kind"] == "mlp" else "")
        res = ""
        wall = ""
        if "regemm_wall_ms" in r:
            wall = f"{r['xla_wall_ms']:.3f}, {r['regemm_wall_ms']:.3f}, {r['xla_wall_ms'] / r['regemm_wall_ms']:.2f}"
        if "residual_bytes_regemm" in r:
            mn = r["m"] * r["n"]
            res = f"{r['residual_bytes_regemm'] / mn:.1f} / {r['residual_bytes_xla'] / mn:.1f}"
        lines.append(
            f"| {r['kind']} | {shape} | {r['dtype']} | {r['act']} | {r['mode']} | {r['matmul_ms']:.3f} | "
            f"{r['xla_ms']:.3f} | {r['regemm_ms']:.3f} | {r['regemm_ms'] / r['matmul_ms']:.2f} | "
            f"{r['xla_ms'] / r['matmul_ms']:.2f} | {r['xla_ms'] / r['regemm_ms']:.2f} | {wall} | {res} |"
        )
    speedups = [r["xla_ms"] / r["regemm_ms"] for r in records]
    gm = float(np.exp(np.mean(np.log(speedups))))
    lines.append("")
    lines.append(f"geometric-mean speed-up over XLA: {gm:.3f} over {len(records)} cells; min {min(speedups):.2f}, max {max(speedups):.2f}")
    walls = [r["xla_wall_ms"] / r["regemm_wall_ms"] for r in records if "regemm_wall_ms" in r]
    if walls:
        gw = float(np.exp(np.mean(np.log(walls))))
        below = sum(w < 0.97 for w in walls)
        lines.append(f"by wall clock: {gw:.3f}; min {min(walls):.2f}, max {max(walls):.2f}; {below} of {len(walls)} cells below 0.97")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grid", choices=["quick", "full"], default="quick")
    p.add_argument("--dtypes", default="bf16,f32_default,f32_highest")
    p.add_argument("--acts", default=",".join(rg.ACTIVATIONS))
    p.add_argument("--modes", default="fwd,fwd_bwd")
    p.add_argument("--no-mlp", action="store_true")
    p.add_argument("--no-layer", action="store_true", help="only the MLPs")
    p.add_argument("--layers", default="", help="override shapes: M:K:N,M:K:N")
    p.add_argument("--mlps", default="", help="override MLPs: batch:width:depth,...")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sets", type=int, default=3, help="input sets rotated between runs")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--graph-min-size", type=int, default=None,
                   help="xla_gpu_graph_min_graph_size for every program, both sides (default: XLA's, 5)")
    args = p.parse_args()
    if args.graph_min_size is not None:
        devtime.COMPILER_OPTIONS["xla_gpu_graph_min_graph_size"] = args.graph_min_size
    acts, modes = args.acts.split(","), args.modes.split(",")
    layers = LAYERS_FULL if args.grid == "full" else LAYERS_QUICK
    if args.layers:
        layers = [tuple(int(v) for v in s.split(":")) for s in args.layers.split(",")]
    if args.no_layer:
        layers = []
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}  jax {jax.__version__}  kernels: {rg.kernels()}", flush=True)
    records = []
    t0 = time.time()
    mlps = [tuple(int(v) for v in s.split(":")) for s in args.mlps.split(",")] if args.mlps else MLPS
    for dtype_name in args.dtypes.split(","):
        for m, k, n in layers:
            if dtype_name == "f32_highest" and m * k * n > 2**36:
                continue  # 10 ms per GEMM at 50 TFLOP/s: one big shape is enough
            records += run_shape("layer", m, k, n, 0, dtype_name, acts, modes, args.repeats, args.sets)
            save(args.out, dev, records)
            print(f"  layer {m}x{k}x{n} {dtype_name} done at {time.time() - t0:.0f}s", flush=True)
        if not args.no_mlp and dtype_name != "f32_highest":
            for batch, width, depth in mlps:
                mlp_acts = [a for a in acts if a in ("relu", "gelu", "sigmoid", "silu")] or acts[:1]
                records += run_shape("mlp", batch, width, width, depth, dtype_name, mlp_acts, modes, max(args.repeats // 2, 5), 1)
                save(args.out, dev, records)
                print(f"  mlp {batch}x{width}x{depth} {dtype_name} done at {time.time() - t0:.0f}s", flush=True)
    save(args.out, dev, records)
    print(table(records))


def save(out, dev, records):
    """JSON and markdown so far (written after every shape: a cut-off run keeps what it measured)."""
    meta = dict(device=dev.device_kind, jax=jax.__version__, host=platform.node(), kernels=rg.kernels(),
                compiler_options=dict(devtime.COMPILER_OPTIONS), tuned=rg.tuned())
    with open(os.path.join(out, "bench_gpu.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    with open(os.path.join(out, "bench_gpu.md"), "w") as f:
        f.write(f"device: {meta['device']}, jax {meta['jax']}\n\n{table(records)}\n")


if __name__ == "__main__":
    main()
