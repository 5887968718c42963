"""Where fluxlike's linear kernel takes the native oneDNN companion (fluxlike/precision/ops.py,
fluxlike/native.py): large float32 layers forward and backward, and bfloat16 inference under
autocast on weights seen before; float16, small layers and (without the companion) everything
stay on MLX's kernels, with the same results to float32 rounding."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import np64

from fluxlike import Dense, autocast, gradient, native, relu
from fluxlike.precision import ops

pytestmark = pytest.mark.skipif(not native.available(), reason=native.native_info().reason)


@pytest.fixture
def calls(monkeypatch):
    seen = []
    original = native.linear

    def counting(*args, **kwargs):
        seen.append(args[0].dtype)
        return original(*args, **kwargs)

    monkeypatch.setattr(ops.native, "linear", counting)
    return seen


def _mlx(layer, x):
    """The layer's float32 result on MLX's own kernels."""
    return relu(mx.addmm(layer.bias, x, layer.weight.T))


def test_a_large_float32_layer_runs_native_forward_and_backward(calls):
    layer, x = Dense(512, 512, relu), mx.random.normal((64, 512))
    y = layer(x)
    assert calls == [mx.float32] and y.dtype == mx.float32
    np.testing.assert_allclose(np64(y), np64(_mlx(layer, x)), rtol=1e-4, atol=1e-4)
    calls.clear()
    (g,) = gradient(lambda m: (m(x) ** 2).sum(), layer)
    assert calls == [mx.float32]
    expected = mx.grad(lambda w: (relu(mx.addmm(layer.bias, x, w.T)) ** 2).sum())(layer.weight)
    np.testing.assert_allclose(np64(g["weight"]), np64(expected), rtol=1e-3, atol=1e-3)


def test_a_small_float32_layer_stays_on_mlx(calls):
    Dense(256, 256)(mx.ones((4, 256)))
    assert calls == []


def test_bfloat16_inference_on_kept_weights_runs_native(calls):
    layer, x = Dense(64, 32, relu), mx.random.normal((8, 64))
    with autocast(mx.bfloat16, device="cpu"):
        first = layer(x)  # first sight: the custom-gradient path, nothing kept yet
        assert calls == []
        again = layer(x)
    assert calls == [mx.bfloat16] and again.dtype == mx.bfloat16
    assert mx.array_equal(first, again).item()  # one rounding of the float32 accumulation


def test_half_training_and_float16_stay_on_the_emulation(calls):
    layer, x = Dense(512, 512), mx.random.normal((16, 512))
    with autocast(mx.float16, device="cpu"):
        layer(x)
        layer(x)  # kept weights, but no oneDNN float16 kernel pays on this CPU
    assert calls == []
    for dtype in (mx.float16, mx.bfloat16):
        (g,) = gradient(lambda m: m(x).astype(mx.float32).sum(), layer, autocast=dtype)
        assert g["weight"].dtype == mx.float32
    assert calls == []  # the emulation keeps only half activations for the backward pass
