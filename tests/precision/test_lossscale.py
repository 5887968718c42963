"""Tests of fluxlike/precision/lossscale.py and of loss scaling in ``update``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from mlx.utils import tree_flatten, tree_map

from fluxlike import (
    Adam,
    Chain,
    Dense,
    DynamicLossScale,
    NoOpLossScale,
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
        self.ls = DynamicLossScale(4.0, growth_interval=self.period,
                                   growth_factor=self.factor, backoff_factor=1 / self.factor,
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


class GradScalerRuleMachine(RuleBasedStateMachine):
    """The rule with GradScaler's separate factors (growth 2, backoff 0.25, as a ported recipe
    might set), through checkpoint round trips, against plain Python."""

    def __init__(self):
        super().__init__()
        self.ls = DynamicLossScale(init_scale=64.0, growth_factor=2.0, backoff_factor=0.25,
                                   growth_interval=2, min_scale=0.5)
        self.scale, self.counter = 64.0, 0

    @rule(finite=st.booleans())
    def adjust(self, finite):
        self.ls.adjust(mx.array(finite))
        if finite:
            self.counter += 1
            if self.counter == 2:
                self.scale, self.counter = self.scale * 2.0, 0
        else:
            self.scale, self.counter = max(self.scale * 0.25, 0.5), 0

    @rule()
    def checkpoint_round_trip(self):
        other = DynamicLossScale()
        other.load_state({k: mx.array(np.array(v)) for k, v in self.ls.state.items()})
        self.ls = other

    @invariant()
    def matches_the_model(self):
        assert self.ls.loss_scale.item() == self.scale
        assert self.ls.counter.item() == self.counter


TestGradScalerRuleMachine = GradScalerRuleMachine.TestCase
TestGradScalerRuleMachine.settings = settings(max_examples=40, stateful_step_count=30,
                                              deadline=None)


def test_scale_never_grows_into_inf():
    ls = DynamicLossScale(2.0**127, growth_interval=1)
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
    (lambda: DynamicLossScale(0), r"\[DynamicLossScale\] init_scale must be a positive"),
    (lambda: DynamicLossScale(growth_interval=0),
     r"\[DynamicLossScale\] growth_interval must be a positive int"),
    (lambda: DynamicLossScale(growth_interval=np.float64(3)),
     r"growth_interval must be a positive integer"),
    (lambda: DynamicLossScale(growth_interval=np.bool_(True)),
     r"growth_interval must be a positive integer"),
    (lambda: DynamicLossScale(growth_interval=2**31),
     r"growth_interval must be .*at most 2\*\*31 - 1"),
    (lambda: DynamicLossScale(growth_factor=1.0), r"growth_factor must be greater than 1"),
    (lambda: DynamicLossScale(growth_factor=1 + 1e-9),  # float32: 1
     r"growth_factor must be greater than 1"),
    (lambda: DynamicLossScale(growth_factor=np.bool_(True)),
     r"growth_factor must be a positive number"),
    (lambda: StaticLossScale(np.bool_(True)), r"scale must be a positive number"),
    (lambda: DynamicLossScale(0.5), r"init_scale must be at least min_scale=1.0"),
    (lambda: StaticLossScale(float("inf")), r"\[StaticLossScale\] scale must be finite"),
    (lambda: StaticLossScale(True), r"\[StaticLossScale\] scale must be a positive"),
])
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_numpy_numbers_are_accepted_as_python_numbers():
    ls = DynamicLossScale(np.float32(64), growth_interval=np.int64(3),
                          growth_factor=np.float16(4), backoff_factor=np.float64(0.25),
                          min_scale=np.int32(2))
    assert repr(ls) == ("DynamicLossScale(init_scale=64.0, growth_factor=4.0, backoff_factor=0.25, "
                        "growth_interval=3, min_scale=2.0)")
    assert type(ls.growth_interval) is int and type(ls.growth_factor) is float
    assert repr(StaticLossScale(np.float32(8))) == "StaticLossScale(8.0)"
    model = Dense(2, 1)
    for number in (np.float64(8), np.float32(8), np.int64(8)):
        assert repr(setup(Adam(), model, loss_scale=number).loss_scale) == "StaticLossScale(8.0)"
    with pytest.raises(ValueError, match="loss_scale must be None"):
        setup(Adam(), model, loss_scale=np.bool_(True))


def test_hyperparameters_are_state_and_come_back_from_a_checkpoint():
    ls = DynamicLossScale(64.0, growth_interval=3, growth_factor=4.0, backoff_factor=0.25,
                          min_scale=2.0)
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
    ls = DynamicLossScale(64.0, growth_interval=3, growth_factor=4.0, backoff_factor=0.25,
                          min_scale=2.0)
    ls.load_state({"loss_scale": mx.array(8.0), "counter": mx.array(2, mx.int32)})
    assert repr(ls) == ("DynamicLossScale(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, "
                        "growth_interval=3, min_scale=2.0)")
    model = Dense(2, 1)
    fresh = setup(Adam(), model)  # no loss scale yet: the defaults, as before
    fresh.load_state({**fresh.state, "loss_scale": {"loss_scale": mx.array(8.0),
                                                    "counter": mx.array(2, mx.int32)}})
    assert repr(fresh.loss_scale) == (
        "DynamicLossScale(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, "
        "growth_interval=2000, min_scale=1.0)")
    saved = setup(Adam(), model, loss_scale=DynamicLossScale(growth_interval=5,
                                                                   growth_factor=3.0)).state
    fresh = setup(Adam(), model)
    fresh.load_state(saved)
    assert (fresh.loss_scale.growth_interval, fresh.loss_scale.growth_factor) == (5, 3.0)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("growth_interval", mx.array(0, mx.int32), "growth_interval must be a positive integer"),
    ("growth_factor", mx.array(0.5), "growth_factor must be greater than 1"),
    ("min_scale", mx.array(float("nan")), "min_scale must be a positive number"),
])
def test_loaded_hyperparameters_are_checked(key, value, message):
    ls = DynamicLossScale(growth_interval=3)
    state = dict(ls.state)
    with pytest.raises(ValueError,
                       match=rf"^\[DynamicLossScale\] {message}.*\(in the state loaded\)"):
        ls.load_state({**state, key: value})
    assert all(ls.state[k] is v for k, v in state.items())


def test_reassigned_hyperparameters_are_checked_and_used():
    ls = DynamicLossScale(8.0, growth_interval=100)
    ls.growth_interval, ls.growth_factor, ls.backoff_factor, ls.min_scale = np.int64(1), 4, 0.25, 2
    assert repr(ls) == ("DynamicLossScale(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, "
                        "growth_interval=1, min_scale=2.0)")
    ls.adjust(mx.array(True))
    assert ls.loss_scale.item() == 32.0
    for _ in range(3):
        ls.adjust(mx.array(False))
    assert ls.loss_scale.item() == 2.0
    for name, bad in (("growth_interval", 0), ("growth_factor", 1.0), ("backoff_factor", 1.0),
                      ("min_scale", -1.0)):
        with pytest.raises(ValueError, match=rf"\[DynamicLossScale\] {name} must be"):
            setattr(ls, name, bad)
    assert repr(ls) == ("DynamicLossScale(init_scale=2.0, growth_factor=4.0, backoff_factor=0.25, "
                        "growth_interval=1, min_scale=2.0)")


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
    model_b, scaled, _ = _setup(DynamicLossScale(1024.0))
    update(plain, model_a, grads)
    update(scaled, model_b, tree_map(lambda g: g * 1024.0, grads))
    a, b = _snapshot(model_a, plain), _snapshot(model_b, scaled)
    for k in a:
        np.testing.assert_allclose(np.array(b[k]), np.array(a[k]), rtol=1e-6, err_msg=k)
    assert scaled.loss_scale.counter.item() == 1


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_non_finite_step_is_skipped(poison):
    model, opt_state, grads = _setup(DynamicLossScale(1024.0))
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
    model, opt_state, grads = _setup(DynamicLossScale(1024.0, growth_interval=2))
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

    opt_state.loss_scale.growth_interval = 1  # an array of the captured state: read next step
    compiled(grads)
    mx.eval(captured)
    assert opt_state.loss_scale.loss_scale.item() == 2048.0

    def syncing(grads):  # the check above is meaningful: a host sync fails under compile
        update(opt_state, model, grads)
        return mx.array(opt_state.loss_scale.loss_scale.item())

    with pytest.raises(ValueError):
        mx.compile(syncing, inputs=captured, outputs=captured)(grads)


# ---------------------------------------------------------------- GradScaler's arguments


def test_gradscaler_arguments_and_defaults():
    ls = DynamicLossScale()
    assert (ls.loss_scale.item(), ls.growth_factor, ls.backoff_factor, ls.growth_interval,
            ls.min_scale) == (2.0**15, 2.0, 0.5, 2000, 1.0)
    ls = DynamicLossScale(init_scale=64.0, growth_factor=4.0, backoff_factor=0.25,
                          growth_interval=2, min_scale=2.0)
    expected = []
    for finite in (False, True, True, False, False, False):
        ls.adjust(mx.array(finite))
        expected.append(ls.loss_scale.item())
    assert expected == [16.0, 16.0, 64.0, 16.0, 4.0, 2.0]


def test_backoff_independent_of_growth():
    # a recipe with backoff_factor=0.25 and the default growth, as GradScaler allows
    ls = DynamicLossScale(1024.0, backoff_factor=0.25, growth_interval=1)
    ls.adjust(mx.array(False))
    assert ls.loss_scale.item() == 256.0
    ls.adjust(mx.array(True))
    assert ls.loss_scale.item() == 512.0


@pytest.mark.parametrize("name", ["scale", "period", "factor"])
def test_one_spelling_of_each_argument(name):
    # 0.1.0's alternate names are gone: GradScaler's init_scale, growth_interval and
    # growth_factor/backoff_factor are the only ones
    with pytest.raises(TypeError, match=name):
        DynamicLossScale(**{name: 2})
    assert name == "scale" or not hasattr(DynamicLossScale(), name)  # (scale(): the method)
    with pytest.raises(TypeError):  # the factors are keywords: a positional 2nd is refused
        DynamicLossScale(1024.0, 100)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"init_scale": 0}, r"init_scale must be a positive number, got 0"),
    ({"init_scale": float("nan")}, r"init_scale must be a positive number, got nan"),
    ({"init_scale": 1e39}, r"init_scale must be finite \(in float32\), got 1e\+39"),
    ({"init_scale": 0.5}, r"init_scale must be at least min_scale=1.0, got 0.5"),
    ({"growth_factor": 1.0}, r"growth_factor must be greater than 1 .*got 1.0"),
    ({"growth_factor": "2"}, r"growth_factor must be a positive number, got '2'"),
    ({"backoff_factor": 1.0}, r"backoff_factor must be a number in \(0, 1\) .*got 1.0"),
    ({"backoff_factor": 0.0}, r"backoff_factor must be a positive number, got 0.0"),
    ({"backoff_factor": 1e-50}, r"backoff_factor must be a number in \(0, 1\)"),  # 0 in f32
    ({"growth_interval": 0}, r"growth_interval must be a positive integer .*got 0"),
    ({"growth_interval": 2.5}, r"growth_interval must be a positive integer .*got 2.5"),
    ({"min_scale": -1.0}, r"min_scale must be a positive number, got -1.0"),
    ({"min_scale": float("inf")}, r"min_scale must be finite"),
])
def test_every_argument_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=rf"^\[DynamicLossScale\] {message}"):
        DynamicLossScale(**kwargs)


def test_a_state_with_the_earlier_entries_is_refused():
    ls = DynamicLossScale()
    with pytest.raises(ValueError, match=r"unexpected state entry 'period'"):
        ls.load_state({**ls.state, "period": mx.array(3, mx.int32)})


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(("entry", "value", "message"), [
    ("loss_scale", mx.array(_NAN), r"state entry 'loss_scale' must be finite and at least "
                                   r"min_scale=1.0, got nan"),
    ("loss_scale", mx.array(_INF), r"state entry 'loss_scale' must be finite .*got inf"),
    ("loss_scale", mx.array(0.0), r"state entry 'loss_scale' must be finite .*got 0.0"),
    ("loss_scale", mx.array(-8.0), r"state entry 'loss_scale' must be finite .*got -8.0"),
    ("loss_scale", mx.array(0.5), r"state entry 'loss_scale' must be .* at least min_scale=1.0"),
    ("min_scale", mx.array(1e30), r"state entry 'loss_scale' must be .* min_scale=1e\+30"),
    ("min_scale", mx.array(_INF), r"min_scale must be finite"),
    ("counter", mx.array(-1, mx.int32), r"state entry 'counter' must be in \[0, "
                                        r"growth_interval=2000\), got -1"),
    ("counter", mx.array(5000, mx.int32), r"state entry 'counter' must be in \[0, growth_interval"),
    ("counter", mx.array(2.5), r"state entry 'counter' must be an integer array, got float32"),
    ("growth_interval", mx.array(-3, mx.int32), r"growth_interval must be a positive integer"),
    ("growth_factor", mx.array(_NAN), r"growth_factor must be a positive number, got nan"),
    ("backoff_factor", mx.array(0.0), r"backoff_factor must be a positive number"),
    ("backoff_factor", mx.array(3.0), r"backoff_factor must be a number in \(0, 1\)"),
    ("loss_scale", mx.array(True), r"state entry 'loss_scale' must be a real array, got bool"),
])
def test_corrupt_loaded_values_are_refused_and_change_nothing(entry, value, message):
    ls = DynamicLossScale()
    ls.adjust(mx.array(True))
    state = dict(ls.state)
    with pytest.raises(ValueError, match=rf"^\[DynamicLossScale\] {message}"):
        ls.load_state({**state, entry: value})
    assert all(ls.state[k] is v for k, v in state.items())
    # through OptState.load_state too, naming the loss scale, and changing nothing there
    model = Dense(2, 1)
    opt_state = setup(Adam(), model, loss_scale=ls)
    before = tree_flatten(opt_state.state)
    with pytest.raises(ValueError, match=rf"^OptState.load_state: loss_scale: .*{message}"):
        opt_state.load_state({**opt_state.state, "loss_scale": {**state, entry: value}})
    assert all(a[1] is b[1] for a, b in zip(tree_flatten(opt_state.state), before, strict=True))


@pytest.mark.parametrize("value", [_NAN, _INF, 0.0, -2.0])
def test_corrupt_static_scale_is_refused(value):
    ls = StaticLossScale(8.0)
    with pytest.raises(ValueError, match=r"^\[StaticLossScale\] state entry 'loss_scale' must "
                       r"be a finite positive number"):
        ls.load_state({"loss_scale": mx.array(value)})
    assert ls.loss_scale.item() == 8.0


# ---------------------------------------------------------------- one scale, one OptState


def _two_models():
    mx.random.seed(1)
    return Chain(Dense(3, 4), Dense(4, 2)), Chain(Dense(3, 4), Dense(4, 2))


def test_one_scale_shared_by_two_opt_states_is_refused():
    # PyTorch's test_grad_scaling_multiple: two models, one scaler. Each update adjusted the
    # shared scale, so it changed twice per iteration (and unscaled model b's gradients with a
    # scale that had not produced them): refused, saying what to do instead.
    a, b = _two_models()
    ls = DynamicLossScale(init_scale=1024.0)
    first = setup(Adam(), a, loss_scale=ls)
    with pytest.raises(ValueError, match=r"^setup: this DynamicLossScale already belongs to "
                       r"another OptState.*Give each OptState its own.*a container module "
                       r"holding both, one setup"):
        setup(Adam(), b, loss_scale=ls)
    other = setup(Adam(), b)
    x = mx.ones((2, 3))
    mse = lambda m, x: (m(x) ** 2).mean()  # noqa: E731
    from fluxlike import train
    with pytest.raises(ValueError, match=r"^train: this DynamicLossScale already belongs"):
        train(mse, b, [x], other, loss_scale=ls, progress=False)
    assert isinstance(other.loss_scale, NoOpLossScale) and first.loss_scale is ls
    with pytest.raises(ValueError, match=r"^OptState: this DynamicLossScale already belongs"):
        other.loss_scale = ls


def test_a_static_scale_may_be_shared():  # it never changes: nothing to adjust twice
    a, b = _two_models()
    ls = StaticLossScale(1024.0)
    assert setup(Adam(), a, loss_scale=ls).loss_scale is setup(Adam(), b, loss_scale=ls).loss_scale


def test_one_opt_state_keeps_its_scale_over_many_train_calls():
    from fluxlike import train
    a, _ = _two_models()
    ls = DynamicLossScale(init_scale=1024.0, growth_interval=2)
    opt_state = setup(Adam(), a, loss_scale=ls)
    mse = lambda m, x: (m(x) ** 2).mean()  # noqa: E731
    for _ in range(3):
        train(mse, a, [mx.ones((2, 3))], opt_state, loss_scale=ls, progress=False)
        train(mse, a, [mx.ones((2, 3))], opt_state, progress=False)
    assert opt_state.loss_scale is ls and ls.loss_scale.item() == 8192.0


def test_a_scale_is_free_again_once_its_opt_state_is_gone_or_lets_go():
    import gc
    a, b = _two_models()
    ls = DynamicLossScale()
    first = setup(Adam(), a, loss_scale=ls)
    first.loss_scale = DynamicLossScale()  # lets go of ls
    second = setup(Adam(), b, loss_scale=ls)
    del second
    gc.collect()
    setup(Adam(), b, loss_scale=ls)


def test_two_models_as_one_adjust_the_scale_once_per_iteration():
    # the supported way: both models in one container, one setup, one scale
    import mlx.nn as nn
    a, b = _two_models()
    both = nn.Module()
    both.a, both.b = a, b
    ls = DynamicLossScale(init_scale=1024.0, growth_interval=1)
    opt_state = setup(Adam(0.01), both, loss_scale=ls)
    x = mx.ones((2, 3))
    for _ in range(3):
        (grads,) = gradient(lambda m: (m.a(x) ** 2).mean() + (m.b(x) ** 2).mean(), both,
                            loss_scale=ls)
        update(opt_state, both, grads)
    assert ls.loss_scale.item() == 1024.0 * 2**3  # once per iteration, not twice


# ---------------------------------------------------------------- no loss scale


def test_no_op_scale_is_the_identity_and_has_no_state():
    ls = NoOpLossScale()
    tree = {"w": mx.array([1.0, 2.0], mx.float16), "n": [mx.array([3], mx.int32)]}
    assert ls.scale(tree) is tree and ls.unscale(tree) is tree
    loss = mx.array(0.25)
    assert ls.scale(loss) is loss
    ls.adjust(mx.array(False))
    assert ls.state == {} and ls.loss_scale.item() == 1.0 and repr(ls) == "NoOpLossScale()"
    ls.load_state({})
    with pytest.raises(ValueError, match=r"\[NoOpLossScale\] unexpected state entry 'counter'"):
        ls.load_state({"counter": mx.array(0, mx.int32)})


def test_none_means_a_no_op_scale_everywhere():
    model = Dense(2, 1)
    for opt_state in (setup(Adam(), model), setup(Adam(), model, loss_scale=None),
                      setup(Adam(), model, loss_scale="auto")):
        assert isinstance(opt_state.loss_scale, NoOpLossScale)
        assert opt_state.state["loss_scale"] == {}
    opt_state.loss_scale = StaticLossScale(4.0)
    opt_state.loss_scale = None  # assigning None assigns a no-op scale
    assert isinstance(opt_state.loss_scale, NoOpLossScale)
    shared = NoOpLossScale()  # never adjusts: may serve several states
    assert setup(Adam(), model, loss_scale=shared).loss_scale is shared
    assert setup(Adam(), model, loss_scale=shared).loss_scale is shared


def test_gradient_with_a_no_op_scale_equals_none():
    model = Dense(3, 2)
    x = mx.ones((4, 3))
    f = lambda m: (m(x) ** 2).sum()  # noqa: E731
    (plain,), (noop,) = gradient(f, model), gradient(f, model, loss_scale=NoOpLossScale())
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in
               zip(tree_flatten(plain), tree_flatten(noop), strict=True))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_update_without_a_scale_skips_a_non_finite_step(bad):
    # one path for every scale: the finite check and mx.where keep are the no-op scale's too
    model = Dense(2, 1)
    opt_state = setup(Adam(0.1), model)
    before = {k: v for k, v in tree_flatten(model.parameters())}
    grads = tree_map(lambda p: mx.full(p.shape, bad), model.trainable_parameters())
    update(opt_state, model, grads)
    assert all(mx.array_equal(v, before[k]).item() for k, v in tree_flatten(model.parameters()))
    assert opt_state.optimizer.state["step"].item() == 0


@given(st.lists(st.sampled_from([0.0, 1.0, -3.0, 6e4, float("inf"), -float("inf"),
                                  float("nan")]), min_size=1, max_size=6),
       st.sampled_from([mx.float32, mx.float16, mx.bfloat16]))
@settings(max_examples=60, deadline=None)
def test_sum_finite_agrees_with_all_finite(values, dtype):
    # 6e4 in float16, summed: no false overflow (the sum is taken in float32)
    from fluxlike.precision.lossscale import sum_finite
    tree = {"a": mx.array(values, dtype=dtype), "b": [mx.array(values[::-1], dtype=dtype)],
            "n": mx.array([1], mx.int32)}
    assert sum_finite(tree).item() == all_finite(tree).item()
