"""Where the time of bench/run.py's CNN training step goes: each op of the step alone.

    .venv/bin/python bench/cnn_profile.py [--reps 200]

The step of ``bench/models.py``'s ``cnn`` (batch 64, 28x28x1: Conv 3x3 1->16 pad 1, ReLU,
MaxPool 2, Conv 3x3 16->32 pad 1, ReLU, MaxPool 2, flatten, Dense 1568->10, cross entropy,
Adam) taken apart: each piece is built on evaluated inputs of the step's shapes and timed
alone (``mx.eval``, median of interleaved rounds), minus the cost of evaluating a trivial op
(MLX's fixed cost per ``mx.eval``). Pieces run as fluxlike runs them: in float32, and under
``autocast(mx.bfloat16)`` (bfloat16 activations, float32 master weights). The whole step is
timed too, so the sum of the pieces can be read against it. Absolute times are noise on a
shared machine; read the shares.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import models as M  # bench/ is on sys.path when run as a script
from mlx.utils import tree_flatten, tree_unflatten

import fluxlike
from fluxlike import autocast, setup, update, withgradient
from fluxlike.losses import logitcrossentropy

F32, BF16 = mx.float32, mx.bfloat16


def timed(fns: dict[str, Callable[[], object]], reps: int, rounds: int = 7) -> dict[str, float]:
    """Median over ``rounds`` interleaved rounds of the mean time of ``reps`` calls, in us."""
    for fn in fns.values():
        for _ in range(5):
            mx.eval(fn())
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                mx.eval(fn())
            samples[name].append((time.perf_counter() - t) / reps * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def vjp_only(f: Callable, primals: list, cot: mx.array) -> Callable[[], object]:
    """``f``'s forward and backward pass (its ``mx.vjp`` for the cotangent ``cot``); the
    primals may be parameter trees."""
    flat = [tree_flatten(p) if isinstance(p, dict) else None for p in primals]
    arrays = [a for p, fl in zip(primals, flat, strict=True)
              for a in ([v for _, v in fl] if fl is not None else [p])]

    def g(*leaves):
        it = iter(leaves)
        args = [tree_unflatten([(k, next(it)) for k, _ in fl]) if fl is not None else next(it)
                for fl in flat]
        return f(*args)

    def run():
        return mx.vjp(g, arrays, [cot])[1]
    return run


def pieces(dtype: mx.Dtype | None) -> dict[str, Callable[[], object]]:
    """The step's ops, as fluxlike runs them, on evaluated inputs (``dtype`` None: float32;
    bfloat16: under autocast)."""
    spec = M.SPECS["cnn"]
    model = M.fluxlike_model(spec, M.weights(spec))
    x_np, labels_np = M.data(spec)
    x = mx.array(x_np)
    y = mx.array(M.onehot(labels_np, spec.classes))
    conv1, pool1, conv2, pool2, flat, dense = model.layers
    act = F32 if dtype is None else dtype
    scope = (lambda: autocast(dtype)) if dtype is not None else None

    def in_scope(fn: Callable) -> Callable:
        if scope is None:
            return fn

        def run(*a):
            with scope():
                return fn(*a)
        return run

    # The activations between layers, evaluated.
    with (scope() if scope else _null()):
        a1 = conv1(x)
        p1 = pool1(a1)
        a2 = conv2(p1)
        p2 = pool2(a2)
        f = flat(p2)
        z = dense(f)
    mx.eval(a1, p1, a2, p2, f, z)
    ga1, gp1, ga2, gp2, gz = (mx.ones_like(t) * 1e-3 for t in (a1, p1, a2, p2, z))
    mx.eval(ga1, gp1, ga2, gp2, gz)

    def layer_fn(layer):
        def f(params, inp):
            layer.update(params)
            return layer(inp)
        return in_scope(f)

    out: dict[str, Callable[[], object]] = {}
    p_c1, p_c2, p_d = (m.trainable_parameters() for m in (conv1, conv2, dense))
    mx.eval(p_c1, p_c2, p_d)
    out["conv1+bias+relu fwd"] = lambda: in_scope(conv1)(x)
    out["conv1 bwd (w, b)"] = vjp_only(lambda p: layer_fn(conv1)(p, x), [p_c1], ga1)
    out["maxpool1 fwd"] = lambda: pool1(a1)
    out["maxpool1 bwd"] = vjp_only(pool1, [a1], gp1)
    out["conv2+bias+relu fwd"] = lambda: in_scope(conv2)(p1)
    out["conv2 bwd (x, w, b)"] = vjp_only(lambda p, i: layer_fn(conv2)(p, i), [p_c2, p1], ga2)
    out["maxpool2 fwd"] = lambda: pool2(a2)
    out["maxpool2 bwd"] = vjp_only(pool2, [a2], gp2)
    out["flatten fwd+bwd"] = vjp_only(flat, [p2], f)
    out["dense fwd"] = lambda: in_scope(dense)(f)
    out["dense bwd (x, w, b)"] = vjp_only(lambda p, i: layer_fn(dense)(p, i), [p_d, f], gz)

    def loss_fn(zz):
        return logitcrossentropy(zz, y)
    out["loss fwd"] = lambda: loss_fn(z)
    out["loss fwd+bwd"] = lambda: mx.vjp(loss_fn, [z], [mx.array(1.0)])[1]

    # Adam on the model's parameters with float32 gradients of their shapes.
    opt_state = setup(fluxlike.Adam(1e-3), model)
    grads = fluxlike.gradient(lambda m: logitcrossentropy(m(x), y), model)[0]
    mx.eval(grads, opt_state.optimizer.state)

    def adam():
        update(opt_state, model, grads)
        return [model.parameters(), opt_state.optimizer.state]
    out["Adam update"] = adam

    # The whole step, as bench/run.py's fl f32 / fl autocast.
    model2 = M.fluxlike_model(spec, M.weights(spec))
    st2 = setup(fluxlike.Adam(1e-3), model2)

    def step():
        loss, g = withgradient(lambda m: M.fluxlike_loss(m, x, y), model2, autocast=dtype)
        update(st2, model2, g[0])
        return [loss, model2.parameters(), st2.optimizer.state]
    out["whole step"] = step
    out["(eval of a trivial op)"] = lambda: x[:1, :1, :1] + 1
    del act
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def mlx_pool_pieces() -> dict[str, Callable[[], object]]:
    """MLX's own pooling (nn.MaxPool2d) and a plain ReLU, for comparison."""
    a = mx.random.normal((64, 28, 28, 16))
    g = mx.random.normal((64, 14, 14, 16))
    mx.eval(a, g)
    pool = nn.MaxPool2d(2)
    return {"nn.MaxPool2d fwd": lambda: pool(a), "nn.MaxPool2d bwd": vjp_only(pool, [a], g),
            "relu fwd (64x28x28x16)": lambda: nn.relu(a),
            "relu bwd (64x28x28x16)": vjp_only(nn.relu, [a], a)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=100)
    args = parser.parse_args()
    mx.set_cache_limit(1 << 30)
    tables = {"float32": timed(pieces(None), args.reps),
              "autocast bf16": timed(pieces(BF16), args.reps)}
    base = {k: t["(eval of a trivial op)"] for k, t in tables.items()}
    print(f"CNN training step, per piece: us per mx.eval minus a trivial eval's "
          f"({', '.join(f'{k}: {v:.0f} us' for k, v in base.items())})")
    print(f"{'piece':28s} " + " ".join(f"{k:>14s}" for k in tables))
    names = list(next(iter(tables.values())))
    for name in names:
        if name.startswith("("):
            continue
        print(f"{name:28s} " + " ".join(f"{t[name] - base[k]:14.0f}" for k, t in tables.items()))
    extra = timed(mlx_pool_pieces(), args.reps)
    for name, v in extra.items():
        print(f"{name:28s} {v - base['float32']:14.0f}")


if __name__ == "__main__":
    main()
