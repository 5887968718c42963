"""Tests of fluxlike/optimisers/hyperparameters.py: adjust changes a live state's
hyperparameters, kept moments and all, and the next (compiled) update uses them."""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from helpers import assert_parameters, rule_problem, run_rule

from fluxlike import (
    AccumGrad,
    AdaDelta,
    Adam,
    AdamW,
    ClipNorm,
    Descent,
    Momentum,
    OptimiserChain,
    RMSProp,
    Rprop,
    adjust,
    setup,
    update,
)
from fluxlike.optimisers.compiled import COMPILED
from fluxlike.optimisers.hyperparameters import ScheduleNotStored, recorded, restored


def _steps(opt_state, model, grads):
    for g in grads:
        update(opt_state, model, {k: mx.array(v) for k, v in g.items()})


def _adam_reference(params, grads, settings):
    """Adam in float64, ``settings[t]`` = (lr, b1, b2, eps) for step t (1-based): moments
    carried over, bias corrections with the current betas' powers of the step count."""
    out = {}
    for name, w in params.items():
        m = v = 0
        for t, g in enumerate(grads, start=1):
            lr, b1, b2, eps = settings[t]
            g = g[name].astype(np.float64)
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g**2
            w = w - lr * m / (1 - b1**t) / (np.sqrt(v / (1 - b2**t)) + eps)
        out[name] = w
    return out


def test_adjusted_lr_betas_and_eps_take_effect_at_the_next_compiled_update():
    model, params, grads = rule_problem(steps=5)
    opt_state = setup(Adam(0.01), model)
    _steps(opt_state, model, grads[:2])
    adjust(opt_state, 0.05, betas=(0.5, 0.9))
    _steps(opt_state, model, grads[2:4])
    adjust(opt_state, eps=1e-3)
    _steps(opt_state, model, grads[4:])
    settings = {1: (0.01, 0.9, 0.999, 1e-8), 2: (0.01, 0.9, 0.999, 1e-8),
                3: (0.05, 0.5, 0.9, 1e-8), 4: (0.05, 0.5, 0.9, 1e-8), 5: (0.05, 0.5, 0.9, 1e-3)}
    assert_parameters(model, _adam_reference(params, grads, settings))
    assert opt_state.rule == Adam(0.05, (0.5, 0.9), 1e-3)
    assert COMPILED[opt_state].eager is None  # still compiled, traced again for the changes


def test_a_learning_rate_replaces_a_schedule_and_back():
    model, params, grads = rule_problem(steps=4)
    opt_state = setup(Descent(optim.step_decay(0.1, 0.5, 1)), model)
    _steps(opt_state, model, grads[:1])  # lr 0.1
    adjust(opt_state, lr=0.02)
    _steps(opt_state, model, grads[1:3])  # 0.02, 0.02
    adjust(opt_state, optim.step_decay(1.0, 0.1, 1))
    _steps(opt_state, model, grads[3:])  # step 3: 1.0 * 0.1**3
    lrs = [0.1, 0.02, 0.02, 1e-3]
    expected = {k: w - sum(lr * g[k].astype(np.float64) for lr, g in zip(lrs, grads, strict=True))
                for k, w in params.items()}
    assert_parameters(model, expected)


def test_chain_lr_goes_to_the_rule_other_fields_to_every_part_that_has_them():
    model, params, grads = rule_problem(steps=2)
    opt_state = setup(OptimiserChain(ClipNorm(100.0), Descent(0.1)), model)
    _steps(opt_state, model, grads[:1])
    adjust(opt_state, 0.2, max_norm=0.5)
    _steps(opt_state, model, grads[1:])
    assert opt_state.rule == OptimiserChain(ClipNorm(0.5), Descent(0.2))
    expected = {}
    g = grads[1]
    norm = np.sqrt(sum((v.astype(np.float64) ** 2).sum() for v in g.values()))
    for k, w in params.items():
        expected[k] = w - 0.1 * grads[0][k] - 0.2 * g[k] * min(1.0, 0.5 / (norm + 1e-6))
    assert_parameters(model, expected)


def test_accumgrad_n_and_its_rules_lr():
    model, params, grads = rule_problem(steps=3)
    opt_state = setup(AccumGrad(2, Descent(0.1)), model)
    _steps(opt_state, model, grads[:1])
    adjust(opt_state, 0.5, n=1)  # the held gradient and this one step now, at lr 0.5
    _steps(opt_state, model, grads[1:2])
    _steps(opt_state, model, grads[2:])
    assert opt_state.rule == AccumGrad(1, Descent(0.5))
    expected = {k: w - 0.5 * (grads[0][k] + grads[1][k]) / 2 - 0.5 * grads[2][k]
                for k, w in params.items()}
    assert_parameters(model, expected)


