import mlx.core as mx
import numpy as np
import pytest
from helpers import check_gradients, check_layer_gradients, np64

from fluxlike import (
    Bilinear,
    Chain,
    Dense,
    Embedding,
    Parallel,
    Scale,
    SkipConnection,
    autocast,
    flatten,
    relu,
)
from fluxlike.precision import kernels


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
        assert repr(Dense(5, 2, relu, bias=False)) == \
            "Dense(5 => 2, relu, bias=False)  # 10 parameters"

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
            with pytest.warns(UserWarning, match="float64 input converted") as seen:
                assert layer(x).dtype == mx.float32
        assert seen[0].filename == __file__  # the user's line, not fluxlike's

    def test_float64_input_under_autocast_says_the_dtype_it_computes_in(self):
        from fluxlike.precision import operands
        operands._warned_float64.discard("Dense")
        with autocast(mx.bfloat16), pytest.warns(
                UserWarning, match=r"\[Dense\] float64 input converted to mlx.core.bfloat16"):
            assert Dense(2, 2)(mx.ones((1, 2), dtype=mx.float64)).dtype == mx.bfloat16


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
        with pytest.raises(ValueError, match=r"\[Chain\] \['layers'\] cannot name a layer"):
            Chain(layers=Dense(2, 2))
        with pytest.raises(ValueError, match=r"\['_training'\] cannot name a layer \(reserved, "
                                             r"or private to mlx.nn.Module"):
            Chain(_training=Dense(2, 2))  # model.train() assigns that attribute

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


def bilinear_reference(layer, x1, x2):
    w = np64(layer.weight)
    out = np.einsum("...i,kij,...j->...k", np64(x1), w, np64(x2))
    return out if layer.bias is None else out + np64(layer.bias)


