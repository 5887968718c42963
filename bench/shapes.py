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
    .venv/bin/python bench/shapes.py --conv-costs        # where a conv's first use runs MLX

Variants: ``auto`` (the companion as it ships), ``off`` (``fluxlike.native.disabled()``) and,
with ``--per-shape``, ``primitive`` (the companion's matmul mode with a primitive per shape, as
before 2026-12-04).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if {"--first-calls", "--conv-costs"} & set(sys.argv):
    # before oneDNN starts: its own cache of primitives off, so that a round after the first
    # meets new shapes as the first did (0 hits otherwise too)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

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


def cnn_gradient() -> Callable[[int], None]:
    """The same small CNN's float32 gradient (a training step's) on a new image size per call:
    the convolutions' backward passes and the pooling's too."""
    mx.random.seed(4)
    model = fluxlike.Chain(fluxlike.Conv((3, 3), 3, 16, fluxlike.relu),
                           fluxlike.MaxPool((2, 2)), fluxlike.Conv((3, 3), 16, 32, fluxlike.relu))
    mx.eval(model.parameters())

    def step(size: int) -> None:
        x = mx.random.normal((2, size, size, 3))
        loss, grads = withgradient(lambda m: (m(x) ** 2).mean(), model)
        mx.eval(loss, grads)

    return step


