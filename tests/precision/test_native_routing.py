"""Where fluxlike's linear kernel takes the native oneDNN companion (fluxlike/precision/ops.py,
fluxlike/native.py): float32 layers forward and backward, and bfloat16 under autocast
(inference and training), of any size, where oneDNN has bfloat16 kernels; float16 and
(without the companion) everything stay on MLX's kernels, with the same results to float32
rounding."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import np64

from fluxlike import Dense, autocast, gradient, native, relu
from fluxlike.precision import ops

pytestmark = pytest.mark.skipif(not native.available(), reason=native.native_info().reason)


@pytest.fixture
def calls(monkeypatch):
    """The dtypes of the linear products the native kernel computed (through
    ``native.linear``, or the everyday float32 call's ``plain_linear`` entry)."""
    seen = []
    original, plain = native.linear, ops._plain_kernel()

    def counting(*args, **kwargs):
        seen.append(args[0].dtype)
        return original(*args, **kwargs)

    def counting_plain(x, w, bias, relu):
        y = plain(x, w, bias, relu)
        if y is not None:
            seen.append(x.dtype)
        return y

    monkeypatch.setattr(ops.native, "linear", counting)
    monkeypatch.setattr(ops, "_plain_kernel", lambda: counting_plain)
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


@pytest.mark.parametrize("rows, dims", [(1, 8), (4, 256), (128, 64)])
def test_float32_layers_of_every_size_run_native(calls, rows, dims):
    # oneDNN's float32 kernel beats MLX's (OpenBLAS) down to the smallest layers measured,
    # forward and backward (bench/README.md): there is no size below which MLX takes over.
    layer, x = Dense(dims, dims, relu), mx.random.normal((rows, dims))
    y = layer(x)
    assert calls == [mx.float32] and y.dtype == mx.float32
    np.testing.assert_allclose(np64(y), np64(_mlx(layer, x)), rtol=1e-5, atol=1e-5)


def test_a_bias_the_kernel_does_not_take_falls_back_to_mlx(calls):
    layer, x = Dense(3, 2), mx.random.normal((4, 3))
    layer.bias = mx.array([[0.5, -1.0]])  # (1, 2): oneDNN wants (2,), MLX broadcasts it
    y = layer(x)
    assert calls == []  # declined, and computed by MLX instead
    np.testing.assert_allclose(np64(y), np64(x @ layer.weight.T + layer.bias), rtol=1e-6)
    with pytest.raises(ValueError, match=r"\[Dense\]"):  # a real shape error is still named
        layer(mx.ones((4, 5)))


def test_bfloat16_inference_runs_native_first_and_on_kept_weights(calls):
    if not native.bfloat16_native():
        pytest.skip("bfloat16 runs in oneDNN's float32 kernels here: the emulation takes it")
    layer, x = Dense(64, 32, relu), mx.random.normal((8, 64))
    with autocast(mx.bfloat16, device="cpu"):
        first = layer(x)  # first sight: through the per-call casts
        again = layer(x)  # then on the kept bfloat16 casts
    assert calls == [mx.bfloat16, mx.bfloat16] and again.dtype == mx.bfloat16
    assert mx.array_equal(first, again).item()  # one rounding of the float32 accumulation


def test_bfloat16_training_runs_native_and_float16_stays_on_the_emulation(calls):
    layer, x = Dense(512, 512), mx.random.normal((16, 512))
    with autocast(mx.float16, device="cpu"):
        layer(x)
        layer(x)  # kept weights, but no oneDNN float16 kernel pays on this CPU
    assert calls == []
    (g,) = gradient(lambda m: m(x).astype(mx.float32).sum(), layer, autocast=mx.float16)
    assert g["weight"].dtype == mx.float32 and calls == []
    (g,) = gradient(lambda m: m(x).astype(mx.float32).sum(), layer, autocast=mx.bfloat16)
    assert g["weight"].dtype == g["bias"].dtype == mx.float32
    # oneDNN's bfloat16 kernel where the CPU has one: its backward pass keeps only bfloat16
    # activations (and less than the emulation: tests/precision/test_cpu_half.py).
    assert calls == ([mx.bfloat16] if native.bfloat16_native() else [])
    # d/dw of sum(x @ w.T) is the column sums of x, rounded to bfloat16 (accumulated in float32)
    expected = x.astype(mx.bfloat16).astype(mx.float32).sum(axis=0).astype(mx.bfloat16)
    np.testing.assert_allclose(np64(g["weight"][0]), np64(expected), rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("dtype", [None, mx.bfloat16], ids=["float32", "autocast-bf16"])
def test_a_nan_input_gives_nan_outputs_through_a_relu_layer(calls, dtype):
    # A diverged batch must show in the loss (fluxlike.train stops on it), not be zeroed.
    layer = Dense(3, 4, relu)
    x = mx.array([[float("nan"), 1.0, 2.0], [1.0, 1.0, 1.0]])
    with autocast(dtype, enabled=dtype is not None, device="cpu"):
        y = layer(x)
    assert bool(calls) == (dtype is None or native.bfloat16_native())  # the kernel ran
    assert np.isnan(np64(y)[0]).all() and not np.isnan(np64(y)[1]).any()
