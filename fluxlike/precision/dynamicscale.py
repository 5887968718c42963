"""The dynamic loss scale: float16 training's default, as jmp's and PyTorch's ``GradScaler``
(grow the scale while gradients stay finite, shrink it and skip the step when they overflow;
every decision on the device)."""

from __future__ import annotations

import math
import numbers
from typing import Any, cast

import mlx.core as mx
import numpy as np

from .lossscale import LossScale, _check_positive, _shown

_INT32_MAX = 2**31 - 1  # the counter is int32


def _check_interval(value: Any, where: str) -> int:
    if (
        isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral)
        or not 1 <= int(value) <= _INT32_MAX
    ):
        raise ValueError(
            f"[{where}] growth_interval must be a positive integer (at most 2**31 - 1), "
            f"got {value!r}"
        )
    return int(value)


def _check_growth(value: Any, where: str) -> float:
    factor = _check_positive(value, "growth_factor", where)
    if not np.float32(factor) > 1:  # compared as stored: float32, like the scale it multiplies
        raise ValueError(
            f"[{where}] growth_factor must be greater than 1 (and finite in float32), "
            f"got {value!r}"
        )
    return factor


def _check_backoff(value: Any, where: str) -> float:
    factor = _check_positive(value, "backoff_factor", where)
    if not 0 < np.float32(factor) < 1:
        raise ValueError(
            f"[{where}] backoff_factor must be a number in (0, 1) (in float32), got {value!r}"
        )
    return factor


