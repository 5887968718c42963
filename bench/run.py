"""fluxlike against hand-written MLX, mlx.nn and PyTorch on this machine's CPU, side by side.

    .venv/bin/python bench/run.py [--quick] [--only inference|training|memory]
                                  [--models seed,large,cnn,act,lm] [--torch PYTHON]

Three tables, each with the variants interleaved (round-robin over the variants for every
repetition, in a new random order each round, medians kept), after a warm-up:

1. inference: one forward pass (``mx.eval`` of the output inside the timed region);
2. training: one full step, forward + backward + Adam update (``mx.eval`` of the loss, the
   parameters and the optimiser state inside the timed region);
3. memory: ``mx.get_peak_memory()`` of one training step (MLX variants only).

PyTorch runs in a process of its own (``bench/torch_worker.py``, started once per run; this
process never imports torch): MLX in the same process changes what PyTorch pays (BLAS symbols,
page faults after MLX's buffer cache grew). The interleaving is kept across the two: at a
PyTorch variant's turn in a round, the worker is asked for one sample (its untimed settle call,
then the timed calls, measured inside the worker so that the pipe's latency is not counted).

Native kernels: with fluxlike-native installed, ``fl f32`` and ``fl autocast`` take its oneDNN
kernels where fluxlike routes them (``fluxlike.native``); the ``-native`` variants are the same
with the native kernels switched off in this process (as ``FLUXLIKE_NATIVE=0`` would), and a
line under each model says which native kernels each variant ran (counted on one untimed call).
``lm`` is a transformer language model of stock ``mlx.nn`` layers, timed in training.

Times are ratios to PyTorch float32 (to fluxlike float32 when PyTorch is not installed); the
baseline's absolute milliseconds are in the last column. PyTorch runs with its default
thread count (printed in the header), MLX with whatever it uses. Absolute numbers are noise on
a shared machine; the ratios measured side by side are the figures to keep.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import models as M
import numpy as np
import torch_worker as TW
from machine import processor

import fluxlike
from fluxlike import autocast, bf16mix, native, setup, update, withgradient
from fluxlike.precision import kernels

BF16 = mx.bfloat16
SECTIONS = ("inference", "training", "memory")
DEFAULT_MODELS = {"inference": ["seed", "large", "cnn"],
                  "training": ["seed", "large", "cnn", "lm"],
                  "memory": ["seed", "large", "cnn", "act"]}
MODELS = [*M.SPECS, M.LM.name]


# ------------------------------------------------------------------ native kernels

def without_native(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with fluxlike's native kernels switched off while it builds its graph
    (:func:`fluxlike.native.disabled`: what ``FLUXLIKE_NATIVE=0`` does for a whole process),
    so every routing decision takes MLX's kernels."""

    def run() -> object:
        with native.disabled():
            return fn()

    return run


def kernels_used(fn: Callable[[], object]) -> str:
    """Which of ``fluxlike.native``'s kernels one call of ``fn`` ran, by kernel and operand
    dtype, e.g. ``linear bf16 x4`` (the routing's choices, :func:`fluxlike.precision.kernels.
    choose`, and the everyday float32 layer call's C++ entry); ``MLX`` when none."""
    if not native.available():
        return "MLX"
    seen: dict[str, int] = {}

    def count(op: str, dtype: object) -> None:
        key = f"{op} {str(dtype).rpartition('.')[2].replace('bfloat16', 'bf16')}"
        seen[key] = seen.get(key, 0) + 1

    choose = kernels.choose

    def counted_choice(op: str, dtype: object, *args: object) -> str:
        backend = choose(op, dtype, *args)  # type: ignore[arg-type]
        if backend == kernels.NATIVE:
            count(op, dtype)
        return backend

    class Entry:  # the companion as the routing sees it, counting the plain float32 entry
        def __init__(self, ext: object):
            self.ext = ext

        def __getattr__(self, name: str) -> object:
            return getattr(self.ext, name)

        def plain_linear(self, x: mx.array, *args: object) -> object:
            y = self.ext.plain_linear(x, *args)  # type: ignore[attr-defined]
            if y is not None:
                count("linear", x.dtype)
            return y

    ext = native.switch.ext
    kernels.choose = counted_choice  # type: ignore[assignment]
    native.switch.ext = Entry(ext)  # type: ignore[assignment]
    try:
        fn()
    finally:
        kernels.choose = choose  # type: ignore[assignment]
        native.switch.ext = ext
    return ", ".join(f"{k} x{n}" for k, n in seen.items()) or "MLX"


