"""The benchmark models in fluxlike, hand-written MLX and mlx.nn, from one set of numpy weights.

The models, their weights and data are in ``bench/specs.py`` (re-exported here); the PyTorch
models are built in ``bench/torch_worker.py``, in a process of their own. Every framework
computes the same function (same weights, same layout of the data), so the outputs can be
compared and the timings are of the same work.

The loss is the mean cross entropy of the logits; fluxlike and hand-written MLX take one-hot
targets (as Flux does; fluxlike's integer-label path reads the label range back to the host,
one synchronisation per call), ``mlx.nn`` and PyTorch take integer labels.

Layouts: MLX is channels last (NHWC), PyTorch channels first (NCHW); PyTorch's first Dense
after ``flatten`` gets its weight columns permuted (in ``torch_worker.py``) so that both
compute the same function.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from specs import LM, SPECS, LMSpec, Spec, data, lm_data, onehot, weights  # noqa: F401

import fluxlike
from fluxlike.losses import logitcrossentropy

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


# ---------------------------------------------------------------- the transformer LM (stock mlx.nn)


class LanguageModel(nn.Module):
    """A causal transformer LM as a user builds it from ``mlx.nn``: token and position
    embeddings, pre-norm ``nn.TransformerEncoderLayer``s (``nn.MultiHeadAttention``,
    ``nn.LayerNorm``, ``nn.Linear``) with an additive causal mask, a final ``nn.LayerNorm``
    and an ``nn.Linear`` head."""

    def __init__(self, spec: LMSpec = LM):
        super().__init__()
        self.embedding = nn.Embedding(spec.vocab, spec.dims)
        self.positions = nn.Embedding(spec.context, spec.dims)
        self.layers = [nn.TransformerEncoderLayer(spec.dims, spec.heads, 4 * spec.dims)
                       for _ in range(spec.layers)]
        self.norm = nn.LayerNorm(spec.dims)
        self.head = nn.Linear(spec.dims, spec.vocab)

    def __call__(self, tokens: mx.array) -> mx.array:
        length = tokens.shape[1]
        x = self.embedding(tokens) + self.positions(mx.arange(length))
        mask = nn.MultiHeadAttention.create_additive_causal_mask(length)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, tokens: mx.array, targets: mx.array) -> mx.array:
    """Mean next-token cross entropy (``mlx.nn.losses``), on float32 logits."""
    logits = model(tokens).astype(mx.float32)
    return nn.losses.cross_entropy(logits, targets, reduction="mean")
