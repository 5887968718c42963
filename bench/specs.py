"""The benchmark models' shapes, weights and data, in numpy only.

Both processes of ``bench/run.py`` build their models from these: the MLX process through
``bench/models.py``, the PyTorch process through ``bench/torch_worker.py``, which must not load
fluxlike or MLX. Same seeds, same arrays, so every framework computes the same function.

- ``seed``: MLP 256 -> 256 -> 256 -> 10, ReLU, batch 128 (the PyTorch CPU-autocast
  tutorial's model).
- ``large``: MLP 4 x (2048 -> 2048, ReLU), batch 512.
- ``cnn``: 28x28x1 images, Conv 3x3 1->16 (pad 1) -> ReLU -> MaxPool 2 -> Conv 3x3 16->32
  (pad 1) -> ReLU -> MaxPool 2 -> flatten (7*7*32 = 1568) -> Dense 10, batch 64.
- ``act``: MLP 8 x (512 -> 512, ReLU), batch 8192 (activation-dominated memory).
- ``lm`` (:data:`LM`): a causal transformer language model of stock layers, four pre-norm
  encoder layers of width 512 with 8 heads (MLP 2048, ReLU), learned positions, context 128,
  batch 4, vocabulary 1024; each framework initialises its own (same shapes, not the same
  weights: only its training step is timed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spec:
    """One benchmark model: ``layers`` is a list of ``("dense", in, out, relu)`` and
    ``("conv", in, out)`` (3x3, pad 1, ReLU, then MaxPool 2) and ``("flatten",)``."""

    name: str
    description: str
    batch: int
    input_shape: tuple[int, ...]  # one sample, MLX layout
    classes: int
    layers: tuple[tuple, ...]


def _mlp(name: str, description: str, batch: int, dims: list[int], last_relu: bool) -> Spec:
    layers = tuple(
        ("dense", i, o, last_relu or k < len(dims) - 2)
        for k, (i, o) in enumerate(zip(dims[:-1], dims[1:], strict=True))
    )
    return Spec(name, description, batch, (dims[0],), dims[-1], layers)


SPECS: dict[str, Spec] = {
    "seed": _mlp("seed", "MLP 256-256-256-10, batch 128", 128, [256, 256, 256, 10], False),
    "large": _mlp("large", "MLP 4x(2048->2048, ReLU), batch 512", 512, [2048] * 5, True),
    "cnn": Spec(
        "cnn", "CNN 28x28x1: conv16-pool-conv32-pool-dense10, batch 64", 64, (28, 28, 1), 10,
        (("conv", 1, 16), ("conv", 16, 32), ("flatten",), ("dense", 7 * 7 * 32, 10, False)),
    ),
    "act": _mlp("act", "MLP 8x(512->512, ReLU), batch 8192", 8192, [512] * 9, True),
}


def weights(spec: Spec, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Glorot-uniform weights and small biases, float32, MLX layouts: Dense ``(out, in)``,
    Conv ``(out, 3, 3, in)``."""
    rng = np.random.default_rng(seed)
    found = []
    for layer in spec.layers:
        if layer[0] == "flatten":
            continue
        _, i, o = layer[:3]
        shape = (o, i) if layer[0] == "dense" else (o, 3, 3, i)
        fan_in, fan_out = math.prod(shape[1:]), o * math.prod(shape[1:-1] or (1,))
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        w = rng.uniform(-limit, limit, shape).astype(np.float32)
        b = rng.uniform(-0.01, 0.01, (o,)).astype(np.float32)
        found.append((w, b))
    return found


def data(spec: Spec, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A batch ``(x, labels)``: standard normal float32 inputs and int32 class labels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((spec.batch, *spec.input_shape)).astype(np.float32)
    labels = rng.integers(0, spec.classes, spec.batch).astype(np.int32)
    return x, labels


def onehot(labels: np.ndarray, classes: int) -> np.ndarray:
    """float32 one-hot rows of integer labels."""
    return np.eye(classes, dtype=np.float32)[labels]


@dataclass(frozen=True)
class LMSpec:
    """The transformer language model's shapes (``lm``)."""

    name: str = "lm"
    description: str = "transformer LM: 4 x (width 512, 8 heads, MLP 2048), context 128, batch 4"
    vocab: int = 1024
    dims: int = 512
    heads: int = 8
    layers: int = 4
    context: int = 128
    batch: int = 4


LM = LMSpec()


def lm_data(spec: LMSpec = LM, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A batch of token ids and next-token targets, int32 ``(batch, context)`` each."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, spec.vocab, (spec.batch, spec.context + 1)).astype(np.int32)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()
