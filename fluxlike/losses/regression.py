"""Regression losses: ``mse``, ``mae``, ``msle``, ``huber_loss``, ``poisson_loss``."""

from __future__ import annotations

import numbers

import mlx.core as mx

from ._common import (
    Agg,
    _eps,
    _prepare,
    _xlogy,
)


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
