import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import check_layer_gradients, normal, np64
from mlx.utils import tree_flatten

from fluxlike import (
    Adam,
    Chain,
    Conv,
    Dense,
    WeightNorm,
    autocast,
    f16mix,
    gradient,
    policy_of,
    setup,
    update,
)


def reference(layer, x):
    """act(x @ (g * v / |v|).T + b) with the norm over each row of v, in numpy."""
    v, g = np64(layer.layer.weight), np64(layer.g)
    w = g * v / np.linalg.norm(v, axis=1, keepdims=True)
    return np64(x) @ w.T + np64(layer.layer.bias)


class TestWeightNorm:
    def test_starts_as_the_wrapped_layer_and_has_one_magnitude_per_output(self):
        dense = Dense(4, 3)
        x = normal(5, 4)
        before = np64(dense(x))
        layer = WeightNorm(dense)
        assert layer.g.shape == (3, 1) and layer.layer is dense
        np.testing.assert_allclose(np64(layer.g)[:, 0], np.linalg.norm(np64(dense.weight), axis=1),
                                   rtol=1e-6)
        np.testing.assert_allclose(np64(layer(x)), before, rtol=1e-5, atol=1e-6)

    def test_forward_is_g_times_the_direction(self):
        layer = WeightNorm(Dense(4, 3))
        layer.g = normal(3, 1, seed=2)
        x = normal(5, 4)
        np.testing.assert_allclose(np64(layer(x)), reference(layer, x), rtol=1e-5, atol=1e-5)
        # the direction alone: scaling v changes nothing
        layer.layer.weight = layer.layer.weight * 7.0
        np.testing.assert_allclose(np64(layer(x)), reference(layer, x), rtol=1e-5, atol=1e-5)

    def test_the_layer_keeps_its_direction_after_a_call(self):
        layer = WeightNorm(Dense(4, 3))
        v = layer.layer.weight
        layer.g = layer.g * 2
        layer(normal(2, 4))
        assert layer.layer.weight is v

    @pytest.mark.parametrize("dims, g_shape", [(0, (4, 1, 1)), (None, (1, 1, 1)),
                                               ((0, -1), (4, 1, 2))])
    def test_conv_and_dims(self, dims, g_shape):
        conv = Conv((3,), 2, 4, padding=1)
        layer = WeightNorm(conv, dims=dims)
        assert layer.g.shape == g_shape
        x = normal(2, 5, 2)
        np.testing.assert_allclose(np64(layer(x)), np64(conv(x)), rtol=1e-5, atol=1e-5)

    def test_gradients_float64(self):
        layer = WeightNorm(Dense(4, 3, mx.tanh))
        layer.g = normal(3, 1, seed=3)
        check_layer_gradients(layer, normal(5, 4))
        check_layer_gradients(WeightNorm(nn.Linear(3, 2), dims=None), normal(4, 3))

    def test_parameters_train_and_keep_their_names(self):
        model = Chain(WeightNorm(Dense(3, 4, "relu")), Dense(4, 1))
        keys = sorted(k for k, _ in tree_flatten(model.trainable_parameters()))
        assert keys == ["layers.0.g", "layers.0.layer.bias", "layers.0.layer.weight",
                        "layers.1.bias", "layers.1.weight"]
        x, y = normal(16, 3), normal(16, 1, seed=1)
        state = setup(Adam(1e-2), model)
        g0, v0 = np64(model[0].g), np64(model[0].layer.weight)

        def loss(m):
            return mx.mean((m(x) - y) ** 2)

        first = loss(model).item()
        for _ in range(20):
            grads, = gradient(loss, model)
            update(state, model, grads)
        assert loss(model).item() < first
        assert not np.allclose(np64(model[0].g), g0) and not np.allclose(
            np64(model[0].layer.weight), v0)

    @pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
    def test_autocast_the_layer_computes_in_half_and_gradients_stay_float32(self, dtype):
        assert policy_of(WeightNorm) == "none"
        layer = WeightNorm(Dense(4, 3))
        x = normal(5, 4)
        with autocast(dtype, device="cpu"):
            y = layer(x)
        assert y.dtype == dtype and layer.layer.weight.dtype == mx.float32
        np.testing.assert_allclose(np64(y), np64(layer(x)), rtol=3e-2, atol=3e-2)
        grads, = gradient(lambda m: mx.sum(m(x)), layer, autocast=dtype)
        assert grads["g"].dtype == grads["layer"]["weight"].dtype == mx.float32

    def test_half_storage(self):
        half = f16mix(WeightNorm(Dense(4, 3)))
        assert half.g.dtype == mx.float16
        assert half(normal(2, 4)).dtype == mx.float16

    def test_remove_folds_the_magnitude_in(self):
        layer = WeightNorm(Dense(4, 3))
        layer.g = normal(3, 1, seed=5)
        x = normal(2, 4)
        expected = np64(layer(x))
        plain = layer.remove()
        assert isinstance(plain, Dense)
        np.testing.assert_allclose(np64(plain(x)), expected, rtol=1e-5, atol=1e-6)

    def test_repr(self):
        assert repr(WeightNorm(Dense(3, 2))) == "WeightNorm(Dense(3 => 2))  # 10 parameters"
        assert repr(WeightNorm(Conv((3,), 1, 2), dims=None)) == \
            "WeightNorm(Conv((3,), 1 => 2), dims=None)  # 9 parameters"
        assert repr(Chain(WeightNorm(Dense(3, 2)))).splitlines()[1] == \
            "  WeightNorm(Dense(3 => 2)),  # 10 parameters"

    def test_errors(self):
        with pytest.raises(ValueError, match=r"\[WeightNorm\] Dense has no floating parameter "
                                             r"'kernel'; its arrays are \['weight', 'bias'\]"):
            WeightNorm(Dense(3, 2), "kernel")
        with pytest.raises(TypeError, match=r"\[WeightNorm\] expected a layer"):
            WeightNorm(mx.tanh)
        with pytest.raises(ValueError, match=r"\[WeightNorm\] dims must be None, an axis or a "
                                             r"tuple of axes of the 2-d weight, got 2"):
            WeightNorm(Dense(3, 2), dims=2)
