"""Tests of fluxlike/training.py's trainstep and trainstep_withgradient (Flux's trainstep!),
and of fluxlike/compiledstep.py, the whole step compiled and cached with its OptState."""

from __future__ import annotations

import gc
import math
import signal
import textwrap
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import interrupted_child, leaves, mse_of
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxlike.compiledstep as compiledstep
from fluxlike import (
    Adam,
    BatchNorm,
    Chain,
    Dense,
    Descent,
    Dropout,
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    gradient,
    relu,
    setup,
    train,
    trainstep,
    trainstep_withgradient,
    update,
)
from fluxlike.optimisers.compiled import COMPILED


def _data(seed=0, batch=8):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.normal(size=(batch, 3)).astype(np.float32))
    return x, mx.array(rng.normal(size=(batch, 1)).astype(np.float32))


def _model(seed=0, norm=False, dropout=False):
    mx.random.seed(seed)
    layers = [Dense(3, 4, relu)]
    layers += [BatchNorm(4)] if norm else []
    layers += [Dropout(0.5)] if dropout else []
    return Chain(*layers, Dense(4, 1))


def _state(model, opt_state):
    """Everything a step may change, as host values."""
    mx.eval(model.parameters(), opt_state.state)
    return ({k: np.array(v) for k, v in leaves(model.parameters()).items()},
            {k: np.array(v) for k, v in leaves(opt_state.state).items()},
            np.array(mx.random.state[0]))


def _same(a, b):
    (pa, sa, ka), (pb, sb, kb) = a, b
    return (pa.keys() == pb.keys() and sa.keys() == sb.keys()
            and all(np.array_equal(pa[k], pb[k], equal_nan=True) for k in pa)
            and all(np.array_equal(sa[k], sb[k], equal_nan=True) for k in sa)
            and np.array_equal(ka, kb))


# ---------------------------------------------------------------- the step


@pytest.mark.parametrize("compile", [False, True])
def test_trainstep_is_gradient_then_update(compile):
    x, y = _data()
    model, reference = _model(), _model()
    opt_state, ref_state = setup(Adam(0.01), model), setup(Adam(0.01), reference)
    for _ in range(3):
        loss = trainstep(mse_of, model, (x, y), opt_state, compile=compile)
        assert type(loss) is float
        assert loss == pytest.approx(mse_of(reference, x, y).item(), rel=1e-6)
        update(ref_state, reference, gradient(mse_of, reference, x, y)[0])
    for k, v in leaves(model.parameters()).items():
        assert mx.allclose(v, leaves(reference.parameters())[k], atol=1e-6).item(), k


def test_a_tuple_batch_is_splatted_anything_else_is_one_argument():
    x, y = _data()
    model = _model()
    opt_state = setup(Descent(0.1), model)
    seen = []
    trainstep(lambda m, a, b: (seen.append(2), mse_of(m, a, b))[1], model, (x, y), opt_state)
    trainstep(lambda m, d: (seen.append(1), mse_of(m, d["x"], d["y"]))[1], model,
              {"x": x, "y": y}, opt_state)
    trainstep(lambda m, a: (seen.append(0), (m(a) ** 2).mean())[1], model, x, opt_state)
    assert seen == [2, 1, 0]


def test_a_loss_with_aux_outputs_returns_the_loss():
    x, y = _data()
    model = _model()
    loss = trainstep(lambda m, x, y: (mse_of(m, x, y), "aux"), model, (x, y),
                     setup(Descent(0.1), model))
    assert loss == pytest.approx(mse_of(_model(), x, y).item(), rel=1e-6)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_skips_the_step_and_changes_nothing(compile, bad):
    # model (running statistics too), optimiser, loss-scale and random state as before
    x, y = _data()
    model = _model(norm=True, dropout=True)
    opt_state = setup(Adam(0.01), model, loss_scale=DynamicLossScale(256.0, growth_interval=1))
    trainstep(mse_of, model, (x, y), opt_state, compile=compile)  # state exists, scale grew
    before = _state(model, opt_state)

    def poisoned(m, x, y):
        return mse_of(m, x, y) * bad

    assert math.isnan(trainstep(poisoned, model, (x, y), opt_state, compile=compile)) or (
        bad == math.inf)
    assert _same(before, _state(model, opt_state))
    # and training goes on from there
    assert math.isfinite(trainstep(mse_of, model, (x, y), opt_state, compile=compile))
    assert not _same(before, _state(model, opt_state))


