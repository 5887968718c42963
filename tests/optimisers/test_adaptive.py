"""Tests of fluxlike/optimisers/adaptive.py: each rule against float64 steps written from
Optimisers.jl's formulas (its src/rules.jl), float16 and bfloat16 parameters, errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_parameters, reference_steps, rule_problem, run_rule
from mlx.utils import tree_flatten

from fluxlike import (
    AdaBelief,
    AdaDelta,
    AdaGrad,
    AdaMax,
    AMSGrad,
    ClipNorm,
    Dense,
    NAdam,
    OAdam,
    OptimiserChain,
    RAdam,
    setup,
    train,
    update,
)
from fluxlike.losses import mse
from fluxlike.optimisers.rules import FLOAT16_EPS


def _check(rule, step, steps=3, rtol=1e-5, atol=1e-6):
    model, params, grads = rule_problem(steps)
    run_rule(rule, model, grads)
    assert_parameters(model, reference_steps(step, params, grads), rtol=rtol, atol=atol)


def test_adagrad():  # acc starts at eps: acc += g²; w -= η g / (√acc + ϵ)
    lr, eps = 0.1, 1e-3

    def step(w, g, s, t):
        s["acc"] = s.get("acc", eps) + g**2
        return w - lr * g / (np.sqrt(s["acc"]) + eps)

    _check(AdaGrad(lr, eps), step)


def test_adadelta():
    rho, eps = 0.8, 1e-4

    def step(w, g, s, t):
        s["acc"] = rho * s.get("acc", 0) + (1 - rho) * g**2
        d = g * np.sqrt(s.get("dacc", 0) + eps) / np.sqrt(s["acc"] + eps)
        s["dacc"] = rho * s.get("dacc", 0) + (1 - rho) * d**2
        return w - d

    _check(AdaDelta(rho, eps), step)


def test_adamax_has_flux_bias_correction():
    lr, b1, b2, eps = 0.01, 0.8, 0.95, 1e-6

    def step(w, g, s, t):
        s["m"] = b1 * s.get("m", 0) + (1 - b1) * g
        s["u"] = np.maximum(b2 * s.get("u", 0), np.abs(g))
        return w - lr / (1 - b1**t) * s["m"] / (s["u"] + eps)

    _check(AdaMax(lr, (b1, b2), eps), step)


def _moments(s, g, b1, b2):
    s["m"] = b1 * s.get("m", 0) + (1 - b1) * g
    s["v"] = b2 * s.get("v", 0) + (1 - b2) * g**2
    return s["m"], s["v"]


def test_nadam():
    lr, b1, b2, eps = 0.01, 0.8, 0.95, 1e-7

    def step(w, g, s, t):
        m, v = _moments(s, g, b1, b2)
        num = b1 * m / (1 - b1 * b1**t) + (1 - b1) * g / (1 - b1**t)
        return w - lr * num / (np.sqrt(v * b2 / (1 - b2**t)) + eps)

    _check(NAdam(lr, (b1, b2), eps), step)


def test_radam_both_branches():
    # beta2 = 0.9: rho_t <= 4 for t <= 4 (momentum only), > 4 from t = 5 (rectified)
    lr, b1, b2, eps = 0.01, 0.8, 0.9, 1e-8
    rho_inf = 2 / (1 - b2) - 1
    branches = []

    def step(w, g, s, t):
        m, v = _moments(s, g, b1, b2)
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)
        branches.append(rho > 4)
        if rho > 4:
            r = np.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            return w - m / (1 - b1**t) / (np.sqrt(v / (1 - b2**t)) + eps) * lr * r
        return w - m / (1 - b1**t) * lr

    _check(RAdam(lr, (b1, b2), eps), step, steps=7, rtol=2e-5)
    assert any(branches) and not all(branches)


def test_oadam():
    lr, b1, b2, eps = 0.01, 0.5, 0.9, 1e-8

    def step(w, g, s, t):
        m, v = _moments(s, g, b1, b2)
        previous = s.get("term", 0)
        s["term"] = lr * m / (1 - b1**t) / (np.sqrt(v / (1 - b2**t)) + eps)
        return w - (2 * s["term"] - previous)

    _check(OAdam(lr, (b1, b2), eps), step, steps=4)


def test_adabelief():
    lr, b1, b2, eps = 0.01, 0.8, 0.95, 1e-10

    def step(w, g, s, t):
        s["m"] = b1 * s.get("m", 0) + (1 - b1) * g
        s["s"] = b2 * s.get("s", 0) + (1 - b2) * (g - s["m"]) ** 2 + eps
        return w - lr * s["m"] / (1 - b1**t) / (np.sqrt(s["s"] / (1 - b2**t)) + eps)

    _check(AdaBelief(lr, (b1, b2), eps), step)


def test_amsgrad():  # m, v, v̂ start at eps; no bias correction
    lr, b1, b2, eps = 0.01, 0.8, 0.95, 1e-4

    def step(w, g, s, t):
        s["m"] = b1 * s.get("m", eps) + (1 - b1) * g
        s["v"] = b2 * s.get("v", eps) + (1 - b2) * g**2
        s["vmax"] = np.maximum(s.get("vmax", eps), s["v"])
        return w - lr * s["m"] / (np.sqrt(s["vmax"]) + eps)

    _check(AMSGrad(lr, (b1, b2), eps), step, steps=4)


def test_defaults_are_optimisers_jl():
    assert AdaGrad() == AdaGrad(0.1, 1e-8)
    assert AdaDelta() == AdaDelta(0.9, 1e-8)
    for rule in (AdaMax, NAdam, RAdam, AMSGrad):
        assert rule() == rule(0.001, (0.9, 0.999), 1e-8)
    assert OAdam() == OAdam(0.001, (0.5, 0.9), 1e-8)
    assert AdaBelief() == AdaBelief(0.001, (0.9, 0.999), 1e-16)
    assert repr(AdaDelta(0.5)) == "AdaDelta(rho=0.5, eps=1e-08)"


RULES = [AdaGrad(0.01), AdaDelta(), AdaMax(0.01), NAdam(0.01), RAdam(0.01), OAdam(0.01),
         AdaBelief(0.01), AMSGrad(0.01)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_float16_parameters_with_zero_gradients_stay_finite(rule):
    # eps 1e-8 (1e-16) is 0 in float16: the step uses FLOAT16_EPS, as Optimisers.jl's _eps
    model = Dense(3, 2)
    model.weight = model.weight.astype(mx.float16)
    opt_state = setup(OptimiserChain(ClipNorm(10.0), rule), model)
    grads = {"weight": mx.zeros((2, 3), mx.float16), "bias": mx.ones(2)}
    for _ in range(3):
        update(opt_state, model, grads)
    assert model.weight.dtype == mx.float16
    assert np.isfinite(np.array(model.weight)).all() and np.isfinite(np.array(model.bias)).all()
    eps = getattr(opt_state.optimizer.inner, "eps", None)
    assert eps is None or eps < FLOAT16_EPS  # its own eps, restored after the step


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_bfloat16_parameters_keep_their_dtype_and_follow_float32(rule):
    model, _, grads = rule_problem(3)
    half, _, _ = rule_problem(3)
    half.update({k: v.astype(mx.bfloat16) for k, v in half.parameters().items()})
    run_rule(rule, model, grads)
    state = run_rule(rule, half, [{k: v for k, v in g.items()} for g in grads])
    assert half.weight.dtype == mx.bfloat16
    moments = [v for k, v in tree_flatten(state.state) if k.count(".") == 2]
    assert moments and all(v.dtype == mx.bfloat16 for v in moments)
    np.testing.assert_allclose(np.array(half.weight.astype(mx.float32)), np.array(model.weight),
                               rtol=0.05, atol=0.05)


@pytest.mark.parametrize("make, message", [
    (lambda: AdaGrad(-1.0), r"^\[AdaGrad\] lr must be a positive number"),
    (lambda: AdaGrad(eps=0), r"^\[AdaGrad\] eps must be a positive number, got 0"),
    (lambda: AdaDelta(rho=1.0), r"^\[AdaDelta\] rho must be a number in \[0, 1\)"),
    (lambda: NAdam(betas=(0.9,)), r"^\[NAdam\] betas must be a pair"),
    (lambda: RAdam(betas=(0.9, 1.0)), r"^\[RAdam\] betas\[1\]"),
    (lambda: AMSGrad(eps=float("nan")), r"^\[AMSGrad\] eps"),
])
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_keywords_name_fluxlikes():
    with pytest.raises(TypeError, match=r"^\[NAdam\] .*name is lr: NAdam\(lr=0\.1\)$"):
        NAdam(learning_rate=0.1)
    with pytest.raises(TypeError, match=r"^\[AdaDelta\] unknown keyword 'lr'; the keywords are "
                                        r"rho, eps"):
        AdaDelta(lr=1.0)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_training_under_autocast_keeps_float32_weights_and_state(rule, dtype):
    # float16: train's dynamic loss scale; a skipped step must leave the rule's state as it was
    mx.random.seed(2)
    x = mx.random.normal((16, 3))
    y = x @ mx.array([[1.0], [-1.0], [2.0]])
    model = Dense(3, 1)
    opt_state = setup(rule, model)
    batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)]
    losses = [train(lambda m, a, b: mse(m(a), b), model, batches, opt_state, autocast=dtype,
                    progress=False) for _ in range(3)]
    assert np.isfinite(losses).all()
    assert model.weight.dtype == mx.float32
    floating = [v for k, v in tree_flatten(opt_state.state["optimizer"])
                if mx.issubdtype(v.dtype, mx.floating)]
    assert all(v.dtype == mx.float32 for v in floating)
    assert all(np.isfinite(np.array(v)).all() for v in floating)
