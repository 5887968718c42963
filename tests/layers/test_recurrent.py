import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import assert_unchanged, check_layer_gradients, np64, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten, tree_map

import fluxlike
from fluxlike import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNCell, relu

CELLS = {RNN: RNNCell, LSTM: LSTMCell, GRU: GRUCell}
GATES = {RNNCell: 1, LSTMCell: 4, GRUCell: 3}


def randomise(layer: nn.Module, scale: float = 0.5) -> nn.Module:
    """Random values for every parameter, biases included (they start at zero)."""
    layer.update(tree_map(lambda p: scale * mx.random.normal(p.shape), layer.parameters()))
    return layer


# --- independent numpy references: PyTorch's equations, one step at a time --------------

def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_weights(cell):
    b_ih = np64(cell.bias_ih) if cell.bias_ih is not None else 0.0
    b_hh = np64(cell.bias_hh) if cell.bias_hh is not None else 0.0
    return np64(cell.weight_ih), np64(cell.weight_hh), b_ih, b_hh


def np_rnn_step(cell, x, h, act=np.tanh):
    w_ih, w_hh, b_ih, b_hh = np_weights(cell)
    return act(x @ w_ih.T + b_ih + h @ w_hh.T + b_hh)


def np_lstm_step(cell, x, h, c):
    w_ih, w_hh, b_ih, b_hh = np_weights(cell)
    H = h.shape[-1]
    gates = x @ w_ih.T + b_ih + h @ w_hh.T + b_hh
    i, f = sigmoid(gates[..., :H]), sigmoid(gates[..., H:2 * H])
    g, o = np.tanh(gates[..., 2 * H:3 * H]), sigmoid(gates[..., 3 * H:])
    c = f * c + i * g
    return o * np.tanh(c), c


def np_gru_step(cell, x, h):
    w_ih, w_hh, b_ih, b_hh = np_weights(cell)
    H = h.shape[-1]
    W_ir, W_iz, W_in = w_ih[:H], w_ih[H:2 * H], w_ih[2 * H:]
    W_hr, W_hz, W_hn = w_hh[:H], w_hh[H:2 * H], w_hh[2 * H:]
    b = [np.broadcast_to(v, (3 * H,)) for v in (b_ih, b_hh)]
    r = sigmoid(x @ W_ir.T + b[0][:H] + h @ W_hr.T + b[1][:H])
    z = sigmoid(x @ W_iz.T + b[0][H:2 * H] + h @ W_hz.T + b[1][H:2 * H])
    n = np.tanh(x @ W_in.T + b[0][2 * H:] + r * (h @ W_hn.T + b[1][2 * H:]))
    return (1 - z) * n + z * h


def np_sequence(layer, x, state):
    """Outputs (batch, time, out) and the final state, looping over time in numpy."""
    outs = []
    for t in range(x.shape[-2]):
        xt = x[..., t, :]
        if isinstance(layer, LSTM):
            state = np_lstm_step(layer.cell, xt, *state)
            outs.append(state[0])
        elif isinstance(layer, GRU):
            state = np_gru_step(layer.cell, xt, state)
            outs.append(state)
        else:
            act = {relu: lambda v: np.maximum(v, 0)}.get(layer.cell.act, np.tanh)
            state = np_rnn_step(layer.cell, xt, state, act)
            outs.append(state)
    return np.stack(outs, axis=-2), state


def initial_state(kind, batch, out):
    h = mx.random.normal((*batch, out))
    return (h, mx.random.normal((*batch, out))) if kind is LSTM else h


def to_np(state):
    return tuple(np64(s) for s in state) if isinstance(state, tuple) else np64(state)


def assert_states_close(a, b, **tol):
    pairs = zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,),
                strict=True)
    for x, y in pairs:
        np.testing.assert_allclose(np64(x) if isinstance(x, mx.array) else x, y, **tol)