@pytest.mark.parametrize("compile", [False, True])
def test_overflowing_gradients_are_a_skipped_step_that_lowers_the_scale(compile):
    x, y = _data()
    model = _model()
    opt_state = setup(Descent(0.1), model, loss_scale=StaticLossScale(1.0))
    opt_state.loss_scale = DynamicLossScale(2.0**15)
    params = _state(model, opt_state)[0]

    def kinked(m, x, y):  # finite loss, non-finite gradient (sqrt's slope at 0)
        return mx.sqrt(mx.abs(m.layers[0].weight * 0)).sum() + mse_of(m, x, y)

    loss = trainstep(kinked, model, (x, y), opt_state, compile=compile)
    assert math.isfinite(loss)
    assert opt_state.loss_scale.loss_scale.item() == 2.0**14
    after = _state(model, opt_state)[0]
    assert all(np.array_equal(params[k], after[k]) for k in params)


def test_trainstep_withgradient_returns_the_unscaled_float32_gradient():
    x, y = _data()
    model, reference = _model(), _model()
    expected = gradient(mse_of, reference, x, y, autocast=mx.float16)[0]
    opt_state = setup(Descent(0.1), model)
    loss, grads = trainstep_withgradient(mse_of, model, (x, y), opt_state,
                                         autocast=mx.float16)
    assert isinstance(opt_state.loss_scale, DynamicLossScale)  # "auto" made one
    assert leaves(grads).keys() == leaves(model.trainable_parameters()).keys()
    for k, g in leaves(grads).items():
        assert g.dtype == mx.float32
        assert mx.allclose(g, leaves(expected)[k], rtol=2e-2, atol=1e-3).item(), k
    _, grads_c = trainstep_withgradient(mse_of, _model(), (x, y), setup(Descent(0.1), _model()),
                                        compile=True)
    assert leaves(grads_c).keys() == leaves(grads).keys()


def test_the_loss_scale_argument():
    x, y = _data()
    model = _model()
    opt_state = setup(Descent(0.1), model)
    trainstep(mse_of, model, (x, y), opt_state, autocast=mx.bfloat16)
    assert isinstance(opt_state.loss_scale, NoOpLossScale)
    trainstep(mse_of, model, (x, y), opt_state, autocast=mx.float16)
    dynamic = opt_state.loss_scale
    assert isinstance(dynamic, DynamicLossScale)
    trainstep(mse_of, model, (x, y), opt_state)  # "auto" keeps it
    assert opt_state.loss_scale is dynamic
    trainstep(mse_of, model, (x, y), opt_state, loss_scale=64)
    static = opt_state.loss_scale
    trainstep(mse_of, model, (x, y), opt_state, loss_scale=64.0)  # the same: kept
    assert opt_state.loss_scale is static and static.loss_scale.item() == 64
    trainstep(mse_of, model, (x, y), opt_state, loss_scale=None)
    assert isinstance(opt_state.loss_scale, NoOpLossScale)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"autocast": mx.float32}, ValueError,
     r"trainstep: autocast must be None, mx.float16 or mx.bfloat16, got mlx.core.float32"),
    ({"loss_scale": "dynamic"}, ValueError, r"trainstep: loss_scale must be None, 'auto'"),
    ({"loss_scale": -1.0}, ValueError, r"scale must be a positive number, got -1.0"),
    ({"model": "model"}, TypeError, r"trainstep: model must be an mlx.nn.Module, got str"),
    ({"opt_state": {}}, TypeError, r"trainstep: expected an OptState from setup\(\), got \{\}"),
    ({"loss": lambda m, x: mse_of(m, x, x)}, TypeError,
     r"trainstep: the loss is called as loss\(model, \*batch\), here with a batch of 2 "
     r"\(array, array\), and cannot take that"),
    ({"loss": lambda m, x, y: m(x)}, ValueError,
     r"trainstep: the function must return a floating scalar \(the loss\), got shape \(8, 1\)"),
    ({"other_model": True}, ValueError,
     r"trainstep: opt_state (was set up for another model|does not fit the model)"),
])
@pytest.mark.parametrize("compile", [False, True])
def test_bad_input_names_trainstep_and_changes_nothing(kwargs, error, message, compile):
    kwargs = dict(kwargs)
    x, y = _data()
    model = _model()
    opt_state = setup(Adam(0.01), model, loss_scale=DynamicLossScale())
    trainstep(mse_of, model, (x, y), opt_state, compile=compile)
    scale = opt_state.loss_scale
    args = {"loss": mse_of, "model": model, "opt_state": opt_state}
    if kwargs.pop("other_model", False):
        args["model"] = Chain(Dense(3, 2), Dense(2, 1))
    args.update({k: v for k, v in kwargs.items() if k in args})
    options = {k: v for k, v in kwargs.items() if k not in args}
    before = _state(model, opt_state)
    with pytest.raises(error, match=message):
        trainstep(args["loss"], args["model"], (x, y), args["opt_state"], compile=compile,
                  **options)
    assert _same(before, _state(model, opt_state)) and opt_state.loss_scale is scale
    assert math.isfinite(trainstep(mse_of, model, (x, y), opt_state, compile=compile))


