"""Fit an image with a neural field: a narrow MLP from pixel coordinates to colour.

    python examples/neural_field.py [--size 256] [--steps 500] [--width 64] [--hidden 4]
                                    [--freqs 8] [--dtype bfloat16] [--out neural_field.png]

The image is scikit-learn's bundled sample photo (no download), cropped square and resized
to --size. Each pixel's (x, y) in [0, 1] goes through a frequency encoding (sin and cos of
2^l pi x for l < --freqs: 4 * freqs features), then `jax_regemm.flax.MLP`: --hidden layers of
--width with relu, and a sigmoid output of 3 channels. Full-batch Adam on the mean squared
error; the fit is saved beside the original as one PNG. On a GPU the whole training takes
seconds; it runs on the CPU too (use a smaller --size there).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from PIL import Image
from sklearn.datasets import load_sample_image

from jax_regemm.flax import MLP


def load(size):
    """The sample photo as [size, size, 3] floats in [0, 1] (centre square crop, resized)."""
    img = load_sample_image("china.jpg")
    h, w, _ = img.shape
    s = min(h, w)
    top, left = (h - s) // 2, (w - s) // 2
    img = Image.fromarray(img[top : top + s, left : left + s]).resize((size, size), Image.LANCZOS)
    return np.asarray(img, np.float32) / 255.0


def encode(size, freqs):
    """Every pixel's frequency encoding, [size * size, 4 * freqs], row-major like the image."""
    t = (np.arange(size, dtype=np.float32) + 0.5) / size
    yy, xx = np.meshgrid(t, t, indexing="ij")
    xy = np.stack([xx.ravel(), yy.ravel()], axis=-1)  # [P, 2]
    angles = xy[:, :, None] * (np.pi * 2.0 ** np.arange(freqs, dtype=np.float32))  # [P, 2, freqs]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).reshape(len(xy), 4 * freqs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--hidden", type=int, default=4)
    p.add_argument("--freqs", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--dtype", default="bfloat16", help="the layers' compute dtype (parameters stay f32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="neural_field.png")
    args = p.parse_args(argv)

    target = load(args.size)
    x = jnp.asarray(encode(args.size, args.freqs), args.dtype)
    y = jnp.asarray(target.reshape(-1, 3))
    model = MLP(features=[args.width] * args.hidden + [3], activation="relu", final_activation="sigmoid",
                dtype=jnp.dtype(args.dtype))  # fmt: skip
    params = model.init(jax.random.PRNGKey(args.seed), x[:1])
    opt = optax.adam(args.lr)
    state = opt.init(params)

    def loss(params):
        return jnp.mean((model.apply(params, x).astype(jnp.float32) - y) ** 2)

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    params, state, first = step(params, state)  # compiles
    jax.block_until_ready(first)
    losses = [float(first)]
    t0 = time.perf_counter()
    for _ in range(args.steps - 1):
        params, state, value = step(params, state)
        losses.append(value)
    losses = [float(v) for v in jax.block_until_ready(losses)]
    seconds = time.perf_counter() - t0

    fit = np.clip(np.asarray(model.apply(params, x), np.float32).reshape(target.shape), 0.0, 1.0)
    psnr = float(-10.0 * np.log10(np.mean((fit - target) ** 2)))
    side_by_side = np.concatenate([target, fit], axis=1)
    Image.fromarray((side_by_side * 255.0 + 0.5).astype(np.uint8)).save(args.out)
    print(f"{args.size}x{args.size} pixels, {x.shape[1]} features -> {args.hidden} x {args.width} -> 3, "
          f"{args.dtype} on {jax.default_backend()}: {args.steps} steps in {seconds:.2f} s after compiling "
          f"({(args.steps - 1) / seconds:.0f} steps/s); loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"PSNR {psnr:.1f} dB; original | fit saved to {args.out}")  # fmt: skip
    return psnr, losses


if __name__ == "__main__":
    main()