class TestBilinear:
    def test_construction_positional_and_keyword(self):
        a = Bilinear(5, 4, 3, relu)
        b = Bilinear(in1=5, in2=4, out=3, act=relu, bias=False, init=mx.ones)
        assert a.weight.shape == b.weight.shape == (3, 5, 4)
        assert a.bias.shape == (3,) and b.bias is None and "bias" not in b.parameters()
        assert a.act is relu and np64(b.weight).min() == 1

    def test_forward_matches_numpy(self):
        layer = Bilinear(5, 4, 3)
        layer.bias = mx.random.normal((3,))
        x1, x2 = mx.random.normal((2, 6, 5)), mx.random.normal((2, 6, 4))
        out = layer(x1, x2)
        assert out.shape == (2, 6, 3) and out.dtype == mx.float32
        np.testing.assert_allclose(np64(out), bilinear_reference(layer, x1, x2),
                                   rtol=1e-5, atol=1e-5)

    def test_tuple_and_single_input(self):
        layer = Bilinear(3, 3, 2, mx.tanh)
        x, z = mx.random.normal((4, 3)), mx.random.normal((4, 3))
        np.testing.assert_array_equal(np64(layer((x, z))), np64(layer(x, z)))
        np.testing.assert_allclose(np64(layer(x)), np.tanh(bilinear_reference(layer, x, x)),
                                   rtol=1e-5, atol=1e-6)
        assert layer(mx.ones((3,)), mx.ones((3,))).shape == (2,)  # no batch axis

    def test_in_a_chain_after_parallel(self):
        model = Chain(Parallel(None, Dense(2, 3), Dense(2, 4)), Bilinear(3, 4, 1))
        assert model(mx.ones((5, 2))).shape == (5, 1)

    def test_gradients_float64(self):
        check_layer_gradients(Bilinear(3, 4, 2, mx.tanh), mx.random.normal((5, 3)),
                              mx.random.normal((5, 4)))

    def test_repr(self):
        assert repr(Bilinear(5, 4, 3)) == "Bilinear((5, 4) => 3)  # 63 parameters"
        assert repr(Bilinear(2, 2, 3, "tanh", bias=False)) == \
            "Bilinear((2, 2) => 3, tanh, bias=False)  # 12 parameters"

    def test_autocast_computes_in_half_through_ops(self, monkeypatch):
        layer = Bilinear(3, 4, 2)
        calls = []
        for name in ("linear", "matmul"):
            kernel = getattr(kernels, name)
            monkeypatch.setattr(kernels, name, lambda *a, k=kernel, n=name: calls.append(
                (n, a[0].dtype, a[1].dtype)) or k(*a))
        x1, x2 = mx.random.normal((5, 3)), mx.random.normal((5, 4))
        with autocast(mx.float16, device="cpu"):
            out = layer(x1, x2)
        assert out.dtype == mx.float16 and layer.weight.dtype == mx.float32
        assert calls == [("linear", mx.float16, mx.float16), ("matmul", mx.float16, mx.float16)]
        np.testing.assert_allclose(np64(out), bilinear_reference(layer, x1, x2),
                                   rtol=2e-2, atol=2e-2)

        def loss(params):
            layer.update(params)
            with autocast(mx.float16, device="cpu"):
                return mx.sum(layer(x1, x2))

        grads = mx.grad(loss)(layer.trainable_parameters())
        assert grads["weight"].dtype == grads["bias"].dtype == mx.float32

    def test_bad_input_raises_and_leaves_model_unchanged(self):
        layer = Bilinear(3, 4, 2)
        before = np64(layer.weight)
        with pytest.raises(ValueError, match=r"\[Bilinear\] expected input with 4 features.*"
                                             r"\(5, 3\)"):
            layer(mx.ones((5, 3)), mx.ones((5, 3)))
        with pytest.raises(ValueError, match=r"\[Bilinear\] .*batch axes.*\(5, 3\) and \(6, 4\)"):
            layer(mx.ones((5, 3)), mx.ones((6, 4)))
        with pytest.raises(ValueError, match=r"\[Bilinear\] expected a pair of inputs, got 3"):
            layer((mx.ones((5, 3)),) * 3)
        with pytest.raises(TypeError, match=r"\[Bilinear\] expected a floating-point input"):
            layer(mx.ones((5, 3), dtype=mx.int32), mx.ones((5, 4)))
        np.testing.assert_array_equal(np64(layer.weight), before)

    def test_bad_sizes(self):
        with pytest.raises(ValueError, match=r"\[Bilinear\] in2 must be a positive integer"):
            Bilinear(3, 0, 2)


class TestScale:
    def test_construction_positional_and_keyword(self):
        a = Scale(3, relu)
        b = Scale(size=(2, 3), act=relu, bias=False, init=mx.zeros)
        assert a.weight.shape == a.bias.shape == (3,) and np64(a.weight).tolist() == [1, 1, 1]
        assert b.weight.shape == (2, 3) and b.bias is None and np64(b.weight).max() == 0

    def test_forward_matches_numpy_and_broadcasts(self):
        layer = Scale(4, mx.tanh)
        layer.weight, layer.bias = mx.random.normal((4,)), mx.random.normal((4,))
        x = mx.random.normal((2, 3, 4))
        expected = np.tanh(np64(layer.weight) * np64(x) + np64(layer.bias))
        np.testing.assert_allclose(np64(layer(x)), expected, rtol=1e-5, atol=1e-6)
        assert Scale((1, 4))(mx.ones((2, 3, 4))).shape == (2, 3, 4)

    def test_dtypes(self):
        layer = Scale(3)
        assert layer(mx.ones((2, 3), dtype=mx.bfloat16)).dtype == mx.bfloat16
        assert layer(mx.array([[1, 2, 3]])).dtype == mx.float32  # integers: parameter dtype
        with autocast(mx.float16, device="cpu"):  # policy "none": input dtype either way
            assert layer(mx.ones((2, 3), dtype=mx.float16)).dtype == mx.float16
            assert layer(mx.ones((2, 3))).dtype == mx.float32
        assert layer.weight.dtype == mx.float32

    def test_gradients_float64(self):
        layer = Scale(3, mx.tanh)
        layer.weight = mx.random.normal((3,))
        check_layer_gradients(layer, mx.random.normal((4, 3)))

    def test_repr(self):
        assert repr(Scale(3)) == "Scale(3)  # 6 parameters"
        assert repr(Scale((2, 3), "relu", bias=False)) == \
            "Scale((2, 3), relu, bias=False)  # 6 parameters"

    def test_bad_input_raises_and_leaves_model_unchanged(self):
        layer = Scale(3)
        with pytest.raises(ValueError, match=r"\[Scale\] expected input whose trailing axes "
                                             r"match \(3,\), got shape \(2, 4\)"):
            layer(mx.ones((2, 4)))
        with pytest.raises(ValueError, match=r"\[Scale\] .*got shape \(3,\)"):
            Scale((2, 3))(mx.ones((3,)))
        with pytest.raises(TypeError, match=r"\[Scale\] expected an mx.array"):
            layer([1.0, 2.0, 3.0])
        assert np64(layer.weight).tolist() == [1, 1, 1]

    @pytest.mark.parametrize("bad", [0, (2, 0), (), "3", 2.0])
    def test_bad_sizes(self, bad):
        with pytest.raises(ValueError, match=r"\[Scale\] size must be a positive integer"):
            Scale(bad)


