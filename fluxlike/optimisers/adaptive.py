"""The Adam family and the other per-parameter adaptive rules of Optimisers.jl.

Each rule follows Optimisers.jl's ``apply!`` (its ``src/rules.jl``), in MLX's optimizer
form: ``init_single`` makes a parameter's state, ``apply_single`` steps it. Where
``mlx.optimizers`` has the rule, the optimiser is MLX's, with Flux's arithmetic where the
two differ (each docstring says where):

=================================  ============================================================
rule                               built on
=================================  ============================================================
``AdaGrad(lr, eps)``               ``mlx.optimizers.Adagrad`` (accumulator starts at ``eps``)
``AdaDelta(rho, eps)``             ``mlx.optimizers.AdaDelta`` (learning rate 1, as Flux)
``AdaMax(lr, betas, eps)``         ``mlx.optimizers.Adamax`` (with Flux's bias correction)
``NAdam``, ``RAdam``, ``OAdam``,   their own ``apply_single`` (MLX has none of them)
``AdaBelief``, ``AMSGrad``
=================================  ============================================================

The bias corrections ``1 - beta**t`` count the optimiser's steps (MLX's ``step``), as
:class:`~fluxlike.Adam` does (see there). A float16 parameter's step uses
``max(eps, 1e-7)`` (``FLOAT16_EPS``), as Optimisers.jl's ``_eps`` does. The state is kept in
each parameter's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.optimizers as optim

from .rules import (
    LearningRate,
    Rule,
    _betas,
    _builds,
    _clear_keywords,
    _Follows,
    _fraction,
    _HalfEps,
    _lr,
    _nonnegative,
)


class _Corrections:
    """``beta**t`` for the optimiser's step ``t`` (1 at the first step), as float32 arrays:
    Optimisers.jl's ``βt`` state, which every parameter of a step shares."""

    step: mx.array
    betas: list[float]

    def powers(self) -> tuple[mx.array, mx.array]:
        t = self.step.astype(mx.float32)
        b1, b2 = self.betas
        return mx.power(mx.array(b1, mx.float32), t), mx.power(mx.array(b2, mx.float32), t)


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x.astype(dtype)


def _half_eps(cls: type) -> type:
    """``cls`` with :class:`_HalfEps` in front of its ``apply_single``."""
    return type(cls.__name__, (_HalfEps, cls), {"__doc__": cls.__doc__,
                                                "__module__": cls.__module__})


class _AdaGrad(_HalfEps, optim.Adagrad, _Follows):
    """MLX's Adagrad, its accumulator starting at ``eps`` as Optimisers.jl's."""

    def init_single(self, parameter: mx.array, state: dict) -> None:
        state["v"] = mx.full(parameter.shape, self.eps, parameter.dtype)


class _AdaDelta(_HalfEps, optim.AdaDelta, _Follows):
    pass


@_half_eps
class _AdaMax(_Corrections, optim.Adamax, _Follows):
    """MLX's Adamax with Optimisers.jl's bias correction ``lr / (1 - beta1**t)``."""

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        dtype = gradient.dtype
        b1, b2 = self.betas
        b1t, _ = self.powers()
        m = b1 * state["m"] + (1 - b1) * gradient
        u = mx.maximum(b2 * state["v"], mx.abs(gradient))
        state["m"], state["v"] = m, u
        lr = _as(self.learning_rate / (1 - b1t), dtype)
        return parameter - lr * m / (u + self.eps)


class _Moments(_Corrections, optim.Optimizer, _Follows):
    """An optimiser with Adam's first and second moments ``m`` and ``v``."""

    def __init__(self, learning_rate: LearningRate, betas: list[float], eps: float):
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.betas = betas
        self.eps = eps

    def init_single(self, parameter: mx.array, state: dict) -> None:
        state["m"] = mx.zeros_like(parameter)
        state["v"] = mx.zeros_like(parameter)

    def moments(self, gradient: mx.array, state: dict) -> tuple[mx.array, mx.array]:
        b1, b2 = self.betas
        state["m"] = b1 * state["m"] + (1 - b1) * gradient
        state["v"] = b2 * state["v"] + (1 - b2) * mx.square(gradient)
        return state["m"], state["v"]


@_half_eps
class _NAdam(_Moments):
    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        dtype, (b1, b2) = gradient.dtype, self.betas
        b1t, b2t = self.powers()
        m, v = self.moments(gradient, state)
        nesterov = _as(b1 / (1 - b1 * b1t), dtype) * m + _as((1 - b1) / (1 - b1t), dtype) * gradient
        scale = mx.sqrt(v * _as(b2 / (1 - b2t), dtype)) + self.eps
        return parameter - _as(self.learning_rate, dtype) * nesterov / scale


