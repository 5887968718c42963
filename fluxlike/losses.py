"""Loss functions with Flux's names and semantics, in MLX's layout (class axis last).

Every loss is ``loss(ŷ, y, *, agg="mean", ...)``: ``ŷ`` (``yhat``) is the prediction and
``y`` the target, of the same shape (a shape mismatch is a ``ValueError``; for the elementwise
losses a Python number ``y`` is a constant target). ``agg`` reduces the elementwise loss (or,
for the class-axis losses, the per-sample loss): ``"mean"`` (default), ``"sum"``, ``"none"``
(return the array), or a function applied to that array.

The class-axis losses (``crossentropy``, ``logitcrossentropy``, ``kldivergence``,
``focal_loss``) sum over ``axis`` (default ``-1``) first, so ``agg="mean"`` is the mean over
samples of the per-sample sum over classes, as in Flux; ``agg="none"`` returns the
per-sample losses with the class axis removed. Their target ``y`` is either one-hot /
probabilities of ``ŷ``'s shape, or integer class indices (0-based) of ``ŷ``'s shape without
the class axis; a Python ``int`` is a class index, as ``mx.array(3)`` is, and a Python
``float`` is a ``TypeError`` (a constant probability target must be an array). Class indices
are range-checked (a ``ValueError``; this reads two numbers back to the host, one
synchronisation per call); inside ``mx.compile`` nothing can be read back and an
out-of-range index makes its sample's loss NaN instead.

The overlap losses (``dice_coeff_loss``, ``tversky_loss``) default to ``agg=None``, as in Flux:
one loss from sums over all entries; with an ``agg`` they compute one loss per sample (sums
over the axes after the batch axis) and reduce those.

Precision (policy "fp32", no scope read needed): half-precision inputs are cast up and the
loss is computed, accumulated and returned in float32, inside or outside
:func:`~fluxlike.autocast`. float32 and float64 inputs keep their dtype (float64 if either
input is float64). ``eps`` defaults to the machine epsilon of that compute dtype.

>>> import mlx.core as mx
>>> from fluxlike.losses import mse, logitcrossentropy
>>> mse(mx.array([1.0, 2.0]), mx.array([1.0, 4.0])).item()
2.0
>>> logitcrossentropy(mx.zeros((3, 4), dtype=mx.float16), mx.array([0, 1, 3])).dtype
mlx.core.float32
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn.losses as mlx_losses

from . import _ctc
from .activations import max_shifted, stable_logsoftmax
from .checks import index_range

AGGREGATIONS = ("mean", "sum", "none")

Agg = str | Callable[[mx.array], Any]


def _aggregate(agg: Agg, name: str) -> Callable[[mx.array], Any]:
    """The reduction named or given by ``agg``."""
    if isinstance(agg, str) and agg in AGGREGATIONS:
        return {"mean": mx.mean, "sum": mx.sum, "none": lambda a: a}[agg]
    if callable(agg) and not isinstance(agg, str):
        return agg
    raise ValueError(
        f"[{name}] agg must be one of {AGGREGATIONS} or a function of the loss array, "
        f"got {agg!r}"
    )


def _compute_dtype(*xs: Any) -> mx.Dtype:
    """float64 if any input is float64, else float32 (half precision is cast up)."""
    wide = any(isinstance(x, mx.array) and x.dtype == mx.float64 for x in xs)
    return mx.float64 if wide else mx.float32


def _check_prediction(yhat: Any, name: str) -> None:
    if not isinstance(yhat, mx.array):
        raise TypeError(
            f"[{name}] expected the prediction ŷ as an mx.array, got {type(yhat).__name__}"
        )
    _check_real(yhat, name, "prediction ŷ")


def _check_real(x: mx.array, name: str, what: str) -> None:
    """Refuse complex arrays: the losses compute in a real dtype, and a cast to it would
    drop the imaginary part without a word."""
    if mx.issubdtype(x.dtype, mx.complexfloating):
        raise TypeError(
            f"[{name}] expected a real {what}, got {x.dtype}; losses are defined on real "
            f"values: pass mx.abs(z), or z.real and z.imag as separate terms"
        )


def _check_target(y: Any, name: str) -> None:
    if isinstance(y, mx.array):
        _check_real(y, name, "target y")
        return
    if not isinstance(y, numbers.Real):
        raise TypeError(
            f"[{name}] expected the target y as an mx.array or a number, got {type(y).__name__}"
        )


def _as_array(y: mx.array | float, dtype: mx.Dtype) -> mx.array:
    return (y if isinstance(y, mx.array) else mx.array(y)).astype(dtype)


def _prepare(yhat: Any, y: Any, name: str, agg: Agg) -> tuple[mx.array, mx.array, Callable]:
    """Validate, and cast both to the compute dtype: the elementwise losses' preamble."""
    reduce = _aggregate(agg, name)
    _check_prediction(yhat, name)
    _check_target(y, name)
    if isinstance(y, mx.array) and y.shape != yhat.shape:
        raise ValueError(
            f"[{name}] prediction shape {tuple(yhat.shape)} does not match target shape "
            f"{tuple(y.shape)}"
        )
    dtype = _compute_dtype(yhat, y)
    return yhat.astype(dtype), _as_array(y, dtype), reduce