class TestSkipConnection:
    def test_forward_and_numpy(self):
        inner = Dense(3, 3, mx.tanh)
        block = SkipConnection(inner, mx.add)
        x = mx.random.normal((4, 3))
        expected = np.tanh(np64(x) @ np64(inner.weight).T + np64(inner.bias)) + np64(x)
        np.testing.assert_allclose(np64(block(x)), expected, rtol=1e-5, atol=1e-6)
        keyword = SkipConnection(layers=inner, connection=lambda a, b: mx.concatenate([a, b], -1))
        assert keyword(x).shape == (4, 6) and keyword.layers is inner

    def test_layer_connection_owns_parameters(self):
        block = SkipConnection(Dense(3, 2), Bilinear(2, 3, 4))
        assert block(mx.ones((5, 3))).shape == (5, 4)
        assert set(block.parameters()) == {"layers", "connection"}

    def test_gradients_float64(self):
        check_layer_gradients(SkipConnection(Dense(3, 3, mx.tanh), mx.multiply),
                              mx.random.normal((4, 3)))

    def test_dtype_under_autocast(self):
        block = SkipConnection(Dense(3, 3), mx.add)
        with autocast(mx.bfloat16, device="cpu"):
            assert block(mx.ones((2, 3), dtype=mx.bfloat16)).dtype == mx.bfloat16

    def test_repr_expands(self):
        assert repr(SkipConnection(Dense(3, 3), mx.add)).splitlines() == [
            "SkipConnection(",
            "  Dense(3 => 3),  # 12 parameters",
            "  add,",
            ")  # Total: 2 arrays, 12 parameters, 48 bytes.",
        ]

    def test_bad_construction(self):
        with pytest.raises(TypeError, match=r"\[SkipConnection\] connection must be callable"):
            SkipConnection(Dense(2, 2), "add")