@_half_eps
class _RAdam(_Moments):
    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        dtype, (_, b2) = gradient.dtype, self.betas
        b1t, b2t = self.powers()
        m, v = self.moments(gradient, state)
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * self.step.astype(mx.float32) * b2t / (1 - b2t)
        # the rectification where the variance is tractable (rho > 4), else plain momentum
        tractable = rho > 4
        safe = mx.where(tractable, rho, 5.0)  # no sqrt of a negative in the discarded branch
        r = mx.sqrt((safe - 4) * (safe - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * safe))
        lr = self.learning_rate / (1 - b1t)
        adaptive = m * _as(lr * r, dtype) / (mx.sqrt(v / _as(1 - b2t, dtype)) + self.eps)
        return parameter - mx.where(tractable, adaptive, _as(lr, dtype) * m)


@_half_eps
class _OAdam(_Moments):
    def init_single(self, parameter: mx.array, state: dict) -> None:
        super().init_single(parameter, state)
        state["term"] = mx.zeros_like(parameter)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        dtype = gradient.dtype
        b1t, b2t = self.powers()
        m, v = self.moments(gradient, state)
        previous = state["term"]
        term = _as(self.learning_rate / (1 - b1t), dtype) * m / (
            mx.sqrt(v / _as(1 - b2t, dtype)) + self.eps)
        state["term"] = term
        return parameter - (2 * term - previous)


@_half_eps
class _AdaBelief(_Moments):
    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        dtype, (b1, b2) = gradient.dtype, self.betas
        b1t, b2t = self.powers()
        m = b1 * state["m"] + (1 - b1) * gradient
        s = b2 * state["v"] + (1 - b2) * mx.square(gradient - m) + self.eps
        state["m"], state["v"] = m, s
        lr = _as(self.learning_rate / (1 - b1t), dtype)
        return parameter - lr * m / (mx.sqrt(s / _as(1 - b2t, dtype)) + self.eps)


@_half_eps
class _AMSGrad(_Moments):
    def init_single(self, parameter: mx.array, state: dict) -> None:
        for name in ("m", "v", "v_max"):  # all start at eps, as Optimisers.jl's
            state[name] = mx.full(parameter.shape, self.eps, parameter.dtype)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        m, v = self.moments(gradient, state)
        state["v_max"] = v_max = mx.maximum(state["v_max"], v)
        lr = _as(self.learning_rate, gradient.dtype)
        return parameter - lr * m / (mx.sqrt(v_max) + self.eps)


def _checked(rule: Rule, lr: bool = True, betas: bool = True, eps: str = "eps") -> None:
    """Validate and normalise a dataclass rule's common fields in place."""
    name = type(rule).__name__
    if lr:
        object.__setattr__(rule, "lr", _lr(rule.lr, name))  # type: ignore[attr-defined]
    if betas:
        object.__setattr__(rule, "betas", _betas(rule.betas, name))  # type: ignore[attr-defined]
    if eps:
        value = _nonnegative(getattr(rule, eps), eps, name, strict=True)
        object.__setattr__(rule, eps, value)


@_clear_keywords
@_builds(_AdaGrad)
@dataclass(frozen=True)
class AdaGrad(Rule):
    """AdaGrad: ``a += g**2``, ``w -= lr * g / (sqrt(a) + eps)``, the accumulator ``a``
    starting at ``eps`` (Optimisers.jl's ``AdaGrad(η = 0.1, ϵ = 1e-8)``; MLX's ``Adagrad``,
    which this builds on, starts it at 0).

    >>> import mlx.core as mx
    >>> from fluxlike import AdaGrad, Dense, setup, update
    >>> model = Dense(1, 1, bias=False)
    >>> model.weight = mx.array([[1.0]])
    >>> opt_state = setup(AdaGrad(0.1), model)
    >>> update(opt_state, model, {"weight": mx.array([[2.0]])})
    >>> model.weight  # 1 - 0.1 * 2 / sqrt(4)
    array([[0.9]], dtype=float32)
    """

    lr: LearningRate = 0.1
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _checked(self, betas=False)

    def build(self) -> optim.Optimizer:
        return _AdaGrad(self.lr, eps=self.eps)


@_clear_keywords
@_builds(_AdaDelta)
@dataclass(frozen=True)
class AdaDelta(Rule):
    """AdaDelta, which has no learning rate: ``a = rho * a + (1 - rho) * g**2``,
    ``d = g * sqrt(b + eps) / sqrt(a + eps)``, ``b = rho * b + (1 - rho) * d**2``,
    ``w -= d`` (Optimisers.jl's ``AdaDelta(ρ = 0.9, ϵ = 1e-8)``; MLX's ``AdaDelta`` with
    learning rate 1).

    >>> from fluxlike import AdaDelta
    >>> AdaDelta()
    AdaDelta(rho=0.9, eps=1e-08)
    """

    rho: float = 0.9
    eps: float = 1e-8

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho", _fraction(self.rho, "rho", "AdaDelta"))
        _checked(self, lr=False, betas=False)

    def build(self) -> optim.Optimizer:
        return _AdaDelta(1.0, rho=self.rho, eps=self.eps)


