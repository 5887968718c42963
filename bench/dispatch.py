"""What the autocast dispatch barrier costs per layer call.

Per-call cost of one ``Dense(256, 256)`` call before the process's first ``autocast`` use,
after it outside any scope, and inside an ``autocast(mx.bfloat16)`` scope, as ratios to a
hand-written function doing the same MLX operation (``mx.addmm(b, x, w.T)``), in two ways:

- graph construction only (no ``mx.eval``; the result is dropped): the Python cost of the call,
  where any overhead of the layer shows undiluted;
- a whole call, graph construction plus ``mx.eval`` of the result: what a user pays.

``mlx.nn.Linear`` is measured beside it for reference. Graph construction is timed in thread
CPU time, whole calls on the wall clock. All variants of a phase are measured in alternation
(rotating which goes first); each round's sample is divided by the same round's hand-written
sample and the median ratio is reported, so drift on a shared machine cancels out. The "before"
phase must run before anything in the process uses autocast, so the script measures it first
and then crosses the barrier itself.

    .venv/bin/python bench/dispatch.py [--rounds 61] [--calls 200]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

import fluxlike as fl
from fluxlike.precision.policy import is_routing

BATCHES = (1, 16, 128)
DIMS = 256


def per_call_us(
    fn: Callable[[mx.array], mx.array], x: mx.array, calls: int, evaluate: bool = False
) -> float:
    # Graph construction is single-threaded Python: thread CPU time leaves out the time this
    # thread spends descheduled on a busy shared machine. Evaluation runs on MLX's own
    # threads, so a whole call is timed on the wall clock.
    clock = time.perf_counter_ns if evaluate else time.thread_time_ns
    start = clock()
    for _ in range(calls):
        y = fn(x)
        if evaluate:
            mx.eval(y)
    return (clock() - start) / calls / 1e3


def interleaved(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """``rounds`` samples of each variant, the variants alternating within each round."""
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            samples[name].append(variants[name]())
    return samples


def phase(batch: int, rounds: int, calls: int, scoped: bool, evaluate: bool) -> dict[str, float]:
    """Median ratio to the hand-written function of each variant, and the hand-written
    function's own median time (key ``"hand us"``)."""
    layers = {"Dense": fl.Dense(DIMS, DIMS), "nn.Linear": nn.Linear(DIMS, DIMS)}
    w, b = layers["Dense"].weight, layers["Dense"].bias
    x = mx.random.normal((batch, DIMS))
    mx.eval(x, w, b, [layer.parameters() for layer in layers.values()])

    def hand(x: mx.array) -> mx.array:
        return mx.addmm(b, x, w.T)

    def outside(fn: Callable) -> Callable[[], float]:
        return lambda: per_call_us(fn, x, calls, evaluate)

    def inside(fn: Callable) -> Callable[[], float]:
        def sample() -> float:
            with fl.autocast(mx.bfloat16, device="cpu"):
                return per_call_us(fn, x, calls, evaluate)

        return sample

    variants = {"hand": outside(hand)}
    for name, layer in layers.items():
        variants[name] = outside(layer)
        if scoped:
            variants[f"{name} in scope"] = inside(layer)
    for sample in variants.values():  # warm up
        sample()
    samples = interleaved(variants, rounds)
    hand_us = samples.pop("hand")
    ratios = {name: statistics.median(s / h for s, h in zip(values, hand_us, strict=True))
              for name, values in samples.items()}
    return {**ratios, "hand us": statistics.median(hand_us)}


def table(head: tuple[str, ...], rows: list[list[str]]) -> None:
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for row in rows:
        print(" | ".join(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=61)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    if is_routing():
        raise SystemExit("autocast was already used in this process: cannot measure 'before'")

    gc.disable()
    try:
        modes = (False, True)
        before = {(n, e): phase(n, args.rounds, args.calls, False, e)
                  for e in modes for n in BATCHES}
        assert not is_routing()
        with fl.autocast(device="cpu"):  # the first use: crosses the barrier
            pass
        after = {(n, e): phase(n, args.rounds, args.calls, True, e)
                 for e in modes for n in BATCHES}
    finally:
        gc.enable()

    def ratios(name: str, key: tuple[int, bool]) -> list[str]:
        return [f"{before[key][name]:.2f}x", f"{after[key][name]:.2f}x",
                f"{after[key][name + ' in scope']:.2f}x"]

    print(f"Dense({DIMS} => {DIMS}) per call, median over {args.rounds} "
          f"interleaved rounds of {args.calls} calls of the ratio to the hand-written "
          f"mx.addmm(b, x, w.T) of the same round. BLAS: {fl.blas_info().path}\n")
    for evaluate, title in ((False, "graph construction only (no mx.eval)"),
                            (True, "whole call: graph construction + mx.eval")):
        print(f"{title}:\n")
        table(("batch", "hand-written (before / after)", "Dense: before 1st use",
               "after, outside a scope", "inside autocast(bf16)", "nn.Linear: before",
               "after", "inside"),
              [[str(n), f"{before[n, evaluate]['hand us']:.2f} / "
                        f"{after[n, evaluate]['hand us']:.2f} us",
                *ratios("Dense", (n, evaluate)), *ratios("nn.Linear", (n, evaluate))]
               for n in BATCHES])
        print()
    print(f"peak memory: {mx.get_peak_memory() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
