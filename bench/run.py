"""fluxlike against hand-written MLX, mlx.nn and PyTorch on this machine's CPU, side by side.

    .venv/bin/python bench/run.py [--quick] [--only inference|training|memory]
                                  [--models seed,large,cnn,act]

Three tables, each measured in one process with the variants interleaved (round-robin over
the variants for every repetition, in a new random order each round, medians kept),
after a warm-up:

1. inference: one forward pass (``mx.eval`` of the output inside the timed region);
2. training: one full step, forward + backward + Adam update (``mx.eval`` of the loss, the
   parameters and the optimiser state inside the timed region);
3. memory: ``mx.get_peak_memory()`` of one training step (MLX variants only).

Times are ratios to PyTorch float32 (to fluxlike float32 when PyTorch is not installed); the
baseline's absolute milliseconds are in the last column. PyTorch runs with its default
thread count (printed in the header), MLX with whatever it uses. Absolute numbers are noise on
a shared machine; the ratios measured side by side are the figures to keep.
"""

# ruff: noqa: E402  (the imports are ordered on purpose, see below)
from __future__ import annotations

# isort: off
import sys

# PyTorch (an optional extra) before fluxlike, and fluxlike before mlx.core. fluxlike opens
# OpenBLAS with RTLD_GLOBAL so that MLX binds to it; a torch imported *after* that binds its
# own BLAS calls to OpenBLAS too, whose threads then fight torch's OpenMP threads (a seed-MLP
# training step 3-7x slower and erratic on 2 cores). In this order each uses its own BLAS.
torch = F = None
if "--no-torch" not in sys.argv:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        pass
import fluxlike  # before mlx.core: fluxlike picks MLX's BLAS
# isort: on

import argparse
import gc
import importlib.metadata
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import models as M
import numpy as np

from fluxlike import autocast, bf16mix, setup, update, withgradient

BF16 = mx.bfloat16
SECTIONS = ("inference", "training", "memory")
DEFAULT_MODELS = {"inference": ["seed", "large", "cnn"], "training": ["seed", "large", "cnn"],
                  "memory": ["seed", "large", "cnn", "act"]}


# ------------------------------------------------------------------ timing


class Timer:
    """Interleaved timing: every variant gets its own number of calls per sample (so that a
    sample lasts about ``sample_s``) and its own number of samples (about ``budget_s`` in all,
    at least ``min_samples``, or one for a variant slower than ``slow_s``); each sample is
    preceded by one untimed call of its variant."""

    def __init__(self, quick: bool):
        self.quick = quick
        self.sample_s = 0.01 if quick else 0.05
        self.budget_s = 0.03 if quick else 1.0
        self.min_samples = 1 if quick else 7
        self.max_samples = 2 if quick else 25
        self.slow_s = 1.0

    def run(self, variants: dict[str, Callable[[], object]]) -> dict[str, float]:
        """The median seconds per call of each variant."""
        inner, count = {}, {}
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()  # first call: traces, compiles, allocates
            first = time.perf_counter() - start
            if first < self.slow_s:
                for _ in range(1 if self.quick else 2):
                    start = time.perf_counter()
                    fn()
                    first = time.perf_counter() - start
            inner[name] = max(1, round(self.sample_s / first))
            low = 1 if first > self.slow_s else self.min_samples
            wanted = round(self.budget_s / (inner[name] * first))
            count[name] = min(self.max_samples, max(low, wanted))
        samples: dict[str, list[float]] = {name: [] for name in variants}
        names, shuffle = list(variants), random.Random(0).shuffle
        for r in range(max(count.values(), default=0)):
            # A new order each round: a variant that leaves threads spinning (OpenMP after
            # PyTorch, OpenBLAS after an MLX matmul) must not always run just before the same one.
            shuffle(names)
            for name in names:
                if r >= count[name]:
                    continue
                fn, k = variants[name], inner[name]
                # One untimed call first: a sample measures the variant in its steady state
                # (a training loop repeats one step), not its first call after another
                # variant reshuffled the allocators' caches (MLX's buffer cache, malloc's).
                fn()
                start = time.perf_counter()
                for _ in range(k):
                    fn()
                samples[name].append((time.perf_counter() - start) / k)
        return {name: statistics.median(s) for name, s in samples.items()}


