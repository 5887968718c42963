"""Normalisation layers (BatchNorm, LayerNorm, RMSNorm, GroupNorm, InstanceNorm), Dropout and
AlphaDropout.

Channels last: the channel axis is the input's last axis. The norm layers have the "fp32"
precision policy: statistics and affine are computed in at least float32 (half-precision
input and parameters are cast up, float64 stays float64) and the result is cast back to the
input dtype. Inside an :func:`~fluxlike.autocast` scope the input arrives already cast up and
the output is float32.

Storage: ``f16mix``/``bf16mix`` keep the parameters and running statistics of ``BatchNorm``,
``InstanceNorm`` and ``GroupNorm`` in float32 (``keep_float32``); ``LayerNorm`` and
``RMSNorm`` are converted with the rest of the model (their half-precision weights are cast
up for the computation, which still runs in float32).

>>> from fluxlike import BatchNorm, Chain, LayerNorm, f16mix
>>> half = f16mix(Chain(BatchNorm(4), LayerNorm(4)))
>>> half[0].weight.dtype, half[1].weight.dtype
(mlx.core.float32, mlx.core.float16)

``BatchNorm``, ``InstanceNorm``, ``Dropout`` and ``AlphaDropout`` depend on the train/test
mode (see :mod:`fluxlike.modes`): active inside gradient computations, inactive elsewhere,
unless fixed by ``trainmode``/``testmode``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast, overload

import mlx.core as mx

from .. import workarounds
from ..activations import identity, resolve
from ..checks import (
    channels_first_hint,
    check_active,
    check_flag,
    check_real,
    check_size,
    is_int,
)
from ..modes import is_active
from ..precision.policy import autocast_policy
from .base import Layer, signature_of

Dims = int | tuple[int, ...]


def _check_eps(eps: Any, layer: str) -> float:
    return check_real(eps, layer, "eps", lambda v: 0 < v < math.inf, "a positive number")


def _check_momentum(momentum: Any, layer: str) -> float:
    return check_real(momentum, layer, "momentum", lambda v: 0 <= v <= 1, "in [0, 1]")


def _check_dims(dims: Any, layer: str, name: str = "dims") -> tuple[int, ...]:
    """A positive int or a non-empty tuple of them, as a tuple of Python ints."""
    shape = (dims,) if is_int(dims) else dims
    if not isinstance(shape, tuple) or not shape:
        raise ValueError(f"[{layer}] {name} must be a positive integer or a tuple of them, "
                         f"got {dims!r}")
    return tuple(check_size(size, layer, name) for size in shape)


def _check_input(x: Any, layer: str, trailing: tuple[int, ...], min_ndim: int, form: str) -> None:
    """Raise unless ``x`` is a floating array of at least ``min_ndim`` axes ending in
    ``trailing``; ``form`` describes the expected layout in the message."""
    if not isinstance(x, mx.array):
        raise TypeError(f"[{layer}] expected an mx.array input, got {type(x).__name__}")
    if not mx.issubdtype(x.dtype, mx.floating):
        raise TypeError(f"[{layer}] expected a floating-point input, got {x.dtype}; "
                        f"convert it first, e.g. x.astype(mx.float32)")
    if x.ndim < max(min_ndim, len(trailing)):
        raise ValueError(f"[{layer}] expected input of at least {min_ndim} dimensions {form}, "
                         f"got shape {tuple(x.shape)}")
    if tuple(x.shape[x.ndim - len(trailing):]) != trailing:
        if len(trailing) == 1:
            what = f"{trailing[0]} channels on the last axis (channels last, e.g. NHWC)"
            hint = channels_first_hint(x.shape, trailing[0])
        else:
            what, hint = f"trailing shape {trailing}", ""
        raise ValueError(f"[{layer}] expected input with {what}, got shape "
                         f"{tuple(x.shape)}{hint}")


def _compute_dtype(x: mx.array, *params: mx.array | None) -> mx.Dtype:
    """float64 if the input or a parameter is float64, else float32."""
    f64 = mx.float64
    if x.dtype == f64:
        return f64
    for p in params:  # a plain loop: every call of a norm layer
        if p is not None and p.dtype == f64:
            return f64
    return mx.float32


@overload
def _as(x: mx.array, dtype: mx.Dtype) -> mx.array: ...
@overload
def _as(x: None, dtype: mx.Dtype) -> None: ...
@overload
def _as(x: mx.array | None, dtype: mx.Dtype) -> mx.array | None: ...
def _as(x: mx.array | None, dtype: mx.Dtype) -> mx.array | None:
    return x if x is None or x.dtype == dtype else x.astype(dtype)


def _count(x: mx.array, axes: tuple[int, ...], layer: str) -> int:
    """How many values each statistic averages; statistics need at least two."""
    n = math.prod(x.shape[a] for a in axes)
    if n < 2:
        raise ValueError(f"[{layer}] statistics from the input need more than one value per "
                         f"channel, got shape {tuple(x.shape)}")
    return n


def _options(**pairs: tuple[Any, Any]) -> dict[str, Any]:
    """``key=value`` options that differ from their defaults, from ``key=(value, default)``."""
    return {k: v for k, (v, default) in pairs.items() if v != default}


class _Norm(Layer):
    """Shared parts: the affine parameters, the activation, casting back.

    Parameters are read by item (``self.get("weight")``): as attributes they go through
    ``nn.Module.__getattr__``, which is slow.
    """

    def _init_affine(self, shape: tuple[int, ...], affine: bool, bias: bool = True) -> None:
        self.weight = mx.ones(shape) if affine else None
        self.bias = mx.zeros(shape) if affine and bias else None

    def _finish(self, y: mx.array, dtype: mx.Dtype, out_dtype: mx.Dtype) -> mx.array:
        """Affine (if any), activation, then back to the input dtype."""
        weight, bias = self.get("weight"), self.get("bias")
        if weight is not None:
            y = y * _as(weight, dtype)
        if bias is not None:
            y = y + _as(bias, dtype)
        return _as(getattr(self, "act", identity)(y), out_dtype)


class _RunningNorm(_Norm):
    """BatchNorm and InstanceNorm: optional running statistics, frozen, updated when active."""

    _STATS = ["running_mean", "running_var"]

    def __init__(self, channels: int, act: Callable | str, *, momentum: float, eps: float,
                 affine: bool, track_stats: bool, active: bool | None):
        super().__init__()
        name = type(self).__name__
        channels = check_size(channels, name, "channels")
        affine = check_flag(affine, name, "affine")
        track_stats = check_flag(track_stats, name, "track_stats")
        self.channels = channels
        self.act = resolve(act, name)
        self.momentum = _check_momentum(momentum, name)
        self.eps = _check_eps(eps, name)
        self.active = check_active(active, name)
        self._init_affine((channels,), affine)
        self.running_mean = mx.zeros((channels,)) if track_stats else None
        self.running_var = mx.ones((channels,)) if track_stats else None
        if track_stats:
            # In parameters() (so checkpoints keep them) but never trained, whatever unfreezes.
            self._no_grad = workarounds.always_frozen(self._STATS)

    def _normalise(self, x: mx.array, axes: tuple[int, ...], name: str) -> mx.array:
        """Normalise over ``axes`` with the input's statistics or the running ones; the running
        statistics are updated (with new arrays, after everything else succeeded) when active."""
        running_mean, running_var = self.get("running_mean"), self.get("running_var")
        stats = cast("tuple[mx.array, mx.array]", (running_mean, running_var))  # both or none
        dtype = _compute_dtype(x, self.get("weight"), running_mean)
        y = _as(x, dtype)
        active = is_active(self)
        update = None
        if active or running_mean is None:
            n = _count(x, axes, name)
            mean = mx.mean(y, axis=axes, keepdims=True)
            var = mx.var(y, axis=axes, keepdims=True)
            if active and running_mean is not None:
                unbiased = var * (n / (n - 1))
                update = self._new_stats(stats, (mean, unbiased), dtype)
        else:
            mean, var = _as(stats[0], dtype), _as(stats[1], dtype)
        out = self._finish((y - mean) * mx.rsqrt(var + self.eps), dtype, x.dtype)
        if update is not None:
            self.running_mean, self.running_var = update
        return out

    def _new_stats(self, running: tuple[mx.array, mx.array], batch: tuple[mx.array, mx.array],
                   dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """PyTorch's rule ``(1 - m) * running + m * batch``, per channel, in the stats' dtype.
        The batch statistics are constants here: no gradient flows into running statistics."""
        m = self.momentum
        fresh = []
        for old, new in zip(running, batch, strict=True):
            new = mx.stop_gradient(new).reshape(-1, new.shape[-1]).mean(axis=0)
            fresh.append(_as((1 - m) * _as(old, dtype) + m * new, old.dtype))
        return fresh[0], fresh[1]


@autocast_policy("fp32", keep_float32=True)
class BatchNorm(_RunningNorm):
    """Batch normalisation over every axis but the last (the channels), as in Flux.

    ``BatchNorm(channels, act=identity, *, momentum=0.1, eps=1e-5, affine=True,
    track_stats=True, active=None)`` computes ``act(weight * (x - μ) / sqrt(σ² + eps) + bias)``
    per channel. When active (training) ``μ``, ``σ²`` are the batch's statistics, and
    ``running_mean``/``running_var`` move towards them:
    ``running = (1 - momentum) * running + momentum * batch`` (the unbiased variance, as in
    PyTorch). When inactive the running statistics are used (the batch's, if
    ``track_stats=False``). ``weight``/``bias`` are ``None`` when ``affine=False``; the running
    statistics are ``None`` when ``track_stats=False``, and otherwise frozen: saved with the
    model, never trained. Statistics are computed in float32 (float64 for float64 input); the
    output has the input's dtype.

    Under ``mx.compile`` pass the model's state (``inputs=model.state,
    outputs=model.state``) so the updated running statistics leave the compiled function.

    >>> import mlx.core as mx
    >>> from fluxlike import BatchNorm, relu, trainmode
    >>> layer = BatchNorm(64, relu)
    >>> layer
    BatchNorm(64, relu)  # 128 parameters, plus 128 non-trainable
    >>> x = mx.ones((8, 4, 4, 64), dtype=mx.float16)
    >>> layer(x).shape, layer(x).dtype
    ((8, 4, 4, 64), mlx.core.float16)
    >>> _ = trainmode(layer)(x)  # an active call updates the running statistics
    >>> layer.running_mean[:3], layer.running_mean.dtype
    (array([0.1, 0.1, 0.1], dtype=float32), mlx.core.float32)
    >>> BatchNorm(4, affine=False, momentum=0.01)
    BatchNorm(4, momentum=0.01, affine=False)  # 0 parameters, plus 8 non-trainable
    """

    def __init__(
        self,
        channels: int,
        act: Callable | str = identity,
        *,
        momentum: float = 0.1,
        eps: float = 1e-5,
        affine: bool = True,
        track_stats: bool = True,
        active: bool | None = None,
    ):
        super().__init__(channels, act, momentum=momentum, eps=eps, affine=affine,
                         track_stats=track_stats, active=active)

    def __call__(self, x: mx.array) -> mx.array:
        _check_input(x, "BatchNorm", (self.channels,), 2, "(N, ..., C)")
        return self._normalise(x, tuple(range(x.ndim - 1)), "BatchNorm")

    def signature(self) -> str:
        options = _options(momentum=(self.momentum, 0.1), eps=(self.eps, 1e-5),
                           affine=(self.weight is not None, True),
                           track_stats=(self.running_mean is not None, True),
                           active=(self.active, None))
        return signature_of([str(self.channels)], "BatchNorm", self.act, **options)


@autocast_policy("fp32", keep_float32=True)
class InstanceNorm(_RunningNorm):
    """Instance normalisation: each sample and channel normalised over the spatial axes.

    ``InstanceNorm(channels, act=identity, *, affine=False, eps=1e-5, momentum=0.1,
    track_stats=False, active=None)`` takes input ``(N, spatial..., C)`` with at least one
    spatial axis. With ``affine=True`` it learns a per-channel ``weight`` and ``bias``. With
    ``track_stats=True`` it keeps running statistics (the batch average of the per-instance
    statistics, updated when active as in ``BatchNorm``) and normalises with them when
    inactive. Statistics in float32 (float64 for float64 input); output in the input dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import InstanceNorm
    >>> layer = InstanceNorm(8)
    >>> layer
    InstanceNorm(8)
    >>> layer(mx.ones((2, 5, 5, 8))).shape
    (2, 5, 5, 8)
    >>> InstanceNorm(8, "relu", affine=True)
    InstanceNorm(8, relu, affine=True)  # 16 parameters
    """

    def __init__(
        self,
        channels: int,
        act: Callable | str = identity,
        *,
        affine: bool = False,
        eps: float = 1e-5,
        momentum: float = 0.1,
        track_stats: bool = False,
        active: bool | None = None,
    ):
        super().__init__(channels, act, momentum=momentum, eps=eps, affine=affine,
                         track_stats=track_stats, active=active)

    def __call__(self, x: mx.array) -> mx.array:
        _check_input(x, "InstanceNorm", (self.channels,), 3, "(N, spatial..., C)")
        return self._normalise(x, tuple(range(1, x.ndim - 1)), "InstanceNorm")

    def signature(self) -> str:
        options = _options(affine=(self.weight is not None, False), eps=(self.eps, 1e-5),
                           momentum=(self.momentum, 0.1),
                           track_stats=(self.running_mean is not None, False),
                           active=(self.active, None))
        return signature_of([str(self.channels)], "InstanceNorm", self.act, **options)


@autocast_policy("fp32", keep_float32=True)
class GroupNorm(_Norm):
    """Group normalisation: the channels split into ``groups`` runs of consecutive channels,
    each sample normalised over its spatial axes and the channels of each group.

    ``GroupNorm(channels, groups, act=identity, *, affine=True, eps=1e-5)``; ``channels`` must
    be divisible by ``groups``. Input ``(N, ..., C)``. Grouping matches Flux and PyTorch
    (group ``g`` holds channels ``g*C/G`` to ``(g+1)*C/G - 1``). Statistics in float32 (float64
    for float64 input); output in the input dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import GroupNorm
    >>> layer = GroupNorm(32, 4)
    >>> layer
    GroupNorm(32, 4)  # 64 parameters
    >>> layer(mx.ones((2, 3, 3, 32), dtype=mx.bfloat16)).dtype
    mlx.core.bfloat16
    """

    def __init__(
        self,
        channels: int,
        groups: int,
        act: Callable | str = identity,
        *,
        affine: bool = True,
        eps: float = 1e-5,
    ):
        super().__init__()
        channels = check_size(channels, "GroupNorm", "channels")
        groups = check_size(groups, "GroupNorm", "groups")
        affine = check_flag(affine, "GroupNorm", "affine")
        if channels % groups:
            swapped = "; fluxlike's order is GroupNorm(channels, groups) (mlx.nn's is " \
                "(groups, dims))" if groups > channels else ""
            raise ValueError(f"[GroupNorm] channels ({channels}) must be divisible by groups "
                             f"({groups}){swapped}")
        self.channels, self.groups = channels, groups
        self.act = resolve(act, "GroupNorm")
        self.eps = _check_eps(eps, "GroupNorm")
        self._init_affine((channels,), affine)

    def __call__(self, x: mx.array) -> mx.array:
        _check_input(x, "GroupNorm", (self.channels,), 2, "(N, ..., C)")
        dtype = _compute_dtype(x, self.get("weight"))
        y = _as(x, dtype).reshape(x.shape[0], -1, self.groups, self.channels // self.groups)
        _count(y, (1, 3), "GroupNorm")
        mean = mx.mean(y, axis=(1, 3), keepdims=True)
        var = mx.var(y, axis=(1, 3), keepdims=True)
        y = ((y - mean) * mx.rsqrt(var + self.eps)).reshape(x.shape)
        return self._finish(y, dtype, x.dtype)

    def signature(self) -> str:
        options = _options(affine=(self.weight is not None, True), eps=(self.eps, 1e-5))
        return signature_of([str(self.channels), str(self.groups)], "GroupNorm", self.act,
                            **options)


class _LastAxesNorm(_Norm):
    """LayerNorm and RMSNorm: normalise over the last ``len(dims)`` axes, which are flattened
    into one so that the fused ``mx.fast`` kernels (last axis only) apply. Subclasses give
    ``_fast(y, weight, bias)`` (the kernel, affine included) and ``_exact(y)`` (plain ops,
    no affine) for float64, which the kernels do not compute exactly."""

    def _setup(self, dims: Dims, affine: bool, eps: float, bias: bool) -> None:
        name = type(self).__name__
        dims, eps = _check_dims(dims, name), _check_eps(eps, name)
        affine = check_flag(affine, name, "affine")
        self.dims, self.eps = dims, eps
        self._init_affine(dims, affine, bias)

    def __call__(self, x: mx.array) -> mx.array:
        dims = self["dims"]
        _check_input(x, type(self).__name__, dims, len(dims), f"ending in {dims}")
        weight, bias = self.get("weight"), self.get("bias")
        dtype = _compute_dtype(x, weight)
        y = _as(x, dtype)
        if len(dims) > 1:  # flatten the normalised axes into one
            y = y.reshape(*x.shape[: x.ndim - len(dims)], -1)
            weight, bias = (None if p is None else p.reshape(-1) for p in (weight, bias))
        if dtype in workarounds.FAST_KERNELS_INEXACT:  # float64: the kernels compute in float32
            return self._finish(self._exact(y).reshape(x.shape), dtype, x.dtype)
        y = self._fast(y, _as(weight, dtype), _as(bias, dtype))
        return _as(y.reshape(x.shape), x.dtype)

    def signature(self) -> str:
        dims = str(self.dims[0]) if len(self.dims) == 1 else str(self.dims)
        options = _options(affine=(self.weight is not None, True), eps=(self.eps, 1e-5))
        return signature_of([dims], type(self).__name__, **options)


@autocast_policy("fp32")
class LayerNorm(_LastAxesNorm):
    """Layer normalisation over the last ``len(dims)`` axes, with ``mx.fast.layer_norm``.

    ``LayerNorm(dims, *, affine=True, eps=1e-5)``: ``dims`` is an int (the last axis) or a
    tuple (the trailing shape, e.g. ``(H, W, C)``); ``weight`` and ``bias`` have shape ``dims``
    (``None`` when ``affine=False``). Statistics in float32 (float64 for float64 input);
    output in the input dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import LayerNorm
    >>> LayerNorm(32)
    LayerNorm(32)  # 64 parameters
    >>> LayerNorm((4, 8), affine=False)(mx.ones((2, 4, 8), dtype=mx.float16)).dtype
    mlx.core.float16
    """

    def __init__(self, dims: Dims, *, affine: bool = True, eps: float = 1e-5):
        super().__init__()
        self._setup(dims, affine, eps, bias=True)

    def _fast(self, y: mx.array, w: mx.array | None, b: mx.array | None) -> mx.array:
        return mx.fast.layer_norm(y, w, b, self.eps)

    def _exact(self, y: mx.array) -> mx.array:
        mean = mx.mean(y, axis=-1, keepdims=True)
        return (y - mean) * mx.rsqrt(mx.var(y, axis=-1, keepdims=True) + self.eps)


@autocast_policy("fp32")
class RMSNorm(_LastAxesNorm):
    """Root-mean-square normalisation over the last ``len(dims)`` axes, with
    ``mx.fast.rms_norm``: ``weight * x / sqrt(mean(x²) + eps)``.

    ``RMSNorm(dims, *, affine=True, eps=1e-5)``: ``dims`` as in :class:`LayerNorm`; ``weight``
    has shape ``dims`` (``None`` when ``affine=False``); there is no bias. Computed in float32
    (float64 for float64 input); output in the input dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import RMSNorm
    >>> RMSNorm(16, eps=1e-6)
    RMSNorm(16, eps=1e-06)  # 16 parameters
    >>> y = RMSNorm(16)(mx.full((1, 16), 3.0))
    >>> y.shape, mx.allclose(y, mx.array(1.0)).item()
    ((1, 16), True)
    """

    def __init__(self, dims: Dims, *, affine: bool = True, eps: float = 1e-5):
        super().__init__()
        self._setup(dims, affine, eps, bias=False)

    def _fast(self, y: mx.array, w: mx.array | None, b: None) -> mx.array:
        return mx.fast.rms_norm(y, w, self.eps)

    def _exact(self, y: mx.array) -> mx.array:
        return y * mx.rsqrt(mx.mean(mx.square(y), axis=-1, keepdims=True) + self.eps)


class Dropout(Layer):
    """Inverted dropout: when active, zero each entry with probability ``p`` and scale the
    rest by ``1 / (1 - p)``; when inactive, the identity.

    ``Dropout(p, *, dims=None, active=None)``: ``p`` in ``[0, 1]`` (``p=1`` zeroes everything,
    as in Flux and PyTorch, and passes zero gradients back). ``dims`` (an axis or a
    tuple of axes, negative allowed) restricts which axes get independent draws: the mask is
    shared (broadcast) along every other axis, e.g. ``dims=(0, -1)`` on ``NHWC`` input drops
    whole channels of each sample. Active only inside gradient computations, or when fixed
    by ``trainmode`` or ``model.train()``. Runs in the input dtype (no precision policy).

    >>> import mlx.core as mx
    >>> from fluxlike import Dropout, trainmode
    >>> layer = Dropout(0.5)
    >>> layer
    Dropout(0.5)
    >>> layer(mx.ones((2, 3)))  # inactive outside training
    array([[1, 1, 1],
           [1, 1, 1]], dtype=float32)
    >>> y = trainmode(layer)(mx.ones((1000,), dtype=mx.float16))
    >>> y.dtype, sorted(set(y.tolist()))
    (mlx.core.float16, [0.0, 2.0])
    >>> Dropout(0.2, dims=-1)
    Dropout(0.2, dims=-1)
    """

    def __init__(self, p: float, *, dims: int | tuple[int, ...] | None = None,
                 active: bool | None = None):
        super().__init__()
        self.p = check_real(p, "Dropout", "p", lambda v: 0 <= v <= 1, "a probability in [0, 1]")
        axes = (dims,) if is_int(dims) else dims
        if dims is not None and not (isinstance(axes, tuple) and all(map(is_int, axes))):
            raise ValueError(f"[Dropout] dims must be None, an axis or a tuple of axes, "
                             f"got {dims!r}")
        # Plain ints: a numpy integer would show in the repr.
        self.dims = int(dims) if is_int(dims) else None if dims is None else tuple(map(int, dims))
        self.active = check_active(active, "Dropout")

    def _mask_shape(self, x: mx.array) -> tuple[int, ...]:
        if self.dims is None:
            return tuple(x.shape)
        axes = (self.dims,) if isinstance(self.dims, int) else self.dims
        if any(not -x.ndim <= a < x.ndim for a in axes):
            raise ValueError(f"[Dropout] dims={self.dims!r} out of range for input of shape "
                             f"{tuple(x.shape)}")
        kept = {a % x.ndim for a in axes}
        return tuple(s if i in kept else 1 for i, s in enumerate(x.shape))

    def __call__(self, x: mx.array) -> mx.array:
        _check_input(x, "Dropout", (), 0, "")
        shape = self._mask_shape(x)
        if self.p == 0 or not is_active(self):
            return x
        if self.p == 1:  # everything dropped: no 1 / (1 - p); zero gradients
            return mx.zeros_like(x)
        keep = mx.random.bernoulli(1 - self.p, shape)
        return mx.where(keep, x * (1 / (1 - self.p)), mx.zeros((), dtype=x.dtype))

    def signature(self) -> str:
        options = _options(dims=(self.dims, None), active=(self.active, None))
        return signature_of([f"{self.p:g}"], "Dropout", **options)


# selu(-inf) = -λα: where AlphaDropout puts a dropped value (Klambauer et al., 2017)
_ALPHA_PRIME = -1.0507009873554804934193349852946 * 1.6732632423543772848170429916717


class AlphaDropout(Layer):
    """Alpha dropout (Klambauer et al., 2017), Flux's ``AlphaDropout``: dropout for
    self-normalising networks (:func:`~fluxlike.selu` activations), which keeps the mean and
    variance of its input instead of zeroing.

    When active each entry is replaced with probability ``p`` by ``α' = -λα ≈ -1.7581``
    (SELU's limit at ``-∞``), and the result is mapped by ``a * y + b`` with
    ``a = 1 / sqrt((1 - p) (1 + p α'²))`` and ``b = -a α' p``, so an input of mean 0 and
    variance 1 keeps them. ``p=1`` gives zeros (the limit). ``AlphaDropout(p, *, active=None)``:
    the train/test mode as :class:`Dropout`'s (active inside gradient computations or when
    fixed by ``trainmode``/``model.train()``); when inactive, the identity. Runs in the
    input's dtype (policy "none").

    >>> import mlx.core as mx
    >>> from fluxlike import AlphaDropout, trainmode
    >>> layer = AlphaDropout(0.2)
    >>> layer
    AlphaDropout(0.2)
    >>> layer(mx.ones((2,)))  # inactive outside training
    array([1, 1], dtype=float32)
    >>> y = trainmode(layer)(mx.random.normal((100_000,)))
    >>> round(y.mean().item(), 1), round(y.var().item(), 1)
    (0.0, 1.0)
    """

    def __init__(self, p: float, *, active: bool | None = None):
        super().__init__()
        self.p = check_real(p, "AlphaDropout", "p", lambda v: 0 <= v <= 1,
                            "a probability in [0, 1]")
        self.active = check_active(active, "AlphaDropout")

    def __call__(self, x: mx.array) -> mx.array:
        _check_input(x, "AlphaDropout", (), 0, "")
        p = self.p
        if p == 0 or not is_active(self):
            return x
        if p == 1:
            return mx.zeros_like(x)
        a = 1 / math.sqrt((1 - p) * (1 + p * _ALPHA_PRIME**2))
        b = -a * _ALPHA_PRIME * p
        keep = mx.random.bernoulli(1 - p, x.shape)
        dropped = mx.array(_ALPHA_PRIME, dtype=x.dtype)
        return mx.where(keep, x, dropped) * a + b  # Python floats: kept in x's dtype

    def signature(self) -> str:
        options = _options(active=(self.active, None))
        return signature_of([f"{self.p:g}"], "AlphaDropout", **options)
