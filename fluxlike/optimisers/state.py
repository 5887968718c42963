"""The optimiser state of one model: ``OptState``, ``setup`` and ``update``.

``setup`` builds the optimiser for a rule and initialises it for the model's trainable
parameters; ``update`` takes one step, through the compiled step of :mod:`.compiled`, with the
loss scale's unscaling, finite check and adjustment when ``opt_state`` has one.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map_with_path

from .._mlxtyping import tree_flatten
from ..distributed import DataParallel, prepare
from ..gradients import _INEXACT, _floating_or_tree, _trainable, _trainable_parameters
from ..precision import lossscale
from ..precision.dynamicscale import DynamicLossScale
from ..precision.lossscale import LossScale, NoOpLossScale
from .compiled import (
    COMPILED,
    Compiled,
    assign,
    averager,
    init_missing,
    rollback,
    step,
    uninterrupted,
)
from .rules import Rule, following


class OptState:
    """The state of training one model: the optimiser and the loss scale.

    Made by :func:`setup`. Attributes: :attr:`rule` (the rule the optimiser follows now),
    ``optimizer`` (the initialised ``mlx.optimizers.Optimizer``) and ``loss_scale`` (a
    :class:`~fluxlike.DynamicLossScale`/:class:`~fluxlike.StaticLossScale`, or
    :class:`~fluxlike.NoOpLossScale` for none).

    :attr:`state` is a nested dict of arrays for checkpoints and :meth:`load_state` puts
    one back.

    >>> from fluxlike import Adam, Dense, setup
    >>> opt_state = setup(Adam(), Dense(2, 1), loss_scale=1024)
    >>> opt_state
    OptState(Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08), loss_scale=StaticLossScale(1024.0))
    >>> sorted(opt_state.state), sorted(opt_state.state["optimizer"])
    (['loss_scale', 'optimizer'], ['bias', 'learning_rate', 'step', 'weight'])

    The rule and the repr show the values the optimiser holds now:

    >>> opt_state.optimizer.learning_rate = 1e-4
    >>> opt_state.rule
    Adam(lr=0.0001, betas=(0.9, 0.999), eps=1e-08)
    """

    def __init__(
        self, rule: Rule | optim.Optimizer, optimizer: optim.Optimizer,
        loss_scale: LossScale | None = None, distributed: DataParallel | None = None,
    ):
        self.rule = rule
        self.optimizer = optimizer
        self._loss_scale: LossScale = NoOpLossScale()
        self.loss_scale = loss_scale  # type: ignore[assignment]  # None: NoOpLossScale()
        self.distributed = distributed  # data parallelism (fluxlike.distributed), or None
        # the parameter names and shapes of the model setup() made this for (None: unknown)
        self._model_shapes: dict[str, tuple] | None = None

    @property
    def loss_scale(self) -> LossScale:
        """The loss scale (:class:`~fluxlike.NoOpLossScale` for none; assigning ``None``
        assigns one). A dynamic scale belongs to one ``OptState``: assigning one that another
        live ``OptState`` holds is a ``ValueError`` (see :class:`~fluxlike.DynamicLossScale`)."""
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value: LossScale | None) -> None:
        if value is None:
            value = NoOpLossScale()
        if not isinstance(value, LossScale):
            raise TypeError(f"OptState.loss_scale must be a loss scale or None, got {value!r}")
        claim(value, self, "OptState")
        old = self._loss_scale
        if old is not value and _owner(old) is self:
            del _OWNERS[old]
        self._loss_scale = value

    @property
    def rule(self) -> Rule | optim.Optimizer:
        """The rule the optimiser follows now: the one given to :func:`setup` (or made by
        :func:`~fluxlike.adjust` or :func:`~fluxlike.loadcheckpoint`), its hyperparameters
        read from the optimiser, so that they are the live ones, also after an assignment
        such as ``opt_state.optimizer.learning_rate = 1e-4`` (a learning rate is shown as
        the shortest decimal of the float32 value it holds). An ``mlx.optimizers``
        optimiser given to ``setup`` as it is is its own rule. Assigning a rule records it,
        as ``adjust`` does; it does not change the optimiser."""
        rule = self._rule
        return following(self.optimizer, rule) if isinstance(rule, Rule) else rule

    @rule.setter
    def rule(self, rule: Rule | optim.Optimizer) -> None:
        self._rule = rule

    def __repr__(self) -> str:
        shown = "" if self.distributed is None else f", distributed={self.distributed!r}"
        return f"OptState({self.rule!r}, loss_scale={self.loss_scale!r}{shown})"

    @property
    def state(self) -> dict[str, Any]:
        """``{"optimizer": <optimizer state>, "loss_scale": <loss-scale state>}`` (the second
        empty for :class:`~fluxlike.NoOpLossScale`). The inner dicts are the live ones."""
        return {"optimizer": self.optimizer.state, "loss_scale": self.loss_scale.state}

    def load_state(self, tree: dict[str, Any]) -> None:
        """Restore a tree saved from :attr:`state`, in place.

        ``tree`` may be nested or flat (``{"optimizer.step": ...}``, as from
        ``mlx.utils.tree_flatten``). The optimiser entries must match this state's names,
        shapes and dtypes exactly. A ``"loss_scale"`` entry is loaded into
        ``self.loss_scale``; if there is none yet, a ``DynamicLossScale()`` (the entry has a
        ``counter``; its growth_interval, growth_factor, backoff_factor and min_scale are
        loaded too, or stay the defaults for an entry saved without them) or a
        ``StaticLossScale`` is made for it. Without a
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
        _check_optimizer_values([(f"optimizer.{key}", given[f"optimizer.{key}"])
                                 for key, _ in current])
        scale_tree = {k[len("loss_scale."):]: v for k, v in given.items()
                      if k.startswith("loss_scale.")}
        known = {f"optimizer.{k}" for k, _ in current}
        for key in given:
            if key not in known and not key.startswith("loss_scale."):
                raise ValueError(f"OptState.load_state: unexpected entry {key!r}")
        scale = self.loss_scale
        if scale_tree:
            if isinstance(scale, NoOpLossScale):  # a scale saved, none here: make its kind
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


