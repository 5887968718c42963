"""Loss scaling for float16 training, after jmp: one interface, no host synchronisation.

Float16 gradients underflow to zero below about ``6e-8``. Multiplying the loss by a large
scale before differentiating lifts the cotangents into float16's range; the gradients are
divided by the same scale before the optimiser sees them. :class:`DynamicLossScale` grows
the scale while gradients stay finite and shrinks it (and the step is skipped) when they
overflow. Every decision is made with ``mx.where`` on arrays, so a training step that uses
a loss scale never waits for the device and can run inside ``mx.compile``.

A loss scale keeps its arrays in a dict, :attr:`state`, that stays the same object for the
scale's lifetime: pass it in ``mx.compile``'s ``inputs``/``outputs`` to capture it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

Tree = Any


def all_finite(tree: Tree) -> mx.array:
    """Whether every floating array in ``tree`` is free of inf and nan, as a bool ``mx.array``
    (no host synchronisation; ``True`` for a tree without floating arrays).

    >>> import mlx.core as mx
    >>> from fluxlike import all_finite
    >>> all_finite({"w": mx.ones(3), "b": [mx.zeros(2)]})
    array(True, dtype=bool)
    >>> all_finite({"w": mx.array([1.0, float("inf")])})
    array(False, dtype=bool)
    """
    finite = mx.array(True)
    for _, leaf in tree_flatten(tree):
        if isinstance(leaf, mx.array) and mx.issubdtype(leaf.dtype, mx.floating):
            finite = mx.logical_and(finite, mx.all(mx.isfinite(leaf)))
    return finite


def _multiply(tree: Tree, factor: mx.array) -> Tree:
    """Floating leaves times ``factor`` (a float32 scalar), each kept in its own dtype.

    The product is formed in at least float32, so a float16 gradient is divided by the
    scale before being rounded back (never rounded first, then divided)."""

    def one(x: Any) -> Any:
        if isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.floating):
            return (x * factor).astype(x.dtype)
        return x

    return tree_map(one, tree)


def _is_number(value: Any) -> bool:
    """A real number, Python's or numpy's (``np.float32(2)``, ``np.int64(3)``), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _check_positive(value: Any, name: str, where: str) -> float:
    if not _is_number(value) or not value > 0:
        raise ValueError(f"[{where}] {name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"[{where}] {name} must be finite, got {value!r}")
    return float(value)


_INT32_MAX = 2**31 - 1  # the counter is int32


def _check_period(value: Any, where: str) -> int:
    if (
        isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral)
        or not 1 <= value <= _INT32_MAX
    ):
        raise ValueError(
            f"[{where}] period must be a positive integer (at most 2**31 - 1), got {value!r}"
        )
    return int(value)


def _check_factor(value: Any, where: str) -> float:
    factor = _check_positive(value, "factor", where)
    # compared as stored: float32, like the scale it multiplies
    if not mx.array(factor).item() > 1 or not math.isfinite(mx.array(factor).item()):
        raise ValueError(
            f"[{where}] factor must be greater than 1 (and finite in float32), got {value!r}"
        )
    return factor


