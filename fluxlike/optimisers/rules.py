"""Optimisation rules with Flux's names, built on ``mlx.optimizers``.

A rule is a small immutable description (``Adam(1e-3)``); :func:`~fluxlike.setup` turns it
into an initialised ``mlx.optimizers.Optimizer`` for one model. The update formulas are
those of Flux (Optimisers.jl):

========================================  ==========================================
rule                                      mlx.optimizers equivalent
========================================  ==========================================
``Descent(lr)``                           ``SGD(lr)`` (no momentum buffer is kept)
``Momentum(lr, rho)``                     ``SGD(lr, momentum=rho)``
``Nesterov(lr, rho)``                     ``SGD(lr, momentum=rho, nesterov=True)``
``RMSProp(lr, rho, eps)``                 ``RMSprop(lr, alpha=rho, eps=eps)``
``Adam(lr, betas, eps)``                  ``Adam(lr, betas, eps, bias_correction=True)``
``AdamW(lr, betas, eps, weight_decay)``   ``AdamW(..., bias_correction=True)``
``Lion(lr, betas, weight_decay)``         ``Lion(lr, betas, weight_decay)``
========================================  ==========================================

(Flux's ``Momentum`` keeps ``lr * velocity``, MLX keeps the velocity; the steps are the same
for a constant learning rate.) ``lr`` may be a number or an ``mlx.optimizers`` schedule
(a callable of the step count, e.g. ``mlx.optimizers.cosine_decay(1e-3, 1000)``).

Gradient clipping goes in front of a rule with :class:`OptimiserChain`:
``OptimiserChain(ClipNorm(1.0), Adam(1e-3))``. Unlike Optimisers.jl's per-array
``ClipNorm``, :class:`ClipNorm` clips the *global* norm of all gradients together (as
PyTorch's ``clip_grad_norm_`` and ``mlx.optimizers.clip_grad_norm`` do).

The optimiser a rule builds knows the rule it follows (:func:`following`): its repr is that
rule's, with the values it holds now (after :func:`~fluxlike.adjust`, an assignment to its
``learning_rate`` or a checkpoint load), not those it was built with.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from .. import native

LearningRate = float | Callable[[mx.array], mx.array]
Tree = Any


def _lr(value: Any, rule: str) -> LearningRate:
    if callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"[{rule}] lr must be a positive number or a schedule (a callable of the step), "
            f"got {value!r}"
        )
    if not math.isfinite(value):  # one step would make every parameter inf or nan
        raise ValueError(f"[{rule}] lr must be finite, got {value!r}")
    return float(value)


def _fraction(value: Any, name: str, rule: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"[{rule}] {name} must be a number in [0, 1), got {value!r}")
    return float(value)


def _betas(value: Any, rule: str) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"[{rule}] betas must be a pair (beta1, beta2), got {value!r}")
    return (_fraction(value[0], "betas[0]", rule), _fraction(value[1], "betas[1]", rule))


def _nonnegative(value: Any, name: str, rule: str, strict: bool = False) -> float:
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    if bad or not math.isfinite(value) or value < 0 or (strict and value == 0):
        kind = "positive" if strict else "non-negative"
        raise ValueError(f"[{rule}] {name} must be a {kind} number, got {value!r}")
    return float(value)


# mlx.optimizers' and PyTorch's keywords, as fluxlike spells them
_ALIASES = {"learning_rate": "lr", "momentum": "rho", "alpha": "rho", "clip_value": "delta",
            "max_grad_norm": "max_norm"}
# ... and where a rule lacks one: the rules that take it
_ELSEWHERE = {"weight_decay": "; AdamW and Lion take weight_decay",
              "momentum": "; Momentum and Nesterov take it as rho",
              "beta1": "; give betas=(beta1, beta2)", "beta2": "; give betas=(beta1, beta2)"}


def _clear_keywords(cls: type[Any]) -> type:
    """Give a dataclass rule an ``__init__`` that names fluxlike's keyword when given another
    library's (``Adam(learning_rate=1e-3)``); its signature, repr and equality stay the
    dataclass's."""
    init = cls.__init__
    fields = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        for name, value in kwargs.items():
            if name not in fields:
                alias = _ALIASES.get(name)
                fix = f"fluxlike's name is {alias}: {cls.__name__}({alias}={value!r})" \
                    if alias in fields else \
                    f"the keywords are {', '.join(fields)}{_ELSEWHERE.get(name, '')}"
                raise TypeError(f"[{cls.__name__}] unknown keyword {name!r}; {fix}")
        init(self, *args, **kwargs)

    cls.__init__ = checked
    return cls


