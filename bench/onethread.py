"""Which native kernels run on one OpenMP thread: the threshold, quiet and beside busy processes.

The native kernels run on oneDNN's OpenMP team (libgomp, ``OMP_WAIT_POLICY=PASSIVE``: an idle
team member sleeps). A kernel below a threshold of multiply-adds runs on one thread instead
(``fluxlike_native.set_single_thread_macs``): it then wakes no team member, and waits at no
barrier for one that the scheduler has put behind another process. This script measures, in
one process, with the variants interleaved in a new random order every round:

- ``kernels``: single oneDNN matmuls (a linear layer's forward ``x @ w.T`` and its weight
  gradient ``g.T @ x``) and convolutions (the CNN's, forward) from 2**14 to 2**27
  multiply-adds, and the native Adam update of 2**14 to 2**21 elements (counted as 32
  multiply-adds each, as the companion counts them), on the team (threshold 0) and on one
  thread (no threshold);
- ``steps``: training steps (``withgradient`` + Adam ``update``, float32 and
  ``autocast=mx.bfloat16``) of the seed MLP, the small CNN and a charlm-sized transformer
  LM, under each threshold of ``--thresholds`` (``0``: every kernel on the team, ``inf``:
  every kernel on one thread), and with OpenBLAS (MLX's own matmuls) on one thread
  (``blas1``: a variant's name followed by ``+blas1``).

``--busy K`` runs the comparison again beside ``K`` processes that spin in pure Python. The
machine is shared: a sample counts only if the rest of the machine (all CPU time but this
process's) used at most ``K + --slack`` cores while it was taken (``/proc/stat``); otherwise
it is taken again after a pause (``--tries`` times at most, then that round has none). Each
figure is the best, over the rounds, of a round's median (ms); ratios are to the first
variant in the same condition.

    .venv/bin/python bench/onethread.py [--busy 0 1] [--parts kernels,steps] [--rounds 5]
        [--thresholds 0,2**20,2**22,2**24,inf] [--models seed,cnn,lm] [--blas1]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

import fluxlike as fl
from fluxlike import _blas
from fluxlike.losses import logitcrossentropy
from fluxlike.native import _loader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import processor  # noqa: E402
from models import fluxlike_model  # noqa: E402
from specs import SPECS, data, onehot, weights  # noqa: E402

ext = _loader.switch.ext
MODELS = ("seed", "cnn", "lm")


def lm() -> tuple[fl.Chain, tuple[mx.array, mx.array]]:
    """A charlm-sized transformer LM of fluxlike's layers: 2 pre-norm blocks, width 128,
    4 heads, context 64, batch 32, vocabulary 96."""
    d, heads, vocab, context, batch = 128, 4, 96, 64, 32

    class Block(fl.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = fl.LayerNorm(d), fl.LayerNorm(d)
            self.attention = fl.MultiHeadAttention(d, heads)
            self.mlp = fl.Chain(fl.Dense(d, 4 * d, fl.gelu), fl.Dense(4 * d, d))

        def __call__(self, x: mx.array) -> mx.array:
            x = x + self.attention(self.norm1(x), mask="causal")
            return x + self.mlp(self.norm2(x))

    mx.random.seed(0)
    model = fl.Chain(fl.Embedding(vocab, d), Block(), Block(), fl.LayerNorm(d),
                     fl.Dense(d, vocab))
    tokens = mx.random.randint(0, vocab, (batch, context + 1))
    return model, (tokens[:, :-1], tokens[:, 1:])


def build(name: str) -> tuple[fl.Chain, tuple[mx.array, mx.array]]:
    """One of :data:`MODELS` and a batch for it."""
    if name == "lm":
        return lm()
    spec = SPECS[name]
    x, labels = data(spec)
    y = mx.array(onehot(labels, spec.classes))
    return fluxlike_model(spec, weights(spec)), (mx.array(x), y)


def train_step(name: str, autocast: mx.Dtype | None) -> Callable[[], None]:
    """A function that runs one training step of model ``name`` and evaluates it."""
    model, batch = build(name)
    opt = fl.setup(fl.Adam(1e-3), model)

    def step() -> None:
        loss, grads = fl.withgradient(lambda m, x, y: logitcrossentropy(m(x), y), model,
                                      *batch, autocast=autocast)
        fl.update(opt, model, grads[0])
        mx.eval(loss, model.parameters(), opt.state)

    return step


def kernel_cases() -> list[tuple[str, float, Callable[[], None]]]:
    """``(label, multiply-adds, run once)`` for the kernel sweep."""
    cases = []
    for m, k, n in [(16, 32, 32), (32, 64, 64), (64, 64, 128), (64, 128, 128),
                    (128, 128, 128), (128, 128, 256), (128, 256, 256), (256, 256, 256),
                    (256, 256, 512), (512, 256, 512), (2048, 128, 512), (2048, 512, 128)]:
        x, w, g = (mx.random.normal(s) for s in ((m, k), (n, k), (m, n)))
        mx.eval(x, w, g)

        def fwd(x: mx.array = x, w: mx.array = w) -> None:
            mx.eval(ext.matmul(x, w, None, False, True, False, None, False, False))

        def dw(g: mx.array = g, x: mx.array = x) -> None:
            mx.eval(ext.matmul(g, x, None, True, False, False, None, False, False))

        cases.append((f"linear {m}x{k}->{n}", float(m * k * n), fwd))
        cases.append((f"  dW {n}x{m}@{m}x{k}", float(m * k * n), dw))
    for batch, size, cin, cout in [(64, 28, 1, 16), (64, 14, 16, 32), (16, 14, 16, 32)]:
        x = mx.random.normal((batch, size, size, cin))
        w = mx.random.normal((cout, 3, 3, cin))
        mx.eval(x, w)

        def conv(x: mx.array = x, w: mx.array = w) -> None:
            mx.eval(ext.conv(x, w, None, [1, 1], [1, 1], [1, 1], [1, 1], 1, False))

        cases.append((f"conv {batch}x{size}x{size}x{cin}->{cout}",
                      float(batch * size * size * 9 * cin * cout), conv))
    for n in (2**14, 2**15, 2**16, 2**17, 2**18, 2**19, 2**20, 2**21):
        p, g, m, v = (mx.random.normal((n,)) for _ in range(4))
        c = mx.array(0.5)
        mx.eval(p, g, m, v, c)

        def adam(p: mx.array = p, g: mx.array = g, m: mx.array = m, v: mx.array = v,
                 c: mx.array = c) -> None:
            mx.eval(*ext.adam_step(p, g, m, v, c, c, None, 0.9, 0.999, 1e-8))

        cases.append((f"adam 2^{int(math.log2(n))} elements", float(n * 32), adam))
    return cases


class Load:
    """CPU time used by the rest of the machine (all but this process), in cores."""

    tick = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def snapshot() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            cpu = [int(v) for v in f.readline().split()[1:]]
        busy = sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        return busy, int(own[11]) + int(own[12]), time.perf_counter()

    @classmethod
    def others(cls, a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
        return (b[0] - a[0] - (b[1] - a[1])) / cls.tick / max(b[2] - a[2], 1e-3)


class Sampler:
    """Times a function where the rest of the machine stays within ``busy + slack`` cores."""

    def __init__(self, busy: int, slack: float, tries: int) -> None:
        self.limit, self.tries = busy + slack, tries
        self.kept = self.dropped = 0
        self.seen: list[float] = []

    def __call__(self, fn: Callable[[], None], reps: int) -> float | None:
        for _ in range(self.tries):
            before = Load.snapshot()
            ms = timed(fn, reps)
            self.seen.append(Load.others(before, Load.snapshot()))
            if self.seen[-1] <= self.limit:
                self.kept += 1
                return ms
            self.dropped += 1
            time.sleep(0.5)
        return None


def timed(fn: Callable[[], None], reps: int, least: float = 0.2) -> float:
    """Median ms of ``fn``'s calls after two warm-up calls: ``reps`` calls, and more until
    ``least`` seconds have passed (the load is read in clock ticks of 10 ms)."""
    fn()
    fn()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < reps or time.perf_counter() - began < least:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


class Blas:
    """OpenBLAS's thread count, where fluxlike put OpenBLAS under MLX."""

    def __init__(self) -> None:
        self.lib = None
        path = _blas.blas_info().loaded
        if path and "openblas" in path.lower():
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            if hasattr(lib, "openblas_set_num_threads"):
                self.lib = lib
                self.default = lib.openblas_get_num_threads()

    def threads(self, n: int | None) -> None:
        if self.lib is not None:
            self.lib.openblas_set_num_threads(self.default if n is None else n)


