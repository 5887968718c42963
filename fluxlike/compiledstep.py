"""The whole training step as one ``mx.compile``-d function: :func:`fluxlike.trainstep` and
:func:`fluxlike.train` with ``compile=True``.

Forward, backward, loss scaling, the finite check and the rule are traced once per key and
replayed by MLX (one C++ call, which also writes the captured model, optimiser, loss-scale
and random state: a step is all or nothing). The functions live in the :class:`Compiled`
record of their :class:`~fluxlike.OptState` (a weak-keyed table), so they are reused across
calls and epochs and freed with the optimiser state, and with it the model they captured.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import FunctionType, MethodType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import native
from ._mlxtyping import tree_flatten
from .gradients import _trainable_parameters, _value_and_grad
from .optimisers.compiled import (
    _PLAIN,
    COMPILED,
    Compiled,
    _Same,
    _settings,
    assign,
    averager,
    init_missing,
    step,
    uninterrupted,
)
from .optimisers.state import OptState, _check_grads, _check_same_model
from .precision import state as precision_state

LIMIT = 8  # whole steps kept per OptState; the oldest is dropped (and traced again if needed)


def _batch_key(value: Any) -> Any:
    """What a trace bakes in of one batch argument: arrays' shapes and dtypes, other values
    themselves (by identity when unhashable)."""
    if isinstance(value, mx.array):
        return value.shape, value.dtype
    if isinstance(value, (list, tuple)):
        return (type(value), *map(_batch_key, value))
    if isinstance(value, dict):
        return (dict, *((k, _batch_key(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return _Same(value)
    return type(value), value


def _loss_key(loss: Callable) -> Any:
    """What identifies a loss function for a trace: a Python function by its code and what
    its closure cells and defaults hold (so that ``trainstep(lambda m, x, y: ..., ...)``
    written inside a loop, a new function object each time, still finds its trace, and a cell
    rebound to another object, whose value the trace baked in, does not), a bound method by
    its function and object, anything else by identity. Objects are held weakly where they
    can be: the key lives as long as the optimiser state, and a loss that refers back to that
    state (a trainer's bound method, a default argument) must not keep it alive."""
    if isinstance(loss, FunctionType):
        cells = tuple(_held(c) for c in loss.__closure__ or ())
        defaults = (*(loss.__defaults__ or ()), *(loss.__kwdefaults__ or {}).values())
        return (_Same(loss.__code__), _Same(loss.__globals__), cells,
                tuple(map(_identity, defaults)))  # (a default array is baked in: identity)
    if isinstance(loss, MethodType):
        return _loss_key(loss.__func__), _identity(loss.__self__)
    return _identity(loss)


class _Weakly:
    """Compares equal only to a wrapper of the same object while it lives (a dead one equals
    nothing), without keeping it alive."""

    __slots__ = ("key", "ref")

    def __init__(self, obj: Any):
        self.ref, self.key = weakref.ref(obj), id(obj)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Weakly) or other.key != self.key:
            return False
        obj = self.ref()
        return obj is not None and obj is other.ref()

    def __hash__(self) -> int:
        return self.key


def _identity(value: Any) -> Any:
    """``value`` as a key: a plain value itself, an object by identity (weakly where it can
    be)."""
    if type(value) in _PLAIN:
        return value
    try:
        return _Weakly(value)
    except TypeError:
        return _Same(value)


def _held(cell: Any) -> Any:
    """What a closure cell holds, as a key (an empty cell: its own marker)."""
    try:
        return _identity(cell.cell_contents)
    except ValueError:
        return _EMPTY


_EMPTY = object()


def _structure(model: nn.Module) -> tuple:
    """The model's modules, their train/eval mode and frozen names: a trace bakes them in.
    (A walk of modules only, not of arrays: this runs on every step; ``model.modules()``
    took several times as long.)"""
    out = []
    stack: list[Any] = [model]
    while stack:
        value = stack.pop()
        if isinstance(value, nn.Module):
            frozen = value._no_grad
            out.append((id(value), value._training, frozenset(frozen) if frozen else None))
        for v in value.values() if isinstance(value, dict) else value:
            if isinstance(v, (dict, list)):  # (a module is a dict)
                stack.append(v)
    return tuple(out)


