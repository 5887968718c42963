import mlx.core as mx
import numpy as np
import pytest
from helpers import check_layer_gradients, np64

from fluxlike import EmbeddingBag, autocast, bf16, policy_of

REDUCE = {"mean": lambda r: r.mean(axis=0), "sum": lambda r: r.sum(axis=0),
          "max": lambda r: r.max(axis=0)}


def bags_reference(weight, bags, reduction):
    w = np64(weight)
    return np.stack([REDUCE[reduction](w[b]) if len(b) else np.zeros(w.shape[1])
                     for b in bags])


@pytest.mark.parametrize("reduction", ["mean", "sum", "max"])
class TestEmbeddingBag:
    def test_equal_bags_on_the_last_axis(self, reduction):
        layer = EmbeddingBag(10, 4, reduction)
        x = mx.array([[[1, 2, 3], [4, 5, 9]], [[0, 0, 7], [2, 8, 8]]])
        y = layer(x)
        assert y.shape == (2, 2, 4) and y.dtype == mx.float32
        expected = bags_reference(layer.weight, np.array(x).reshape(4, 3), reduction)
        np.testing.assert_allclose(np64(y).reshape(4, 4), expected, rtol=1e-6, atol=1e-6)
        one = layer(mx.array([3, 1]))
        assert one.shape == (4,)
        np.testing.assert_allclose(np64(one), bags_reference(layer.weight, [[3, 1]],
                                                             reduction)[0], rtol=1e-6)

    def test_ragged_bags_by_offsets_and_by_list(self, reduction):
        layer = EmbeddingBag(10, 3, reduction)
        bags = [[1, 2], [], [3, 4, 5, 9], [0], []]
        indices = mx.array([1, 2, 3, 4, 5, 9, 0])
        offsets = [0, 2, 2, 6, 7]
        expected = bags_reference(layer.weight, bags, reduction)
        for given in (offsets, np.array(offsets), mx.array(offsets)):
            y = layer(indices, given)
            assert y.shape == (5, 3)
            np.testing.assert_allclose(np64(y), expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np64(layer(bags)), expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np64(layer([mx.array(b, dtype=mx.int32) for b in bags])),
                                   expected, rtol=1e-6, atol=1e-6)
        assert (np64(layer([[], []])) == 0).all()

    def test_gradients_float64(self, reduction):
        check_layer_gradients(EmbeddingBag(6, 3, reduction), mx.array([[0, 2, 2], [5, 1, 3]]))
        check_layer_gradients(EmbeddingBag(6, 3, reduction), mx.array([0, 2, 2, 5, 1]),
                              mx.array([0, 1, 1, 4]))

    @pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
    def test_autocast_leaves_it_in_the_weight_dtype(self, reduction, dtype):
        layer = EmbeddingBag(10, 4, reduction)
        x = mx.array([[1, 2, 3], [4, 5, 9]])
        with autocast(dtype, device="cpu"):
            inside = layer(x)
            ragged = layer([[1, 2], [3]])
        assert inside.dtype == ragged.dtype == mx.float32
        np.testing.assert_array_equal(np64(inside), np64(layer(x)))
        half = bf16(layer)
        assert half(x).dtype == half([[1], [2, 3]]).dtype == mx.bfloat16


class TestEmbeddingBagChecks:
    def test_repr_policy_and_reduction_functions(self):
        assert repr(EmbeddingBag(10, 4)) == "EmbeddingBag(10 => 4)  # 40 parameters"
        assert repr(EmbeddingBag(10, 4, "sum")) == \
            "EmbeddingBag(10 => 4, reduction='sum')  # 40 parameters"
        assert EmbeddingBag(3, 2, mx.max).reduction == "max"
        assert EmbeddingBag(3, 2, reduction=mx.mean).reduction == "mean"
        assert policy_of(EmbeddingBag) == "none"
        assert EmbeddingBag(3, 2, init=lambda s: mx.ones(s)).weight.tolist() == [[1, 1]] * 3

    @pytest.mark.parametrize("call, error, message", [
        (lambda b: b(mx.array([[0.5, 1.0]])), TypeError,
         r"expected an mx.array of integer indices, got mlx.core.float32"),
        (lambda b: b(mx.array([[1, 10]])), ValueError,
         r"indices must lie in \[0, 10\), got values from 1 to 10"),
        (lambda b: b(mx.array([1, 2, 3]), [1, 2]), ValueError,
         r"offsets must be the 0-based start of each bag"),
        (lambda b: b(mx.array([1, 2, 3]), [0, 2, 1]), ValueError, r"offsets must .*non-decreasing"),
        (lambda b: b(mx.array([1, 2, 3]), [0, 4]), ValueError, r"offsets .*at most the number of "
                                                               r"indices \(3\)"),
        (lambda b: b(mx.array([[1, 2]]), [0]), ValueError,
         r"bag\(indices, offsets\) takes a 1-D array of indices, got shape \(1, 2\)"),
        (lambda b: b([[1, 2], [0.5]]), TypeError, r"each bag must be a 1-D list or array of "
                                                  r"integer indices, got \[0.5\] for bag 1"),
        (lambda b: b([]), ValueError, r"expected at least one bag"),
        (lambda b: b(mx.array(3)), ValueError,
         r"expected a bag of indices .*got a 0-d array; one index is a bag of one"),
        (lambda b: b(mx.array([-1, 2]), [0, 1]), ValueError, r"indices must lie in \[0, 10\)"),
    ])
    def test_bad_calls(self, call, error, message):
        with pytest.raises(error, match=r"\[EmbeddingBag\] " + message):
            call(EmbeddingBag(10, 4))

    def test_bad_construction(self):
        with pytest.raises(ValueError, match=r"\[EmbeddingBag\] reduction must be one of "
                                             r"\['mean', 'sum', 'max'\].*got 'median'"):
            EmbeddingBag(3, 2, "median")
        with pytest.raises(ValueError, match=r"\[EmbeddingBag\] dims must be a positive"):
            EmbeddingBag(3, 0)