class Rule:
    """Base class of optimisation rules: :meth:`build` makes a fresh mlx optimizer."""

    def build(self) -> optim.Optimizer:
        """A new, uninitialised ``mlx.optimizers.Optimizer`` following this rule."""
        raise NotImplementedError


class GradientTransform:
    """Base class of gradient transforms (clipping, weight decay), placed before a rule in a
    chain. ``transform(grads)`` returns the new gradients; a transform that needs the
    parameters too sets ``uses_params = True`` and is called ``transform(grads, params)``."""

    uses_params = False

    def __call__(self, grads: Tree) -> Tree:
        raise NotImplementedError


class _Follows:
    """For the mlx optimizers that fluxlike's rules build: :meth:`following` is the rule the
    optimizer follows now, and its repr is that rule's (``Adam(lr=0.05, betas=(0.5, 0.6),
    eps=0.001)``, not ``<..._Adam object at 0x...>``). For a dataclass rule's optimizer the
    rule's fields are read back from the optimizer's live settings: ``learning_rate`` (its
    schedule, if it has one) and the attributes :data:`_OPTIMIZER_NAMES` names."""

    rule_type: ClassVar[type]  # the rule that builds it (set by @_builds on the rule)

    def following(self, given: Any = None) -> Any:
        """The rule this optimizer follows now; ``given`` is the rule it was built (or
        adjusted) with, whose learning rate is kept where it is the one the optimizer holds
        (``Adam(0.1234567891)`` keeps its lr, where the float32 value alone would show
        0.12345679)."""
        optimizer = cast(optim.Optimizer, self)
        cls = self.rule_type
        if given is not None and not isinstance(given, cls):  # built by another rule
            return given
        values = {}
        for field in dataclasses.fields(cls):
            if field.name == "lr":
                values["lr"] = _live_lr(optimizer, getattr(given, "lr", None))
                continue
            value = getattr(optimizer, _OPTIMIZER_NAMES.get((cls, field.name), field.name))
            values[field.name] = tuple(value) if isinstance(value, list) else value
        if given is None:
            return _unchecked(cls, values)
        if all(getattr(given, k) == v for k, v in values.items()):
            return given
        return _unchecked(given, values)  # (a subclass of the rule keeps its own fields)

    def __repr__(self) -> str:
        return repr(self.following())


def following(optimizer: optim.Optimizer, given: Any = None) -> Any:
    """The rule ``optimizer`` follows now (see :class:`_Follows`): ``given`` (the rule that
    built it) with the values of its hyperparameters that ``optimizer`` holds now; ``given``
    as it is for an optimizer fluxlike did not build.

    >>> import mlx.core as mx
    >>> from fluxlike import Adam
    >>> optimizer = Adam(1e-3).build()
    >>> optimizer.learning_rate, optimizer.betas = mx.array(0.05), [0.5, 0.6]
    >>> optimizer
    Adam(lr=0.05, betas=(0.5, 0.6), eps=1e-08)
    >>> following(optimizer, Adam(1e-3)) == Adam(0.05, betas=(0.5, 0.6))
    True
    """
    return optimizer.following(given) if isinstance(optimizer, _Follows) else given