class TestParallel:
    def test_one_input_goes_to_every_layer(self):
        a, b = Dense(2, 3), Dense(2, 3, relu)
        p = Parallel(mx.add, a, b)
        x = mx.random.normal((4, 2))
        np.testing.assert_allclose(np64(p(x)), np64(a(x)) + np64(b(x)), rtol=1e-6)
        assert p[0] is a and p[-1] is b and len(p) == 2

    def test_inputs_one_to_one_as_args_or_tuple(self):
        p = Parallel(lambda u, v: mx.concatenate([u, v], -1), a=Dense(2, 3), b=Dense(4, 1))
        x, z = mx.random.normal((5, 2)), mx.random.normal((5, 4))
        expected = np.concatenate([np64(p["a"](x)), np64(p["b"](z))], -1)
        np.testing.assert_allclose(np64(p(x, z)), expected, rtol=1e-6)
        np.testing.assert_array_equal(np64(p((x, z))), np64(p(x, z)))
        assert p[1] is p["b"] and list(p[:1].layers) == ["a"]

    def test_one_layer_many_inputs_and_none_connection(self):
        layer = Dense(2, 3)
        outputs = Parallel(None, layer)(mx.ones((1, 2)), mx.zeros((4, 2)))
        assert isinstance(outputs, tuple) and [o.shape for o in outputs] == [(1, 3), (4, 3)]

    def test_parameters_tree(self):
        p = Parallel(Bilinear(3, 3, 1), a=Dense(2, 3), b=Dense(2, 3))
        assert set(p.parameters()) == {"connection", "layers"}
        assert set(p.parameters()["layers"]) == {"a", "b"}
        assert p(mx.ones((4, 2))).shape == (4, 1)

    def test_gradients_float64(self):
        p = Parallel(mx.multiply, Dense(3, 2, mx.tanh), Dense(4, 2))
        check_layer_gradients(p, mx.random.normal((5, 3)), mx.random.normal((5, 4)))

    def test_repr(self):
        assert repr(Parallel(mx.add, a=Dense(2, 3), b=Dense(4, 3))).splitlines() == [
            "Parallel(",
            "  add,",
            "  a = Dense(2 => 3),  # 9 parameters",
            "  b = Dense(4 => 3),  # 15 parameters",
            ")  # Total: 4 arrays, 24 parameters, 96 bytes.",
        ]

    def test_bad_calls_and_construction(self):
        p = Parallel(mx.add, Dense(2, 2), Dense(2, 2), Dense(2, 2))
        with pytest.raises(ValueError, match=r"\[Parallel\] with 3 layers takes one input or 3 "
                                             r"inputs, got 2"):
            p(mx.ones((1, 2)), mx.ones((1, 2)))
        with pytest.raises(ValueError, match=r"\[Parallel\] expected at least one input"):
            p()
        with pytest.raises(ValueError, match=r"\[Parallel\] needs at least one layer"):
            Parallel(mx.add)
        with pytest.raises(ValueError, match=r"either by position or by name"):
            Parallel(mx.add, Dense(2, 2), b=Dense(2, 2))
        with pytest.raises(ValueError, match=r"\['layers'\] cannot name a layer"):
            Parallel(mx.add, layers=Dense(2, 2))
        with pytest.raises(TypeError, match=r"\[Parallel\] connection must be callable or None"):
            Parallel("add", Dense(2, 2))
        with pytest.raises(TypeError, match=r"\[Parallel\] layer 1 must be callable"):
            Parallel(mx.add, Dense(2, 2), 3)
        with pytest.raises(KeyError, match=r"no layer named 'c'"):
            Parallel(mx.add, a=Dense(2, 2))["c"]


