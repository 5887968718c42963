"""The Adam update alone: fluxlike's (the native kernel), MLX's compiled and eager updates, and
PyTorch's three CPU implementations, on the parameters of the benchmark MLPs.

Each variant updates its own copy of the model's parameters with fixed gradients, Adam(1e-3)
with bias correction; one sample is ``calls`` updates each followed by ``mx.eval`` of the
parameters and the moments (PyTorch: ``opt.step()``). The MLX variants are interleaved in
this process (a new order each round) and their medians kept; PyTorch runs in a process of
its own (as in ``bench/run.py``), its single-tensor loop (its CPU default), ``foreach=True``
and ``fused=True``, at the same sizes.

- ``fl update``: ``fluxlike.update`` with ``fluxlike.Adam``: on the CPU the native kernel
  (``fluxlike.native.adam_kernel``) for float32 and bfloat16 parameters;
- ``fl -native``: the same with the kernel switched off: MLX's fused kernels, as ``update``
  compiles the step;
- ``mlx eager``: ``mlx.optimizers.Adam(bias_correction=True).update`` (about ten ops per
  parameter);
- ``fl bf16``: ``fluxlike.update`` on a bfloat16 copy of the model (``bf16mix``'s parameters
  and moments), the kernel's bfloat16 pass; ``fl bf16 -native`` MLX's;
- ``fl rmsprop`` / ``fl rmsprop -native``: ``fluxlike.RMSProp(1e-3)`` with its kernel and
  with MLX's compiled update (PyTorch's RMSprop is not timed).

``--split`` also times the large MLP's whole training step (``bench/run.py``'s ``fl f32`` and
``fl autocast``) against its forward + backward alone (``withgradient``), interleaved: what the
update's share of the step is, float32 and under ``autocast(mx.bfloat16)``.

    .venv/bin/python bench/adam.py [--models seed,large] [--rounds 9] [--torch PYTHON] [--split]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

SIZES = {"seed": [256, 256, 256, 10], "large": [2048] * 5}
CALLS = {"seed": 200, "large": 3}


def shapes(model: str) -> list[tuple[int, ...]]:
    dims = SIZES[model]
    out: list[tuple[int, ...]] = []
    for a, b in zip(dims[:-1], dims[1:], strict=True):
        out += [(b, a), (b,)]
    return out


def arrays(model: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(s).astype(np.float32) * 0.05 for s in shapes(model)]
    grads = [rng.standard_normal(s).astype(np.float32) * 1e-2 for s in shapes(model)]
    return params, grads


def torch_child(model: str, rounds: int) -> None:
    import torch

    params, grads = arrays(model)
    variants = {"torch single": {"foreach": False}, "torch foreach": {"foreach": True},
                "torch fused": {"fused": True}}
    steps = {}
    for name, kw in variants.items():
        ps = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
        for p, g in zip(ps, grads, strict=True):
            p.grad = torch.from_numpy(g)
        opt = torch.optim.Adam(ps, lr=1e-3, **kw)
        opt.step()
        steps[name] = opt.step
    print(json.dumps(interleave(steps, CALLS[model], rounds)))


def interleave(steps: dict[str, Callable[[], object]], calls: int, rounds: int
               ) -> dict[str, float]:
    """Median ms per call of each variant over ``rounds`` interleaved samples."""
    samples: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            steps[name]()
            start = time.perf_counter()
            for _ in range(calls):
                steps[name]()
            samples[name].append((time.perf_counter() - start) / calls * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def mlx_variants(model: str) -> dict[str, Callable[[], object]]:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from run import without_native

    import fluxlike
    from fluxlike.optimisers.rules import Rule

    params, grads = arrays(model)

    class Params(nn.Module):
        def __init__(self, dtype: mx.Dtype):
            super().__init__()
            self.ws = [mx.array(p).astype(dtype) for p in params]

    def fl(dtype: mx.Dtype, rule: Rule | None = None) -> Callable[[], object]:
        m = Params(dtype)
        state = fluxlike.setup(rule or fluxlike.Adam(1e-3), m)
        g = {"ws": [mx.array(x).astype(dtype) for x in grads]}
        mx.eval(g)

        def step() -> None:
            fluxlike.update(state, m, g)
            mx.eval(m.parameters(), state.optimizer.state)

        return step

    def eager() -> Callable[[], object]:
        m, opt = Params(mx.float32), optim.Adam(1e-3, bias_correction=True)
        g = {"ws": [mx.array(x) for x in grads]}

        def step() -> None:
            opt.update(m, g)
            mx.eval(m.parameters(), opt.state)

        return step

    # The -native steps run inside native.disabled(): fluxlike.update keys its compiled steps
    # by the switch, so each call traces (once) and replays MLX's update there.
    return {"fl update": fl(mx.float32), "fl -native": without_native(fl(mx.float32)),
            "mlx eager": eager(), "fl bf16": fl(mx.bfloat16),
            "fl bf16 -native": without_native(fl(mx.bfloat16)),
            "fl rmsprop": fl(mx.float32, fluxlike.RMSProp(1e-3)),
            "fl rmsprop -native": without_native(fl(mx.float32, fluxlike.RMSProp(1e-3)))}


def step_split(rounds: int) -> None:
    """The large MLP's step and its forward + backward alone, float32 and under autocast."""
    import mlx.core as mx
    import models as M

    import fluxlike
    from fluxlike import setup, update, withgradient

    spec = M.SPECS["large"]
    ws = M.weights(spec)
    x_np, labels = M.data(spec)
    x, y = mx.array(x_np), mx.array(M.onehot(labels, spec.classes))
    model = M.fluxlike_model(spec, ws)
    state = setup(fluxlike.Adam(1e-3), model)

    def made(ac: mx.Dtype | None, step: bool) -> Callable[[], object]:
        def run() -> None:
            loss, grads = withgradient(lambda m: M.fluxlike_loss(m, x, y), model, autocast=ac)
            if step:
                update(state, model, grads[0])
            mx.eval(loss, grads, model.parameters(), state.optimizer.state)

        return run

    times = interleave({"fwd+bwd f32": made(None, False), "fwd+bwd autocast": made(mx.bfloat16,
                                                                                   False),
                        "step f32": made(None, True), "step autocast": made(mx.bfloat16, True)},
                       3, rounds)
    print("\nlarge: the training step split (ms; the step = forward + backward + update)")
    for name, ms in times.items():
        print(f"  {name:16s} {ms:9.1f} ms")
    print(f"  autocast / f32: step {times['step autocast'] / times['step f32']:.2f}, "
          f"forward + backward {times['fwd+bwd autocast'] / times['fwd+bwd f32']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="seed,large")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--torch", metavar="PYTHON", default=sys.executable,
                        help="a Python with torch for the PyTorch columns (default: this one)")
    parser.add_argument("--split", action="store_true",
                        help="also split the large MLP's training step (see above)")
    parser.add_argument("--torch-child", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_child:
        torch_child(args.torch_child, args.rounds)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mlx.core as mx

    from fluxlike import native

    mx.set_cache_limit(1 << 32)  # as update's first step raises it: no page faults in samples
    takes = "the native kernel" if native.adam_kernel() is not None else "MLX's update"
    print(f"# The Adam update alone (ms per update; ratios to fl update)\n"
          f"native: {native.native_info().reason}\nfl update takes {takes}")
    for model in args.models.split(","):
        if model not in SIZES:
            sys.exit(f"unknown model {model!r}: expected one of {', '.join(SIZES)}")
        n = sum(int(np.prod(s)) for s in shapes(model))
        times = interleave(mlx_variants(model), CALLS[model], args.rounds)
        peak = mx.get_peak_memory() / 2**20
        done = subprocess.run([args.torch, __file__, "--torch-child", model, "--rounds",
                               str(args.rounds)], capture_output=True, text=True)
        if done.returncode == 0:
            times.update(json.loads(done.stdout.strip().splitlines()[-1]))
        else:
            print(f"(PyTorch left out: {done.stderr.strip().splitlines()[-1:]})")
        base = times["fl update"]
        print(f"\n{model}: {n} parameters; this process's peak memory {peak:.0f} MiB")
        for name, ms in times.items():
            print(f"  {name:18s} {ms:9.3f} ms  {ms / base:6.2f}x")
    if args.split:
        step_split(args.rounds)


if __name__ == "__main__":
    main()
