"""Rules that use only the sign of the gradient (Optimisers.jl's ``Rprop`` and ``Signum``)
or of the weight (``SignDecay``, L1 regularisation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_map

from .rules import (
    GradientTransform,
    LearningRate,
    Rule,
    Tree,
    _builds,
    _clear_keywords,
    _Follows,
    _fraction,
    _lr,
    _nonnegative,
)


def _pair(value: Any, name: str, rule: str, low: float, high: float | None) -> tuple[float, float]:
    """A pair ``(a, b)`` with ``low < a <= b`` (and ``a < high < b`` when ``high``)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"[{rule}] {name} must be a pair (a, b), got {value!r}")
    a, b = (_nonnegative(v, f"{name}[{i}]", rule) for i, v in enumerate(value))
    ok = low < a <= b if high is None else low < a < high < b
    if not ok:
        want = f"{low} < a <= b" if high is None else f"{low} < a < {high} < b"
        raise ValueError(f"[{rule}] {name} must be a pair (a, b) with {want}, got {value!r}")
    return (a, b)


class _Rprop(optim.Optimizer, _Follows):
    """Per-entry step sizes, grown while the gradient keeps its sign, shrunk when it flips."""

    def __init__(self, learning_rate: float, etas: tuple[float, float],
                 step_sizes: tuple[float, float]):
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.etas = etas
        self.step_sizes = step_sizes

    def init_single(self, parameter: mx.array, state: dict) -> None:
        state["g"] = mx.zeros_like(parameter)
        # (mx.full of an array value ignores its dtype argument: MLX 0.32)
        state["step_size"] = mx.zeros_like(parameter) + self.learning_rate.astype(parameter.dtype)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        (shrink, grow), (smallest, largest) = self.etas, self.step_sizes
        same = state["g"] * gradient
        size = state["step_size"]
        size = mx.where(same > 0, mx.minimum(size * grow, largest),
                        mx.where(same < 0, mx.maximum(size * shrink, smallest), size))
        g = mx.where(same < 0, mx.zeros_like(gradient), gradient)
        state["g"], state["step_size"] = g, size
        return parameter - size * mx.sign(g)


@_clear_keywords
@_builds(_Rprop)
@dataclass(frozen=True)
class Rprop(Rule):
    """Rprop, for full-batch training: each entry has its own step size, starting at
    ``lr``, multiplied by ``etas[1]`` while its gradient keeps its sign and by ``etas[0]``
    when it flips (then that entry's step is skipped), kept within ``step_sizes``; the step
    is ``size * sign(g)``. Optimisers.jl's ``Rprop(η = 1e-3, ℓ = (0.5, 1.2),
    Γ = (1e-6, 50.0))``, with PyTorch's names for ``ℓ`` and ``Γ``.

    ``lr`` is the initial step size only: :func:`~fluxlike.adjust` of ``lr`` on a live state
    changes the step size of parameters that get state later (thawed ones), as in
    Optimisers.jl, not the sizes already adapted.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, Rprop, setup, update
    >>> model = Dense(1, 2, bias=False)
    >>> model.weight = mx.zeros((2, 1))
    >>> opt_state = setup(Rprop(0.1), model)
    >>> for g in ([3.0, -1.0], [5.0, 2.0]):
    ...     update(opt_state, model, {"weight": mx.array(g).reshape(2, 1)})
    >>> model.weight  # -0.1 - 0.12; 0.1, then the flip skips a step
    array([[-0.22],
           [0.1]], dtype=float32)
    """

    lr: float = 1e-3
    etas: tuple[float, float] = (0.5, 1.2)
    step_sizes: tuple[float, float] = (1e-6, 50.0)

    def __post_init__(self) -> None:
        if callable(self.lr):
            raise ValueError(
                f"[Rprop] lr is the initial step size, a number, not a schedule: got "
                f"{self.lr!r}; Rprop adapts each entry's step size itself"
            )
        object.__setattr__(self, "lr", _lr(self.lr, "Rprop"))
        object.__setattr__(self, "etas", _pair(self.etas, "etas", "Rprop", 0.0, 1.0))
        sizes = _pair(self.step_sizes, "step_sizes", "Rprop", 0.0, None)
        object.__setattr__(self, "step_sizes", sizes)

    def build(self) -> optim.Optimizer:
        return _Rprop(self.lr, self.etas, self.step_sizes)


class _Signum(optim.Optimizer, _Follows):
    def __init__(self, learning_rate: LearningRate, beta: float):
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.beta = beta

    def init_single(self, parameter: mx.array, state: dict) -> None:
        state["m"] = mx.zeros_like(parameter)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        m = self.beta * state["m"] + (1 - self.beta) * gradient
        state["m"] = m
        return parameter - self.learning_rate.astype(gradient.dtype) * mx.sign(m)


@_clear_keywords
@_builds(_Signum)
@dataclass(frozen=True)
class Signum(Rule):
    """Signum, sign descent with momentum: ``m = beta * m + (1 - beta) * g``,
    ``w -= lr * sign(m)`` (Optimisers.jl's ``Signum(η = 0.01, β = 0.9)``; ``beta = 0`` is
    signSGD). Unlike :class:`~fluxlike.Lion` the sign is of the momentum itself.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, Signum, setup, update
    >>> model = Dense(1, 2, bias=False)
    >>> model.weight = mx.zeros((2, 1))
    >>> opt_state = setup(Signum(0.5), model)
    >>> update(opt_state, model, {"weight": mx.array([[3.0], [-0.001]])})
    >>> model.weight
    array([[-0.5],
           [0.5]], dtype=float32)
    """

    lr: LearningRate = 0.01
    beta: float = 0.9

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _lr(self.lr, "Signum"))
        object.__setattr__(self, "beta", _fraction(self.beta, "beta", "Signum"))

    def build(self) -> optim.Optimizer:
        return _Signum(self.lr, self.beta)


@_clear_keywords
@dataclass(frozen=True)
class SignDecay(GradientTransform):
    """Add ``decay * sign(w)`` to each parameter's gradient: L1 regularisation, the gradient
    of ``decay * sum(|w|)`` (Optimisers.jl's ``SignDecay(λ = 1e-3)``). Put it in front of a
    rule: ``OptimiserChain(SignDecay(1e-3), Adam())``; with :class:`~fluxlike.WeightDecay`
    beside it, elastic net.

    >>> import mlx.core as mx
    >>> from fluxlike import SignDecay
    >>> SignDecay(0.5)({"w": mx.array([1.0, 1.0, 1.0])}, {"w": mx.array([2.0, 0.0, -4.0])})["w"]
    array([1.5, 1, 0.5], dtype=float32)
    """

    decay: float = 1e-3
    uses_params = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "decay", _nonnegative(self.decay, "decay", "SignDecay"))

    # uses_params: called with the parameters too, unlike the base class
    def __call__(self, grads: Tree, params: Tree) -> Tree:  # type: ignore[override]
        def decayed(g: Any, w: Any) -> Any:
            if isinstance(g, mx.array) and mx.issubdtype(g.dtype, mx.floating):
                return g + (self.decay * mx.sign(w)).astype(g.dtype)
            return g

        return tree_map(decayed, grads, params)