# ------------------------------------------------------------------ variants


def inference_variants(spec: M.Spec) -> tuple[dict[str, Callable], dict[str, Callable]]:
    """``(timed, outputs)``: per variant a function running one forward pass to completion,
    and one returning the output as a float32 numpy array (for the agreement check)."""
    ws = M.weights(spec)
    x_np, _ = M.data(spec)
    x = mx.array(x_np)
    flux = M.fluxlike_model(spec, ws)
    flux16 = bf16mix(flux)
    params, forward = M.mlx_params(ws), M.mlx_forward(spec)
    mnn = M.mlx_nn_model(spec, ws)
    mx.eval(flux.parameters(), flux16.parameters(), params, mnn.parameters(), x)

    def fl_autocast():
        with autocast(BF16):
            return flux(x)

    fns: dict[str, Callable[[], object]] = {
        "fl f32": lambda: flux(x),
        "fl autocast": fl_autocast,
        "fl bf16mix": lambda: flux16(x),
        "mlx hand": lambda: forward(params, x),
        "mlx.nn": lambda: mnn(x),
    }
    outputs = {name: (lambda f=f: np.array(f().astype(mx.float32))) for name, f in fns.items()}
    timed = {name: (lambda f=f: mx.eval(f())) for name, f in fns.items()}
    if torch is not None:
        tm, tx = M.torch_model(spec, ws).eval(), M.torch_input(x_np)

        def torch_f32():
            with torch.no_grad():
                return tm(tx)

        def torch_bf16():
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                return tm(tx)

        for name, f in (("torch f32", torch_f32), ("torch bf16", torch_bf16)):
            timed[name] = f
            outputs[name] = lambda f=f: f().float().numpy()
    return timed, outputs


def fluxlike_step(spec: M.Spec, ws: list, x: mx.array, y: mx.array, *, ac: mx.Dtype | None,
                  mixed: bool = False, compiled: bool = False) -> tuple[Callable, Callable]:
    """``(step, live)``: one fluxlike training step as a user writes it (``withgradient`` +
    ``update``; compiled with ``fluxlike.compile`` capturing model and optimiser state) and
    a function returning the arrays it changes."""
    model = M.fluxlike_model(spec, ws)
    if mixed:
        model = bf16mix(model)
    opt_state = setup(fluxlike.Adam(1e-3), model)
    captured = [model.state, opt_state.optimizer.state]

    def raw(x: mx.array, y: mx.array) -> mx.array:
        loss, grads = withgradient(lambda m: M.fluxlike_loss(m, x, y), model, autocast=ac)
        update(opt_state, model, grads[0])
        return loss

    fn = fluxlike.compile(raw, inputs=captured, outputs=captured) if compiled else raw

    def step():
        mx.eval(fn(x, y), captured)

    return step, lambda: captured


