"""Basic layers: containers, dense maps, embeddings."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from ..activations import identity, resolve
from ..init import glorot_uniform
from ..precision import ops
from ..precision.policy import autocast_policy
from .base import Layer, signature_of


def check_size(value: Any, layer: str, name: str) -> int:
    """``value`` as a positive int, or a ``ValueError`` naming the layer and argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"[{layer}] {name} must be a positive integer, got {value!r}")
    return value


def check_features(x: Any, expected: int, layer: str, axis: int = -1) -> None:
    """Raise unless ``x`` is an array with ``expected`` entries on ``axis``."""
    if not isinstance(x, mx.array):
        raise TypeError(f"[{layer}] expected an mx.array input, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[axis] != expected:
        raise ValueError(
            f"[{layer}] expected input with {expected} features on axis {axis}, "
            f"got shape {tuple(x.shape)}"
        )


class Chain(Layer):
    """Call layers in sequence: ``Chain(f, g, h)(x) == h(g(f(x)))``.

    Layers may be given by position or by name (``Chain(enc=Dense(2, 3), dec=Dense(3, 2))``)
    but not both. A chain can be indexed (``c[0]``, ``c["enc"]``) and sliced (``c[1:]``,
    another ``Chain`` sharing the same layers). Elements may be plain functions.

    >>> import mlx.core as mx
    >>> from fluxlike import Chain, Dense, relu
    >>> model = Chain(Dense(5, 3, relu), Dense(3, 2))
    >>> model(mx.ones((4, 5))).shape
    (4, 2)
    >>> model
    Chain(
      Dense(5 => 3, relu),  # 18 parameters
      Dense(3 => 2),  # 8 parameters
    )  # Total: 4 arrays, 26 parameters, 104 bytes.
    """

    def __init__(self, *layers: Callable, **named: Callable):
        super().__init__()
        if layers and named:
            raise ValueError("[Chain] give layers either by position or by name, not both")
        if "layers" in named:
            raise ValueError("[Chain] 'layers' is reserved and cannot name a layer")
        for key, layer in list(enumerate(layers)) + list(named.items()):
            if not callable(layer):
                raise TypeError(f"[Chain] layer {key!r} must be callable, got {layer!r}")
        self.layers = dict(named) if named else list(layers)

    def _items(self) -> list[tuple[str | None, Callable]]:
        if isinstance(self.layers, dict):
            return list(self.layers.items())
        return [(None, layer) for layer in self.layers]

    def __call__(self, x: Any) -> Any:
        for _, layer in self._items():
            x = layer(x)
        return x

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(layer for _, layer in self._items())

    def __getitem__(self, index: int | slice | str) -> Any:
        if isinstance(index, str):  # mlx.nn.Module reads its own entries with string keys
            layers = dict.get(self, "layers")
            if isinstance(layers, dict) and index in layers:
                return layers[index]
            if index in self.keys():
                return dict.__getitem__(self, index)
            raise KeyError(f"[Chain] no layer named {index!r}")
        items = self._items()
        if isinstance(index, slice):
            chosen = items[index]
            if isinstance(self.layers, dict):
                return Chain(**dict(chosen))
            return Chain(*(layer for _, layer in chosen))
        return items[index][1]

    def shown_children(self) -> list[tuple[str | None, Any]]:
        return self._items()


@autocast_policy("down")
class Dense(Layer):
    """A fully connected layer: ``act(x @ weight.T + bias)``.

    ``Dense(in_dims, out_dims, act=identity, *, bias=True, init=glorot_uniform)``: ``weight``
    has shape ``(out_dims, in_dims)`` and is made by ``init(shape)``; ``bias=False`` leaves
    ``bias`` as ``None``. The input's last axis must have ``in_dims`` entries; any leading
    axes are batch axes. Under :func:`~fluxlike.autocast` it computes in the scope's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense
    >>> layer = Dense(5, 2)
    >>> layer
    Dense(5 => 2)  # 12 parameters
    >>> layer(mx.ones((3, 5))).shape
    (3, 2)
    >>> Dense(5, 2, "relu", bias=False)
    Dense(5 => 2, relu, bias=False)  # 10 parameters
    """

    def __init__(
        self,
        in_dims: int,
        out_dims: int,
        act: Callable | str = identity,
        *,
        bias: bool = True,
        init: Callable[[tuple[int, ...]], mx.array] = glorot_uniform,
    ):
        super().__init__()
        check_size(in_dims, "Dense", "in_dims")
        check_size(out_dims, "Dense", "out_dims")
        self.act = resolve(act, "Dense")
        self.weight = init((out_dims, in_dims))
        self.bias = mx.zeros((out_dims,)) if bias else None

    def __call__(self, x: mx.array) -> mx.array:
        check_features(x, self.weight.shape[1], "Dense")
        x = ops.match_input(x, self.weight, "Dense")
        return self.act(ops.linear(x, self.weight, self.bias))

    def signature(self) -> str:
        out_dims, in_dims = self.weight.shape
        options = {} if self.bias is not None else {"bias": False}
        return signature_of([f"{in_dims} => {out_dims}"], "Dense", self.act, **options)
