"""Pooling layers, channels last, batch first: windows, global and adaptive pools.

Pooling has no parameters and the "none" precision policy: it runs in its input's dtype,
inside an :func:`~fluxlike.autocast` scope too. As with ``Conv``, the window tuple's length
(1, 2 or 3) chooses the dimension, and ``padding`` takes the same forms (an int, one per
dim, ``(lo, hi)`` pairs, or ``"same"`` for an output of size ``ceil(input / stride)``).
``MaxPool`` ignores padded entries; ``MeanPool`` counts them as zeros and always divides by
the window's size (Flux's ``meanpool``, PyTorch's ``count_include_pad=True``).

The global pools keep the spatial axes as size-1 axes, as Flux does: ``(N, H, W, C)``
becomes ``(N, 1, 1, C)``; put :func:`~fluxlike.flatten` after one to feed a ``Dense``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from .. import workarounds
from ..precision import kernels
from ..precision.state import HALF
from .base import Layer
from .conv import (
    check_fits,
    check_input,
    kernel_tuple,
    pad_text,
    padding_pairs,
    per_dim,
    same_padding,
    short,
)


def check_nonempty(x: mx.array, layer: str) -> None:
    """Raise unless every spatial axis of ``x`` (all but the first and last) has entries: a
    pool over nothing would be NaN (mean) or ``-inf`` (max), or an MLX error.

    >>> import mlx.core as mx
    >>> check_nonempty(mx.ones((2, 0, 3)), "GlobalMaxPool")
    Traceback (most recent call last):
    ValueError: [GlobalMaxPool] expected non-empty spatial axes, got shape (2, 0, 3)
    """
    if 0 in x.shape[1:-1]:
        raise ValueError(f"[{layer}] expected non-empty spatial axes, got shape {tuple(x.shape)}")


def sliding_windows(x: mx.array, window: Sequence[int], stride: Sequence[int]) -> mx.array:
    """The ``(N, *out, *window, C)`` windows of an ``(N, *spatial, C)`` array, without copies
    where the windows tile the input."""
    spatial = x.shape[1:-1]
    out = [(n - w) // s + 1 for n, w, s in zip(spatial, window, stride, strict=True)]
    if all(w == s for w, s in zip(window, stride, strict=True)):
        # Tiles: crop the ragged end, split each axis into (out, window), move windows last.
        # (the index built first: mypy reads x[(a, *b)] as Python 3.11's x[a, *b])
        tiles = (slice(None), *(slice(0, o * w) for o, w in zip(out, window, strict=True)))
        x = x[tiles]
        n = len(window)
        x = x.reshape(x.shape[0], *(d for o, w in zip(out, window, strict=True) for d in (o, w)),
                      x.shape[-1])
        return x.transpose(0, *range(1, 2 * n, 2), *range(2, 2 * n + 1, 2), 2 * n + 1)
    # Overlapping or gapped windows: a strided view (row-major element strides).
    strides = [math.prod(x.shape[i + 1:]) for i in range(x.ndim)]
    shape = (x.shape[0], *out, *window, x.shape[-1])
    view_strides = (strides[0], *(strides[i + 1] * s for i, s in enumerate(stride)),
                    *strides[1:-1], 1)
    return mx.as_strided(x, shape, view_strides)


class _WindowPool(Layer):
    """What ``MaxPool`` and ``MeanPool`` share: arguments, checks, windows and the repr.
    Subclasses give ``pad_value(dtype)`` and the call."""

    def __init__(self, window: tuple[int, ...], *, stride: int | tuple[int, ...] | None = None,
                 padding: int | str | tuple = 0):
        super().__init__()
        name = type(self).__name__
        window = kernel_tuple(window, name, "window")
        self.window = window
        self.stride = window if stride is None else per_dim(stride, len(window), name, "stride")
        self.same = padding == "same"
        if self.same:
            self.padding = same_padding(window, (1,) * len(window))
        else:
            self.padding = padding_pairs(padding, len(window), name)
        # Every window then holds an input entry (a max over padding alone would be -inf).
        if any(max(pair) >= w for pair, w in zip(self.padding, window, strict=True)):
            raise ValueError(
                f"[{name}] padding {self.padding} must be smaller than the window {window} "
                f"on each side"
            )

    def _check(self, x: Any) -> None:
        """Raise unless ``x`` is an input this pool takes."""
        name = type(self).__name__
        # By item: self.window would go through nn.Module.__getattr__, which is slow.
        window, padding = self["window"], self["padding"]
        check_input(x, len(window), name, "pool")
        check_nonempty(x, name)
        check_fits(x, window, padding, name, "window")

    def _windows(self, x: Any, checked: bool = False) -> mx.array:
        """The windows of ``x`` (padded), ``(N, *out, *window, C)``."""
        if not checked:
            self._check(x)
        window, padding = self["window"], self["padding"]
        if any(lo or hi for lo, hi in padding):
            x = mx.pad(x, [(0, 0), *padding, (0, 0)], constant_values=self.pad_value(x.dtype))
        return sliding_windows(x, window, self["stride"])

    def _axes(self) -> tuple[int, ...]:
        """The window axes of :meth:`_windows`' result."""
        return tuple(range(-len(self["window"]) - 1, -1))

    def signature(self) -> str:
        options = [] if self.stride == self.window else [f"stride={short(self.stride)}"]
        pad = pad_text(self.padding, self.same)
        options += [] if pad is None else [f"pad={pad}"]
        return f"{type(self).__name__}({', '.join([str(self.window), *options])})"