def training_variants(spec: M.Spec, memory: bool = False) -> dict[str, Callable]:
    """Per variant a function building the model and optimiser and returning ``step``, which
    runs one training step to completion (built lazily so the memory section can build,
    measure and free one variant at a time)."""
    ws = M.weights(spec)
    x_np, labels_np = M.data(spec)
    x, labels = mx.array(x_np), mx.array(labels_np)
    y = mx.array(M.onehot(labels_np, spec.classes))
    flux = partial(fluxlike_step, spec, ws, x, y)

    def mlx_hand():
        params, opt = M.mlx_params(ws), optim.Adam(1e-3, bias_correction=True)
        opt.init(params)
        value_and_grad = mx.value_and_grad(M.mlx_loss(M.mlx_forward(spec)))
        box = [params]

        def step():
            loss, grads = value_and_grad(box[0], x, y)
            box[0] = opt.apply_gradients(grads, box[0])
            mx.eval(loss, box[0], opt.state)

        return step

    def mlx_nn(compiled: bool):
        model, opt = M.mlx_nn_model(spec, ws), optim.Adam(1e-3, bias_correction=True)
        opt.init(model.trainable_parameters())
        value_and_grad = nn.value_and_grad(model, M.mlx_nn_loss)
        state = [model.state, opt.state]

        def raw(x: mx.array, labels: mx.array) -> mx.array:
            loss, grads = value_and_grad(model, x, labels)
            opt.update(model, grads)
            return loss

        fn = mx.compile(raw, inputs=state, outputs=state) if compiled else raw

        def step():
            mx.eval(fn(x, labels), state)

        return step

    makers: dict[str, Callable[[], Callable]] = {
        "fl f32": lambda: flux(ac=None)[0],
        "fl compiled": lambda: flux(ac=None, compiled=True)[0],
        "fl autocast": lambda: flux(ac=BF16)[0],
        "fl ac compiled": lambda: flux(ac=BF16, compiled=True)[0],
        "fl bf16mix": lambda: flux(ac=None, mixed=True)[0],
    }
    if memory:
        makers["mlx.nn"] = lambda: mlx_nn(False)
        return makers
    makers["mlx hand"] = mlx_hand
    makers["mlx.nn"] = lambda: mlx_nn(False)
    makers["mlx.nn compiled"] = lambda: mlx_nn(True)
    if torch is not None:
        def torch_step(dtype):
            tm = M.torch_model(spec, ws).train()
            tx, tl = M.torch_input(x_np), torch.from_numpy(labels_np.astype(np.int64))
            opt = torch.optim.Adam(tm.parameters(), lr=1e-3)

            def step():
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                    loss = F.cross_entropy(tm(tx), tl)
                loss.backward()
                opt.step()

            return step

        makers["torch f32"] = lambda: torch_step(None)
        makers["torch bf16"] = lambda: torch_step(torch.bfloat16)
    return makers


# ------------------------------------------------------------------ sections


def baseline_name(columns: list[str]) -> str:
    return "torch f32" if "torch f32" in columns else "fl f32"