def _prepare_classes(
    yhat: Any, y: Any, name: str, agg: Agg, axis: int
) -> tuple[mx.array, mx.array, bool, int, Callable]:
    """Like :func:`_prepare` for class-axis losses; also accepts integer class indices.

    Returns ``(ŷ, y, y_is_indices, axis, reduce)`` with ``axis`` made non-negative.
    """
    reduce = _aggregate(agg, name)
    _check_prediction(yhat, name)
    _check_target(y, name)
    if yhat.ndim == 0 or not -yhat.ndim <= axis < yhat.ndim:
        raise ValueError(
            f"[{name}] axis {axis} is out of range for a prediction of shape {tuple(yhat.shape)}"
        )
    axis %= yhat.ndim
    per_sample = yhat.shape[:axis] + yhat.shape[axis + 1 :]
    y = _class_target(y, name, yhat.shape, per_sample, yhat.shape[axis])
    dtype = _compute_dtype(yhat, y)
    if y.shape == yhat.shape:
        return yhat.astype(dtype), y.astype(dtype), False, axis, reduce
    if y.shape == per_sample and mx.issubdtype(y.dtype, mx.integer):
        bounds, classes = index_range(y), yhat.shape[axis]
        if bounds is not None and (bounds[0] < 0 or bounds[1] >= classes):
            raise ValueError(
                f"[{name}] class indices must lie in [0, {classes}) (0-based), "
                f"got values from {bounds[0]} to {bounds[1]}"
            )
        return yhat.astype(dtype), y, True, axis, reduce
    if y.shape == per_sample:
        hint = f"class indices of shape {tuple(per_sample)} must be integers, got {y.dtype}"
    else:
        hint = f"integer class indices must have shape {tuple(per_sample)}"
    raise ValueError(
        f"[{name}] prediction shape {tuple(yhat.shape)} does not match target shape "
        f"{tuple(y.shape)}; {hint}"
    )


def _class_target(
    y: mx.array | float, name: str, shape: tuple, per_sample: tuple, classes: int
) -> mx.array:
    """A class-axis loss's target as an array: a Python ``int`` is a class index (as
    ``mx.array(y)``); a Python ``float`` or ``bool`` is refused rather than broadcast as a
    constant probability, which would silently give a different loss."""
    if isinstance(y, mx.array):
        return y
    if isinstance(y, numbers.Integral) and not isinstance(y, bool):
        if not -(2**63) <= y < 2**63:  # mx.array cannot hold it; no class index either
            raise ValueError(
                f"[{name}] class indices must lie in [0, {classes}) (0-based), "
                f"got values from {y} to {y}"
            )
        return mx.array(int(y))
    raise TypeError(
        f"[{name}] expected class indices (an int array of shape {tuple(per_sample)}, or a "
        f"Python int) or probabilities/one-hot of shape {tuple(shape)}, got "
        f"{type(y).__name__} {y!r}; for a constant probability pass an array, "
        f"e.g. mx.full({tuple(shape)}, {y!r})"
    )


