"""Per-layer precision records and the dispatch barrier.

Every layer class has one :class:`Policy`, set by :func:`autocast_policy` (and
:func:`keep_float32`) and read through :func:`policy_record`. Its ``kind`` says what the
layer does inside an :func:`~fluxlike.autocast` scope with compute dtype ``T``:

- ``"down"``: floating inputs and the layer's own floating parameters are cast to ``T`` for
  the call; the output is ``T``. How depends on ``forward``: a layer written with
  :mod:`fluxlike.precision.ops` (fluxlike's own, ``forward="ops"``) casts at its kernels and
  runs as it is; a function given as ``forward`` runs in place of ``__call__`` (mlx.nn's
  layers, which fluxlike cannot edit); otherwise (a user's layer) the layer's own
  ``__call__`` runs on the layer itself with its parameters' casts swapped in for the call
  (:func:`swapped`), so whatever the forward writes to the layer persists.
- ``"fp32"``: the body runs with autocast off on its device (layers nested in it compute
  in float32), half-precision inputs are cast up, and half outputs are returned in float32.
- ``"none"``: untouched.

The barrier: until the first use of autocast in the process (:func:`activate`) no class is
routed and a layer call runs its own plain method. ``activate`` wraps the ``__call__`` of
every class whose record needs it (and of their subclasses that define their own,
including subclasses defined later) once; from then on such a call outside any scope costs
one context-variable read. Layers that cast at their kernels are never wrapped.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from . import castcache
from .state import CASTABLE, HALF, PLAIN, barrier, context, device_index, with_dtype

KINDS = ("down", "fp32", "none")
M = TypeVar("M", bound=type)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Everything the precision machinery knows about a layer class.

    - ``kind``: ``"down"``, ``"fp32"`` or ``"none"`` (see the module docs);
    - ``forward``: for ``"down"``: ``None`` (cast the parameters around the class's own
      ``__call__``), ``"ops"`` (the class's ``__call__`` casts at fluxlike's kernels), or a
      function ``f(layer, *args, **kwargs)`` run inside a scope in place of ``__call__``;
    - ``methods``: other methods run inside a scope by a function of their own (a tied
      embedding's ``as_linear``);
    - ``unscoped``: for a ``forward`` function (and ``methods``): a predicate
      ``f(layer, *args, **kwargs)`` saying that outside a scope the call runs ``forward``
      (or the method's function) too: mlx.nn's layers after a half-precision converter,
      whose own forwards would run MLX's slow CPU half kernels or refuse a float32
      attention mask (:mod:`.stock`);
    - ``keep_float32``: whether ``f16mix``/``bf16mix`` leave its parameters in float32;
    - ``owner``: the class that declared it (a subclass that defines its own ``__call__``
      is not covered by the owner's ``forward``).
    """

    kind: str = "none"
    forward: Callable | str | None = None
    methods: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    unscoped: Callable[..., bool] | None = None
    keep_float32: bool = False
    owner: type | None = None


_NONE = Policy()
_records: dict[type, Policy] = {}


def policy_record(layer: Any) -> Policy:
    """The record of a layer or layer class: its own, else its nearest declared base's.

    >>> from fluxlike import BatchNorm, Dense
    >>> policy_record(Dense).kind, policy_record(BatchNorm(3)).keep_float32
    ('down', True)
    """
    cls = layer if isinstance(layer, type) else type(layer)
    for base in cls.__mro__:
        record = _records.get(base)
        if record is not None:
            return record
    return _NONE


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


def _declare(cls: type, **changes: Any) -> None:
    """Give ``cls`` a record of its own: the inherited one with ``changes``. A new kind or
    forward makes ``cls`` the record's owner; ``keep_float32`` alone keeps the inherited
    owner (whose forward still covers only the owner's own ``__call__``)."""
    with barrier.lock:
        inherited = policy_record(cls)
        owner = cls if "kind" in changes or inherited.owner is None else inherited.owner
        _records[cls] = dataclasses.replace(inherited, owner=owner, **changes)
        if barrier.crossed:
            _route_tree(cls)


