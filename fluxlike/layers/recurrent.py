"""Recurrent layers: the one-step cells ``RNNCell``, ``LSTMCell``, ``GRUCell`` and the layers
``RNN``, ``LSTM``, ``GRU`` that run a cell over a ``(batch, time, features)`` sequence.

The gate equations and the gate order follow PyTorch (LSTM: ``i, f, g, o``; GRU: ``r, z, n``),
with fused parameters ``weight_ih`` ``(gates * out, in)``, ``weight_hh`` ``(gates * out, out)``,
``bias_ih`` and ``bias_hh`` (``None`` with ``bias=False``), named and laid out as in PyTorch's
``nn.LSTMCell``/``nn.GRUCell``/``nn.RNNCell``, so their weights carry over unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..activations import resolve, tanh
from ..checks import check_features, check_flag, check_size, checked_init, initialise
from ..init import glorot_uniform
from ..precision import kernels
from ..precision.operands import operands
from ..precision.policy import autocast_policy
from .base import Layer, act_name, signature_of

State = mx.array | tuple[mx.array, mx.array]
Init = Callable[[tuple[int, ...]], mx.array]


class _Cell(Layer):
    """What the three cells share: fused parameters, validation, the one-step call.

    Parameters are read by item (``self["weight_hh"]``), not as attributes: the layers call
    ``step`` once per time step, and ``nn.Module.__getattr__`` is slow.
    """

    gates = 1

    def __init__(self, in_dims: int, out_dims: int, bias: bool, init: Init):
        super().__init__()
        name = type(self).__name__
        in_dims = check_size(in_dims, name, "in_dims")
        out_dims = check_size(out_dims, name, "out_dims")
        bias = check_flag(bias, name, "bias")
        rows = self.gates * out_dims
        self.weight_ih = initialise(init, (rows, in_dims), name)
        self.weight_hh = initialise(init, (rows, out_dims), name)
        self.bias_ih = mx.zeros((rows,), self.weight_ih.dtype) if bias else None
        self.bias_hh = mx.zeros((rows,), self.weight_hh.dtype) if bias else None

    @property
    def in_dims(self) -> int:
        return self["weight_ih"].shape[1]

    @property
    def out_dims(self) -> int:
        return self["weight_hh"].shape[1]

    def project(self, x: mx.array) -> mx.array:
        """The input part of every gate, ``x @ weight_ih.T + bias_ih``, for any leading axes."""
        return kernels.linear(x, self["weight_ih"], self.get("bias_ih"))

    def recur(self, h: mx.array) -> mx.array:
        """The hidden-state part of every gate, ``h @ weight_hh.T + bias_hh``."""
        return kernels.linear(h, self["weight_hh"], self.get("bias_hh"))

    def step(self, xp: mx.array, state: Any) -> Any:
        """The new state from the projected input ``xp`` of one time step and the old state."""
        raise NotImplementedError

    def output(self, state: Any) -> mx.array:
        """The hidden state ``h`` the layers collect at each time step."""
        return state

    def check_state(self, state: Any, shape: tuple[int, ...], layer: str) -> None:
        """Raise unless ``state`` is ``None`` or one array of ``shape``."""
        _check_array_state(state, shape, layer, "state")

    def prepare_state(self, state: Any, batch: tuple[int, ...], dtype: mx.Dtype, layer: str) -> Any:
        """A checked ``state`` in the compute dtype, or zeros of ``(*batch, out_dims)``."""
        if state is None:
            return mx.zeros((*batch, self.out_dims), dtype=dtype)
        return operands(state, self["weight_hh"], layer=layer)[0]

    def __call__(self, x: mx.array, state: State | None = None) -> State:
        name, in_dims = type(self).__name__, self.in_dims
        check_features(x, in_dims, name)
        if x.ndim > 2:
            raise ValueError(
                f"[{name}] expected one time step of shape (batch, {in_dims}) or "
                f"({in_dims},), got shape {tuple(x.shape)}; use {name[:-4]} for sequences"
            )
        self.check_state(state, (*x.shape[:-1], self.out_dims), name)
        x = operands(x, self["weight_ih"], layer=name)[0]
        return self.step(self.project(x), self.prepare_state(state, x.shape[:-1], x.dtype, name))

    def _options(self) -> dict[str, Any]:
        return {} if self.get("bias_ih") is not None else {"bias": False}

    def signature(self) -> str:
        return signature_of([f"{self.in_dims} => {self.out_dims}"], type(self).__name__,
                            **self._options())


def _check_array_state(state: Any, shape: tuple[int, ...], layer: str, what: str) -> None:
    if state is None:
        return
    if not isinstance(state, mx.array):
        raise TypeError(f"[{layer}] {what} must be an mx.array of shape {shape}, "
                        f"got {type(state).__name__}")
    if tuple(state.shape) != shape:
        raise ValueError(f"[{layer}] expected {what} of shape {shape}, got shape "
                         f"{tuple(state.shape)}; pass None for a zero initial state")


@autocast_policy("down")
class RNNCell(_Cell):
    """One step of an Elman RNN::

        h' = act(x @ weight_ih.T + bias_ih + h @ weight_hh.T + bias_hh)

    ``RNNCell(in_dims, out_dims, act=tanh, *, bias=True, init=glorot_uniform)``; the call
    ``cell(x, state=None)`` takes ``x`` of shape ``(batch, in_dims)`` (or ``(in_dims,)``) and
    the hidden state ``h`` of shape ``(batch, out_dims)`` (zeros when ``None``) and returns the
    new ``h``. :class:`RNN` runs it over a sequence.

    >>> import mlx.core as mx
    >>> from fluxlike import RNNCell
    >>> cell = RNNCell(3, 5)
    >>> cell
    RNNCell(3 => 5, tanh)  # 50 parameters
    >>> h = cell(mx.ones((2, 3)))
    >>> cell(mx.ones((2, 3)), state=h).shape
    (2, 5)
    """

    def __init__(
        self,
        in_dims: int,
        out_dims: int,
        act: Callable | str = tanh,
        *,
        bias: bool = True,
        init: Init = glorot_uniform,
    ):
        act = resolve(act, "RNNCell")
        super().__init__(in_dims, out_dims, bias, init)
        self.act = act

    def step(self, xp: mx.array, h: mx.array) -> mx.array:
        return self.act(xp + self.recur(h))

    def signature(self) -> str:
        # Unlike Dense, the default is tanh, so identity is shown too.
        act = act_name(self.act) or "identity"
        args = [f"{self.in_dims} => {self.out_dims}", act]
        return signature_of(args, type(self).__name__, **self._options())


@autocast_policy("down")
class LSTMCell(_Cell):
    """One step of a long short-term memory, with PyTorch's gates ``i, f, g, o``::

        i, f, g, o = split(x @ weight_ih.T + bias_ih + h @ weight_hh.T + bias_hh, 4)
        c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h' = sigmoid(o) * tanh(c')

    ``LSTMCell(in_dims, out_dims, *, bias=True, init=glorot_uniform)``; ``cell(x, state=None)``
    takes ``x`` of shape ``(batch, in_dims)`` (or ``(in_dims,)``) and the state ``(h, c)``, each
    of shape ``(batch, out_dims)`` (zeros when ``None``), and returns the new ``(h, c)``.
    :class:`LSTM` runs it over a sequence.

    >>> import mlx.core as mx
    >>> from fluxlike import LSTMCell
    >>> cell = LSTMCell(3, 5)
    >>> cell
    LSTMCell(3 => 5)  # 200 parameters
    >>> h, c = cell(mx.ones((2, 3)))
    >>> h, c = cell(mx.ones((2, 3)), state=(h, c))
    >>> h.shape, c.shape
    ((2, 5), (2, 5))
    """

    gates = 4

    def __init__(self, in_dims: int, out_dims: int, *, bias: bool = True,
                 init: Init = glorot_uniform):
        super().__init__(in_dims, out_dims, bias, init)

    def step(self, xp: mx.array, state: tuple[mx.array, mx.array]) -> tuple[mx.array, mx.array]:
        h, c = state
        i, f, g, o = mx.split(xp + self.recur(h), 4, axis=-1)
        c = kernels.sigmoid(f) * c + kernels.sigmoid(i) * kernels.tanh(g)
        return kernels.sigmoid(o) * kernels.tanh(c), c

    def output(self, state: tuple[mx.array, mx.array]) -> mx.array:
        return state[0]

    def check_state(self, state: Any, shape: tuple[int, ...], layer: str) -> None:
        if state is None:
            return
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            got = f"a {type(state).__name__} of length {len(state)}" \
                if isinstance(state, (tuple, list)) else type(state).__name__
            raise TypeError(f"[{layer}] state must be a pair (h, c), each of shape "
                            f"(batch, hidden) = {shape}, got {got}")
        _check_array_state(state[0], shape, layer, "h")
        _check_array_state(state[1], shape, layer, "c")

    def prepare_state(
        self, state: Any, batch: tuple[int, ...], dtype: mx.Dtype, layer: str
    ) -> tuple[mx.array, mx.array]:
        if state is None:
            zeros = mx.zeros((*batch, self.out_dims), dtype=dtype)
            return zeros, zeros
        h, c = state
        weight = self["weight_hh"]
        return (operands(h, weight, layer=layer)[0], operands(c, weight, layer=layer)[0])


@autocast_policy("down")
class GRUCell(_Cell):
    """One step of a gated recurrent unit, with PyTorch's gates ``r, z, n``::

        r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)
        z = sigmoid(W_iz x + b_iz + W_hz h + b_hz)
        n = tanh(W_in x + b_in + r * (W_hn h + b_hn))
        h' = (1 - z) * n + z * h

    ``GRUCell(in_dims, out_dims, *, bias=True, init=glorot_uniform)``; ``cell(x, state=None)``
    takes ``x`` of shape ``(batch, in_dims)`` (or ``(in_dims,)``) and the hidden state ``h`` of
    shape ``(batch, out_dims)`` (zeros when ``None``) and returns the new ``h``. :class:`GRU`
    runs it over a sequence.

    >>> import mlx.core as mx
    >>> from fluxlike import GRUCell
    >>> cell = GRUCell(3, 5, bias=False)
    >>> cell
    GRUCell(3 => 5, bias=False)  # 120 parameters
    >>> cell(mx.ones((3,))).shape
    (5,)
    """

    gates = 3

    def __init__(self, in_dims: int, out_dims: int, *, bias: bool = True,
                 init: Init = glorot_uniform):
        super().__init__(in_dims, out_dims, bias, init)

    def step(self, xp: mx.array, h: mx.array) -> mx.array:
        xr, xz, xn = mx.split(xp, 3, axis=-1)
        hr, hz, hn = mx.split(self.recur(h), 3, axis=-1)
        r = kernels.sigmoid(xr + hr)
        z = kernels.sigmoid(xz + hz)
        n = kernels.tanh(xn + r * hn)
        return n + z * (h - n)


class _Recurrent(Layer):
    """A cell run over the time axis of ``(batch, time, features)`` or ``(time, features)``.

    The arguments are checked here under the layer's own name before the cell (of type
    ``cell_type``) is built from them, so that an error names ``RNN`` rather than ``RNNCell``.
    """

    # a _Cell subclass, called as (in_dims, out_dims, *act, bias=..., init=...)
    cell_type: Callable[..., _Cell]

    def __init__(self, in_dims: int, out_dims: int, *act: Callable | str, bias: bool,
                 init: Init, return_state: bool):
        super().__init__()
        name = type(self).__name__
        in_dims = check_size(in_dims, name, "in_dims")
        out_dims = check_size(out_dims, name, "out_dims")
        act = tuple(resolve(a, name) for a in act)
        bias = check_flag(bias, name, "bias")
        return_state = check_flag(return_state, name, "return_state")
        self.cell = self.cell_type(in_dims, out_dims, *act, bias=bias,
                                   init=checked_init(init, name))
        self.return_state = return_state

    def __call__(self, x: mx.array, state: State | None = None) -> Any:
        name, cell = type(self).__name__, self["cell"]
        self._check(x, state, cell, name)
        x = operands(x, cell["weight_ih"], layer=name)[0]
        state = cell.prepare_state(state, x.shape[:-2], x.dtype, name)
        xp = cell.project(x)  # the input part of every step in one matmul
        outputs = []
        for t in range(x.shape[-2]):
            state = cell.step(xp[..., t, :], state)
            outputs.append(cell.output(state))
        out = mx.stack(outputs, axis=-2)
        return (out, state) if self.return_state else out

    @staticmethod
    def _check(x: Any, state: Any, cell: _Cell, name: str) -> None:
        """Raise unless ``x`` is a non-empty sequence of the cell's inputs and ``state`` fits."""
        in_dims = cell.in_dims
        check_features(x, in_dims, name)
        if x.ndim not in (2, 3):
            raise ValueError(
                f"[{name}] expected input of shape (batch, time, {in_dims}) or "
                f"(time, {in_dims}), got shape {tuple(x.shape)}"
            )
        if x.shape[-2] == 0:
            raise ValueError(f"[{name}] expected at least one time step, got shape "
                             f"{tuple(x.shape)}")
        cell.check_state(state, (*x.shape[:-2], cell.out_dims), name)

    def signature(self) -> str:
        cell = self.cell.signature()
        options = ", return_state=True" if self.return_state else ""
        return f"{type(self).__name__}{cell[cell.index('('):-1]}{options})"


