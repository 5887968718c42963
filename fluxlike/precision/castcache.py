"""Casts of parameters kept across calls, so that repeated inference under autocast does not
cast every weight again on every call.

Under autocast the down-policy kernels cast each weight to the compute dtype, and on the CPU
the half operands of a GEMM or convolution are cast back up to run in float32 kernels
(:mod:`~fluxlike.precision.emulation`): two full passes over every weight per call. Here each cast
is made once and reused for as long as its source array is alive and not replaced.

- Keys are array identities. An entry holds its source by weak reference and goes when the
  source goes, so replacing a parameter (``Module.update``, an optimiser step,
  ``load_weights``, plain assignment) retires its casts, and the cache never keeps an old
  weight alive. What it holds while the weights live: the half copy and, on the CPU, the
  float32 upcast of it.
- Each thread has entries of its own: a cast not evaluated yet belongs to the stream of the
  thread that made it, and another thread cannot evaluate it.
- While fluxlike differentiates (:func:`~fluxlike.gradient`, :func:`~fluxlike.train`) and
  under ``mx.grad``/``mx.compile`` the parameters are the transformation's arrays, new at
  every step or trace: their casts serve that step only (a layer applied several times, a
  recurrent layer's time steps) and go with them. The float32 values of the half casts
  (:func:`casts_if_seen`, :func:`rounded_f32_if_seen`) are never kept for them: computed as
  constants, they would hold float32 copies for the backward pass.
- MLX arrays are values, but ``w[i] = v`` and ``w += v`` rewrite an array in place, under
  the same identity; the cache cannot see that. Assign a new array instead (``layer.weight
  = layer.weight + v``, as ``Module.update`` and the optimisers do) or call
  :func:`clear_cast_cache` after an in-place change.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import mlx.core as mx

from ..native import _loader
from .state import context

_CONVERTED = frozenset((mx.float32, mx.bfloat16, mx.float16))
_switch = _loader.switch  # .ext read per call: the companion's module, or None


def convert(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """``x.astype(dtype)``, the same bits, through the native companion's vectorised pass
    (``fluxlike_native.convert``) for casts between float32, bfloat16 and float16 on the CPU:
    MLX's CPU casts to and from float16 convert one value at a time (on an AVX2 EPYC, 800,000
    values narrowed in 1.95 ms and widened in 1.12, against 0.14 and 0.14; bfloat16's 0.33
    and 0.14 against 0.15 and 0.10). MLX's ``astype`` elsewhere.

    >>> import mlx.core as mx
    >>> convert(mx.array([1.0, 2.5]), mx.float16)
    array([1, 2.5], dtype=float16)
    """
    source = x.dtype
    if source == dtype:
        return x
    ext = _switch.ext  # (read once: another thread may enter native.disabled() meanwhile)
    if (ext is not None and source in _CONVERTED and dtype in _CONVERTED
            and mx.default_device().type is mx.cpu):
        return ext.convert(x, dtype)
    return x.astype(dtype)


# One thread's entries: id(source) -> (weak reference to source, {dtype: source.astype(dtype)}).
_Table = dict[int, tuple[weakref.ref, dict[mx.Dtype, mx.array]]]
_thread = threading.local()
_every: list[weakref.ref] = []  # each live thread's table, for clearing
_every_lock = threading.Lock()


class _Casts(_Table):
    """A thread's table (a dict subclass: plain dicts take no weak references)."""


def _table() -> _Casts:
    """This thread's entries (they go with the thread)."""
    try:
        return _thread.casts
    except AttributeError:
        table = _thread.casts = _Casts()
        with _every_lock:
            _every[:] = [ref for ref in _every if ref() is not None]
            _every.append(weakref.ref(table))
        return table


def _forget(table: dict, key: int) -> Callable[[weakref.ref], None]:
    def forget(ref: weakref.ref) -> None:
        entry = table.get(key)
        if entry is not None and entry[0] is ref:  # not a newer entry under a reused id
            del table[key]

    return forget


def _casts(source: mx.array) -> dict:
    """This thread's casts of ``source`` (an empty table the first time): dtype (or
    ``(half dtype, float32)``) to array."""
    try:
        table = _thread.casts
    except AttributeError:
        table = _table()
    key = id(source)
    entry = table.get(key)
    if entry is None or entry[0]() is not source:
        entry = table[key] = (weakref.ref(source, _forget(table, key)), {})
    return entry[1]


def cached_cast(source: mx.array, dtype: mx.Dtype) -> mx.array:
    """``source.astype(dtype)``, the same array object on every call while ``source`` lives.
    While fluxlike differentiates, the parameters are the transformation's own arrays, new at
    every step: their casts are kept for that step (a recurrent layer's weights are cast once
    per sequence, not at every time step) and go with them.

    >>> import mlx.core as mx
    >>> w = mx.ones((2, 2))
    >>> cached_cast(w, mx.bfloat16) is cached_cast(w, mx.bfloat16)
    True
    >>> cached_cast(w, mx.bfloat16).dtype
    mlx.core.bfloat16
    """
    if source.dtype == dtype:
        return source
    casts = _casts(source)
    result = casts.get(dtype)
    if result is None:
        result = casts[dtype] = convert(source, dtype)
    return result


