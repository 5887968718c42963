import mlx.core as mx
import numpy as np
import pytest
from helpers import check_layer_gradients, normal, np64

from fluxlike import Chain, Dense, Maxout, PairwiseFusion, autocast, policy_of, relu


def dense_np(layer, x):
    return np64(x) @ np64(layer.weight).T + np64(layer.bias)


class TestMaxout:
    def test_elementwise_maximum_of_the_layers(self):
        layers = [Dense(4, 3), Dense(4, 3), Dense(4, 3)]
        x = normal(5, 4)
        y = Maxout(*layers)(x)
        expected = np.maximum.reduce([dense_np(layer, x) for layer in layers])
        assert y.shape == (5, 3) and y.dtype == mx.float32
        np.testing.assert_allclose(np64(y), expected, rtol=1e-6, atol=1e-6)

    def test_factory_makes_independent_copies(self):
        m = Maxout(lambda: Dense(4, 3, relu), 4)
        assert len(m) == 4 and all(isinstance(layer, Dense) for layer in m.layers)
        w = [np64(layer.weight) for layer in m.layers]
        assert not np.allclose(w[0], w[1])
        assert len(m.trainable_parameters()["layers"]) == 4

    def test_plain_functions_and_one_layer(self):
        x = normal(3, 2)
        np.testing.assert_array_equal(np64(Maxout(mx.sin, mx.cos)(x)),
                                      np.maximum(np.sin(np64(x)), np.cos(np64(x))).astype(
                                          np.float32))
        np.testing.assert_array_equal(np64(Maxout(mx.abs)(x)), np.abs(np64(x)))

    def test_gradients_float64(self):
        check_layer_gradients(Maxout(Dense(4, 3), Dense(4, 3, mx.tanh)), normal(6, 4))

    def test_indexing_and_slicing(self):
        a, b, c = Dense(2, 2), Dense(2, 2), Dense(2, 2)
        m = Maxout(a, b, c)
        assert m[0] is a and m[-1] is c
        assert isinstance(m[1:], Maxout) and len(m[1:]) == 2 and m[1:][0] is b

    @pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
    def test_autocast_layers_compute_in_half_and_gradients_stay_float32(self, dtype):
        assert policy_of(Maxout) == "none"
        m = Maxout(lambda: Dense(4, 3), 2)
        x = normal(5, 4)
        with autocast(dtype, device="cpu"):
            y = m(x)
        assert y.dtype == dtype
        np.testing.assert_allclose(np64(y), np64(m(x)), rtol=3e-2, atol=3e-2)

        def loss(params):
            m.update(params)
            with autocast(dtype, device="cpu"):
                return mx.sum(m(x).astype(mx.float32))

        grads = mx.grad(loss)(m.trainable_parameters())
        assert {g["weight"].dtype for g in grads["layers"]} == {mx.float32}

    def test_repr(self):
        assert repr(Maxout(Dense(2, 3), Dense(2, 3))) == (
            "Maxout(\n"
            "  Dense(2 => 3),  # 9 parameters\n"
            "  Dense(2 => 3),  # 9 parameters\n"
            ")  # Total: 4 arrays, 18 parameters, 72 bytes."
        )
        assert repr(Chain(Maxout(mx.abs), relu)).splitlines()[1] == "  Maxout("

    def test_errors(self):
        with pytest.raises(TypeError, match=r"\[Maxout\] Maxout\(make, n\) takes a function "
                                            r"that makes a new layer, got the layer Dense"):
            Maxout(Dense(2, 2), 3)
        with pytest.raises(ValueError, match=r"\[Maxout\] n must be a positive integer, got 0"):
            Maxout(lambda: Dense(2, 2), 0)
        with pytest.raises(ValueError, match=r"\[Maxout\] needs at least one layer"):
            Maxout()
        with pytest.raises(TypeError, match=r"\[Maxout\] layer 1 must be callable"):
            Maxout(Dense(2, 2), "relu")
        m = Maxout(Dense(2, 2), Dense(2, 3))
        with pytest.raises(ValueError, match=r"\[Maxout\] the layers' outputs must share one "
                                             r"shape, got \(4, 2\) from layer 0 and \(4, 3\) "
                                             r"from layer 1"):
            m(mx.ones((4, 2)))


