"""Shapes that vary: native kernels against off, interleaved in one run.

The issue's float32 MLP gradient (``Chain(Dense(64, 128, relu), Dense(128, 64))`` on
``(4, length, 64)``), and
a small causal transformer LM (bench/models.py's ``LanguageModel``: dims 128, 4 heads, 2
layers, vocab 512, batch 4) trained under ``autocast(bfloat16)`` on batches of random
sequence length, and a generation-style loop (the whole prefix again, one token longer each
call), each with the native kernels and with them off (``fluxlike.native.disabled()``).
The first pass meets every length for the first time; the steady pass repeats them.
Reported: ms per step (median), and the primitives created (``fluxlike.native.cache_info``).

    .venv/bin/python bench/shapes.py [--lengths 120] [--max-length 512] [--per-shape]
    .venv/bin/python bench/shapes.py --first-calls 3     # first calls only, each against off

Variants: ``auto`` (the companion as it ships), ``off`` (``fluxlike.native.disabled()``) and,
with ``--per-shape``, ``primitive`` (the companion's matmul mode with a primitive per shape, as
before 2026-12-04).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--first-calls" in sys.argv:  # before oneDNN starts: its own cache of primitives off, so
    # that a round after the first meets new shapes as the first did (0 hits otherwise too)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")

import mlx.core as mx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import models as M  # noqa: E402

import fluxlike  # noqa: E402
from fluxlike import autocast, native, setup, update, withgradient  # noqa: E402

SPEC = M.LMSpec(name="shapes", description="LM for varying shapes", vocab=512, dims=128,
                heads=4, layers=2, context=512, batch=4)


def creations() -> int:
    info = native.cache_info()
    return 0 if info is None else int(info["creations"])


def trainer() -> Callable[[int], None]:
    mx.random.seed(0)
    lm = M.LanguageModel(SPEC)
    opt_state = setup(fluxlike.Adam(1e-3), lm)
    captured = [lm.state, opt_state.optimizer.state]
    mx.eval(captured)

    def step(length: int) -> None:
        tokens = mx.random.randint(0, SPEC.vocab, (SPEC.batch, length))
        targets = mx.random.randint(0, SPEC.vocab, (SPEC.batch, length))
        loss, grads = withgradient(lambda m: M.lm_loss(m, tokens, targets), lm,
                                   autocast=mx.bfloat16)
        update(opt_state, lm, grads[0])
        mx.eval(loss, captured)

    return step


def generator() -> Callable[[int], None]:
    mx.random.seed(1)
    lm = M.LanguageModel(SPEC)
    mx.eval(lm.parameters())

    def step(length: int) -> None:
        tokens = mx.random.randint(0, SPEC.vocab, (1, length))
        with autocast(mx.bfloat16):
            mx.eval(lm(tokens)[:, -1].argmax(-1))

    return step


def mlp_gradient() -> Callable[[int], None]:
    """A float32 gradient with a new row count per length: Chain(Dense(64, 128, relu),
    Dense(128, 64)) on (4, length, 64) inputs."""
    mx.random.seed(2)
    model = fluxlike.Chain(fluxlike.Dense(64, 128, fluxlike.relu), fluxlike.Dense(128, 64))
    mx.eval(model.parameters())

    def step(length: int) -> None:
        x = mx.random.normal((4, length, 64))
        loss, grads = withgradient(lambda m: (m(x) ** 2).mean(), model)
        mx.eval(loss, grads)

    return step


def cnn_forward() -> Callable[[int], None]:
    """A small CNN's inference on a new image size per call: Conv 3x3 3->16, ReLU, MaxPool 2,
    Conv 3x3 16->32, ReLU on (2, size, size, 3)."""
    mx.random.seed(3)
    model = fluxlike.Chain(fluxlike.Conv((3, 3), 3, 16, fluxlike.relu),
                           fluxlike.MaxPool((2, 2)), fluxlike.Conv((3, 3), 16, 32, fluxlike.relu))
    mx.eval(model.parameters())

    def step(size: int) -> None:
        mx.eval(model(mx.random.normal((2, size, size, 3))))

    return step


def first_calls(rounds: int, max_length: int) -> None:
    """Each call's time with the kernels on against off, first calls only: the companion's
    cache is emptied before every round, and every length is new to it. A length runs three
    times back to back, on, off and off again, in a rotating order (the first also warms
    MLX's allocator); the ratio of the two off calls is the machine's noise floor."""
    ext = native.switch.loaded
    if ext is None:
        print("first calls: the companion is not in use")
        return
    loops = (("mlp f32 grad", mlp_gradient, list(range(1, max_length + 1, 7))),
             ("generation", generator, list(range(1, 65))),
             ("cnn forward", cnn_forward, list(range(8, 40))))
    print(f"\n{'loop (first calls)':<20} {'calls':>6} {'on/off: median':>15} {'p90':>5} "
          f"{'> 1.10':>7} {'| off/off: p90':>15} {'> 1.10':>7} {'ms on':>6} {'ms off':>7}")
    variants = ("on", "off", "off again")
    for name, make, lengths in loops:
        step = make()
        step(lengths[0])  # warm: imports, the weights' casts
        ratios: dict[str, list[float]] = {"on": [], "off again": []}
        on_ms, off_ms = [], []
        for r in range(rounds):
            ext.clear_cache()
            order = random.Random(r).sample(lengths, len(lengths))
            for i, length in enumerate(order):
                times = {}
                turn = (i + r) % 3
                for variant in variants[turn:] + variants[:turn]:
                    with contextlib.nullcontext() if variant == "on" else native.disabled():
                        start = time.perf_counter()
                        step(length)
                        times[variant] = time.perf_counter() - start
                for key in ratios:
                    ratios[key].append(times[key] / times["off"])
                on_ms.append(times["on"] * 1e3)
                off_ms.append(times["off"] * 1e3)
        on, noise = sorted(ratios["on"]), sorted(ratios["off again"])

        def p90(values: list[float]) -> float:
            return values[int(0.9 * len(values))]

        def over(values: list[float]) -> str:
            return f"{sum(v > 1.10 for v in values) / len(values):.0%}"

        print(f"{name:<20} {len(on):>6} {statistics.median(on):>15.2f} {p90(on):>5.2f} "
              f"{over(on):>7} {p90(noise):>15.2f} {over(noise):>7} "
              f"{statistics.median(on_ms):>6.2f} {statistics.median(off_ms):>7.2f}")


def run(step: Callable[[int], None], lengths: list[int], variant: str) -> tuple[float, int]:
    """Median ms per call over ``lengths``, and the primitives created meanwhile, for the
    variant ``"off"`` (fluxlike.native.disabled()) or a matmul mode of the companion
    (``"auto"``; ``"primitive"``: a primitive per shape, as before 2026-12-04)."""
    ext = native.switch.loaded
    before = creations()
    times = []
    old = ext.set_matmul_mode(variant) if ext is not None and variant != "off" else None
    try:
        for length in lengths:
            if variant == "off":
                with native.disabled():
                    start = time.perf_counter()
                    step(length)
            else:
                start = time.perf_counter()
                step(length)
            times.append(time.perf_counter() - start)
    finally:
        if old is not None:
            ext.set_matmul_mode(old)
    return statistics.median(times) * 1e3, creations() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=120, help="distinct training lengths")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=96, help="generation steps")
    parser.add_argument("--per-shape", action="store_true",
                        help="also the companion with a primitive per shape (matmul mode "
                             "'primitive', as before 2026-12-04)")
    parser.add_argument("--first-calls", type=int, metavar="ROUNDS", default=0,
                        help="only first calls, each against the kernels off: ROUNDS rounds, "
                             "the primitive cache emptied before each")
    args = parser.parse_args()
    mx.set_cache_limit(1 << 30)
    if args.first_calls:
        print(f"native: {native.native_info().reason}")
        first_calls(args.first_calls, args.max_length)
        return
    rng = random.Random(0)
    lengths = rng.sample(range(1, args.max_length + 1), args.lengths)
    gen = list(range(1, args.tokens + 1))
    print(f"native: {native.native_info().reason}")
    if native.switch.loaded is not None:
        print(f"matmul mode: {native.switch.loaded.matmul_mode()}")
    rows = []
    loops = (("mlp f32 grad", mlp_gradient, lengths), ("lm bf16 train", trainer, lengths),
             ("generation", generator, gen))
    variants = ["auto", "off"] + (["primitive"] if args.per_shape else [])
    for name, make, ls in loops:
        steps = {v: make() for v in variants}
        # interleaved: a chunk of 8 lengths with each variant in turn, the order rotated
        # from chunk to chunk (the first to meet a length also warms MLX's buffer cache)
        results: dict[str, list] = {f"{v} {phase}": [] for phase in ("first", "steady")
                                    for v in variants}
        for phase in ("first", "steady"):
            for i in range(0, len(ls), 8):
                chunk = ls[i:i + 8]
                turn = (i // 8) % len(variants)
                for v in variants[turn:] + variants[:turn]:
                    results[f"{v} {phase}"].append(run(steps[v], chunk, v))
        for key, parts in results.items():
            ms = statistics.median(p[0] for p in parts)
            made = sum(p[1] for p in parts)
            rows.append((name, key, ms, made))
    print(f"\n{'loop':<14} {'variant':<16} {'ms/step (median)':>17} {'primitives made':>16}")
    for name, key, ms, made in rows:
        print(f"{name:<14} {key:<16} {ms:>17.2f} {made:>16}")


if __name__ == "__main__":
    main()
