"""Classification losses: the cross entropies, ``kldivergence``, the focal losses, the hinge
losses and ``siamese_contrastive_loss``."""

from __future__ import annotations

import numbers

import mlx.core as mx
import mlx.nn.losses as mlx_losses

from ..precision import kernels
from ..precision.kernels import stable_logsoftmax
from ._common import (
    Agg,
    _eps,
    _focal_weight,
    _pick,
    _prepare,
    _prepare_classes,
    _xlogx,
    _xlogy,
)


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
        lse, top = kernels.logsumexp_shifted(yhat, axis)
        return reduce(lse.squeeze(axis) - (_pick(yhat, y, axis) - top.squeeze(axis)))
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
