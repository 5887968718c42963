"""Gradients, as in Flux: ``gradient`` and ``withgradient``.

Gradients are taken with respect to every model (``mlx.nn.Module``) and every floating
``mx.array`` argument of the loss, through ``mx.value_and_grad``. While the loss runs,
Dropout and BatchNorm are in training mode (:func:`fluxlike.modes.differentiating`), and with
``autocast=`` it runs inside :func:`~fluxlike.autocast`: the model computes in half precision,
its float32 master weights receive float32 gradients, and the optimiser never sees a half
precision array.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map, tree_map_with_path

from ._mlxtyping import tree_flatten
from .modes import differentiating
from .precision import lossscale
from .precision.lossscale import LossScale
from .precision.scope import autocast as autocast_scope

AUTOCAST_DTYPES = (mx.float16, mx.bfloat16)


def _check_autocast(value: Any, where: str) -> mx.Dtype | None:
    if value is None or (isinstance(value, mx.Dtype) and value in AUTOCAST_DTYPES):
        return value
    raise ValueError(
        f"{where}: autocast must be None, mx.float16 or mx.bfloat16, got {value!r}"
    )


def _split_output(out: Any, where: str, args: tuple = ()) -> tuple[mx.array, Any]:
    """``(loss, rest)`` of what the loss function returned; ``rest`` is ``None`` for a bare
    loss, else the other elements of a tuple ``(loss, aux...)``. ``args``: the arguments it
    was given, for the error's hint (a number or NumPy array passed is not differentiated)."""
    loss, rest = (out[0], out[1:]) if isinstance(out, tuple) and out else (out, None)
    if not isinstance(loss, mx.array):
        plain = [f"argument {i + 1} is a {type(a).__name__}" for i, a in enumerate(args)
                 if isinstance(a, (float, np.floating, np.ndarray))]
        hint = (f" ({', '.join(plain)}, passed as it is and not differentiated: wrap it in "
                f"mx.array)" if plain else "")
        raise TypeError(
            f"{where}: the function must return a scalar mx.array (the loss), "
            f"got {type(loss).__name__}{hint}"
        )
    if loss.size != 1 or not mx.issubdtype(loss.dtype, mx.floating):
        raise ValueError(
            f"{where}: the function must return a floating scalar (the loss), "
            f"got shape {tuple(loss.shape)} and dtype {loss.dtype}"
        )
    if loss.ndim:
        loss = loss.reshape(())  # (a graph node less for a loss already a scalar)
    if loss.dtype in AUTOCAST_DTYPES:
        loss = loss.astype(mx.float32)
    return loss, rest


_valid = nn.Module.valid_parameter_filter
_trainable = nn.Module.trainable_parameter_filter


def _trainable_parameters(module: nn.Module, leaves: list | None = None) -> tuple[dict, bool]:
    """``(module.trainable_parameters(), whether any parameter is frozen)`` in one walk of
    the module tree, with ``mlx.nn``'s filters (``withgradient`` runs on every step; a model
    without frozen entries then needs no ``parameters()`` walk). ``leaves``, a list, receives
    ``(id(owning module), path in it, shape, dtype)`` of each trainable array, in order: what
    identifies the tree for :mod:`fluxlike.eagerstep`."""
    frozen = False

    def walk(owner: nn.Module, key: str, value: Any) -> Any:
        # mlx.nn's trainable_parameter_filter and the dtype test inline, and the paths made
        # only inside containers: this walk runs on every step
        nonlocal frozen
        entries: Iterable[tuple[Any, Any]]
        if isinstance(value, nn.Module):
            owner, entries, prefix = value, value.items(), None
        elif isinstance(value, (dict, list)):
            entries = value.items() if isinstance(value, dict) else enumerate(value)
            prefix = f"{key}."
        else:
            return value
        out: dict[Any, Any] = {}
        no_grad = owner._no_grad
        for k, v in entries:
            path: str = k if prefix is None else f"{prefix}{k}"  # type: ignore[assignment]
            if isinstance(v, mx.array):
                if (dtype := v.dtype) in _INEXACT and path[:1] != "_" and path not in no_grad:
                    out[k] = v
                    if leaves is not None:
                        leaves.append((id(owner), path, v.shape, dtype))
                    continue
            elif isinstance(v, (dict, list)) and path[:1] != "_" and path not in no_grad:
                out[k] = walk(owner, path, v)
                continue
            frozen = frozen or _valid(owner, path, v)
            if owner is not value:  # in a dict or list, as filter_and_map: a placeholder
                out[k] = {}
        return list(out.values()) if isinstance(value, list) else out

    return walk(module, "", module), frozen


