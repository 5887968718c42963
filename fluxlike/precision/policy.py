"""Per-layer precision records, and the routing of layer calls through them.

Every layer class has one :class:`Policy`, declared with :func:`autocast_policy` (or
:func:`keep_float32` alone) and looked up along the class hierarchy by :func:`policy_record`.
Its ``kind`` says what the layer does inside an :func:`~fluxlike.autocast` scope with compute
dtype ``T``:

- ``"down"``: floating inputs and the layer's own floating parameters are cast to ``T`` for
  the call; the output is ``T``. fluxlike's own layers cast at their kernels
  (:mod:`.kernels`) and run as they are; a class fluxlike cannot edit (``mlx.nn``'s) has a
  ``forward`` run in its place; any other ``__call__`` (a user's layer) runs on the layer
  itself with its parameters' casts swapped in for the call (:class:`~.swap.swapped`), so
  whatever the forward writes to the layer persists.
- ``"fp32"``: the body runs with autocast off on its device (layers nested in it compute in
  float32), half-precision inputs are cast up, and half outputs are returned in float32.
- ``"none"``: untouched.

The routing: until the first use of autocast in the process (:func:`activate`) no class is
routed and a layer call runs its own plain method. ``activate`` wraps, once, the
``__call__`` of every class whose record needs it (and their subclasses' own), and from then
on routes each new ``mlx.nn.Module`` subclass as it is defined; a wrapped call outside any
scope costs one context-variable read.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from .operands import convert
from .state import CASTABLE, HALF, PLAIN, context, device_index, first_use, routing
from .swap import cast_arguments, swap_lock, swapped

KINDS = ("down", "fp32", "none")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
M = TypeVar("M", bound=type)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Everything the precision machinery knows about a layer class.

    - ``kind``: ``"down"``, ``"fp32"`` or ``"none"`` (see the module docs);
    - ``keep_float32``: whether ``f16mix``/``bf16mix`` leave its parameters in float32;
    - ``forward``: for a ``"down"`` class fluxlike cannot edit, a function
      ``f(layer, *args, **kwargs)`` run inside a scope in place of the class's ``__call__``
      (not of a subclass's own);
    - ``methods``: other methods run inside a scope by a function of their own (a tied
      embedding's ``as_linear``);
    - ``unscoped``: for a ``forward`` (and ``methods``), a predicate ``f(layer, *args,
      **kwargs)`` saying that outside a scope the call runs ``forward`` (or the method's
      function) too: ``mlx.nn``'s layers after a half-precision converter, whose own forwards
      would run MLX's slow CPU half kernels or refuse a float32 attention mask (:mod:`.stock`).
    """

    kind: str = "none"
    keep_float32: bool = False
    forward: Callable | None = None
    methods: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    unscoped: Callable[..., bool] | None = None


_NONE = Policy()
# What each class declared itself (the fields it set); a record merges them along the MRO.
_declared: dict[type, dict[str, Any]] = {}


def policy_record(layer: Any) -> Policy:
    """The record of a layer or layer class: each field as the nearest class in its MRO
    that declared it set it.

    >>> from fluxlike import BatchNorm, Dense
    >>> policy_record(Dense).kind, policy_record(BatchNorm(3)).keep_float32
    ('down', True)
    """
    cls = layer if isinstance(layer, type) else type(layer)
    return _record(cls)


@functools.lru_cache(maxsize=4096)
def _record(cls: type) -> Policy:
    fields: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        fields.update(_declared.get(base, ()))
    return Policy(**fields) if fields else _NONE


def _declarer(cls: type, field: str) -> type | None:
    """The class whose own declaration gives ``cls`` its ``field``."""
    return next((base for base in cls.__mro__ if field in _declared.get(base, ())), None)


