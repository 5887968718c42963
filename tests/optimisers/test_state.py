"""Tests of fluxlike/optimisers/state.py: setup, OptState, update."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from helpers import leaves, mse_of
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from fluxlike import (
    AccumGrad,
    Adam,
    BatchNorm,
    Chain,
    ClipNorm,
    Dense,
    Descent,
    DynamicLossScale,
    Momentum,
    NoOpLossScale,
    OptimiserChain,
    OptState,
    StaticLossScale,
    adjust,
    gradient,
    relu,
    setup,
    update,
)
from fluxlike.gradients import _trainable_parameters

# ---------------------------------------------------------------- setup / OptState


def test_setup_state_and_repr():
    model = Chain(Dense(2, 3, relu), BatchNorm(3), Dense(3, 1))
    opt_state = setup(Adam(), model)
    assert isinstance(opt_state, OptState)
    assert repr(opt_state) == (
        "OptState(Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08), loss_scale=NoOpLossScale())"
    )
    keys = sorted(leaves(opt_state.state))
    assert "optimizer.layers.1.weight.m" in keys and "optimizer.step" in keys
    assert not any("running" in k for k in keys)


def test_repr_and_rule_show_the_live_hyperparameters():
    opt_state = setup(OptimiserChain(ClipNorm(1.0), Adam(1e-3)), Dense(2, 1))
    adjust(opt_state, 5e-2, betas=(0.5, 0.6), eps=1e-3, max_norm=2.0)
    shown = "OptimiserChain(ClipNorm(max_norm=2.0), Adam(lr=0.05, betas=(0.5, 0.6), eps=0.001))"
    assert repr(opt_state) == f"OptState({shown}, loss_scale=NoOpLossScale())"
    assert repr(opt_state.optimizer) == shown
    # assigned on the optimizer (docs/training.md's loop assigns the learning rate)
    opt_state.optimizer.learning_rate = 1e-4
    opt_state.optimizer.inner.betas = [0.7, 0.8]
    live = OptimiserChain(ClipNorm(2.0), Adam(1e-4, (0.7, 0.8), 1e-3))
    assert opt_state.rule == live
    assert repr(opt_state) == f"OptState({live!r}, loss_scale=NoOpLossScale())"
    assert repr(opt_state.optimizer) == repr(live)
    assert repr(opt_state.optimizer.inner) == repr(live.parts[-1])


def test_the_rule_keeps_a_learning_rate_as_given_and_its_schedule():
    opt_state = setup(AccumGrad(2, Adam(0.1234567891)), Dense(2, 1))
    assert opt_state.rule.rule.lr == 0.1234567891  # not the float32 value it holds
    assert repr(opt_state.optimizer) == (  # (which the optimizer alone shows)
        "AccumGrad(n=2, rule=Adam(lr=0.12345679, betas=(0.9, 0.999), eps=1e-08))")
    opt_state.optimizer.rule_optimizer.learning_rate = 0.25
    assert opt_state.rule == AccumGrad(2, Adam(0.25))
    schedule = optim.step_decay(0.1, 0.5, 1)
    opt_state = setup(Adam(schedule), Dense(2, 1))
    opt_state.optimizer.learning_rate = 0.25  # the schedule sets it before every step
    assert opt_state.rule.lr is schedule
    adjust(opt_state, 0.01)
    assert opt_state.rule == Adam(0.01)


def test_setup_accepts_mlx_optimizer_and_loss_scales():
    opt = optim.SGD(0.1, momentum=0.5)
    opt_state = setup(opt, Dense(2, 1), loss_scale=256)
    assert opt_state.optimizer is opt and "v" in opt.state["weight"]
    assert opt_state.rule is opt  # its own rule
    assert isinstance(opt_state.loss_scale, StaticLossScale)
    assert isinstance(setup(Adam(), Dense(2, 1), loss_scale="auto").loss_scale, NoOpLossScale)
    ls = DynamicLossScale()
    assert setup(Adam(), Dense(2, 1), loss_scale=ls).loss_scale is ls


@pytest.mark.parametrize("rule, model, kwargs, error, message", [
    ("adam", Dense(1, 1), {}, TypeError, "rule must be a fluxlike rule"),
    (Adam(), "model", {}, TypeError, "model must be an mlx.nn.Module"),
    (Adam(), Dense(1, 1), {"loss_scale": "dynamic"}, ValueError, "loss_scale must be None"),
    (Adam(), Dense(1, 1), {"loss_scale": -2.0}, ValueError, "positive number"),
])
def test_setup_errors(rule, model, kwargs, error, message):
    with pytest.raises(error, match=message):
        setup(rule, model, **kwargs)


def test_load_state_round_trip_nested_and_flat():
    def make():
        return Chain(Dense(2, 3), relu, BatchNorm(3), Dense(3, 1))  # sparse list indices

    model = make()
    opt_state = setup(Adam(0.1), model, loss_scale=DynamicLossScale(8.0))
    x, y = mx.ones((4, 2)) * mx.arange(4).reshape(4, 1), mx.zeros((4, 1))
    for _ in range(3):
        update(opt_state, model, gradient(lambda m: mse_of(m, x, y), model)[0])
    saved = {k: mx.array(v) for k, v in leaves(opt_state.state).items()}

    fresh = setup(Adam(0.1), make())
    fresh.load_state(saved)  # flat form, and it creates the dynamic loss scale
    assert isinstance(fresh.loss_scale, DynamicLossScale)
    for k, v in leaves(fresh.state).items():
        assert mx.array_equal(v, saved[k]).item() and v.dtype == saved[k].dtype, k

    again = setup(Adam(0.1), make(), loss_scale=DynamicLossScale())
    again.load_state(tree_unflatten(list(saved.items())))  # nested form
    assert again.loss_scale.loss_scale.item() == opt_state.loss_scale.loss_scale.item()
    assert again.optimizer.step.item() == 3
    assert set(leaves(again.state)) == set(saved)


def test_load_state_mismatch_changes_nothing():
    opt_state = setup(Momentum(), Chain(Dense(2, 3), Dense(3, 1)), loss_scale=4.0)
    before = leaves(opt_state.state)
    good = dict(before)
    cases = [
        ({k: v for k, v in good.items() if k != "optimizer.layers.1.bias.v"},
         "missing entry 'optimizer.layers.1.bias.v'"),
        ({**good, "optimizer.layers.0.weight.v": mx.zeros((3, 3))},
         r"'optimizer.layers.0.weight.v' must be a float32 array of shape \(3, 2\)"),
        ({**good, "optimizer.step": mx.array(1, mx.int32)}, "'optimizer.step' must be a uint64"),
        ({**good, "optimizer.extra": mx.zeros(1)}, "unexpected entry 'optimizer.extra'"),
        ({**good, "loss_scale.loss_scale": mx.zeros(2)}, "loss_scale"),
    ]
    for tree, message in cases:
        with pytest.raises(ValueError, match=message):
            opt_state.load_state(tree)
        after = leaves(opt_state.state)
        assert all(after[k] is v for k, v in before.items())


# ---------------------------------------------------------------- update


def test_update_errors_leave_model_unchanged():
    model = Dense(2, 1)
    opt_state = setup(Descent(), model)
    weight = model.weight
    grads = gradient(lambda m: m(mx.ones((1, 2))).sum(), model)
    with pytest.raises(TypeError, match=r"grads\[0\]"):
        update(opt_state, model, grads)
    with pytest.raises(ValueError, match=r"'weight' must be an array of shape \(1, 2\)"):
        update(opt_state, model, {"weight": mx.zeros((2, 1))})
    with pytest.raises(ValueError, match="no trainable parameter 'kernel'"):
        update(opt_state, model, {"kernel": mx.zeros((2, 1))})
    with pytest.raises(TypeError, match=r"update: gradient 'weight' must be a floating array "
                                        r"\(as the parameter, float32\), got int32"):
        update(opt_state, model, {"weight": mx.ones((1, 2), mx.int32), "bias": mx.ones((1,))})
    with pytest.raises(TypeError, match="OptState"):
        update(opt_state.optimizer, model, grads[0])
    assert model.weight is weight and opt_state.optimizer.step.item() == 0


def test_update_rejects_gradients_of_frozen_parameters():
    model = Chain(Dense(2, 3), BatchNorm(3))
    model.layers[0].freeze(keys=["bias"])
    opt_state = setup(Descent(), model)
    before = model.parameters()
    with pytest.raises(ValueError, match="no trainable parameter 'layers.0.bias'"):
        update(opt_state, model, {"layers": [{"bias": mx.zeros((3,))}]})
    with pytest.raises(ValueError, match="no trainable parameter 'layers.1.running_mean'"):
        update(opt_state, model, {"layers": [{}, {"running_mean": mx.zeros((3,))}]})
    with pytest.raises(ValueError, match="no trainable parameter 'layers.2'"):
        update(opt_state, model, {"layers": [{}, {}, {"weight": mx.zeros((3,))}]})
    after = model.parameters()
    assert all(a is b for (_, a), (_, b) in zip(tree_flatten(before), tree_flatten(after),
                                                   strict=True))


class _Nested(nn.Module):
    """Parameters in a dict and a list, one of them frozen, beside a child module."""

    def __init__(self):
        super().__init__()
        self.blocks = {"a": mx.ones((2,)), "b": [mx.ones((3,)), mx.ones((1,))], "n": 3}
        self.child = Dense(2, 2)
        self._hidden = mx.ones((4,))
        self.freeze(keys=["blocks.b"], recurse=False)


@pytest.mark.parametrize("make", [
    lambda: Dense(2, 3),
    lambda: Chain(Dense(2, 3), BatchNorm(3), Dense(3, 1)),
    lambda: Chain(Dense(2, 3), Dense(3, 1)).freeze(keys=["weight"]),
    _Nested,
    lambda: nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3)),
])
def test_trainable_parameter_walk_matches_mlx(make):
    # withgradient's one walk gives what mlx.nn's trainable_parameters() gives, and knows
    # whether parameters() holds more (frozen entries to restore).
    model = make()
    tree, has_frozen = _trainable_parameters(model)
    expected = model.trainable_parameters()
    assert [(k, id(v)) for k, v in tree_flatten(tree)] == [
        (k, id(v)) for k, v in tree_flatten(expected)]
    assert tree_map(lambda _: 0, tree) == tree_map(lambda _: 0, expected)  # same {} placeholders
    assert has_frozen == (len(tree_flatten(model.parameters())) != len(tree_flatten(expected)))


def test_update_takes_gradients_of_parameters_in_dicts_and_lists():
    model = _Nested()
    (grads,) = gradient(lambda m: m.blocks["a"].sum() + m.child(mx.ones((1, 2))).sum(), model)
    assert grads["blocks"]["b"] == {} and grads["blocks"]["n"] == {}
    frozen = model.blocks["b"][0]
    update(setup(Descent(1.0), model), model, grads)
    np.testing.assert_allclose(np.array(model.blocks["a"]), np.zeros(2))
    assert model.blocks["b"][0] is frozen


def test_update_with_partial_grads():
    model = Dense(2, 1)
    bias = model.bias
    opt_state = setup(Descent(1.0), model)
    update(opt_state, model, {"weight": mx.ones((1, 2))})
    assert model.bias is bias