# Only floating arrays are trained: integer and boolean ones (indices, masks) are state, as in
# Flux; mx.value_and_grad cannot differentiate some of them, and an optimiser step would turn
# them into floats.
_INEXACT = frozenset(t for t in vars(mx).values()
                     if isinstance(t, mx.Dtype) and mx.issubdtype(t, mx.inexact))


def _has_array(tree: Any) -> bool:
    """Whether the nested dicts/lists ``tree`` hold an array (stops at the first)."""
    if isinstance(tree, mx.array):
        return True
    if isinstance(tree, (dict, list)):
        return any(map(_has_array, tree.values() if isinstance(tree, dict) else tree))
    return False


def _floating(value: Any) -> bool:
    return isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating)


def _differentiable(value: Any) -> bool:
    """A floating array, or a list, tuple or dict holding one (not a model: ``nn.Module``
    is a dict, and models are differentiated on their own)."""
    if isinstance(value, nn.Module):
        return False
    if isinstance(value, (list, tuple, dict)):
        return any(_floating(v) for _, v in tree_flatten(value))
    return _floating(value)


def _floating_leaves(tree: Any) -> list[mx.array]:
    return [v for _, v in tree_flatten(tree) if _floating(v)]


def _refill(tree: Any, values: list, other: Any = ...) -> Any:
    """``tree`` with its floating arrays replaced, in order, by ``values``, and its other
    leaves by ``other`` (kept as they are by default)."""
    it = iter(values)
    return tree_map(lambda v: next(it) if _floating(v) else (v if other is ... else other), tree)


def _floating_or_tree(value: Any) -> bool:
    """Not an integer or boolean array."""
    return not isinstance(value, mx.array) or value.dtype in _INEXACT


def _distinct(modules: list[nn.Module], where: str) -> None:
    """Refuse a model argument that is part of another one: both would be differentiated
    through one set of parameters, and one would get the other's gradient."""
    for i, outer in enumerate(modules):
        inner = {id(m) for _, m in outer.named_modules()} - {id(outer)}
        for j, other in enumerate(modules):
            if i != j and id(other) in inner:
                raise ValueError(
                    f"{where}: model argument {j + 1} is a part of model argument {i + 1}; "
                    f"pass the whole model once (its gradient includes that part's)"
                )


def _holds_module(tree: list | tuple | dict, depth: int = 0) -> bool:
    """Whether a model lies inside the plain containers ``tree`` (not looking inside
    models: ``nn.Module`` is a dict)."""
    for v in tree.values() if isinstance(tree, dict) else tree:
        if isinstance(v, nn.Module):
            return True
        if isinstance(v, (list, tuple, dict)) and depth < 8 and _holds_module(v, depth + 1):
            return True
    return False


