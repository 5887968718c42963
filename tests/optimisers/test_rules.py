"""Tests of fluxlike/optimisers/rules.py: each rule against a numpy step from Flux's formulas."""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from helpers import assert_parameters, reference_steps, rule_problem, run_rule

from fluxlike import (
    Adam,
    AdamW,
    ClipNorm,
    ClipValue,
    Dense,
    Descent,
    Lion,
    Momentum,
    Nesterov,
    OptimiserChain,
    RMSProp,
    WeightDecay,
    setup,
    update,
)
from fluxlike.optimisers.rules import FLOAT16_EPS

STEPS = 3


def test_descent():
    model, params, grads = rule_problem(STEPS)
    run_rule(Descent(0.1), model, grads)
    assert_parameters(model, reference_steps(lambda w, g, s, t: w - 0.1 * g, params, grads))


def test_descent_keeps_no_buffer():
    opt_state = setup(Descent(), Dense(3, 2))
    assert sorted(opt_state.state["optimizer"]) == ["bias", "learning_rate", "step", "weight"]
    assert opt_state.state["optimizer"]["weight"] == {}


def test_momentum():  # Optimisers.jl: v = rho v + lr g; w -= v
    model, params, grads = rule_problem(STEPS)

    def step(w, g, s, t):
        s["v"] = 0.8 * s.get("v", 0) + 0.05 * g
        return w - s["v"]

    run_rule(Momentum(0.05, 0.8), model, grads)
    assert_parameters(model, reference_steps(step, params, grads))


def test_nesterov():  # Optimisers.jl: dx = -rho^2 v + (1 + rho) lr g; v = rho v - lr g
    model, params, grads = rule_problem(STEPS)
    lr, rho = 0.01, 0.9

    def step(w, g, s, t):
        v = s.get("v", 0)
        dx = -(rho**2) * v + (1 + rho) * lr * g
        s["v"] = rho * v - lr * g
        return w - dx

    run_rule(Nesterov(lr, rho), model, grads)
    assert_parameters(model, reference_steps(step, params, grads))


def test_rmsprop():
    model, params, grads = rule_problem(STEPS)
    lr, rho, eps = 0.01, 0.9, 1e-8

    def step(w, g, s, t):
        s["a"] = rho * s.get("a", 0) + (1 - rho) * g**2
        return w - lr * g / (np.sqrt(s["a"]) + eps)

    run_rule(RMSProp(lr, rho, eps), model, grads)
    assert_parameters(model, reference_steps(step, params, grads))


def _adam_step(lr, b1, b2, eps, wd=0.0):
    def step(w, g, s, t):
        s["m"] = b1 * s.get("m", 0) + (1 - b1) * g
        s["v"] = b2 * s.get("v", 0) + (1 - b2) * g**2
        m_hat, v_hat = s["m"] / (1 - b1**t), s["v"] / (1 - b2**t)
        return w * (1 - lr * wd) - lr * m_hat / (np.sqrt(v_hat) + eps)

    return step


def test_adam_has_bias_correction():
    model, params, grads = rule_problem(STEPS)
    run_rule(Adam(0.01, (0.8, 0.99), 1e-7), model, grads)
    assert_parameters(model, reference_steps(_adam_step(0.01, 0.8, 0.99, 1e-7), params, grads))


def test_adamw():
    model, params, grads = rule_problem(STEPS)
    run_rule(AdamW(0.01, weight_decay=0.1), model, grads)
    step = _adam_step(0.01, 0.9, 0.999, 1e-8, wd=0.1)
    assert_parameters(model, reference_steps(step, params, grads))


def test_lion():
    model, params, grads = rule_problem(STEPS)
    lr, b1, b2, wd = 0.01, 0.9, 0.99, 0.1

    def step(w, g, s, t):
        m = s.get("m", 0)
        c = b1 * m + (1 - b1) * g
        s["m"] = b2 * m + (1 - b2) * g
        return w * (1 - lr * wd) - lr * np.sign(c)

    run_rule(Lion(lr, (b1, b2), wd), model, grads)
    assert_parameters(model, reference_steps(step, params, grads))