class TestEmbedding:
    def test_construction_and_lookup_matches_numpy(self):
        emb = Embedding(10, 4)
        keyword = Embedding(vocab=10, dims=4, init=mx.zeros)
        assert emb.weight.shape == (10, 4) and np64(keyword.weight).max() == 0
        idx = mx.array([[1, 2, 3], [9, 0, 3]])
        out = emb(idx)
        assert out.shape == (2, 3, 4) and out.dtype == mx.float32
        np.testing.assert_array_equal(np64(out), np64(emb.weight)[np.array(idx)])
        assert emb(mx.array(7)).shape == (4,)
        assert emb(mx.array([1, 2], dtype=mx.uint8)).shape == (2, 4)
        assert emb(mx.zeros((0,), dtype=mx.int32)).shape == (0, 4)

    def test_default_init_is_standard_normal(self):
        w = np64(Embedding(400, 50).weight)
        assert abs(w.mean()) < 0.02 and abs(w.std() - 1) < 0.02

    def test_dtype_under_autocast_stays_float32(self):
        emb = Embedding(5, 3)
        with autocast(mx.float16, device="cpu"):
            assert emb(mx.array([1, 2])).dtype == mx.float32

    def test_gradients_float64(self):
        emb, idx = Embedding(6, 3), mx.array([[0, 2, 2], [5, 1, 0]])
        r = mx.random.normal((2, 3, 3)).astype(mx.float64)

        def loss(weight, unused):
            # helpers.check_gradients needs two arguments: mx.grad returns a bare array
            # (not a tuple) for a single one
            emb.weight = weight
            return mx.sum(emb(idx) * r) + 0 * mx.sum(unused)

        with mx.stream(mx.cpu):
            check_gradients(loss, emb.weight.astype(mx.float64), mx.zeros((1,), mx.float64))

    def test_repr(self):
        assert repr(Embedding(10, 4)) == "Embedding(10 => 4)  # 40 parameters"

    @pytest.mark.parametrize("bad", [[-1, 2], [0, 10], [10**6]])
    def test_out_of_range_is_a_clear_error(self, bad):
        emb = Embedding(10, 4)
        before = np64(emb.weight)
        with pytest.raises(ValueError, match=r"\[Embedding\] indices must lie in \[0, 10\), "
                                             rf"got values from {min(bad)} to {max(bad)}"):
            emb(mx.array(bad))
        np.testing.assert_array_equal(np64(emb.weight), before)

    def test_compiled_out_of_range_rows_are_nan(self):
        emb = Embedding(5, 3)
        out = mx.compile(lambda i: emb(i))(mx.array([1, 5, -1]))
        np.testing.assert_array_equal(np64(out[0]), np64(emb.weight[1]))
        assert np.isnan(np64(out[1:])).all()

    @pytest.mark.parametrize("bad", [mx.ones((2,)), mx.array([True, False]), [1, 2]])
    def test_non_integer_input_is_a_type_error(self, bad):
        with pytest.raises(TypeError, match=r"\[Embedding\] expected an mx.array of integer "
                                            r"indices"):
            Embedding(4, 2)(bad)

    def test_bad_sizes(self):
        with pytest.raises(ValueError, match=r"\[Embedding\] dims must be a positive integer"):
            Embedding(4, 0)


class TestFlatten:
    def test_shapes_numpy_and_chain(self):
        x = mx.random.normal((2, 3, 4, 5))
        np.testing.assert_array_equal(np64(flatten(x)), np64(x).reshape(2, 60))
        assert flatten(mx.ones((3,))).shape == (3, 1)
        assert flatten(mx.ones((3, 2), dtype=mx.float16)).dtype == mx.float16
        assert Chain(flatten, Dense(12, 2))(mx.ones((5, 3, 4))).shape == (5, 2)

    def test_bad_input(self):
        with pytest.raises(ValueError, match=r"\[flatten\] expected an input with a batch axis"):
            flatten(mx.array(1.0))
        with pytest.raises(TypeError, match=r"\[flatten\] expected an mx.array"):
            flatten([[1.0]])


def test_sizes_of_any_integer_type_are_stored_as_ints_but_bools_refused():
    i64 = np.int64
    layers = {
        "Dense(4 => 3)  # 15 parameters": Dense(i64(4), i64(3)),
        "Bilinear((2, 3) => 4)  # 28 parameters": Bilinear(i64(2), np.int32(3), np.uint8(4)),
        "Scale(3)  # 6 parameters": Scale(i64(3)),
        "Scale((2, 3))  # 12 parameters": Scale((i64(2), np.int16(3))),
        "Embedding(10 => 4)  # 40 parameters": Embedding(i64(10), i64(4)),
    }
    for text, layer in layers.items():
        assert repr(layer) == text
        assert all(type(n) is int for n in layer.weight.shape)
    assert Dense(i64(4), 3)(mx.ones((2, 4))).shape == (2, 3)
    assert Embedding(i64(10), 2)(mx.array([9])).shape == (1, 2)
    for bad in (True, False, np.bool_(True)):  # bools are integers to Python, not sizes
        with pytest.raises(ValueError, match=r"\[Dense\] in_dims must be a positive integer"):
            Dense(bad, 2)
        with pytest.raises(ValueError, match=r"\[Bilinear\] out must be a positive integer"):
            Bilinear(2, 2, bad)
        with pytest.raises(ValueError, match=r"\[Scale\] size must be a positive integer"):
            Scale((2, bad))
        with pytest.raises(ValueError, match=r"\[Embedding\] vocab must be a positive integer"):
            Embedding(bad, 2)