class TestPairwiseFusion:
    def test_each_step_sees_the_last_output_and_its_own_input(self):
        f1, f2, f3 = Dense(2, 3), Dense(3, 3), Dense(3, 1)
        p = PairwiseFusion(mx.add, f1, f2, f3)
        x1, x2, x3 = normal(4, 2, seed=1), normal(4, 3, seed=2), normal(4, 3, seed=3)
        y1 = dense_np(f1, x1)
        y2 = dense_np(f2, mx.array(y1 + np64(x2), dtype=mx.float32))
        y3 = dense_np(f3, mx.array(y2 + np64(x3), dtype=mx.float32))
        for out in (p(x1, x2, x3), p((x1, x2, x3))):
            assert isinstance(out, tuple) and len(out) == 3
            for got, want in zip(out, (y1, y2, y3), strict=True):
                np.testing.assert_allclose(np64(got), want, rtol=1e-5, atol=1e-5)

    def test_one_input_is_every_input(self):
        p = PairwiseFusion(lambda y, x: y * x, Dense(3, 3), Dense(3, 3))
        x = normal(2, 3)
        a, b = p(x)
        np.testing.assert_allclose(np64(b), np64(p[1](a * x)), rtol=1e-6)

    def test_named_layers_and_indexing(self):
        p = PairwiseFusion(mx.add, first=Dense(2, 2), second=Dense(2, 2))
        assert p.first is p["first"] is p[0] and p.second is p[-1]
        sliced = p[1:]
        assert isinstance(sliced, PairwiseFusion) and len(sliced) == 1
        assert sliced.connection is mx.add

    def test_gradients_float64(self):
        p = PairwiseFusion(mx.multiply, Dense(3, 3, mx.tanh), Dense(3, 2))
        check_layer_gradients(p, normal(4, 3, seed=1), normal(4, 3, seed=2))

    @pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
    def test_autocast(self, dtype):
        p = PairwiseFusion(mx.add, Dense(2, 3), Dense(3, 3))
        x1, x2 = normal(4, 2), normal(4, 3)
        with autocast(dtype, device="cpu"):
            y1, y2 = p(x1, x2)
        assert y1.dtype == y2.dtype == dtype
        np.testing.assert_allclose(np64(y2), np64(p(x1, x2)[1]), rtol=5e-2, atol=5e-2)

    def test_repr(self):
        p = PairwiseFusion(mx.add, a=Dense(2, 2), b=Dense(2, 2))
        assert repr(p).splitlines() == [
            "PairwiseFusion(",
            "  add,",
            "  a = Dense(2 => 2),  # 6 parameters",
            "  b = Dense(2 => 2),  # 6 parameters",
            ")  # Total: 4 arrays, 12 parameters, 48 bytes.",
        ]

    def test_errors(self):
        with pytest.raises(TypeError, match=r"\[PairwiseFusion\] connection must be a callable"):
            PairwiseFusion("add", Dense(2, 2))
        with pytest.raises(ValueError, match=r"\[PairwiseFusion\] needs at least one layer"):
            PairwiseFusion(mx.add)
        p = PairwiseFusion(mx.add, Dense(2, 2), Dense(2, 2), Dense(2, 2))
        with pytest.raises(ValueError, match=r"\[PairwiseFusion\] with 3 layers takes one input "
                                             r"or 3 inputs, got 2"):
            p(mx.ones((1, 2)), mx.ones((1, 2)))
        with pytest.raises(ValueError, match=r"\[PairwiseFusion\] give layers either by "
                                             r"position or by name, not both"):
            PairwiseFusion(mx.add, Dense(2, 2), b=Dense(2, 2))
