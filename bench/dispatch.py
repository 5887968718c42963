"""What the autocast dispatch barrier costs per layer call.

Per-call cost (thread CPU time) of building the graph of one ``Dense(256, 256)`` call (graph
construction only: no ``mx.eval``; the result is dropped) before the process's first
``autocast`` use, after it outside any scope, and inside an ``autocast(mx.bfloat16)`` scope,
as ratios to a hand-written function doing the same MLX operation (``mx.addmm(b, x, w.T)``).

All variants of a phase are measured in alternation (rotating which goes first); each round's
sample is divided by the same round's hand-written sample and the median ratio is reported,
so drift on a shared machine cancels out. The "before" phase must run before anything in the
process uses autocast, so the script measures it first and then crosses the barrier itself.

A second table explains the gap between the layer and the hand-written function: the same
``Dense`` body reading its parameters as ``self["weight"]`` instead of ``self.weight``, and
``mlx.nn.Linear`` (which reads ``self["weight"]``), in the same three states.

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
from fluxlike.layers.basic import check_features
from fluxlike.precision import ops
from fluxlike.precision.policy import is_dispatching

BATCHES = (1, 16, 128)
DIMS = 256


class ItemDense(fl.Dense):
    """``Dense`` with one ``self["weight"]`` read instead of three ``self.weight`` reads."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        check_features(x, weight.shape[1], "Dense")
        x = ops.match_input(x, weight, "Dense")
        return self.act(ops.linear(x, weight, self.get("bias")))


def per_call_us(fn: Callable[[mx.array], mx.array], x: mx.array, calls: int) -> float:
    # Thread CPU time: graph construction is single-threaded Python, and CPU time leaves out
    # the time this thread spends descheduled on a busy shared machine.
    start = time.thread_time_ns()
    for _ in range(calls):
        fn(x)
    return (time.thread_time_ns() - start) / calls / 1e3


def interleaved(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """``rounds`` samples of each variant, the variants alternating within each round."""
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            samples[name].append(variants[name]())
    return samples


def phase(batch: int, rounds: int, calls: int, scoped: bool) -> dict[str, float]:
    """Median ratio to the hand-written function of each variant, and the hand-written
    function's own median time (key ``"hand us"``)."""
    layers = {"Dense": fl.Dense(DIMS, DIMS), "ItemDense": ItemDense(DIMS, DIMS),
              "nn.Linear": nn.Linear(DIMS, DIMS)}
    w, b = layers["Dense"].weight, layers["Dense"].bias
    x = mx.random.normal((batch, DIMS))
    mx.eval(x, w, b, [layer.parameters() for layer in layers.values()])

    def hand(x: mx.array) -> mx.array:
        return mx.addmm(b, x, w.T)

    def outside(fn: Callable) -> Callable[[], float]:
        return lambda: per_call_us(fn, x, calls)

    def inside(fn: Callable) -> Callable[[], float]:
        def sample() -> float:
            with fl.autocast(mx.bfloat16, device="cpu"):
                return per_call_us(fn, x, calls)

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


def attribute_costs(rounds: int, calls: int) -> tuple[float, float]:
    """Cost of reading a parameter as ``module.weight`` and as ``module["weight"]``."""
    layer = fl.Dense(DIMS, DIMS)
    samples = interleaved({
        "attr": lambda: per_call_us(lambda m: m.weight, layer, calls),
        "item": lambda: per_call_us(lambda m: m["weight"], layer, calls),
        "none": lambda: per_call_us(lambda m: m, layer, calls),
    }, rounds)
    costs = {name: statistics.median(s) for name, s in samples.items()}
    return costs["attr"] - costs["none"], costs["item"] - costs["none"]


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
    if is_dispatching():
        raise SystemExit("autocast was already used in this process: cannot measure 'before'")

    gc.disable()
    try:
        before = {n: phase(n, args.rounds, args.calls, scoped=False) for n in BATCHES}
        assert not is_dispatching()
        with fl.autocast(device="cpu"):  # the first use: crosses the barrier
            pass
        after = {n: phase(n, args.rounds, args.calls, scoped=True) for n in BATCHES}
        attr, item = attribute_costs(args.rounds, args.calls * 5)
    finally:
        gc.enable()

    def ratios(name: str, n: int) -> list[str]:
        return [f"{before[n][name]:.2f}x", f"{after[n][name]:.2f}x",
                f"{after[n][name + ' in scope']:.2f}x"]

    print(f"Dense({DIMS} => {DIMS}) per call: graph construction only (no mx.eval), thread CPU "
          f"time, median over {args.rounds} interleaved rounds of {args.calls} calls of the "
          f"ratio to the hand-written mx.addmm(b, x, w.T) of the same round.\n")
    table(("batch", "hand-written (before / after)", "Dense before 1st use",
           "after, outside a scope", "inside autocast(bf16)"),
          [[str(n), f"{before[n]['hand us']:.2f} / {after[n]['hand us']:.2f} us",
            *ratios("Dense", n)] for n in BATCHES])
    print("\nWhere the gap to the hand-written function comes from (same states):\n")
    table(("batch", "Dense reading self[...]: before", "after", "in scope",
           "mlx.nn.Linear: before", "after", "in scope"),
          [[str(n), *ratios("ItemDense", n), *ratios("nn.Linear", n)] for n in BATCHES])
    print(f"\nReading a parameter as `layer.weight` costs {attr:.2f} us (mlx.nn.Module.__getattr__ "
          f"runs after a failed normal lookup); `layer[\"weight\"]` costs {item:.2f} us. "
          f"Dense.__call__ reads self.weight three times and self.bias once.")
    print(f"peak memory: {mx.get_peak_memory() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