@pytest.mark.parametrize("make", [
    lambda bias: Dense(3, 2, bias=bias),
    lambda bias: Bilinear(2, 3, 4, bias=bias),
    lambda bias: Scale(3, bias=bias),
], ids=["Dense", "Bilinear", "Scale"])
def test_bias_must_be_a_bool(make):
    name = type(make(True)).__name__
    for bad in ("no", 0, 1, None, "False"):
        with pytest.raises(TypeError, match=rf"^\[{name}\] bias must be True or False, "
                                            rf"got {bad!r}$"):
            make(bad)
    assert make(np.bool_(False)).bias is None
    assert make(np.bool_(True)).bias is not None
    assert repr(make(np.bool_(False))).split("  #")[0].endswith("bias=False)")


def test_init_must_return_an_array_of_the_requested_shape():
    with pytest.raises(ValueError, match=r"^\[Dense\] init returned shape \(5, 7\), "
                                         r"expected \(2, 3\)$"):
        Dense(3, 2, init=lambda s: mx.ones((5, 7)))
    with pytest.raises(ValueError, match=r"\[Bilinear\] init returned shape \(4, 2\), "
                                         r"expected \(4, 2, 3\)"):
        Bilinear(2, 3, 4, init=lambda s: mx.ones(s[:2]))
    with pytest.raises(ValueError, match=r"\[Scale\] init returned shape \(\), expected \(3,\)"):
        Scale(3, init=lambda s: mx.array(1.0))
    with pytest.raises(ValueError, match=r"\[Embedding\] init returned shape \(4, 10\)"):
        Embedding(10, 4, init=lambda s: mx.zeros(s[::-1]))
    with pytest.raises(TypeError, match=r"\[Dense\] init returned an array of dtype "
                                        r"mlx.core.int32, expected a floating dtype"):
        Dense(3, 2, init=lambda s: mx.zeros(s, mx.int32))
    with pytest.raises(TypeError, match=r"\[Embedding\] init must return an mx.array"):
        Embedding(10, 4, init=np.zeros)
    with pytest.raises(TypeError, match=r"\[Dense\] init must be a function of a shape"):
        Dense(3, 2, init="glorot_uniform")
    seen = []
    Dense(np.int64(3), np.int32(2), init=lambda s: seen.append(s) or mx.zeros(s))
    assert seen == [(2, 3)] and all(type(n) is int for n in seen[0])


def test_container_index_errors_name_the_container_and_the_range():
    a, b = Dense(3, 4), Dense(4, 2)
    chain = Chain(a, b)
    with pytest.raises(IndexError, match=r"^\[Chain\] index 99 out of range for 2 layers$"):
        chain[99]
    with pytest.raises(IndexError, match=r"^\[Chain\] index -3 out of range for 2 layers$"):
        chain[-3]
    with pytest.raises(IndexError, match=r"^\[Parallel\] index 1 out of range for 1 layer$"):
        Parallel(None, a)[1]
    assert chain[np.int64(1)] is b and chain[-2] is a
    # slicing is unchanged, out-of-range slices included
    assert list(chain[5:]) == [] and list(chain[::-1]) == [b, a] and list(chain[-9:1]) == [a]
    named = Chain(enc=a, dec=b)
    with pytest.raises(KeyError, match=r"\[Chain\] no layer named 'x'; the names are "
                                       r"\['enc', 'dec'\]"):
        named["x"]
    with pytest.raises(KeyError, match=r"\[Chain\] no layer named 'enc'; its layers are given "
                                       r"by position: index them by number"):
        chain["enc"]
    with pytest.raises(IndexError, match=r"\[Chain\] index 2 out of range for 2 layers"):
        named[2]
    assert named[1] is b and list(named[1:]) == [b]