class LossScale:
    """The interface shared by :class:`StaticLossScale` and :class:`DynamicLossScale`."""

    _state: dict[str, mx.array]
    _optional: tuple[str, ...] = ()  # state entries an older checkpoint may lack

    @property
    def loss_scale(self) -> mx.array:
        """The current scale, a float32 scalar ``mx.array``."""
        return self._state["loss_scale"]

    @property
    def state(self) -> dict[str, mx.array]:
        """The scale's arrays, a dict (the live object: capture it in ``mx.compile``)."""
        return self._state

    def scale(self, tree: Tree) -> Tree:
        """``tree``'s floating arrays multiplied by the scale. A half-precision loss is
        scaled in float32 (the result is float32), so the product cannot overflow."""

        def one(x: Any) -> Any:
            if isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.floating):
                return x * self.loss_scale  # promotes half to float32
            return x

        return tree_map(one, tree)

    def unscale(self, tree: Tree) -> Tree:
        """``tree``'s floating arrays divided by the scale, each kept in its dtype."""
        return _multiply(tree, mx.reciprocal(self.loss_scale))

    def adjust(self, grads_finite: mx.array) -> None:
        """Update the scale after a step whose gradients were finite or not (in place)."""

    def load_state(self, state: dict[str, mx.array]) -> None:
        """Restore :attr:`state` (e.g. from a checkpoint), in place. Raises ``ValueError``
        naming the first mismatched entry and changes nothing if ``state`` does not fit."""
        where = type(self).__name__
        if not isinstance(state, dict):
            raise ValueError(f"[{where}] state must be a dict, got {type(state).__name__}")
        for key, current in self._state.items():
            if key not in state:
                if key in self._optional:
                    continue
                raise ValueError(f"[{where}] state is missing the entry {key!r}")
            value = state[key]
            if not isinstance(value, mx.array) or value.shape != current.shape:
                shape = getattr(value, "shape", type(value).__name__)
                raise ValueError(
                    f"[{where}] state entry {key!r} must be an mx.array of shape "
                    f"{current.shape}, got {shape}"
                )
        extra = [key for key in state if key not in self._state]
        if extra:
            raise ValueError(f"[{where}] unexpected state entry {extra[0]!r}")
        new = {key: state[key].astype(current.dtype) for key, current in self._state.items()
               if key in state}
        self._check_loaded(new)
        self._state.update(new)

    def _check_loaded(self, new: dict[str, mx.array]) -> None:
        """Raise ``ValueError`` if loaded entries hold values the scale cannot have."""


class StaticLossScale(LossScale):
    """A fixed loss scale: ``scale`` multiplies the loss, gradients are divided by it.

    >>> import mlx.core as mx
    >>> from fluxlike import StaticLossScale
    >>> ls = StaticLossScale(1024)
    >>> ls
    StaticLossScale(1024.0)
    >>> ls.scale(mx.array(0.5))
    array(512, dtype=float32)
    >>> ls.unscale({"w": mx.array([2048.0], dtype=mx.float16)})["w"]
    array([2], dtype=float16)
    """

    def __init__(self, scale: float):
        self._state = {"loss_scale": mx.array(_check_positive(scale, "scale", "StaticLossScale"))}

    def __repr__(self) -> str:
        return f"StaticLossScale({self.loss_scale.item()})"