def _whole(current: list, model: nn.Module, opt_state: OptState, dtype: mx.Dtype | None,
           where: str, with_grads: bool) -> Callable:
    """The step to trace, of the loss ``current[0]`` (set for each call and cleared after:
    the function is kept with the optimiser state, and must not keep a loss that refers back
    to that state alive). It returns only what the caller reads (each output of a compiled
    function costs its call a little): not the new parameters (the captured model holds
    them), the gradients only ``with_grads``."""
    optimizer, scale, parallel = opt_state.optimizer, opt_state.loss_scale, opt_state.distributed
    average = averager(opt_state)

    def whole(*args: Any) -> tuple:
        before = model.parameters()  # the inputs: returned, so a skipped step can be undone
        fresh: list = []
        value, (g, *_) = _value_and_grad(current[0], (model, *args), dtype, scale, where,
                                         wrt_arrays=False, fresh_state=fresh)
        value = value[0] if isinstance(value, tuple) else value
        if parallel is not None:  # the group's mean: every rank decides alike
            value = parallel.mean(value)
        params = _trainable_parameters(model)[0]
        new_params, finite, grads, state_before = step(optimizer, scale, g, params, average,
                                                       keep=False)
        model.update(new_params)
        statistics = [v for _, _, new in fresh for v in new.values()]
        return value, finite, grads if with_grads else None, statistics, before, state_before

    return whole


def compiled_step(loss: Callable, model: nn.Module, args: tuple, opt_state: OptState,
                  dtype: mx.Dtype | None, where: str, with_grads: bool = False) -> tuple | None:
    """The step through the compiled function for its key (traced first if new):
    ``(loss, finite, grads, new parameters, new running statistics, the model's parameters
    before, the optimiser state before)``, arrays not yet evaluated (a non-finite step is
    taken: the caller undoes it); ``grads`` is ``None`` unless ``with_grads``, and the new
    parameters are the model's state (a tree to evaluate). ``None`` when this optimiser
    cannot be captured (then nothing has changed: take the step eagerly)."""
    optimizer, scale = opt_state.optimizer, opt_state.loss_scale
    live = optimizer.state
    compiled = COMPILED.get(opt_state) or COMPILED.setdefault(opt_state, Compiled())
    settings = (_settings(optimizer), _settings(scale))
    key = (_loss_key(loss), tuple(map(_batch_key, args)), dtype, precision_state.context.get(),
           _Same(optimizer), _Same(scale), id(live), id(scale.state), settings,
           native.available(), with_grads, _structure(model))
    entry = compiled.whole.get(key)
    if entry is not None:
        entry[1][0] = loss
        try:
            out = entry[0](*args)  # one C++ call: the captured state is written all at once
        finally:
            entry[1][0] = None
        _sync_statistics(opt_state, model)
        return _with_parameters(out, model)
    if compiled.eager is not None or live is not optimizer.state:
        return None  # an optimiser that must run eagerly (see fluxlike.update)
    params = _trainable_parameters(model)[0]
    signature, params, _ = _check_grads(params, model, where)  # parameters stand for grads
    if signature not in compiled.initialised:
        _check_same_model(opt_state, signature, False, where)
        init_missing(optimizer, params, where)
        _check_same_model(opt_state, signature, True, where)
        compiled.initialised.add(signature)
    captured = [model.state, live, scale.state, mx.random.state]
    before = (model.parameters(), dict(tree_flatten(live)), dict(scale.state))
    current: list = [loss]
    fn = mx.compile(_whole(current, model, opt_state, dtype, where, with_grads),
                    inputs=captured, outputs=captured)
    with uninterrupted():
        try:
            out = fn(*args)
        except BaseException:
            # A trace that raised leaves mx.compile's placeholders in everything captured
            # (see fluxlike.workarounds): put the arrays of before the step back.
            model.update(before[0])
            assign(live, before[1], prune=True)
            scale.state.update(before[2])
            compiled.initialised.clear()  # state made for thawed parts may be gone
            raise
        finally:
            current[0] = None
    if settings == (_settings(optimizer), _settings(scale)):  # else: replays would differ
        if len(compiled.whole) >= LIMIT:
            del compiled.whole[next(iter(compiled.whole))]
        compiled.whole[key] = (fn, current)
    _sync_statistics(opt_state, model)
    return _with_parameters(out, model)


def _with_parameters(out: tuple, model: nn.Module) -> tuple:
    value, finite, grads, *rest = out
    return value, finite, grads, model.state, *rest


def _sync_statistics(opt_state: OptState, model: nn.Module) -> None:
    if opt_state.distributed is not None:
        opt_state.distributed.sync_statistics(model)