def policy_of(layer: Any) -> str:
    """The policy kind (``"down"``, ``"fp32"``, ``"none"``) of a layer or layer class.

    >>> import mlx.nn as nn
    >>> from fluxlike import Dense, policy_of
    >>> policy_of(Dense), policy_of(nn.LayerNorm(4)), policy_of(nn.Dropout())
    ('down', 'fp32', 'none')
    """
    return policy_record(layer).kind


def _check_class(cls: Any, where: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"{where}: expected an mlx.nn.Module subclass, got {cls!r}")


def _declare(cls: type, **fields: Any) -> None:
    """Record ``fields`` as ``cls``'s own (routing it at once after :func:`activate`)."""
    with routing.lock:
        _declared.setdefault(cls, {}).update(fields)
        _record.cache_clear()
        if routing.on:
            for sub in _with_subclasses(cls):
                _route(sub)


def autocast_policy(
    kind: str, *, keep_float32: bool | None = None, forward: Callable | None = None,
    methods: Mapping[str, Callable] | None = None, unscoped: Callable[..., bool] | None = None,
) -> Callable[[M], M]:
    """Class decorator giving a layer class its precision policy under autocast.

    One line opts a user's own layer in::

        @autocast_policy("down")
        class MyProjection(nn.Module): ...

    and it works on existing classes too: ``autocast_policy("fp32")(SomeNorm)``. Inside a
    scope a ``"down"`` layer's floating inputs and own floating parameters are cast to the
    compute dtype for the call (its ``__call__`` runs on the layer itself, so state it
    writes persists); an ``"fp32"`` layer runs with autocast off, in float32. A subclass
    inherits its parent's policy unless it declares its own. ``keep_float32=True`` is
    :func:`keep_float32` in the same line; ``forward``, ``methods`` and ``unscoped`` are for
    classes fluxlike cannot edit (see :class:`Policy`).

    >>> import mlx.core as mx
    >>> import mlx.nn as nn
    >>> from fluxlike import autocast, autocast_policy
    >>> @autocast_policy("down")
    ... class Project(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = mx.ones((3, 2))
    ...         self.calls = 0
    ...     def __call__(self, x):
    ...         self.calls += 1
    ...         return x @ self.w
    >>> layer = Project()
    >>> with autocast(mx.bfloat16):
    ...     layer(mx.ones((1, 3))).dtype
    mlx.core.bfloat16
    >>> layer.w.dtype, layer.calls
    (mlx.core.float32, 1)
    """
    if kind not in KINDS:
        raise ValueError(f"autocast_policy: policy must be one of {KINDS}, got {kind!r}")
    if keep_float32 is not None and not isinstance(keep_float32, bool):
        raise TypeError(f"autocast_policy: keep_float32 must be a bool, got {keep_float32!r}")
    if forward is not None and not callable(forward):
        raise TypeError(f"autocast_policy: forward must be None or a function, got {forward!r}")
    if unscoped is not None and not (callable(unscoped) and (forward is not None or methods)):
        raise TypeError(f"autocast_policy: unscoped must be a predicate given with a forward "
                        f"function or methods, got unscoped={unscoped!r}, forward={forward!r}")
    methods = dict(methods or {})
    for name, fn in methods.items():
        if not (isinstance(name, str) and callable(fn)):
            raise TypeError(f"autocast_policy: methods must map method names to functions, "
                            f"got {name!r}: {fn!r}")
    fields: dict[str, Any] = {"kind": kind, "forward": forward, "methods": methods,
                              "unscoped": unscoped}
    if keep_float32 is not None:
        fields["keep_float32"] = keep_float32

    def register(cls: M) -> M:
        _check_class(cls, "autocast_policy")
        _declare(cls, **fields)
        return cls

    return register


C = TypeVar("C", bound=type)