def _live_lr(optimizer: optim.Optimizer, given: Any) -> Any:
    """The learning rate ``optimizer`` uses now: its schedule if it has one, else the number
    it holds, written as the shortest decimal of its float32 value (``given`` where that is
    the same float32)."""
    schedule = optimizer._schedulers.get("learning_rate")
    if schedule is not None:
        return schedule
    value = optimizer.state.get("learning_rate")
    if not isinstance(value, mx.array) or value.size != 1:  # not one number: as it is
        return given if value is None else value
    return _as_number(value, given)


def _as_number(value: mx.array, given: Any = None) -> float:
    """A one-element array (a learning rate) as a Python float: ``given`` where that is the
    same float32 value, else the shortest decimal of the value as a float32."""
    number = np.float32(cast(float, value.astype(mx.float32).item()))
    if isinstance(given, (int, float)) and not isinstance(given, bool) and (
        np.float32(given) == number
    ):
        return float(given)
    return float(str(number))  # numpy writes a float32 with its shortest decimal


def _unchecked(base: Any, values: dict[str, Any]) -> Any:
    """A frozen dataclass rule holding ``values`` as they are (``base``: its class, or a rule
    whose other fields it keeps): a rule read back from a live optimizer shows what it
    holds, even a value its constructor would refuse."""
    rule = object.__new__(base) if isinstance(base, type) else copy.copy(base)
    for name, value in values.items():
        object.__setattr__(rule, name, value)
    return rule


# The dataclass rules whose optimizers follow them (@_builds): their fields can be read back
# from a live optimizer and set on it, so checkpoints record and restore them.
FOLLOWED: set[type] = set()


def _builds(*optimizers: type[_Follows]) -> Callable[[type], type]:
    """Class decorator of a dataclass rule: the mlx optimizer classes that it builds, whose
    :meth:`_Follows.following` reads this rule's fields."""
    def mark(rule: type) -> type:
        for optimizer in optimizers:
            optimizer.rule_type = rule
        FOLLOWED.add(rule)
        return rule

    return mark


# The smallest eps a float16 parameter's step uses, as Optimisers.jl's _eps: 1e-8 is 0 in
# float16, and a zero gradient then divides 0 by 0 (NaN in an f16mix model's first steps).
FLOAT16_EPS = 1e-7


class _HalfEps:
    """For an mlx optimiser with ``eps``: the step of a float16 parameter uses at least
    ``FLOAT16_EPS``. (eps is restored at once: a compiled step sees no Python change.)"""

    eps: float

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        if parameter.dtype != mx.float16 or self.eps >= FLOAT16_EPS:
            return super().apply_single(gradient, parameter, state)  # type: ignore[misc]  # mixin
        eps, self.eps = self.eps, FLOAT16_EPS
        try:
            return super().apply_single(gradient, parameter, state)  # type: ignore[misc]  # mixin
        finally:
            self.eps = eps


class _NativeAdam:
    """For mlx's Adam and AdamW (bias-corrected): on the CPU, the update of a float32 or
    bfloat16 parameter (gradient and moments of its dtype) is one pass of the native
    companion's kernel (:func:`fluxlike.native.adam_kernel`), which computes MLX's arithmetic
    bit for bit; MLX's own CPU kernels for it are scalar (``bench/README.md``,
    *bench/jit.py*). Anything else (float16, mixed dtypes, a learning rate that is not one
    number, the GPU) takes MLX's update."""

    betas: list[float]
    eps: float
    bias_correction: bool
    step: mx.array
    learning_rate: mx.array
    weight_decay: float  # AdamW's

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        kernel = native.adam_kernel()
        m, v, dtype = state.get("m"), state.get("v"), parameter.dtype
        if not (self.bias_correction
                and _native_update_takes(kernel, self.learning_rate, parameter, gradient, m, v)):
            return super().apply_single(gradient, parameter, state)  # type: ignore[misc]  # mixin
        assert kernel is not None
        # The scalars as MLX's Adam.apply_single (and AdamW's) compute them.
        lr = self.learning_rate.astype(dtype)
        b1, b2 = self.betas
        c1 = (lr / (1 - b1**self.step)).astype(dtype)
        c2 = mx.rsqrt(1 - b2**self.step).astype(dtype)
        decay = 1 - lr * self.weight_decay if isinstance(self, optim.AdamW) else None
        keeping = getattr(self, KEEP, None)  # a step that keeps its state if not finite
        new, state["m"], state["v"] = kernel(parameter, gradient, m, v, c1, c2, decay, b1, b2,
                                             self.eps, keep=None if keeping is None else keeping[0])
        if keeping is not None:
            keeping[1].update((id(new), id(state["m"]), id(state["v"])))
        return new