def print_kernels(model: str, variants: dict[str, Callable | TW.Remote]) -> None:
    """One untimed call of each local variant (for a compiled one its trace), counting the
    native kernels it runs; printed under the model's name."""
    if not native.available():
        return
    used = {name: kernels_used(fn) for name, fn in variants.items()
            if not isinstance(fn, TW.Remote)}
    print(f"  {model}: native kernels per call: " + "; ".join(
        f"{name}: {what}" for name, what in used.items()))


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

    def run(self, variants: dict[str, Callable[[], object] | TW.Remote]) -> dict[str, float]:
        """The median seconds per call of each variant (a ``Remote`` one is timed in the
        PyTorch process, at its turn)."""
        inner, count = {}, {}
        extra = 1 if self.quick else 2
        for name, fn in variants.items():
            if isinstance(fn, TW.Remote):
                first = fn.warm_up(extra, self.slow_s)
            else:
                first = TW.warm_up(fn, extra, self.slow_s)
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
                # One untimed call first, then k timed ones (TW.sample), in either process.
                if isinstance(fn, TW.Remote):
                    samples[name].append(fn.sample(k))
                else:
                    samples[name].append(TW.sample(fn, k))
        return {name: statistics.median(s) for name, s in samples.items()}


# ------------------------------------------------------------------ variants


def inference_variants(spec: M.Spec, worker: TW.TorchWorker | None
                       ) -> tuple[dict[str, Callable | TW.Remote], dict[str, Callable]]:
    """``(timed, outputs)``: per variant a function running one forward pass to completion
    (a ``Remote`` for the PyTorch ones), and one returning the output as a float32 numpy
    array (for the agreement check)."""
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
    if native.available():
        fns["fl f32 -native"] = without_native(fns["fl f32"])
        fns["fl ac -native"] = without_native(fl_autocast)
    outputs = {name: (lambda f=f: np.array(f().astype(mx.float32))) for name, f in fns.items()}
    timed: dict[str, Callable | TW.Remote] = {
        name: (lambda f=f: mx.eval(f())) for name, f in fns.items()}
    if worker is not None:
        for name, remote in worker.build("inference", spec.name).items():
            timed[name], outputs[name] = remote, remote.output
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
    if native.available():
        makers["fl f32 -native"] = lambda: without_native(flux(ac=None)[0])
        makers["fl ac -native"] = lambda: without_native(flux(ac=BF16)[0])
    if memory:
        makers["mlx.nn"] = lambda: mlx_nn(False)
        return makers
    makers["mlx hand"] = mlx_hand
    makers["mlx.nn"] = lambda: mlx_nn(False)
    makers["mlx.nn compiled"] = lambda: mlx_nn(True)
    return makers


def lm_training_variants() -> dict[str, Callable]:
    """The transformer LM's training step (stock ``mlx.nn`` model, next-token cross entropy,
    Adam(1e-3)): with fluxlike's ``withgradient`` + ``update`` in float32 and under
    ``autocast(mx.bfloat16)`` (and, with the native kernels installed, both without them),
    and plain ``mlx.nn`` (``nn.value_and_grad`` + ``mlx.optimizers``), eager and compiled."""
    tokens_np, targets_np = M.lm_data()
    tokens, targets = mx.array(tokens_np), mx.array(targets_np)

    def model() -> nn.Module:
        mx.random.seed(0)
        lm = M.LanguageModel()
        mx.eval(lm.parameters())
        return lm

    def flux(ac: mx.Dtype | None, compiled: bool = False) -> Callable:
        lm = model()
        opt_state = setup(fluxlike.Adam(1e-3), lm)
        captured = [lm.state, opt_state.optimizer.state]

        def raw(tokens: mx.array, targets: mx.array) -> mx.array:
            loss, grads = withgradient(lambda m: M.lm_loss(m, tokens, targets), lm,
                                       autocast=ac)
            update(opt_state, lm, grads[0])
            return loss

        fn = fluxlike.compile(raw, inputs=captured, outputs=captured) if compiled else raw
        return lambda: mx.eval(fn(tokens, targets), captured)

    def mlx_nn(compiled: bool) -> Callable:
        lm, opt = model(), optim.Adam(1e-3, bias_correction=True)
        opt.init(lm.trainable_parameters())
        value_and_grad = nn.value_and_grad(lm, M.lm_loss)
        state = [lm.state, opt.state]

        def raw(tokens: mx.array, targets: mx.array) -> mx.array:
            loss, grads = value_and_grad(lm, tokens, targets)
            opt.update(lm, grads)
            return loss

        fn = mx.compile(raw, inputs=state, outputs=state) if compiled else raw
        return lambda: mx.eval(fn(tokens, targets), state)

    makers: dict[str, Callable[[], Callable]] = {
        "fl f32": lambda: flux(None),
        "fl compiled": lambda: flux(None, compiled=True),
        "fl autocast": lambda: flux(BF16),
        "fl ac compiled": lambda: flux(BF16, compiled=True),
    }
    if native.available():
        makers["fl f32 -native"] = lambda: without_native(flux(None))
        makers["fl ac -native"] = lambda: without_native(flux(BF16))
    makers["mlx.nn"] = lambda: mlx_nn(False)
    makers["mlx.nn compiled"] = lambda: mlx_nn(True)
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
    columns: list[str] = []
    for times in results.values():  # every model's variants (the LM has fewer)
        columns += [c for c in times if c not in columns]
    base = baseline_name(columns)
    rows = []
    for model, times in results.items():
        cells = {c: f"{times[c] / times[base]:.2f}" for c in columns if c in times}
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
        half = "bf16" in variant or "autocast" in variant or variant.startswith("fl ac")
        limit = 0.1 if half else 1e-3
        worst.append(f"{variant} {err:.0e}")
        if not err <= limit:
            print(f"WARNING: {name}: {variant} differs from fl f32 by {err:.3g} (relative)")
    print(f"  {name}: outputs agree with fl f32 (max error / max |output|): " + ", ".join(worst))


