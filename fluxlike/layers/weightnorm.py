"""``WeightNorm``: weight normalisation (Salimans and Kingma, 2016), a reparametrisation of one
weight of a layer as ``g * v / ‖v‖``."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..checks import is_int
from .base import Layer, _line


class WeightNorm(Layer):
    """Weight normalisation of the parameter ``which`` of ``layer``, Flux's ``WeightNorm``:
    the layer runs with ``w = g * v / ‖v‖``, where ``v`` (the direction) is trained in the
    layer's own entry (``layer.weight`` stays the name in checkpoints) and ``g`` (the
    magnitude) is this wrapper's parameter.

    ``WeightNorm(layer, which="weight", *, dims=0)``: ``dims`` are the axes that keep a
    magnitude of their own (PyTorch's ``dim``); the norm runs over the others. The default,
    axis 0, is the output axis of every fluxlike weight (``(out, in)``, ``(out, *kernel,
    in)``): one magnitude per output unit, as in the paper. ``dims=None`` gives one magnitude
    for the whole array. (Flux's ``dims`` names the axes the norm runs over, in its own
    layout.) ``g`` starts at ``‖v‖``, so the wrapped layer first computes what it did.
    :meth:`remove` folds ``g`` back into the weight.

    Precision: the wrapper has policy "none" and computes ``w`` in ``v``'s dtype (float32
    master weights); the wrapped layer then follows its own policy (a ``Dense`` casts ``w``
    to the compute dtype of an :func:`~fluxlike.autocast` scope). During a call the layer's
    entry holds ``w`` (the layer's own forward reads it there), so one wrapped layer must
    not be called from two threads at once.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, WeightNorm
    >>> layer = WeightNorm(Dense(3, 2))
    >>> layer
    WeightNorm(Dense(3 => 2))  # 10 parameters
    >>> layer.g.shape
    (2, 1)
    >>> x = mx.ones((4, 3))
    >>> bool(mx.allclose(layer(x), layer.layer(x)))  # g = ‖v‖ at first
    True
    """

    def __init__(self, layer: nn.Module, which: str = "weight", *,
                 dims: int | tuple[int, ...] | None = 0):
        super().__init__()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"[WeightNorm] expected a layer (an mlx.nn.Module), got "
                            f"{type(layer).__name__}")
        if not isinstance(which, str):
            raise TypeError(f"[WeightNorm] which must name a parameter, got {which!r}")
        arrays = [k for k, v in layer.items() if isinstance(v, mx.array)]
        v = layer.get(which)
        if not isinstance(v, mx.array) or not mx.issubdtype(v.dtype, mx.floating):
            raise ValueError(f"[WeightNorm] {type(layer).__name__} has no floating parameter "
                             f"{which!r}; its arrays are {arrays}")
        self.which = which
        self.dims = _check_dims(dims, v.ndim)
        self.layer = layer
        self.g = _norm(v, self._axes(v.ndim))

    def _axes(self, ndim: int) -> tuple[int, ...]:
        """The axes the norm runs over."""
        kept = () if self.dims is None else (self.dims,) if isinstance(self.dims, int) \
            else self.dims
        return tuple(a for a in range(ndim) if a not in {k % ndim for k in kept})

    def normalised_weight(self) -> mx.array:
        """The weight the layer computes with: ``g * v / ‖v‖``."""
        v = self.layer[self.which]
        return self["g"].astype(v.dtype) * v / _norm(v, self._axes(v.ndim))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer, which = self["layer"], self.which
        v = layer[which]
        layer[which] = self.normalised_weight()
        try:
            return layer(*args, **kwargs)
        finally:
            layer[which] = v

    def remove(self) -> nn.Module:
        """The wrapped layer with ``g * v / ‖v‖`` as its weight (Flux's
        ``remove_weight_norms`` for one layer); the layer is changed in place and returned.

        >>> from fluxlike import Dense, WeightNorm
        >>> WeightNorm(Dense(3, 2)).remove()
        Dense(3 => 2)  # 8 parameters
        """
        layer = self.layer
        layer[self.which] = self.normalised_weight()
        return layer

    def signature(self) -> str:
        options = []
        if self.which != "weight":
            options.append(f"which={self.which!r}")
        if self.dims != 0:
            options.append(f"dims={self.dims!r}")
        return f"WeightNorm({', '.join([_line(self.layer), *options])})"


def _norm(v: mx.array, axes: tuple[int, ...]) -> mx.array:
    """``‖v‖`` over ``axes`` (kept), accumulated in at least float32."""
    wide = v if v.dtype in (mx.float32, mx.float64) else v.astype(mx.float32)
    return mx.sqrt(mx.sum(wide * wide, axis=axes, keepdims=True)).astype(v.dtype)


def _check_dims(dims: Any, ndim: int) -> int | tuple[int, ...] | None:
    """``dims`` as an int, a tuple of ints or ``None``, each a valid axis of ``ndim``."""
    if dims is None:
        return None
    values = (dims,) if is_int(dims) else dims
    if not isinstance(values, tuple) or not all(is_int(d) and -ndim <= d < ndim
                                                for d in values):
        raise ValueError(f"[WeightNorm] dims must be None, an axis or a tuple of axes of the "
                         f"{ndim}-d weight, got {dims!r}")
    return int(dims) if is_int(dims) else tuple(int(d) for d in values)