# ---------------------------------------------------------------- train over trainstep


@pytest.mark.parametrize("compile", [False, True])
def test_train_is_a_loop_over_trainstep(compile):
    data = [_data(seed) for seed in range(4)]
    a, b = _model(), _model()
    state_a, state_b = setup(Adam(0.01), a), setup(Adam(0.01), b)
    mean = train(mse_of, a, data, state_a, progress=False, compile=compile)
    losses = [trainstep(mse_of, b, batch, state_b, compile=compile) for batch in data]
    assert mean == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    for k, v in leaves(a.parameters()).items():
        assert mx.array_equal(v, leaves(b.parameters())[k]).item(), k


# ---------------------------------------------------------------- the compiled step's cache


def _counting(traces):
    def loss(m, x, y):  # its Python runs only while a trace is made
        traces.append(x.shape)
        return mse_of(m, x, y)
    return loss


def test_the_compiled_step_is_reused_across_calls_epochs_and_train():
    traces = []
    loss = _counting(traces)
    model = _model()
    opt_state = setup(Adam(0.01), model)
    x, y = _data()
    for _ in range(3):
        trainstep(loss, model, (x, y), opt_state, compile=True)
    for _ in range(2):  # epochs, in train's own idiom: one batch per call
        train(loss, model, [(x, y)], opt_state, progress=False, compile=True)
    assert len(traces) == 1
    x2, y2 = _data(batch=5)
    trainstep(loss, model, (x2, y2), opt_state, compile=True)  # a new batch shape: traced
    trainstep(loss, model, (x, y), opt_state, compile=True)  # the first: still cached
    assert len(traces) == 2
    trainstep(loss, model, (x, y), opt_state, compile=True, autocast=mx.bfloat16)
    trainstep(loss, model, (x, y), opt_state, compile=True, loss_scale=128)
    model.layers[0].freeze()
    trainstep(loss, model, (x, y), opt_state, compile=True, loss_scale=128)
    assert len(traces) == 5
    assert len(COMPILED[opt_state].whole) == 5


def test_a_traced_step_is_not_replayed_for_another_key():
    # a frozen layer must stay as it is: a replay of the unfrozen trace would train it
    x, y = _data()
    model = _model()
    opt_state = setup(Descent(0.1), model)
    trainstep(mse_of, model, (x, y), opt_state, compile=True)
    model.layers[0].freeze()
    frozen = np.array(model.layers[0].weight)
    trainstep(mse_of, model, (x, y), opt_state, compile=True)
    assert np.array_equal(frozen, np.array(model.layers[0].weight))