def parse_threshold(text: str) -> float:
    return math.inf if text == "inf" else float(eval(text, {}))  # "2**20"


def spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def table(title: str, rows: dict[str, dict[str, float]], names: list[str],
          extra: dict[str, str] | None = None) -> None:
    print(f"\n{title}\n")
    head = "| " + (" | ".join(["", *(extra and ["multiply-adds"] or []), *names])) + " |"
    print(head)
    print("|---" * (len(names) + 1 + bool(extra)) + "|")
    for row, cells in rows.items():
        base = cells.get(names[0])
        out = ["-" if n not in cells else f"{cells[n]:.3f}" + (
            f" ({cells[n] / base:.2f})" if base and n != names[0] else "") for n in names]
        print("| " + " | ".join([row, *([extra[row]] if extra else []), *out]) + " |")


def run_kernels(sample: Sampler, rounds: int, reps: int) -> None:
    cases = kernel_cases()
    variants = {"team": 0.0, "one thread": math.inf}
    best: dict[str, dict[str, float]] = {label: {} for label, _, _ in cases}
    for _ in range(rounds):
        for name in random.sample(list(variants), len(variants)):
            ext.set_single_thread_macs(variants[name])
            for label, _, fn in cases:
                ms = sample(fn, reps)
                if ms is not None:
                    best[label][name] = min(best[label].get(name, math.inf), ms)
    macs = {label: f"2^{math.log2(m):.1f}" for label, m, _ in cases}
    table("kernels (ms, best round's median; ratio to the team)", best, list(variants), macs)