def autocast_policy(
    kind: str, *, forward: Callable | str | None = None,
    methods: Mapping[str, Callable] | None = None,
    unscoped: Callable[..., bool] | None = None,
) -> Callable[[M], M]:
    """Class decorator giving a layer class its precision policy under autocast.

    One line opts a user's own layer in::

        @autocast_policy("down")
        class MyProjection(nn.Module): ...

    and it works on existing classes too: ``autocast_policy("fp32")(SomeNorm)``. Inside a
    scope a ``"down"`` layer's floating inputs and own floating parameters are cast to the
    compute dtype for the call (its ``__call__`` runs on the layer itself, so state it
    writes persists); an ``"fp32"`` layer runs with autocast off, in float32. A subclass
    inherits its parent's policy unless it declares its own. ``forward`` and ``methods``
    are for layers written with :mod:`fluxlike.precision.ops`, and ``unscoped`` for a
    ``forward`` that also serves some calls outside a scope (see :class:`Policy`).

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
    if forward is not None and not (forward == "ops" or callable(forward)):
        raise TypeError(f"autocast_policy: forward must be None, 'ops' or a function, "
                        f"got {forward!r}")
    if unscoped is not None and not (callable(unscoped) and (callable(forward) or methods)):
        raise TypeError(f"autocast_policy: unscoped must be a predicate given with a forward "
                        f"function or methods, got unscoped={unscoped!r}, forward={forward!r}")
    methods = dict(methods or {})
    for name, fn in methods.items():
        if not (isinstance(name, str) and callable(fn)):
            raise TypeError(f"autocast_policy: methods must map method names to functions, "
                            f"got {name!r}: {fn!r}")

    def register(cls: M) -> M:
        _check_class(cls, "autocast_policy")
        _declare(cls, kind=kind, forward=forward, methods=methods, unscoped=unscoped)
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
    """Cross the barrier: route every class with a record through its policy. Idempotent."""
    if barrier.crossed:
        return
    with barrier.lock:
        if barrier.crossed:
            return
        # Bases first, so that a subclass's own routing replaces an inherited wrapper.
        for cls in sorted(_records, key=lambda c: len(c.__mro__)):
            _route_tree(cls)
        barrier.crossed = True


def is_dispatching() -> bool:
    """Whether the process has crossed the barrier (autocast was used at least once)."""
    return barrier.crossed


def _subclasses(cls: type[Any]) -> list[type]:
    """``cls`` and, bases first, its subclasses that need routing of their own: those
    defining ``__call__`` (or a routed method), and declared ones."""
    names = {"__call__", *policy_record(cls).methods}
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(s for s in _subclasses(sub)
                     if s in _records or any(n in s.__dict__ for n in names))
    return found


def _route_tree(cls: type) -> None:
    """Route ``cls``, its existing subclasses and (via a hook) its future ones."""
    for sub in _subclasses(cls):
        _route(sub)
    _watch_subclasses(cls)


def _watch_subclasses(cls: type[Any]) -> None:
    """Route subclasses of ``cls`` defined after the barrier was crossed."""
    own = cls.__dict__.get("__init_subclass__")
    if getattr(own, "__fluxlike_watch__", False):
        return

    def __init_subclass__(sub: type, **kwargs: Any) -> None:
        if own is not None:
            own.__func__(sub, **kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)
        if sub not in _records:
            with barrier.lock:
                _route(sub)

    hook: classmethod[Any, ..., None] = classmethod(__init_subclass__)
    hook.__fluxlike_watch__ = True  # type: ignore[attr-defined]  # a mark on the hook
    cls.__init_subclass__ = hook  # type: ignore[assignment]  # the hook installed on the class


def _plain(method: Callable) -> Callable:
    """A method without fluxlike's routing wrapper."""
    return getattr(method, "__fluxlike_plain__", method)


def _route(cls: type) -> None:
    """Give ``cls.__call__`` (and the record's methods) the wrapper its record asks for,
    or pin the plain method where it needs none."""
    record = policy_record(cls)
    plain = _plain(cls.__call__)
    # The owner's forward covers the owner's own __call__ only: a subclass that writes its
    # own forward gets its parameters cast around it instead.
    covered = record.owner is not None and plain is _plain(record.owner.__call__)
    forward = record.forward if covered else None
    unscoped = record.unscoped if covered else None
    if record.kind == "fp32":
        _install(cls, "__call__", plain, _unscoped_call(plain, float32=True), "fp32")
    elif record.kind == "down" and forward == "ops":
        _install(cls, "__call__", plain, None, None)
    elif record.kind == "down" and forward is not None:
        _install(cls, "__call__", plain, _scoped_call(plain, cast(Callable, forward), unscoped),
                 "down")
    elif record.kind == "down":
        _install(cls, "__call__", plain, _swapping_call(plain), "down")
    elif _casts_at_ops(cls, plain):  # "none" over a forward that would cast: as outside
        _install(cls, "__call__", plain, _unscoped_call(plain, float32=False), "none")
    else:
        _install(cls, "__call__", plain, None, None)
    for name, scoped in record.methods.items():
        method = _plain(getattr(cls, name))
        _install(cls, name, method, _scoped_call(method, scoped, record.unscoped), "down")


def _casts_at_ops(cls: type, plain: Callable) -> bool:
    """Whether ``plain`` is the own ``__call__`` of a class declared ``forward="ops"``."""
    for base in cls.__mro__:
        record = _records.get(base)
        if record is not None and record.forward == "ops" and record.owner is base and (
            _plain(base.__call__) is plain
        ):
            return True
    return False


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


def _unscoped_call(plain: Callable, float32: bool) -> Callable:
    """``plain`` with autocast off on its device inside a scope: the ``"fp32"`` policy with
    ``float32=True`` (half inputs cast up, half outputs returned in float32), else a
    ``"none"`` class whose inherited forward would cast at fluxlike's kernels."""
    up = _to(mx.float32, HALF)

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = context.get()
        if state is PLAIN:
            return plain(self, *args, **kwargs)
        slot = device_index()
        if state[slot] is None:
            return plain(self, *args, **kwargs)
        if float32:
            args, kwargs = cast_arguments(mx.float32, HALF, args, kwargs)
        token = with_dtype(slot, None)
        try:
            out = plain(self, *args, **kwargs)
        finally:
            context.reset(token)
        if not float32:
            return out
        return up(out) if isinstance(out, mx.array) else tree_map(up, out)

    return call


# Calls that swap casts into a layer hold this lock, and so do plain calls of the same
# classes: a layer is never seen half-swapped by another thread. (Graph construction holds
# the GIL anyway; the lock serialises only these classes' calls.)
_swap_lock = threading.RLock()


def _swapping_call(plain: Callable) -> Callable:
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = context.get()
        dtype = None if state is PLAIN else cast("mx.Dtype | None", state[device_index()])
        with _swap_lock:
            if dtype is None:
                return plain(self, *args, **kwargs)
            args, kwargs = cast_arguments(dtype, CASTABLE, args, kwargs)
            with swapped(self, dtype):
                return plain(self, *args, **kwargs)

    return call


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
    :data:`_swap_lock` around it.

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
        cast = castcache.cast(value, self.dtype)
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
