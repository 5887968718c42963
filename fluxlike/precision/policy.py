"""Per-layer precision policies and the dispatch barrier.

Every layer class has a policy (``"down"``, ``"fp32"`` or ``"none"``) saying what it does
inside an :func:`~fluxlike.autocast` scope with compute dtype ``T``:

- ``down``: floating inputs and the layer's own floating parameters are cast to ``T`` for the
  call (on a shallow view of the layer: the master weights are never touched); output is ``T``.
- ``fp32``: half-precision inputs are cast up to float32; output is float32.
- ``none``: the call is left alone.

The barrier: until :func:`activate` runs (on the first use of autocast in the process) a
layer's ``__call__`` is its own plain method and no autocast code runs at all. ``activate``
wraps the ``__call__`` of every registered class once; from then on a call outside any scope
costs one context-variable read.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from .state import CASTABLE, HALF, OFF, compute_dtypes, device_index

POLICIES = ("down", "fp32", "none")

_registry: dict[type, str] = {}
_lock = threading.Lock()
_dispatching = False

M = TypeVar("M", bound=type)


def autocast_policy(policy: str) -> Callable[[M], M]:
    """Class decorator giving a layer class its precision policy under autocast.

    One line opts a user's own layer in::

        @autocast_policy("down")
        class MyProjection(nn.Module): ...

    and it works on existing classes too: ``autocast_policy("fp32")(SomeNorm)``.
    A subclass inherits its parent's policy unless it declares its own.
    """
    if policy not in POLICIES:
        raise ValueError(f"autocast_policy: policy must be one of {POLICIES}, got {policy!r}")

    def register(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"autocast_policy: expected an mlx.nn.Module subclass, got {cls!r}")
        with _lock:
            _registry[cls] = policy
            if _dispatching:
                _install(cls, policy)
        return cls

    return register


def policy_of(layer: Any) -> str:
    """The policy of a layer or layer class: its own, else its nearest registered base's."""
    cls = layer if isinstance(layer, type) else type(layer)
    for base in cls.__mro__:
        if base in _registry:
            return _registry[base]
    return "none"


def is_dispatching() -> bool:
    """Whether the process has crossed the barrier (autocast was used at least once)."""
    return _dispatching


def activate() -> None:
    """Cross the barrier: route every registered layer class through its policy. Idempotent."""
    global _dispatching
    if _dispatching:
        return
    with _lock:
        if _dispatching:
            return
        for cls in _registry:
            for sub in _subclasses(cls):
                _install(sub, policy_of(sub))
        _dispatching = True


def _subclasses(cls: type) -> list[type]:
    """``cls`` and its subclasses that define their own ``__call__`` (and so need wrapping)."""
    found = [cls]
    for sub in cls.__subclasses__():
        if sub not in _registry:
            found.extend(s for s in _subclasses(sub) if "__call__" in s.__dict__)
    return found


def _install(cls: type, policy: str) -> None:
    call = cls.__call__
    plain = getattr(call, "__fluxlike_plain__", call)  # never wrap a wrapper
    if policy == "none":
        if plain is not call and "__call__" in cls.__dict__:
            cls.__call__ = plain
        return
    dispatch = _down if policy == "down" else _fp32

    @functools.wraps(plain)
    def __call__(self, *args, **kwargs):
        state = compute_dtypes.get()
        if state is OFF:
            return plain(self, *args, **kwargs)
        dtype = state[device_index()]
        if dtype is None:
            return plain(self, *args, **kwargs)
        return dispatch(plain, self, dtype, args, kwargs)

    __call__.__fluxlike_plain__ = plain
    cls.__call__ = __call__


def _to(dtype: mx.Dtype, sources: tuple) -> Callable[[Any], Any]:
    def cast(x: Any) -> Any:
        if isinstance(x, mx.array) and x.dtype in sources and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return cast


def _down(plain, layer: nn.Module, dtype: mx.Dtype, args: tuple, kwargs: dict):
    cast = _to(dtype, CASTABLE)
    return plain(half_view(layer, dtype), *tree_map(cast, args), **tree_map(cast, kwargs))


def _fp32(plain, layer: nn.Module, dtype: mx.Dtype, args: tuple, kwargs: dict):
    up = _to(mx.float32, HALF)
    return plain(layer, *tree_map(up, args), **tree_map(up, kwargs))


def half_view(layer: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """A shallow copy of ``layer`` whose own floating parameters are cast to ``dtype``.

    Child modules are shared, not copied: a child with a policy of its own casts itself
    when it is called. The casts are ordinary graph ops, so gradients flow back to the
    float32 master weights in float32.
    """
    view = type(layer).__new__(type(layer))
    view.__dict__.update(layer.__dict__)
    cast = _to(dtype, CASTABLE)
    for key, value in layer.items():
        dict.__setitem__(view, key, cast(value))
    return view
