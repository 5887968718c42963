"""Half precision against float32 on the CPU: a training step under ``autocast(mx.bfloat16)``
and ``autocast(mx.float16)`` as a ratio to the same model's float32 step.

The models are ``bench/onethread.py``'s (``seed``: MLP 256-256-256-10, batch 128; ``cnn``: the
small CNN of ``bench/specs.py``, batch 64; ``lm``: a charlm-sized transformer, 2 blocks, width
128, 4 heads, context 64, batch 32), each step ``fluxlike.withgradient`` + Adam ``update``,
evaluated. The three dtypes of a model are interleaved in one process, each round timing a
run of steps of each; the table keeps each variant's best round (the machine's noise only
ever adds time). A ratio under 1 means half precision pays. Peak memory: MLX's peak over one
step of each variant, after the warm-up (the buffers MLX allocates; a native kernel's float32
copies of half-precision operands are its own, outside that count).

    .venv/bin/python bench/halves.py [--models seed,cnn,lm] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx
from machine import processor
from onethread import train_step

import fluxlike as fl

DTYPES: dict[str, mx.Dtype | None] = {"f32": None, "bf16": mx.bfloat16, "f16": mx.float16}
STEPS = {"seed": 60, "cnn": 20, "lm": 4}  # steps per round: about 0.1-1 s each


def measure(models: list[str], rounds: int) -> tuple[dict, dict]:
    """Best seconds per step, and peak bytes of one step, of each (model, dtype)."""
    steps: dict[tuple[str, str], Callable[[], None]] = {
        (m, d): train_step(m, dtype) for m in models for d, dtype in DTYPES.items()}
    peaks = {}
    for key, step in steps.items():  # warm: kernels, kept casts, buffers
        for _ in range(3):
            step()
        mx.reset_peak_memory()
        step()
        peaks[key] = mx.get_peak_memory()
    best = {key: float("inf") for key in steps}
    for _ in range(rounds):
        for (model, dtype), step in steps.items():
            n = STEPS.get(model, 10)
            start = time.perf_counter()
            for _ in range(n):
                step()
            best[model, dtype] = min(best[model, dtype], (time.perf_counter() - start) / n)
    return best, peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="seed,cnn,lm")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    models = args.models.split(",")
    best, peaks = measure(models, args.rounds)
    info = fl.native.native_info()
    print(f"# {processor()}; MLX {mx.__version__}; native kernels "
          f"{f'on: bfloat16 {info.bfloat16}, float16 {info.float16}' if info.available else 'off'}")
    print(f"# best of {args.rounds} interleaved rounds, wall time per training step\n")
    print("| model | f32 ms | bf16 / f32 | f16 / f32 | peak MB f32 / bf16 / f16 |")
    print("|---|---|---|---|---|")
    for m in models:
        f32 = best[m, "f32"]
        peak = " / ".join(f"{peaks[m, d] / 2**20:.1f}" for d in DTYPES)
        print(f"| {m} | {f32 * 1e3:.2f} | {best[m, 'bf16'] / f32:.2f} | "
              f"{best[m, 'f16'] / f32:.2f} | {peak} |")


if __name__ == "__main__":
    main()