@pytest.mark.parametrize("compile", [False, True])
def test_the_compiled_step_goes_with_its_model_and_optimiser_state(compile):
    x, y = _data()
    model = _model()
    opt_state = setup(Adam(0.01), model)
    for _ in range(2):
        trainstep(mse_of, model, (x, y), opt_state, compile=compile)
    train(mse_of, model, [(x, y)], opt_state, progress=False, compile=compile)
    refs = weakref.ref(model), weakref.ref(opt_state)
    del model, opt_state
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


@pytest.mark.parametrize("compile", [False, True])
def test_a_step_keeps_no_strong_reference_to_a_loss_that_refers_to_its_state(compile):
    """What a step keeps with the optimiser state (the eager path's gradient function, the
    compiled step and its key) holds the loss weakly: a trainer whose bound-method loss
    refers to the optimiser state, or a loss whose default argument does, is collected with
    it; meanwhile its steps reuse what was kept."""
    x, y = _data()
    model = _model()
    opt_state = setup(Adam(0.01), model)

    def loss(m, x, y, held=opt_state):
        return mse_of(m, x, y)

    for _ in range(3):
        trainstep(loss, model, (x, y), opt_state, compile=compile)
    assert len(COMPILED[opt_state].whole) == (1 if compile else 0)
    refs = weakref.ref(model), weakref.ref(opt_state)
    del model, opt_state, loss
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_trainers_bound_method_loss_goes_with_the_trainer():
    """A trainer whose bound-method loss refers to its optimiser state (which keys what a
    step keeps: the eager path's gradient function, the compiled step) is collected whole;
    meanwhile its steps reuse what was kept (a new, equal bound method at each access)."""

    class Trainer:
        def __init__(self):
            self.model = _model()
            self.opt_state = setup(Adam(0.01), self.model)

        def loss(self, m, x, y):  # a new bound method at each access
            return mse_of(m, x, y)

    x, y = _data()
    for compile in (False, True):
        trainer = Trainer()
        for _ in range(3):
            trainstep(trainer.loss, trainer.model, (x, y), trainer.opt_state, compile=compile)
        kept = COMPILED[trainer.opt_state]
        kept = kept.whole.copy() if compile else kept.gradient
        trainstep(trainer.loss, trainer.model, (x, y), trainer.opt_state, compile=compile)
        now = COMPILED[trainer.opt_state]
        assert (now.whole == kept) if compile else (now.gradient is kept)  # reused
        refs = weakref.ref(trainer), weakref.ref(trainer.opt_state), weakref.ref(trainer.model)
        del trainer, kept, now
        gc.collect()
        assert all(ref() is None for ref in refs)


def test_a_compiled_step_of_a_closure_follows_what_its_cells_hold():
    """A compiled trace bakes in what the loss's closure holds: the same objects find the
    trace again (a lambda written anew each step included); a name rebound to another object
    traces anew, so the step computes with the new one."""
    x, y = _data()
    model = _model()
    opt_state = setup(Descent(1e-30), model)  # (steps too small to move a float32 weight)
    weight = mx.array(1.0)

    def weighted():
        return lambda m, x, y: weight * mse_of(m, x, y)

    base = trainstep(weighted(), model, (x, y), opt_state, compile=True)
    assert trainstep(weighted(), model, (x, y), opt_state, compile=True) == base
    assert len(COMPILED[opt_state].whole) == 1
    weight = mx.array(3.0)
    assert trainstep(weighted(), model, (x, y), opt_state, compile=True) == pytest.approx(
        3 * base)
    assert len(COMPILED[opt_state].whole) == 2


# ---------------------------------------------------------------- what a step costs


