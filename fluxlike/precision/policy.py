"""Per-layer precision policies and the dispatch barrier.

Every layer class has a policy (``"down"``, ``"fp32"`` or ``"none"``) saying what it does
inside an :func:`~fluxlike.autocast` scope with compute dtype ``T``:

- ``down``: floating inputs and the layer's own floating parameters are cast to ``T`` for the
  call (on a shallow view of the layer: the master weights are never touched); output is ``T``.
- ``fp32``: half-precision inputs are cast up to float32; output is float32.
- ``none``: the call is left alone.

The barrier: until :func:`activate` runs (on the first use of autocast in the process) a
layer's ``__call__`` is its own plain method and no autocast code runs at all. ``activate``
wraps the ``__call__`` of every registered class (and of their subclasses that define their
own, including subclasses defined later) once; from then on a call outside any scope costs
one context-variable read.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from . import castcache
from .state import CASTABLE, HALF, OFF, compute_dtypes, current_dtype, device_index

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
                _install_tree(cls)
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
        # Bases first, so that a "none" subclass of a wrapped class pins the plain method.
        for cls in sorted(_registry, key=lambda c: len(c.__mro__)):
            _install_tree(cls)
        _dispatching = True


def _subclasses(cls: type) -> list[type]:
    """``cls`` and, bases first, its subclasses that need a ``__call__`` of their own: those
    defining one, and registered ones (their policy may differ from the inherited wrapper's)."""
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(s for s in _subclasses(sub) if s in _registry or "__call__" in s.__dict__)
    return found


def _install_tree(cls: type) -> None:
    """Route ``cls``, its existing subclasses and (via a hook) its future ones."""
    for sub in _subclasses(cls):
        _install(sub, policy_of(sub))
    _watch_subclasses(cls)


def _watch_subclasses(cls: type) -> None:
    """Wrap the ``__call__`` of subclasses of ``cls`` defined after the barrier was crossed."""
    own = cls.__dict__.get("__init_subclass__")
    if getattr(own, "__fluxlike_watch__", False):
        return

    def __init_subclass__(sub: type, **kwargs: Any) -> None:
        if own is not None:
            own.__func__(sub, **kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)
        call = sub.__dict__.get("__call__")
        if call is not None and sub not in _registry and not hasattr(call, "__fluxlike_plain__"):
            with _lock:
                _install(sub, policy_of(sub))

    hook = classmethod(__init_subclass__)
    hook.__fluxlike_watch__ = True
    cls.__init_subclass__ = hook


# A layer's own forward -> the same computation for use inside a scope (stock.py)
_scoped_forwards: dict[Callable, Callable] = {}


def scoped_forward(forward: Callable, replacement: Callable) -> None:
    """Inside an autocast scope, run ``replacement`` wherever a layer's ``__call__`` is
    ``forward``: the same computation, written with :mod:`.ops` kernels so that CPU half
    precision takes the float32 kernels. For layers one cannot edit (``mlx.nn``'s); a
    subclass defining its own ``__call__`` keeps it. Call before the first autocast use."""
    _scoped_forwards[forward] = replacement


def _install(cls: type, policy: str) -> None:
    call = cls.__call__
    plain = getattr(call, "__fluxlike_plain__", call)  # never wrap a wrapper
    if policy == "none":
        if plain is not call:  # pin the plain method over an inherited wrapper
            cls.__call__ = plain
        return
    own = cls.__dict__.get("__call__")
    if getattr(own, "__fluxlike_policy__", None) == policy:
        return  # already routed: keep the one wrapper
    dispatch = _down if policy == "down" else _fp32
    scoped = _scoped_forwards.get(plain, plain)

    @functools.wraps(plain)
    def __call__(self, *args, **kwargs):
        state = compute_dtypes.get()
        if state is OFF:
            return plain(self, *args, **kwargs)
        dtype = state[device_index()]
        if dtype is None:
            return plain(self, *args, **kwargs)
        return dispatch(scoped, self, dtype, args, kwargs)

    __call__.__fluxlike_plain__ = plain
    __call__.__fluxlike_policy__ = policy
    cls.__call__ = __call__


@functools.cache
def _to(
    dtype: mx.Dtype, sources: tuple, astype: Callable = mx.array.astype
) -> Callable[[Any], Any]:
    def cast(x: Any) -> Any:
        if isinstance(x, mx.array):
            current = x.dtype
            if current != dtype and current in sources:
                return astype(x, dtype)
        return x

    return cast


def _cast_all(cast: Callable[[Any], Any], args: tuple, kwargs: dict) -> tuple[list, dict]:
    """``cast`` applied to every array in ``args`` and ``kwargs`` (arrays directly: the common
    case, and a ``tree_map`` costs microseconds)."""
    args = [cast(a) if isinstance(a, mx.array) else tree_map(cast, a) for a in args]
    return args, (tree_map(cast, kwargs) if kwargs else kwargs)


def _down(plain, layer: nn.Module, dtype: mx.Dtype, args: tuple, kwargs: dict):
    caster = castcache.cast_input if castcache.is_sealed(layer) else mx.array.astype
    args, kwargs = _cast_all(_to(dtype, CASTABLE, caster), args, kwargs)
    return plain(half_view(layer, dtype), *args, **kwargs)


def _fp32(plain, layer: nn.Module, dtype: mx.Dtype, args: tuple, kwargs: dict):
    args, kwargs = _cast_all(_to(mx.float32, HALF), args, kwargs)
    return plain(layer, *args, **kwargs)


def half_view(layer: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """A shallow copy of ``layer`` whose own floating parameters are cast to ``dtype``.

    Child modules are shared, not copied: a child with a policy of its own casts itself
    when it is called. Parameters held in lists or dicts are cast too. The casts are
    ordinary graph ops, so gradients flow back to the float32 master weights in float32.
    Outside differentiation the view and its casts are kept across calls while the layer's
    parameters are the same arrays (:mod:`.castcache`).

    >>> import mlx.core as mx
    >>> from fluxlike import Dense
    >>> layer = Dense(2, 3)
    >>> view = half_view(layer, mx.float16)
    >>> view.weight.dtype, layer.weight.dtype
    (mlx.core.float16, mlx.core.float32)
    """
    return castcache.view(layer, dtype, lambda: _make_view(layer, dtype))


def _make_view(layer: nn.Module, dtype: mx.Dtype) -> nn.Module:
    view = type(layer).__new__(type(layer))
    view.__dict__.update(layer.__dict__)
    cast = _to(dtype, CASTABLE, castcache.cast)
    for key, value in layer.items():
        if isinstance(value, (list, tuple, dict)) and not isinstance(value, nn.Module):
            value = tree_map(cast, value, is_leaf=nn.Module.is_module)
        else:
            value = cast(value)
        dict.__setitem__(view, key, value)
    return view


def compute_view(layer: nn.Module) -> nn.Module:
    """``layer`` as its down policy would run it right now: a :func:`half_view` in the scope's
    compute dtype inside an autocast scope, the layer itself outside. For a container that
    calls a down-policy child's parts directly instead of through its ``__call__`` (a
    recurrent layer stepping its cell).

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, autocast
    >>> layer = Dense(2, 3)
    >>> compute_view(layer) is layer
    True
    >>> with autocast(mx.bfloat16, device="cpu"):
    ...     compute_view(layer).weight.dtype
    mlx.core.bfloat16
    """
    dtype = current_dtype()
    return layer if dtype is None else half_view(layer, dtype)