# The attribute through which compiled.step hands a native update its keep flag:
# ``(finite, ids)``, a 0-d bool and the set into which the update adds the ids of the arrays
# it already kept (given back unchanged where the flag is false), which the step then does not
# select again.
KEEP = "_fluxlike_keep"


def _native_update_takes(kernel: Callable | None, learning_rate: mx.array,
                         parameter: mx.array, *arrays: mx.array | None) -> bool:
    """Whether a native update ``kernel`` takes this parameter: the kernels are in use, the
    default device is the CPU, the learning rate is one number, and the parameter is float32
    or bfloat16 with its gradient and state ``arrays`` (present) of its dtype."""
    dtype = parameter.dtype
    return (kernel is not None and dtype in _NATIVE_UPDATE_DTYPES
            and all(a is not None and a.dtype == dtype for a in arrays)
            and mx.default_device() == mx.cpu and learning_rate.ndim == 0)


_NATIVE_UPDATE_DTYPES = (mx.float32, mx.bfloat16)


class _NativeRMSprop:
    """For mlx's RMSprop: on the CPU, the update of a float32 or bfloat16 parameter (gradient
    and ``v`` of its dtype) is one pass of the native kernel
    (:func:`fluxlike.native.rmsprop_kernel`), with MLX's bits; anything else MLX's update."""

    alpha: float
    eps: float
    learning_rate: mx.array

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        kernel, v = native.rmsprop_kernel(), state.get("v")
        if not _native_update_takes(kernel, self.learning_rate, parameter, gradient, v):
            return super().apply_single(gradient, parameter, state)  # type: ignore[misc]  # mixin
        assert kernel is not None
        new, state["v"] = kernel(parameter, gradient, v,
                                 self.learning_rate.astype(parameter.dtype), self.alpha,
                                 self.eps)
        return new


class _Adam(_HalfEps, _NativeAdam, optim.Adam, _Follows):
    pass


class _AdamW(_HalfEps, _NativeAdam, optim.AdamW, _Follows):
    pass


class _RMSprop(_HalfEps, _NativeRMSprop, optim.RMSprop, _Follows):
    pass


class _Descent(optim.SGD, _Follows):
    """Plain SGD that keeps no (unused) momentum buffer."""

    def init_single(self, parameter: mx.array, state: dict) -> None:
        pass


class _Momentum(optim.SGD, _Follows):
    pass


class _Nesterov(optim.SGD, _Follows):
    pass


class _Lion(optim.Lion, _Follows):
    pass


@_clear_keywords
@_builds(_Descent)
@dataclass(frozen=True)
class Descent(Rule):
    """Plain gradient descent: ``w -= lr * g``.

    >>> from fluxlike import Descent
    >>> Descent()
    Descent(lr=0.1)
    """

    lr: LearningRate = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _lr(self.lr, "Descent"))

    def build(self) -> optim.Optimizer:
        return _Descent(self.lr)


@_clear_keywords
@_builds(_Momentum)
@dataclass(frozen=True)
class Momentum(Rule):
    """Gradient descent with momentum: ``v = rho * v + g``, ``w -= lr * v``.

    >>> from fluxlike import Momentum
    >>> Momentum(0.05)
    Momentum(lr=0.05, rho=0.9)
    """

    lr: LearningRate = 0.01
    rho: float = 0.9

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _lr(self.lr, "Momentum"))
        object.__setattr__(self, "rho", _fraction(self.rho, "rho", "Momentum"))

    def build(self) -> optim.Optimizer:
        return _Momentum(self.lr, momentum=self.rho)


