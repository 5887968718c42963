"""Casts of parameters kept across calls, so that repeated inference under autocast does not
cast every weight again on every call.

Under autocast a down-policy layer runs on a view of itself whose parameters are cast to the
compute dtype (:func:`~fluxlike.precision.policy.half_view`), and on the CPU the half
operands of its GEMM or convolution are cast back up to run in float32 kernels
(:mod:`~fluxlike.precision.ops`). Those are two full passes over every weight per call: on
a large MLP they cost more than a third of a float32 forward pass. Here each cast is made
once and reused for as long as its source array is alive and not replaced.

- Keys are array identities. An entry holds its source by weak reference and goes when the
  source goes, so replacing a parameter (``Module.update``, an optimiser step,
  ``load_weights``, plain assignment) retires its casts, and the cache never keeps an old
  weight alive. What it holds while the weights live: the half copy (half the float32
  size) and, on the CPU, the float32 upcast of it.
- Each thread has entries of its own: a cast not evaluated yet belongs to the stream of the
  thread that made it, and another thread cannot evaluate it.
- Nothing is cached while fluxlike differentiates (:func:`~fluxlike.gradient`,
  :func:`~fluxlike.train`): parameters are new arrays on every step there, and the casts
  must stay in the graph. Under ``mx.grad``/``mx.compile`` the parameters are tracers, new
  arrays per trace, so they miss and their entries go with them.
- Activations on the CPU: an output of that kept path can carry its values in float32
  (:func:`remember_float32`, :func:`float32_of`), so that the next layer's float32 kernel
  starts from them and the half-precision copy between the two is never computed. Only
  where no other code can change the array in place (``h += v`` keeps its identity) between
  the two: from one of fluxlike's own layers to the next inside a ``Chain``
  (:func:`hand_over`), and from such a layer's input cast to its kernel.
- MLX arrays are values, but ``w[i] = v`` and ``w += v`` rewrite an array in place, under
  the same identity; the cache cannot see that. Assign a new array instead (``layer.weight
  = layer.weight + v``, as ``Module.update`` and the optimisers do) or call
  :func:`clear_cast_cache` after an in-place change.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..modes import _differentiating


class _Tables:
    """One thread's entries: ``casts``, id(source) -> (weak reference to source, {dtype:
    source.astype(dtype)}); ``views``, id(layer) -> (weak reference to layer, {dtype: (the
    layer's values, arrays by weak reference, and its view)}); a view goes as soon as one of
    the arrays it was made from goes."""

    __slots__ = ("casts", "views", "__weakref__")

    def __init__(self) -> None:
        self.casts: dict[int, tuple[weakref.ref, dict]] = {}
        self.views: dict[int, tuple[weakref.ref, dict]] = {}


_thread = threading.local()
_every: weakref.WeakSet[_Tables] = weakref.WeakSet()  # each live thread's, for clearing


def _tables() -> _Tables:
    """This thread's entries (they go with the thread)."""
    try:
        return _thread.tables
    except AttributeError:
        tables = _thread.tables = _Tables()
        _every.add(tables)
        return tables


def _forget(table: dict, key: int) -> Callable[[weakref.ref], None]:
    def forget(ref: weakref.ref) -> None:
        entry = table.get(key)
        if entry is not None and entry[0] is ref:  # not a newer entry under a reused id
            del table[key]

    return forget


def _entry(table: dict, source: object) -> dict:
    key = id(source)
    entry = table.get(key)
    if entry is None or entry[0]() is not source:
        entry = (weakref.ref(source, _forget(table, key)), {})
        table[key] = entry
    return entry[1]


def cast(source: mx.array, dtype: mx.Dtype) -> mx.array:
    """``source.astype(dtype)``, the same array object on every call while ``source`` lives.

    >>> import mlx.core as mx
    >>> w = mx.ones((2, 2))
    >>> cast(w, mx.bfloat16) is cast(w, mx.bfloat16)
    True
    >>> cast(w, mx.bfloat16).dtype
    mlx.core.bfloat16
    """
    if source.dtype == dtype:
        return source
    if _differentiating.get():
        return source.astype(dtype)
    casts = _entry(_tables().casts, source)
    result = casts.get(dtype)
    if result is None:
        result = casts[dtype] = source.astype(dtype)
    return result


def reused(sources: tuple[mx.array, ...], dtype: mx.Dtype) -> list[mx.array] | None:
    """The casts of ``sources`` to ``dtype`` if every one was cached by an earlier call;
    otherwise ``None``, having cached the missing ones for the next call.

    A hit means each source is an array seen before, so none is a tracer made for the
    transformation (``mx.grad``, ``mx.compile``) now running: the caller may then compute
    with the casts as constants instead of through its custom gradient.

    >>> import mlx.core as mx
    >>> w = mx.ones((2, 2), mx.bfloat16)
    >>> reused((w,), mx.float32) is None
    True
    >>> reused((w,), mx.float32)[0].dtype
    mlx.core.float32
    """
    if _differentiating.get():
        return None
    found = []
    casts = _tables().casts
    for source in sources:
        entry = casts.get(id(source))
        result = None if entry is None or entry[0]() is not source else entry[1].get(dtype)
        if result is None:
            break
        found.append(result)
    else:
        return found
    for source in sources:  # a miss: cache what is missing, for the next call
        cast(source, dtype)
    return None


def view(layer: nn.Module, dtype: mx.Dtype, make: Callable[[], nn.Module]) -> nn.Module:
    """``make()``, a view of ``layer`` in ``dtype``, kept and returned again while the
    layer's parameters and children are the same objects (its other attributes are copied
    onto the kept view on every call, so a mode switch reaches it). Layers holding lists or
    dicts, whose contents could change unseen, get a new view every call.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense
    >>> from fluxlike.precision.policy import half_view
    >>> layer = Dense(2, 3)
    >>> half_view(layer, mx.float16) is half_view(layer, mx.float16)
    True
    >>> layer.weight = mx.zeros((3, 2))
    >>> half_view(layer, mx.float16).weight.tolist()
    [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    """
    if _differentiating.get():
        return make()
    values = tuple(layer.values())
    views = _entry(_tables().views, layer)
    kept = views.get(dtype)
    if kept is not None and len(kept[0]) == len(values) and all(map(_same, kept[0], values)):
        kept[1].__dict__.update(layer.__dict__)
        return kept[1]
    made = make()
    if all(map(_immutable, values)):
        entry: tuple = ()

        def drop(_: weakref.ref) -> None:  # a parameter went: so does the view made from it
            if views.get(dtype) is entry:
                del views[dtype]

        held = tuple(weakref.ref(v, drop) if isinstance(v, mx.array) else v for v in values)
        entry = views[dtype] = (held, made)
    return made


def _same(held: object, value: object) -> bool:
    return (held() if isinstance(held, weakref.ref) else held) is value


def _immutable(value: object) -> bool:
    """Whether a layer's item is seen whole by an identity test: an array, a module, or a
    tuple of plain numbers (``mlx.nn.Conv2d`` keeps its stride and padding as items)."""
    if isinstance(value, (mx.array, nn.Module)):
        return True
    return isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)


# Layer classes whose own code reads their input only through fluxlike's kernels: it neither
# changes the input in place nor shows it to other code first (see ``sealed``).
_SEALED: set[type] = set()
# Whether the layer running now is a sealed one that Chain hands straight to another.
_handing_over: ContextVar[bool] = ContextVar("fluxlike_handing_over", default=False)


def sealed(cls: type) -> type:
    """Class decorator: ``cls`` (exactly, not its subclasses, which may override
    ``__call__``) reads its input only through fluxlike's kernels, so the float32 values
    noted with the input's cast, or with a sealed predecessor's output, stand for it."""
    _SEALED.add(cls)
    return cls


def is_sealed(layer: object) -> bool:
    return type(layer) in _SEALED


def hand_over(layers: Iterable[Any], x: Any) -> Any:
    """``Chain``'s loop under autocast: a sealed layer followed by another sealed layer may
    note its output's float32 values for it, since nothing runs between the two.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, relu, autocast
    >>> with autocast(mx.bfloat16, device="cpu"):
    ...     hand_over([Dense(2, 3, relu), Dense(3, 1)], mx.ones((4, 2))).dtype
    mlx.core.bfloat16
    """
    layers = layers if isinstance(layers, list) else list(layers)
    sealed = [type(layer) in _SEALED for layer in layers] + [False]
    outer = _handing_over.get()
    for i, layer in enumerate(layers):
        pass_on = sealed[i] and sealed[i + 1]
        if pass_on is outer:
            x = layer(x)
            continue
        token = _handing_over.set(pass_on)
        try:
            x = layer(x)
        finally:
            _handing_over.reset(token)
    return x


# id(half array) -> (weak reference to it, its float32 source, the activation applied): outputs
# of the kept inference path, so that the next layer's kernel starts from float32 without a
# cast. The rounded float32 values are made only when asked for. An entry is taken by its
# first use. An unused one keeps its float32 source alive as long as the half array lives (a
# user collecting outputs), so only the newest few are kept.
_shadows: dict[int, tuple[weakref.ref, mx.array, Callable | None]] = {}
SHADOWS = 16


def remember_float32(
    half: mx.array, source: mx.array, act: Callable[[mx.array], mx.array] | None = None
) -> mx.array:
    """Note that ``half`` is ``act(source)`` (``source`` float32) rounded to ``half``'s
    dtype, for :func:`float32_of`; returns ``half``. An unused ``half`` is never computed:
    MLX evaluates only what is asked for. For a layer's output: noted only while
    :func:`hand_over` hands it to the next layer (anywhere else the caller could change it
    in place before the next layer reads it)."""
    return _note(half, source, act) if _handing_over.get() else half


def _note(half: mx.array, source: mx.array, act: Callable | None = None) -> mx.array:
    key = id(half)

    def forget(ref: weakref.ref) -> None:
        if _shadows.get(key, (None,))[0] is ref:
            del _shadows[key]

    _shadows.pop(key, None)
    _shadows[key] = (weakref.ref(half, forget), source, act)
    if len(_shadows) > SHADOWS:
        del _shadows[next(iter(_shadows))]
    return half


@functools.cache
def round_in_float32(
    dtype: mx.Dtype, act: Callable[[mx.array], mx.array] | None = None
) -> Callable[[mx.array], mx.array]:
    """``act`` (if any) then the rounding to ``dtype``, kept in float32: one fused kernel."""
    if act is None:
        return mx.compile(lambda y: y.astype(dtype).astype(mx.float32), shapeless=True)
    return mx.compile(lambda y: act(y).astype(dtype).astype(mx.float32), shapeless=True)


def cast_input(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """``x.astype(dtype)`` for a sealed layer's input under autocast; on the CPU a float32
    ``x`` also gets its rounded values noted in float32, for the layer's float32 kernel."""
    half = x.astype(dtype)
    if x.dtype == mx.float32 and mx.default_device().type is mx.cpu and (
        not _differentiating.get()
    ):
        _note(half, x)
    return half


def float32_of(half: mx.array) -> mx.array:
    """``half.astype(mx.float32)``; for a ``half`` noted by :func:`remember_float32`, the
    same values made from its float32 source in one fused pass (``half`` itself need never
    be computed).

    >>> import mlx.core as mx
    >>> source = mx.array([1.00390625, -2.0])
    >>> half = _note(source.astype(mx.bfloat16), source)
    >>> float32_of(half).tolist(), float32_of(half).dtype
    ([1.0, -2.0], mlx.core.float32)
    """
    entry = _shadows.pop(id(half), None)
    if entry is not None and entry[0]() is half:
        return round_in_float32(half.dtype, entry[2])(entry[1])
    return half.astype(mx.float32)


def clear_cast_cache() -> None:
    """Drop every cached cast (after changing a parameter in place, ``w[i] = v`` or
    ``w += v``, which keeps the array's identity).

    >>> import mlx.core as mx
    >>> w = mx.ones(2)
    >>> before = cast(w, mx.float16)
    >>> clear_cast_cache()
    >>> cast(w, mx.float16) is before
    False
    """
    for tables in list(_every):
        tables.casts.clear()
        tables.views.clear()
    _shadows.clear()


def cached() -> int:
    """How many arrays and layers have cached casts and views in this thread (for tests and
    diagnostics)."""
    tables = _tables()
    return len(tables.casts) + len(tables.views)