@pytest.mark.parametrize("rule, changes, attribute, value", [
    (RMSProp(), {"rho": 0.5}, "alpha", 0.5),
    (Momentum(), {"rho": 0.5}, "momentum", 0.5),
    (AdamW(), {"weight_decay": 0.3}, "weight_decay", 0.3),
    (AdaDelta(), {"rho": 0.7}, "rho", 0.7),
    (Rprop(), {"etas": (0.3, 1.5)}, "etas", (0.3, 1.5)),
])
def test_fields_reach_the_mlx_optimizer(rule, changes, attribute, value):
    opt_state = run_rule(rule, *rule_problem(steps=1)[::2])
    adjust(opt_state, **changes)
    assert getattr(opt_state.optimizer, attribute) == value


def test_an_mlx_optimizer_given_as_it_is():
    model, _, grads = rule_problem(steps=1)
    opt_state = run_rule(optim.Adam(0.01), model, grads)
    adjust(opt_state, 0.5, betas=[0.5, 0.5])
    assert opt_state.optimizer.learning_rate.item() == 0.5
    assert opt_state.optimizer.betas == [0.5, 0.5]
    with pytest.raises(TypeError, match=r"^adjust: Adam has no hyperparameter 'rho'"):
        adjust(opt_state, rho=0.1)


@pytest.mark.parametrize("rule, args, kwargs, error, message", [
    (Adam(), (), {}, TypeError, r"^adjust: nothing to change"),
    (Adam(), (-1.0,), {}, ValueError, r"^\[Adam\] lr must be a positive number"),
    (Adam(), (), {"betas": (0.9, 1.2)}, ValueError, r"^\[Adam\] betas\[1\]"),
    (Adam(), (), {"eta": 0.1}, TypeError,
     r"fluxlike's name is lr: adjust\(opt_state, lr=\.\.\.\)$"),
    (Adam(), (), {"rho": 0.1}, TypeError,
     r"^adjust: Adam\(.*\) has no hyperparameter 'rho'; its fields are betas, eps, lr$"),
    (AdaDelta(), (0.1,), {}, ValueError, r"^adjust: AdaDelta has no learning rate"),
    (Adam(), (0.1,), {"lr": 0.2}, TypeError, r"multiple values for argument 'lr'"),
])
def test_bad_adjustments_change_nothing(rule, args, kwargs, error, message):
    model, _, grads = rule_problem(steps=1)
    opt_state = run_rule(rule, model, grads)
    before = {k: np.array(v) for k, v in opt_state.optimizer.state.items()
              if isinstance(v, mx.array)}
    with pytest.raises(error, match=message):
        adjust(opt_state, *args, **kwargs)
    assert opt_state.rule == rule
    for k, v in before.items():
        np.testing.assert_array_equal(np.array(opt_state.optimizer.state[k]), v)


def test_not_an_opt_state():
    with pytest.raises(TypeError, match=r"^adjust: expected an OptState from setup\(\)"):
        adjust(Adam(), 0.1)


# ---------------------------------------------------------------- recorded / restored

def _round_trip(rule, record):
    import json
    return restored(rule, json.loads(json.dumps(record)))


@pytest.mark.parametrize(("given", "saved"), [
    (Adam(), Adam(0.05, (0.5, 0.6), 1e-3)),
    (Rprop(), Rprop(0.05, (0.3, 1.5), (1e-4, 10.0))),
    (OptimiserChain(ClipNorm(1.0), Momentum()), OptimiserChain(ClipNorm(0.5), Momentum(0.2, 0.5))),
    (AccumGrad(2, OptimiserChain(ClipNorm(1.0), AdamW())),
     AccumGrad(5, OptimiserChain(ClipNorm(0.5), AdamW(0.2, weight_decay=0.3)))),
])
def test_a_rule_restored_from_its_record_is_the_rule(given, saved):
    assert _round_trip(given, recorded(saved)) == saved


@pytest.mark.parametrize(("given", "saved"), [
    (Descent(), Adam()),
    (AdamW(), Adam()),
    (Adam(), OptimiserChain(ClipNorm(1.0), Adam())),
    (OptimiserChain(ClipNorm(1.0), Adam()), Adam()),
    (OptimiserChain(ClipNorm(1.0), Adam()), OptimiserChain(ClipNorm(1.0), ClipNorm(1.0), Adam())),
    (AccumGrad(2, Adam()), AccumGrad(2, Momentum())),
])
def test_a_record_of_another_structure_restores_nothing(given, saved):
    assert _round_trip(given, recorded(saved)) is None


def test_schedules_are_recorded_by_name_and_rules_of_ones_own_not_at_all():
    from dataclasses import dataclass

    schedule = optim.step_decay(0.1, 0.5, 1)
    record = recorded(Adam(schedule))
    assert record["fields"]["lr"] == {"schedule": "step_decay.<locals>.schedule"}
    assert _round_trip(Adam(schedule, (0.5, 0.5)), record) == Adam(schedule)
    with pytest.raises(ScheduleNotStored, match=r"^lr was a schedule \(step_decay"):
        _round_trip(Adam(), record)

    @dataclass(frozen=True)
    class MyAdam(Adam):  # its optimizer's settings are unknown to fluxlike
        pass

    assert recorded(MyAdam()) is None and recorded(OptimiserChain(ClipNorm(1.0), MyAdam())) is None