# Which OptState holds each loss scale (weakly: a dropped OptState frees its scale).
_OWNERS: weakref.WeakKeyDictionary[LossScale, weakref.ref] = weakref.WeakKeyDictionary()


def _owner(scale: LossScale) -> OptState | None:
    ref = _OWNERS.get(scale)
    return None if ref is None else ref()


def claim(scale: LossScale, opt_state: OptState | None, where: str) -> None:
    """Make ``opt_state`` the holder of ``scale`` (``None``: only check that it is free);
    a ``ValueError`` if another live OptState holds it. ``update`` adjusts the scale of the
    state it steps, so a scale shared by two states would be adjusted twice per iteration
    and would unscale the second model's gradients with a scale that did not produce them.
    A scale that never adjusts (:class:`~fluxlike.StaticLossScale`) may be shared."""
    if type(scale).adjust is LossScale.adjust:  # a static (or no-op) scale never changes
        return
    holder = _owner(scale)
    if holder is not None and holder is not opt_state:
        raise ValueError(
            f"{where}: this {type(scale).__name__} already belongs to another OptState; one "
            f"loss scale cannot serve two optimiser states (each update adjusts it, so it "
            f"would change twice per iteration and unscale one model's gradients with a "
            f"scale that did not produce them). Give each OptState its own "
            f"(setup(rule, model, loss_scale={type(scale).__name__}(...))), or train the "
            f"models as one: a container module holding both, one setup, one loss"
        )
    if opt_state is not None:
        _OWNERS[scale] = weakref.ref(opt_state)


MAX_STEP = 2**40  # a step count past this is no real run (a trillion steps): a corrupt file