@autocast_policy("down")
class RNN(_Recurrent):
    """An Elman RNN over a sequence: :class:`RNNCell` applied at each time step.

    ``RNN(in_dims, out_dims, act=tanh, *, bias=True, init=glorot_uniform, return_state=False)``.
    ``layer(x, state=None)`` takes ``x`` of shape ``(batch, time, in_dims)`` (or
    ``(time, in_dims)``) and the initial hidden state ``h`` of shape ``(batch, out_dims)`` (or
    ``(out_dims,)``; zeros when ``None``), and returns the hidden states of every step,
    ``(batch, time, out_dims)``; with ``return_state=True`` it returns ``(outputs, h_last)``.
    The parameters live in ``layer.cell``.

    >>> import mlx.core as mx
    >>> from fluxlike import RNN
    >>> layer = RNN(3, 5, "relu")
    >>> layer
    RNN(3 => 5, relu)  # 50 parameters
    >>> layer(mx.ones((2, 7, 3))).shape
    (2, 7, 5)
    >>> layer(mx.ones((2, 7, 3)), state=mx.zeros((2, 5))).shape
    (2, 7, 5)
    """

    cell_type = RNNCell

    def __init__(
        self,
        in_dims: int,
        out_dims: int,
        act: Callable | str = tanh,
        *,
        bias: bool = True,
        init: Init = glorot_uniform,
        return_state: bool = False,
    ):
        super().__init__(in_dims, out_dims, act, bias=bias, init=init, return_state=return_state)


