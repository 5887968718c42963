"""Containers that fuse the outputs of several layers: ``Maxout`` and ``PairwiseFusion``
(Flux keeps them in ``basic.jl``; here beside :mod:`.basic`, which holds ``Chain`` and
``Parallel``).

Like every container they have no precision policy of their own: under
:func:`~fluxlike.autocast` each inner layer follows its own, and the fusing (a maximum, the
connection) runs in the dtype the inner layers return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..checks import is_int
from .basic import _Container


class Maxout(_Container):
    """The elementwise maximum of several layers' outputs on one input (Goodfellow et al.,
    2013), Flux's ``Maxout``.

    ``Maxout(*layers)``, or ``Maxout(make, n)`` with a function ``make()`` returning a new
    layer, called ``n`` times (each copy has its own parameters). The layers' outputs must
    share one shape. Layers can be indexed and sliced like a :class:`~fluxlike.Chain`'s.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, Maxout
    >>> m = Maxout(lambda: Dense(5, 7, "tanh"), 3)
    >>> m(mx.ones((2, 5))).shape
    (2, 7)
    >>> m
    Maxout(
      Dense(5 => 7, tanh),  # 42 parameters
      Dense(5 => 7, tanh),  # 42 parameters
      Dense(5 => 7, tanh),  # 42 parameters
    )  # Total: 6 arrays, 126 parameters, 504 bytes.
    """

    def __init__(self, *layers: Callable | int):
        super().__init__()
        if len(layers) == 2 and is_int(layers[1]) and callable(layers[0]):
            make, n = layers[0], int(layers[1])
            if isinstance(make, nn.Module):
                raise TypeError(
                    f"[Maxout] Maxout(make, n) takes a function that makes a new layer, got "
                    f"the layer {type(make).__name__} itself; write Maxout(lambda: ..., {n}) "
                    f"so that each of the {n} copies gets parameters of its own"
                )
            if n < 1:
                raise ValueError(f"[Maxout] n must be a positive integer, got {n}")
            layers = tuple(make() for _ in range(n))
        if not layers:
            raise ValueError("[Maxout] needs at least one layer")
        self._set_layers(layers, {})  # type: ignore[arg-type]  # the ints are gone by now

    def __call__(self, x: Any) -> mx.array:
        first, *rest = self._layers()
        out = first(x)
        for k, layer in enumerate(rest, start=1):
            y = layer(x)
            if tuple(y.shape) != tuple(out.shape):
                raise ValueError(
                    f"[Maxout] the layers' outputs must share one shape, got "
                    f"{tuple(out.shape)} from layer 0 and {tuple(y.shape)} from layer {k}"
                )
            out = mx.maximum(out, y)
        return out

    def _sliced(self, *layers: Callable, **named: Callable) -> Maxout:
        return Maxout(*layers)

    def shown_children(self) -> list[tuple[str | None, Any]]:
        return self._items()


class PairwiseFusion(_Container):
    """A chain with a side input at each step, Flux's ``PairwiseFusion``: for layers
    ``f1, ..., fN``, inputs ``x1, ..., xN`` and a ``connection`` of two arguments,

    ``y1 = f1(x1)``, ``y2 = f2(connection(y1, x2))``, ..., ``yN = fN(connection(yN-1, xN))``

    and the call returns the tuple ``(y1, ..., yN)`` of every step's output.
    ``PairwiseFusion(connection, *layers)`` or ``PairwiseFusion(connection, name=layer, ...)``;
    call it with ``N`` inputs (``p(x1, ..., xN)`` or the tuple ``p((x1, ..., xN))``) or with
    one, which is then every ``xi``. Layers can be indexed like a :class:`~fluxlike.Chain`'s.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, PairwiseFusion
    >>> p = PairwiseFusion(mx.add, Dense(2, 3), Dense(3, 4))
    >>> [y.shape for y in p(mx.ones((5, 2)), mx.ones((5, 3)))]
    [(5, 3), (5, 4)]
    >>> p
    PairwiseFusion(
      add,
      Dense(2 => 3),  # 9 parameters
      Dense(3 => 4),  # 16 parameters
    )  # Total: 4 arrays, 25 parameters, 100 bytes.
    """

    _reserved = ("layers", "connection")

    def __init__(self, connection: Callable, *layers: Callable, **named: Callable):
        super().__init__()
        if not callable(connection):
            raise TypeError(f"[PairwiseFusion] connection must be a callable of two arguments "
                            f"(e.g. mx.add), got {connection!r}")
        if not layers and not named:
            raise ValueError("[PairwiseFusion] needs at least one layer")
        self.connection = connection
        self._set_layers(layers, named)

    def __call__(self, *xs: Any) -> tuple[Any, ...]:
        if len(xs) == 1 and isinstance(xs[0], tuple):  # a tuple is spread, as in Parallel
            xs = xs[0]
        layers = list(self._layers())
        if len(xs) == 1:
            xs = xs * len(layers)
        elif len(xs) != len(layers):
            raise ValueError(
                f"[PairwiseFusion] with {len(layers)} layers takes one input or "
                f"{len(layers)} inputs, got {len(xs)}"
            )
        y = layers[0](xs[0])
        outputs = [y]
        for layer, x in zip(layers[1:], xs[1:], strict=True):
            y = layer(self.connection(y, x))
            outputs.append(y)
        return tuple(outputs)

    def _sliced(self, *layers: Callable, **named: Callable) -> PairwiseFusion:
        return PairwiseFusion(self.connection, *layers, **named)

    def shown_children(self) -> list[tuple[str | None, Any]]:
        return [(None, self.connection)] + self._items()
