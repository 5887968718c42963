import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import snapshot

from fluxlike import (
    BatchNorm,
    Bilinear,
    Chain,
    Conv,
    Dense,
    Embedding,
    MaxPool,
    PairwiseFusion,
    Parallel,
    SkipConnection,
    flatten,
    modules,
    outputsize,
    relu,
    trainmode,
)


class TestOutputsize:
    def test_dense_and_conv_models(self):
        assert outputsize(Chain(Dense(5, 3, relu), Dense(3, 2)), (7, 5)) == (7, 2)
        cnn = Chain(Conv((3, 3), 1, 8, stride=2, padding=1), MaxPool((2, 2)), flatten,
                    Dense(8 * 7 * 7, 10))
        assert outputsize(cnn, (28, 28, 1), padbatch=True) == (1, 10)
        assert outputsize(cnn[:2], (4, 28, 28, 1)) == (4, 7, 7, 8)
        assert outputsize(mx.tanh, (3, 2)) == (3, 2)

    def test_several_inputs_and_structured_outputs(self):
        assert outputsize(Bilinear(2, 3, 4), (6, 2), (6, 3)) == (6, 4)
        assert outputsize(Parallel(None, Dense(2, 3), Dense(2, 1)), (5, 2)) == ((5, 3), (5, 1))
        fusion = PairwiseFusion(mx.add, Dense(2, 3), Dense(3, 4))
        assert outputsize(fusion, (5, 2), (5, 3)) == ((5, 3), (5, 4))
        assert outputsize(lambda x: {"a": x, "b": x[:, :1]}, (2, 3)) == {"a": (2, 3),
                                                                          "b": (2, 1)}

    def test_integer_inputs(self):
        assert outputsize(Embedding(10, 4), (2, 7), dtype=mx.int32) == (2, 7, 4)

    def test_nothing_is_computed(self):
        # a 4 GiB input and output: only their shapes exist
        mx.eval(mx.zeros(1))
        mx.reset_peak_memory()
        assert outputsize(Dense(1024, 1024), (1 << 20, 1024)) == (1 << 20, 1024)
        assert mx.get_peak_memory() < 64 << 20

    def test_the_model_is_left_as_it_was(self):
        model = trainmode(Chain(Dense(3, 4), BatchNorm(4)))
        before = snapshot(model)
        assert outputsize(model, (8, 3)) == (8, 4)
        after = snapshot(model)
        assert after.keys() == before.keys()
        for k in before:
            np.testing.assert_array_equal(after[k], before[k], err_msg=k)

    def test_a_shape_the_model_cannot_take_raises_its_error(self):
        with pytest.raises(ValueError, match=r"\[Dense\] expected input with 4 features"):
            outputsize(Chain(Dense(3, 5), Dense(4, 2)), (2, 3))

    @pytest.mark.parametrize("call, error, message", [
        (lambda: outputsize(Dense(2, 2), (2, -1)), ValueError,
         r"\[outputsize\] each input shape must be a tuple of non-negative integers, "
         r"got \(2, -1\)"),
        (lambda: outputsize(Dense(2, 2)), ValueError, r"\[outputsize\] give the shape of each "
                                                      r"input"),
        (lambda: outputsize("model", (2, 2)), TypeError, r"\[outputsize\] model must be "
                                                         r"callable"),
    ])
    def test_bad_arguments(self, call, error, message):
        with pytest.raises(error, match=message):
            call()


class TestModules:
    def test_depth_first_in_order_itself_first(self):
        inner = Chain(Dense(4, 3), BatchNorm(3))
        model = Chain(inner, SkipConnection(Dense(3, 3), mx.add), Dense(3, 2))
        found = modules(model)
        assert [type(m).__name__ for m in found] == [
            "Chain", "Chain", "Dense", "BatchNorm", "SkipConnection", "Dense", "Dense"]
        assert found[0] is model and found[1] is inner and found[2] is inner[0]

    def test_shared_modules_once_and_named_children(self):
        shared = Dense(2, 2)
        model = Chain(shared, relu, shared, Parallel(mx.add, a=shared, b=Dense(2, 2)))
        found = modules(model)
        assert [type(m).__name__ for m in found] == ["Chain", "Dense", "Parallel", "Dense"]
        assert sum(m is shared for m in found) == 1

    def test_mlx_nn_modules(self):
        model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 1)))
        assert [type(m).__name__ for m in modules(model)] == [
            "Sequential", "Linear", "ReLU", "Sequential", "Linear"]

    def test_a_penalty_over_every_dense_weight(self):
        model = Chain(Dense(2, 3), Chain(Dense(3, 3)), Dense(3, 1))
        total = sum(mx.sum(m.weight**2) for m in modules(model) if isinstance(m, Dense))
        expected = sum(float(mx.sum(layer.weight**2)) for layer in (model[0], model[1][0],
                                                                    model[2]))
        assert abs(total.item() - expected) < 1e-4

    def test_not_a_module(self):
        with pytest.raises(TypeError, match=r"\[modules\] expected an mlx.nn.Module, got list"):
            modules([Dense(2, 2)])