def _pick(yhat: mx.array, indices: mx.array, axis: int) -> mx.array:
    """``ŷ`` at the target class of each sample, the class axis removed; NaN for an index
    out of range (reachable only inside ``mx.compile``, where the eager check cannot run)."""
    valid = (indices >= 0) & (indices < yhat.shape[axis])
    safe = mx.expand_dims(mx.where(valid, indices, 0), axis)
    picked = mx.take_along_axis(yhat, safe, axis=axis).squeeze(axis)
    return mx.where(valid, picked, mx.array(float("nan"), picked.dtype))


def _xlogy(x: mx.array, y: mx.array) -> mx.array:
    """``x * log(y)``, and 0 where ``x == 0`` (Flux's ``xlogy``)."""
    # log of a safe y where x == 0: the discarded branch's gradient (x / y, log y) would be
    # 0 / 0 or 0 * inf = NaN at y == 0, and `where` passes NaN on
    return mx.where(x == 0, 0, x * mx.log(mx.where(x == 0, 1, y)))


def _xlogx(x: mx.array) -> mx.array:
    """``x * log(x)``, and 0 at ``x == 0``."""
    return mx.where(x == 0, 0, x * mx.log(mx.where(x == 0, 1, x)))


def _focal_weight(p: mx.array, gamma: float) -> mx.array | float:
    """``max(1 - p, 0)**gamma``, with a finite gradient for every ``p`` and ``gamma >= 0``.

    ``p = ŷ + eps`` may pass 1 by eps; there the weight is the constant 0 (1 for ``gamma = 0``).
    The power only ever sees a positive base: its derivative at 0 is inf for ``gamma < 1``
    (0 * inf = NaN for ``gamma = 0``), and `where` passes a discarded branch's NaN on.
    """
    if gamma == 0:
        return 1.0  # exactly crossentropy, value and gradient
    base = 1 - p
    positive = base > 0
    return mx.where(positive, mx.power(mx.where(positive, base, 1), float(gamma)), 0)


def _eps(eps: float | None, x: mx.array) -> float:
    return mx.finfo(x.dtype).eps if eps is None else eps


def mse(yhat: mx.array, y: mx.array | float, *, agg: Agg = "mean") -> mx.array:
    """Mean squared error: ``agg((ŷ - y)**2)``.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import mse
    >>> mse(mx.array([1.1, 1.9, 3.1]), mx.array([1.0, 2.0, 3.0])).item()
    0.01
    >>> mse(mx.array([1.0, 3.0]), mx.array([1.0, 1.0]), agg="none")
    array([0, 4], dtype=float32)
    """
    yhat, y, reduce = _prepare(yhat, y, "mse", agg)
    return reduce(mx.square(yhat - y))


def mae(yhat: mx.array, y: mx.array | float, *, agg: Agg = "mean") -> mx.array:
    """Mean absolute error: ``agg(abs(ŷ - y))``.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import mae
    >>> mae(mx.array([1.0, 2.0, 6.0]), mx.array([1.0, 4.0, 3.0]), agg="sum").item()
    5.0
    """
    yhat, y, reduce = _prepare(yhat, y, "mae", agg)
    return reduce(mx.abs(yhat - y))


def msle(
    yhat: mx.array, y: mx.array | float, *, agg: Agg = "mean", eps: float | None = None
) -> mx.array:
    """Mean squared logarithmic error: ``agg(log((ŷ + eps) / (y + eps))**2)``.

    Penalises under-estimation more than over-estimation.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import msle
    >>> msle(mx.array([1.1, 2.2, 3.3]), mx.array([1.0, 2.0, 3.0])).item()
    0.009084
    """
    yhat, y, reduce = _prepare(yhat, y, "msle", agg)
    eps = _eps(eps, yhat)
    return reduce(mx.square(mx.log((yhat + eps) / (y + eps))))