class MaxPool(_WindowPool):
    """The maximum over each window: ``MaxPool(window, *, stride=window, padding=0)``.

    ``window`` is a tuple (its length chooses 1-, 2- or 3-D); ``stride`` defaults to the
    window (``None``), giving non-overlapping windows. Runs in the input's dtype. On the CPU
    with fluxlike's native kernels, float32 and bfloat16 run oneDNN's max pooling
    (:func:`fluxlike.native.max_pool`): the same values; the gradient goes to the first
    maximum of a window where MLX's would share it among equal maxima
    (``FLUXLIKE_NATIVE=0`` gives MLX's kernels).

    >>> import mlx.core as mx
    >>> from fluxlike import MaxPool
    >>> pool = MaxPool((2, 2))
    >>> pool
    MaxPool((2, 2))
    >>> pool(mx.ones((1, 5, 6, 3))).shape
    (1, 2, 3, 3)
    >>> MaxPool((3,), stride=1, padding=1)(mx.array([[[1.0], [3.0], [2.0]]]))[0, :, 0]
    array([3, 3, 3], dtype=float32)
    """

    @staticmethod
    def pad_value(dtype: mx.Dtype) -> float | int:
        """Padding is ``-inf`` (the dtype's minimum for integers), so a max ignores it."""
        if mx.issubdtype(dtype, mx.floating):
            return -math.inf
        return mx.iinfo(dtype).min if dtype != mx.bool_ else False

    def __call__(self, x: mx.array) -> mx.array:
        self._check(x)
        y = kernels.max_pool(x, self["window"], self["stride"], self["padding"])
        if y is not None:  # the native kernel (oneDNN's pooling) on the CPU
            return y
        return mx.max(self._windows(x, checked=True), axis=self._axes())


class MeanPool(_WindowPool):
    """The mean over each window: ``MeanPool(window, *, stride=window, padding=0)``.

    Padded entries count as zeros and the divisor is always the window's size. Half
    precision is summed in float32 (a float16 sum overflows above 65504) and the result
    returned in the input dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import MeanPool
    >>> pool = MeanPool((2, 2), stride=1)
    >>> pool
    MeanPool((2, 2), stride=1)
    >>> pool(mx.ones((1, 5, 5, 3))).shape
    (1, 4, 4, 3)
    >>> MeanPool((2,), padding=(1,))(mx.array([[[2.0], [4.0]]]))[0, :, 0]
    array([1, 2], dtype=float32)
    """

    @staticmethod
    def pad_value(dtype: mx.Dtype) -> float:
        """Padding is zero."""
        return 0

    def __call__(self, x: mx.array) -> mx.array:
        half = isinstance(x, mx.array) and x.dtype in HALF
        # Sum half precision in float32 (see workarounds.mean); upcast before windowing, as
        # overlapping windows are a view of the input but a copy of any result computed
        # from them.
        y = mx.mean(self._windows(x.astype(mx.float32) if half else x), axis=self._axes())
        return y.astype(x.dtype) if half else y


