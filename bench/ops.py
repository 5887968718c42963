"""The kernels of fluxlike/precision/kernels.py and the BLAS under them, side by side on this CPU.

    .venv/bin/python bench/ops.py

Tables (one run, ratios first; absolute numbers are noise on a shared machine):

1. sgemm GFLOP/s of MLX's float32 matmul on the optimised BLAS (this process) and on the
   wheel's reference BLAS (a subprocess with ``FLUXLIKE_BLAS=off``);
2. Dense and Conv forward+backward: float32, MLX's native half kernels, and fluxlike's
   half precision through float32 kernels (``autocast``), with peak memory;
3. elementwise ops in each dtype (what the half-precision activations cost around the GEMMs);
4. OpenBLAS threads: a float32 training step with the default thread count and with one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

import fluxlike
from fluxlike import Chain, Conv, Dense, autocast, relu
from fluxlike.precision import kernels

HALVES = (mx.bfloat16, mx.float16)


def best_ms(fn: Callable[[], object], reps: int = 3, budget_s: float = 1.5) -> float:
    """The best of ``reps`` timed calls (``mx.eval`` inside), after one warm-up call; fewer
    calls for a slow function."""
    start = time.perf_counter()
    mx.eval(fn())
    first = time.perf_counter() - start
    reps = max(1, min(reps, int(budget_s / max(first, 1e-6))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def sgemm_rates(sizes: tuple[int, ...]) -> dict[int, float]:
    rates = {}
    for n in sizes:
        a = mx.random.normal((n, n))
        mx.eval(a)
        rates[n] = 2 * n**3 / best_ms(lambda a=a: a @ a, budget_s=2.0) * 1e-6
    return rates


def in_subprocess(mode: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, __file__, mode], env={**os.environ, **env},
                          capture_output=True, text=True, check=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))))


def section_sgemm() -> None:
    sizes = (256, 1024, 2048)
    optimised = sgemm_rates(sizes)
    reference = {int(k): v for k, v in in_subprocess("--sgemm", FLUXLIKE_BLAS="off").items()}
    info = fluxlike.blas_info()
    rows = [[f"{n}x{n} @ {n}x{n}", f"{reference[n]:.1f}", f"{optimised[n]:.1f}",
             f"{optimised[n] / reference[n]:.0f}x"] for n in sizes]
    table(f"1. MLX float32 matmul, GFLOP/s (optimised: {info.path})",
          ["shape", "reference BLAS", "optimised BLAS", "speed-up"], rows)


def training_step(model: nn.Module, x: mx.array, dtype: mx.Dtype | None,
                  native: bool = False) -> Callable[[], object]:
    """One forward+backward pass: float32 (``dtype`` None), fluxlike's half precision
    (autocast), or MLX's native half kernels (``native``: the layer's kernels bypass the
    float32 route)."""
    def loss(m, x):
        with autocast(dtype, enabled=dtype is not None):
            return m(x).astype(mx.float32).sum()

    grad = nn.value_and_grad(model, loss)

    def step():
        if not native:
            return grad(model, x)
        saved = kernels.choose
        kernels.choose = lambda *a: kernels.MLX  # the one decision point: MLX's own kernels
        try:
            return grad(model, x)
        finally:
            kernels.choose = saved

    return step


def peak_mb(step: Callable[[], object]) -> float:
    mx.eval(step())
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(step())
    return (mx.get_peak_memory() - base) / 2**20


def section_layers() -> None:
    mx.random.seed(0)
    cases = {
        "Dense MLP 4x(1024=>1024, relu), batch 512":
            (Chain(*[Dense(1024, 1024, relu) for _ in range(4)]), mx.random.normal((512, 1024)),
             True),
        "Dense MLP 8x(512=>512, relu), batch 8192":  # native half: ~25 s a step, left out
            (Chain(*[Dense(512, 512, relu) for _ in range(8)]), mx.random.normal((8192, 512)),
             False),
        "Conv 3x3 64=>64 pad 1, 32x32x32x64":
            (Conv((3, 3), 64, 64, relu, padding=1), mx.random.normal((32, 32, 32, 64)), True),
    }
    rows = []
    for name, (model, x, with_native) in cases.items():
        mx.eval(model.parameters(), x)
        f32 = training_step(model, x, None)
        base = best_ms(f32)
        base_mem = peak_mb(f32)
        rows.append([name, "float32", f"{base:.0f} ms", "1.00", f"{base_mem:.0f} MB", "1.00"])
        for dtype in HALVES:
            short = str(dtype).rpartition(".")[2]
            variants = [(f"{short} native MLX", True)] if with_native else []
            for label, native in [*variants, (f"{short} fluxlike", False)]:
                step = training_step(model, x, dtype, native)
                ms, mem = best_ms(step, reps=1 if native else 3), peak_mb(step)
                rows.append(["", label, f"{ms:.0f} ms", f"{ms / base:.2f}", f"{mem:.0f} MB",
                             f"{mem / base_mem:.2f}"])
    table("2. forward+backward (value_and_grad, eager): time and peak memory vs float32",
          ["model", "variant", "time", "ratio", "peak mem", "ratio"], rows)


def section_elementwise() -> None:
    x, y = mx.random.normal((8192, 512)), mx.random.normal((8192, 512))
    cases = {
        "relu": lambda a, b: nn.relu(a),
        "add": lambda a, b: a + b,
        "relu backward (mask * g)": lambda a, b: (a > 0) * b,
        "cast to float32": lambda a, b: a.astype(mx.float32),
        "cast from float32": lambda a, b: x.astype(a.dtype),
    }
    rows = []
    for name, fn in cases.items():
        times = {}
        for dtype in (mx.float32, *HALVES):
            a, b = x.astype(dtype), y.astype(dtype)
            mx.eval(a, b)
            times[dtype] = best_ms(lambda a=a, b=b, fn=fn: fn(a, b), reps=10)
        if name.startswith("cast"):  # float32 to float32 is no op at all
            rows.append([name, "no op", *(f"{times[d]:.2f} ms" for d in HALVES), "-", "-"])
            continue
        rows.append([name, *(f"{times[d]:.2f} ms" for d in times),
                     *(f"{times[d] / times[mx.float32]:.1f}" for d in HALVES)])
    table("3. elementwise on 8192x512 (what the half activations cost around the GEMMs)",
          ["op", "float32", "bfloat16", "float16", "bf16 ratio", "f16 ratio"], rows)


def mlp_step_ms() -> float:
    mx.random.seed(0)
    model = Chain(*[Dense(1024, 1024, relu) for _ in range(4)])
    x = mx.random.normal((512, 1024))
    mx.eval(model.parameters(), x)
    return best_ms(training_step(model, x, None), reps=5)


def section_threads() -> None:
    default = in_subprocess("--step")
    single = in_subprocess("--step", OPENBLAS_NUM_THREADS="1")
    gemm = sgemm_rates((1024,))[1024]
    rows = [["default threads", f"{default['gflops']:.0f}", f"{default['ms']:.1f} ms", "1.00"],
            ["OPENBLAS_NUM_THREADS=1", f"{single['gflops']:.0f}", f"{single['ms']:.1f} ms",
             f"{single['ms'] / default['ms']:.2f}"]]
    table(f"4. OpenBLAS threads on {os.cpu_count()} cores (this process: {gemm:.0f} GFLOP/s)",
          ["setting", "sgemm 1024 GFLOP/s", "MLP fwd+bwd", "ratio"], rows)


def main() -> None:
    if sys.argv[1:] == ["--sgemm"]:
        print(json.dumps(sgemm_rates((256, 1024, 2048))))
        return
    if sys.argv[1:] == ["--step"]:
        print(json.dumps({"ms": mlp_step_ms(), "gflops": sgemm_rates((1024,))[1024]}))
        return
    print(f"fluxlike.blas_info(): {fluxlike.blas_info()}")
    section_sgemm()
    section_layers()
    section_elementwise()
    section_threads()


if __name__ == "__main__":
    main()