def test_learning_rate_schedule():
    model, params, grads = rule_problem(STEPS)
    schedule = optim.step_decay(0.1, 0.5, 1)  # 0.1, 0.05, 0.025 at steps 0, 1, 2
    run_rule(Descent(schedule), model, grads)
    step = lambda w, g, s, t: w - 0.1 * 0.5 ** (t - 1) * g  # noqa: E731
    assert_parameters(model, reference_steps(step, params, grads))


def test_clip_norm_is_global():
    g = {"a": mx.array([3.0, 0.0]), "b": [mx.array([[4.0]])]}
    clipped = ClipNorm(1.0)(g)
    np.testing.assert_allclose(np.array(clipped["a"]), [0.6, 0.0], rtol=1e-5)
    np.testing.assert_allclose(np.array(clipped["b"][0]), [[0.8]], rtol=1e-5)
    small = ClipNorm(10.0)(g)
    np.testing.assert_allclose(np.array(small["a"]), [3.0, 0.0], rtol=1e-5)


def test_clip_value_keeps_dtype():
    out = ClipValue(1.0)({"w": mx.array([-3.0, 0.5, 2.0], dtype=mx.float16)})["w"]
    assert out.dtype == mx.float16
    assert out.tolist() == [-1.0, 0.5, 1.0]


def _clip_norm_reference(g, max_norm):
    norm = np.sqrt(sum((v**2).sum() for v in g.values()))
    return {k: v * min(1.0, max_norm / (norm + 1e-6)) for k, v in g.items()}


@pytest.mark.parametrize("clip, reference", [
    (ClipNorm(0.5), lambda g: _clip_norm_reference(g, 0.5)),
    (ClipValue(0.3), lambda g: {k: np.clip(v, -0.3, 0.3) for k, v in g.items()}),
])
def test_chain_clips_before_the_rule(clip, reference):
    model, params, grads = rule_problem(STEPS)
    run_rule(OptimiserChain(clip, Descent(0.1)), model, grads)
    expected = dict(params)
    for g in grads:
        g64 = reference({k: v.astype(np.float64) for k, v in g.items()})
        expected = {k: expected[k] - 0.1 * g64[k] for k in expected}
    assert_parameters(model, expected)


def test_chain_state_is_the_rules_state():
    opt_state = setup(OptimiserChain(ClipNorm(1.0), Adam()), Dense(3, 2))
    assert sorted(opt_state.state["optimizer"]["weight"]) == ["m", "v"]
    assert opt_state.optimizer.learning_rate.item() == pytest.approx(0.001)


def test_reprs():
    assert repr(Descent()) == "Descent(lr=0.1)"
    assert repr(AdamW()) == "AdamW(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01)"
    assert repr(OptimiserChain(ClipValue(1), Lion())) == (
        "OptimiserChain(ClipValue(delta=1.0), Lion(lr=0.0001, betas=(0.9, 0.99), "
        "weight_decay=0.0))"
    )
    assert Adam(1e-3) == Adam(0.001, (0.9, 0.999))


def test_positional_and_keyword_construction():
    assert Momentum(0.1, 0.5) == Momentum(lr=0.1, rho=0.5)
    assert AdamW(0.1, (0.8, 0.9), 1e-6, 0.2) == AdamW(
        lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)