@pytest.mark.parametrize("compile", [False, True])
def test_a_step_installs_no_signal_handler_flattens_no_tree_and_reads_the_device_once(
        compile, monkeypatch):
    x, y = _data()
    model = _model()
    opt_state = setup(Adam(0.01), model, loss_scale=DynamicLossScale())
    for _ in range(2):
        trainstep(mse_of, model, (x, y), opt_state, compile=compile)
    calls = {"signal": 0, "flatten": 0, "eval": 0, "async_eval": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(signal, "signal", counting("signal", signal.signal))
    import fluxlike.gradients
    import fluxlike.optimisers.compiled
    import fluxlike.optimisers.state
    import fluxlike.training
    for module in (fluxlike.gradients, fluxlike.optimisers.compiled, fluxlike.optimisers.state,
                   fluxlike.training, compiledstep):
        if hasattr(module, "tree_flatten"):
            monkeypatch.setattr(module, "tree_flatten",
                                counting("flatten", module.tree_flatten))
    monkeypatch.setattr(mx, "eval", counting("eval", mx.eval))
    monkeypatch.setattr(mx, "async_eval", counting("async_eval", mx.async_eval))
    for _ in range(5):
        trainstep(mse_of, model, (x, y), opt_state, compile=compile)
    assert calls == {"signal": 0, "flatten": 0, "eval": 5, "async_eval": 0}


def test_after_its_first_step_a_model_is_stepped_without_validating_it_again(monkeypatch):
    # the first step validates the model's tree (fluxlike.optimisers.state._check_grads);
    # later steps of the same tree take the remembered path and give the same numbers
    x, y = _data()
    model, twin = _model(), _model()
    opt_state, twin_state = setup(Adam(0.01), model), setup(Adam(0.01), twin)
    trainstep(mse_of, model, (x, y), opt_state)
    checks = []
    import fluxlike.optimisers.state as state_module
    real = state_module._check_grads
    monkeypatch.setattr(state_module, "_check_grads",
                        lambda *a, **k: checks.append(1) or real(*a, **k))
    losses = [trainstep(mse_of, model, (x, y), opt_state) for _ in range(3)]
    assert checks == []
    monkeypatch.undo()
    twin_losses = [float(withgradient_step(twin, twin_state, x, y)) for _ in range(4)]
    assert losses == twin_losses[1:]
    assert _same(_state(model, opt_state)[:2] + (0,), _state(twin, twin_state)[:2] + (0,))


def test_the_remembered_path_follows_the_loss_the_model_and_the_scale_of_each_call():
    """The eager path keeps the gradient function it made for the last (loss, model, scale):
    another loss, another model wrapping the same layers, or another scale is taken with its
    own, call by call."""
    x, y = _data()
    model = _model()
    opt_state = setup(Descent(1e-30), model)  # (steps too small to move a float32 weight)
    doubled = lambda m, x, y: 2 * mse_of(m, x, y)  # noqa: E731
    base = trainstep(mse_of, model, (x, y), opt_state)
    for _ in range(2):
        assert trainstep(doubled, model, (x, y), opt_state) == pytest.approx(2 * base)
        assert trainstep(mse_of, model, (x, y), opt_state) == pytest.approx(base)

    class Negated(Chain):  # the same layers (the same fingerprint), another forward
        def __call__(self, x):
            return -super().__call__(x)

    other = Negated(*model.layers)
    negated = mse_of(other, x, y).item()
    assert trainstep(mse_of, other, (x, y), opt_state) == pytest.approx(negated)
    assert trainstep(mse_of, model, (x, y), opt_state) == pytest.approx(base)
    # a static scale of 1024 (a power of two: exact) unscales to the same gradients
    _, scaled = trainstep_withgradient(mse_of, model, (x, y), opt_state, loss_scale=1024.0)
    _, plain = trainstep_withgradient(mse_of, model, (x, y), opt_state, loss_scale=None)
    scaled, plain = leaves(scaled), leaves(plain)
    assert scaled.keys() == plain.keys()
    for k in scaled:
        np.testing.assert_array_equal(np.array(scaled[k]), np.array(plain[k]))


def withgradient_step(model, opt_state, x, y):
    """A step the long way round: gradient, then update."""
    from fluxlike import withgradient
    loss, (g, *_) = withgradient(mse_of, model, x, y)
    update(opt_state, model, g)
    mx.eval(model.parameters(), opt_state.state)
    return loss.item()


@pytest.mark.parametrize("change", ["reshape", "freeze", "thaw", "new layer"])
def test_a_model_changed_between_steps_is_validated_again(change):
    x, y = _data()
    model = _model()
    opt_state = setup(Descent(0.1), model)
    for _ in range(2):
        trainstep(mse_of, model, (x, y), opt_state)
    if change == "reshape":  # another model's shape: refused, nothing changed
        model.layers[1].weight = mx.zeros((1, 5))
        model.layers[0] = Dense(3, 5, relu)
        before = _state(model, opt_state)
        with pytest.raises(ValueError, match="trainstep: opt_state was set up for another"):
            trainstep(mse_of, model, (x, y), opt_state)
        assert _same(_state(model, opt_state), before)
        return
    if change == "freeze":  # a frozen weight is not stepped
        model.layers[0].freeze()
    elif change == "thaw":
        model.layers[0].freeze()
        trainstep(mse_of, model, (x, y), opt_state)
        model.layers[0].unfreeze()
    else:  # a layer swapped for one of the same shapes: its own arrays are stepped
        model.layers[1] = Dense(4, 1)
    frozen = np.array(model.layers[0].weight)
    swapped = np.array(model.layers[1].weight)
    trainstep(mse_of, model, (x, y), opt_state)
    if change == "freeze":
        np.testing.assert_array_equal(np.array(model.layers[0].weight), frozen)
    else:
        assert not np.array_equal(np.array(model.layers[0].weight), frozen)
    assert not np.array_equal(np.array(model.layers[1].weight), swapped)


# ---------------------------------------------------------------- against a model of the rule


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(["ok", "nan loss", "overflow"]), min_size=1, max_size=6),
       st.booleans())
