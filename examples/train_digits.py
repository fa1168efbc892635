"""Train an MLP built from jax_regemm layers on scikit-learn's digits (bundled: no download).

    python examples/train_digits.py [--framework flax|nnx|equinox|plain] [--epochs 30]
                                    [--act relu] [--save auto] [--seed 0]

Every hidden layer is one fused kernel act(x @ W + b) forward and a fused
backward; the same training loop (jax.grad + optax.adam) drives all four
front ends, which differ only in how the model is built and applied.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import trange

import jax_regemm as rg

HIDDEN = (128, 128)


def load(seed):
    """8x8 digit images as 64 features in [0, 1]; a stratified 75/25 train/test split."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)


def build(framework, act, save, seed, n_in, n_out):
    """(params, apply(params, x [B, n_in]) -> logits [B, n_out]) for one front end."""
    sizes = (n_in, *HIDDEN, n_out)
    key = jax.random.key(seed)
    if framework == "flax":
        from jax_regemm.flax import MLP

        model = MLP(sizes[1:], activation=act, save=save)
        return model.init(key, jnp.zeros((1, n_in))), model.apply
    if framework == "nnx":
        from flax import nnx

        from jax_regemm.nnx import MLP

        graphdef, params = nnx.split(MLP(sizes, activation=act, save=save, rngs=nnx.Rngs(seed)))
        return params, lambda p, x: nnx.merge(graphdef, p)(x)
    if framework == "equinox":
        import equinox as eqx

        from jax_regemm.equinox import MLP

        model = MLP(n_in, n_out, HIDDEN[0], len(HIDDEN), activation=act, save=save, key=key)
        params, static = eqx.partition(model, eqx.is_array)
        # Equinox style: the model sees one example; vmap batches it (one GEMM per layer).
        return params, lambda p, x: jax.vmap(eqx.combine(p, static))(x)
    if framework == "plain":
        keys = jax.random.split(key, len(sizes) - 1)
        params = [
            {"w": jax.random.normal(k, (i, o)) / np.sqrt(i), "b": jnp.zeros(o)}
            for k, i, o in zip(keys, sizes[:-1], sizes[1:])
        ]

        def apply(params, x):
            for i, layer in enumerate(params):
                last = i == len(params) - 1
                x = rg.dense(x, layer["w"], layer["b"], act="none" if last else act, save=save)
            return x

        return params, apply
    raise ValueError(f"unknown framework {framework!r}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("flax", "nnx", "equinox", "plain"), default="flax")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--act", choices=rg.ACTIVATIONS, default="relu")
    p.add_argument("--save", choices=rg.SAVE_POLICIES, default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args(argv)

    start = time.perf_counter()
    x_train, x_test, y_train, y_test = load(args.seed)
    params, apply = build(args.framework, args.act, args.save, args.seed, x_train.shape[1], 10)
    opt = optax.adam(args.lr)
    opt_state = opt.init(params)

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    # The train state donated, as training loops do: on the GPU a captured step then keeps its
    # buffers' addresses, and XLA replays its CUDA graph without recording the regemm calls again.
    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(apply(params, x), -1) == y)

    rng = np.random.default_rng(args.seed)
    steps = len(x_train) // args.batch_size  # drop the ragged last batch: one compiled shape
    epoch_losses = []
    bar = trange(args.epochs, desc=f"{args.framework} {args.act} save={args.save}")
    for _ in bar:
        order = rng.permutation(len(x_train))
        losses = []
        for i in range(steps):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
            losses.append(loss)
        epoch_losses.append(float(np.mean(losses)))
        bar.set_postfix(loss=f"{epoch_losses[-1]:.4f}", test_acc=f"{float(accuracy(params, x_test, y_test)):.4f}")

    acc = float(accuracy(params, x_test, y_test))
    print(f"final train loss: {epoch_losses[-1]:.4f}")
    print(f"test accuracy: {acc:.4f} ({args.framework}, {args.epochs} epochs, {time.perf_counter() - start:.1f} s)")
    return acc, epoch_losses


if __name__ == "__main__":
    main()