def huber_loss(
    yhat: mx.array, y: mx.array | float, *, agg: Agg = "mean", delta: float = 1.0
) -> mx.array:
    """Huber loss: ``0.5 * e**2`` where ``e = |ŷ - y| < delta``, else
    ``delta * (e - 0.5 * delta)``.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import huber_loss
    >>> huber_loss(mx.array([0.5, 3.0]), mx.array([0.0, 0.0]), agg="none")
    array([0.125, 2.5], dtype=float32)
    """
    if not isinstance(delta, numbers.Real) or not delta > 0:
        raise ValueError(f"[huber_loss] delta must be a positive number, got {delta!r}")
    yhat, y, reduce = _prepare(yhat, y, "huber_loss", agg)
    error = mx.abs(yhat - y)
    return reduce(mx.where(error < delta, 0.5 * error * error, delta * (error - 0.5 * delta)))


def crossentropy(
    yhat: mx.array,
    y: mx.array,
    *,
    agg: Agg = "mean",
    eps: float | None = None,
    axis: int = -1,
) -> mx.array:
    """Cross entropy of probabilities ``ŷ`` (e.g. softmax output):
    ``agg(-sum(y * log(ŷ + eps), axis))``.

    ``y``: one-hot or probabilities of ``ŷ``'s shape, or integer class indices. Prefer
    :func:`logitcrossentropy` on logits, which is more stable.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import crossentropy
    >>> p = mx.array([[0.25, 0.75], [0.5, 0.5]])
    >>> crossentropy(p, mx.array([[0.0, 1.0], [1.0, 0.0]]), agg="none")
    array([0.287682, 0.693147], dtype=float32)
    >>> crossentropy(p, mx.array([1, 0])).item()
    0.490415
    """
    yhat, y, indices, axis, reduce = _prepare_classes(yhat, y, "crossentropy", agg, axis)
    eps = _eps(eps, yhat)
    if indices:
        return reduce(-mx.log(_pick(yhat, y, axis) + eps))
    return reduce(-mx.sum(_xlogy(y, yhat + eps), axis=axis))


def logitcrossentropy(
    yhat: mx.array, y: mx.array, *, agg: Agg = "mean", axis: int = -1
) -> mx.array:
    """Cross entropy of logits ``ŷ``: ``agg(-sum(y * logsoftmax(ŷ), axis))``, equal to
    ``crossentropy(softmax(ŷ), y)`` but stable.

    ``y``: one-hot or probabilities of ``ŷ``'s shape, or integer class indices of ``ŷ``'s
    shape without ``axis`` (then the loss is ``logsumexp(ŷ) - ŷ[y]`` per sample).

    >>> import mlx.core as mx
    >>> from fluxlike.losses import logitcrossentropy
    >>> logits = mx.array([[0.0, 0.0], [2.0, 0.0]])
    >>> logitcrossentropy(logits, mx.array([0, 1]), agg="none")
    array([0.693147, 2.12693], dtype=float32)
    >>> logitcrossentropy(logits, mx.array([[1.0, 0.0], [0.0, 1.0]])).item()
    1.410038
    """
    yhat, y, indices, axis, reduce = _prepare_classes(yhat, y, "logitcrossentropy", agg, axis)
    if indices:  # max-shifted: logsumexp(ŷ) - ŷ[y] = log(sum(exp(ŷ - m))) - (ŷ[y] - m)
        shifted, _ = max_shifted(yhat, axis)
        lse = mx.log(mx.sum(mx.exp(shifted), axis=axis))
        return reduce(lse - _pick(shifted, y, axis))
    return reduce(-mx.sum(y * stable_logsoftmax(yhat, axis), axis=axis))