@_clear_keywords
@_builds(_Nesterov)
@dataclass(frozen=True)
class Nesterov(Rule):
    """Nesterov momentum: ``v = rho * v + g``, ``w -= lr * (g + rho * v)``.

    >>> from fluxlike import Nesterov
    >>> Nesterov()
    Nesterov(lr=0.001, rho=0.9)
    """

    lr: LearningRate = 0.001
    rho: float = 0.9

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _lr(self.lr, "Nesterov"))
        rho = _fraction(self.rho, "rho", "Nesterov")
        if rho == 0:
            raise ValueError("[Nesterov] rho must be in (0, 1), got 0; use Descent for none")
        object.__setattr__(self, "rho", rho)

    def build(self) -> optim.Optimizer:
        return _Nesterov(self.lr, momentum=self.rho, nesterov=True)


@_clear_keywords
@_builds(_RMSprop)
@dataclass(frozen=True)
class RMSProp(Rule):
    """RMSProp: ``a = rho * a + (1 - rho) * g**2``, ``w -= lr * g / (sqrt(a) + eps)``.

    >>> from fluxlike import RMSProp
    >>> RMSProp()
    RMSProp(lr=0.001, rho=0.9, eps=1e-08)
    """

    lr: LearningRate = 0.001
    rho: float = 0.9
    eps: float = 1e-8

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _lr(self.lr, "RMSProp"))
        object.__setattr__(self, "rho", _fraction(self.rho, "rho", "RMSProp"))
        object.__setattr__(self, "eps", _nonnegative(self.eps, "eps", "RMSProp", strict=True))

    def build(self) -> optim.Optimizer:
        return _RMSprop(self.lr, alpha=self.rho, eps=self.eps)


@_clear_keywords
@_builds(_Adam)
@dataclass(frozen=True)
class Adam(Rule):
    """Adam with bias correction (as in Flux and PyTorch):
    ``w -= lr * m̂ / (sqrt(v̂) + eps)``.

    The correction counts the steps of the whole optimiser (MLX's ``step``), where PyTorch
    and Optimisers.jl count each parameter's: a parameter updated only on some steps (a part
    thawed later, alternating updates of two parts) gets a smaller correction than there,
    and larger first steps. Give parts updated on their own their own ``setup``.

    A float16 parameter's step uses ``max(eps, 1e-7)`` (``FLOAT16_EPS``, as Optimisers.jl):
    the default 1e-8 is 0 in float16, where a zero gradient would divide 0 by 0. The same
    holds for :class:`AdamW` and :class:`RMSProp`.

    On the CPU, where the native companion is built, a float32 or bfloat16 parameter's update
    (Adam's, :class:`AdamW`'s and :class:`RMSProp`'s) is one vectorised pass of its kernel
    (:func:`fluxlike.native.adam_kernel`), with the bits of MLX's update: about 3× faster than
    MLX's compiled update (5× its eager one) on a 17 M-parameter MLP (``bench/adam.py``).

    >>> from fluxlike import Adam
    >>> Adam(1e-3)
    Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08)
    """

    lr: LearningRate = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        name = type(self).__name__
        object.__setattr__(self, "lr", _lr(self.lr, name))
        object.__setattr__(self, "betas", _betas(self.betas, name))
        object.__setattr__(self, "eps", _nonnegative(self.eps, "eps", name))

    def build(self) -> optim.Optimizer:
        return _Adam(self.lr, betas=list(self.betas), eps=self.eps, bias_correction=True)


