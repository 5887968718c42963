"""Convolution layers: ``Conv`` (and its Flux names ``CrossCor`` and ``DepthwiseConv``) and
``ConvTranspose``, channels last, batch first.

Every one is a cross-correlation, as in MLX and PyTorch: the kernel is not flipped. Flux's
``Conv`` flips it (a true convolution) and its ``CrossCor`` does not, so a Flux ``Conv`` weight
needs its spatial axes reversed to load here, a ``CrossCor`` weight does not.

The kernel tuple's length chooses the dimension: ``(3,)`` is a 1-D convolution over
``(N, L, C)``, ``(3, 3)`` a 2-D one over ``(N, H, W, C)``, ``(3, 3, 3)`` a 3-D one over
``(N, D, H, W, C)``. Weights use MLX's layout ``(out, *kernel, in // groups)``.

``padding`` is an int (every side), a tuple with one int per spatial dimension (both sides
of that dimension), a tuple of ``(lo, hi)`` pairs (entries may mix ints and pairs), or
``"same"``, Flux's ``SamePad``: a stride-1 ``Conv`` keeps the spatial size, a strided one
gives ``ceil(size / stride)``, and an odd total padding puts the extra row on the low side.

Inputs need their batch axis. MLX's kernels take ``groups > 1`` only in 1-D and 2-D, so a
grouped 3-D layer runs one convolution per group. Float64 works on the CPU only where MLX
has float64 kernels (stride 1 in the backward pass, no dilation, one group), and MLX
computes those at about float32 precision.

The helpers here (argument checks, padding, repr text) are shared with ``pooling.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import mlx.core as mx

from .. import workarounds
from ..activations import identity, resolve
from ..checks import (
    channels_first_hint,
    channels_last_fix,
    check_flag,
    check_size,
    initialise,
    is_int,
)
from ..init import glorot_uniform
from ..precision import kernels
from ..precision.operands import operands
from ..precision.policy import autocast_policy
from .base import Layer, signature_of

Pairs = tuple[tuple[int, int], ...]

SHAPES = {1: "(N, L, C)", 2: "(N, H, W, C)", 3: "(N, D, H, W, C)"}


def kernel_tuple(kernel: Any, layer: str, name: str = "kernel") -> tuple[int, ...]:
    """``kernel`` as a tuple of 1 to 3 positive ints; an int is refused as ambiguous.

    Integers of any type (``np.int64``) are accepted and stored as Python ints, here and in
    the helpers below, so reprs show plain numbers."""
    if is_int(kernel):
        k = int(kernel)
        raise TypeError(
            f"[{layer}] {name} must be a tuple whose length is the number of spatial dims, "
            f"got {k!r}; write ({k},) for 1-D or ({k}, {k}) for 2-D"
        )
    if not isinstance(kernel, (tuple, list)) or not 1 <= len(kernel) <= 3:
        raise ValueError(f"[{layer}] {name} must be a tuple of 1 to 3 sizes, got {kernel!r}")
    for k in kernel:
        if not is_int(k) or k < 1:
            raise ValueError(f"[{layer}] {name} must hold positive integers, got {kernel!r}")
    return tuple(int(k) for k in kernel)


def per_dim(value: Any, n: int, layer: str, name: str, minimum: int = 1) -> tuple[int, ...]:
    """An int or a length-``n`` tuple of ints ``>= minimum`` as a length-``n`` tuple."""
    values = (value,) * n if is_int(value) else value
    ok = isinstance(values, (tuple, list)) and len(values) == n and all(
        is_int(v) and v >= minimum for v in values
    )
    if not ok:
        what = "positive" if minimum == 1 else f"at least {minimum}"
        raise ValueError(
            f"[{layer}] {name} must be an int or a tuple of {n} ints, each {what}, "
            f"got {value!r}"
        )
    return tuple(int(v) for v in values)


def same_padding(kernel: Sequence[int], dilation: Sequence[int]) -> Pairs:
    """Flux's ``SamePad``: total ``dilation * (k - 1)`` per dim, the odd row on the low side."""
    totals = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
    return tuple((t - t // 2, t // 2) for t in totals)


def padding_pairs(padding: Any, n: int, layer: str) -> Pairs:
    """``padding`` (int, tuple of ints and/or ``(lo, hi)`` pairs) as ``n`` ``(lo, hi)`` pairs."""
    if isinstance(padding, str):
        raise ValueError(
            f"[{layer}] unknown padding {padding!r}; expected 'same', an int or a tuple"
        )
    if is_int(padding):
        padding = (padding,) * n
    if not isinstance(padding, (tuple, list)) or len(padding) != n:
        raise ValueError(
            f"[{layer}] padding must be 'same', an int, or a tuple of {n} ints or (lo, hi) "
            f"pairs (one per spatial dim), got {padding!r}"
        )
    pairs = tuple((p, p) if is_int(p) else p for p in padding)
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(
            is_int(v) and v >= 0 for v in pair
        ):
            raise ValueError(
                f"[{layer}] padding must hold non-negative ints or (lo, hi) pairs of them, "
                f"got {padding!r}"
            )
    return tuple((int(lo), int(hi)) for lo, hi in pairs)


def check_input(x: Any, n: int, layer: str, kind: str, channels: int | None = None) -> None:
    """Raise unless ``x`` is an ``(N, *spatial, C)`` array with ``n`` spatial dims."""
    if not isinstance(x, mx.array):
        raise TypeError(f"[{layer}] expected an mx.array input, got {type(x).__name__}")
    if x.ndim != n + 2:
        raise ValueError(
            f"[{layer}] expected input of shape {SHAPES[n]} for a {n}-D {kind}, "
            f"got shape {tuple(x.shape)}"
        )
    if channels is not None and x.shape[-1] != channels:
        raise ValueError(
            f"[{layer}] expected input with {channels} channels (last axis), "
            f"got shape {tuple(x.shape)}{channels_first_hint(x.shape, channels)}"
        )


def check_fits(x: mx.array, extent: Sequence[int], pads: Pairs, layer: str, what: str) -> None:
    """Raise unless every padded spatial size of ``x`` holds a window of ``extent``."""
    padded = tuple(s + lo + hi for s, (lo, hi) in zip(x.shape[1:-1], pads, strict=True))
    if any(p < e for p, e in zip(padded, extent, strict=True)):
        # A channels-first input puts its few channels among the spatial sizes (a pool knows
        # no channel count to tell): hint when its true spatial axes would fit.
        spatial = (s + lo + hi for s, (lo, hi) in zip(x.shape[2:], pads, strict=True))
        fits = all(p >= e for p, e in zip(spatial, extent, strict=True))
        raise ValueError(
            f"[{layer}] input of shape {tuple(x.shape)} is too small: padded spatial size "
            f"{padded} is smaller than the {what} {tuple(extent)}"
            f"{channels_last_fix(x.ndim, maybe=True) if fits else ''}"
        )


def short(values: Iterable[Any]) -> str:
    """One value when all are equal (``2`` for ``(2, 2)``), else the tuple, as Flux prints."""
    values = tuple(values)
    return str(values[0]) if len(set(values)) == 1 else str(values)


def pad_text(pairs: Pairs, same: bool) -> str | None:
    """The ``pad=`` text of a repr, or ``None`` for no padding."""
    if same:
        return "'same'"
    if all(lo == hi for lo, hi in pairs):
        return None if all(lo == 0 for lo, _ in pairs) else short(lo for lo, _ in pairs)
    return str(pairs)


def _options(layer: Any, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The non-default options of a convolution, in repr order."""
    options = {}
    if any(s != 1 for s in layer.stride):
        options["stride"] = short(layer.stride)
    pad = pad_text(layer.padding, layer.same)
    if pad is not None:
        options["pad"] = pad
    options.update(extra or {})
    if any(d != 1 for d in layer.dilation):
        options["dilation"] = short(layer.dilation)
    if layer.groups != 1:
        options["groups"] = str(layer.groups)
    if layer.bias is None:
        options["bias"] = "False"
    return options


class _ConvBase(Layer):
    """What ``Conv`` and ``ConvTranspose`` share: checks, parameters and the repr.

    The calls read parameters and tuple options by item (``self["stride"]``):
    ``self.stride`` goes through ``nn.Module.__getattr__``, which is slow.
    """

    def _setup(self, name: str, kernel: Any, in_channels: int, out_channels: int, act: Any,
               stride: Any, dilation: Any, groups: int) -> tuple[int, ...]:
        kernel = kernel_tuple(kernel, name)
        n = len(kernel)
        in_channels = check_size(in_channels, name, "in_channels")
        out_channels = check_size(out_channels, name, "out_channels")
        groups = check_size(groups, name, "groups")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"[{name}] in_channels ({in_channels}) and out_channels ({out_channels}) "
                f"must both be divisible by groups ({groups})"
            )
        self.stride = per_dim(stride, n, name, "stride")
        self.dilation = per_dim(dilation, n, name, "dilation")
        self.act = resolve(act, name)
        self.groups = groups
        self.in_channels = in_channels
        return kernel

    def _make_parameters(self, kernel: tuple[int, ...], out_channels: int, bias: bool,
                         init: Callable) -> None:
        name = type(self).__name__
        bias = check_flag(bias, name, "bias")
        # int(): out_channels comes from the caller unconverted (validated by _setup)
        shape = (int(out_channels), *kernel, self.in_channels // self.groups)
        self.weight = initialise(init, shape, name)
        self.bias = mx.zeros((int(out_channels),), self.weight.dtype) if bias else None

    @property
    def kernel(self) -> tuple[int, ...]:
        """The kernel's spatial size."""
        return tuple(self["weight"].shape[1:-1])

    def _check(self, x: Any, weight: mx.array) -> None:
        check_input(x, weight.ndim - 2, type(self).__name__, self.kind, self.in_channels)

    def _finish(self, y: mx.array, bias: mx.array | None) -> mx.array:
        return self.act(y if bias is None else y + bias)

    def _signature(self, in_ch: int, out_ch: int, extra: dict[str, str] | None = None) -> str:
        name = type(self).__name__
        args = [str(self.kernel), f"{in_ch} => {out_ch}"]
        return signature_of(args, name, self.act, **_options(self, extra))


@autocast_policy("down")
class Conv(_ConvBase):
    """A convolution: ``act(conv(x, weight) + bias)``, channels last.

    ``Conv(kernel, in_channels, out_channels, act=identity, *, stride=1, padding=0,
    dilation=1, groups=1, bias=True, init=glorot_uniform)``. ``kernel`` is a tuple; its
    length (1, 2 or 3) chooses the dimension (an int is refused: write ``(3,)`` for 1-D).
    The input is ``(N, *spatial, in_channels)`` with a batch axis; ``weight`` has shape
    ``(out_channels, *kernel, in_channels // groups)``, ``bias`` ``(out_channels,)`` or
    ``None``. ``stride`` and ``dilation`` are an int or one per dim; ``padding`` as in the
    module docstring (``"same"``: output size ``ceil(input / stride)``). Under
    :func:`~fluxlike.autocast` it computes in the scope's dtype. The repr uses Flux's
    keyword names: ``pad=`` for ``padding``.

    >>> import mlx.core as mx
    >>> from fluxlike import Conv, relu
    >>> layer = Conv((3, 3), 1, 8, relu, stride=2, padding=1)
    >>> layer
    Conv((3, 3), 1 => 8, relu, stride=2, pad=1)  # 80 parameters
    >>> layer.weight.shape
    (8, 3, 3, 1)
    >>> layer(mx.ones((2, 28, 28, 1))).shape
    (2, 14, 14, 8)
    >>> Conv((5,), 4, 6, padding="same", groups=2, bias=False)(mx.ones((1, 10, 4))).shape
    (1, 10, 6)
    """

    kind = "convolution"

    def __init__(
        self,
        kernel: tuple[int, ...],
        in_channels: int,
        out_channels: int,
        act: Callable | str = identity,
        *,
        stride: int | tuple[int, ...] = 1,
        padding: int | str | tuple = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        bias: bool = True,
        init: Callable[[tuple[int, ...]], mx.array] = glorot_uniform,
    ):
        super().__init__()
        name = type(self).__name__  # CrossCor's too
        kernel = self._setup(name, kernel, in_channels, out_channels, act, stride, dilation,
                             groups)
        self.same = padding == "same"
        if self.same:
            self.padding = same_padding(kernel, self.dilation)
        else:
            self.padding = padding_pairs(padding, len(kernel), name)
        self._make_parameters(kernel, out_channels, bias, init)

    def __call__(self, x: mx.array) -> mx.array:
        weight, padding, dilation = self["weight"], self["padding"], self["dilation"]
        self._check(x, weight)
        name = type(self).__name__
        extent = [d * (k - 1) + 1 for k, d in zip(weight.shape[1:-1], dilation, strict=True)]
        check_fits(x, extent, padding, name, "dilated kernel")
        x, weight, bias = operands(x, weight, self.get("bias"), layer=name)
        lo, hi = zip(*padding, strict=True)
        options = (self["stride"], (lo, hi), dilation, self.groups)
        if workarounds.splits_groups(x, self.groups):
            return self._finish(workarounds.grouped(kernels.conv, x, weight, *options), bias)
        return kernels.conv(x, weight, *options, bias, self.act)

    def signature(self) -> str:
        return self._signature(self.in_channels, self.weight.shape[0])


class CrossCor(Conv):
    """A cross-correlation, ``act(crosscor(x, weight) + bias)``: Flux's ``CrossCor``, which is
    what :class:`Conv` computes in fluxlike (MLX's and PyTorch's convolution does not flip the
    kernel; Flux's ``Conv`` does).

    The same arguments, weights, padding rules and precision policy ("down") as
    :class:`Conv`; only the name differs, so that a model ported from Flux keeps its layer
    names, and a Flux ``CrossCor`` weight loads without flipping (permuted from Flux's
    ``(*kernel, in, out)`` to ``(out, *kernel, in)``: ``w.transpose(3, 0, 1, 2)`` for 2-D).

    >>> import mlx.core as mx
    >>> from fluxlike import CrossCor
    >>> layer = CrossCor((3, 3), 1, 8, "relu", padding=1)
    >>> layer
    CrossCor((3, 3), 1 => 8, relu, pad=1)  # 80 parameters
    >>> layer(mx.ones((2, 28, 28, 1))).shape
    (2, 28, 28, 8)
    """


def DepthwiseConv(  # noqa: N802  (a constructor, named as Flux names it)
    kernel: tuple[int, ...],
    in_channels: int,
    out_channels: int,
    act: Callable | str = identity,
    *,
    stride: int | tuple[int, ...] = 1,
    padding: int | str | tuple = 0,
    dilation: int | tuple[int, ...] = 1,
    bias: bool = True,
    init: Callable[[tuple[int, ...]], mx.array] = glorot_uniform,
) -> Conv:
    """A depthwise convolution: each input channel convolved with its own
    ``out_channels // in_channels`` kernels, as Flux's ``DepthwiseConv``.

    Like Flux's, it is a :class:`Conv` with ``groups=in_channels`` (and prints as one);
    ``out_channels`` must be a multiple of ``in_channels``. ``weight`` has shape
    ``(out_channels, *kernel, 1)``. The other arguments are :class:`Conv`'s.

    >>> import mlx.core as mx
    >>> from fluxlike import DepthwiseConv
    >>> layer = DepthwiseConv((3, 3), 4, 8, padding="same")
    >>> layer
    Conv((3, 3), 4 => 8, pad='same', groups=4)  # 80 parameters
    >>> layer(mx.ones((2, 5, 5, 4))).shape
    (2, 5, 5, 8)
    """
    in_channels = check_size(in_channels, "DepthwiseConv", "in_channels")
    out_channels = check_size(out_channels, "DepthwiseConv", "out_channels")
    if out_channels % in_channels:
        raise ValueError(
            f"[DepthwiseConv] out_channels must be a multiple of in_channels (each input "
            f"channel gets out_channels // in_channels kernels), got in_channels="
            f"{in_channels}, out_channels={out_channels}; use Conv(..., groups=g) for other "
            f"groupings"
        )
    return Conv(kernel, in_channels, out_channels, act, stride=stride, padding=padding,
                dilation=dilation, groups=in_channels, bias=bias, init=init)


@autocast_policy("down")
class ConvTranspose(_ConvBase):
    """A transposed convolution (the adjoint of ``Conv``'s map of ``x``), channels last.

    ``ConvTranspose(kernel, in_channels, out_channels, act=identity, *, stride=1, padding=0,
    dilation=1, output_padding=0, groups=1, bias=True, init=glorot_uniform)``. Each input
    position ``i`` scatters ``x[i] * weight[:, k]`` to output position
    ``i * stride + k * dilation - lo``; the output's spatial size is
    ``(n - 1) * stride + dilation * (k - 1) + 1 - lo - hi + output_padding``.
    ``padding`` takes the same forms as ``Conv``'s; ``"same"`` makes the output exactly
    ``input * stride`` (and picks ``output_padding`` itself). ``weight`` has shape
    ``(out_channels, *kernel, in_channels // groups)``, as in MLX. The repr uses Flux's
    keyword names: ``pad=`` for ``padding``, ``outpad=`` for ``output_padding``.

    >>> import mlx.core as mx
    >>> from fluxlike import ConvTranspose
    >>> layer = ConvTranspose((3, 3), 8, 1)
    >>> layer
    ConvTranspose((3, 3), 8 => 1)  # 73 parameters
    >>> layer(mx.ones((2, 7, 7, 8))).shape
    (2, 9, 9, 1)
    >>> ConvTranspose((4, 4), 8, 4, stride=2, padding="same")(mx.ones((2, 7, 7, 8))).shape
    (2, 14, 14, 4)
    >>> ConvTranspose((3,), 2, 2, stride=2, padding=1, output_padding=1)
    ConvTranspose((3,), 2 => 2, stride=2, pad=1, outpad=1)  # 14 parameters
    """

    kind = "transposed convolution"

    def __init__(
        self,
        kernel: tuple[int, ...],
        in_channels: int,
        out_channels: int,
        act: Callable | str = identity,
        *,
        stride: int | tuple[int, ...] = 1,
        padding: int | str | tuple = 0,
        dilation: int | tuple[int, ...] = 1,
        output_padding: int | tuple[int, ...] = 0,
        groups: int = 1,
        bias: bool = True,
        init: Callable[[tuple[int, ...]], mx.array] = glorot_uniform,
    ):
        super().__init__()
        name = "ConvTranspose"
        kernel = self._setup(name, kernel, in_channels, out_channels, act, stride, dilation,
                             groups)
        n = len(kernel)
        output_padding = per_dim(output_padding, n, name, "output_padding", minimum=0)
        self.same = padding == "same"
        if self.same:
            if any(output_padding):
                raise ValueError(
                    f"[{name}] padding='same' picks the output padding itself; "
                    f"drop output_padding={output_padding!r}"
                )
            # Crop dilation * (k - 1) + 1 - stride in all, or extend when that is negative.
            dims = zip(kernel, self.dilation, self.stride, strict=True)
            totals = [d * (k - 1) + 1 - s for k, d, s in dims]
            self.padding = tuple((t - t // 2, t // 2) if t > 0 else (0, 0) for t in totals)
            output_padding = tuple(max(-t, 0) for t in totals)
        else:
            self.padding = padding_pairs(padding, n, name)
            steps = zip(output_padding, self.stride, self.dilation, strict=True)
            if any(op >= max(s, d) for op, s, d in steps):
                raise ValueError(
                    f"[{name}] output_padding must be smaller than stride or dilation in each "
                    f"dimension (it picks among the input sizes a stride maps to one output "
                    f"size), got output_padding={output_padding}, stride={self.stride}, "
                    f"dilation={self.dilation}"
                )
        self.output_padding = output_padding
        self._make_parameters(kernel, out_channels, bias, init)

    def output_size(self, size: Sequence[int]) -> tuple[int, ...]:
        """The output's spatial size for an input of spatial size ``size``."""
        dims = zip(size, self["stride"], self["dilation"], self.kernel, self["padding"],
                   self["output_padding"], strict=True)
        return tuple((n - 1) * s + d * (k - 1) + 1 - lo - hi + op
                     for n, s, d, k, (lo, hi), op in dims)

    def __call__(self, x: mx.array) -> mx.array:
        weight, padding = self["weight"], self["padding"]
        self._check(x, weight)
        size = self.output_size(x.shape[1:-1])
        if min(size) < 1:
            raise ValueError(
                f"[ConvTranspose] padding {padding} crops the output for input shape "
                f"{tuple(x.shape)} to nothing (spatial size {size}); use less padding"
            )
        x, weight, bias = operands(x, weight, self.get("bias"), layer="ConvTranspose")
        # What MLX's conv_transpose computes correctly: a symmetric padding of at most
        # dilation * (k - 1), cropped below, and an output padding of at most that, the rest
        # appended as zeros (before the bias and activation).
        sym = workarounds.conv_transpose_padding(padding, self.kernel, self["dilation"])
        out_pad, extra = workarounds.conv_transpose_output_padding(
            self["output_padding"], padding, sym)
        options = (self["stride"], sym, self["dilation"], out_pad, self.groups)
        if workarounds.splits_groups(x, self.groups) or any(extra):
            if workarounds.splits_groups(x, self.groups):
                y = workarounds.grouped(kernels.conv_transpose, x, weight, *options)
            else:
                y = kernels.conv_transpose(x, weight, *options)
            if any(extra):
                y = mx.pad(y, [(0, 0), *((0, e) for e in extra), (0, 0)])
            y = self._finish(y, bias)
        else:  # bias and activation are elementwise: applied before the crop below
            y = kernels.conv_transpose(x, weight, *options, bias, self.act)
        starts = [lo - p for (lo, _), p in zip(padding, sym, strict=True)]
        if any(starts) or tuple(y.shape[1:-1]) != size:
            # (the index built first: mypy reads y[(a, *b)] as Python 3.11's y[a, *b])
            crop = (slice(None), *(slice(a, a + n) for a, n in zip(starts, size, strict=True)))
            y = y[crop]
        return y

    def signature(self) -> str:
        extra = {}
        if any(self.output_padding) and not self.same:
            extra["outpad"] = short(self.output_padding)
        return self._signature(self.in_channels, self.weight.shape[0], extra)
