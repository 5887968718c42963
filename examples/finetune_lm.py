"""Fine-tune an mlx-lm language model with LoRA under autocast, against float32 and float16.

The model is mlx-lm's own Llama (``mlx_lm.models.llama``), built from a small config with
random weights (no download), its tokens the bytes of Python's own documentation
(``pydoc_data.topics``, ~465 thousand characters: the first 90% to train on, the rest to
validate). LoRA is set up as mlx-lm sets it up: the base model frozen, its attention and MLP
projections in the last ``--lora-layers`` blocks wrapped by ``linear_to_lora_layers`` (mlx-lm's
``LoRALinear``), so that only the low-rank adapters train.

The same initial weights and adapters are trained three times on the same batches by
fluxlike's ``train``: in float32, under ``autocast=mx.bfloat16`` and under
``autocast=mx.float16`` (with ``train``'s dynamic loss scale). Under autocast the frozen
projections and the adapters' own matmuls compute in half precision, while the adapters,
their gradients and Adam's state stay float32. The script prints each run's speed and peak
memory and a sample from mlx-lm's own ``generate_step`` run under the scope, and writes a PNG
of the three loss curves (matplotlib, ``pip install 'fluxlike[examples]'``).

    python examples/finetune_lm.py                           # plot in finetune_lm.png
    python examples/finetune_lm.py --steps 100 --plot /tmp/curves.png
    python examples/finetune_lm.py --precisions float32,bfloat16 --no-plot
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

import fluxlike as fl

PRECISIONS = {"float32": None, "bfloat16": mx.bfloat16, "float16": mx.float16}
VOCAB = 256  # bytes
NEEDS_MLX_LM = "this example fine-tunes mlx-lm's Llama: pip install 'fluxlike[examples]'"


def load_tokens() -> np.ndarray:
    """Python's documentation topics as bytes (token ids 0-255)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[name] for name in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def batches(tokens: np.ndarray, count: int, size: int, context: int, seed: int) -> list:
    """``count`` batches of ``size`` windows of ``context + 1`` tokens (inputs and targets
    shifted by one), drawn at random with ``seed``."""
    starts = np.random.default_rng(seed).integers(0, len(tokens) - context - 1, (count, size))
    return [(mx.array(np.stack([tokens[s:s + context + 1] for s in row])),) for row in starts]


def make_model(args: argparse.Namespace) -> nn.Module:
    """mlx-lm's Llama with random weights, frozen, with LoRA adapters as mlx-lm adds them."""
    from mlx_lm.models import llama
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mx.random.seed(args.seed)
    config = llama.ModelArgs(
        model_type="llama", hidden_size=args.dims, num_hidden_layers=args.layers,
        intermediate_size=4 * args.dims, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, rms_norm_eps=1e-5, vocab_size=VOCAB,
        tie_word_embeddings=False)
    model = llama.Model(config)
    model.freeze()
    linear_to_lora_layers(model, args.lora_layers,
                          {"rank": args.rank, "scale": args.lora_scale, "dropout": 0.0})
    mx.eval(model.parameters())
    return model


def loss(model: nn.Module, tokens: mx.array) -> mx.array:
    """Next-token cross entropy, in float32 whatever the logits' dtype (as mlx-lm's)."""
    logits = model(tokens[:, :-1]).astype(mx.float32)
    return nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")


def evaluate(model: nn.Module, data: list, dtype: mx.Dtype | None) -> float:
    with fl.autocast(dtype, enabled=dtype is not None):
        return float(np.mean([loss(model, *batch).item() for batch in data]))


def sample(model: nn.Module, dtype: mx.Dtype | None, prompt: str, length: int) -> str:
    """Greedy text from mlx-lm's own ``generate_step`` (KV cache, prefill) under the scope."""
    from mlx_lm.generate import generate_step

    ids = mx.array(list(prompt.encode("utf-8")))
    with fl.autocast(dtype, enabled=dtype is not None):
        out = [token for token, _ in generate_step(ids, model, max_tokens=length)]
    return prompt + bytes(out).decode("utf-8", errors="replace")


@dataclass
class Run:
    precision: str
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    tokens_per_second: float = 0.0
    peak_memory: int = 0
    sample: str = ""


def train_one(args: argparse.Namespace, precision: str, train_data: list,
              val_data: list) -> Run:
    """LoRA fine-tuning in one precision, from the seed's weights and adapters."""
    dtype = PRECISIONS[precision]
    model = make_model(args)
    opt_state = fl.setup(fl.Adam(args.lr), model)
    run = Run(precision)
    mx.reset_peak_memory()
    seconds = 0.0
    for first in range(0, args.steps, args.eval_every):
        chunk = train_data[first:first + args.eval_every]
        start = time.perf_counter()
        mean = fl.train(loss, model, chunk, opt_state, autocast=dtype, progress=False)
        seconds += time.perf_counter() - start
        run.steps.append(first + len(chunk))
        run.train_loss.append(mean)
        run.val_loss.append(evaluate(model, val_data, dtype))
        print(f"  {precision:>8}  step {run.steps[-1]:4d}  train {mean:.3f}  "
              f"val {run.val_loss[-1]:.3f}", flush=True)
    run.peak_memory = mx.get_peak_memory()
    run.tokens_per_second = args.steps * args.batchsize * args.context / seconds
    for key, value in tree_flatten(model.trainable_parameters()):
        assert value.dtype == mx.float32, key  # the adapters stay float32 under autocast
    run.sample = sample(model, dtype, args.prompt, args.sample_length)
    return run