@_clear_keywords
@_builds(_AdamW)
@dataclass(frozen=True)
class AdamW(Adam):
    """Adam with decoupled weight decay: ``w -= lr * (adam_step + weight_decay * w)``.

    >>> from fluxlike import AdamW
    >>> AdamW(weight_decay=0.1)
    AdamW(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.1)
    """

    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        wd = _nonnegative(self.weight_decay, "weight_decay", "AdamW")
        object.__setattr__(self, "weight_decay", wd)

    def build(self) -> optim.Optimizer:
        return _AdamW(
            self.lr, betas=list(self.betas), eps=self.eps,
            weight_decay=self.weight_decay, bias_correction=True,
        )


@_clear_keywords
@_builds(_Lion)
@dataclass(frozen=True)
class Lion(Rule):
    """Lion: ``w -= lr * (sign(beta1 * m + (1 - beta1) * g) + weight_decay * w)``,
    ``m = beta2 * m + (1 - beta2) * g``.

    >>> from fluxlike import Lion
    >>> Lion()
    Lion(lr=0.0001, betas=(0.9, 0.99), weight_decay=0.0)
    """

    lr: LearningRate = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _lr(self.lr, "Lion"))
        object.__setattr__(self, "betas", _betas(self.betas, "Lion"))
        wd = _nonnegative(self.weight_decay, "weight_decay", "Lion")
        object.__setattr__(self, "weight_decay", wd)

    def build(self) -> optim.Optimizer:
        return _Lion(self.lr, betas=list(self.betas), weight_decay=self.weight_decay)


@_clear_keywords
@dataclass(frozen=True)
class ClipNorm(GradientTransform):
    """Scale all gradients down together so that their global L2 norm is at most
    ``max_norm`` (``mlx.optimizers.clip_grad_norm``). Use it in an :class:`OptimiserChain`.

    >>> import mlx.core as mx
    >>> from fluxlike import ClipNorm
    >>> ClipNorm(1.0)({"w": mx.array([3.0, 4.0])})["w"]
    array([0.6, 0.8], dtype=float32)
    """

    max_norm: float

    def __post_init__(self) -> None:
        value = _nonnegative(self.max_norm, "max_norm", "ClipNorm", strict=True)
        object.__setattr__(self, "max_norm", value)

    def __call__(self, grads: Tree) -> Tree:
        return optim.clip_grad_norm(grads, self.max_norm)[0]


@_clear_keywords
@dataclass(frozen=True)
class ClipValue(GradientTransform):
    """Clip every gradient entry to ``[-delta, delta]`` (Flux's ``ClipGrad``). Use it in an
    :class:`OptimiserChain`.

    >>> import mlx.core as mx
    >>> from fluxlike import ClipValue
    >>> ClipValue(0.5)({"w": mx.array([-2.0, 0.25, 3.0])})["w"]
    array([-0.5, 0.25, 0.5], dtype=float32)
    """

    delta: float

    def __post_init__(self) -> None:
        value = _nonnegative(self.delta, "delta", "ClipValue", strict=True)
        object.__setattr__(self, "delta", value)

    def __call__(self, grads: Tree) -> Tree:
        def clip(g: Any) -> Any:
            if isinstance(g, mx.array) and mx.issubdtype(g.dtype, mx.floating):
                return mx.clip(g, -self.delta, self.delta)
            return g

        return tree_map(clip, grads)


@_clear_keywords
@dataclass(frozen=True)
class WeightDecay(GradientTransform):
    """Add ``decay * w`` to each parameter's gradient (L2 regularisation; Flux's
    ``WeightDecay``): ``OptimiserChain(WeightDecay(5e-4), Momentum())``. Before Adam this
    is Adam's coupled decay; :class:`AdamW` decouples it.

    >>> import mlx.core as mx
    >>> from fluxlike import WeightDecay
    >>> WeightDecay(0.5)({"w": mx.array([1.0, -1.0])}, {"w": mx.array([2.0, 4.0])})["w"]
    array([2, 1], dtype=float32)
    """

    decay: float = 5e-4
    uses_params = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "decay", _nonnegative(self.decay, "decay", "WeightDecay"))

    # uses_params: called with the parameters too, unlike the base class
    def __call__(self, grads: Tree, params: Tree) -> Tree:  # type: ignore[override]
        def decayed(g: Any, w: Any) -> Any:
            if isinstance(g, mx.array) and mx.issubdtype(g.dtype, mx.floating):
                return g + (self.decay * w).astype(g.dtype)
            return g

        return tree_map(decayed, grads, params)


