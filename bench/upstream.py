"""Real upstream models at a realistic size: float32 against autocast(bfloat16/float16).

mlx-lm's Llama, Qwen2, Gemma, GPT-2, Mamba and Mixtral (mixture of experts), and
mlx-examples' BERT (stock ``mlx.nn``), built from their own classes with random weights
(``tests/integration/zoo.py``; no download), dims 512, 4 layers, batch 4 x 128 tokens by
default. For each model: inference (one forward pass) and a training step (``train`` on
one batch: forward, backward, Adam; float16 with ``train``'s dynamic loss scale), in float32,
under ``autocast(bfloat16)`` and ``autocast(float16)``, and inference of ``bf16mix(model)``
(the converted model, no scope). All variants of a model are interleaved (a new order each
round; the median kept), each with its own copy of the same initial weights; the peak
memory is ``mx.get_peak_memory()`` over one call above what was resident before it.

    .venv/bin/python bench/upstream.py                       # every model, ~5 minutes
    .venv/bin/python bench/upstream.py --models llama,bert --rounds 3
    .venv/bin/python bench/upstream.py --quick               # tiny sizes: a smoke run
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
import zoo  # noqa: E402  (the model builders the integration tests use)

import fluxlike  # noqa: E402
from fluxlike import Adam, autocast, bf16mix, setup, train  # noqa: E402

MODELS = ("llama", "qwen2", "gemma", "gpt2", "bert", "mamba", "mixtral")
PRECISIONS = {"f32": None, "bf16": mx.bfloat16, "f16": mx.float16}


def processor() -> str:
    """The CPU's name and its half-precision flags (the figures depend on them)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown processor"
    name = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = sorted(set(re.findall(r"\b(amx_bf16|avx512_bf16|avx512_fp16)\b", info)))
    return f"{name.group(1) if name else 'unknown'} ({', '.join(flags) or 'no bf16/fp16 flags'})"


def variants(name: str, dims: int, layers: int, vocab: int, tokens: mx.array
             ) -> dict[str, Callable[[], object]]:
    """The timed calls of one model: ``infer <precision>``, ``infer bf16mix`` and
    ``train <precision>``, each on its own copy of the same initial weights."""
    out: dict[str, Callable[[], object]] = {}
    x = tokens[:, :-1]
    for label, dtype in PRECISIONS.items():
        mx.random.seed(0)
        model = zoo.build(name, dims, layers, vocab)

        def infer(model: nn.Module = model, dtype: mx.Dtype | None = dtype) -> object:
            if dtype is None:
                return mx.eval(model(x))
            with autocast(dtype):
                return mx.eval(model(x))

        out[f"infer {label}"] = infer
        mx.random.seed(0)
        trained = zoo.build(name, dims, layers, vocab)
        opt_state = setup(Adam(1e-4), trained)

        def step(model: nn.Module = trained, opt_state: object = opt_state,
                 dtype: mx.Dtype | None = dtype) -> object:
            return train(zoo.lm_loss, model, [(tokens,)], opt_state, autocast=dtype,
                         progress=False)

        out[f"train {label}"] = step
    mx.random.seed(0)
    half = bf16mix(zoo.build(name, dims, layers, vocab))
    out["infer bf16mix"] = lambda: mx.eval(half(x))
    return out


def measure(fns: dict[str, Callable[[], object]], rounds: int, warmup: int
            ) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per call over ``rounds`` interleaved rounds (after ``warmup`` calls of
    each), and each call's peak memory above what was resident before it (bytes)."""
    names = list(fns)
    peaks: dict[str, float] = {}
    for name in list(names):
        try:
            fns[name]()
        except RuntimeError as e:  # MLX 0.32's CPU gather_mm is float32-only (bf16mix Mixtral)
            print(f"<!-- {name} does not run: {e} -->", file=sys.stderr)
            names.remove(name)
            continue
        for _ in range(warmup - 1):
            fns[name]()
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        fns[name]()
        mx.synchronize()
        peaks[name] = mx.get_peak_memory() - base
    samples: dict[str, list[float]] = {name: [] for name in names}
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(names)
        for name in names:
            start = time.perf_counter()
            fns[name]()
            mx.synchronize()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items() if s}, peaks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(zoo.LM_NAMES + zoo.STOCK_NAMES)}")
    parser.add_argument("--dims", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="dims 64, 2 layers, batch 2 x 16, 1 round: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.dims, args.layers, args.vocab, args.batch, args.length = 64, 2, 128, 2, 16
        args.rounds, args.warmup = 1, 1
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in zoo.LM_NAMES + zoo.STOCK_NAMES]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {zoo.LM_NAMES + zoo.STOCK_NAMES}")
    mx.set_cache_limit(1 << 30)
    mx.random.seed(0)
    tokens = mx.random.randint(0, args.vocab, (args.batch, args.length + 1))
    print("# Upstream models: float32 against autocast, one run (bench/upstream.py)\n")
    info = fluxlike.native.native_info()
    native = (f"native kernels: {info.isa}, bfloat16 {info.bfloat16}, float16 {info.float16}"
              if info.available else "no native kernels")
    print(f"processor: {processor()}; MLX {mx.__version__}; {native}")
    print(f"size: dims {args.dims}, {args.layers} layers, vocab {args.vocab}, batch "
          f"{args.batch} x {args.length} tokens; median of {args.rounds} interleaved rounds\n")
    header = ("| model | infer f32 ms | bf16 | f16 | bf16mix | train f32 ms | bf16 | f16 | "
              "peak MiB train f32 / bf16 / f16 |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for name in names:
        times, peaks = measure(variants(name, args.dims, args.layers, args.vocab, tokens),
                               args.rounds, args.warmup)
        infer32, train32 = times["infer f32"], times["train f32"]
        mib = [peaks[f"train {p}"] / 2**20 for p in PRECISIONS]
        mixed = times.get("infer bf16mix")
        mixed_ratio = "does not run" if mixed is None else f"{mixed / infer32:.2f}x"
        print(f"| {name} | {1e3 * infer32:.1f} | {times['infer bf16'] / infer32:.2f}x | "
              f"{times['infer f16'] / infer32:.2f}x | {mixed_ratio} | "
              f"{1e3 * train32:.1f} | {times['train bf16'] / train32:.2f}x | "
              f"{times['train f16'] / train32:.2f}x | "
              f"{mib[0]:.0f} / {mib[1]:.0f} / {mib[2]:.0f} |", flush=True)
    print("\nratios: time of the variant / float32's time of the same model (below 1: faster);"
          " bf16mix Mixtral does not run on the CPU: MLX 0.32's gather_mm is float32-only")


if __name__ == "__main__":
    main()