def _value_and_grad(
    f: Callable,
    args: tuple,
    dtype: mx.Dtype | None,
    scale: LossScale,
    where: str,
    wrt_arrays: bool = True,
    fresh_state: list | None = None,
) -> tuple[Any, tuple]:
    """The engine of :func:`withgradient`; ``scale`` multiplies the loss before it is
    differentiated (the value returned is the unscaled loss); ``wrt_arrays=False`` takes
    gradients for the modules only (array arguments get ``None``). ``fresh_state``, a list,
    receives ``(module, parameters before, {path: new frozen entry})`` for each module whose
    frozen entries (running statistics) the call changed, which are then left for the caller
    to evaluate (or put back: :func:`fluxlike.trainstep` after a skipped step)."""
    if not callable(f):
        raise TypeError(f"{where}: expected a callable loss function first, got {f!r}")
    modules: list[nn.Module] = []  # each module once, in order of first appearance
    for i, a in enumerate(args):
        if isinstance(a, nn.Module):
            if not any(a is m for m in modules):
                modules.append(a)
        elif isinstance(a, (list, tuple, dict)) and _holds_module(a):
            raise TypeError(
                f"{where}: argument {i + 1} is a {type(a).__name__} holding a model, which "
                f"would get no gradient; pass models as separate arguments "
                f"(gradient(f, m1, m2), not gradient(f, [m1, m2]))"
            )
    if len(modules) > 1:
        _distinct(modules, where)
    # Floating arrays are differentiated, alone or in lists, tuples and dicts (as Zygote does):
    # for a container, the primal is the list of its floating arrays.
    arrays = [i for i, a in enumerate(args) if wrt_arrays and _differentiable(a)]
    primals = [args[i] if isinstance(args[i], mx.array) else _floating_leaves(args[i])
               for i in arrays]
    walked = [_trainable_parameters(m) for m in modules]
    trainable, has_frozen = [t for t, _ in walked], [has for _, has in walked]
    # Modules with frozen entries (running statistics...) keep all their parameters to be
    # restored; for the others the trainable ones are all of them.
    originals = [m.parameters() if has else t
                 for m, t, has in zip(modules, trainable, has_frozen, strict=True)]
    trainable_keys = [{k for k, _ in tree_flatten(t)} if has else set()
                      for t, has in zip(trainable, has_frozen, strict=True)]

    def frozen(m: nn.Module, keys: set[str], has: bool) -> list[tuple[str, mx.array]]:
        return [(k, v) for k, v in tree_flatten(m.parameters()) if k not in keys] if has else []

    def inner(primals: tuple[list, list]) -> tuple[mx.array, tuple]:
        params, xs = primals
        for m, p in zip(modules, params, strict=True):
            m.update(p)
        call = list(args)
        for i, x in zip(arrays, xs, strict=True):
            call[i] = x if isinstance(x, mx.array) else _refill(args[i], x)
        out = f(*call)
        loss, rest = _split_output(out, where, args)
        # Running statistics (BatchNorm) are frozen parameters: return them as outputs so
        # they come out of the transform as ordinary arrays.
        state = [frozen(*entry) for entry in zip(modules, trainable_keys, has_frozen,
                                                 strict=True)]
        scaled = scale.scale(loss)
        return scaled, (loss, rest, state)

    # Train mode and the scope hold for the whole transform, not only while ``f`` runs: MLX
    # runs checkpointed blocks (mx.checkpoint) again while it builds the backward pass.
    scope = nullcontext() if dtype is None else autocast_scope(dtype)
    try:
        with differentiating(), scope:
            if arrays or any(map(_has_array, trainable)):
                (_, (loss, rest, state)), (g_params, g_arrays) = mx.value_and_grad(inner)(
                    (trainable, primals)
                )
            else:  # nothing to differentiate: no gradient arrays (MLX's grad would refuse)
                (_, (loss, rest, state)), g_params, g_arrays = inner((trainable, [])), trainable, []
    except BaseException:
        for m, p in zip(modules, originals, strict=True):
            m.update(p)
        raise
    for m, p, new in zip(modules, originals, state, strict=True):
        # Trainable entries back to the original arrays (no tracer stays in the model),
        # frozen entries to their values after the call.
        m.update(tree_map_with_path(lambda k, v, new=dict(new): new.get(k, v), p) if new else p)
    if fresh_state is not None:
        fresh_state.extend((m, p, dict(new)) for m, p, new in zip(modules, originals, state,
                                                                  strict=True) if new)
    fresh = [v for entry in state for _, v in entry] if fresh_state is None else []
    if fresh:
        # New running statistics feed no loss: left unevaluated, each step's would build on
        # the last, and every later gradient would walk the whole chain (a loop that reads
        # only the loss got slower step by step).
        try:
            mx.async_eval(fresh)
        except (ValueError, RuntimeError):  # inside a transformation (mx.compile, as in
            pass  # train(compile=True)), which refuses evaluation: its caller evaluates
    by_module = {id(m): g for m, g in zip(modules, g_params, strict=True)}
    by_index = {i: g if isinstance(g, mx.array) else _refill(args[i], g, None)
                for i, g in zip(arrays, g_arrays, strict=True)}
    grads = tuple(
        by_module[id(a)] if isinstance(a, nn.Module) else by_index.get(i)
        for i, a in enumerate(args)
    )
    value = loss if rest is None else (loss, *rest)
    return value, grads


