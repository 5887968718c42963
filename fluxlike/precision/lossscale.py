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

from .. import native
from .._mlxtyping import tree_flatten

Tree = Any


def _floating(tree: Tree) -> list[mx.array]:
    return [leaf for _, leaf in tree_flatten(tree)
            if isinstance(leaf, mx.array) and mx.issubdtype(leaf.dtype, mx.floating)]


def _native_check(leaves: list[mx.array]) -> mx.array | None:
    """The native kernels' one-node check of ``leaves``
    (:func:`fluxlike.native.finite_kernel`), where they are in use, the default device is
    the CPU and every leaf is float32, bfloat16 or float16; else ``None``."""
    kernel = native.finite_kernel()
    if (kernel is None or not leaves or mx.default_device() != mx.cpu
            or any(leaf.dtype not in _NATIVE_CHECKED for leaf in leaves)):
        return None
    return kernel(leaves)


_NATIVE_CHECKED = (mx.float32, mx.bfloat16, mx.float16)


def all_finite(tree: Tree) -> mx.array:
    """Whether every floating array in ``tree`` is free of inf and nan, as a bool ``mx.array``
    (no host synchronisation; ``True`` for a tree without floating arrays). On the CPU with
    the native kernels, one primitive (:func:`fluxlike.native.finite_kernel`); else MLX's
    ``isfinite`` and ``all`` per array.

    >>> import mlx.core as mx
    >>> from fluxlike import all_finite
    >>> all_finite({"w": mx.ones(3), "b": [mx.zeros(2)]})
    array(True, dtype=bool)
    >>> all_finite({"w": mx.array([1.0, float("inf")])})
    array(False, dtype=bool)
    """
    leaves = _floating(tree)
    checked = _native_check(leaves)
    if checked is not None:
        return checked
    finite = mx.array(True)
    for leaf in leaves:
        finite = mx.logical_and(finite, mx.all(mx.isfinite(leaf)))
    return finite


def sum_finite(tree: Tree) -> mx.array:
    """:func:`all_finite` for a training step, in the fewest graph nodes: on the CPU with the
    native kernels it is :func:`all_finite` (one primitive); elsewhere, whether the float32
    sum of every floating array in ``tree`` is finite. An inf or nan anywhere makes the sum
    inf or nan; so does a sum past float32's range (about ``3.4e38``), which no trainable
    gradient reaches. One reduction per array instead of two kernels (``isfinite``,
    ``all``), which on a small model is a sizeable part of a step.

    >>> import mlx.core as mx
    >>> sum_finite({"w": mx.ones(3), "b": [mx.zeros(2, dtype=mx.float16)]})
    array(True, dtype=bool)
    >>> sum_finite({"w": mx.array([1.0, float("inf")]), "v": mx.array([-float("inf")])})
    array(False, dtype=bool)
    """
    leaves = _floating(tree)
    checked = _native_check(leaves)
    if checked is not None:
        return checked
    total = mx.array(0.0)
    for leaf in leaves:
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