@autocast_policy("down")
class LSTM(_Recurrent):
    """A long short-term memory over a sequence: :class:`LSTMCell` applied at each time step.

    ``LSTM(in_dims, out_dims, *, bias=True, init=glorot_uniform, return_state=False)``.
    ``layer(x, state=None)`` takes ``x`` of shape ``(batch, time, in_dims)`` (or
    ``(time, in_dims)``) and the initial state ``(h, c)``, each ``(batch, out_dims)`` (zeros
    when ``None``), and returns ``h`` at every step, ``(batch, time, out_dims)``; with
    ``return_state=True`` it returns ``(outputs, (h_last, c_last))``.

    >>> import mlx.core as mx
    >>> from fluxlike import LSTM
    >>> layer = LSTM(3, 5, return_state=True)
    >>> layer
    LSTM(3 => 5, return_state=True)  # 200 parameters
    >>> out, (h, c) = layer(mx.ones((2, 7, 3)))
    >>> out, (h, c) = layer(mx.ones((2, 7, 3)), state=(h, c))
    >>> out.shape, h.shape, c.shape
    ((2, 7, 5), (2, 5), (2, 5))
    """

    cell_type = LSTMCell

    def __init__(self, in_dims: int, out_dims: int, *, bias: bool = True,
                 init: Init = glorot_uniform, return_state: bool = False):
        super().__init__(in_dims, out_dims, bias=bias, init=init, return_state=return_state)


@autocast_policy("down")
class GRU(_Recurrent):
    """A gated recurrent unit over a sequence: :class:`GRUCell` applied at each time step.

    ``GRU(in_dims, out_dims, *, bias=True, init=glorot_uniform, return_state=False)``.
    ``layer(x, state=None)`` takes ``x`` of shape ``(batch, time, in_dims)`` (or
    ``(time, in_dims)``) and the initial hidden state ``h`` of shape ``(batch, out_dims)``
    (zeros when ``None``), and returns ``h`` at every step, ``(batch, time, out_dims)``; with
    ``return_state=True`` it returns ``(outputs, h_last)``.

    >>> import mlx.core as mx
    >>> from fluxlike import GRU
    >>> layer = GRU(3, 5)
    >>> layer
    GRU(3 => 5)  # 150 parameters
    >>> layer(mx.ones((7, 3))).shape
    (7, 5)
    >>> layer(mx.ones((7, 3)), state=mx.zeros((5,))).shape
    (7, 5)
    """

    cell_type = GRUCell

    def __init__(self, in_dims: int, out_dims: int, *, bias: bool = True,
                 init: Init = glorot_uniform, return_state: bool = False):
        super().__init__(in_dims, out_dims, bias=bias, init=init, return_state=return_state)

