"""Train the digits CNN of examples/digits.py data-parallel, over processes started by mlx.launch.

Every process builds the same model and loads the whole data set; ``setup(...,
distributed=True)`` gives them rank 0's initial weights and makes each step average the
gradients over the group, and ``DataLoader(..., distributed=True)`` gives each process its own
share of every epoch. Each step thus trains on ``--batchsize`` images in all, ``--batchsize /
processes`` per process, exactly as one process would on the whole batch (up to float32
rounding). Only rank 0 prints and writes the checkpoint.

    mlx.launch -n 2 --backend ring --python .venv/bin/python examples/digits_distributed.py
    mlx.launch -n 2 --backend ring --python .venv/bin/python examples/digits_distributed.py \\
        --precision bfloat16 --communication bfloat16 --save digits.safetensors

On one machine the ring backend runs over loopback; for several machines give ``mlx.launch``
a hostfile (see the README). Run without ``mlx.launch`` it trains in one process.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim

sys.path.insert(0, str(Path(__file__).resolve().parent))  # digits.py, beside this file
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's fluxlike
import digits  # noqa: E402

import fluxlike as fl  # noqa: E402

COMMUNICATION = {"float32": None, "bfloat16": mx.bfloat16, "float16": mx.float16}


def parse_args(argv: Sequence[str] | None, size: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="passes over the data (10)")
    parser.add_argument("--batchsize", type=int, default=32,
                        help="images per step over all processes (32)")
    parser.add_argument("--lr", type=float, default=5e-3, help="Adam's initial rate (5e-3)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and shuffling (0)")
    parser.add_argument("--precision", choices=list(digits.PRECISIONS), default="float32",
                        help="compute dtype of the layers, via fluxlike.autocast (float32)")
    parser.add_argument("--communication", choices=list(COMMUNICATION), default="float32",
                        help="dtype the gradients travel in (float32)")
    parser.add_argument("--save", metavar="PATH", help="write a checkpoint here at the end")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if args.batchsize < size or args.batchsize % size:
        parser.error(f"--batchsize must be a positive multiple of the {size} processes, "
                     f"got {args.batchsize}")
    if args.save and not args.save.endswith(".safetensors"):
        parser.error(f"--save names a safetensors file (x.safetensors), got {args.save!r}")
    return args


def main(argv: Sequence[str] | None = None) -> float:
    """Train and evaluate on every rank of the group; returns the final test accuracy."""
    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    args = parse_args(argv, size)
    say = print if rank == 0 else (lambda *_: None)
    dtype = digits.PRECISIONS[args.precision]
    (x_train, y_train), (x_test, y_test) = digits.load_data()
    mx.random.seed(args.seed + rank)  # different on purpose: setup gives all rank 0's weights
    model = digits.build_model()
    loader = fl.DataLoader((x_train, fl.onehotbatch(y_train, digits.CLASSES)),
                           batchsize=args.batchsize // size, shuffle=True, rng=args.seed,
                           distributed=group)
    schedule = optim.cosine_decay(args.lr, args.epochs * len(loader))
    opt_state = fl.setup(fl.Adam(schedule), model, distributed=group,
                         communication_dtype=COMMUNICATION[args.communication])
    say(f"{size} process(es), {len(loader)} steps of {args.batchsize // size} images each "
        f"per epoch, {args.precision} compute, {args.communication} communication")
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        mean_loss = fl.train(digits.loss, model, loader, opt_state, autocast=dtype,
                             progress=False)
        test_accuracy = digits.accuracy(model, x_test, y_test, dtype)
        say(f"epoch {epoch:2d}  loss {mean_loss:.4f}  test accuracy {100 * test_accuracy:.2f}%"
            f"  ({time.perf_counter() - start:.1f} s)")
    say(f"final test accuracy: {100 * test_accuracy:.2f}%")
    if args.save:
        fl.savemodel(args.save, model, opt_state)  # rank 0 writes, the others wait
        say(f"saved model and optimiser state to {args.save}")
    return test_accuracy


if __name__ == "__main__":
    main()