@pytest.mark.parametrize("make, message", [
    (lambda: Descent(-1.0), r"\[Descent\] lr must be a positive number"),
    (lambda: Descent("fast"), r"\[Descent\] lr"),
    (lambda: Descent(float("inf")), r"^\[Descent\] lr must be finite, got inf$"),
    (lambda: Adam(np.float64("inf")), r"^\[Adam\] lr must be finite, got "),
    (lambda: AdamW(float("nan")), r"^\[AdamW\] lr must be a positive number"),
    (lambda: Momentum(rho=1.0), r"\[Momentum\] rho must be a number in \[0, 1\)"),
    (lambda: Nesterov(rho=0), r"\[Nesterov\] rho must be in \(0, 1\)"),
    (lambda: RMSProp(eps=0), r"\[RMSProp\] eps must be a positive number"),
    (lambda: Adam(betas=(0.9,)), r"\[Adam\] betas must be a pair"),
    (lambda: AdamW(betas=(0.9, 1.5)), r"\[AdamW\] betas\[1\]"),
    (lambda: AdamW(weight_decay=-1), r"\[AdamW\] weight_decay must be a non-negative"),
    (lambda: Lion(weight_decay=float("nan")), r"\[Lion\] weight_decay"),
    (lambda: ClipNorm(0), r"\[ClipNorm\] max_norm must be a positive"),
    (lambda: ClipValue(-1), r"\[ClipValue\] delta must be a positive"),
    (lambda: OptimiserChain(Adam(), ClipNorm(1.0)), r"\[OptimiserChain\] the last part"),
    (lambda: OptimiserChain(Adam(), Descent()), r"\[OptimiserChain\] parts before the rule"),
    (lambda: OptimiserChain(), r"\[OptimiserChain\] the last part"),
])
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


RULES = [Descent, Momentum, Nesterov, RMSProp, Adam, AdamW, Lion]


@pytest.mark.parametrize("rule", RULES)
def test_mlx_learning_rate_keyword_names_lr(rule):
    name = rule.__name__
    with pytest.raises(TypeError, match=rf"^\[{name}\] unknown keyword 'learning_rate'; "
                                        rf"fluxlike's name is lr: {name}\(lr=0\.001\)$"):
        rule(learning_rate=1e-3)
    assert rule(lr=1e-3) == rule(1e-3)


@pytest.mark.parametrize("make, message", [
    (lambda: Momentum(momentum=0.8), r"^\[Momentum\] .*name is rho: Momentum\(rho=0\.8\)$"),
    (lambda: RMSProp(alpha=0.8), r"^\[RMSProp\] .*name is rho: RMSProp\(rho=0\.8\)$"),
    (lambda: Adam(weight_decay=0.1), r"^\[Adam\] unknown keyword 'weight_decay'; the keywords "
                                     r"are lr, betas, eps; AdamW and Lion take weight_decay$"),
    (lambda: Lion(beta1=0.9), r"the keywords are lr, betas, weight_decay; give betas="),
    (lambda: Descent(momentum=0.9), r"Momentum and Nesterov take it as rho$"),
    (lambda: ClipNorm(max_grad_norm=1.0), r"name is max_norm: ClipNorm\(max_norm=1\.0\)$"),
    (lambda: ClipValue(clip_value=1.0), r"name is delta: ClipValue\(delta=1\.0\)$"),
])
def test_other_keywords_name_fluxlikes(make, message):
    with pytest.raises(TypeError, match=message):
        make()


def test_keyword_checks_keep_signature_repr_equality_and_replace():
    import dataclasses
    import inspect

    assert list(inspect.signature(AdamW).parameters) == ["lr", "betas", "eps", "weight_decay"]
    with pytest.raises(TypeError, match=r"^\[AdamW\] unknown keyword 'learning_rate'"):
        AdamW(0.1, learning_rate=0.2)
    rule = dataclasses.replace(Adam(), lr=0.1)
    assert rule == Adam(0.1) and hash(rule) == hash(Adam(0.1))
    assert repr(rule) == "Adam(lr=0.1, betas=(0.9, 0.999), eps=1e-08)"
    with pytest.raises(TypeError, match="multiple values"):  # Python's own check still runs
        Adam(0.1, lr=0.2)


@pytest.mark.parametrize("rule", [Adam(0.01), AdamW(0.01), RMSProp(0.01),
                                  OptimiserChain(ClipNorm(1.0), Adam(0.01))],
                         ids=["Adam", "AdamW", "RMSProp", "chain"])
