"""The native kernels' OpenMP wait policy, on a quiet machine and beside busy processes.

oneDNN runs on libgomp's OpenMP threads. After each parallel region a libgomp thread spins
before it sleeps (``GOMP_SPINCOUNT`` iterations; 300,000 by default, a few milliseconds), so
that the next kernel finds it awake. Beside other busy processes that spinning takes a core
they (and MLX's own threads) need, and a descheduled team member stalls a whole kernel. The
policy is read once, when libgomp loads, so each variant runs in a process of its own:

- ``default``: fluxlike's own (no variable set: fluxlike sets ``OMP_WAIT_POLICY=PASSIVE``
  while it loads the companion, ``fluxlike/native/_loader.py``);
- ``libgomp``: libgomp's own policy (``GOMP_SPINCOUNT=300000``, its default spin, which
  keeps fluxlike from setting a policy);
- ``spin N``: ``GOMP_SPINCOUNT=N``;
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once), set by hand: the same policy as
  ``default`` (their difference is the machine's noise);
- ``off``: ``FLUXLIKE_NATIVE=0`` (MLX's kernels, and OpenBLAS's threads).

Each process times training steps of each model (median ms of a step, after warm-up); the
variants alternate within each round, and ``--busy K`` runs the whole comparison again beside
``K`` processes that spin in pure Python for its duration. The table gives each variant's
median step time and its ratio to ``default`` in the same condition.

    .venv/bin/python bench/threads.py [--busy 0 1] [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import processor

HERE = Path(__file__).resolve().parent
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "libgomp": {"GOMP_SPINCOUNT": "300000"},  # (libgomp's own: fluxlike then sets nothing)
    "spin 10000": {"GOMP_SPINCOUNT": "10000"},
    "spin 1000": {"GOMP_SPINCOUNT": "1000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "1 thread passive": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"},
    "off": {"FLUXLIKE_NATIVE": "0"},
}
MODELS = ("seed", "cnn", "lm")  # and "lm512" (width 512, 4 blocks, 4 x 128 tokens) on request
OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "FLUXLIKE_NATIVE",
            "FLUXLIKE_OMP")

CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, {here!r})
import mlx.core as mx
import fluxlike as fl
from fluxlike.losses import logitcrossentropy
from specs import SPECS, data, onehot, weights
from models import fluxlike_model

def lm(d=128, heads=4, vocab=96, context=64, batch=32, blocks=2):
    # a transformer LM of fluxlike's layers, pre-norm blocks: charlm-sized by default

    class Block(fl.Layer):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = fl.LayerNorm(d), fl.LayerNorm(d)
            self.attention = fl.MultiHeadAttention(d, heads)
            self.mlp = fl.Chain(fl.Dense(d, 4 * d, fl.gelu), fl.Dense(4 * d, d))

        def __call__(self, x):
            x = x + self.attention(self.norm1(x), mask="causal")
            return x + self.mlp(self.norm2(x))

    model = fl.Chain(fl.Embedding(vocab, d), *(Block() for _ in range(blocks)),
                     fl.LayerNorm(d), fl.Dense(d, vocab))
    tokens = mx.random.randint(0, vocab, (batch, context + 1))
    return model, (tokens[:, :-1], tokens[:, 1:])

def build(name):
    if name == "lm":
        return lm()
    if name == "lm512":  # mid-sized products: 512 rows of width 512 (and 2048)
        return lm(d=512, heads=8, vocab=4096, context=128, batch=4, blocks=4)
    spec = SPECS[name]
    x, labels = data(spec)
    y = mx.array(onehot(labels, spec.classes))
    return fluxlike_model(spec, weights(spec)), (mx.array(x), y)

out = {{}}
for name in {models!r}:
    for ac in (None, mx.bfloat16):
        model, batch = build(name)
        opt = fl.setup(fl.Adam(1e-3), model)
        def step():
            loss, grads = fl.withgradient(lambda m, x, y: logitcrossentropy(m(x), y), model,
                                          *batch, autocast=ac)
            fl.update(opt, model, grads[0])
            mx.eval(loss, model.parameters())
        for _ in range(5):
            step()
        times = []
        for _ in range({steps}):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        out[f"{{name}} {{'bf16' if ac else 'f32'}}"] = 1e3 * statistics.median(times)
print(json.dumps(out))
"""


def run_variant(env_changes: dict[str, str], models: tuple[str, ...], steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OMP_KEYS}
    env.update(env_changes)
    code = CHILD.format(here=str(HERE), models=models, steps=steps)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1],
                        help="numbers of busy processes to compare beside (default: 0 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    models = tuple(args.models.split(","))
    unknown = [n for n in args.variants.split(",") if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; the variants are {list(VARIANTS)}")
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    print(f"processor: {processor()}; {args.rounds} rounds of {args.steps} steps")
    for busy in args.busy:
        samples: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
        procs = spinners(busy)
        try:
            time.sleep(1.0)
            names = list(variants)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    for key, ms in run_variant(variants[name], models, args.steps).items():
                        samples[name].setdefault(key, []).append(ms)
                    time.sleep(0.5)  # let the last process's threads settle
        finally:
            for p in procs:
                p.kill()
        rows = list(next(iter(samples.values())))
        print(f"\nbusy processes: {busy} (median step ms, ratio to default)\n")
        print("| step | " + " | ".join(variants) + " |")
        print("|---|" + "---|" * len(variants))
        for row in rows:
            base = statistics.median(samples["default"][row]) if "default" in samples else None
            cells = []
            for name in variants:
                ms = statistics.median(samples[name][row])
                ratio = f" ({ms / base:.2f})" if base else ""
                cells.append(f"{ms:.2f}{ratio}")
            print(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