def binarycrossentropy(
    yhat: mx.array, y: mx.array | float, *, agg: Agg = "mean", eps: float | None = None
) -> mx.array:
    """Binary cross entropy of probabilities ``ŷ`` (e.g. sigmoid output):
    ``agg(-y * log(ŷ + eps) - (1 - y) * log(1 - ŷ + eps))``, elementwise.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import binarycrossentropy
    >>> loss = binarycrossentropy(mx.array([0.9, 0.2]), mx.array([1.0, 0.0]), agg="none")
    >>> [round(v, 4) for v in loss.tolist()]
    [0.1054, 0.2231]
    """
    yhat, y, reduce = _prepare(yhat, y, "binarycrossentropy", agg)
    eps = _eps(eps, yhat)
    return reduce(-_xlogy(y, yhat + eps) - _xlogy(1 - y, 1 - yhat + eps))


def logitbinarycrossentropy(yhat: mx.array, y: mx.array | float, *, agg: Agg = "mean") -> mx.array:
    """Binary cross entropy of logits ``ŷ``: ``binarycrossentropy(sigmoid(ŷ), y)``, stably,
    as ``(1 - y) * ŷ - logsigmoid(ŷ)``.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import logitbinarycrossentropy
    >>> logitbinarycrossentropy(mx.array([2.0, -1.0, 3.1415927]), mx.array([1, 0, 1])).item()
    0.160832
    """
    yhat, y, reduce = _prepare(yhat, y, "logitbinarycrossentropy", agg)
    # Two non-negative terms, each exact: (1 - y) * ŷ + log(1 + exp(-ŷ)) cancels for large
    # negative ŷ (-20 + 20.000000002 is 0 in float32).
    zero = mx.zeros_like(yhat)
    return reduce(y * mx.logaddexp(zero, -yhat) + (1 - y) * mx.logaddexp(zero, yhat))


def kldivergence(
    yhat: mx.array,
    y: mx.array,
    *,
    agg: Agg = "mean",
    eps: float | None = None,
    axis: int = -1,
) -> mx.array:
    """Kullback-Leibler divergence of ``ŷ`` from the distribution ``y``:
    ``agg(sum(y * log(y) - y * log(ŷ + eps), axis))`` (entropy plus cross entropy).

    ``agg`` is applied to the per-sample divergence (Flux applies it to the entropy and the
    cross entropy separately; the two agree for ``"mean"`` and ``"sum"``). Integer class
    indices ``y`` stand for one-hot targets, whose entropy is 0.

    >>> import math, mlx.core as mx
    >>> from fluxlike.losses import kldivergence
    >>> kl = kldivergence(mx.full((2, 2), 0.5), mx.array([[1.0, 0.0], [0.0, 1.0]]))
    >>> math.isclose(kl.item(), math.log(2), rel_tol=1e-5)
    True
    """
    yhat, y, indices, axis, reduce = _prepare_classes(yhat, y, "kldivergence", agg, axis)
    eps = _eps(eps, yhat)
    if indices:
        return reduce(-mx.log(_pick(yhat, y, axis) + eps))
    return reduce(mx.sum(_xlogx(y) - _xlogy(y, yhat + eps), axis=axis))


def focal_loss(
    yhat: mx.array,
    y: mx.array,
    *,
    agg: Agg = "mean",
    gamma: float = 2,
    eps: float | None = None,
    axis: int = -1,
) -> mx.array:
    """Focal loss of probabilities ``ŷ`` (softmax output) for imbalanced classes:
    ``agg(sum(-y * (1 - p)**gamma * log(p), axis))`` with ``p = ŷ + eps``.

    ``gamma = 0`` gives :func:`crossentropy`. ``y``: one-hot/probabilities or integer class
    indices.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import focal_loss
    >>> p = mx.array([[0.25, 0.75], [0.5, 0.5]])
    >>> focal_loss(p, mx.array([1, 0]), agg="none")
    array([0.0179801, 0.173287], dtype=float32)
    """
    if not isinstance(gamma, numbers.Real) or gamma < 0:
        raise ValueError(f"[focal_loss] gamma must be a non-negative number, got {gamma!r}")
    yhat, y, indices, axis, reduce = _prepare_classes(yhat, y, "focal_loss", agg, axis)
    eps = _eps(eps, yhat)
    if indices:
        p = _pick(yhat, y, axis) + eps
        return reduce(-_focal_weight(p, gamma) * mx.log(p))
    p = yhat + eps
    return reduce(-mx.sum(_xlogy(y, p) * _focal_weight(p, gamma), axis=axis))