def keep_float32(cls: C, keep: bool = True) -> C:
    """Declare that ``cls`` keeps its parameters in float32 under ``f16mix``/``bf16mix``.

    The one-line trait of Flux's ``_keep_f32_under_halfprec``; works as a class decorator
    (``@keep_float32``) and on existing classes. Subclasses inherit it; a subclass can opt
    out with ``keep_float32(Sub, False)``. Children of a layer that keeps float32 stay
    float32 too. Returns ``cls``.

    >>> import mlx.core as mx
    >>> import mlx.nn as nn
    >>> from fluxlike import f16mix, keep_float32
    >>> @keep_float32
    ... class Gain(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gain = mx.ones((3,))
    >>> f16mix(Gain()).gain.dtype
    mlx.core.float32
    """
    _check_class(cls, "keep_float32")
    if not isinstance(keep, bool):
        raise TypeError(f"keep_float32: keep must be a bool, got {keep!r}")
    _declare(cls, keep_float32=keep)
    return cls


def activate() -> None:
    """Start routing: every class with a record through its policy, and from now on each new
    ``mlx.nn.Module`` subclass as it is defined; then fluxlike's first use
    (:func:`.state.first_use`) if this is it. Idempotent."""
    if routing.on:
        return
    with routing.lock:
        if routing.on:
            return
        # The hook first: a class defined meanwhile in another thread waits for the lock and is
        # routed then. Bases first, so that a subclass's own routing replaces a base's wrapper.
        nn.Module.__init_subclass__ = classmethod(_route_new)  # type: ignore[assignment]  # one hook, on the root
        for cls in sorted(_with_subclasses(nn.Module), key=lambda c: len(c.__mro__)):
            _route(cls)
        first_use()
        routing.on = True


def _route_new(sub: type, **kwargs: Any) -> None:
    """``nn.Module.__init_subclass__`` once routing is on: route the new class."""
    with routing.lock:
        _route(sub)


def is_routing() -> bool:
    """Whether the process routes layer calls (autocast was used at least once)."""
    return routing.on


def _with_subclasses(cls: type[Any]) -> list[type]:
    """``cls`` and every subclass of it, bases first."""
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(s for s in _with_subclasses(sub) if s not in found)
    return found


def _plain(method: Callable) -> Callable:
    """A method without fluxlike's routing wrapper."""
    return getattr(method, "__fluxlike_plain__", method)


