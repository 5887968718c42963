"""Changing a live optimiser state's hyperparameters: :func:`adjust`, Optimisers.jl's
``adjust!``."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim

from .accumulate import AccumGrad, _Accumulating
from .rules import (
    _OPTIMIZER_NAMES,
    FOLLOWED,
    GradientTransform,
    LearningRate,
    OptimiserChain,
    Rule,
    _as_number,
    _Chained,
    _lr,
    _unchecked,
)
from .state import OptState

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
    rule, optimizer = opt_state.rule, opt_state.optimizer  # (the live values: read once)
    for name in changes:
        if name in _FLUX_NAMES and not (name == "beta" and "beta" in _fields(rule)):
            raise TypeError(
                f"adjust: unknown keyword {name!r}; fluxlike's name is "
                f"{_FLUX_NAMES[name]}: adjust(opt_state, {_FLUX_NAMES[name]}=...)"
            )
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


def recorded(rule: Any) -> dict[str, Any] | None:
    """``rule``'s hyperparameters as plain data, as a checkpoint records them (JSON):
    ``{"type": "Adam", "fields": {"lr": 0.05, "betas": [0.5, 0.6], "eps": 0.001}}``, an
    :class:`~fluxlike.OptimiserChain` as ``{"type": "OptimiserChain", "parts": [...]}``, a
    rule inside another (:class:`~fluxlike.AccumGrad`'s) in its field. A schedule (a
    function, which a file cannot hold) is recorded by its name, ``{"schedule": ...}``.
    ``None`` where a part is not one of fluxlike's rules (a subclass of one, a rule of your
    own: their optimisers' settings are unknown here) or holds a value that is not plain.

    >>> from fluxlike import Adam, ClipNorm, OptimiserChain
    >>> recorded(OptimiserChain(ClipNorm(1.0), Adam(0.05, betas=(0.5, 0.6))))
    {'type': 'OptimiserChain', 'parts': [{'type': 'ClipNorm', 'fields': {'max_norm': 1.0}},
    {'type': 'Adam', 'fields': {'lr': 0.05, 'betas': [0.5, 0.6], 'eps': 1e-08}}]}
    """
    if isinstance(rule, OptimiserChain):
        parts = [recorded(part) for part in rule.parts]
        return None if None in parts else {"type": "OptimiserChain", "parts": parts}
    if not dataclasses.is_dataclass(rule) or isinstance(rule, type) or not (
        type(rule) in FOLLOWED or type(rule) is AccumGrad or isinstance(rule, GradientTransform)
    ):
        return None
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(rule):
        value = getattr(rule, field.name)
        if isinstance(value, (Rule, GradientTransform)):
            value = recorded(value)
            if value is None:
                return None
        elif callable(value):
            value = {"schedule": getattr(value, "__qualname__", type(value).__name__)}
        elif isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
            value = list(value)
        elif value is not None and not isinstance(value, _PLAIN):
            return None
        fields[field.name] = value
    return {"type": type(rule).__name__, "fields": fields}


_PLAIN = (bool, int, float, str)


class ScheduleNotStored(ValueError):
    """:func:`restored`: the record has a schedule for a field (by its name, ``schedule``)
    where the rule given has a number (``value``)."""

    def __init__(self, field: str, schedule: Any, value: Any):
        super().__init__(f"{field} was a schedule ({schedule}), given {value!r}")
        self.field, self.schedule, self.value = field, schedule, value


def restored(rule: Any, record: Any, learning_rate: mx.array | None = None) -> Any:
    """``rule`` (an optimiser state's :attr:`~fluxlike.OptState.rule`) with the
    hyperparameters of ``record`` (from :func:`recorded`); ``None`` where ``record`` is of
    another structure (another rule, another chain). The record is checked whatever
    ``rule`` is, by the constructors of the rules it names (:func:`saved_rule`): a
    malformed one is a ``ValueError`` saying what is wrong.

    A recorded learning rate that is a number is ``learning_rate``'s value where one is
    given (the state's array, which a checkpoint also holds and which
    :meth:`~fluxlike.OptState.load_state` checks; the recorded number where it is the same
    float32), and is not checked here (0 is a warm-up's start). A schedule cannot be
    stored: where ``record`` has one, ``rule``'s own schedule stays, and a number there
    raises :class:`ScheduleNotStored`.

    >>> from fluxlike import Adam, Descent
    >>> restored(Adam(), recorded(Adam(0.05, betas=(0.5, 0.6))))
    Adam(lr=0.05, betas=(0.5, 0.6), eps=1e-08)
    >>> restored(Descent(), recorded(Adam())) is None
    True
    """
    saved = saved_rule(record)
    if saved is None or not _alike(rule, saved):
        return None
    return _merged(rule, saved, learning_rate)


class _Schedule:
    """A recorded schedule, by its name: what :func:`saved_rule` puts in its place."""

    def __init__(self, name: Any):
        self.name = name

    def __call__(self, step: mx.array) -> mx.array:
        raise TypeError(f"the schedule {self.name} was not stored (a function)")

    def __repr__(self) -> str:
        return f"<schedule {self.name}>"


def saved_rule(record: Any) -> Any:
    """The rule a :func:`recorded` record describes, checked by its constructor (a
    schedule shown by its name; a learning rate that is a number as recorded, unchecked:
    see :func:`restored`); ``None`` where it names a gradient transform this process does not
    know (one of the user's own, not imported). A ``ValueError`` says what is wrong with a
    malformed record."""
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        raise ValueError(f"a rule's record is an object with a 'type', got {str(record)[:80]}")
    kind = record["type"]
    if kind == "OptimiserChain":
        parts = record.get("parts")
        if not isinstance(parts, list) or set(record) != {"type", "parts"}:
            raise ValueError(f"{kind} records no list of parts: {str(record)[:80]}")
        built = [saved_rule(part) for part in parts]
        if any(part is None for part in built):
            return None
        return _made(OptimiserChain, built, {})
    fields = record.get("fields")
    if not isinstance(fields, dict) or set(record) != {"type", "fields"}:
        raise ValueError(f"{kind} records no object of fields: {str(record)[:80]}")
    cls = _known(kind)
    if cls is None:
        return None
    names = [field.name for field in dataclasses.fields(cls)]
    if sorted(fields) != sorted(names):
        raise ValueError(f"{kind} records the fields {str(fields)[:80]}, its fields are "
                         f"{', '.join(names)}")
    values, lr = {}, None
    for name in names:
        saved = fields[name]
        if isinstance(saved, dict) and set(saved) == {"schedule"}:
            value: Any = _Schedule(saved["schedule"])
        elif isinstance(saved, dict):
            value = saved_rule(saved)
            if value is None:
                return None
        elif name == "lr":
            if isinstance(saved, bool) or not isinstance(saved, (int, float)):
                raise ValueError(f"{kind} records lr={str(saved)[:80]}, not a number")
            value, lr = 1.0, float(saved)  # (a stand-in for the constructor: see restored)
        elif isinstance(saved, list):
            value = tuple(saved)
        else:
            value = saved
        values[name] = value
    rule = _made(cls, (), values)
    return rule if lr is None else _unchecked(rule, {"lr": lr})


def _made(cls: type, args: Any, kwargs: dict[str, Any]) -> Any:
    try:
        return cls(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cls.__name__} refuses the recorded values: {e}") from None


def _known(name: str) -> type | None:
    """The dataclass rule or gradient transform (fluxlike's, or one of the user's) whose
    record has the type ``name``."""
    transforms: list[type] = []
    todo: list[type] = [GradientTransform]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        transforms.append(cls)
    for cls in (*FOLLOWED, AccumGrad, *transforms):
        if cls.__name__ == name and dataclasses.is_dataclass(cls):
            return cls
    return None


def _alike(rule: Any, saved: Any) -> bool:
    """Whether ``rule`` and ``saved`` are the same rules, chained and wrapped alike."""
    if type(rule) is not type(saved) or recorded(rule) is None:
        return False
    if isinstance(rule, OptimiserChain):
        return len(rule.parts) == len(saved.parts) and all(
            _alike(a, b) for a, b in zip(rule.parts, saved.parts, strict=True))
    return all(_alike(getattr(rule, f.name), getattr(saved, f.name))
               for f in dataclasses.fields(rule)
               if isinstance(getattr(rule, f.name), (Rule, GradientTransform)))


def _merged(rule: Any, saved: Any, learning_rate: mx.array | None) -> Any:
    """``saved`` (alike ``rule``) with ``rule``'s schedules where it has recorded ones and the
    state's ``learning_rate`` for a number (see :func:`restored`)."""
    if isinstance(rule, OptimiserChain):
        return OptimiserChain(*(_merged(a, b, learning_rate)
                                for a, b in zip(rule.parts, saved.parts, strict=True)))
    values = {}
    for field in dataclasses.fields(rule):
        current, value = getattr(rule, field.name), getattr(saved, field.name)
        if isinstance(current, (Rule, GradientTransform)):
            values[field.name] = _merged(current, value, learning_rate)
        elif isinstance(value, _Schedule):
            if not callable(current):
                raise ScheduleNotStored(field.name, value.name, current)
            values[field.name] = current  # (a function is not stored: the schedule given stays)
        elif field.name == "lr" and isinstance(learning_rate, mx.array) and (
                learning_rate.size == 1):
            values[field.name] = _as_number(learning_rate, value)
    return _unchecked(saved, values) if values else saved


def replaced_schedules(rule: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """``(field, schedule, number)`` where ``rule`` has a schedule and ``new`` (``rule`` as
    :func:`restored` gives it) the number the record had there.

    >>> from mlx.optimizers import step_decay
    >>> from fluxlike import Adam
    >>> [(field, number) for field, _, number in replaced_schedules(
    ...     Adam(step_decay(0.1, 0.5, 10)), Adam(0.05))]
    [('lr', 0.05)]
    """
    if isinstance(rule, OptimiserChain):
        return [found for a, b in zip(rule.parts, new.parts, strict=True)
                for found in replaced_schedules(a, b)]
    found = []
    for field in dataclasses.fields(rule):
        current, value = getattr(rule, field.name), getattr(new, field.name)
        if isinstance(current, (Rule, GradientTransform)):
            found += replaced_schedules(current, value)
        elif callable(current) and not callable(value):
            found.append((field.name, current, value))
    return found


def follow(opt_state: OptState, rule: Rule) -> None:
    """Make ``opt_state``'s optimiser follow ``rule`` (of the structure of its own rule, as
    :func:`restored` makes it), keeping its state; ``opt_state.rule`` becomes ``rule``."""
    _apply(opt_state.rule, rule, opt_state.optimizer)
    opt_state.rule = rule


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