class Call(nn.Module):
    """check_layer_gradients calls ``layer(*arrays)``: this adapts other call signatures."""

    def __init__(self, layer, fn):
        super().__init__()
        self.layer = layer
        self.fn = fn  # a function, not a parameter

    def __call__(self, *args):
        return self.fn(self.layer, *args)


# --- cells --------------------------------------------------------------------------------

class TestCells:
    @pytest.mark.parametrize("cls", [RNNCell, LSTMCell, GRUCell])
    def test_construction_positional_and_keyword(self, cls):
        a = cls(3, 5)
        b = cls(in_dims=3, out_dims=5, bias=False, init=lambda s: mx.ones(s))
        g = GATES[cls]
        assert a.weight_ih.shape == b.weight_ih.shape == (g * 5, 3)
        assert a.weight_hh.shape == b.weight_hh.shape == (g * 5, 5)
        assert a.bias_ih.shape == a.bias_hh.shape == (g * 5,)
        assert b.bias_ih is None and b.bias_hh is None
        assert set(b.parameters()) == {"weight_ih", "weight_hh"}
        assert np64(b.weight_hh).min() == 1.0

    def test_rnn_cell_matches_numpy(self):
        cell = randomise(RNNCell(4, 3, relu))
        x, h = mx.random.normal((2, 4)), mx.random.normal((2, 3))
        expected = np_rnn_step(cell, np64(x), np64(h), lambda v: np.maximum(v, 0))
        np.testing.assert_allclose(np64(cell(x, h)), expected, rtol=1e-5, atol=1e-6)

    def test_lstm_cell_matches_numpy(self):
        cell = randomise(LSTMCell(4, 3))
        x, h, c = mx.random.normal((2, 4)), mx.random.normal((2, 3)), mx.random.normal((2, 3))
        h1, c1 = cell(x, (h, c))
        eh, ec = np_lstm_step(cell, np64(x), np64(h), np64(c))
        np.testing.assert_allclose(np64(h1), eh, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np64(c1), ec, rtol=1e-5, atol=1e-6)

    def test_gru_cell_matches_numpy(self):
        cell = randomise(GRUCell(4, 3))
        x, h = mx.random.normal((2, 4)), mx.random.normal((2, 3))
        expected = np_gru_step(cell, np64(x), np64(h))
        np.testing.assert_allclose(np64(cell(x, h)), expected, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("cls", [RNNCell, LSTMCell, GRUCell])
    def test_zero_state_default_and_unbatched(self, cls):
        cell = randomise(cls(4, 3))
        x = mx.random.normal((2, 4))
        zeros = mx.zeros((2, 3))
        explicit = cell(x, (zeros, zeros) if cls is LSTMCell else zeros)
        assert_states_close(cell(x), to_np(explicit))
        single = cell(x[1])
        parts = (v if isinstance(v, tuple) else (v,) for v in (single, explicit))
        for s, e in zip(*parts, strict=True):
            assert s.shape == (3,)
            np.testing.assert_allclose(np64(s), np64(e[1]), rtol=1e-5, atol=1e-6)

    def test_gradients_float64(self):
        x, h, c = mx.random.normal((2, 3)), mx.random.normal((2, 4)), mx.random.normal((2, 4))
        check_layer_gradients(randomise(RNNCell(3, 4)), x, h)
        check_layer_gradients(randomise(GRUCell(3, 4)), x, h)
        lstm = Call(randomise(LSTMCell(3, 4)), lambda cell, x, h, c: cell(x, (h, c)))
        check_layer_gradients(lstm, x, h, c)

    def test_repr(self):
        assert repr(RNNCell(3, 5)) == "RNNCell(3 => 5, tanh)  # 50 parameters"
        assert repr(RNNCell(3, 5, "identity", bias=False)) == \
            "RNNCell(3 => 5, identity, bias=False)  # 40 parameters"
        assert repr(LSTMCell(3, 5)) == "LSTMCell(3 => 5)  # 200 parameters"
        assert repr(GRUCell(3, 5, bias=False)) == "GRUCell(3 => 5, bias=False)  # 120 parameters"

    def test_autocast_bfloat16(self):
        cell = LSTMCell(4, 3)
        x, h = mx.random.normal((2, 4)), mx.random.normal((2, 3))
        with fluxlike.autocast(mx.bfloat16, device="cpu"):
            h1, c1 = cell(x, (h, h))
        assert h1.dtype == c1.dtype == mx.bfloat16
        assert all(p.dtype == mx.float32 for _, p in tree_flatten(cell.parameters()))
        np.testing.assert_allclose(np64(h1), np64(cell(x, (h, h))[0]), atol=3e-2)

    @pytest.mark.parametrize("cls", [RNNCell, LSTMCell, GRUCell])
    def test_bad_input(self, cls):
        cell = cls(4, 3)
        name = cls.__name__
        before = snapshot(cell)
        with pytest.raises(ValueError, match=rf"\[{name}\] expected input with 4 feat.*\(2, 5\)"):
            cell(mx.ones((2, 5)))
        with pytest.raises(ValueError, match=rf"\[{name}\] expected one time step.*\(2, 7, 4\)"):
            cell(mx.ones((2, 7, 4)))
        bad = mx.ones((2, 4))
        state = (bad, bad) if cls is LSTMCell else bad
        with pytest.raises(ValueError, match=rf"\[{name}\] expected (state|h) of shape \(2, 3\)"):
            cell(mx.ones((2, 4)), state)
        with pytest.raises(TypeError, match=rf"\[{name}\] expected a floating-point input"):
            cell(mx.ones((2, 4), dtype=mx.int32))
        assert_unchanged(cell, before)

    def test_lstm_state_must_be_a_pair(self):
        with pytest.raises(TypeError, match=r"\[LSTMCell\] state must be a pair \(h, c\)"):
            LSTMCell(4, 3)(mx.ones((2, 4)), mx.zeros((2, 3)))
        with pytest.raises(ValueError, match=r"\[LSTMCell\] expected c of shape \(2, 3\).*\(3,\)"):
            LSTMCell(4, 3)(mx.ones((2, 4)), (mx.zeros((2, 3)), mx.zeros((3,))))

    @pytest.mark.parametrize("bad", [0, -2, 1.5, True])
    def test_bad_sizes(self, bad):
        with pytest.raises(ValueError, match=r"\[GRUCell\] out_dims must be a positive integer"):
            GRUCell(3, bad)

    def test_unknown_activation(self):
        with pytest.raises(ValueError, match=r"\[RNNCell\] unknown activation 'tanhh'"):
            RNNCell(3, 4, "tanhh")


# --- layers over sequences -----------------------------------------------------------------

class TestLayers:
    @pytest.mark.parametrize("cls", [RNN, LSTM, GRU])
    def test_construction_positional_and_keyword(self, cls):
        a = cls(3, 5)
        b = cls(in_dims=3, out_dims=5, bias=False, return_state=True)
        assert isinstance(a.cell, CELLS[cls]) and isinstance(b.cell, CELLS[cls])
        assert a.cell.weight_ih.shape == (GATES[CELLS[cls]] * 5, 3)
        assert b.cell.bias_ih is None and a.return_state is False and b.return_state is True
        assert set(a.parameters()) == {"cell"}
        if cls is RNN:
            assert RNN(3, 5, relu).cell.act is relu and RNN(3, 5, act="relu").cell.act is relu

    @pytest.mark.parametrize("cls", [RNN, LSTM, GRU])
    def test_sequence_matches_numpy_with_initial_state(self, cls):
        layer = randomise(cls(4, 3, return_state=True))
        x = mx.random.normal((2, 6, 4))
        state = initial_state(cls, (2,), 3)
        out, final = layer(x, state)
        expected, expected_final = np_sequence(layer, np64(x), to_np(state))
        assert out.shape == (2, 6, 3) and out.dtype == mx.float32
        np.testing.assert_allclose(np64(out), expected, rtol=1e-5, atol=1e-5)
        assert_states_close(final, expected_final, rtol=1e-5, atol=1e-5)

    def test_rnn_relu_and_no_bias_match_numpy(self):
        layer = randomise(RNN(4, 3, relu, bias=False))
        x, h = mx.random.normal((2, 5, 4)), mx.random.normal((2, 3))
        expected, _ = np_sequence(layer, np64(x), np64(h))
        np.testing.assert_allclose(np64(layer(x, h)), expected, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("cls", [RNN, LSTM, GRU])
    def test_equals_stepping_the_cell(self, cls):
        layer = randomise(cls(4, 3, return_state=True))
        x = mx.random.normal((2, 5, 4))
        out, final = layer(x)
        state = None
        for t in range(5):
            state = layer.cell(x[:, t], state)
            h = state[0] if cls is LSTM else state
            np.testing.assert_allclose(np64(out[:, t]), np64(h), rtol=1e-5, atol=1e-6)
        assert_states_close(final, to_np(state), rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("cls", [RNN, LSTM, GRU])
    def test_unbatched_equals_batch_of_one(self, cls):
        layer = randomise(cls(4, 3, return_state=True))
        x = mx.random.normal((5, 4))
        state = initial_state(cls, (), 3)
        out, final = layer(x, state)
        batched_state = tree_map(lambda s: s[None], state)
        out1, final1 = layer(x[None], batched_state)
        assert out.shape == (5, 3)
        np.testing.assert_allclose(np64(out), np64(out1[0]), rtol=1e-6, atol=1e-6)
        assert_states_close(final, tuple(np64(s[0]) for s in final1) if cls is LSTM
                            else np64(final1[0]), rtol=1e-6, atol=1e-6)

    def test_default_state_is_zeros_and_outputs_only(self):
        layer = randomise(GRU(4, 3))
        x = mx.random.normal((2, 5, 4))
        out = layer(x)
        assert isinstance(out, mx.array)
        np.testing.assert_allclose(np64(out), np64(layer(x, mx.zeros((2, 3)))), rtol=1e-6)

    @pytest.mark.parametrize("cls", [RNN, GRU])
    def test_gradients_float64(self, cls):
        check_layer_gradients(randomise(cls(3, 4)), mx.random.normal((2, 4, 3)),
                              mx.random.normal((2, 4)))

    def test_lstm_gradients_float64_through_final_state(self):
        layer = randomise(LSTM(3, 4, return_state=True))
        wrapped = Call(layer, lambda m, x, h, c: m(x, (h, c)))
        x, h, c = mx.random.normal((2, 4, 3)), mx.random.normal((2, 4)), mx.random.normal((2, 4))
        check_layer_gradients(wrapped, x, h, c)

    def test_repr(self):
        assert repr(LSTM(3, 5)) == "LSTM(3 => 5)  # 200 parameters"
        assert repr(GRU(3, 5, bias=False, return_state=True)) == \
            "GRU(3 => 5, bias=False, return_state=True)  # 120 parameters"
        assert repr(RNN(3, 5, relu)) == "RNN(3 => 5, relu)  # 50 parameters"

    @pytest.mark.parametrize("cls", [RNN, LSTM, GRU])
    def test_autocast_bfloat16(self, cls):
        layer = randomise(cls(4, 3, return_state=True))
        x = mx.random.normal((2, 5, 4))
        state = initial_state(cls, (2,), 3)
        reference, _ = layer(x, state)
        with fluxlike.autocast(mx.bfloat16, device="cpu"):
            out, final = layer(x, state)
        assert out.dtype == mx.bfloat16
        assert all(s.dtype == mx.bfloat16 for s in (final if cls is LSTM else (final,)))
        assert all(p.dtype == mx.float32 for _, p in tree_flatten(layer.parameters()))
        np.testing.assert_allclose(np64(out), np64(reference), atol=5e-2)

    def test_autocast_gradients_are_float32(self):
        layer = randomise(LSTM(4, 3))
        x = mx.random.normal((2, 5, 4))

        def loss(params):
            layer.update(params)
            return layer(x).astype(mx.float32).sum()

        with fluxlike.autocast(mx.bfloat16, device="cpu"):
            grads = mx.grad(loss)(layer.trainable_parameters())
        for _, g in tree_flatten(grads):
            assert g.dtype == mx.float32 and np.isfinite(np64(g)).all()
        assert np.abs(np64(grads["cell"]["weight_hh"])).sum() > 0

    def test_compiled_matches_eager(self):
        layer = randomise(LSTM(4, 3))
        x = mx.random.normal((2, 5, 4))
        forward = fluxlike.compile(lambda v: layer(v))
        np.testing.assert_allclose(np64(forward(x)), np64(layer(x)), rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("cls", [RNN, LSTM, GRU])
    def test_bad_input(self, cls):
        layer = cls(4, 3)
        name = cls.__name__
        before = snapshot(layer)
        with pytest.raises(ValueError, match=rf"\[{name}\] expected input with 4 .*\(2, 5, 6\)"):
            layer(mx.ones((2, 5, 6)))
        with pytest.raises(ValueError, match=rf"\[{name}\] expected input of shape \(batch, time"):
            layer(mx.ones((4,)))
        with pytest.raises(ValueError, match=rf"\[{name}\] expected at least one time step"):
            layer(mx.ones((2, 0, 4)))
        bad = mx.zeros((3, 3))
        with pytest.raises(ValueError, match=rf"\[{name}\] expected (state|h) of shape \(2, 3\), "
                                             r"got shape \(3, 3\)"):
            layer(mx.ones((2, 5, 4)), (bad, bad) if cls is LSTM else bad)
        with pytest.raises(TypeError, match=rf"\[{name}\] expected a floating-point input"):
            layer(mx.ones((2, 5, 4), dtype=mx.int32))
        assert_unchanged(layer, before)

    def test_bad_return_state(self):
        with pytest.raises(TypeError, match=r"^\[LSTM\] return_state must be True or False, "
                                            r"got 'yes'$"):
            LSTM(3, 4, return_state="yes")
        with pytest.raises(TypeError, match=r"\[GRU\] return_state must be True or False"):
            GRU(3, 4, return_state=1)
        layer = RNN(3, 4, return_state=np.bool_(True))
        assert layer.return_state is True and repr(layer).startswith("RNN(3 => 4, tanh, return")


@settings(max_examples=12, deadline=None)
@given(
    cls=st.sampled_from([RNN, LSTM, GRU]),
    batch=st.integers(1, 3),
    steps=st.integers(1, 4),
    in_dims=st.integers(1, 5),
    out_dims=st.integers(1, 5),
    bias=st.booleans(),
)
def test_any_size_matches_numpy(cls, batch, steps, in_dims, out_dims, bias):
    layer = randomise(cls(in_dims, out_dims, bias=bias, return_state=True))
    x = mx.random.normal((batch, steps, in_dims))
    state = initial_state(cls, (batch,), out_dims)
    out, final = layer(x, state)
    expected, expected_final = np_sequence(layer, np64(x), to_np(state))
    np.testing.assert_allclose(np64(out), expected, rtol=1e-4, atol=1e-5)
    assert_states_close(final, expected_final, rtol=1e-4, atol=1e-5)


ALL = [RNNCell, LSTMCell, GRUCell, RNN, LSTM, GRU]


@pytest.mark.parametrize("cls", ALL)
def test_sizes_of_any_integer_type_reach_init_as_ints(cls):
    seen = []
    layer = cls(np.int64(3), np.int32(4), init=lambda s: seen.append(s) or mx.zeros(s))
    rows = GATES[CELLS.get(cls, cls)] * 4
    assert seen == [(rows, 3), (rows, 4)]
    assert all(type(n) is int for shape in seen for n in shape)
    assert "np." not in repr(layer) and repr(layer).startswith(f"{cls.__name__}(3 => 4")


@pytest.mark.parametrize("cls", ALL)
def test_bias_must_be_a_bool(cls):
    name = cls.__name__
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match=rf"^\[{name}\] bias must be True or False, "
                                            rf"got {bad!r}$"):
            cls(3, 4, bias=bad)
    cell = cls(3, 4, bias=np.bool_(False))
    cell = cell.cell if hasattr(cell, "cell") else cell
    assert cell.bias_ih is None and cell.bias_hh is None


@pytest.mark.parametrize("cls", ALL)
def test_init_of_the_wrong_shape_is_refused(cls):
    name, rows = cls.__name__, GATES[CELLS.get(cls, cls)] * 4
    with pytest.raises(ValueError, match=rf"^\[{name}\] init returned shape \(2, 2\), "
                                         rf"expected \({rows}, 3\)$"):
        cls(3, 4, init=lambda s: mx.zeros((2, 2)))
    with pytest.raises(TypeError, match=rf"\[{name}\] init returned an array of dtype "
                                        r"mlx.core.int32"):
        cls(3, 4, init=lambda s: mx.zeros(s, mx.int32))
    with pytest.raises(TypeError, match=rf"\[{name}\] init must be a function of a shape"):
        cls(3, 4, init=None)


@pytest.mark.parametrize("cls", [RNN, LSTM, GRU])
def test_construction_errors_name_the_layer_not_its_cell(cls):
    name = cls.__name__
    with pytest.raises(ValueError, match=rf"\[{name}\] in_dims must be a positive integer"):
        cls(0, 4)
    with pytest.raises(ValueError, match=rf"\[{name}\] out_dims must be a positive integer"):
        cls(3, True)
    if cls is RNN:
        with pytest.raises(ValueError, match=r"^\[RNN\] unknown activation 'foo'"):
            RNN(3, 4, "foo")
        with pytest.raises(TypeError, match=r"^\[RNN\] activation must be callable"):
            RNN(3, 4, 3)
        assert repr(RNN(3, 4, "relu")).startswith("RNN(3 => 4, relu)")


@pytest.mark.parametrize("cls", [LSTM, LSTMCell])
def test_lstm_state_of_the_wrong_length_says_what_is_expected(cls):
    name = cls.__name__
    layer, x = cls(4, 3), mx.ones((2, 5, 4) if cls is LSTM else (2, 4))
    h = mx.zeros((2, 3))
    expected = r"state must be a pair \(h, c\), each of shape \(batch, hidden\) = \(2, 3\), "
    with pytest.raises(TypeError, match=rf"^\[{name}\] {expected}got a tuple of length 3$"):
        layer(x, (h, h, h))
    with pytest.raises(TypeError, match=rf"^\[{name}\] {expected}got a list of length 1$"):
        layer(x, [h])
    with pytest.raises(TypeError, match=rf"^\[{name}\] {expected}got array$"):
        layer(x, h)


@pytest.mark.parametrize("cls", ALL)
def test_the_state_keyword_of_the_docstrings(cls):
    layer = cls(4, 3)
    x = mx.ones((2, 5, 4) if cls in CELLS else (2, 4))
    h = mx.zeros((2, 3))
    state = (h, h) if cls in (LSTM, LSTMCell) else h
    out = layer(x, state=state)
    first = out[0] if isinstance(out, tuple) else out
    assert first.shape[-1] == 3
    doc = " ".join(cls.__doc__.split())
    assert "(x, state=None)" in doc and "h=None" not in doc and "(h, c)=None" not in doc
