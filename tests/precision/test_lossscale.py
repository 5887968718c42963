"""Tests of fluxlike/precision/lossscale.py and of loss scaling in ``update``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from mlx.utils import tree_flatten, tree_map

from fluxlike import (
    Adam,
    Chain,
    Dense,
    DynamicLossScale,
    StaticLossScale,
    all_finite,
    gradient,
    setup,
    update,
)

# ---------------------------------------------------------------- the dynamic rule


class DynamicScaleMachine(RuleBasedStateMachine):
    """``DynamicLossScale.adjust`` against a plain-Python model of the rule."""

    def __init__(self):
        super().__init__()
        self.period, self.factor, self.floor = 3, 2.0, 0.25
        self.ls = DynamicLossScale(scale=4.0, period=self.period, factor=self.factor,
                                   min_scale=self.floor)
        self.scale, self.counter = 4.0, 0

    @rule(finite=st.booleans())
    def adjust(self, finite):
        self.ls.adjust(mx.array(finite))
        if finite:
            self.counter += 1
            if self.counter == self.period:
                self.scale, self.counter = self.scale * self.factor, 0
        else:
            self.scale, self.counter = max(self.scale / self.factor, self.floor), 0

    @rule()
    def checkpoint_round_trip(self):
        saved = {k: mx.array(v) for k, v in self.ls.state.items()}
        other = DynamicLossScale()  # the hyperparameters come back with the state
        other.load_state(saved)
        self.ls = other

    @invariant()
    def matches_the_model(self):
        assert self.ls.loss_scale.item() == self.scale
        assert self.ls.counter.item() == self.counter
        assert self.ls.loss_scale.dtype == mx.float32 and self.ls.counter.dtype == mx.int32


TestDynamicScaleMachine = DynamicScaleMachine.TestCase
TestDynamicScaleMachine.settings = settings(max_examples=60, stateful_step_count=30,
                                            deadline=None)


def test_scale_never_grows_into_inf():
    ls = DynamicLossScale(scale=2.0**127, period=1)
    ls.adjust(mx.array(True))
    assert ls.loss_scale.item() == 2.0**127


def test_scale_and_unscale_dtypes():
    ls = StaticLossScale(2.0**15)
    scaled = ls.scale(mx.array(4.0, dtype=mx.float16))  # 131072 overflows float16
    assert scaled.dtype == mx.float32 and scaled.item() == 2.0**17
    grads = {"a": mx.array([2.0**15], dtype=mx.float16), "b": [mx.array([3.0])],
             "n": mx.array([2], mx.int32)}
    out = ls.unscale(grads)
    assert out["a"].dtype == mx.float16 and out["a"].item() == 1.0
    assert out["b"][0].item() == pytest.approx(3.0 / 2**15)
    assert out["n"] is grads["n"]


def test_all_finite():
    assert all_finite({}).item() is True
    assert all_finite({"a": mx.ones(2), "n": mx.array([1], mx.int32)}).item() is True
    assert all_finite([mx.ones(2), {"b": mx.array([float("nan")], mx.float16)}]).item() is False
    assert all_finite(mx.array([-float("inf")])).item() is False


@pytest.mark.parametrize("make, message", [
    (lambda: DynamicLossScale(scale=0), r"\[DynamicLossScale\] scale must be a positive"),
    (lambda: DynamicLossScale(period=0), r"\[DynamicLossScale\] period must be a positive int"),
    (lambda: DynamicLossScale(period=np.float64(3)), r"period must be a positive integer"),
    (lambda: DynamicLossScale(period=np.bool_(True)), r"period must be a positive integer"),
    (lambda: DynamicLossScale(period=2**31), r"period must be .*at most 2\*\*31 - 1"),
    (lambda: DynamicLossScale(factor=1.0), r"factor must be greater than 1"),
    (lambda: DynamicLossScale(factor=1 + 1e-9), r"factor must be greater than 1"),  # float32: 1
    (lambda: DynamicLossScale(factor=np.bool_(True)), r"factor must be a positive number"),
    (lambda: StaticLossScale(np.bool_(True)), r"scale must be a positive number"),
    (lambda: DynamicLossScale(scale=0.5), r"scale must be at least min_scale=1.0"),
    (lambda: StaticLossScale(float("inf")), r"\[StaticLossScale\] scale must be finite"),
    (lambda: StaticLossScale(True), r"\[StaticLossScale\] scale must be a positive"),
])
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_numpy_numbers_are_accepted_as_python_numbers():
    ls = DynamicLossScale(scale=np.float32(64), period=np.int64(3), factor=np.float16(4),
                          min_scale=np.int32(2))
    assert repr(ls) == "DynamicLossScale(scale=64.0, period=3, factor=4.0, min_scale=2.0)"
    assert type(ls.period) is int and type(ls.factor) is float
    assert repr(StaticLossScale(np.float32(8))) == "StaticLossScale(8.0)"
    model = Dense(2, 1)
    for number in (np.float64(8), np.float32(8), np.int64(8)):
        assert repr(setup(Adam(), model, loss_scale=number).loss_scale) == "StaticLossScale(8.0)"
    with pytest.raises(ValueError, match="loss_scale must be None"):
        setup(Adam(), model, loss_scale=np.bool_(True))


def test_hyperparameters_are_state_and_come_back_from_a_checkpoint():
    ls = DynamicLossScale(scale=64.0, period=3, factor=4.0, min_scale=2.0)
    ls.adjust(mx.array(True))
    saved = {k: mx.array(np.array(v)) for k, v in ls.state.items()}  # as read from a file
    other = DynamicLossScale()
    other.load_state(saved)
    assert repr(other) == repr(ls) and other.counter.item() == 1
    for finite, expected in ((True, 64.0), (True, 256.0), (False, 64.0), (False, 16.0)):
        other.adjust(mx.array(finite))
        assert other.loss_scale.item() == expected


def test_state_without_hyperparameters_keeps_them():
    # checkpoints written before the hyperparameters were state
    ls = DynamicLossScale(scale=64.0, period=3, factor=4.0, min_scale=2.0)
    ls.load_state({"loss_scale": mx.array(8.0), "counter": mx.array(2, mx.int32)})
    assert repr(ls) == "DynamicLossScale(scale=8.0, period=3, factor=4.0, min_scale=2.0)"
    model = Dense(2, 1)
    fresh = setup(Adam(), model)  # no loss scale yet: the defaults, as before
    fresh.load_state({**fresh.state, "loss_scale": {"loss_scale": mx.array(8.0),
                                                    "counter": mx.array(2, mx.int32)}})
    assert repr(fresh.loss_scale) == (
        "DynamicLossScale(scale=8.0, period=2000, factor=2.0, min_scale=1.0)")
    saved = setup(Adam(), model, loss_scale=DynamicLossScale(period=5, factor=3.0)).state
    fresh = setup(Adam(), model)
    fresh.load_state(saved)
    assert (fresh.loss_scale.period, fresh.loss_scale.factor) == (5, 3.0)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("period", mx.array(0, mx.int32), "period must be a positive integer"),
    ("factor", mx.array(0.5), "factor must be greater than 1"),
    ("min_scale", mx.array(float("nan")), "min_scale must be a positive number"),
])
def test_loaded_hyperparameters_are_checked(key, value, message):
    ls = DynamicLossScale(period=3)
    state = dict(ls.state)
    with pytest.raises(ValueError,
                       match=rf"^\[DynamicLossScale\] {message}.*\(in the state loaded\)"):
        ls.load_state({**state, key: value})
    assert all(ls.state[k] is v for k, v in state.items())


def test_reassigned_hyperparameters_are_checked_and_used():
    ls = DynamicLossScale(scale=8.0, period=100)
    ls.period, ls.factor, ls.min_scale = np.int64(1), 4, 2
    assert repr(ls) == "DynamicLossScale(scale=8.0, period=1, factor=4.0, min_scale=2.0)"
    ls.adjust(mx.array(True))
    assert ls.loss_scale.item() == 32.0
    for _ in range(3):
        ls.adjust(mx.array(False))
    assert ls.loss_scale.item() == 2.0
    for name, bad in (("period", 0), ("factor", 1.0), ("min_scale", -1.0)):
        with pytest.raises(ValueError, match=rf"\[DynamicLossScale\] {name} must be"):
            setattr(ls, name, bad)
    assert repr(ls) == "DynamicLossScale(scale=2.0, period=1, factor=4.0, min_scale=2.0)"


def test_load_state_validates_first():
    ls = DynamicLossScale()
    state = dict(ls.state)
    for bad, message in [({"loss_scale": mx.array(2.0)}, "missing the entry 'counter'"),
                         ({**state, "counter": mx.zeros(3)}, "'counter' must be an mx.array"),
                         ({**state, "extra": mx.array(1)}, "unexpected state entry 'extra'")]:
        with pytest.raises(ValueError, match=message):
            ls.load_state(bad)
        assert all(ls.state[k] is v for k, v in state.items())


# ---------------------------------------------------------------- loss scaling in update


def _setup(loss_scale):
    mx.random.seed(0)
    model = Chain(Dense(3, 4), Dense(4, 2))
    opt_state = setup(Adam(0.01), model, loss_scale=loss_scale)
    x = mx.array(np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32))
    (grads,) = gradient(lambda m: (m(x) ** 2).sum(), model)
    return model, opt_state, grads


def _snapshot(model, opt_state):
    return {**{f"p.{k}": v for k, v in tree_flatten(model.parameters())},
            **{f"s.{k}": v for k, v in tree_flatten(opt_state.optimizer.state)}}


def test_scaled_step_equals_unscaled_step():
    model_a, plain, grads = _setup(None)
    model_b, scaled, _ = _setup(DynamicLossScale(scale=1024.0))
    update(plain, model_a, grads)
    update(scaled, model_b, tree_map(lambda g: g * 1024.0, grads))
    a, b = _snapshot(model_a, plain), _snapshot(model_b, scaled)
    for k in a:
        np.testing.assert_allclose(np.array(b[k]), np.array(a[k]), rtol=1e-6, err_msg=k)
    assert scaled.loss_scale.counter.item() == 1


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_non_finite_step_is_skipped(poison):
    model, opt_state, grads = _setup(DynamicLossScale(scale=1024.0))
    update(opt_state, model, grads)  # one real step, so the optimiser state is non-trivial
    mx.eval(_snapshot(model, opt_state))
    before = _snapshot(model, opt_state)
    bad = tree_map(lambda g: g, grads)
    bad["layers"][1]["weight"] = bad["layers"][1]["weight"].at[0, 0].add(poison)
    update(opt_state, model, bad)
    after = _snapshot(model, opt_state)
    for k, v in before.items():
        assert mx.array_equal(after[k], v).item(), k  # bit-identical (no NaN either)
        assert mx.all(mx.isfinite(after[k])).item() if after[k].dtype != mx.uint64 else True
    assert opt_state.loss_scale.loss_scale.item() == 512.0
    assert opt_state.loss_scale.counter.item() == 0
    update(opt_state, model, grads)  # training goes on from there
    assert opt_state.optimizer.step.item() == 2


def test_update_runs_inside_compile_without_host_sync():
    model, opt_state, grads = _setup(DynamicLossScale(scale=1024.0, period=2))
    captured = [model.state, opt_state.state]

    def step(grads):
        update(opt_state, model, grads)

    compiled = mx.compile(step, inputs=captured, outputs=captured)
    bad = tree_map(lambda g: g * float("inf"), grads)
    for g in (grads, bad, grads, grads):
        compiled(g)
    mx.eval(captured)
    assert opt_state.optimizer.step.item() == 3
    assert opt_state.loss_scale.loss_scale.item() == 1024.0  # halved, then doubled
    assert all(mx.all(mx.isfinite(v)).item() for _, v in tree_flatten(model.parameters()))

    opt_state.loss_scale.period = 1  # an array of the captured state: read at the next step
    compiled(grads)
    mx.eval(captured)
    assert opt_state.loss_scale.loss_scale.item() == 2048.0

    def syncing(grads):  # the check above is meaningful: a host sync fails under compile
        update(opt_state, model, grads)
        return mx.array(opt_state.loss_scale.loss_scale.item())

    with pytest.raises(ValueError):
        mx.compile(syncing, inputs=captured, outputs=captured)(grads)
