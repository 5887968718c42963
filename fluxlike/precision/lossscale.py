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
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from .._mlxtyping import tree_flatten

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


def sum_finite(tree: Tree) -> mx.array:
    """:func:`all_finite` for a training step: whether the float32 sum of every floating array
    in ``tree`` is finite. An inf or nan anywhere makes the sum inf or nan; so does a sum past
    float32's range (about ``3.4e38``), which no trainable gradient reaches. One reduction per
    array instead of two kernels (``isfinite``, ``all``), which on a small model is a
    sizeable part of a step.

    >>> import mlx.core as mx
    >>> sum_finite({"w": mx.ones(3), "b": [mx.zeros(2, dtype=mx.float16)]})
    array(True, dtype=bool)
    >>> sum_finite({"w": mx.array([1.0, float("inf")]), "v": mx.array([-float("inf")])})
    array(False, dtype=bool)
    """
    total = mx.array(0.0)
    for _, leaf in tree_flatten(tree):
        if isinstance(leaf, mx.array) and mx.issubdtype(leaf.dtype, mx.floating):
            total = total + (leaf if leaf.dtype == mx.float32 else leaf.astype(mx.float32)).sum()
    return mx.isfinite(total)


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
    if not math.isfinite(value) or not math.isfinite(cast(float, mx.array(float(value)).item())):
        raise ValueError(f"[{where}] {name} must be finite (in float32), got {value!r}")
    return float(value)


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


def _shown(value: float) -> str:
    """A float32 value as its shortest repr (0.33333334, not 0.3333333432674408)."""
    return repr(float(str(np.float32(value))))


class LossScale:
    """The interface shared by :class:`NoOpLossScale`, :class:`StaticLossScale` and
    :class:`DynamicLossScale` (jmp's): :meth:`scale` the loss, :meth:`unscale` the
    gradients, :meth:`adjust` to whether they were finite. The training code runs one path
    for all three; "no loss scale" is :class:`NoOpLossScale`.

    ``reports_overflow``: whether non-finite gradients of a finite loss are an error worth
    stopping :func:`~fluxlike.train` for (no scale: something is wrong) or a step the scale
    skips and recovers from (a scale: an overflow it was made for)."""

    reports_overflow = False

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
            if mx.issubdtype(current.dtype, mx.integer) and not mx.issubdtype(
                value.dtype, mx.integer
            ) or not mx.issubdtype(value.dtype, mx.number):
                kind = "an integer" if mx.issubdtype(current.dtype, mx.integer) else "a real"
                raise ValueError(f"[{where}] state entry {key!r} must be {kind} array, got "
                                 f"{str(value.dtype).rpartition('.')[2]}")
        extra = [key for key in state if key not in self._state]
        if extra:
            raise ValueError(f"[{where}] unexpected state entry {extra[0]!r}")
        new = {key: state[key].astype(current.dtype) for key, current in self._state.items()
               if key in state}
        self._check_loaded(new)
        self._state.update(new)

    def _check_loaded(self, new: dict[str, mx.array]) -> None:
        """Raise ``ValueError`` if loaded entries hold values the scale cannot have."""
        scale = cast(float, new["loss_scale"].item()) if "loss_scale" in new else 1.0
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"[{type(self).__name__}] state entry 'loss_scale' must be a "
                             f"finite positive number, got {scale} (in the state loaded)")

    @staticmethod
    def _value(value: Any, key: str, integer: bool = False) -> Any:
        """A loaded scalar entry's Python value (checked to be a real, or an integer, array)."""
        kind = mx.integer if integer else mx.number
        if not isinstance(value, mx.array) or value.shape != () or not mx.issubdtype(
            value.dtype, kind
        ):
            shown = (f"{str(value.dtype).rpartition('.')[2]} array of shape {value.shape}"
                     if isinstance(value, mx.array) else type(value).__name__)
            raise ValueError(f"[DynamicLossScale] state entry {key!r} must be "
                             f"{'an integer' if integer else 'a real'} scalar array, "
                             f"got a {shown}")
        return value.item()


class NoOpLossScale(LossScale):
    """No loss scale (jmp's ``NoOpLossScale``): :meth:`scale` and :meth:`unscale` return
    their argument, :meth:`adjust` does nothing, :attr:`state` is empty and
    :attr:`loss_scale` is 1. This is ``opt_state.loss_scale`` when none was asked for
    (``setup(rule, model)``, ``loss_scale=None``), so that training takes one path.

    >>> import mlx.core as mx
    >>> from fluxlike import NoOpLossScale
    >>> ls = NoOpLossScale()
    >>> ls, ls.scale(mx.array(0.5)), ls.state
    (NoOpLossScale(), array(0.5, dtype=float32), {})
    >>> g = {"w": mx.ones(2)}
    >>> ls.unscale(g) is g
    True
    """

    reports_overflow = True
    _ONE = mx.array(1.0)

    def __init__(self) -> None:
        self._state = {}

    @property
    def loss_scale(self) -> mx.array:
        """``1.0`` (a float32 scalar)."""
        return self._ONE

    def scale(self, tree: Tree) -> Tree:
        return tree

    def unscale(self, tree: Tree) -> Tree:
        return tree

    def __repr__(self) -> str:
        return "NoOpLossScale()"


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


def resolve(loss_scale: Any, where: str) -> LossScale:
    """A loss-scale argument as an object: ``None`` is :class:`NoOpLossScale`, a number is
    static, a loss-scale object is itself. (``"auto"`` is decided by the caller.)"""
    if isinstance(loss_scale, LossScale):
        return loss_scale
    if loss_scale is None:
        return NoOpLossScale()
    if _is_number(loss_scale):
        return StaticLossScale(loss_scale)
    raise ValueError(
        f"{where}: loss_scale must be None, 'auto', a positive number (a static scale) or a "
        f"DynamicLossScale/StaticLossScale/NoOpLossScale, got {loss_scale!r}"
    )
