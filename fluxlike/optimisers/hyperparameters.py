"""Changing a live optimiser state's hyperparameters: :func:`adjust`, Optimisers.jl's
``adjust!``."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim

from .accumulate import AccumGrad, _Accumulating
from .rules import (
    GradientTransform,
    LearningRate,
    Momentum,
    Nesterov,
    OptimiserChain,
    RMSProp,
    Rule,
    _Chained,
    _lr,
)
from .state import OptState

# A rule's field that its mlx optimizer keeps under another name.
_OPTIMIZER_NAMES: dict[tuple[type, str], str] = {
    (RMSProp, "rho"): "alpha", (Momentum, "rho"): "momentum", (Nesterov, "rho"): "momentum",
}
# Optimisers.jl's field names, as fluxlike spells them.
_FLUX_NAMES = {"eta": "lr", "learning_rate": "lr", "beta": "betas", "epsilon": "eps",
               "ell": "etas", "gamma": "step_sizes", "omega": "max_norm"}


def adjust(opt_state: OptState, lr: LearningRate | None = None, **changes: Any) -> None:
    """Change hyperparameters of a live optimiser state in place, keeping its moments and
    step count (Optimisers.jl's ``adjust!``): ``adjust(opt_state, 1e-4)`` sets the learning
    rate, ``adjust(opt_state, betas=(0.8, 0.99), eps=1e-6)`` any field of the rule. The next
    :func:`~fluxlike.update` uses them (its compiled step is traced again when a value it
    bakes in changed).

    The keywords are the rule's fields (its repr shows them); in an
    :class:`~fluxlike.OptimiserChain` each goes to every part that has it and ``lr`` to the
    rule, in :class:`~fluxlike.AccumGrad` to its rule (``n`` to the accumulation). ``lr``
    may be a number or a schedule, replacing either. ``opt_state.rule`` becomes the
    adjusted rule. Values are checked as the rule's constructor checks them, before anything
    changes; a keyword no part of the rule has is a ``TypeError``.

    Two differences from Optimisers.jl follow from MLX's state: new ``betas`` correct the
    bias with their own powers of the step count (Optimisers.jl keeps the product of the
    betas used so far), and :class:`~fluxlike.Momentum` and :class:`~fluxlike.Nesterov` keep
    the velocity without the learning rate, so a new ``lr`` scales the momentum already
    gathered too.

    >>> import mlx.core as mx
    >>> from fluxlike import Adam, Dense, adjust, setup, update
    >>> model = Dense(2, 1)
    >>> opt_state = setup(Adam(1e-3), model)
    >>> update(opt_state, model, {"weight": mx.ones((1, 2)), "bias": mx.ones(1)})
    >>> adjust(opt_state, 1e-4, betas=(0.8, 0.99))
    >>> opt_state.rule, opt_state.optimizer.learning_rate.item()
    (Adam(lr=0.0001, betas=(0.8, 0.99), eps=1e-08), 9.999999747378752e-05)
    >>> opt_state.state["optimizer"]["step"].item()  # moments and steps kept
    1
    """
    if not isinstance(opt_state, OptState):
        raise TypeError(f"adjust: expected an OptState from setup(), got {opt_state!r}")
    if lr is not None:
        changes["lr"] = lr
    if not changes:
        raise TypeError("adjust: nothing to change; give a learning rate, e.g. "
                        "adjust(opt_state, 1e-4), or fields such as betas=(0.9, 0.99)")
    for name in changes:
        if name in _FLUX_NAMES and not (name == "beta" and "beta" in _fields(opt_state.rule)):
            raise TypeError(
                f"adjust: unknown keyword {name!r}; fluxlike's name is "
                f"{_FLUX_NAMES[name]}: adjust(opt_state, {_FLUX_NAMES[name]}=...)"
            )
    rule, optimizer = opt_state.rule, opt_state.optimizer
    if not isinstance(rule, Rule):  # an mlx optimizer given to setup as it is
        _set_raw(optimizer, changes)
        return
    new, used = _adjusted(rule, changes)
    unused = sorted(set(changes) - used)
    if unused:
        raise TypeError(
            f"adjust: {rule!r} has no hyperparameter {', '.join(map(repr, unused))}; "
            f"its fields are {', '.join(sorted(_fields(rule)))}"
        )
    _apply(rule, new, optimizer)
    opt_state.rule = new


def _fields(rule: Any) -> set[str]:
    if isinstance(rule, OptimiserChain):
        return set().union(*(_fields(p) for p in rule.parts))
    if isinstance(rule, AccumGrad):
        return {"n"} | _fields(rule.rule)
    return {f.name for f in dataclasses.fields(rule)} if dataclasses.is_dataclass(rule) else set()


def _adjusted(rule: Any, changes: dict[str, Any]) -> tuple[Any, set[str]]:
    """The rule with ``changes`` made (validated by its constructor) and the keys it took."""
    if isinstance(rule, OptimiserChain):
        parts, used = [], set()
        for i, part in enumerate(rule.parts):
            last = i == len(rule.parts) - 1
            mine = {k: v for k, v in changes.items() if k != "lr" or last}
            new, took = _adjusted(part, mine)
            parts.append(new)
            used |= took
        return OptimiserChain(*parts), used
    if isinstance(rule, AccumGrad):
        inner, used = _adjusted(rule.rule, {k: v for k, v in changes.items() if k != "n"})
        n = changes.get("n", rule.n)
        return AccumGrad(n, inner), used | ({"n"} if "n" in changes else set())
    mine = {k: v for k, v in changes.items() if k in _fields(rule)}
    if "lr" in changes and "lr" not in mine and isinstance(rule, Rule):
        raise ValueError(
            f"adjust: {type(rule).__name__} has no learning rate (as in Optimisers.jl, "
            f"where adjust! leaves it as it is); its fields are "
            f"{', '.join(sorted(_fields(rule)))}"
        )
    return (dataclasses.replace(rule, **mine) if mine else rule), set(mine)


def _apply(old: Any, new: Any, optimizer: optim.Optimizer) -> None:
    """Make the live ``optimizer`` (built from ``old``) follow the rule ``new``."""
    if isinstance(old, OptimiserChain):
        assert isinstance(optimizer, _Chained)
        optimizer.transforms = tuple(new.parts[:-1])  # stateless: replaced whole
        _apply(old.parts[-1], new.parts[-1], optimizer.inner)
        return
    if isinstance(old, AccumGrad):
        assert isinstance(optimizer, _Accumulating)
        optimizer.n = new.n
        _apply(old.rule, new.rule, optimizer.rule_optimizer)
        return
    if isinstance(old, GradientTransform):
        return
    for field in dataclasses.fields(old):
        value = getattr(new, field.name)
        if value == getattr(old, field.name):
            continue
        if field.name == "lr":
            _set_learning_rate(optimizer, value)
            continue
        name = _OPTIMIZER_NAMES.get((type(old), field.name), field.name)
        current = getattr(optimizer, name)
        setattr(optimizer, name, list(value) if isinstance(current, list) else value)


def _set_learning_rate(optimizer: optim.Optimizer, lr: LearningRate) -> None:
    """A number, or a schedule (a callable of the step) in place of either."""
    if callable(lr):
        optimizer._schedulers["learning_rate"] = lr
        optimizer.state["learning_rate"] = lr(optimizer.step)
    else:
        optimizer._schedulers.pop("learning_rate", None)
        optimizer.learning_rate = mx.array(lr, mx.float32)


def _set_raw(optimizer: optim.Optimizer, changes: dict[str, Any]) -> None:
    """An mlx optimizer used as it is: ``lr`` and its own Python attributes."""
    for name in changes:
        if name != "lr" and (not hasattr(optimizer, name) or name.startswith("_")
                             or isinstance(getattr(optimizer, name), mx.array)):
            raise TypeError(
                f"adjust: {type(optimizer).__name__} has no hyperparameter {name!r}; give "
                f"lr, or one of its attributes "
                f"({', '.join(k for k in vars(optimizer) if not k.startswith('_'))})"
            )
    for name, value in changes.items():
        if name == "lr":
            _set_learning_rate(optimizer, _lr(value, "adjust"))
        else:
            setattr(optimizer, name, value)