def hinge_loss(yhat: mx.array, y: mx.array | float, *, agg: Agg = "mean") -> mx.array:
    """Hinge loss of scores ``ŷ`` for labels ``y`` in ``{-1, 1}``:
    ``agg(max(0, 1 - ŷ * y))`` (support vector machines; ``mlx.nn.losses.hinge_loss``).

    >>> import mlx.core as mx
    >>> from fluxlike.losses import hinge_loss
    >>> hinge_loss(mx.array([0.1, 0.3, 1.0, 1.5]), mx.array([1, -1, 1, 1])).item()
    0.55
    """
    yhat, y, reduce = _prepare(yhat, y, "hinge_loss", agg)
    return reduce(mlx_losses.hinge_loss(yhat, y))


def squared_hinge_loss(yhat: mx.array, y: mx.array | float, *, agg: Agg = "mean") -> mx.array:
    """Squared hinge loss: ``agg(max(0, 1 - ŷ * y)**2)``, labels ``y`` in ``{-1, 1}``.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import squared_hinge_loss
    >>> squared_hinge_loss(mx.array([0.1, 0.3, 1.0, 1.5]), mx.array([1, -1, 1, 1])).item()
    0.625
    """
    yhat, y, reduce = _prepare(yhat, y, "squared_hinge_loss", agg)
    return reduce(mx.square(mlx_losses.hinge_loss(yhat, y)))


def poisson_loss(yhat: mx.array, y: mx.array | float, *, agg: Agg = "mean") -> mx.array:
    """Poisson loss of predicted rates ``ŷ > 0`` for counts ``y``: ``agg(ŷ - y * log(ŷ))``
    (the negative log-likelihood up to a constant; ``0 * log(0)`` is 0).

    >>> import mlx.core as mx
    >>> from fluxlike.losses import poisson_loss
    >>> poisson_loss(mx.array([1.0, 3.0, 3.0]), mx.array([1, 2, 3])).item()
    0.502313
    """
    yhat, y, reduce = _prepare(yhat, y, "poisson_loss", agg)
    return reduce(yhat - _xlogy(y, yhat))


def siamese_contrastive_loss(
    yhat: mx.array, y: mx.array | float, *, agg: Agg = "mean", margin: float = 1.0
) -> mx.array:
    """Contrastive loss of distances ``ŷ`` between pairs, ``y = 1`` for a dissimilar pair and
    ``0`` for a similar one: ``agg((1 - y) * ŷ**2 + y * max(0, margin - ŷ)**2)``.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import siamese_contrastive_loss
    >>> siamese_contrastive_loss(mx.array([0.5, 1.5, 2.5]), mx.array([1, 2, 3]), margin=2).item()
    -4.0
    """
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not margin >= 0:
        raise ValueError(
            f"[siamese_contrastive_loss] margin must be a non-negative number, got {margin!r}"
        )
    yhat, y, reduce = _prepare(yhat, y, "siamese_contrastive_loss", agg)
    return reduce((1 - y) * mx.square(yhat) + y * mx.square(mx.maximum(margin - yhat, 0)))