def section_inference(models: list[str], timer: Timer, worker: TW.TorchWorker | None) -> dict:
    print("\n# Inference: one forward pass, batch as in the model's name")
    results = {}
    for name in models:
        spec = M.SPECS[name]
        timed, outputs = inference_variants(spec, worker)
        check_outputs(name, outputs)
        print_kernels(name, timed)
        results[spec.name] = timer.run(timed)
        del timed, outputs
        gc.collect()
    return report("Inference (per forward pass)", results, worker)


def section_training(models: list[str], timer: Timer, worker: TW.TorchWorker | None) -> dict:
    print("\n# Training: one step = forward + backward + Adam update")
    results = {}
    for name in models:
        made = lm_training_variants() if name == M.LM.name else training_variants(M.SPECS[name])
        steps: dict[str, Callable | TW.Remote] = {
            variant: make() for variant, make in made.items()}
        if worker is not None:
            steps.update(worker.build("training", name))
        print_kernels(name, steps)
        results[name] = timer.run(steps)
        del steps
        gc.collect()
    return report("Training step (forward + backward + Adam)", results, worker)


def report(title: str, results: dict, worker: TW.TorchWorker | None) -> dict:
    """Free the PyTorch process's models of a timed section and print its table."""
    if worker is not None:
        worker.clear()
    rows, columns, note = ratio_rows(results)
    print_table(title, rows, columns, note)
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
    less this process's and the PyTorch worker's CPU time): a PyTorch step with two OpenMP
    threads slows down tenfold when another process holds one of two cores, so the figure
    says how far to trust a table."""

    def __init__(self, worker: TW.TorchWorker | None):
        self.worker = worker
        self.start = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle and iowait
        own = os.times()
        ours = own.user + own.system + (self.worker.cpu_seconds() if self.worker else 0.0)
        return busy, ours, time.perf_counter()

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


def start_torch(args: argparse.Namespace, sections: list[str]
                ) -> tuple[TW.TorchWorker | None, str]:
    """The PyTorch worker process (``None`` when it is not wanted or cannot run) and the
    header's line about it."""
    skipped = "PyTorch columns skipped, ratios are to fluxlike f32"
    if args.no_torch:
        return None, f"torch: --no-torch: {skipped}"
    if not {"inference", "training"} & set(sections):
        return None, "torch: not used by the memory section"
    if args.torch is None and importlib.util.find_spec("torch") is None:  # looks only
        return None, (f"torch: not installed: {skipped} (install: .venv/bin/pip install "
                      "torch==2.13.0, or pass --torch PYTHON, a Python that has it)")
    try:
        worker = TW.TorchWorker(args.torch_threads, args.torch)
    except TW.Unavailable as e:
        return None, f"torch: the PyTorch process could not start ({e}): {skipped}"
    chosen = "set by --torch-threads" if args.torch_threads else "its default"
    loaded = ", ".join(worker.loaded) or "no MLX, no fluxlike"
    threads = f"{worker.threads} thread{'s' if worker.threads != 1 else ''}"
    return worker, (f"torch {worker.version}: in a process of its own ({worker.python}, "
                    f"pid {worker.pid}, "
                    f"{threads}, {chosen}; {loaded} loaded there), timed there on request; "
                    "this process does not import torch")


