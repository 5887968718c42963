"""Training, as in Flux: ``gradient``, ``withgradient``, ``setup``, ``update``, ``train``.

Gradients are taken with respect to every model (``mlx.nn.Module``) and every floating
``mx.array`` argument of the loss, through ``mx.value_and_grad``. While the loss runs,
Dropout and BatchNorm are in training mode (:func:`fluxlike.modes.differentiating`), and with
``autocast=`` it runs inside :func:`~fluxlike.autocast`: the model computes in half precision,
its float32 master weights receive float32 gradients, and the optimiser never sees a half
precision array.

Float16 gradients underflow, so ``train(..., autocast=mx.float16)`` scales the loss with a
:class:`~fluxlike.DynamicLossScale` by default; the scale lives in ``opt_state.loss_scale``,
so it carries over from one ``train`` call to the next and into checkpoints.
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from .modes import differentiating
from .optimise import Rule
from .optstep import COMPILED, Compiled, assign, init_missing, step
from .precision import lossscale
from .precision.lossscale import DynamicLossScale, LossScale
from .precision.scope import autocast as autocast_scope

AUTOCAST_DTYPES = (mx.float16, mx.bfloat16)


def _check_autocast(value: Any, where: str) -> mx.Dtype | None:
    if value is None or (isinstance(value, mx.Dtype) and value in AUTOCAST_DTYPES):
        return value
    raise ValueError(
        f"{where}: autocast must be None, mx.float16 or mx.bfloat16, got {value!r}"
    )


def _split_output(out: Any, where: str) -> tuple[mx.array, Any]:
    """``(loss, rest)`` of what the loss function returned; ``rest`` is ``None`` for a bare
    loss, else the other elements of a tuple ``(loss, aux...)``."""
    loss, rest = (out[0], out[1:]) if isinstance(out, tuple) and out else (out, None)
    if not isinstance(loss, mx.array):
        raise TypeError(
            f"{where}: the function must return a scalar mx.array (the loss), "
            f"got {type(loss).__name__}"
        )
    if loss.size != 1 or not mx.issubdtype(loss.dtype, mx.floating):
        raise ValueError(
            f"{where}: the function must return a floating scalar (the loss), "
            f"got shape {tuple(loss.shape)} and dtype {loss.dtype}"
        )
    loss = loss.reshape(())
    if loss.dtype in AUTOCAST_DTYPES:
        loss = loss.astype(mx.float32)
    return loss, rest


_valid = nn.Module.valid_parameter_filter
_trainable = nn.Module.trainable_parameter_filter


def _trainable_parameters(module: nn.Module) -> tuple[dict, bool]:
    """``(module.trainable_parameters(), whether any parameter is frozen)`` in one walk of
    the module tree, with ``mlx.nn``'s filters (``withgradient`` runs on every step; a model
    without frozen entries then needs no ``parameters()`` walk)."""
    frozen = False

    def walk(owner: nn.Module, key: str, value: Any) -> Any:
        nonlocal frozen
        if isinstance(value, nn.Module):
            owner, entries, prefix = value, value.items(), ""
        elif isinstance(value, (dict, list)):
            entries = value.items() if isinstance(value, dict) else enumerate(value)
            prefix = f"{key}."
        else:
            return value
        out = {}
        for k, v in entries:
            path = f"{prefix}{k}"
            # (the dtype test inline: this walk runs on every step)
            if _trainable(owner, path, v) and (
                not isinstance(v, mx.array) or v.dtype in _INEXACT
            ):
                out[k] = walk(owner, path, v)
            else:
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
    scale: LossScale | None,
    where: str,
    wrt_arrays: bool = True,
) -> tuple[Any, tuple]:
    """The engine of :func:`withgradient`; ``scale`` multiplies the loss before it is
    differentiated (the value returned is the unscaled loss); ``wrt_arrays=False`` takes
    gradients for the modules only (array arguments get ``None``)."""
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
        loss, rest = _split_output(out, where)
        # Running statistics (BatchNorm) are frozen parameters: return them as outputs so
        # they come out of the transform as ordinary arrays.
        state = [frozen(*entry) for entry in zip(modules, trainable_keys, has_frozen,
                                                 strict=True)]
        scaled = loss if scale is None else scale.scale(loss)
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
    fresh = [v for entry in state for _, v in entry]
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

    ``loss_scale`` (``None``, a number, or a loss-scale object such as
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


class OptState:
    """The state of training one model: the optimiser and the loss scale.

    Made by :func:`setup`. Attributes: ``rule`` (what ``setup`` was given), ``optimizer``
    (the initialised ``mlx.optimizers.Optimizer``) and ``loss_scale`` (a
    :class:`~fluxlike.DynamicLossScale`/:class:`~fluxlike.StaticLossScale`, or ``None``).

    :attr:`state` is a nested dict of arrays for checkpoints and :meth:`load_state` puts
    one back.

    >>> from fluxlike import Adam, Dense, setup
    >>> opt_state = setup(Adam(), Dense(2, 1), loss_scale=1024)
    >>> opt_state
    OptState(Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08), loss_scale=StaticLossScale(1024.0))
    >>> sorted(opt_state.state), sorted(opt_state.state["optimizer"])
    (['loss_scale', 'optimizer'], ['bias', 'learning_rate', 'step', 'weight'])
    """

    def __init__(
        self, rule: Rule | optim.Optimizer, optimizer: optim.Optimizer,
        loss_scale: LossScale | None = None,
    ):
        self.rule = rule
        self.optimizer = optimizer
        self.loss_scale = loss_scale

    def __repr__(self) -> str:
        return f"OptState({self.rule!r}, loss_scale={self.loss_scale!r})"

    @property
    def state(self) -> dict[str, Any]:
        """``{"optimizer": <optimizer state>, "loss_scale": <loss-scale state>}``, the second
        entry only when there is a loss scale. The inner dicts are the live ones."""
        tree: dict[str, Any] = {"optimizer": self.optimizer.state}
        if self.loss_scale is not None:
            tree["loss_scale"] = self.loss_scale.state
        return tree

    def load_state(self, tree: dict[str, Any]) -> None:
        """Restore a tree saved from :attr:`state`, in place.

        ``tree`` may be nested or flat (``{"optimizer.step": ...}``, as from
        ``mlx.utils.tree_flatten``). The optimiser entries must match this state's names,
        shapes and dtypes exactly. A ``"loss_scale"`` entry is loaded into
        ``self.loss_scale``; if there is none yet, a ``DynamicLossScale()`` (the entry has a
        ``counter``; its period, factor and min_scale are loaded too, or stay the defaults
        for an entry saved without them) or a ``StaticLossScale`` is made for it. Without a
        ``"loss_scale"`` entry, ``self.loss_scale`` is left as it is. On any mismatch,
        raises ``ValueError`` naming the first mismatched entry and changes nothing.
        """
        if not isinstance(tree, dict):
            raise ValueError(f"OptState.load_state: expected a dict, got {type(tree).__name__}")
        given = dict(tree_flatten(tree))
        current = tree_flatten(self.optimizer.state)
        for key, value in current:
            name = f"optimizer.{key}"
            if name not in given:
                raise ValueError(f"OptState.load_state: missing entry {name!r}")
            new = given[name]
            if not isinstance(new, mx.array) or new.shape != value.shape or (
                new.dtype != value.dtype
            ):
                found = (
                    f"{_name(new.dtype)} array of shape {tuple(new.shape)}"
                    if isinstance(new, mx.array) else type(new).__name__
                )
                raise ValueError(
                    f"OptState.load_state: entry {name!r} must be a {_name(value.dtype)} "
                    f"array of shape {tuple(value.shape)}, got a {found}"
                )
        scale_tree = {k[len("loss_scale."):]: v for k, v in given.items()
                      if k.startswith("loss_scale.")}
        known = {f"optimizer.{k}" for k, _ in current}
        for key in given:
            if key not in known and not key.startswith("loss_scale."):
                raise ValueError(f"OptState.load_state: unexpected entry {key!r}")
        scale = self.loss_scale
        if scale_tree:
            if scale is None:
                scale = DynamicLossScale() if "counter" in scale_tree else (
                    lossscale.StaticLossScale(1.0)
                )
            try:
                scale.load_state(scale_tree)  # validates before changing anything
            except ValueError as e:
                raise ValueError(f"OptState.load_state: loss_scale: {e}") from None
        assign(self.optimizer.state, {k[len("optimizer."):]: v for k, v in given.items()
                                       if k.startswith("optimizer.")})
        self.loss_scale = scale


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).rpartition(".")[2]


def _resolve_scale(loss_scale: Any, where: str) -> LossScale | None:
    return None if isinstance(loss_scale, str) and loss_scale == "auto" else (
        lossscale.resolve(loss_scale, where)
    )


def setup(
    rule: Rule | optim.Optimizer, model: nn.Module, *, loss_scale: Any = None
) -> OptState:
    """Prepare to train ``model`` with ``rule``: returns an :class:`OptState`.

    ``rule`` is a fluxlike rule (``Adam(1e-3)``, ``OptimiserChain(ClipNorm(1.0),
    Descent())``, ...) or an ``mlx.optimizers.Optimizer``, which is used as it is. The
    optimiser is initialised for the model's trainable parameters, so ``opt_state.state``
    is complete before the first step.

    ``loss_scale``: ``None`` (none), a positive number (a :class:`~fluxlike.StaticLossScale`),
    a loss-scale object, or ``"auto"``, which is the same as ``None`` here: :func:`train`
    then chooses (a dynamic scale for float16 autocast).

    >>> from fluxlike import Dense, Descent, DynamicLossScale, setup
    >>> opt_state = setup(Descent(0.1), Dense(2, 1), loss_scale=DynamicLossScale())
    >>> type(opt_state.optimizer).__mro__[1].__name__, opt_state.loss_scale.loss_scale
    ('SGD', array(32768, dtype=float32))
    """
    if isinstance(rule, Rule):
        optimizer = rule.build()
    elif isinstance(rule, optim.Optimizer):
        optimizer = rule
    else:
        raise TypeError(
            f"setup: rule must be a fluxlike rule such as Adam() or an mlx.optimizers "
            f"Optimizer, got {rule!r}"
            + ("; put a gradient transform in OptimiserChain(..., Adam())"
               if callable(rule) else "")
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"setup: model must be an mlx.nn.Module, got {type(model).__name__}")
    scale = _resolve_scale(loss_scale, "setup")
    optimizer.init(_trainable_parameters(model)[0])
    return OptState(rule, optimizer, scale)


def _check_grads(grads: Any, model: nn.Module) -> tuple[tuple, Any]:
    """Validate ``grads`` against ``model``'s trainable parameters, in one walk of both.
    Returns ``(signature, params)``: each gradient's path, shape and dtype (which key the
    compiled steps), and the parameters, in the structure of ``grads``."""
    if not isinstance(grads, dict):
        hint = "; gradient() returns a tuple, pass its model entry (grads[0])" if isinstance(
            grads, tuple) else ""
        raise TypeError(
            f"update: grads must be a dict shaped like model.trainable_parameters(), "
            f"got {type(grads).__name__}{hint}"
        )
    signature = []

    def walk(g: Any, value: Any, owner: nn.Module, key: str, path: str) -> Any:
        # ``value``: the model's entry at ``path``; ``owner``, ``key``: the module holding it
        # and its key there (dotted inside plain containers), as mlx.nn's filters take them.
        if isinstance(g, (dict, list, tuple)):
            found = []
            for k, sub in g.items() if isinstance(g, dict) else enumerate(g):
                if isinstance(sub, (dict, list, tuple)) and not sub:  # no gradient in here
                    found.append((k, sub))
                    continue
                where = f"{path}.{k}" if path else str(k)
                o, kk = (value, str(k)) if isinstance(value, nn.Module) else (owner, f"{key}.{k}")
                v = _entry(value, k)
                if v is _MISSING or not _trainable(o, kk, v):
                    raise ValueError(f"update: the model has no trainable parameter {where!r}")
                if not _floating_or_tree(v):
                    raise ValueError(f"update: {where!r} is a {_name(v.dtype)} array of the "
                                     f"model: integer and boolean arrays are not trained")
                found.append((k, walk(sub, v, o, kk, where)))
            return dict(found) if isinstance(g, dict) else type(g)(v for _, v in found)
        if not isinstance(value, mx.array):
            raise ValueError(f"update: the model has no trainable parameter {path!r}")
        if not isinstance(g, mx.array) or g.shape != value.shape:
            found = tuple(g.shape) if isinstance(g, mx.array) else type(g).__name__
            raise ValueError(
                f"update: gradient {path!r} must be an array of shape "
                f"{tuple(value.shape)}, got {found}"
            )
        signature.append((path, g.shape, g.dtype))
        return value

    params = walk(grads, model, model, "", "")
    return tuple(signature), params


_MISSING = object()


def _entry(container: Any, key: Any) -> Any:
    """``container[key]`` for a dict or list, else ``_MISSING``."""
    if isinstance(container, dict):
        return container.get(key, _MISSING)
    if isinstance(container, list) and isinstance(key, int) and 0 <= key < len(container):
        return container[key]
    return _MISSING


def update(opt_state: OptState, model: nn.Module, grads: dict) -> None:
    """One optimiser step: change ``model`` and ``opt_state`` in place; returns ``None``.

    ``grads`` is the model's gradient (``gradient(loss, model)[0]``). With a loss scale in
    ``opt_state`` (given to :func:`setup`, or made by ``train(..., autocast=mx.float16)``)
    ``grads`` must be the gradient of the scaled loss (``gradient(loss, model,
    loss_scale=opt_state.loss_scale)[0]``): the gradients are first divided by the scale;
    if any is then inf or nan the step is skipped (weights and optimiser state stay exactly
    as they were) and the scale is lowered, else the step is taken and the scale adjusted.
    These decisions are ``mx.where`` selections on arrays: ``update`` never waits for the
    device and can run inside ``mx.compile`` (capture ``opt_state.state`` and
    ``model.state``).

    The step (the optimiser's ``apply_gradients`` and, with a loss scale, the unscaling,
    finite check and scale adjustment) runs as one ``mx.compile``-d function per
    ``opt_state``, with the optimiser and loss-scale state captured, so that MLX fuses each
    parameter's arithmetic into one kernel (the first step on a machine builds those
    kernels, about a second each; MLX keeps them on disk). It is traced again when the
    gradients' structure, shapes or dtypes change, or when a Python setting of the
    optimiser or loss scale (``betas``, ``eps``, a schedule function, ...) is reassigned.
    Array state (learning rate, step count, moments, the loss scale and its period, factor
    and minimum) is read afresh at every step, so ``opt_state.optimizer.learning_rate =
    1e-4`` takes effect at once; with a schedule (a callable ``lr``), though, MLX sets the
    learning rate from the schedule before every step, so such an assignment has no effect.
    An optimiser whose step cannot be traced (a schedule that reads an array's value), that
    changes its own Python attributes while stepping, or whose ``state`` is not one live
    dict, is updated eagerly.

    On the CPU the first step also raises MLX's buffer-cache limit from its default
    (32 MiB) to twice the bytes of the parameters, gradients and optimiser state (at most
    1/8 of MLX's memory limit), so that each step reuses the buffers the previous one
    freed instead of faulting in fresh pages. A limit set with ``mx.set_cache_limit`` is
    left as it is.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, Descent, gradient, setup, update
    >>> model = Dense(2, 1, bias=False)
    >>> model.weight = mx.array([[1.0, 2.0]])
    >>> opt_state = setup(Descent(0.5), model)
    >>> update(opt_state, model, {"weight": mx.array([[2.0, 2.0]])})
    >>> model.weight
    array([[0, 1]], dtype=float32)
    """
    if not isinstance(opt_state, OptState):
        raise TypeError(f"update: expected an OptState from setup(), got {opt_state!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"update: model must be an mlx.nn.Module, got {type(model).__name__}")
    signature, params = _check_grads(grads, model)
    compiled = COMPILED.get(opt_state) or COMPILED.setdefault(opt_state, Compiled())
    optimizer, scale = opt_state.optimizer, opt_state.loss_scale
    if signature not in compiled.initialised:
        init_missing(optimizer, params)  # thawed since setup(): no state yet
        compiled.initialised.add(signature)
    reason = compiled.eager or compiled.step(opt_state, model, grads, params, signature)
    if reason is None:
        return
    trees = [optimizer.state] if scale is None else [optimizer.state, scale.state]
    before = [dict(tree_flatten(tree)) for tree in trees]
    try:
        if scale is None:
            optimizer.update(model, grads)
        else:
            model.update(step(optimizer, scale, grads, params))
    except BaseException:
        for tree, values in zip(trees, before, strict=True):  # no half-taken step
            assign(tree, values, prune=True)
        raise
    compiled.fall_back(reason)  # only once the eager step worked: else it was the input


def _check_call(loss: Callable, model: nn.Module, args: tuple, data: Any, where: str) -> None:
    """Refuse a first batch that ``loss(model, *batch)`` cannot take, saying how ``train``
    calls it (else the error is Python's, naming neither)."""
    try:
        signature = inspect.signature(loss)
    except (TypeError, ValueError):  # a builtin or the like: let the call speak
        return
    try:
        signature.bind(model, *args)
    except TypeError as e:
        kinds = ", ".join(type(a).__name__ for a in args)
        hint = ""
        if isinstance(data, tuple) and all(isinstance(a, mx.array) for a in data):
            hint = ("; data is a tuple of arrays, so each batch is one of them: for one batch "
                    "(x, y) pass [(x, y)], for batches of it DataLoader((x, y), batchsize=...)")
        raise TypeError(f"{where}: the loss is called as loss(model, *batch), here with a batch "
                        f"of {len(args)} ({kinds}), and cannot take that: {e}{hint}") from None


def _restore(model: nn.Module, opt_state: OptState, scale_state: dict, before: tuple) -> None:
    """Put back the model, optimiser, loss-scale and random state saved before a batch."""
    params, optimizer_state, scale, key = before
    model.update(params)
    assign(opt_state.optimizer.state, optimizer_state, prune=True)
    compiled = COMPILED.get(opt_state)
    if compiled is not None:  # state made for thawed parts may be gone: let update look again
        compiled.initialised.clear()
    scale_state.update(scale)
    if mx.random.state[0] is not key:  # mx.random.state takes no assignment: seed to the key
        hi, lo = key.tolist()
        mx.random.seed((hi << 32) | lo)


class _Progress:
    """A one-line text progress bar on a terminal stream."""

    WIDTH = 30

    def __init__(self, total: int | None, stream: Any):
        self.total, self.stream = total, stream
        self.shown_at = 0.0

    def show(self, done: int, mean_loss: float, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.shown_at < 0.1:  # redraw at most ten times a second
            return
        self.shown_at = now
        if self.total:
            filled = self.WIDTH * done // self.total
            bar = "[" + "=" * filled + " " * (self.WIDTH - filled) + "] "
            count = f"{done}/{self.total}"
        else:
            bar, count = "", f"{done}"
        self.stream.write(f"\r{bar}{count} loss {mean_loss:.4g}" + ("\n" if final else ""))
        self.stream.flush()


def train(
    loss: Callable[..., mx.array],
    model: nn.Module,
    data: Iterable,
    opt_state: OptState,
    *,
    autocast: mx.Dtype | None = None,
    loss_scale: Any = "auto",
    progress: bool = True,
    compile: bool = False,
) -> float:
    """One pass over ``data``: for each batch, ``loss(model, *batch)``, its gradient, and an
    :func:`update`. Returns the mean loss over the batches as a float (nan for no batches).

    A batch that is a tuple is splatted into ``loss``; anything else (an array, a dict)
    is passed as one argument. ``autocast`` is as in :func:`gradient`.

    ``loss_scale``: ``"auto"`` uses ``opt_state.loss_scale`` if it holds one, else makes a
    :class:`~fluxlike.DynamicLossScale` when ``autocast=mx.float16`` (bfloat16 and float32
    need none) and keeps it in ``opt_state.loss_scale``. ``None``, a number or a loss-scale
    object replaces ``opt_state.loss_scale``. A step whose gradients overflow is skipped
    by the loss scale, silently; a loss that is inf or nan stops training with
    ``FloatingPointError`` naming the batch (0-based), and the model and ``opt_state`` are
    left as they were before that batch.

    ``progress``: a text progress bar on stderr, shown only when stderr is a terminal.
    ``compile=True`` runs each step as one ``mx.compile``-d function (model, optimiser,
    loss-scale and random state captured), traced anew in each ``train`` call.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, Descent, setup, train
    >>> model = Dense(1, 1)
    >>> x = mx.array([[0.0], [1.0], [2.0]]); y = 2 * x + 1
    >>> opt_state = setup(Descent(0.1), model)
    >>> mse = lambda m, x, y: ((m(x) - y) ** 2).mean()
    >>> for epoch in range(200):
    ...     _ = train(mse, model, [(x, y)], opt_state, progress=False)
    >>> round(model.weight.item(), 3), round(model.bias.item(), 3)
    (2.0, 1.0)
    """
    where = "train"
    dtype = _check_autocast(autocast, where)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an mlx.nn.Module, got {type(model).__name__}")
    if not isinstance(opt_state, OptState):
        raise TypeError(f"{where}: expected an OptState from setup(), got {opt_state!r}")
    if isinstance(loss_scale, str) and loss_scale == "auto":
        if opt_state.loss_scale is None and dtype is not None and dtype == mx.float16:
            opt_state.loss_scale = DynamicLossScale()
    else:
        opt_state.loss_scale = lossscale.resolve(loss_scale, where)
    scale = opt_state.loss_scale
    scale_state = {} if scale is None else scale.state

    def step(*batch: Any) -> mx.array:
        value, grads = _value_and_grad(loss, (model, *batch), dtype, scale, where,
                                       wrt_arrays=False)
        update(opt_state, model, grads[0])
        return value[0] if isinstance(value, tuple) else value

    captured = [model.state, opt_state.optimizer.state, scale_state, mx.random.state]
    if compile:
        step = mx.compile(step, inputs=captured, outputs=captured)

    stream = sys.stderr
    bar = None
    if progress and hasattr(stream, "isatty") and stream.isatty():
        bar = _Progress(len(data) if hasattr(data, "__len__") else None, stream)
    total, count = 0.0, 0
    for i, batch in enumerate(data):
        args = batch if isinstance(batch, tuple) else (batch,)
        if i == 0:
            _check_call(loss, model, args, data, where)
        before = (model.parameters(), dict(tree_flatten(opt_state.optimizer.state)),
                  dict(scale_state), mx.random.state[0])
        try:
            value = step(*args)
            mx.eval(value, captured)
        except BaseException:
            # A trace that raised leaves mx.compile's placeholders in everything captured,
            # the random state included: put the arrays of before the batch back.
            _restore(model, opt_state, scale_state, before)
            raise
        value = value.item()
        if not math.isfinite(value):
            _restore(model, opt_state, scale_state, before)
            if bar is not None:
                bar.stream.write("\n")
            raise FloatingPointError(
                f"{where}: the loss is {value} at batch {i} (counting from 0); the model and "
                f"optimiser state are left as they were before that batch"
            )
        total, count = total + value, count + 1
        if bar is not None:
            bar.show(count, total / count)
    if bar is not None and count:
        bar.show(count, total / count, final=True)
    return total / count if count else math.nan