def binary_focal_loss(
    yhat: mx.array,
    y: mx.array | float,
    *,
    agg: Agg = "mean",
    gamma: float = 2,
    eps: float | None = None,
) -> mx.array:
    """Binary focal loss of probabilities ``ŷ`` (sigmoid output) for imbalanced labels:
    ``agg(-(1 - p)**gamma * log(p))`` elementwise, with ``p = y * (ŷ + eps) + (1 - y) *
    (1 - ŷ + eps)`` the probability given to the label.

    ``gamma = 0`` gives :func:`binarycrossentropy`. (Flux subtracts ``eps`` from ``1 - ŷ``;
    adding it, as :func:`binarycrossentropy` does, keeps ``ŷ = 1`` finite.)

    >>> import mlx.core as mx
    >>> from fluxlike.losses import binary_focal_loss
    >>> p = mx.array([[0.268941, 0.731059], [0.5, 0.5], [0.268941, 0.731059]])
    >>> binary_focal_loss(p, mx.array([[0, 1], [1, 0], [0, 1]])).item()
    0.07287
    """
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real) or not gamma >= 0:
        raise ValueError(f"[binary_focal_loss] gamma must be a non-negative number, got {gamma!r}")
    yhat, y, reduce = _prepare(yhat, y, "binary_focal_loss", agg)
    eps = _eps(eps, yhat)
    p = y * (yhat + eps) + (1 - y) * (1 - yhat + eps)
    return reduce(-_focal_weight(p, gamma) * mx.log(p))


def _overlap_loss(
    yhat: Any, y: Any, name: str, agg: Agg | None, loss: Callable[..., mx.array]
) -> mx.array:
    """The dice/Tversky pattern: ``loss(sum)`` with ``sum`` over all entries (``agg=None``, as
    Flux) or over each sample's entries (all axes but the first), then ``agg``."""
    yhat, y, reduce = _prepare(yhat, y, name, "mean" if agg is None else agg)
    if agg is None:
        return loss(mx.sum, yhat, y)
    if yhat.ndim < 2:
        raise ValueError(
            f"[{name}] agg needs a batch axis: per-sample losses are over the axes after the "
            f"first, got a prediction of shape {tuple(yhat.shape)}; for one loss over all "
            f"entries leave agg=None"
        )
    axes = tuple(range(1, yhat.ndim))
    return reduce(loss(lambda a: mx.sum(a, axis=axes), yhat, y))


def dice_coeff_loss(
    yhat: mx.array, y: mx.array, *, smooth: float = 1.0, agg: Agg | None = None
) -> mx.array:
    """Dice loss for segmentation (V-Net): ``1 - (2 * sum(y * ŷ) + smooth) / (sum(y**2) +
    sum(ŷ**2) + smooth)``, ``1 -`` a smoothed F1 score.

    ``agg=None`` (as Flux): one loss, the sums over all entries. With an ``agg``
    (``"mean"``, ``"sum"``, ``"none"``, a function) the sums run over each sample's entries
    (all axes after the batch axis) and ``agg`` reduces the per-sample losses.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import dice_coeff_loss
    >>> dice_coeff_loss(mx.array([1.1, 2.1, 3.1]), mx.array([1.0, 2.0, 3.0])).item()
    0.000992
    """
    if isinstance(smooth, bool) or not isinstance(smooth, numbers.Real) or not smooth >= 0:
        raise ValueError(f"[dice_coeff_loss] smooth must be a non-negative number, got {smooth!r}")

    def loss(total: Callable, yhat: mx.array, y: mx.array) -> mx.array:
        return 1 - (2 * total(y * yhat) + smooth) / (
            total(mx.square(y)) + total(mx.square(yhat)) + smooth)

    return _overlap_loss(yhat, y, "dice_coeff_loss", agg, loss)


