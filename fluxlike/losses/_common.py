"""What the losses share: the aggregation, dtype rules and argument checks."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..checks import index_range

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
