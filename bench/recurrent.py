"""Recurrent layers' training steps: fluxlike's LSTM and GRU with the native sigmoid and tanh,
the same with the native kernels off, and mlx.nn's LSTM/GRU in a hand-written MLX loop,
interleaved in one run, with peak memory.

    .venv/bin/python bench/recurrent.py [--batch 32] [--length 64] [--hidden 256] [--rounds 5]

A model ``Chain(LSTM(64, hidden), Dense(hidden, 64))`` (GRU alike) on ``(batch, length, 64)``,
mean squared output as the loss, ``mx.value_and_grad`` for the MLX loop. MLX's CPU ``exp`` and
``tanh`` are scalar on the Linux wheel: the gates' sigmoid and tanh were about a third of an
LSTM's step.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

import fluxlike
from fluxlike import native, withgradient

DIMS = 64


def fluxlike_step(cell: str, hidden: int, x: mx.array) -> Callable[[], None]:
    model = fluxlike.Chain(getattr(fluxlike, cell)(DIMS, hidden), fluxlike.Dense(hidden, DIMS))
    mx.eval(model.parameters())

    def step() -> None:
        loss, grads = withgradient(lambda m: (m(x) ** 2).mean(), model)
        mx.eval(loss, grads)

    return step


def mlx_step(cell: str, hidden: int, x: mx.array) -> Callable[[], None]:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(nn, cell)(DIMS, hidden)
            self.out = nn.Linear(hidden, DIMS)

        def __call__(self, v: mx.array) -> mx.array:
            h = self.rnn(v)
            return self.out(h[0] if isinstance(h, tuple) else h)

    model = Model()
    mx.eval(model.parameters())
    grad = nn.value_and_grad(model, lambda m, v: (m(v) ** 2).mean())

    def step() -> None:
        loss, grads = grad(model, x)
        mx.eval(loss, grads)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"native: {native.native_info().reason}")
    x = mx.random.normal((args.batch, args.length, DIMS))
    mx.eval(x)
    print(f"\n{'cell':<6} {'variant':<22} {'ms/step':>9} {'/ MLX loop':>11} {'peak MiB':>9}")
    for cell in ("LSTM", "GRU"):
        variants = {"fluxlike (native)": fluxlike_step(cell, args.hidden, x),
                    "fluxlike (native off)": fluxlike_step(cell, args.hidden, x),
                    "mlx.nn, MLX loop": mlx_step(cell, args.hidden, x)}
        times: dict[str, list[float]] = {v: [] for v in variants}
        peaks = dict.fromkeys(variants, 0)
        for r in range(args.rounds + 1):  # (the first round warms)
            for name, step in variants.items():
                off = name.endswith("off)")
                with native.disabled() if off else contextlib.nullcontext():
                    mx.reset_peak_memory()
                    start = time.perf_counter()
                    step()
                    if r:
                        times[name].append(time.perf_counter() - start)
                    peaks[name] = max(peaks[name], mx.get_peak_memory())
        base = statistics.median(times["mlx.nn, MLX loop"])
        for name in variants:
            ms = statistics.median(times[name])
            print(f"{cell:<6} {name:<22} {ms * 1e3:>9.1f} {ms / base:>11.2f} "
                  f"{peaks[name] / 2**20:>9.1f}")


if __name__ == "__main__":
    main()