@pytest.mark.parametrize("shape", [(8, 28, 28), (8, 28, 28, 1), (8, 1, 28, 28), (8, 784, 1)])
def test_dense_given_an_unflattened_batch_says_to_flatten_it(shape):
    layer = Dense(784, 10)
    before = np64(layer.weight)
    with pytest.raises(ValueError, match=r"^\[Dense\] expected input with 784 features on axis "
                                         r"-1, got shape .*; flatten it first: flatten\(x\) or "
                                         r"x\.reshape\(x\.shape\[0\], -1\)$"):
        layer(mx.ones(shape))
    np.testing.assert_array_equal(np64(layer.weight), before)
    assert layer(flatten(mx.ones(shape))).shape == (8, 10)


def test_dense_gives_the_flatten_hint_only_when_flattening_would_fit():
    with pytest.raises(ValueError, match=r"flatten it first"):
        Dense(784, 10)(mx.ones((8, 28, 28)))
    for shape in [(8, 28, 27, 1), (28, 28), (8, 28)]:
        with pytest.raises(ValueError, match=r"got shape \([0-9, ]*\)$"):
            Dense(784, 10)(mx.ones(shape))


def test_dense_flatten_hint_under_autocast_in_a_chain():
    with autocast(mx.float16), pytest.raises(ValueError, match=r"flatten it first"):
        Chain(Dense(784, 10), Dense(10, 2))(mx.ones((8, 28, 28)))


@pytest.mark.parametrize("make", [Chain, lambda **named: Parallel(None, **named)])
def test_named_layers_are_attributes(make):
    a, b = Dense(2, 3), Dense(2, 3)
    c = make(enc=a, dec=b)
    assert c.enc is a and c.dec is b
    assert not hasattr(c, "nope")
    with pytest.raises(AttributeError, match="nope"):
        _ = c.nope
    assert callable(c.parameters)  # methods still come first


@pytest.mark.parametrize("container", ["Chain", "Parallel"])
def test_setting_a_named_layer_replaces_it(container):
    a, b, new = Dense(2, 2), Dense(2, 2), Dense(2, 2, relu)
    c = Chain(enc=a, dec=b) if container == "Chain" else Parallel(None, enc=a, dec=b)
    keys = sorted(c.keys())
    c.enc = new
    assert c["enc"] is new and c.enc is new and sorted(c.keys()) == keys  # no extra entry
    x = mx.random.normal((1, 2))
    expected = b(new(x)) if container == "Chain" else new(x)
    out = c(x) if container == "Chain" else c(x)[0]
    np.testing.assert_array_equal(np64(out), np64(expected))
    with pytest.raises(TypeError, match=rf"^\[{container}\] layer 'enc' must be callable, got 3$"):
        c.enc = 3
    assert c["enc"] is new


def test_only_named_layers_are_attributes():
    assert hasattr(Chain(enc=Dense(2, 2)), "enc")
    c = Chain(Dense(2, 2))
    assert not hasattr(c, "enc")
    c.extra = Dense(2, 2)  # an ordinary new entry, as in mlx.nn
    assert sorted(c.keys()) == ["extra", "layers"]


@pytest.mark.parametrize("dtype", [None, mx.bfloat16, mx.float16])
def test_dense_refuses_a_0d_input_inside_and_outside_a_scope(dtype):
    layer = Dense(3, 2)
    with pytest.raises(ValueError, match=r"\[Dense\] expected input with 3 features"):
        if dtype is None:
            layer(mx.array(1.0))
        else:
            with autocast(dtype, device="cpu"):
                layer(mx.array(1.0))