def casts_if_seen(sources: tuple[mx.array, ...], dtype: mx.Dtype) -> list[mx.array] | None:
    """The casts of ``sources`` to ``dtype`` (a source of that dtype: itself) if an earlier
    call made every one; otherwise ``None``, having made the missing ones for the next call,
    and ``None`` while fluxlike differentiates.

    A hit means each source is an array seen before, so none is a tracer made for the
    transformation (``mx.grad``, ``mx.compile``) now running: the caller may then compute
    with the casts as constants instead of through its custom gradient. (Except for a layer
    applied twice inside one plain ``mx.grad`` trace, which fluxlike cannot see: its second
    application hits its first one's tracer. The casts are then ops of the trace, and the
    gradients flow through them in float32: see the README on plain ``mx.grad``.)

    >>> import mlx.core as mx
    >>> w = mx.ones((2, 2), mx.bfloat16)
    >>> casts_if_seen((w,), mx.float32) is None
    True
    >>> casts_if_seen((w,), mx.float32)[0].dtype
    mlx.core.float32
    """
    if context.get().differentiating:
        return None
    try:
        table = _thread.casts
    except AttributeError:
        table = _table()
    found: list[mx.array] = []
    for source in sources:  # _casts(source).get(dtype), inline: every layer call
        if source.dtype == dtype:
            found.append(source)
            continue
        entry = table.get(id(source))
        result = None if entry is None or entry[0]() is not source else entry[1].get(dtype)
        if result is None:
            break
        found.append(result)
    else:
        return found
    for source in sources:  # a miss: cache what is missing, for the next call
        cached_cast(source, dtype)
    return None


_PACKED = "packed"  # the key of a weight's packed layout among its casts
_UNPACKED = mx.array([], mx.uint8)  # (kept where the weight has no packed layout)


def packed_weights(source: mx.array, half: mx.array) -> mx.array | None:
    """The native companion's packed layout of ``half`` (``source``'s bfloat16 weights, as
    :func:`casts_if_seen` keeps them) for ``fluxlike_native.packed_linear``: reordered once
    into the layout oneDNN's kernel prefers and kept with ``source``'s casts, for as long as
    they are (on an Intel Xeon with AMX a 512 x 2048 x 2048 product 2.6 -> 2.1 ms). ``None``
    where there is none (no companion, no bfloat16 kernel, or the kernel's own layout is the
    plain one). For inference only: call it after a hit of :func:`casts_if_seen` for float32
    weights (a hit means they are not a tracer). It holds one more bfloat16 copy of the
    weights, and like the casts it cannot see an in-place change (``w *= 2``)."""
    casts = _casts(source)
    packed = casts.get(_PACKED)
    if packed is None:
        ext = _switch.ext
        made = ext.pack_weights(half) if ext is not None else None
        packed = casts[_PACKED] = _UNPACKED if made is None else made
    return None if packed is _UNPACKED else packed


def rounded_f32_if_seen(sources: tuple[mx.array, ...], dtype: mx.Dtype
                        ) -> list[mx.array] | None:
    """``[s.astype(dtype).astype(mx.float32) for s in sources]`` (the values rounded to the
    half ``dtype``, held in float32, for a float32 kernel that computes half precision's
    numerics) if an earlier call made every one; otherwise ``None``, having made them for the
    next call. As with :func:`casts_if_seen`, a hit means no source is a tracer.

    >>> import mlx.core as mx
    >>> w = mx.array([1.00390625])
    >>> rounded_f32_if_seen((w,), mx.bfloat16) is None
    True
    >>> kept = rounded_f32_if_seen((w,), mx.bfloat16)
    >>> kept[0].tolist(), kept[0].dtype
    ([1.0], mlx.core.float32)
    """
    if context.get().differentiating:
        return None
    found: list[mx.array] = []
    missed = False
    for source in sources:
        casts = _casts(source)
        result = casts.get((dtype, mx.float32))
        if result is None:
            half = source if source.dtype == dtype else casts.get(dtype)
            if half is None:
                half = casts[dtype] = convert(source, dtype)
            casts[(dtype, mx.float32)] = convert(half, mx.float32)
            missed = True
        else:
            found.append(result)
    return None if missed else found


def clear_cast_cache() -> None:
    """Drop every cached cast (after changing a parameter in place, ``w[i] = v`` or
    ``w += v``, which keeps the array's identity).

    >>> import mlx.core as mx
    >>> w = mx.ones(2)
    >>> before = cached_cast(w, mx.float16)
    >>> clear_cast_cache()
    >>> cached_cast(w, mx.float16) is before
    False
    """
    with _every_lock:
        tables = [ref() for ref in _every]
    for table in tables:
        if table is not None:
            table.clear()


def cached() -> int:
    """How many arrays have cached casts in this thread (for tests and diagnostics)."""
    return len(_table())