class _GlobalPool(Layer):
    """A reduction (the subclass's ``reduce``) over every spatial axis, keeping them; any
    number of spatial axes (at least one, none empty)."""

    reduce: Callable[..., mx.array]

    def __call__(self, x: mx.array) -> mx.array:
        name = type(self).__name__
        if not isinstance(x, mx.array):
            raise TypeError(f"[{name}] expected an mx.array input, got {type(x).__name__}")
        if x.ndim < 3:
            raise ValueError(
                f"[{name}] expected input of shape (N, *spatial, C) with at least one spatial "
                f"axis, got shape {tuple(x.shape)}"
            )
        check_nonempty(x, name)
        return type(self).reduce(x, axis=tuple(range(1, x.ndim - 1)), keepdims=True)


class GlobalMaxPool(_GlobalPool):
    """The maximum over all spatial axes, kept as size-1 axes: ``(N, H, W, C) -> (N, 1, 1, C)``.

    Any number of spatial axes, at least one (``(N, L, C) -> (N, 1, C)`` too); none empty.

    >>> import mlx.core as mx
    >>> from fluxlike import GlobalMaxPool
    >>> GlobalMaxPool()
    GlobalMaxPool()
    >>> GlobalMaxPool()(mx.arange(8.0).reshape(1, 2, 2, 2))
    array([[[[6, 7]]]], dtype=float32)
    """

    reduce = mx.max


class GlobalMeanPool(_GlobalPool):
    """The mean over all spatial axes, kept as size-1 axes: ``(N, H, W, C) -> (N, 1, 1, C)``.

    Any number of spatial axes, at least one (``(N, L, C) -> (N, 1, C)`` too); none empty.

    Half precision is summed in float32 and the result returned in the input dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import GlobalMeanPool
    >>> GlobalMeanPool()
    GlobalMeanPool()
    >>> GlobalMeanPool()(mx.arange(8.0).reshape(1, 2, 2, 2))
    array([[[[3, 4]]]], dtype=float32)
    """

    reduce = workarounds.mean  # mx.mean, summing half precision in float32


class AdaptiveMeanPool(Layer):
    """Mean pooling to a fixed output spatial size: ``AdaptiveMeanPool(out_size)``.

    ``out_size`` is a tuple (its length chooses 1-, 2- or 3-D). Output index ``i`` along an
    axis of input size ``n`` and output size ``m`` averages the input range
    ``floor(i * n / m) : ceil((i + 1) * n / m)`` (PyTorch's formula; with ``n`` divisible by
    ``m`` these are the ``n / m`` tiles). Runs in the input's dtype (half precision sums in
    float32).

    >>> import mlx.core as mx
    >>> from fluxlike import AdaptiveMeanPool
    >>> pool = AdaptiveMeanPool((4, 4))
    >>> pool
    AdaptiveMeanPool((4, 4))
    >>> pool(mx.ones((2, 10, 7, 3))).shape
    (2, 4, 4, 3)
    """

    def __init__(self, out_size: tuple[int, ...]):
        super().__init__()
        self.out_size = kernel_tuple(out_size, "AdaptiveMeanPool", "out_size")

    def __call__(self, x: mx.array) -> mx.array:
        out_size = self["out_size"]  # by item: nn.Module.__getattr__ is slow
        check_input(x, len(out_size), "AdaptiveMeanPool", "pool")
        check_nonempty(x, "AdaptiveMeanPool")
        half = x.dtype if x.dtype in HALF else None
        if half is not None:  # sum in float32 (workarounds.mean), stay in it between axes
            x = x.astype(mx.float32)
        # A box mean is a mean along each axis in turn (the weights factorise).
        for axis, (n, m) in enumerate(zip(x.shape[1:-1], out_size, strict=True), start=1):
            if n == m:
                continue
            if n % m == 0:
                shape = (*x.shape[:axis], m, n // m, *x.shape[axis + 1:])
                x = mx.mean(x.reshape(shape), axis=axis + 1)
                continue
            lead = (slice(None),) * axis
            x = mx.concatenate([
                mx.mean(x[lead + (slice(i * n // m, -(-(i + 1) * n // m)),)], axis=axis,
                        keepdims=True)
                for i in range(m)
            ], axis=axis)
        return x if half is None else x.astype(half)

    def signature(self) -> str:
        return f"AdaptiveMeanPool({self.out_size})"