# A rule's field that its mlx optimizer keeps under another name.
_OPTIMIZER_NAMES: dict[tuple[type, str], str] = {
    (RMSProp, "rho"): "alpha", (Momentum, "rho"): "momentum", (Nesterov, "rho"): "momentum",
}


class _Chained(optim.Optimizer, _Follows):
    """An mlx optimizer applying gradient transforms, then an inner optimizer. Its state is
    the inner optimizer's state (the transforms are stateless)."""

    def __init__(self, transforms: tuple[GradientTransform, ...], inner: optim.Optimizer):
        super().__init__()
        self.transforms = transforms
        self.inner = inner

    def following(self, given: Any = None) -> Any:
        parts = given.parts if isinstance(given, OptimiserChain) else ()
        rule = following(self.inner, parts[-1] if parts else None)
        if rule is None:  # an inner optimizer fluxlike did not build, and no rule given
            return given
        chain = object.__new__(OptimiserChain)  # (unchecked, as _Follows' rules)
        chain.parts = (*self.transforms, rule)
        return given if chain == given else chain

    def __repr__(self) -> str:
        return f"OptimiserChain({', '.join(map(repr, (*self.transforms, self.inner)))})"

    def init(self, parameters: dict) -> None:
        self.inner.init(parameters)

    def apply_gradients(self, gradients: dict, parameters: dict) -> dict:
        for transform in self.transforms:
            if transform.uses_params:  # then called with the parameters too
                gradients = cast("Callable[[dict, dict], dict]", transform)(gradients, parameters)
            else:
                gradients = transform(gradients)
        return self.inner.apply_gradients(gradients, parameters)

    @property
    def state(self) -> dict:
        return self.inner.state

    @state.setter
    def state(self, state: dict) -> None:
        self.inner.state = state

    @property
    def learning_rate(self) -> mx.array:
        return self.inner.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: float | mx.array) -> None:
        self.inner.learning_rate = learning_rate


class OptimiserChain(Rule):
    """Gradient transforms (:class:`ClipNorm`, :class:`ClipValue`, :class:`WeightDecay`) applied
    in order, then one rule last: ``OptimiserChain(ClipNorm(1.0), Adam(1e-3))``.

    >>> from fluxlike import Adam, ClipNorm, OptimiserChain
    >>> OptimiserChain(ClipNorm(1.0), Adam())
    OptimiserChain(ClipNorm(max_norm=1.0), Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08))
    """

    def __init__(self, *parts: GradientTransform | Rule):
        if not parts or not isinstance(parts[-1], Rule) or isinstance(parts[-1], OptimiserChain):
            raise ValueError(
                f"[OptimiserChain] the last part must be a rule such as Adam(), got {parts!r}"
            )
        for part in parts[:-1]:
            if not isinstance(part, GradientTransform):
                raise ValueError(
                    f"[OptimiserChain] parts before the rule must be gradient transforms "
                    f"(ClipNorm, ClipValue, WeightDecay), got {part!r}"
                )
        self.parts = parts

    def __repr__(self) -> str:
        return f"OptimiserChain({', '.join(map(repr, self.parts))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OptimiserChain) and self.parts == other.parts

    def __hash__(self) -> int:
        return hash(self.parts)

    def build(self) -> optim.Optimizer:
        # (checked in __init__: transforms, then one rule)
        transforms = cast("tuple[GradientTransform, ...]", self.parts[:-1])
        return _Chained(transforms, cast(Rule, self.parts[-1]).build())