def test_random_sequences_match_a_model_of_skipping(steps, compile):
    # a skipped step changes nothing but (after an overflow) the scale; a taken one is
    # gradient + update
    x, y = _data()
    model, reference = _model(), _model()
    scale = DynamicLossScale(2.0**10, growth_interval=2)
    opt_state = setup(Adam(0.01), model, loss_scale=scale)
    ref_state = setup(Adam(0.01), reference)
    expected_scale, counter = 2.0**10, 0
    losses = {"ok": mse_of,
              "nan loss": lambda m, x, y: mse_of(m, x, y) * math.nan,
              "overflow": lambda m, x, y: mx.sqrt(mx.abs(m.layers[0].weight * 0)).sum()
              + mse_of(m, x, y)}
    for kind in steps:
        trainstep(losses[kind], model, (x, y), opt_state, compile=compile)
        if kind == "ok":
            update(ref_state, reference, gradient(mse_of, reference, x, y)[0])
            counter += 1
            if counter == 2:
                expected_scale, counter = expected_scale * 2, 0
        elif kind == "overflow":
            expected_scale, counter = expected_scale / 2, 0
        assert opt_state.loss_scale.loss_scale.item() == expected_scale
        assert opt_state.loss_scale.counter.item() == counter
        for k, v in leaves(model.parameters()).items():
            assert mx.allclose(v, leaves(reference.parameters())[k], atol=1e-5).item(), k


def test_a_learning_rate_set_between_compiled_steps_takes_effect():
    # a schedule in the user's loop: the rate is an array of the optimiser state, not baked in
    x, y = _data()
    eager, compiled = _model(), _model()
    states = setup(Adam(0.1), eager), setup(Adam(0.1), compiled)
    for rate in (0.1, 0.01, 0.0, 0.05):
        for model, opt_state, flag in ((eager, states[0], False), (compiled, states[1], True)):
            opt_state.optimizer.learning_rate = rate
            trainstep(mse_of, model, (x, y), opt_state, compile=flag)
    for k, v in leaves(eager.parameters()).items():
        assert mx.allclose(v, leaves(compiled.parameters())[k], atol=1e-6).item(), k
    assert len(COMPILED[states[1]].whole) == 1


# ---------------------------------------------------------------- Ctrl-C inside a step

