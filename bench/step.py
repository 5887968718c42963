"""Per-step overhead of ``train`` and ``trainstep`` against the loop a user writes in plain MLX.

Same model, rule, data and step count; the plain loop is ``nn.value_and_grad`` +
``mlx.optimizers`` + ``mx.eval(model.parameters(), optimizer.state, loss)`` + ``loss.item()``
each step (its compiled form: the step ``mx.compile``-d with the model and optimiser state
captured). Variants are interleaved in one process (a new order each pass) and the best pass of
each is kept; the table prints ratios to the row's reference. Time is the process's CPU time
(``--clock cpu``, the default: all its threads, MLX's stream and OpenMP's included), which a
busy shared machine disturbs far less than the wall clock; ``--clock wall`` for that.

- ``tiny``: Dense(10 => 10), mse, Descent(0.1) and Adam(1e-3) (Flux's own ``train!`` test);
- ``mlp``: Dense 32-64-64-10 (relu), logitcrossentropy, Adam(1e-3), batch 32: eager and
  compiled; and ``autocast=mx.bfloat16`` against its own float32 step.

    .venv/bin/python bench/step.py [--steps 1500] [--passes 10] [--quick]
"""

from __future__ import annotations

import argparse
import platform
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

import fluxlike as fl
from fluxlike.losses import logitcrossentropy


def cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = re.search(r"model name\s*:\s*(.*)", info)
    flags = sorted(set(re.findall(r"\b(amx_bf16|avx512_bf16|avx512_fp16)\b", info)))
    return f"{name.group(1) if name else 'unknown'} [{' '.join(flags) or 'no bf16 flags'}]"


def _mse(m: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    return ((m(x) - y) ** 2).mean()


def _xent(m: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    return logitcrossentropy(m(x), y)


def _model(kind: str) -> nn.Module:
    mx.random.seed(0)
    if kind == "tiny":
        return fl.Dense(10, 10)
    return fl.Chain(fl.Dense(32, 64, fl.relu), fl.Dense(64, 64, fl.relu), fl.Dense(64, 10))


def _data(kind: str) -> tuple[mx.array, mx.array]:
    mx.random.seed(1)
    if kind == "tiny":
        x = mx.random.normal((10, 10))
        return x, mx.random.normal((10, 10))
    x = mx.random.normal((32, 32))
    return x, mx.eye(10)[mx.random.randint(0, 10, (32,))]


def _mlx_rule(rule: str) -> optim.Optimizer:
    return optim.SGD(0.1) if rule == "Descent" else optim.Adam(1e-3, bias_correction=True)


def _fl_rule(rule: str) -> fl.optimisers.rules.Rule:  # type: ignore[name-defined]
    return fl.Descent(0.1) if rule == "Descent" else fl.Adam(1e-3)


def plain(kind: str, rule: str, compiled: bool) -> Callable[[int], None]:
    """The loop a user writes in plain MLX."""
    model, (x, y) = _model(kind), _data(kind)
    opt = _mlx_rule(rule)
    loss_fn = _mse if kind == "tiny" else _xent
    grad_fn = nn.value_and_grad(model, loss_fn)

    def step(x: mx.array, y: mx.array) -> mx.array:
        loss, grads = grad_fn(model, x, y)
        opt.update(model, grads)
        return loss

    if compiled:
        state = [model.state, opt.state]
        step = mx.compile(step, inputs=state, outputs=state)

    def run(n: int) -> None:
        for _ in range(n):
            loss = step(x, y)
            mx.eval(loss, model.parameters(), opt.state)
            loss.item()

    return run


def ours(kind: str, rule: str, how: str, compiled: bool,
         autocast: mx.Dtype | None = None) -> Callable[[int], None]:
    """fluxlike: ``train`` over a list of one batch repeated, or ``trainstep`` in a loop."""
    model, (x, y) = _model(kind), _data(kind)
    opt_state = fl.setup(_fl_rule(rule), model)
    loss_fn = _mse if kind == "tiny" else _xent
    if how == "train":
        def run(n: int) -> None:
            fl.train(loss_fn, model, [(x, y)] * n, opt_state, autocast=autocast,
                     progress=False, compile=compiled)
    else:
        def run(n: int) -> None:
            for _ in range(n):
                fl.trainstep(loss_fn, model, (x, y), opt_state, autocast=autocast,
                             compile=compiled)
    return run


def measure(variants: dict[str, Callable[[int], None]], steps: int, passes: int,
            clock: Callable[[], float]) -> dict:
    for run in variants.values():  # warm: traces, kernels, buffers
        run(max(steps // 10, 20))
    best = {name: float("inf") for name in variants}
    names = list(variants)
    for _ in range(passes):
        random.shuffle(names)
        for name in names:
            start = clock()
            variants[name](steps)
            best[name] = min(best[name], (clock() - start) / steps)
    return best


ROWS = [  # (label, reference variant, variant, target)
    ("tiny Descent eager", "plain tiny Descent", "train tiny Descent", 1.10),
    ("", "plain tiny Descent", "trainstep tiny Descent", 1.10),
    ("tiny Adam eager", "plain tiny Adam", "train tiny Adam", 1.10),
    ("", "plain tiny Adam", "trainstep tiny Adam", 1.10),
    ("mlp Adam eager", "plain mlp", "train mlp", 1.05),
    ("", "plain mlp", "trainstep mlp", 1.05),
    ("mlp Adam compiled", "plain mlp compiled", "train mlp compiled", 1.05),
    ("", "plain mlp compiled", "trainstep mlp compiled", 1.05),
    ("mlp bf16 / own f32 (eager)", "train mlp", "train mlp bf16", 1.15),
    ("mlp bf16 / own f32 (compiled)", "train mlp compiled", "train mlp compiled bf16", 1.15),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="100 steps, 2 passes")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    steps, passes = (100, 2) if args.quick else (args.steps, args.passes)
    variants: dict[str, Callable[[int], None]] = {}
    for rule in ("Descent", "Adam"):
        variants[f"plain tiny {rule}"] = plain("tiny", rule, False)
        variants[f"train tiny {rule}"] = ours("tiny", rule, "train", False)
        variants[f"trainstep tiny {rule}"] = ours("tiny", rule, "trainstep", False)
    for compiled in (False, True):
        tag = " compiled" if compiled else ""
        variants[f"plain mlp{tag}"] = plain("mlp", "Adam", compiled)
        variants[f"train mlp{tag}"] = ours("mlp", "Adam", "train", compiled)
        variants[f"trainstep mlp{tag}"] = ours("mlp", "Adam", "trainstep", compiled)
        variants[f"train mlp{tag} bf16"] = ours("mlp", "Adam", "train", compiled, mx.bfloat16)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    best = measure(variants, steps, passes, clock)
    print(f"# per-step overhead: {cpu()}; MLX {mx.__version__}, native kernels "
          f"{'on' if fl.native.available() else 'off'}")
    print(f"# best of {passes} interleaved passes of {steps} steps, {args.clock} time\n")
    print(f"{'case':<31} {'variant':<26} {'us/step':>8} {'ratio':>6} {'target':>7}")
    for label, ref, name, target in ROWS:
        ratio = best[name] / best[ref]
        mark = "ok" if ratio <= target else "OVER"
        print(f"{label:<31} {name:<26} {best[name] * 1e6:8.1f} {ratio:6.2f} "
              f"{'<=' + format(target, '.2f'):>7} {mark}")
    print("\nreferences (us/step): " + ", ".join(
        f"{r} {best[r] * 1e6:.1f}" for r in dict.fromkeys(ref for _, ref, _, _ in ROWS)))


if __name__ == "__main__":
    main()