def print_table(title: str, rows: list[tuple[str, dict[str, str]]], columns: list[str],
                note: str) -> None:
    widths = [max(6, len(c)) + 2 for c in columns]
    label = max(5, *(len(r[0]) for r in rows))
    print(f"\n## {title}\n")
    print(f"{'model':<{label}}" + "".join(
        f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for name, cells in rows:
        print(f"{name:<{label}}" + "".join(
            f"{cells.get(c, '-'):>{w}}" for c, w in zip(columns, widths, strict=True)))
    print(note)


def ratio_rows(results: dict[str, dict[str, float]]) -> tuple[list, list[str], str]:
    columns = list(next(iter(results.values())))
    base = baseline_name(columns)
    rows = []
    for model, times in results.items():
        cells = {c: f"{times[c] / times[base]:.2f}" for c in columns}
        cells[f"{base} ms"] = f"{times[base] * 1e3:.3g}"
        rows.append((model, cells))
    note = f"(ratios to {base}: lower is faster; last column: {base} in ms per call)"
    return rows, [*columns, f"{base} ms"], note


def check_outputs(name: str, outputs: dict[str, Callable]) -> None:
    """Warn when a variant does not compute the same function as fluxlike float32."""
    ref = outputs["fl f32"]()
    scale = float(np.abs(ref).max()) or 1.0
    worst = []
    for variant, f in outputs.items():
        err = float(np.abs(f() - ref).max()) / scale
        limit = 0.1 if ("bf16" in variant or "autocast" in variant) else 1e-3
        worst.append(f"{variant} {err:.0e}")
        if not err <= limit:
            print(f"WARNING: {name}: {variant} differs from fl f32 by {err:.3g} (relative)")
    print(f"  {name}: outputs agree with fl f32 (max error / max |output|): " + ", ".join(worst))


def section_inference(models: list[str], timer: Timer) -> dict:
    print("\n# Inference: one forward pass, batch as in the model's name")
    results = {}
    for name in models:
        spec = M.SPECS[name]
        timed, outputs = inference_variants(spec)
        check_outputs(name, outputs)
        results[spec.name] = timer.run(timed)
        del timed, outputs
        gc.collect()
    rows, columns, note = ratio_rows(results)
    print_table("Inference (per forward pass)", rows, columns, note)
    return results


def section_training(models: list[str], timer: Timer) -> dict:
    print("\n# Training: one step = forward + backward + Adam update")
    results = {}
    for name in models:
        spec = M.SPECS[name]
        steps = {variant: make() for variant, make in training_variants(spec).items()}
        results[spec.name] = timer.run(steps)
        del steps
        gc.collect()
    rows, columns, note = ratio_rows(results)
    print_table("Training step (forward + backward + Adam)", rows, columns, note)
    return results


def section_memory(models: list[str]) -> dict:
    print("\n# Memory: mx.get_peak_memory() over one training step, each variant built alone")
    results: dict[str, dict[str, float]] = {}
    rows = []
    for name in models:
        spec = M.SPECS[name]
        peaks = {}
        for variant, make in training_variants(spec, memory=True).items():
            gc.collect()
            mx.clear_cache()
            step = make()
            mx.reset_peak_memory()
            step()  # the first step: optimiser state exists already (set up before)
            peaks[variant] = mx.get_peak_memory()
            del step
        results[name] = peaks
        base = peaks["fl f32"]
        cells = {v: f"{p / base:.2f}" for v, p in peaks.items()}
        cells["fl f32 MiB"] = f"{base / 2**20:.1f}"
        rows.append((name, cells))
    columns = [*next(iter(results.values())), "fl f32 MiB"]
    print_table("Peak memory of a training step", rows, columns,
                "(ratios to fl f32 eager; peak includes parameters, Adam state and the batch)")
    return results


# ------------------------------------------------------------------ header and summary


def blas_lines() -> list[str]:
    info = getattr(fluxlike, "blas_info", None)
    lines = [f"fluxlike.blas_info(): {info()}" if callable(info)
             else "fluxlike.blas_info(): not available"]
    if sys.platform == "linux":
        with open("/proc/self/maps") as maps:
            libs = sorted({line.split()[-1] for line in maps if "/" in line and any(
                key in line.rsplit("/", 1)[-1].lower() for key in ("blas", "mkl", "lapack"))})
        lines.append("BLAS-like libraries mapped: " + (", ".join(libs) or "none"))
    n, rates = 512, []
    a = mx.random.normal((n, n))
    for dtype in (mx.float32, BF16):
        b = a.astype(dtype)
        mx.eval(b @ b)
        start = time.perf_counter()
        for _ in range(2):
            mx.eval(b @ b)
        rate = 2 * 2 * n**3 / (time.perf_counter() - start) / 1e9
        rates.append(f"{str(dtype).rpartition('.')[2]} {rate:.0f} GFLOP/s")
    lines.append(f"MLX {n}x{n} GEMM: " + ", ".join(rates)
                 + " (reference BLAS: ~5; OpenBLAS float32: ~200 on a quiet machine)")
    return lines


class OtherLoad:
    """How many cores other processes kept busy while a section ran (from ``/proc/stat``
    less this process's own CPU time): a PyTorch step with two OpenMP threads slows down
    tenfold when another process holds one of two cores, so the figure says how far to
    trust a table."""

    def __init__(self):
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle and iowait
        own = os.times()
        return busy, own.user + own.system, time.perf_counter()

    def report(self) -> str:
        end = self._read()
        if self.start is None or end is None or end[2] <= self.start[2]:
            return "other processes' CPU use: unknown"
        other = max(0.0, (end[0] - self.start[0]) - (end[1] - self.start[1]))
        cores = other / (end[2] - self.start[2])
        return f"other processes kept {cores:.2f} of {os.cpu_count()} cores busy meanwhile"


def load_average() -> str:
    """The 1-minute load average (other processes competing for the cores skew timings)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def fluxlike_version() -> str:
    try:
        return importlib.metadata.version("fluxlike")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def header(args: argparse.Namespace) -> None:
    print("# fluxlike CPU benchmark")
    print(f"command: {' '.join([os.path.relpath(sys.executable), *sys.argv])}")
    print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs; "
          f"python {platform.python_version()}; load average {load_average()}")
    print(f"mlx {mx.__version__} (device {mx.default_device()}); "
          f"fluxlike {fluxlike_version()}")
    if torch is None:
        print("torch: not installed (or --no-torch): PyTorch columns skipped, ratios are to "
              "fluxlike f32 (install: .venv/bin/pip install torch==2.13.0)")
    else:
        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        chosen = "set by --torch-threads" if args.torch_threads else "its default"
        print(f"torch {torch.__version__}: {torch.get_num_threads()} threads ({chosen}); "
              f"imported before fluxlike, so it keeps its own BLAS")
    for line in blas_lines():
        print(line)
    ops = getattr(sys.modules.get("fluxlike.precision.ops"), "__file__", "")
    routed = "custom_function" in open(ops).read() if ops else False
    print(f"fluxlike.precision.ops routes CPU half precision through float32 kernels "
          f"(custom_function present): {routed}")
    print("Variants: fl = fluxlike (Chain of Dense/Conv/MaxPool); autocast = "
          "`with autocast(mx.bfloat16)`; bf16mix = bf16mix(model); mlx hand = plain mx ops; "
          "torch bf16 = torch.autocast('cpu', dtype=torch.bfloat16)")


def summary(inference: dict, training: dict, memory: dict) -> None:
    print("\n## Acceptance targets")
    lines = []
    for label, results in (("inference", inference), ("training", training)):
        for model in ("seed", "large"):
            t = results.get(model)
            if t and "torch f32" in t:
                r = t["fl f32"] / t["torch f32"]
                lines.append((f"(1) {label} {model}: fl f32 / torch f32", r, 1.1))
        for model, t in results.items():
            r = t["fl autocast"] / t["fl f32"]
            lines.append((f"(2) {label} {model}: fl autocast / fl f32", r, 1.3))
    if "act" in memory:
        m = memory["act"]
        lines.append(("(3) memory act: fl autocast / fl f32 peak", m["fl autocast"] / m["fl f32"],
                      0.7))
    for text, r, target in lines:
        verdict = "ok" if r <= target else "MISSED"
        print(f"{text:<48} {r:6.2f}  (target <= {target})  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (a smoke run)")
    parser.add_argument("--only", choices=SECTIONS, help="run one section")
    parser.add_argument("--models", help="comma-separated subset of " + ",".join(M.SPECS))
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch.set_num_threads(N) (default: PyTorch's own choice)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch even if installed")
    args = parser.parse_args()
    chosen = args.models.split(",") if args.models else None
    for name in chosen or []:
        if name not in M.SPECS:
            parser.error(f"--models: unknown model {name!r}; choose from {', '.join(M.SPECS)}")
    header(args)
    timer = Timer(args.quick)
    sections = [args.only] if args.only else list(SECTIONS)
    results: dict[str, dict] = {s: {} for s in SECTIONS}
    began, whole = time.perf_counter(), OtherLoad()
    for section in sections:
        models = [m for m in DEFAULT_MODELS[section] if chosen is None or m in chosen]
        if not models:
            continue
        meter = OtherLoad()
        if section == "inference":
            results[section] = section_inference(models, timer)
        elif section == "training":
            results[section] = section_training(models, timer)
        else:
            results[section] = section_memory(models)
        print(f"({section}: {meter.report()})")
    summary(results["inference"], results["training"], results["memory"])
    print(f"\n(total {time.perf_counter() - began:.0f} s; {whole.report()}; "
          f"load average at the end: {load_average()})")


if __name__ == "__main__":
    main()
