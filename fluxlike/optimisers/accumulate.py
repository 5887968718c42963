"""Gradient accumulation: :class:`AccumGrad` applies a rule every ``n``-th update, to the mean
of the gradients given since its last step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_map

from .._mlxtyping import tree_flatten
from .compiled import assign
from .rules import Rule, Tree, _clear_keywords, _Follows, _unchecked, following


def _per_parameter(optimizer: optim.Optimizer) -> optim.Optimizer:
    """The optimizer that keeps each parameter's state (through an ``OptimiserChain``)."""
    inner = getattr(optimizer, "inner", None)
    return _per_parameter(inner) if isinstance(inner, optim.Optimizer) else optimizer


class _Accumulating(optim.Optimizer, _Follows):
    """Sums the gradients in the state (``accumulated``, beside the rule's own entries for
    each parameter; ``accumulated_steps`` counts them) and applies ``rule_optimizer`` to
    their mean when the count reaches ``n``. No Python value changes from step to step, so
    the step traces once: the rule's step is computed at every update and kept (parameters
    and state) only on the ``n``-th, by ``mx.where``, as the loss scale's skip is."""

    def __init__(self, n: int, rule_optimizer: optim.Optimizer):
        super().__init__()
        self.n = n
        self.rule_optimizer = rule_optimizer  # (not `inner`: that is an OptimiserChain's)

    def following(self, given: Any = None) -> Any:
        inner = given.rule if isinstance(given, AccumGrad) else None
        rule = following(self.rule_optimizer, inner)
        if rule is None:  # an optimizer fluxlike did not build, and no rule given
            return given
        accumulating = _unchecked(AccumGrad, {"n": self.n, "rule": rule})
        return given if accumulating == given else accumulating

    def __repr__(self) -> str:
        return f"AccumGrad(n={self.n!r}, rule={self.rule_optimizer!r})"

    @property
    def state(self) -> dict:
        return self.rule_optimizer.state

    @state.setter
    def state(self, state: dict) -> None:
        self.rule_optimizer.state = state
        self._initialized = False

    def init(self, parameters: dict) -> None:
        self.rule_optimizer.init(parameters)
        tree_map(lambda p, s: s.setdefault("accumulated", mx.zeros_like(p)), parameters,
                 self.state)
        self.state.setdefault("accumulated_steps", mx.array(0, mx.uint32))
        self._initialized = True

    def init_single(self, parameter: mx.array, state: dict) -> None:
        _per_parameter(self.rule_optimizer).init_single(parameter, state)
        state["accumulated"] = mx.zeros_like(parameter)

    def apply_gradients(self, gradients: dict, parameters: dict) -> dict:
        if not self._initialized:
            self.init(gradients)
        state = self.state
        count = state["accumulated_steps"] + 1
        ready = count >= self.n
        slots = tree_map(lambda _, s: s, gradients, state)  # each parameter's state dict
        sums = tree_map(lambda g, s: s["accumulated"] + g.astype(s["accumulated"].dtype),
                        gradients, slots)
        means = tree_map(lambda a: a / count.astype(a.dtype), sums)
        before = dict(tree_flatten(state))
        stepped = self.rule_optimizer.apply_gradients(means, parameters)
        assign(state, {k: mx.where(ready, v, before[k]) if k in before else v
                       for k, v in tree_flatten(state)})

        def restart(a: mx.array, s: dict) -> None:
            s["accumulated"] = mx.where(ready, mx.zeros_like(a), a)

        tree_map(restart, sums, slots)
        state["accumulated_steps"] = mx.where(ready, mx.zeros_like(count), count)
        return tree_map(lambda new, old: mx.where(ready, new, old), stepped,
                        _like(stepped, parameters))


def _like(tree: Tree, parameters: Tree) -> Tree:
    """``parameters`` restricted to the structure of ``tree``."""
    return tree_map(lambda _, p: p, tree, parameters)


@_clear_keywords
@dataclass(frozen=True)
class AccumGrad(Rule):
    """Gradient accumulation: ``rule`` steps once every ``n`` updates, with the mean of the
    ``n`` gradients given since its last step; in between, the parameters stay as they are.
    A batch of ``b`` in ``n`` slices of ``b / n`` then trains as the whole batch would
    (Optimisers.jl's ``OptimiserChain(AccumGrad(n), rule)``).

    The sums are kept in the optimiser state (``accumulated``, per parameter, and
    ``accumulated_steps``), so they are checkpointed with it. ``rule``'s step count (its
    bias corrections, a schedule's ``lr``) counts its own steps, not the updates.

    With a loss scale (float16 training), an update whose gradients are not finite is
    skipped whole, the accumulation included: the step waits for ``n`` finite gradients.
    With data parallelism (``setup(..., distributed=...)``) the gradients are averaged over
    the processes before they are accumulated, so every process keeps the same sums.
    The rule's arithmetic runs at every update and is kept only at the ``n``-th (a
    selection on the device: ``update`` never waits for it, and its compiled step is traced
    once); gradient transforms in ``rule`` (``OptimiserChain(ClipNorm(1.0), Adam())``) act
    on the mean.

    >>> import mlx.core as mx
    >>> from fluxlike import AccumGrad, Dense, Descent, setup, update
    >>> model = Dense(1, 1, bias=False)
    >>> model.weight = mx.array([[1.0]])
    >>> opt_state = setup(AccumGrad(2, Descent(0.1)), model)
    >>> update(opt_state, model, {"weight": mx.array([[4.0]])})
    >>> model.weight  # not yet
    array([[1]], dtype=float32)
    >>> update(opt_state, model, {"weight": mx.array([[2.0]])})
    >>> model.weight  # 1 - 0.1 * (4 + 2) / 2
    array([[0.7]], dtype=float32)
    """

    n: int
    rule: Rule

    def __post_init__(self) -> None:
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"[AccumGrad] n must be a positive int (the updates per step), got {n!r}"
            )
        if not isinstance(self.rule, Rule):
            hint = "; put a gradient transform in OptimiserChain(transform, rule)" \
                if callable(self.rule) else ""
            raise TypeError(
                f"[AccumGrad] rule must be a fluxlike rule such as Adam(), got "
                f"{self.rule!r}{hint}"
            )
        if isinstance(self.rule, AccumGrad):
            raise ValueError(
                f"[AccumGrad] rule is an AccumGrad itself ({self.rule!r}); accumulate once: "
                f"AccumGrad({n * self.rule.n}, {self.rule.rule!r})"
            )

    def build(self) -> optim.Optimizer:
        return _Accumulating(self.n, self.rule.build())

