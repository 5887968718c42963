"""The PyTorch CPU-autocast tutorial's checks, replicated (seeds/003): under
``autocast(mx.bfloat16, device="cpu")`` a Linear returns bfloat16, the layer stays float32,
softmax stays float32, and the tutorial's MLP (256-256-256-10, ReLU, batch 128) predicts the
same classes with outputs within 0.05 of the float32 ones."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import np64

import fluxlike as fl
from fluxlike import autocast

BF16, F32 = mx.bfloat16, mx.float32


def torch_init(shape: tuple[int, int]) -> mx.array:
    """PyTorch's nn.Linear initialisation, U(-1/sqrt(in), 1/sqrt(in)), as in the tutorial."""
    bound = 1 / math.sqrt(shape[1])
    return mx.random.uniform(-bound, bound, shape)


def torch_dense(in_dims: int, out_dims: int, *act: str) -> fl.Dense:
    """A Dense initialised as PyTorch's nn.Linear (weight and bias U(-1/sqrt(in), ...))."""
    layer = fl.Dense(in_dims, out_dims, *act, init=torch_init)
    bound = 1 / math.sqrt(in_dims)
    layer.bias = mx.random.uniform(-bound, bound, (out_dims,))
    return layer


def mlp(kind: str):
    """The tutorial's model: fluxlike's Dense or an unmodified mlx.nn.Sequential."""
    if kind == "mlx.nn":  # mlx.nn.Linear's initialisation is PyTorch's
        return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10))
    return fl.Chain(torch_dense(256, 256, "relu"), torch_dense(256, 256, "relu"),
                    torch_dense(256, 10))


def forward_both(model, x):
    with mx.stream(mx.cpu):
        plain = model(x)
        with autocast(BF16, device="cpu"):
            auto = model(x)
        mx.eval(plain, auto)
    return plain, auto


def test_linear_returns_bfloat16_and_stays_float32():
    layer = fl.Dense(8, 8)
    x = mx.random.normal((2, 8))
    with mx.stream(mx.cpu):
        assert layer(x).dtype == F32
        with autocast(BF16, device="cpu"):
            out = layer(x)
            probs = fl.softmax(x, axis=1)
            half_probs = fl.softmax(x.astype(BF16), axis=1)
            centre = mx.mean(x)
    assert out.dtype == BF16
    assert layer.weight.dtype == F32 and layer.bias.dtype == F32
    assert probs.dtype == F32 and half_probs.dtype == F32 and centre.dtype == F32


@pytest.mark.parametrize("kind", ["fluxlike", "mlx.nn"])
def test_tutorial_mlp_seed_0(kind):
    """The tutorial's closing example: every prediction agrees, outputs close within 0.05."""
    mx.random.seed(0)
    model = mlp(kind)
    x = mx.random.normal((128, 256))
    params = [(k, v, np.array(v)) for k, v in _flat(model)]
    plain, auto = forward_both(model, x)
    assert plain.shape == (128, 10) and plain.dtype == F32
    assert auto.dtype == BF16
    assert mx.array_equal(plain.argmax(axis=1), auto.argmax(axis=1)).item()
    np.testing.assert_allclose(np64(auto), np64(plain), atol=0.05, rtol=0)
    for (key, before, values), (_, after) in zip(params, _flat(model), strict=True):
        assert after is before and after.dtype == F32, key
        np.testing.assert_array_equal(np.array(after), values)


@pytest.mark.parametrize("seed", range(1, 6))
def test_tutorial_mlp_predictions_agree_where_the_margin_is_not_tiny(seed):
    """Over other seeds: rows whose float32 top-1 margin exceeds 0.01 (several times the
    largest bfloat16 deviation) always agree, and nearly all rows agree overall."""
    mx.random.seed(seed)
    model = mlp("fluxlike")
    x = mx.random.normal((128, 256))
    plain, auto = forward_both(model, x)
    agree = np.array(plain.argmax(axis=1) == auto.argmax(axis=1))
    top2 = np.sort(np.array(plain), axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.01
    assert clear.sum() >= 96  # most rows have a clear winner
    assert agree[clear].all()
    assert agree.mean() >= 0.95
    np.testing.assert_allclose(np64(auto), np64(plain), atol=0.05, rtol=0)


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