def run_steps(sample: Sampler, rounds: int, steps: int, thresholds: list[str], models: list[str],
              blas1: bool) -> None:
    blas = Blas()
    variants = [(t, None) for t in thresholds]
    if blas1 and blas.lib is not None:
        variants += [(t, 1) for t in thresholds]
    names = [t + ("+blas1" if b else "") for t, b in variants]
    fns = {f"{m} {'bf16' if ac else 'f32'}": train_step(m, ac)
           for m in models for ac in (None, mx.bfloat16)}
    best: dict[str, dict[str, float]] = {row: {} for row in fns}
    for _ in range(rounds):
        for i in random.sample(range(len(variants)), len(variants)):
            threshold, blas_threads = variants[i]
            ext.set_single_thread_macs(parse_threshold(threshold))
            blas.threads(blas_threads)
            for row, fn in fns.items():
                ms = sample(fn, steps)
                if ms is not None:
                    best[row][names[i]] = min(best[row].get(names[i], math.inf), ms)
    blas.threads(None)
    table("training steps (ms, best round's median; ratio to the first variant)", best,
          names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--parts", default="kernels,steps")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30, help="calls timed per kernel and round")
    parser.add_argument("--steps", type=int, default=10, help="steps timed per model and round")
    parser.add_argument("--thresholds", default="0,2**20,2**22,2**24,inf")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--slack", type=float, default=0.3,
                        help="cores the rest of the machine may use beyond --busy (0.3)")
    parser.add_argument("--tries", type=int, default=4)
    parser.add_argument("--blas1", action="store_true",
                        help="also each threshold with OpenBLAS on one thread")
    args = parser.parse_args()
    if ext is None:
        sys.exit(f"the native kernels are not in use: {_loader.switch.info.reason}")
    print(f"processor: {processor()}; oneDNN ISA {ext.cpu_isa()}; MLX {mx.__version__}; "
          f"BLAS {_blas.blas_info().path}")
    default = ext.single_thread_macs()
    try:
        for busy in args.busy:
            procs = spinners(busy)
            try:
                time.sleep(1.0)
                print(f"\n## beside {busy} busy processes (load average at start "
                      f"{Path('/proc/loadavg').read_text().split()[0]})")
                sample = Sampler(busy, args.slack, args.tries)
                if "kernels" in args.parts:
                    run_kernels(sample, args.rounds, args.reps)
                if "steps" in args.parts:
                    run_steps(sample, args.rounds, args.steps, args.thresholds.split(","),
                              args.models.split(","), args.blas1)
                print(f"\n(samples kept {sample.kept}, taken again {sample.dropped}: the rest "
                      f"of the machine above {busy} + {args.slack} cores; it used "
                      f"{min(sample.seen):.2f}-{max(sample.seen):.2f})")
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            time.sleep(1.0)
    finally:
        ext.set_single_thread_macs(default)


if __name__ == "__main__":
    main()