def withgradient(
    f: Callable, *args: Any, autocast: mx.Dtype | None = None, loss_scale: Any = None
) -> tuple[Any, tuple]:
    """``(f(*args), gradient(f, *args))`` from one evaluation, as in Flux.

    ``f`` returns a scalar loss, or a tuple ``(loss, aux...)`` whose first element is
    differentiated (the value is then the whole tuple). A half-precision loss is returned
    as float32. See :func:`gradient` for the gradients, ``autocast`` and ``loss_scale``.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, withgradient
    >>> model = Dense(2, 1)
    >>> loss, (g,) = withgradient(lambda m: m(mx.ones((4, 2))).sum(), model,
    ...                           autocast=mx.bfloat16)
    >>> loss.dtype, g["weight"].dtype, g["weight"].shape
    (mlx.core.float32, mlx.core.float32, (1, 2))
    """
    return _withgradient(f, args, autocast, loss_scale, "withgradient")


def _withgradient(f: Callable, args: tuple, autocast: Any, loss_scale: Any,
                  where: str) -> tuple[Any, tuple]:
    return _value_and_grad(f, args, _check_autocast(autocast, where),
                           lossscale.resolve(loss_scale, where), where)


def gradient(
    f: Callable, *args: Any, autocast: mx.Dtype | None = None, loss_scale: Any = None
) -> tuple:
    """The gradient of the scalar ``f(*args)`` with respect to each argument, as in Flux.

    Returns a tuple with one entry per argument: for a model (an ``mlx.nn.Module``) a
    nested dict shaped like ``model.trainable_parameters()``; for a floating ``mx.array``
    an array of its shape; for a list, tuple or dict holding floating arrays (an LSTM's
    ``(h, c)``), the same container with their gradients and ``None`` for its other
    entries; for anything else (integer arrays, numbers, functions) ``None``.

    While ``f`` runs (and while MLX re-runs checkpointed blocks for the backward pass),
    fluxlike's Dropout and BatchNorm are in training mode (``mlx.nn``'s follow
    ``model.train()``/``model.eval()``); BatchNorm's running statistics are updated in the
    model, its trainable parameters are left as they were.

    ``autocast`` (``None``, ``mx.float16`` or ``mx.bfloat16``) runs ``f`` inside
    ``fluxlike.autocast(autocast)`` on the default device. The gradients are float32 all
    the same (master weights stay float32), with the same structure as without autocast.

    ``loss_scale`` (``None`` for none, a number, or a loss-scale object such as
    ``opt_state.loss_scale``) multiplies the loss before it is differentiated, so that
    float16 gradients do not underflow: the gradients are those of the scaled loss, which
    is what :func:`update` expects when ``opt_state`` has a loss scale (it divides them by
    it). :func:`train` does this by itself.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, gradient
    >>> model = Dense(3, 2)
    >>> x = mx.ones((5, 3))
    >>> g_model, g_x, g_n = gradient(lambda m, x, n: (m(x) ** 2).sum() * n, model, x, 2)
    >>> sorted(g_model), g_model["weight"].shape, g_x.shape, g_n
    (['bias', 'weight'], (2, 3), (5, 3), None)
    >>> gradient(lambda x: (x ** 2).sum(), mx.array([1.0, 2.0]))
    (array([2, 4], dtype=float32),)
    """
    return _withgradient(f, args, autocast, loss_scale, "gradient")[1]