def _check_optimizer_values(entries: list[tuple[str, mx.array]]) -> None:
    """Refuse optimiser state no real run can have: a non-finite array (moments, learning
    rate...), a negative learning rate, a step count past :data:`MAX_STEP`. One device read
    for all entries."""
    checks = []
    for name, value in entries:
        leaf = name.rpartition(".")[2]
        if mx.issubdtype(value.dtype, mx.inexact):
            checks.append((name, "holds inf or nan", mx.all(mx.isfinite(value))))
        if leaf == "learning_rate":
            checks.append((name, "is negative", mx.all(value >= 0)))
        if leaf == "step" and mx.issubdtype(value.dtype, mx.integer):
            checks.append((name, "is a step count past any real run (over 2**40)",
                           mx.all(value.astype(mx.uint64) <= MAX_STEP)))
    if not checks:
        return
    oks = cast("list[bool]", mx.stack([ok for _, _, ok in checks]).tolist())
    for (name, what, _), ok in zip(checks, oks, strict=True):
        if not ok:
            raise ValueError(
                f"OptState.load_state: entry {name!r} {what}; no training run leaves that, "
                f"so the state (or the file it came from) is corrupt"
            )


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).rpartition(".")[2]


def _resolve_scale(loss_scale: Any, where: str) -> LossScale:
    return lossscale.resolve(None if isinstance(loss_scale, str) and loss_scale == "auto"
                             else loss_scale, where)