class DynamicLossScale(LossScale):
    """A loss scale that adapts to the gradients, as in jmp and PyTorch's ``GradScaler``.

    ``DynamicLossScale(init_scale=2.0**15, *, growth_factor=2.0, backoff_factor=0.5,
    growth_interval=2000, min_scale=1.0)``; numpy numbers are accepted too. After each step,
    :meth:`adjust` receives whether the (unscaled) gradients were all finite:

    - finite: the counter of consecutive finite steps grows by one; when it reaches
      ``growth_interval`` the scale is multiplied by ``growth_factor`` (unless that would
      overflow float32) and the counter restarts at 0;
    - not finite: the scale is multiplied by ``backoff_factor``, but not below ``min_scale``,
      and the counter restarts at 0. (:func:`~fluxlike.update` also skips such a step.)

    The arguments are GradScaler's, with fluxlike's defaults (which suit float16's range):

    ====================  ====================  =========================
    argument              fluxlike default      ``torch.amp.GradScaler``
    ====================  ====================  =========================
    ``init_scale``        ``2.0**15``           ``2.0**16``
    ``growth_factor``     ``2.0``               ``2.0``
    ``backoff_factor``    ``0.5``               ``0.5``
    ``growth_interval``   ``2000``              ``2000``
    ``min_scale``         ``1.0``               (none: no floor)
    ====================  ====================  =========================

    Every argument is checked (a ``ValueError`` naming it and the value given).

    The scale (float32) and the counter (int32) are ``mx.array`` scalars in :attr:`state`,
    and so are ``growth_interval`` (int32), ``growth_factor``, ``backoff_factor`` and
    ``min_scale`` (float32), so that a checkpoint restores them (one written without them
    leaves them as they are). Loaded values are checked like the arguments: a scale that
    is nan, inf, not positive or below ``min_scale``, or a counter outside
    ``[0, growth_interval)``, is a ``ValueError`` naming the entry, and nothing changes.
    :meth:`adjust` only builds graph operations, so it never synchronises with the device.
    The hyperparameters may be reassigned (checked likewise); they are read back from
    :attr:`state` (the factors and ``min_scale`` as float32 values).

    One scale belongs to one :class:`~fluxlike.OptState`: ``setup`` and ``train`` refuse a
    scale another live optimiser state already holds, since each ``update`` adjusts its
    scale (two models sharing one would adjust it twice per iteration, and unscale the
    second model's gradients with a scale that did not produce them). Give each its own
    scale, or train the models as one (a container module holding both, one ``setup``),
    which is what PyTorch's one ``GradScaler`` for several optimisers amounts to.

    The repr is the call that makes a scale in this one's state: its current scale shows as
    ``init_scale`` (16384.0 below, after a skipped step, where it was made with 32768.0).

    >>> import mlx.core as mx
    >>> from fluxlike import DynamicLossScale
    >>> ls = DynamicLossScale(growth_interval=2, backoff_factor=0.25)
    >>> ls
    DynamicLossScale(init_scale=32768.0, growth_factor=2.0, backoff_factor=0.25,
                     growth_interval=2, min_scale=1.0)
    >>> ls.adjust(mx.array(False)); ls.loss_scale
    array(8192, dtype=float32)
    >>> ls.adjust(mx.array(True)); ls.adjust(mx.array(True)); ls.loss_scale
    array(16384, dtype=float32)
    >>> ls
    DynamicLossScale(init_scale=16384.0, growth_factor=2.0, backoff_factor=0.25,
                     growth_interval=2, min_scale=1.0)
    >>> sorted(ls.state)
    ['backoff_factor', 'counter', 'growth_factor', 'growth_interval', 'loss_scale', 'min_scale']
    >>> DynamicLossScale(backoff_factor=2.0)
    Traceback (most recent call last):
    ValueError: [DynamicLossScale] backoff_factor must be a number in (0, 1) (in float32), got 2.0
    """

    _optional = ("growth_interval", "growth_factor", "backoff_factor", "min_scale")

    def __init__(
        self,
        init_scale: float = 2.0**15,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ):
        where = "DynamicLossScale"
        init_scale = _check_positive(init_scale, "init_scale", where)
        growth_interval = _check_interval(growth_interval, where)
        growth_factor = _check_growth(growth_factor, where)
        backoff_factor = _check_backoff(backoff_factor, where)
        min_scale = _check_positive(min_scale, "min_scale", where)
        if init_scale < min_scale:
            raise ValueError(
                f"[{where}] init_scale must be at least min_scale={min_scale}, got {init_scale!r}"
            )
        self._state = {
            "loss_scale": mx.array(init_scale), "counter": mx.array(0, dtype=mx.int32),
            "growth_interval": mx.array(growth_interval, dtype=mx.int32),
            "growth_factor": mx.array(growth_factor),
            "backoff_factor": mx.array(backoff_factor), "min_scale": mx.array(min_scale),
        }

    @property
    def growth_interval(self) -> int:
        """Finite steps after which the scale grows (``state["growth_interval"]``)."""
        return cast(int, self._state["growth_interval"].item())

    @growth_interval.setter
    def growth_interval(self, value: int) -> None:
        self._state["growth_interval"] = mx.array(
            _check_interval(value, "DynamicLossScale"), mx.int32)

    @property
    def growth_factor(self) -> float:
        """What the scale is multiplied by after ``growth_interval`` finite steps."""
        return cast(float, self._state["growth_factor"].item())

    @growth_factor.setter
    def growth_factor(self, value: float) -> None:
        self._state["growth_factor"] = mx.array(_check_growth(value, "DynamicLossScale"))

    @property
    def backoff_factor(self) -> float:
        """What the scale is multiplied by after a step that overflowed."""
        return cast(float, self._state["backoff_factor"].item())

    @backoff_factor.setter
    def backoff_factor(self, value: float) -> None:
        self._state["backoff_factor"] = mx.array(_check_backoff(value, "DynamicLossScale"))

    @property
    def min_scale(self) -> float:
        """The scale is never lowered below this (``state["min_scale"]``)."""
        return cast(float, self._state["min_scale"].item())

    @min_scale.setter
    def min_scale(self, value: float) -> None:
        self._state["min_scale"] = mx.array(
            _check_positive(value, "min_scale", "DynamicLossScale"))

    def _check_loaded(self, new: dict[str, mx.array]) -> None:
        where = "DynamicLossScale"
        merged = {**self._state, **new}
        try:
            values = {k: self._value(v, k, integer=k in ("counter", "growth_interval"))
                      for k, v in new.items()}
            if "growth_interval" in values:
                _check_interval(values["growth_interval"], where)
            if "growth_factor" in values:
                _check_growth(values["growth_factor"], where)
            if "backoff_factor" in values:
                _check_backoff(values["backoff_factor"], where)
            if "min_scale" in values:
                _check_positive(values["min_scale"], "min_scale", where)
            scale, floor = cast("tuple[float, float]",
                                (merged["loss_scale"].item(), merged["min_scale"].item()))
            if not (math.isfinite(scale) and scale >= floor > 0):
                raise ValueError(f"[{where}] state entry 'loss_scale' must be finite and at "
                                 f"least min_scale={_shown(floor)}, got {scale}")
            counter, interval = cast("tuple[int, int]",
                                     (merged["counter"].item(), merged["growth_interval"].item()))
            if not 0 <= counter < interval:
                raise ValueError(f"[{where}] state entry 'counter' must be in "
                                 f"[0, growth_interval={interval}), got {counter}")
        except ValueError as e:
            raise ValueError(f"{e} (in the state loaded)") from None

    def adjust(self, grads_finite: mx.array) -> None:
        finite = mx.array(grads_finite, dtype=mx.bool_)
        scale, counter = self.loss_scale, self.counter
        state = self._state  # the hyperparameters too are arrays: no host sync, no retrace
        due = counter + 1 >= state["growth_interval"]
        grown = scale * state["growth_factor"]
        grown = mx.where(mx.isfinite(grown), grown, scale)  # never grow into inf
        shrunk = mx.maximum(scale * state["backoff_factor"], state["min_scale"])
        self._state["loss_scale"] = mx.where(finite, mx.where(due, grown, scale), shrunk)
        self._state["counter"] = mx.where(
            mx.logical_and(finite, mx.logical_not(due)), counter + 1, mx.array(0, mx.int32)
        )

    @property
    def counter(self) -> mx.array:
        """Consecutive finite steps since the scale last changed, an int32 scalar."""
        return self._state["counter"]

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(init_scale={self.loss_scale.item()}, "
            f"growth_factor={_shown(self.growth_factor)}, "
            f"backoff_factor={_shown(self.backoff_factor)}, "
            f"growth_interval={self.growth_interval}, min_scale={_shown(self.min_scale)})"
        )
