"""Upsampling layers: ``Upsample`` (nearest or linear interpolation) and ``PixelShuffle``,
channels last, batch first: ``(N, *spatial, C)``.

Both have the precision policy "none": they move and mix values of one input and run in its
dtype (the interpolation weights of the linear modes are float32; their weighted sum is
rounded once to a half-precision input's dtype).
"""

from __future__ import annotations

import math
from typing import Any, cast

import mlx.core as mx
from mlx.nn.layers.upsample import upsample_linear, upsample_nearest

from ..checks import channels_last_fix, check_flag, check_size, is_int
from .base import Layer

# mode -> the number of spatial dimensions it takes (None: any)
MODES: dict[str, int | None] = {"nearest": None, "linear": None, "bilinear": 2, "trilinear": 3}
_SHAPES = {1: "(N, L, C)", 2: "(N, H, W, C)", 3: "(N, D, H, W, C)"}


def _check_array(x: Any, layer: str, min_ndim: int = 3) -> None:
    if not isinstance(x, mx.array):
        raise TypeError(f"[{layer}] expected an mx.array input, got {type(x).__name__}")
    if x.ndim < min_ndim:
        raise ValueError(
            f"[{layer}] expected input of shape (N, *spatial, C) with at least one spatial "
            f"axis, got shape {tuple(x.shape)}; add the batch axis with x[None]"
        )