def first_calls(rounds: int, max_length: int) -> None:
    """Each call's time with the kernels on against off, first calls only: the companion's
    cache is emptied before every round, and every length is new to it. A length runs three
    times back to back, on, off and off again, in a rotating order (the first also warms
    MLX's allocator); the ratio of the two off calls is the machine's noise floor. Rounds
    alternate the creation policy (``native.background_creation``): a shape's primitive,
    from its third use, made on the worker thread or on the evaluating thread, each round
    order seen under both."""
    ext = native.switch.loaded
    if ext is None:
        print("first calls: the companion is not in use")
        return
    loops = (("mlp f32 grad", mlp_gradient, list(range(1, max_length + 1, 7))),
             ("generation", generator, list(range(1, 65))),
             ("cnn forward", cnn_forward, list(range(8, 40))),
             ("cnn f32 grad", cnn_gradient, list(range(8, 40))))
    policies = {"worker": True, "evaluating": False}
    print(f"\n{'loop (first calls)':<20} {'creation':<11} {'calls':>6} {'on/off: median':>15} "
          f"{'p90':>5} {'> 1.10':>7} {'| off/off: p90':>15} {'> 1.10':>7} {'ms on':>6} "
          f"{'ms off':>7} {'made':>5}")
    variants = ("on", "off", "off again")
    before = native.background_creation()
    try:
        for name, make, lengths in loops:
            step = make()
            step(lengths[0])  # warm: imports, the weights' casts
            ratios = {p: {"on": [], "off again": []} for p in policies}
            on_ms: dict[str, list[float]] = {p: [] for p in policies}
            off_ms: dict[str, list[float]] = {p: [] for p in policies}
            made = dict.fromkeys(policies, 0)
            for r in range(2 * rounds):
                policy = list(policies)[r % 2]
                native.background_creation(policies[policy])
                ext.clear_cache()  # (waits for the worker's creations)
                order = random.Random(r // 2).sample(lengths, len(lengths))
                for i, length in enumerate(order):
                    times = {}
                    turn = (i + r // 2) % 3
                    for variant in variants[turn:] + variants[:turn]:
                        with contextlib.nullcontext() if variant == "on" else native.disabled():
                            start = time.perf_counter()
                            step(length)
                            times[variant] = time.perf_counter() - start
                    for key in ratios[policy]:
                        ratios[policy][key].append(times[key] / times["off"])
                    on_ms[policy].append(times["on"] * 1e3)
                    off_ms[policy].append(times["off"] * 1e3)
                native.wait_for_creations()
                made[policy] += creations()
            for policy in policies:
                on, noise = sorted(ratios[policy]["on"]), sorted(ratios[policy]["off again"])
                print(f"{name:<20} {policy:<11} {len(on):>6} {statistics.median(on):>15.2f} "
                      f"{p90(on):>5.2f} {over(on):>7} {p90(noise):>15.2f} {over(noise):>7} "
                      f"{statistics.median(on_ms[policy]):>6.2f} "
                      f"{statistics.median(off_ms[policy]):>7.2f} {made[policy]:>5}")
    finally:
        native.background_creation(before)


# (name, kernel, C_in, C_out, x shape, stride, padding): 1-3 spatial axes, 1x1 to 5x5
# kernels, strides 1-2, from 2**17 to 2**29 multiply-adds.
CONVS = [
    ("2d 3x3 3->16 16x16 b2", (3, 3), 3, 16, (2, 16, 16, 3), 1, 0),
    ("2d 3x3 16->32 10x10 b2", (3, 3), 16, 32, (2, 10, 10, 16), 1, 0),
    ("2d 3x3 16->32 17x17 b2", (3, 3), 16, 32, (2, 17, 17, 16), 1, 0),
    ("3d 3x3x3 8->16 8^3 b2", (3, 3, 3), 8, 16, (2, 8, 8, 8, 8), 1, 1),
    ("2d 3x3 16->32 32x32 b2", (3, 3), 16, 32, (2, 32, 32, 16), 1, 0),
    ("2d 5x5 1->20 28x28 b32", (5, 5), 1, 20, (32, 28, 28, 1), 1, 0),
    ("2d 1x1 64->256 14x14 b8", (1, 1), 64, 256, (8, 14, 14, 64), 1, 0),
    ("2d 3x3 s2 32->64 32x32 b8", (3, 3), 32, 64, (8, 32, 32, 32), 2, 1),
    ("1d k5 64->64 L512 b8", (5,), 64, 64, (8, 512, 64), 1, 2),
    ("2d 3x3 256->256 4x4 b8", (3, 3), 256, 256, (8, 4, 4, 256), 1, 1),
    ("3d 3x3x3 16->32 16^3 b2", (3, 3, 3), 16, 32, (2, 16, 16, 16, 16), 1, 1),
    ("2d 3x3 64->64 56x56 b8", (3, 3), 64, 64, (8, 56, 56, 64), 1, 1),
]


def conv_costs(repeats: int = 5) -> None:
    """Where a float32 convolution's first use should run MLX's kernel: per shape, MLX's call
    (the kernels off), a primitive's creation with its first call (matmul mode "primitive",
    the cache emptied before each), and the primitive's later calls; ms, best of
    ``repeats``."""
    ext = native.switch.loaded
    if ext is None:
        print("conv costs: the companion is not in use")
        return

    def best(call: Callable[[], None], clear: bool = False) -> float:
        times = []
        for _ in range(repeats):
            if clear:
                ext.clear_cache()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    print(f"\n{'convolution (ReLU, bias)':<28} {'MACs':>6} {'MLX':>8} {'created + run':>14} "
          f"{'primitive':>10}")
    mode = ext.matmul_mode()
    try:
        for name, kernel, c_in, c_out, shape, stride, padding in CONVS:
            layer = fluxlike.Conv(kernel, c_in, c_out, fluxlike.relu, stride=stride,
                                  padding=padding)
            x = mx.random.normal(shape)
            mx.eval(layer.parameters(), x)
            y = layer(x)
            macs = y.size * c_in * int(np.prod(kernel))

            def call(layer: fluxlike.Conv = layer, x: mx.array = x) -> None:
                mx.eval(layer(x))

            with native.disabled():
                call()
                off = best(call)
            ext.set_matmul_mode("primitive")
            created = best(call, clear=True)
            ext.set_matmul_mode(mode)
            steady = best(call)
            print(f"{name:<28} 2**{math.log2(macs):<4.1f} {off:>8.3f} {created:>14.3f} "
                  f"{steady:>10.3f}")
    finally:
        ext.set_matmul_mode(mode)


def p90(values: list[float]) -> float:
    return values[int(0.9 * len(values))]


def over(values: list[float]) -> str:
    return f"{sum(v > 1.10 for v in values) / len(values):.0%}"


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
    parser.add_argument("--conv-costs", action="store_true",
                        help="only a float32 convolution's costs per shape: MLX's call, a "
                             "creation with its first call, later calls")
    args = parser.parse_args()
    mx.set_cache_limit(1 << 30)
    if args.first_calls or args.conv_costs:
        print(f"native: {native.native_info().reason}")
        if args.conv_costs:
            conv_costs()
        if args.first_calls:
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
            native.wait_for_creations()  # (the first pass's, before the steady one)
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
