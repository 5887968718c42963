"""Tests of fluxlike/optimisers/signs.py: Rprop, Signum and SignDecay against float64 steps
written from Optimisers.jl's formulas."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_parameters, np64, reference_steps, rule_problem, run_rule

from fluxlike import Dense, Descent, OptimiserChain, Rprop, SignDecay, Signum, setup, update


def test_rprop():
    lr, (shrink, grow), (smallest, largest) = 0.05, (0.4, 1.5), (0.01, 0.1)

    def step(w, g, s, t):
        previous, size = s.get("g", np.zeros_like(g)), s.get("size", np.full_like(g, lr))
        same = previous * g
        size = np.where(same > 0, np.minimum(size * grow, largest),
                        np.where(same < 0, np.maximum(size * shrink, smallest), size))
        g = np.where(same < 0, 0, g)
        s["g"], s["size"] = g, size
        return w - size * np.sign(g)

    model, params, grads = rule_problem(steps=8)
    run_rule(Rprop(lr, (shrink, grow), (smallest, largest)), model, grads)
    expected = reference_steps(step, params, grads)
    assert_parameters(model, expected)
    signs = np.sign([g["weight"] for g in grads])
    assert (signs[1:] != signs[:-1]).any() and (signs[1:] == signs[:-1]).any()  # both cases


def test_rprop_defaults_and_errors():
    assert Rprop() == Rprop(1e-3, (0.5, 1.2), (1e-6, 50.0))
    with pytest.raises(ValueError, match=r"^\[Rprop\] etas must be a pair \(a, b\) with "
                                         r"0.0 < a < 1.0 < b, got \(0.5, 0.9\)$"):
        Rprop(etas=(0.5, 0.9))
    with pytest.raises(ValueError, match=r"^\[Rprop\] step_sizes must be a pair"):
        Rprop(step_sizes=(1.0, 0.1))
    with pytest.raises(ValueError, match=r"^\[Rprop\] lr is the initial step size, a number"):
        Rprop(lambda step: 0.1)
    with pytest.raises(TypeError, match=r"^\[Rprop\] unknown keyword 'ell'"):
        Rprop(ell=(0.5, 1.2))


def test_signum():
    lr, beta = 0.05, 0.7

    def step(w, g, s, t):
        s["m"] = beta * s.get("m", 0) + (1 - beta) * g
        return w - lr * np.sign(s["m"])

    model, params, grads = rule_problem(steps=4)
    run_rule(Signum(lr, beta), model, grads)
    assert_parameters(model, reference_steps(step, params, grads))
    assert Signum() == Signum(0.01, 0.9)
    with pytest.raises(ValueError, match=r"^\[Signum\] beta must be a number in \[0, 1\)"):
        Signum(beta=1)


def test_sign_decay_adds_decay_times_the_sign_of_the_weight():
    lr, decay = 0.1, 0.3
    model, params, grads = rule_problem(steps=3)
    run_rule(OptimiserChain(SignDecay(decay), Descent(lr)), model, grads)
    expected = reference_steps(lambda w, g, s, t: w - lr * (g + decay * np.sign(w)), params,
                               grads)
    assert_parameters(model, expected)
    assert repr(SignDecay()) == "SignDecay(decay=0.001)"
    with pytest.raises(ValueError, match=r"^\[SignDecay\] decay must be a non-negative"):
        SignDecay(-1)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("rule", [Rprop(0.01), Signum(0.01),
                                  OptimiserChain(SignDecay(0.01), Descent(0.01))],
                         ids=["Rprop", "Signum", "SignDecay"])
def test_half_parameters_keep_their_dtype(rule, dtype):
    model = Dense(3, 2)
    model.update({k: v.astype(dtype) for k, v in model.parameters().items()})
    opt_state = setup(rule, model)
    for _ in range(3):
        update(opt_state, model, {"weight": mx.ones((2, 3), dtype), "bias": mx.zeros(2, dtype)})
    assert model.weight.dtype == dtype and np.isfinite(np64(model.weight)).all()