def tversky_loss(
    yhat: mx.array, y: mx.array, *, beta: float = 0.7, agg: Agg | None = None
) -> mx.array:
    """Tversky loss for imbalanced segmentation: ``1 - (TP + 1) / (TP + beta * FP +
    (1 - beta) * FN + 1)`` with ``TP = sum(y * ŷ)``, ``FP = sum((1 - y) * ŷ)``,
    ``FN = sum(y * (1 - ŷ))`` (as Flux's code computes it; ``beta = 0.5`` weighs both
    errors alike, a larger ``beta`` false positives more). ``agg`` as in
    :func:`dice_coeff_loss`.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import tversky_loss
    >>> masks = mx.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    >>> tversky_loss(mx.array([[0.9, 0.2, 0.6], [0.1, 0.4, 0.8]]), masks, agg="none")
    array([0.103943, 0.18552], dtype=float32)
    """
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0 <= beta <= 1:
        raise ValueError(f"[tversky_loss] beta must be a number in [0, 1], got {beta!r}")

    def loss(total: Callable, yhat: mx.array, y: mx.array) -> mx.array:
        tp = total(y * yhat)
        return 1 - (tp + 1) / (
            tp + beta * total((1 - y) * yhat) + (1 - beta) * total(y * (1 - yhat)) + 1)

    return _overlap_loss(yhat, y, "tversky_loss", agg, loss)


def ctc_loss(
    yhat: mx.array,
    y: mx.array | list,
    *,
    input_lengths: mx.array | list | None = None,
    target_lengths: mx.array | list | None = None,
    blank: int = -1,
    agg: Agg = "mean",
) -> mx.array:
    """Connectionist temporal classification loss (Graves et al., 2006): ``-log p(y | ŷ)``,
    summed over every alignment of the label sequence ``y`` to the time steps of ``ŷ``.

    ``ŷ``: the network's raw outputs, ``(batch, time, classes)`` (or ``(time, classes)``
    for one sequence, as Flux's ``ctc_loss``); ``logsoftmax`` over the classes is applied
    here, as in Flux. ``y``: 0-based integer labels, ``(batch, max_target_length)`` (or one
    sequence), without blanks; entries past a sample's ``target_lengths`` are ignored
    (padding). ``input_lengths``/``target_lengths``: each sample's time steps and labels
    (default: all). ``blank``: the blank class (``-1``: the last, as Flux). ``agg`` reduces
    the per-sample losses (PyTorch's ``"mean"`` also divides each by its target length;
    this is Flux's plain mean). A sample whose target cannot fit its input is ``inf``.

    Computed in float32 (float64 inputs in float64) by the log-space forward recursion, one
    step per time step, differentiable by ``mx.grad``. The lengths and labels are checked
    (one host read); inside ``mx.compile`` a bad label makes its sample's loss NaN instead.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import ctc_loss
    >>> logits = mx.array([[1.0, 2.0, 3.0], [2.0, 1.0, 3.0], [3.0, 1.0, 2.0]])  # (time, classes)
    >>> ctc_loss(logits, mx.array([0, 1])).item()  # Flux's test value (its 1-based [1, 2])
    3.69907
    >>> batch = mx.stack([logits, logits])
    >>> ctc_loss(batch, mx.array([[0, 1], [1, -1]]), target_lengths=[2, 1], agg="none")
    array([3.69907, 2.2339], dtype=float32)
    """
    reduce = _aggregate(agg, "ctc_loss")
    _check_prediction(yhat, "ctc_loss")
    if yhat.ndim not in (2, 3) or not mx.issubdtype(yhat.dtype, mx.floating):
        raise ValueError(
            f"[ctc_loss] expected floating logits of shape (batch, time, classes) or (time, "
            f"classes), got a {yhat.dtype} array of shape {tuple(yhat.shape)}"
        )
    one = yhat.ndim == 2
    if one:
        yhat = yhat[None]
        y = _ctc._int_array(y, "y", "a label sequence")[None]
        if input_lengths is not None or target_lengths is not None:
            raise ValueError("[ctc_loss] lengths are per sample: give a batch (batch, time, "
                             "classes) with them, or leave them out for one sequence")
    labels, inputs, targets, blank, valid = _ctc.prepare(
        yhat.shape, y, input_lengths, target_lengths, blank)
    logp = stable_logsoftmax(yhat.astype(_compute_dtype(yhat)), axis=-1)
    losses = _ctc.negative_log_likelihood(logp, labels, inputs, targets, blank)
    losses = mx.where(valid, losses, mx.array(float("nan"), losses.dtype))
    return reduce(losses[0] if one else losses)
