"""Casting a layer's call: its arguments (:func:`cast_arguments`) and, for a user's layer
that computes with its own parameters, the parameters themselves swapped for their casts in
place while its own ``__call__`` runs (:class:`swapped`)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from . import castcache
from .state import CASTABLE

# Calls that swap casts into a layer hold this lock, and so do plain calls of the same
# classes: a layer is never seen half-swapped by another thread. (Graph construction holds
# the GIL anyway; the lock serialises only these classes' calls.)
swap_lock = threading.RLock()


@functools.cache
def _to(dtype: mx.Dtype, sources: tuple) -> Callable[[Any], Any]:
    def cast(x: Any) -> Any:
        if isinstance(x, mx.array):
            current = x.dtype
            if current != dtype and current in sources:
                return x.astype(dtype)
        return x

    return cast


def cast_arguments(dtype: mx.Dtype, sources: tuple, args: tuple,
                   kwargs: dict) -> tuple[tuple, dict]:
    """Every array of a dtype in ``sources`` in ``args`` and ``kwargs`` (nested in lists,
    tuples and dicts too) cast to ``dtype``; everything else as it is."""
    cast = _to(dtype, sources)
    if len(args) == 1 and not kwargs and isinstance(args[0], mx.array):  # the usual call
        return (cast(args[0]),), kwargs
    args = tuple(cast(a) if isinstance(a, mx.array) else tree_map(cast, a) for a in args)
    return args, (tree_map(cast, kwargs) if kwargs else kwargs)


class swapped:
    """Context manager: ``layer``'s own floating parameters (its arrays, and arrays in its
    lists and dicts; not its child modules, which have policies of their own) replaced by
    their casts to ``dtype`` in place, and put back on exit wherever a slot still holds the
    cast. A value the body assigned to such a slot stays, in the parameter's own dtype (the
    body computed it from the casts: ``self.u = self.u + 1`` keeps ``u`` float32); items it
    appended stay as they are. Float64, integer and boolean arrays are never cast. Hold
    :data:`swap_lock` around it.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense
    >>> layer = Dense(2, 3)
    >>> with swapped(layer, mx.float16):
    ...     layer.weight.dtype
    mlx.core.float16
    >>> layer.weight.dtype
    mlx.core.float32
    """

    __slots__ = ("layer", "dtype", "originals", "slots", "written")

    def __init__(self, layer: nn.Module, dtype: mx.Dtype):
        self.layer, self.dtype = layer, dtype
        self.originals: dict[int, tuple[mx.array, mx.array]] = {}  # id(cast): (cast, source)
        self.slots: dict[tuple[int, Any], mx.Dtype] = {}  # (id(container), key): its dtype
        self.written: list[mx.array] = []  # what the body assigned, cast back

    def __enter__(self) -> nn.Module:
        self._walk(self.layer, self._swap_in)
        return self.layer

    def __exit__(self, *exc_info: Any) -> None:
        if self.originals:
            self._walk(self.layer, self._swap_out)
        if self.written:
            # Scheduled now, under the lock: an array not yet evaluated belongs to this
            # thread's stream, and another thread calling the layer could not evaluate it.
            try:
                mx.async_eval(self.written)
            except (ValueError, RuntimeError):  # inside mx.grad/mx.compile: no evaluation
                pass

    def _swap_in(self, container: Any, key: Any, value: mx.array) -> mx.array:
        if value.dtype == self.dtype or value.dtype not in CASTABLE:
            return value
        cast = castcache.cached_cast(value, self.dtype)
        self.originals[id(cast)] = (cast, value)
        self.slots[(id(container), key)] = value.dtype
        return cast

    def _swap_out(self, container: Any, key: Any, value: mx.array) -> mx.array:
        held = self.originals.get(id(value))
        if held is not None and held[0] is value:
            return held[1]
        dtype = self.slots.get((id(container), key))
        if dtype is not None and value.dtype == self.dtype:  # assigned by the body
            value = value.astype(dtype)
            self.written.append(value)
        return value

    @staticmethod
    def _walk(container: Any, change: Callable[[Any, Any, mx.array], mx.array],
              depth: int = 0) -> None:
        """Apply ``change`` to the arrays of ``container`` (the layer, or a list or dict in
        it) in place; tuples, which cannot change in place, are replaced whole."""
        if isinstance(container, dict):
            items: Any = list(container.items())
        else:
            items = list(enumerate(container))
        setitem = dict.__setitem__ if isinstance(container, nn.Module) else type(
            container).__setitem__
        for key, value in items:
            if isinstance(value, mx.array):
                new: mx.array | tuple[Any, ...] = change(container, key, value)
            elif isinstance(value, nn.Module) or depth > 8:
                continue
            elif isinstance(value, (list, dict)):
                swapped._walk(value, change, depth + 1)
                continue
            elif type(value) is tuple and any(isinstance(v, mx.array) for v in value):
                new = tuple(change(value, i, v) if isinstance(v, mx.array) else v
                            for i, v in enumerate(value))
                if all(a is b for a, b in zip(new, value, strict=True)):
                    continue
            else:
                continue
            if new is not value:
                setitem(container, key, new)
