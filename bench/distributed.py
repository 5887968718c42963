"""Data-parallel training steps per second: 1 process against 2 (mlx.launch, ring over loopback),
gradients communicated in float32 against bfloat16.

    .venv/bin/python bench/distributed.py [--quick] [--steps N] [--rounds N]

The driver starts one worker process (1 process, no communication) and one ``mlx.launch -n 2
--backend ring`` group on 127.0.0.1; each worker trains an MLP (256-1024-1024-10, 1.3M
parameters: 5 MiB of float32 gradients per step) with ``fluxlike.train`` on a batch of 64 per
process, the variants interleaved round by round (medians kept), and measures the gradient
averaging alone too (``DataParallel.average`` of a gradient-sized tree, evaluated), and, as
a control, 2 processes training alone (no communication). Rank 0 reports.

Read it honestly: on this 2-core machine the two processes share the two cores (and the loopback
"network" is memory copies), so 2 processes cannot run a step faster than 1; what the table shows
is the cost of the communication and of the competition for the cores, and how much bfloat16
communication saves of the first. On separate machines each process has its own cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH, SIZES = 64, (256, 1024, 1024, 10)


def worker(steps: int, rounds: int) -> None:
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx

    import fluxlike as fl
    from fluxlike.losses import logitcrossentropy

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    mx.random.seed(0)
    x = mx.random.normal((BATCH, SIZES[0]))
    y = fl.onehotbatch((mx.arange(BATCH) % SIZES[-1]).tolist(), list(range(SIZES[-1])))
    batches = [(x, y)] * steps

    def loss(m, x, y):
        return logitcrossentropy(m(x), y)

    variants = {}
    wires = {"float32": None, "bfloat16": mx.bfloat16} if size > 1 else {}
    for wire_name, wire in {"none": None, **wires}.items():  # none: each process alone
        for compute_name, compute in (("float32", None), ("bfloat16", mx.bfloat16)):
            layers = [fl.Dense(a, b, fl.relu) for a, b in zip(SIZES[:-2], SIZES[1:-1],
                                                              strict=True)]
            model = fl.Chain(*layers, fl.Dense(SIZES[-2], SIZES[-1]))
            opt = fl.setup(fl.Adam(1e-4), model, distributed=wire_name != "none" or None,
                           communication_dtype=wire)
            fl.train(loss, model, batches[:3], opt, autocast=compute, progress=False)  # warm
            variants[(wire_name, compute_name)] = (model, opt, compute)
    samples: dict = {key: [] for key in variants}
    averaging: dict = {name: [] for name in wires}
    grads = {f"w{i}": mx.random.normal((a, b)) for i, (a, b) in
             enumerate(zip(SIZES[1:], SIZES[:-1], strict=True))}
    mx.eval(grads)
    parallels = {name: fl.DataParallel(group, wire) for name, wire in wires.items()}
    for _ in range(rounds):
        for key, (model, opt, compute) in variants.items():  # the same order on every rank
            fl.barrier(group)
            start = time.perf_counter()
            fl.train(loss, model, batches, opt, autocast=compute, progress=False)
            samples[key].append(steps / (time.perf_counter() - start))
        for name, parallel in parallels.items():
            fl.barrier(group)
            start = time.perf_counter()
            for _ in range(steps):
                mx.eval(parallel.average(grads))
            averaging[name].append((time.perf_counter() - start) / steps * 1e3)
    if rank == 0:
        print("RESULT " + json.dumps({
            "size": size,
            "steps_per_s": {f"{w}|{c}": statistics.median(v) for (w, c), v in samples.items()},
            "average_ms": {k: statistics.median(v) for k, v in averaging.items()},
        }), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(processes: int, steps: int, rounds: int) -> dict:
    me = [str(Path(__file__).resolve()), "--worker", "--steps", str(steps), "--rounds",
          str(rounds)]
    if processes == 1:
        command = [sys.executable, *me]
    else:
        launch = Path(sys.executable).with_name("mlx.launch")
        command = [sys.executable, str(launch), "-n", str(processes), "--backend", "ring",
                   "--hosts", "127.0.0.1", "--starting-port", str(_free_port()),
                   "--python", sys.executable, *me]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=900, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.exit(f"bench/distributed.py: the {processes}-process run failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps: a smoke run")
    parser.add_argument("--steps", type=int, default=20, help="steps per sample (20)")
    parser.add_argument("--rounds", type=int, default=5, help="samples per variant (5)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps, rounds = (3, 2) if args.quick else (args.steps, args.rounds)
    if args.worker:
        worker(steps, rounds)
        return
    import mlx.core as mx

    one, two = run(1, steps, rounds), run(2, steps, rounds)
    print("# fluxlike data parallelism: steps per second (mlx.launch, ring, 127.0.0.1)")
    print(f"mlx {mx.__version__}, {os.cpu_count()} CPU cores shared by all processes; MLP "
          f"{'-'.join(map(str, SIZES))}, batch {BATCH} per process; median of {rounds} "
          f"samples of {steps} steps\n")
    print(f"{'processes':>9} {'communication':>13} {'compute':>8} {'steps/s':>8} "
          f"{'examples/s':>10} {'vs 1 process':>12}")
    for compute in ("float32", "bfloat16"):
        base = one["steps_per_s"][f"none|{compute}"]
        print(f"{1:>9} {'none':>13} {compute:>8} {base:>8.1f} {base * BATCH:>10.0f} "
              f"{1.0:>12.2f}")
        for wire in ("none", "float32", "bfloat16"):
            rate = two["steps_per_s"][f"{wire}|{compute}"]
            print(f"{2:>9} {wire:>13} {compute:>8} {rate:>8.1f} {rate * 2 * BATCH:>10.0f} "
                  f"{rate / base:>12.2f}")
    print("\nGradient averaging alone (DataParallel.average of the 5 MiB gradient tree, "
          "evaluated), ms per step:")
    for wire, ms in two["average_ms"].items():
        print(f"  2 processes, {wire:>8} communication: {ms:6.2f} ms")
    print("\nCommunication 'none' with 2 processes: each trains alone (no averaging), which "
          "measures the competition for the cores by itself. Two processes on two shared cores "
          "compete for them: a 2-process step cannot be faster than a 1-process one here; "
          "'examples/s' counts both processes' batches.")


if __name__ == "__main__":
    main()