def test_float16_parameters_with_zero_gradients_stay_finite(rule):
    # eps=1e-8 is 0 in float16: a zero gradient gave 0/0, NaN in an f16mix model's first step
    model = Dense(3, 2)
    model.weight = model.weight.astype(mx.float16)  # float16 weight, float32 bias
    before = np.array(model.weight)
    opt_state = setup(rule, model)
    grads = {"weight": mx.zeros((2, 3), mx.float16), "bias": mx.ones(2)}
    for _ in range(3):
        update(opt_state, model, grads)
    weight = np.array(model.weight)
    assert model.weight.dtype == mx.float16 and np.isfinite(weight).all()
    if not isinstance(rule, AdamW):  # (AdamW's decay moves it)
        np.testing.assert_array_equal(weight, before)
    optimizer = getattr(opt_state.optimizer, "inner", opt_state.optimizer)
    assert optimizer.eps < FLOAT16_EPS  # its own eps, restored after each float16 step


def test_float32_steps_are_mlx_adams_exactly():
    model = Dense(3, 2)
    twin = Dense(3, 2)
    twin.update(model.parameters())
    mine, theirs = setup(Adam(0.01), model).optimizer, optim.Adam(0.01, bias_correction=True)
    theirs.init(twin.trainable_parameters())
    g = {"weight": mx.ones((2, 3)), "bias": mx.full((2,), -2.0)}
    for _ in range(3):
        mine.update(model, g)
        theirs.update(twin, g)
    assert mx.array_equal(model.weight, twin.weight).item()
    assert mx.array_equal(model.bias, twin.bias).item()


def test_weight_decay_adds_decay_times_the_weight_before_the_rule():
    # Flux's OptimiserChain(WeightDecay(λ), Descent(η)): w -= η * (g + λ * w)
    model = Dense(3, 2)
    w, b = np.array(model.weight), np.array(model.bias)
    opt_state = setup(OptimiserChain(WeightDecay(0.1), Descent(0.5)), model)
    g = {"weight": mx.ones((2, 3)), "bias": mx.full((2,), 2.0)}
    update(opt_state, model, g)
    np.testing.assert_allclose(np.array(model.weight), w - 0.5 * (1 + 0.1 * w), rtol=1e-6)
    np.testing.assert_allclose(np.array(model.bias), b - 0.5 * (2 + 0.1 * b), rtol=1e-6)
    # with part of the model frozen: only the gradients given are decayed
    model.freeze(keys=["bias"])
    opt_state = setup(OptimiserChain(WeightDecay(0.1), Momentum(0.5)), model)
    update(opt_state, model, {"weight": mx.zeros((2, 3))})
    assert np.isfinite(np.array(model.weight)).all()
    assert repr(WeightDecay()) == "WeightDecay(decay=0.0005)"
    with pytest.raises(ValueError, match=r"\[WeightDecay\] decay"):
        WeightDecay(-1.0)


def _every_rule():
    import fluxlike as fl

    return [fl.Descent(0.5), fl.Momentum(0.05, 0.8), fl.Nesterov(), fl.RMSProp(eps=1e-3),
            fl.Adam(0.05, (0.5, 0.6), 1e-3), fl.AdamW(weight_decay=0.2), fl.Lion(),
            fl.AdaGrad(), fl.AdaDelta(0.5), fl.AdaMax(), fl.NAdam(), fl.RAdam(), fl.OAdam(),
            fl.AdaBelief(), fl.AMSGrad(), fl.Rprop(), fl.Signum(0.2),
            OptimiserChain(ClipNorm(1.0), ClipValue(0.5), WeightDecay(), fl.SignDecay(),
                           Adam()),
            fl.AccumGrad(3, OptimiserChain(ClipNorm(1.0), Momentum()))]


@pytest.mark.parametrize("rule", _every_rule(), ids=lambda r: type(r).__name__)
def test_the_optimizer_of_every_rule_shows_the_rule(rule):
    # not <fluxlike.optimisers.rules._Adam object at 0x...>
    assert repr(rule.build()) == repr(rule)
    assert repr(setup(rule, Dense(3, 2)).optimizer) == repr(rule)
