"""A language model's output end on the CPU: the cross entropy over a vocabulary and the head's
product, forward and backward, side by side in one run.

The loss, ``(rows, vocab)`` float32 logits with class-index targets, mean: MLX's own
``mlx.nn.losses.cross_entropy`` (what mlx-lm's training loss calls), the same call once fluxlike
is in use (``fluxlike/precision/stock.py``: its log-sum-exp on the native pass inside
``gradient``/``train``) and fluxlike's ``logitcrossentropy``, each under ``fluxlike.gradient``.
The head, ``nn.Linear(dims, vocab, bias=False)`` on ``(rows, dims)`` float32 inputs, forward and
backward with a plain sum: float32 (MLX's matmul) against ``autocast(bfloat16)`` (fluxlike's
kernels; where the CPU has no bfloat16 instructions, float32 kernels on upcast copies). Variants
interleaved (a new order each round, the median kept); MLX's buffer-cache limit raised first as
``train`` raises it (else each array over 32 MiB is faulted in afresh on every call); peak
memory over one call above what was resident.

    .venv/bin/python bench/losses.py                          # vocabularies 4096 and 32000
    .venv/bin/python bench/losses.py --vocab 32000 --rounds 9
    .venv/bin/python bench/losses.py --quick                  # tiny sizes: a smoke run
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream import measure, processor  # noqa: E402  (interleaved medians; the CPU's name)

import fluxlike  # noqa: E402
from fluxlike.losses import logitcrossentropy  # noqa: E402
from fluxlike.precision import stock  # noqa: E402


def loss_variants(rows: int, vocab: int) -> dict[str, Callable[[], object]]:
    logits = mx.random.normal((rows, vocab), key=mx.random.key(0)) * 3
    targets = mx.random.randint(0, vocab, (rows,), key=mx.random.key(1))
    mx.eval(logits, targets)

    def timed(fn: Callable[[mx.array], mx.array]) -> Callable[[], object]:
        return lambda: mx.eval(fluxlike.withgradient(fn, logits))

    return {
        "MLX's cross_entropy": timed(lambda v: stock._mlx_cross_entropy(
            v, targets, reduction="mean")),
        "cross_entropy, fluxlike in use": timed(lambda v: stock.cross_entropy(
            v, targets, reduction="mean")),
        "fluxlike logitcrossentropy": timed(lambda v: logitcrossentropy(v, targets)),
    }


def head_variants(rows: int, dims: int, vocab: int) -> dict[str, Callable[[], object]]:
    head = nn.Linear(dims, vocab, bias=False)
    x = mx.random.normal((rows, dims), key=mx.random.key(2))
    mx.eval(head.parameters(), x)

    def loss(model: nn.Module, x: mx.array) -> mx.array:
        return model(x).astype(mx.float32).sum()

    return {
        "head float32": lambda: mx.eval(fluxlike.gradient(loss, head, x)),
        "head autocast(bfloat16)": lambda: mx.eval(
            fluxlike.gradient(loss, head, x, autocast=mx.bfloat16)),
    }


def table(title: str, times: dict[str, float], peaks: dict[str, float]) -> None:
    base = next(iter(times.values()))
    print(f"\n{title}\n")
    print("| variant | ms | x the first | peak MiB |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f} | {peaks[name] / 2**20:.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="4096,32000",
                        help="vocabulary sizes, comma-separated (default 4096,32000)")
    parser.add_argument("--rows", type=int, default=512, help="tokens per batch (default 512)")
    parser.add_argument("--dims", type=int, default=512, help="the head's input width")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds")
    args = parser.parse_args(argv)
    vocabs = [int(v) for v in args.vocab.split(",")]
    if args.quick:
        vocabs, args.rows, args.dims, args.rounds = [64], 16, 8, 2
    mx.set_cache_limit(max(mx.set_cache_limit(0), 1 << 32))  # (as train's update raises it)
    with fluxlike.autocast(mx.bfloat16):  # fluxlike in use: MLX's functions replaced
        pass
    print(f"{processor()}; MLX {mx.__version__}; {args.rows} rows, rounds {args.rounds}")
    for vocab in vocabs:
        times, peaks = measure(loss_variants(args.rows, vocab), args.rounds, 2)
        table(f"Cross entropy + gradient, ({args.rows}, {vocab}) float32 logits", times, peaks)
        times, peaks = measure(head_variants(args.rows, args.dims, vocab), args.rounds, 2)
        table(f"Head ({args.rows}, {args.dims}) x ({vocab}, {args.dims}), forward + backward",
              times, peaks)


if __name__ == "__main__":
    main()
