"""The benchmark models, written once per framework from one set of numpy weights.

Every framework computes the same function (same weights, same layout of the data), so the
outputs can be compared and the timings are of the same work:

- ``seed``: MLP 256 -> 256 -> 256 -> 10, ReLU, batch 128 (the PyTorch CPU-autocast
  tutorial's model).
- ``large``: MLP 4 x (2048 -> 2048, ReLU), batch 512.
- ``cnn``: 28x28x1 images, Conv 3x3 1->16 (pad 1) -> ReLU -> MaxPool 2 -> Conv 3x3 16->32
  (pad 1) -> ReLU -> MaxPool 2 -> flatten (7*7*32 = 1568) -> Dense 10, batch 64.
- ``act``: MLP 8 x (512 -> 512, ReLU), batch 8192 (activation-dominated memory).

The loss is the mean cross entropy of the logits; fluxlike and hand-written MLX take one-hot
targets (as Flux does; fluxlike's integer-label path reads the label range back to the host,
one synchronisation per call), ``mlx.nn`` and PyTorch take integer labels.

Layouts: MLX is channels last (NHWC), PyTorch channels first (NCHW); PyTorch's first Dense
after ``flatten`` gets its weight columns permuted so that both compute the same function.
"""

from __future__ import annotations

# isort: off
import fluxlike  # first: fluxlike picks the BLAS before mlx.core is loaded
# isort: on

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from fluxlike.losses import logitcrossentropy


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


# ---------------------------------------------------------------- fluxlike


def fluxlike_model(spec: Spec, ws: list) -> fluxlike.Chain:
    """The model as a ``fluxlike.Chain`` of Dense/Conv/MaxPool/flatten."""
    layers: list = []
    it = iter(ws)
    for layer in spec.layers:
        if layer[0] == "flatten":
            layers.append(fluxlike.flatten)
            continue
        w, b = next(it)
        if layer[0] == "dense":
            made = fluxlike.Dense(layer[1], layer[2], "relu" if layer[3] else fluxlike.identity)
        else:
            made = fluxlike.Conv((3, 3), layer[1], layer[2], "relu", padding=1)
        made.weight, made.bias = mx.array(w), mx.array(b)
        layers.append(made)
        if layer[0] == "conv":
            layers.append(fluxlike.MaxPool((2, 2)))
    return fluxlike.Chain(*layers)


def fluxlike_loss(model: Callable, x: mx.array, y: mx.array) -> mx.array:
    """Mean cross entropy of ``model(x)`` against one-hot ``y``, with fluxlike's loss."""
    return logitcrossentropy(model(x), y)


# ---------------------------------------------------------------- hand-written MLX


def mlx_params(ws: list) -> dict[str, list[dict[str, mx.array]]]:
    """The parameters as ``{"layers": [{"w", "b"}, ...]}`` (a tree for ``mx.value_and_grad``
    and ``mlx.optimizers``)."""
    return {"layers": [{"w": mx.array(w), "b": mx.array(b)} for w, b in ws]}


def mlx_forward(spec: Spec) -> Callable[[dict, mx.array], mx.array]:
    """``forward(params, x)`` in plain ``mlx.core`` ops."""

    def forward(params: dict, x: mx.array) -> mx.array:
        it = iter(params["layers"])
        for layer in spec.layers:
            if layer[0] == "flatten":
                x = x.reshape(x.shape[0], -1)
                continue
            p = next(it)
            if layer[0] == "dense":
                x = mx.addmm(p["b"], x, p["w"].T)
                if layer[3]:
                    x = mx.maximum(x, 0)
            else:
                x = mx.maximum(mx.conv2d(x, p["w"], padding=1) + p["b"], 0)
                n, h, w, c = x.shape
                x = x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))
        return x

    return forward


def mlx_loss(forward: Callable) -> Callable[[dict, mx.array, mx.array], mx.array]:
    """``loss(params, x, y)``: mean cross entropy against one-hot ``y``."""

    def loss(params: dict, x: mx.array, y: mx.array) -> mx.array:
        z = forward(params, x)
        return mx.mean(mx.logsumexp(z, axis=-1) - mx.sum(z * y, axis=-1))

    return loss


# ---------------------------------------------------------------- mlx.nn


def mlx_nn_model(spec: Spec, ws: list) -> nn.Sequential:
    """The model as an ``mlx.nn.Sequential`` of Linear/Conv2d/ReLU/MaxPool2d."""
    layers: list = []
    it = iter(ws)
    for layer in spec.layers:
        if layer[0] == "flatten":
            layers.append(lambda x: x.reshape(x.shape[0], -1))
            continue
        w, b = next(it)
        if layer[0] == "dense":
            made = nn.Linear(layer[1], layer[2])
        else:
            made = nn.Conv2d(layer[1], layer[2], 3, padding=1)
        made.weight, made.bias = mx.array(w), mx.array(b)
        layers.append(made)
        if layer[0] == "conv" or layer[3]:
            layers.append(nn.ReLU())
        if layer[0] == "conv":
            layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


def mlx_nn_loss(model: nn.Module, x: mx.array, labels: mx.array) -> mx.array:
    """Mean cross entropy against integer labels, with ``mlx.nn.losses``."""
    return nn.losses.cross_entropy(model(x), labels, reduction="mean")


# ---------------------------------------------------------------- PyTorch


def torch_model(spec: Spec, ws: list):  # -> torch.nn.Sequential
    """The model as a ``torch.nn.Sequential`` (NCHW for the CNN)."""
    import torch

    layers: list = []
    it = iter(ws)
    spatial = spec.input_shape[:-1]
    for layer in spec.layers:
        if layer[0] == "flatten":
            layers.append(torch.nn.Flatten())
            continue
        w, b = next(it)
        if layer[0] == "dense":
            made = torch.nn.Linear(layer[1], layer[2])
            if len(spec.input_shape) == 3 and layers and isinstance(layers[-1], torch.nn.Flatten):
                # MLX flattens (H, W, C), PyTorch (C, H, W): permute the weight's columns.
                c = w.shape[1] // math.prod(spatial)
                w = w.reshape(w.shape[0], *spatial, c).transpose(0, 3, 1, 2).reshape(w.shape)
            made.weight.data = torch.from_numpy(np.ascontiguousarray(w))
        else:
            made = torch.nn.Conv2d(layer[1], layer[2], 3, padding=1)
            made.weight.data = torch.from_numpy(np.ascontiguousarray(w.transpose(0, 3, 1, 2)))
            spatial = tuple(s // 2 for s in spatial)
        made.bias.data = torch.from_numpy(b.copy())
        layers.append(made)
        if layer[0] == "conv" or layer[3]:
            layers.append(torch.nn.ReLU())
        if layer[0] == "conv":
            layers.append(torch.nn.MaxPool2d(2))
    return torch.nn.Sequential(*layers)


def torch_input(x: np.ndarray):  # -> torch.Tensor
    """``x`` as a torch tensor in PyTorch's layout (NHWC -> NCHW for images)."""
    import torch

    if x.ndim == 4:
        x = x.transpose(0, 3, 1, 2)
    return torch.from_numpy(np.ascontiguousarray(x))