class DynamicLossScale(LossScale):
    """A loss scale that adapts to the gradients, as in jmp and PyTorch's ``GradScaler``.

    ``DynamicLossScale(scale=2.0**15, period=2000, factor=2.0, min_scale=1.0)``; numpy
    numbers are accepted too. After each step, :meth:`adjust` receives whether the
    (unscaled) gradients were all finite:

    - finite: the counter of consecutive finite steps grows by one; when it reaches
      ``period`` the scale is multiplied by ``factor`` (unless that would overflow float32)
      and the counter restarts at 0;
    - not finite: the scale is divided by ``factor``, but not below ``min_scale``, and the
      counter restarts at 0. (:func:`~fluxlike.update` also skips such a step.)

    The scale (float32) and the counter (int32) are ``mx.array`` scalars in :attr:`state`,
    and so are ``period`` (int32), ``factor`` and ``min_scale`` (float32), so that a
    checkpoint restores them (one written without them leaves them as they are);
    :meth:`adjust` only builds graph operations, so it never synchronises with the device.
    ``period``, ``factor`` and ``min_scale`` may be reassigned; they are read back from
    :attr:`state` (``factor`` and ``min_scale`` as float32 values).

    >>> import mlx.core as mx
    >>> from fluxlike import DynamicLossScale
    >>> ls = DynamicLossScale(period=2)
    >>> ls
    DynamicLossScale(scale=32768.0, period=2, factor=2.0, min_scale=1.0)
    >>> ls.adjust(mx.array(False)); ls.loss_scale
    array(16384, dtype=float32)
    >>> ls.adjust(mx.array(True)); ls.adjust(mx.array(True)); ls.loss_scale
    array(32768, dtype=float32)
    >>> sorted(ls.state)
    ['counter', 'factor', 'loss_scale', 'min_scale', 'period']
    """

    _optional = ("period", "factor", "min_scale")

    def __init__(
        self,
        scale: float = 2.0**15,
        period: int = 2000,
        factor: float = 2.0,
        min_scale: float = 1.0,
    ):
        where = "DynamicLossScale"
        scale = _check_positive(scale, "scale", where)
        period = _check_period(period, where)
        factor = _check_factor(factor, where)
        min_scale = _check_positive(min_scale, "min_scale", where)
        if scale < min_scale:
            raise ValueError(
                f"[{where}] scale must be at least min_scale={min_scale}, got {scale!r}"
            )
        self._state = {
            "loss_scale": mx.array(scale), "counter": mx.array(0, dtype=mx.int32),
            "period": mx.array(period, dtype=mx.int32), "factor": mx.array(factor),
            "min_scale": mx.array(min_scale),
        }

    @property
    def period(self) -> int:
        """Finite steps after which the scale grows (``state["period"]``)."""
        return int(self._state["period"].item())

    @period.setter
    def period(self, value: int) -> None:
        self._state["period"] = mx.array(_check_period(value, "DynamicLossScale"), mx.int32)

    @property
    def factor(self) -> float:
        """What the scale is multiplied or divided by (``state["factor"]``)."""
        return self._state["factor"].item()

    @factor.setter
    def factor(self, value: float) -> None:
        self._state["factor"] = mx.array(_check_factor(value, "DynamicLossScale"))

    @property
    def min_scale(self) -> float:
        """The scale is never lowered below this (``state["min_scale"]``)."""
        return self._state["min_scale"].item()

    @min_scale.setter
    def min_scale(self, value: float) -> None:
        self._state["min_scale"] = mx.array(
            _check_positive(value, "min_scale", "DynamicLossScale"))

    def _check_loaded(self, new: dict[str, mx.array]) -> None:
        where = "DynamicLossScale"
        try:
            if "period" in new:
                _check_period(new["period"].item(), where)
            if "factor" in new:
                _check_factor(new["factor"].item(), where)
            if "min_scale" in new:
                _check_positive(new["min_scale"].item(), "min_scale", where)
        except ValueError as e:
            raise ValueError(f"{e} (in the state loaded)") from None

    @property
    def counter(self) -> mx.array:
        """Consecutive finite steps since the scale last changed, an int32 scalar."""
        return self._state["counter"]

    def adjust(self, grads_finite: mx.array) -> None:
        finite = mx.array(grads_finite, dtype=mx.bool_)
        scale, counter = self.loss_scale, self.counter
        state = self._state  # the hyperparameters too are arrays: no host sync, no retrace
        due = counter + 1 >= state["period"]
        grown = scale * state["factor"]
        grown = mx.where(mx.isfinite(grown), grown, scale)  # never grow into inf
        shrunk = mx.maximum(scale / state["factor"], state["min_scale"])
        self._state["loss_scale"] = mx.where(finite, mx.where(due, grown, scale), shrunk)
        self._state["counter"] = mx.where(
            mx.logical_and(finite, mx.logical_not(due)), counter + 1, mx.array(0, mx.int32)
        )

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(scale={self.loss_scale.item()}, period={self.period}, "
            f"factor={self.factor}, min_scale={self.min_scale})"
        )


def resolve(loss_scale: Any, where: str) -> LossScale | None:
    """A loss-scale argument as an object: ``None`` stays ``None``, a number is static, a
    loss-scale object is itself. (``"auto"`` is decided by the caller.)"""
    if loss_scale is None or isinstance(loss_scale, LossScale):
        return loss_scale
    if _is_number(loss_scale):
        return StaticLossScale(loss_scale)
    raise ValueError(
        f"{where}: loss_scale must be None, 'auto', a positive number (a static scale) or a "
        f"DynamicLossScale/StaticLossScale, got {loss_scale!r}"
    )