@dataclass(frozen=True)
class _AdamLike(Rule):
    lr: LearningRate = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _checked(self)


@_clear_keywords
@_builds(_AdaMax)
@dataclass(frozen=True)
class AdaMax(_AdamLike):
    """AdaMax, Adam with the infinity norm: ``m = beta1 * m + (1 - beta1) * g``,
    ``u = max(beta2 * u, |g|)``, ``w -= lr / (1 - beta1**t) * m / (u + eps)``
    (Optimisers.jl's; MLX's ``Adamax``, which this builds on, has no ``1 - beta1**t``).

    >>> from fluxlike import AdaMax
    >>> AdaMax()
    AdaMax(lr=0.001, betas=(0.9, 0.999), eps=1e-08)
    """

    def build(self) -> optim.Optimizer:
        return _AdaMax(self.lr, betas=list(self.betas), eps=self.eps)


@_clear_keywords
@_builds(_NAdam)
@dataclass(frozen=True)
class NAdam(_AdamLike):
    """NAdam, Adam with Nesterov momentum, as Optimisers.jl writes it: with Adam's ``m`` and
    ``v``, ``w -= lr * (beta1 * m / (1 - beta1**(t+1)) + (1 - beta1) * g / (1 - beta1**t))
    / (sqrt(v * beta2 / (1 - beta2**t)) + eps)``. (The factor ``beta2`` under the root is
    Optimisers.jl's; PyTorch's NAdam differs in its momentum schedule too.)

    >>> from fluxlike import NAdam
    >>> NAdam(3e-4)
    NAdam(lr=0.0003, betas=(0.9, 0.999), eps=1e-08)
    """

    def build(self) -> optim.Optimizer:
        return _NAdam(self.lr, list(self.betas), self.eps)


@_clear_keywords
@_builds(_RAdam)
@dataclass(frozen=True)
class RAdam(_AdamLike):
    """Rectified Adam: Adam's step times the rectification ``r`` while the variance of the
    adaptive rate is tractable (``rho_t > 4``, with ``rho_inf = 2 / (1 - beta2) - 1`` and
    ``rho_t = rho_inf - 2 t beta2**t / (1 - beta2**t)``), before that the bias-corrected
    momentum alone: ``w -= lr * m / (1 - beta1**t)`` (Optimisers.jl's).

    >>> from fluxlike import RAdam
    >>> RAdam()
    RAdam(lr=0.001, betas=(0.9, 0.999), eps=1e-08)
    """

    def build(self) -> optim.Optimizer:
        return _RAdam(self.lr, list(self.betas), self.eps)


@_clear_keywords
@_builds(_OAdam)
@dataclass(frozen=True)
class OAdam(_AdamLike):
    """Optimistic Adam, for adversarial training: with Adam's bias-corrected step
    ``s_t = lr * m̂ / (sqrt(v̂) + eps)``, ``w -= 2 s_t - s_{t-1}`` (Optimisers.jl's; its
    default ``betas`` are ``(0.5, 0.9)``). ``s_t`` is kept in the state as ``term``, with the
    learning rate it was taken with.

    >>> from fluxlike import OAdam
    >>> OAdam()
    OAdam(lr=0.001, betas=(0.5, 0.9), eps=1e-08)
    """

    betas: tuple[float, float] = (0.5, 0.9)

    def build(self) -> optim.Optimizer:
        return _OAdam(self.lr, list(self.betas), self.eps)


@_clear_keywords
@_builds(_AdaBelief)
@dataclass(frozen=True)
class AdaBelief(_AdamLike):
    """AdaBelief: Adam whose second moment is the belief ``s = beta2 * s + (1 - beta2) *
    (g - m)**2 + eps`` (the deviation from the momentum), ``w -= lr * m / (1 - beta1**t) /
    (sqrt(s / (1 - beta2**t)) + eps)`` (Optimisers.jl's, default ``eps = 1e-16``).

    >>> from fluxlike import AdaBelief
    >>> AdaBelief()
    AdaBelief(lr=0.001, betas=(0.9, 0.999), eps=1e-16)
    """

    eps: float = 1e-16

    def build(self) -> optim.Optimizer:
        return _AdaBelief(self.lr, list(self.betas), self.eps)


@_clear_keywords
@_builds(_AMSGrad)
@dataclass(frozen=True)
class AMSGrad(_AdamLike):
    """AMSGrad: Adam's moments without bias correction, divided by the largest second moment
    so far: ``v_max = max(v_max, v)``, ``w -= lr * m / (sqrt(v_max) + eps)``; ``m``, ``v``
    and ``v_max`` start at ``eps`` (Optimisers.jl's).

    >>> from fluxlike import AMSGrad
    >>> AMSGrad()
    AMSGrad(lr=0.001, betas=(0.9, 0.999), eps=1e-08)
    """

    def build(self) -> optim.Optimizer:
        return _AMSGrad(self.lr, list(self.betas), self.eps)

