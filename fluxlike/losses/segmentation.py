"""Overlap losses for segmentation: ``dice_coeff_loss`` and ``tversky_loss``."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ._common import (
    Agg,
    _prepare,
)


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