_CHILD = """
    import signal
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from fluxlike import Chain, Dense, Descent, setup, trainstep

    model = Chain(*[Dense(4, 4) for _ in range(150)])  # many small layers: a long update
    for layer in model.layers:
        layer.weight, layer.bias = mx.zeros((4, 4)), mx.zeros((4,))
    opt_state = setup(Descent(1.0), model)

    def loss(m):  # every parameter's gradient is 1: each step takes 1 off every entry
        return sum(p.sum() for _, p in tree_flatten(m.trainable_parameters()))

    trainstep(loss, model, (), opt_state, compile=COMPILE)
    armed = False

    def handler(signum, frame):
        if armed:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    print("ready", flush=True)
    interrupts = torn = steps = 0
    while interrupts < 40:
        try:
            armed = True
            trainstep(loss, model, (), opt_state, compile=COMPILE)
            armed = False
            steps += 1
        except KeyboardInterrupt:
            armed = False
            interrupts += 1
        values = {p.reshape(-1)[0].item() for _, p in tree_flatten(model.parameters())}
        torn += len(values) != 1
    print("INTERRUPTED", interrupts, "TORN", torn, flush=True)
"""


@pytest.mark.parametrize("compile", [False, True])
def test_ctrl_c_inside_trainstep_takes_all_of_the_step_or_none(compile):
    root = Path(__file__).resolve().parent.parent
    code = textwrap.dedent(_CHILD).replace("COMPILE", str(compile))
    out, err = interrupted_child(code, root)
    assert "INTERRUPTED 40 TORN 0" in out, (out, err[-2000:])


def test_a_lambda_written_in_the_loop_finds_its_trace():
    traces = []
    x, y = _data()
    model = _model()
    opt_state = setup(Descent(0.1), model)
    scale = [2.0]
    for _ in range(3):  # a new function object each time, the same code and closure
        trainstep(lambda m, x, y: (traces.append(1), mse_of(m, x, y) * scale[0])[1], model,
                  (x, y), opt_state, compile=True)
    assert len(traces) == 1
    trainstep(lambda m, x, y: (traces.append(1), mse_of(m, x, y))[1], model, (x, y),
              opt_state, compile=True)  # other code: traced
    assert len(traces) == 2


def test_the_remembered_step_notices_settings_changed_between_steps():
    """``trainstep``'s eager path reuses the last compiled update while the optimiser's
    settings are unchanged (checked against its attributes, not a snapshot per step): an
    equal value assigned keeps it; a list changed in place, a new attribute, another array in
    one, an equal value of another type (an array for a float), a dict filled in place or a
    list changed one level down traces anew."""
    mx.random.seed(0)
    model, x, y = Chain(Dense(3, 4, relu), Dense(4, 2)), mx.random.normal((5, 3)), mx.ones((5, 2))
    opt_state = setup(Adam(0.01), model)

    def traces_after(n: int) -> int:
        for _ in range(n):
            trainstep(mse_of, model, (x, y), opt_state)
        return len(COMPILED[opt_state].steps)

    optimizer = opt_state.optimizer
    assert traces_after(3) == 1
    optimizer.eps = float(str(optimizer.eps))  # equal, another object
    assert traces_after(2) == 1
    optimizer.betas[0] = 0.5
    assert traces_after(2) == 2
    optimizer.note = mx.ones(3)
    assert traces_after(2) == 3
    optimizer.note = mx.ones(3)  # (arrays compared without a truth value of their ==)
    assert traces_after(2) == 4
    optimizer.eps = mx.array(optimizer.eps)  # == the float, but another kind of setting
    assert traces_after(2) == 5
    opt_state = setup(Adam(0.01), model)  # (a new state: at most Compiled.LIMIT traces kept)
    optimizer = opt_state.optimizer
    optimizer.extra = {}  # an empty dict, then filled in place
    assert traces_after(2) == 1
    optimizer.extra["k"] = 1.0
    assert traces_after(2) == 2
    optimizer.nested = [[1.0]]  # a list of lists: changed in place one level down
    assert traces_after(2) == 3
    optimizer.nested[0][0] = 2.0
    assert traces_after(2) == 4
    optimizer.extra["k"] = mx.array(1.0)  # == the float inside a dict, another kind of setting
    assert traces_after(2) == 5
    assert all(np.isfinite(np.array(v)).all() for v in leaves(model.parameters()).values())