def _ours(fn: Callable) -> bool:
    """Whether ``fn`` is written in fluxlike: its down layers cast at their kernels
    (tests/precision/test_policy.py checks every one)."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith(_PACKAGE)


def _route(cls: type) -> None:
    """Give ``cls.__call__`` (and the record's methods) the wrapper its record asks for,
    or pin the plain method where it needs none. Classes that neither declare a record nor
    define the method keep what they inherit."""
    defines = next((base for base in cls.__mro__ if "__call__" in base.__dict__), object)
    if (cls not in _declared and defines is not cls) or defines is object:
        return
    record = _record(cls)
    plain = _plain(defines.__dict__["__call__"])
    forward = record.forward
    if forward is not None:
        declarer = _declarer(cls, "forward")
        if declarer is None or plain is not _plain(declarer.__call__):
            forward = None  # a subclass's own __call__: cast around it instead
    if record.kind == "fp32":
        wrapper, kind = _unscoped_call(plain, float32=True), "fp32"
    elif record.kind == "down" and forward is not None:
        wrapper, kind = _scoped_call(plain, forward, record.unscoped), "down"
    elif record.kind == "down" and not _casts_at_kernels(cls, plain):
        wrapper, kind = _swapping_call(plain), "down"
    elif record.kind == "none" and _ours(plain) and _is_kernel_call(cls, plain):
        # fluxlike's down forward declared "none" in a subclass: computes as outside a scope
        wrapper, kind = _unscoped_call(plain, float32=False), "none"
    else:
        wrapper, kind = None, None
    _install(cls, "__call__", plain, wrapper, kind)
    for name, scoped in record.methods.items():
        if name in cls.__dict__ or _declarer(cls, "methods") is cls:
            method = _plain(getattr(cls, name))
            _install(cls, name, method, _scoped_call(method, scoped, record.unscoped), "down")


def _casts_at_kernels(cls: type, plain: Callable) -> bool:
    """Whether ``plain``, written in fluxlike, runs as one of fluxlike's own "down" classes in
    ``cls``'s hierarchy (``cls`` included): it casts at the kernels. A fluxlike ``__call__`` of
    another kind (an ``Embedding``'s, a ``LayerNorm``'s) declared "down" in a user's subclass
    is cast around, as a user's own."""
    return _ours(plain) and any(
        base.__module__.startswith("fluxlike.") and _declared.get(base, {}).get("kind") == "down"
        for base in cls.__mro__)


def _is_kernel_call(cls: type, plain: Callable) -> bool:
    """Whether ``plain`` is the ``__call__`` of a fluxlike class declared ``"down"``."""
    return any(_record(base).kind == "down" and _plain(base.__call__) is plain
               for base in cls.__mro__[1:])


def _install(cls: type, name: str, plain: Callable, wrapper: Callable | None,
             kind: str | None) -> None:
    current = getattr(cls, name)
    if wrapper is None:
        if current is not plain:  # pin the plain method over an inherited wrapper
            setattr(cls, name, plain)
        return
    own = cls.__dict__.get(name)
    if own is not None and getattr(own, "__fluxlike_policy__", None) == kind and (
            _plain(own) is plain):
        return  # already routed: keep the one wrapper
    wrapper = functools.wraps(plain)(wrapper)
    wrapper.__fluxlike_plain__ = plain  # type: ignore[attr-defined]  # marks on the wrapper
    wrapper.__fluxlike_policy__ = kind  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def _scoped_call(plain: Callable, scoped: Callable,
                 unscoped: Callable[..., bool] | None = None) -> Callable:
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = context.get()
        if state is PLAIN or state[device_index()] is None:
            if unscoped is not None and unscoped(self, *args, **kwargs):  # a converted layer
                return scoped(self, *args, **kwargs)
            return plain(self, *args, **kwargs)
        return scoped(self, *args, **kwargs)

    return call


def _up(x: Any) -> Any:
    return convert(x, mx.float32) if isinstance(x, mx.array) and x.dtype in HALF else x


def _unscoped_call(plain: Callable, float32: bool) -> Callable:
    """``plain`` with autocast off on its device inside a scope: the ``"fp32"`` policy with
    ``float32=True`` (half inputs cast up, half outputs returned in float32), else a
    ``"none"`` class whose inherited forward would cast at fluxlike's kernels."""
    f32, half = mx.float32, HALF

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = context.get()
        if state is PLAIN:
            return plain(self, *args, **kwargs)
        slot = 1 if mx.default_device().type is mx.gpu else 0
        if state[slot] is None:
            return plain(self, *args, **kwargs)
        if not float32:
            pass
        elif len(args) == 1 and not kwargs and isinstance(args[0], mx.array):  # the usual
            args = (convert(args[0], f32),) if args[0].dtype in half else args
        else:
            args, kwargs = cast_arguments(f32, half, args, kwargs)
        off = state._replace(cpu=None) if slot == 0 else state._replace(gpu=None)
        token = context.set(off if off[0] is not None or off[1] is not None or off[2] or off[3]
                            else PLAIN)
        try:
            out = plain(self, *args, **kwargs)
        finally:
            context.reset(token)
        if not float32:
            return out
        if isinstance(out, mx.array):
            return convert(out, f32) if out.dtype in half else out
        return tree_map(_up, out)

    return call


def _swapping_call(plain: Callable) -> Callable:
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = context.get()
        dtype = None if state is PLAIN else cast("mx.Dtype | None", state[device_index()])
        with swap_lock:
            if dtype is None:
                return plain(self, *args, **kwargs)
            args, kwargs = cast_arguments(dtype, CASTABLE, args, kwargs)
            with swapped(self, dtype):
                return plain(self, *args, **kwargs)

    return call