def plot(runs: list[Run], path: str, title: str) -> bool:
    """The training- and validation-loss curves of each precision, in one PNG; ``False``
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'fluxlike[examples]'): no plot written")
        return False
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    styles = {"float32": "-", "bfloat16": "--", "float16": ":"}
    for run in runs:
        line = {"label": run.precision, "linestyle": styles[run.precision]}
        axes[0].plot(run.steps, run.train_loss, **line)
        axes[1].plot(run.steps, run.val_loss, **line)
    for axis, name in zip(axes, ("training loss", "validation loss"), strict=True):
        axis.set_xlabel("step")
        axis.set_ylabel(name)
        axis.legend()
        axis.grid(alpha=0.3)
    figure.suptitle(title, fontsize=9)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--dims", type=positive_int, default=128, help="model width (128)")
    add("--heads", type=positive_int, default=4, help="attention heads (4)")
    add("--layers", type=positive_int, default=2, help="transformer blocks (2)")
    add("--lora-layers", type=positive_int, default=2, help="blocks given adapters (2)")
    add("--rank", type=positive_int, default=8, help="LoRA rank (8)")
    add("--lora-scale", type=float, default=20.0, help="LoRA scale, as mlx-lm's (20)")
    add("--context", type=positive_int, default=64, help="tokens per window (64)")
    add("--batchsize", type=positive_int, default=16, help="windows per batch (16)")
    add("--steps", type=positive_int, default=300, help="training steps (300)")
    add("--eval-every", type=positive_int, default=25, help="steps between evaluations (25)")
    add("--val-batches", type=positive_int, default=4, help="validation batches (4)")
    add("--lr", type=float, default=2e-3, help="Adam's learning rate (2e-3)")
    add("--precisions", default="float32,bfloat16,float16",
        help="comma-separated, of float32, bfloat16, float16")
    add("--prompt", default="The ", help="the sample's start ('The ')")
    add("--sample-length", type=positive_int, default=60, help="bytes to sample (60)")
    add("--seed", type=int, default=0)
    add("--plot", metavar="PATH", default="finetune_lm.png",
        help="the PNG to write (finetune_lm.png)")
    add("--no-plot", action="store_true", help="write no plot")
    args = parser.parse_args(argv)
    args.precisions = args.precisions.split(",")
    for name in args.precisions:
        if name not in PRECISIONS:
            parser.error(f"--precisions: {name!r} is not one of {', '.join(PRECISIONS)}")
    if len(set(args.precisions)) != len(args.precisions):
        parser.error(f"--precisions: each at most once, got {args.precisions}")
    if args.dims % args.heads:
        parser.error(f"--dims ({args.dims}) must be a multiple of --heads ({args.heads})")
    if args.lora_layers > args.layers:
        parser.error(f"--lora-layers ({args.lora_layers}) is more than --layers ({args.layers})")
    for name in ("lr", "lora_scale"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if not args.prompt:
        parser.error("--prompt must not be empty")
    if args.no_plot:
        args.plot = None
    elif args.plot:
        if not args.plot.endswith(".png"):
            parser.error(f"--plot names a PNG file (x.png), got {args.plot!r}")
        folder = os.path.dirname(args.plot) or "."
        if not os.path.isdir(folder):
            parser.error(f"--plot: no folder {folder!r} to write {args.plot!r} in")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Run]:
    args = parse_args(argv)
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        sys.exit(NEEDS_MLX_LM)
    tokens = load_tokens()
    split = int(0.9 * len(tokens))
    train_data = batches(tokens[:split], args.steps, args.batchsize, args.context, args.seed)
    val_data = batches(tokens[split:], args.val_batches, args.batchsize, args.context,
                       args.seed + 1)
    model = make_model(args)
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"mlx-lm Llama, {args.layers} blocks of width {args.dims}, {total:,} parameters; "
          f"LoRA rank {args.rank} on {args.lora_layers} blocks: {trainable:,} trainable")
    runs: dict[str, Run] = {}
    for precision in args.precisions:
        runs[precision] = train_one(args, precision, train_data, val_data)
    print()
    for run in runs.values():
        print(f"{run.precision:>8}: final train {run.train_loss[-1]:.3f}, val "
              f"{run.val_loss[-1]:.3f}; {run.tokens_per_second:,.0f} tokens/s; peak memory "
              f"{run.peak_memory / 2**20:.0f} MiB")
    for run in runs.values():
        print(f"--- sample, {run.precision} ---\n{run.sample}")
    if args.plot:
        title = (f"LoRA fine-tuning of mlx-lm's Llama ({args.layers}x{args.dims}, rank "
                 f"{args.rank}), {args.steps} steps of {args.batchsize}x{args.context} bytes")
        if plot(list(runs.values()), args.plot, title):
            print(f"\nwrote {args.plot}")
    return runs


if __name__ == "__main__":
    main()
