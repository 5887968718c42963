import mlx.core as mx
import numpy as np
import pytest
from helpers import check_layer_gradients, np64

from fluxlike import Chain, Dense, relu


class TestDense:
    def test_construction_positional_and_keyword(self):
        a = Dense(5, 2, relu)
        b = Dense(in_dims=5, out_dims=2, act=relu, bias=False)
        assert a.weight.shape == b.weight.shape == (2, 5)
        assert a.bias.shape == (2,) and b.bias is None
        assert "bias" not in b.parameters()

    def test_forward_matches_numpy(self):
        layer = Dense(4, 3, relu)
        x = mx.random.normal((6, 4))
        expected = np.maximum(np64(x) @ np64(layer.weight).T + np64(layer.bias), 0)
        np.testing.assert_allclose(np64(layer(x)), expected, rtol=1e-5, atol=1e-6)

    def test_batch_axes_and_dtype(self):
        out = Dense(4, 3)(mx.ones((2, 5, 4)))
        assert out.shape == (2, 5, 3) and out.dtype == mx.float32

    def test_gradients_float64(self):
        check_layer_gradients(Dense(4, 3, mx.tanh), mx.random.normal((5, 4)))

    def test_repr(self):
        assert repr(Dense(5, 2)) == "Dense(5 => 2)  # 12 parameters"
        assert repr(Dense(5, 2, relu, bias=False)) == "Dense(5 => 2, relu, bias=False)  # 10 parameters"

    def test_wrong_features_raises_and_names_layer(self):
        layer = Dense(5, 2)
        before = np64(layer.weight)
        with pytest.raises(ValueError, match=r"\[Dense\] expected input with 5 features.*\(3, 4\)"):
            layer(mx.ones((3, 4)))
        np.testing.assert_array_equal(np64(layer.weight), before)

    @pytest.mark.parametrize("bad", [0, -1, 2.5, "3"])
    def test_bad_sizes(self, bad):
        with pytest.raises(ValueError, match=r"\[Dense\] in_dims must be a positive integer"):
            Dense(bad, 2)

    def test_unknown_activation_string(self):
        with pytest.raises(ValueError, match=r"\[Dense\] unknown activation 'rleu'"):
            Dense(2, 2, "rleu")

    def test_integer_input_is_a_type_error(self):
        with pytest.raises(TypeError, match=r"\[Dense\] expected a floating-point input"):
            Dense(2, 2)(mx.array([[1, 2]]))

    def test_float64_input_warns_once_and_computes_float32(self):
        layer = Dense(2, 2)
        x = mx.ones((1, 2), dtype=mx.float64)
        with mx.stream(mx.cpu):
            with pytest.warns(UserWarning, match="float64 input converted"):
                assert layer(x).dtype == mx.float32


class TestChain:
    def test_positional_named_indexing_slicing(self):
        a, b = Dense(3, 4, relu), Dense(4, 2)
        chain = Chain(a, b)
        assert chain[0] is a and chain[-1] is b and len(chain) == 2
        assert isinstance(chain[1:], Chain) and chain[1:][0] is b
        named = Chain(enc=a, dec=b)
        assert named["enc"] is a and named[1] is b
        assert list(named[:1]) == [a]
        x = mx.random.normal((2, 3))
        np.testing.assert_allclose(np64(chain(x)), np64(b(a(x))))
        np.testing.assert_allclose(np64(named(x)), np64(chain(x)))

    def test_functions_in_chain(self):
        chain = Chain(Dense(3, 3), relu, lambda x: x * 2)
        assert chain(mx.ones((1, 3))).shape == (1, 3)

    def test_parameters_tree(self):
        named = Chain(enc=Dense(3, 4), dec=Dense(4, 2))
        assert set(named.parameters()["layers"]) == {"enc", "dec"}

    def test_gradients_float64(self):
        check_layer_gradients(Chain(Dense(3, 4, mx.tanh), Dense(4, 2)), mx.random.normal((5, 3)))

    def test_bad_construction(self):
        with pytest.raises(ValueError, match="either by position or by name"):
            Chain(Dense(2, 2), dec=Dense(2, 2))
        with pytest.raises(TypeError, match=r"\[Chain\] layer 0 must be callable"):
            Chain(3)
        with pytest.raises(KeyError, match="no layer named 'x'"):
            Chain(a=Dense(2, 2))["x"]

    def test_repr_expands_containers(self):
        text = repr(Chain(Dense(5, 3, relu), Chain(a=Dense(3, 2))))
        assert text.splitlines() == [
            "Chain(",
            "  Dense(5 => 3, relu),  # 18 parameters",
            "  Chain(",
            "    a = Dense(3 => 2),  # 8 parameters",
            "  ),  # Total: 2 arrays, 8 parameters, 32 bytes.",
            ")  # Total: 4 arrays, 26 parameters, 104 bytes.",
        ]