def setup(
    rule: Rule | optim.Optimizer, model: nn.Module, *, loss_scale: Any = None,
    distributed: Any = None, communication_dtype: mx.Dtype | None = None,
) -> OptState:
    """Prepare to train ``model`` with ``rule``: returns an :class:`OptState`.

    ``rule`` is a fluxlike rule (``Adam(1e-3)``, ``OptimiserChain(ClipNorm(1.0),
    Descent())``, ...) or an ``mlx.optimizers.Optimizer``, which is used as it is. The
    optimiser is initialised for the model's trainable parameters, so ``opt_state.state``
    is complete before the first step.

    ``loss_scale``: ``None`` (none: a :class:`~fluxlike.NoOpLossScale`), a positive number
    (a :class:`~fluxlike.StaticLossScale`), a loss-scale object, or ``"auto"``, which is
    the same as ``None`` here: :func:`train` then chooses (a dynamic scale for float16
    autocast).

    >>> from fluxlike import Dense, Descent, DynamicLossScale, setup
    >>> opt_state = setup(Descent(0.1), Dense(2, 1), loss_scale=DynamicLossScale())
    >>> type(opt_state.optimizer).__mro__[1].__name__, opt_state.loss_scale.loss_scale
    ('SGD', array(32768, dtype=float32))

    ``distributed`` (data parallelism over ``mx.distributed``, see :mod:`fluxlike.distributed`):
    ``None`` for one process, ``True`` for the group of ``mx.distributed.init()``, or an
    ``mx.distributed.Group``. Every rank must call ``setup`` with the same model: the ranks'
    parameter trees (names, shapes, dtypes, which are trained) are compared, and a mismatch is
    a ``ValueError`` on every rank; then every rank gets rank 0's parameters and buffers
    (BatchNorm statistics), and :func:`update` averages the gradients over the group before
    the rule. ``communication_dtype`` (e.g. ``mx.bfloat16``) sends them in that dtype (half
    the bytes; they are averaged back in their own dtype). A group of one process
    communicates nothing.
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
    claim(scale, None, "setup")
    trainable = _trainable_parameters(model)[0]
    parallel = prepare(model, (k for k, _ in tree_flatten(trainable)), distributed,
                       communication_dtype)
    optimizer.init(_trainable_parameters(model)[0] if parallel else trainable)
    opt_state = OptState(rule, optimizer, scale, parallel)
    opt_state._model_shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    return opt_state


def _check_grads(grads: Any, model: nn.Module, where: str = "update") -> tuple[tuple, Any, Any]:
    """Validate ``grads`` against ``model``'s trainable parameters, in one walk of both.
    Returns ``(signature, params, grads)``: each gradient's path, shape and dtype (which key
    the compiled steps), the parameters in the structure of ``grads``, and ``grads`` with
    any gradient wider than its parameter (float64 for float32) cast to the parameter's
    dtype."""
    if not isinstance(grads, dict):
        hint = "; gradient() returns a tuple, pass its model entry (grads[0])" if isinstance(
            grads, tuple) else ""
        raise TypeError(
            f"{where}: grads must be a dict shaped like model.trainable_parameters(), "
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
                at = f"{path}.{k}" if path else str(k)
                o, kk = (value, str(k)) if isinstance(value, nn.Module) else (owner, f"{key}.{k}")
                v = _entry(value, k)
                if v is _MISSING or not _trainable(o, kk, v):
                    raise ValueError(f"{where}: the model has no trainable parameter {at!r}")
                if not _floating_or_tree(v):
                    raise ValueError(f"{where}: {at!r} is a {_name(v.dtype)} array of the "
                                     f"model: integer and boolean arrays are not trained")
                found.append((k, walk(sub, v, o, kk, at)))
            return dict(found) if isinstance(g, dict) else type(g)(v for _, v in found)
        if not isinstance(value, mx.array):
            raise ValueError(f"{where}: the model has no trainable parameter {path!r}")
        if not isinstance(g, mx.array) or g.shape != value.shape:
            got = tuple(g.shape) if isinstance(g, mx.array) else type(g).__name__
            raise ValueError(
                f"{where}: gradient {path!r} must be an array of shape "
                f"{tuple(value.shape)}, got {got}"
            )
        if not mx.issubdtype(g.dtype, mx.floating):  # (complex too: no complex parameters)
            raise TypeError(
                f"{where}: gradient {path!r} must be a floating array (as the parameter, "
                f"{_name(value.dtype)}), got {_name(g.dtype)}; take gradients with "
                f"fluxlike.gradient or mx.grad"
            )
        if g.dtype != value.dtype and g.dtype in _INEXACT and value.dtype in _INEXACT and (
            g.dtype.size > value.dtype.size
        ):  # float64 gradients would turn float32 parameters and moments into float64
            casts[path] = g.astype(value.dtype)
        signature.append((path, g.shape, casts[path].dtype if path in casts else g.dtype))
        return value

    casts: dict[str, mx.array] = {}
    params = walk(grads, model, model, "", "")
    if casts:
        grads = tree_map_with_path(lambda path, g: casts.get(path, g), grads)
    return tuple(signature), params, grads


def _check_same_model(opt_state: OptState, signature: tuple, shapes: bool,
                      where: str = "update") -> None:
    """Refuse gradients of a model other than the one ``opt_state`` was set up for (a
    parameter it did not have, or had in another shape): the step would grow the state with
    the other model's entries and share its step count."""
    known = opt_state._model_shapes
    if known is None:
        return
    for path, shape, _ in signature:
        if path not in known or (shapes and known[path] != tuple(shape)):
            had = f"had it of shape {known[path]}" if path in known else "had no such parameter"
            raise ValueError(
                f"{where}: opt_state was set up for another model: this model's parameter "
                f"{path!r} (shape {tuple(shape)}) does not fit it (the model given to setup() "
                f"{had}); call setup(rule, model) for this model, or pass the model the "
                f"state belongs to"
            )


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
    loss_scale=opt_state.loss_scale)[0]``). Every step takes one path, whatever the scale
    (none is a :class:`~fluxlike.NoOpLossScale`, whose unscaling is the identity): the
    gradients are divided by the scale; if any is then inf or nan the step is skipped
    (weights and optimiser state stay exactly as they were; without the native kernels a
    float32 sum of the gradients past float32's range counts as such, see
    :func:`~fluxlike.precision.lossscale.sum_finite`)
    and the scale is lowered, else the step is taken and the scale adjusted. These decisions
    are ``mx.where`` selections on arrays: ``update`` never waits for the device and can run
    inside ``mx.compile`` (capture ``opt_state.state`` and ``model.state``).

    The step (unscaling, the finite check, the optimiser's ``apply_gradients`` and the
    scale's adjustment) runs as one ``mx.compile``-d function per
    ``opt_state``, with the optimiser and loss-scale state captured, so that MLX fuses each
    parameter's arithmetic into one kernel (the first step on a machine builds those
    kernels, which takes a while; MLX keeps them on disk). On the CPU,
    :class:`~fluxlike.Adam`, :class:`~fluxlike.AdamW` and :class:`~fluxlike.RMSProp` update
    float32 and bfloat16 parameters with the native companion's vectorised kernels instead
    (:func:`fluxlike.native.adam_kernel`: MLX's arithmetic, bit for bit), where it is built.
    It is traced again when the gradients' structure, shapes or dtypes change, or when a
    Python setting of the optimiser or loss scale (``betas``, ``eps``, a schedule function,
    ...) is reassigned. Array state (learning rate, step count, moments, the loss scale and
    its growth interval, factors and minimum) is read afresh at every step, so
    ``opt_state.optimizer.learning_rate = 1e-4`` takes effect at once; with a schedule (a
    callable ``lr``), though, MLX sets the learning rate from the schedule before every
    step, so such an assignment has no effect.
    An optimiser whose step cannot be traced (a schedule that reads an array's value), that
    changes its own Python attributes while stepping, or whose ``state`` is not one live
    dict, is updated eagerly.

    With data parallelism (``setup(..., distributed=...)``) the gradients are first averaged
    over the group, inside the same compiled step (bucketed all-reductions, in
    ``communication_dtype`` if one was given; the gradients of MLX's sharded layers, which
    reduce their own, are left alone), so the unscaling, the finite check and the rule see the
    averaged gradients and every rank takes the same step; afterwards the model's BatchNorm
    running statistics are averaged too. Every rank must call ``update`` for every step.

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
    _update(opt_state, model, grads, True, "update")


def _update(opt_state: OptState, model: nn.Module, grads: dict, keep: bool,
            where: str) -> tuple[dict, mx.array, dict, Any, dict]:
    """:func:`update`; returns :func:`.compiled.step`'s ``(new parameters, finite, gradients,
    optimiser state before)`` and the parameters before, in the structure of the gradients:
    arrays not yet evaluated (no host synchronisation). ``keep``: see :func:`.compiled.step`
    (``False``: a non-finite step is taken all the same, for the caller to undo)."""
    if not isinstance(opt_state, OptState):
        raise TypeError(f"{where}: expected an OptState from setup(), got {opt_state!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an mlx.nn.Module, got {type(model).__name__}")
    signature, params, grads = _check_grads(grads, model, where)
    compiled = COMPILED.get(opt_state) or COMPILED.setdefault(opt_state, Compiled())
    optimizer, scale = opt_state.optimizer, opt_state.loss_scale
    if signature not in compiled.initialised:
        _check_same_model(opt_state, signature, False, where)  # before init_missing grows it
        init_missing(optimizer, params, where)  # thawed since setup(): no state yet
        _check_same_model(opt_state, signature, True, where)  # (moments: init_missing says)
        compiled.initialised.add(signature)
    done = compiled.eager or compiled.step(opt_state, model, grads, params, signature, keep)
    if not isinstance(done, str):
        _sync_statistics(opt_state, model)
        return (*done, params)
    reason = done
    trees = [optimizer.state, scale.state]
    before = [dict(tree_flatten(tree)) for tree in trees]
    with uninterrupted():
        try:
            done = step(optimizer, scale, grads, params, averager(opt_state), keep)
            model.update(done[0])
        except BaseException:
            rollback(model, params, trees, before)  # no half-taken step
            raise
    compiled.fall_back(reason)  # only once the eager step worked: else it was the input
    _sync_statistics(opt_state, model)
    return (*done, params)


def _sync_statistics(opt_state: OptState, model: nn.Module) -> None:
    """Data parallelism: BatchNorm running statistics averaged over the group after the step."""
    if opt_state.distributed is not None:
        opt_state.distributed.sync_statistics(model)