def _scales(value: Any, name: str) -> float | tuple[float, ...]:
    """A positive number, or a tuple of them (one per spatial dimension)."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    ok = len(values) > 0 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
        for v in values
    )
    if not ok:
        raise ValueError(f"[Upsample] {name} must be a positive number or a tuple of them, "
                         f"got {value!r}")
    plain = tuple(int(v) if float(v).is_integer() else float(v) for v in values)
    return plain if isinstance(value, (tuple, list)) else plain[0]


class Upsample(Layer):
    """Upsampling of the spatial axes of ``(N, *spatial, C)`` input, Flux's ``Upsample``.

    ``Upsample(mode="nearest", *, scale=None, size=None, align_corners=True)``: give either
    ``scale`` (a number for every spatial axis, or one per axis) or ``size`` (the output's
    spatial size: an int for every axis, or one per axis), not both; ``Upsample(2)`` is
    ``Upsample(scale=2)``, as in Flux. ``mode`` is

    - ``"nearest"``: each value repeated (any number of spatial axes, any dtype);
    - ``"bilinear"`` (images), ``"trilinear"`` (volumes), or ``"linear"`` (any number of
      spatial axes, MLX's name): linear interpolation along each spatial axis, for floating
      input. ``align_corners=True`` (Flux's and NNlib's default) maps the corner pixels of
      input and output onto each other; ``align_corners=False`` is the default of PyTorch
      and ``mlx.nn.Upsample``.

    Built on MLX's ``mlx.nn.Upsample`` kernels. Precision: policy "none", computed in the
    input's dtype. A scale below 1 downsamples.

    >>> import mlx.core as mx
    >>> from fluxlike import Upsample
    >>> Upsample(2)
    Upsample('nearest', scale=2)
    >>> Upsample(scale=(2, 3))(mx.ones((1, 2, 2, 1))).shape
    (1, 4, 6, 1)
    >>> up = Upsample("bilinear", size=(3, 3))
    >>> up(mx.array([[0.0, 2.0], [4.0, 6.0]]).reshape(1, 2, 2, 1)).reshape(3, 3)
    array([[0, 1, 2],
           [2, 3, 4],
           [4, 5, 6]], dtype=float32)
    """

    def __init__(self, mode: str | float | tuple[float, ...] = "nearest", *,
                 scale: float | tuple[float, ...] | None = None,
                 size: int | tuple[int, ...] | None = None, align_corners: bool = True):
        super().__init__()
        if not isinstance(mode, str) and scale is None and size is None:  # Upsample(2)
            mode, scale = "nearest", cast("float | tuple[float, ...]", mode)
        if mode not in MODES:
            raise ValueError(f"[Upsample] unknown mode {mode!r}; expected one of {list(MODES)}")
        if (scale is None) == (size is None):
            raise ValueError("[Upsample] give either scale or size (the output's spatial "
                             f"size), not both or neither; got scale={scale!r}, size={size!r}")
        self.mode = mode
        self.scale = None if scale is None else _scales(scale, "scale")
        self.size: int | tuple[int, ...] | None
        if size is None:
            self.size = None
        elif is_int(size):
            self.size = check_size(size, "Upsample", "size")
        elif isinstance(size, (tuple, list)) and size:
            self.size = tuple(check_size(s, "Upsample", "size") for s in size)
        else:
            raise ValueError(f"[Upsample] size must be a positive int or a tuple of them, "
                             f"got {size!r}")
        self.align_corners = check_flag(align_corners, "Upsample", "align_corners")

    def _factors(self, x: mx.array) -> tuple[float, ...]:
        """The scale per spatial axis for ``x``, checked against its shape."""
        spatial = x.shape[1:-1]
        n = len(spatial)
        wanted = MODES[self.mode]
        if wanted is not None and n != wanted:
            raise ValueError(
                f"[Upsample] mode {self.mode!r} takes input of shape {_SHAPES[wanted]}, got "
                f"shape {tuple(x.shape)}; mode='linear' interpolates along any number of "
                f"spatial axes"
            )
        given = cast("float | tuple[float, ...]", self.scale if self.scale is not None
                     else self.size)  # one of them is given
        values = given if isinstance(given, tuple) else (given,) * n
        if len(values) != n:
            what = "scale" if self.scale is not None else "size"
            raise ValueError(
                f"[Upsample] {what}={given!r} has {len(values)} entries but the input has "
                f"{n} spatial axes (shape {tuple(x.shape)}, channels last)"
            )
        if self.scale is not None:
            factors = tuple(float(v) for v in values)
        else:  # a size: the scale whose product with the input size truncates to it
            factors = tuple(m / s if int(m / s * s) == m else math.nextafter(m / s, math.inf)
                            for m, s in zip(values, spatial, strict=True))
        out = tuple(int(f * s) for f, s in zip(factors, spatial, strict=True))
        if min(out) < 1:
            raise ValueError(f"[Upsample] scale {given!r} leaves nothing of input shape "
                             f"{tuple(x.shape)} (output spatial size {out})")
        return factors

    def __call__(self, x: mx.array) -> mx.array:
        _check_array(x, "Upsample")
        factors = self._factors(x)
        if self.mode == "nearest":
            return upsample_nearest(x, factors)
        if not mx.issubdtype(x.dtype, mx.floating):
            raise TypeError(f"[Upsample] mode {self.mode!r} interpolates: expected a floating "
                            f"input, got {x.dtype}; convert it with x.astype(mx.float32) or "
                            f"use mode='nearest'")
        y = upsample_linear(x, factors, align_corners=self.align_corners)
        return y if y.dtype == x.dtype else y.astype(x.dtype)  # float32 weights promote

    def signature(self) -> str:
        parts = [repr(self.mode)]
        parts.append(f"scale={self.scale}" if self.scale is not None else f"size={self.size}")
        if self.mode != "nearest" and not self.align_corners:
            parts.append("align_corners=False")
        return f"Upsample({', '.join(parts)})"


def pixel_shuffle(x: mx.array, r: int) -> mx.array:
    """Rearrange ``(N, *spatial, C * r**d)`` into ``(N, *(s * r for s in spatial), C)``
    (``d`` spatial axes), NNlib's and PyTorch's ``pixel_shuffle`` in channels-last layout:
    input channel ``c * r**d + offset`` (the offset counted row-major over the ``r**d``
    positions of an output block) goes to output channel ``c`` at that position. For 2-D:
    ``y[n, h*r + i, w*r + j, c] == x[n, h, w, c*r*r + i*r + j]``.

    >>> import mlx.core as mx
    >>> from fluxlike.layers.upsample import pixel_shuffle
    >>> pixel_shuffle(mx.arange(4).reshape(1, 1, 1, 4), 2).reshape(2, 2)
    array([[0, 1],
           [2, 3]], dtype=int32)
    """
    _check_array(x, "PixelShuffle")
    n, *spatial, channels = x.shape
    d = len(spatial)
    block = r**d
    if channels % block:
        raise ValueError(
            f"[PixelShuffle] the channels (last axis) must be a multiple of r^{d} = {block} "
            f"for {d} spatial axes, got shape {tuple(x.shape)}"
            f"{channels_last_fix(x.ndim, maybe=True)}"
        )
    y = x.reshape(n, *spatial, channels // block, *(r,) * d)
    # (n, s1, ..., sd, c, r1, ..., rd) -> (n, s1, r1, ..., sd, rd, c)
    order = [0, *(a for k in range(d) for a in (1 + k, d + 2 + k)), d + 1]
    return y.transpose(order).reshape(n, *(s * r for s in spatial), channels // block)


class PixelShuffle(Layer):
    """Pixel shuffle with upscale factor ``r`` (Shi et al., 2016; Flux's ``PixelShuffle``):
    ``(N, *spatial, C * r**d)`` becomes ``(N, *(s * r for s in spatial), C)``, the usual end of
    a sub-pixel convolution. The channel order is NNlib's and PyTorch's (see
    :func:`pixel_shuffle`), so a PyTorch or Flux model's weights keep their meaning once
    permuted to channels last. Policy "none": a reshuffle, in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import Chain, Conv, PixelShuffle
    >>> PixelShuffle(2)
    PixelShuffle(2)
    >>> model = Chain(Conv((3, 3), 3, 12, padding=1), PixelShuffle(2))
    >>> model(mx.ones((1, 8, 8, 3))).shape
    (1, 16, 16, 3)
    """

    def __init__(self, r: int):
        super().__init__()
        self.r = check_size(r, "PixelShuffle", "r")

    def __call__(self, x: mx.array) -> mx.array:
        return pixel_shuffle(x, self.r)

    def signature(self) -> str:
        return f"PixelShuffle({self.r})"