def header(torch_line: str) -> None:
    print("# fluxlike CPU benchmark")
    print(f"command: {' '.join([os.path.relpath(sys.executable), *sys.argv])}")
    print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs; "
          f"python {platform.python_version()}; load average {load_average()}")
    print(f"processor: {processor()}")
    print(f"mlx {mx.__version__} (device {mx.default_device()}); "
          f"fluxlike {fluxlike_version()}")
    print(torch_line)
    for line in blas_lines():
        print(line)
    print(f"fluxlike.native.native_info(): {native.native_info().reason}")
    print("Variants: fl = fluxlike (Chain of Dense/Conv/MaxPool); autocast = "
          "`with autocast(mx.bfloat16)`; bf16mix = bf16mix(model); mlx hand = plain mx ops; "
          "torch bf16 = torch.autocast('cpu', dtype=torch.bfloat16); -native = the variant "
          "with fluxlike's native kernels switched off in-process (as FLUXLIKE_NATIVE=0)")


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
    native_kernel_targets(inference, training)


def native_kernel_targets(inference: dict, training: dict) -> None:
    """The targets set for the native kernels (oneDNN) that these tables give: the large MLP
    against PyTorch (autocast and float32), the seed MLP's and the CNN's float32 steps against
    PyTorch's, and the CNN's and the LM's autocast steps against their own float32 steps."""
    wanted = [  # (text, section, model, variant, baseline, target)
        ("large training: fl autocast / torch bf16", training, "large", "fl autocast",
         "torch bf16", 1.15),
        ("large training: fl autocast / fl f32", training, "large", "fl autocast", "fl f32",
         0.45),
        ("large inference: fl autocast / torch bf16", inference, "large", "fl autocast",
         "torch bf16", 1.15),
        ("large inference: fl f32 / torch f32", inference, "large", "fl f32", "torch f32", 0.8),
        ("large training: fl f32 / torch f32", training, "large", "fl f32", "torch f32", 0.8),
        ("seed training: fl f32 / torch f32", training, "seed", "fl f32", "torch f32", 1.0),
        ("cnn training: fl f32 / torch f32", training, "cnn", "fl f32", "torch f32", 1.5),
        ("cnn training: fl autocast / fl f32", training, "cnn", "fl autocast", "fl f32", 1.0),
        ("lm training: fl autocast / fl f32", training, "lm", "fl autocast", "fl f32", 0.7),
    ]
    found = [(text, times[a] / times[b], target) for text, section, model, a, b, target in wanted
             if (times := section.get(model)) and a in times and b in times]
    if not found:
        return
    print("\n## Native kernel targets")
    for n, (text, r, target) in enumerate(found, 1):
        verdict = "ok" if r <= target else "MISSED"
        print(f"({n}) {text:<44} {r:6.2f}  (target <= {target})  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (a smoke run)")
    parser.add_argument("--only", choices=SECTIONS, help="run one section")
    parser.add_argument("--models", help="comma-separated subset of " + ",".join(M.SPECS))
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch.set_num_threads(N) in the PyTorch process "
                             "(default: PyTorch's own choice)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch even if installed")
    parser.add_argument("--torch", metavar="PYTHON",
                        help="the Python to run PyTorch with (default: this one, if it has torch)")
    args = parser.parse_args()
    chosen = args.models.split(",") if args.models else None
    for name in chosen or []:
        if name not in MODELS:
            parser.error(f"--models: unknown model {name!r}; choose from {', '.join(MODELS)}")
    timer = Timer(args.quick)
    sections = [s for s in ([args.only] if args.only else SECTIONS) if any(
        chosen is None or m in chosen for m in DEFAULT_MODELS[s])]
    worker, torch_line = start_torch(args, sections)
    try:
        header(torch_line)
        results: dict[str, dict] = {s: {} for s in SECTIONS}
        began, whole = time.perf_counter(), OtherLoad(worker)
        for section in sections:
            models = [m for m in DEFAULT_MODELS[section] if chosen is None or m in chosen]
            meter = OtherLoad(worker)
            if section == "inference":
                results[section] = section_inference(models, timer, worker)
            elif section == "training":
                results[section] = section_training(models, timer, worker)
            else:
                results[section] = section_memory(models)
            print(f"({section}: {meter.report()})")
        summary(results["inference"], results["training"], results["memory"])
        print(f"\n(total {time.perf_counter() - began:.0f} s; {whole.report()}; "
              f"load average at the end: {load_average()})")
    finally:
        # End of input ends the worker; had this process died instead, the closed pipe would.
        rc = worker.close() if worker is not None else None
    imported = "yes (unexpected)" if "torch" in sys.modules else "no"
    ended = "" if rc is None else f"; the PyTorch process (pid {worker.pid}) exited with {rc}"
    print(f"(torch imported in this process: {imported}{ended})")


if __name__ == "__main__":
    main()
