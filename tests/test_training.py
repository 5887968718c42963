"""Tests of fluxlike/training.py: the train loop (and gradient/update as train uses them)."""

from __future__ import annotations

import io
import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from helpers import leaves, mse_of
from mlx.utils import tree_flatten

import fluxlike
from fluxlike import (
    Adam,
    BatchNorm,
    Chain,
    ClipNorm,
    Dense,
    Descent,
    Dropout,
    DynamicLossScale,
    NoOpLossScale,
    OptimiserChain,
    StaticLossScale,
    gradient,
    relu,
    setup,
    train,
    update,
    withgradient,
)
from fluxlike.gradients import _trainable_parameters

# ---------------------------------------------------------------- train


def _regression(n_batches=8, batch=16, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(3, 1)).astype(np.float32)
    data = []
    for _ in range(n_batches):
        x = rng.normal(size=(batch, 3)).astype(np.float32)
        data.append((mx.array(x), mx.array(x @ w + 0.5)))
    return data


def test_train_converges_and_returns_mean_loss():
    data = _regression()
    model = Chain(Dense(3, 8, relu), Dense(8, 1))
    opt_state = setup(Adam(0.02), model)
    first = train(mse_of, model, data, opt_state, progress=False)
    for _ in range(30):
        last = train(mse_of, model, data, opt_state, progress=False)
    assert isinstance(last, float) and last < 0.02 * first
    assert opt_state.optimizer.step.item() == 31 * len(data)
    expected = np.mean([mse_of(model, x, y).item() for x, y in data])
    assert train(mse_of, model, data, opt_state, progress=False) == pytest.approx(expected, rel=0.2)


def test_train_splats_tuples_and_passes_other_batches_whole():
    model = Dense(2, 1)
    seen = []

    def loss(m, *batch):
        seen.append(len(batch))
        return m(batch[0]).sum()

    opt_state = setup(Descent(0.0001), model)
    train(loss, model, [(mx.ones((1, 2)), mx.ones(1)), mx.ones((1, 2))], opt_state,
          progress=False)
    assert seen == [2, 1]
    with pytest.warns(UserWarning, match=r"train: data gave no batches, so nothing was trained"):
        assert math.isnan(train(loss, model, [], opt_state, progress=False))


@pytest.mark.parametrize(("call", "flag"), [
    ("train", "compile"), ("train", "progress"), ("trainstep", "compile"),
    ("trainstep_withgradient", "compile")])
def test_flags_must_be_booleans(call, flag):
    # "no" is truthy: taken by its truth, compile="no" would compile
    model = Dense(2, 1)
    opt_state = setup(Descent(0.1), model)
    before = tree_flatten(model.parameters())
    batch = (mx.ones((1, 2)),)
    data = [batch] if call == "train" else batch
    with pytest.raises(TypeError, match=rf"{call}: {flag} must be True or False, got 'no'"):
        getattr(fluxlike, call)(lambda m, x: m(x).sum(), model, data, opt_state, **{flag: "no"})
    after = tree_flatten(model.parameters())
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(before, after, strict=True))


@pytest.mark.parametrize("compile", [False, True])
def test_non_finite_loss_names_the_batch_and_leaves_state(compile):
    good = (mx.ones((4, 2)) * mx.arange(4).reshape(4, 1),)
    bad = (mx.full((4, 2), float("nan")),)
    runs = []
    for data in ([good, good], [good, good, bad, good]):
        mx.random.seed(1)
        model = Chain(Dense(2, 2), BatchNorm(2))
        opt_state = setup(Adam(0.1), model)
        try:
            train(lambda m, x: (m(x) ** 2).sum(), model, data, opt_state, progress=False,
                  compile=compile)
        except FloatingPointError as e:
            assert "loss is nan at batch 2" in str(e)
        else:
            assert len(data) == 2
        runs.append((leaves(model.parameters()), leaves(opt_state.state)))
    (p_ok, s_ok), (p_err, s_err) = runs
    for ok, err in ((p_ok, p_err), (s_ok, s_err)):
        assert set(ok) == set(err)
        for k in ok:
            assert mx.array_equal(ok[k], err[k]).item(), k


@pytest.mark.parametrize("compile", [False, True])
def test_a_raising_loss_leaves_model_optimiser_and_random_state_usable(compile):
    # a loss that only works for batches of 4: the partial last batch raises, while the
    # compiled step is traced for its new shape (mx.compile leaves placeholders behind)
    def loss(m, x):
        if x.shape[0] != 4:
            raise RuntimeError("batch of 4 expected")
        return (Dropout(0.5, active=True)(m(x)) ** 2).sum()

    model = Chain(Dense(2, 2), BatchNorm(2))
    opt_state = setup(Adam(0.1), model, loss_scale=DynamicLossScale())
    data = [mx.arange(8.0).reshape(4, 2), mx.arange(8.0).reshape(4, 2) ** 2, mx.ones((3, 2))]
    with pytest.raises(RuntimeError, match="batch of 4"):
        train(loss, model, data[:2], opt_state, progress=False, compile=compile)  # fine
        train(loss, model, data, opt_state, progress=False, compile=compile)
    saved = leaves(model.parameters()), leaves(opt_state.state), mx.random.state[0]
    mx.eval(saved)  # raises if a placeholder was left anywhere
    mx.random.normal((2,))
    assert train(loss, model, data[:2], opt_state, progress=False, compile=compile) > 0


def test_train_loss_scale_argument():
    model = Dense(2, 1)
    data = [(mx.ones((2, 2)), mx.zeros((2, 1)))]
    opt_state = setup(Descent(0.1), model)
    train(mse_of, model, data, opt_state, autocast=mx.bfloat16, progress=False)
    assert isinstance(opt_state.loss_scale, NoOpLossScale)
    train(mse_of, model, data, opt_state, autocast=mx.float16, progress=False)
    ls = opt_state.loss_scale
    assert isinstance(ls, DynamicLossScale)
    train(mse_of, model, data, opt_state, progress=False)  # "auto" keeps the existing scale
    assert opt_state.loss_scale is ls
    train(mse_of, model, data, opt_state, loss_scale=128, progress=False)
    assert isinstance(opt_state.loss_scale, StaticLossScale)
    train(mse_of, model, data, opt_state, autocast=mx.float16, loss_scale=None, progress=False)
    assert isinstance(opt_state.loss_scale, NoOpLossScale)
    with pytest.raises(ValueError, match="loss_scale must be None, 'auto'"):
        train(mse_of, model, data, opt_state, loss_scale="dynamic")


def test_compiled_training_matches_eager():
    data = _regression(n_batches=4)

    def fresh():
        mx.random.seed(3)
        return Chain(Dense(3, 4, relu), BatchNorm(4), Dense(4, 1))

    results = []
    for compile in (False, True):
        model = fresh()
        opt_state = setup(Adam(0.01), model)
        losses = [train(mse_of, model, data, opt_state, progress=False, compile=compile)
                  for _ in range(2)]
        results.append((losses, leaves(model.parameters()), leaves(opt_state.state)))
    (l0, p0, s0), (l1, p1, s1) = results
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    for eager, compiled in ((p0, p1), (s0, s1)):
        assert set(eager) == set(compiled)
        for k in eager:
            np.testing.assert_allclose(np.array(compiled[k]), np.array(eager[k]),
                                       rtol=1e-4, atol=1e-6, err_msg=k)
    assert "layers.1.running_mean" in p1 and np.abs(np.array(p1["layers.1.running_mean"])).sum()


def test_compiled_training_with_dropout_matches_eager():
    results = []
    for compile in (False, True):
        mx.random.seed(5)
        model = Chain(Dense(3, 16, relu), Dropout(0.5), Dense(16, 1))
        opt_state = setup(Adam(0.01), model)
        data = [(mx.ones((4, 3)), mx.zeros((4, 1)))] * 4
        losses = [train(mse_of, model, data, opt_state, progress=False, compile=compile)
                  for _ in range(2)]
        results.append((losses, model[0].weight))
    (l0, w0), (l1, w1) = results
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    np.testing.assert_allclose(np.array(w0), np.array(w1), rtol=1e-5, atol=1e-7)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal(monkeypatch):
    stream = _Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    data = _regression(n_batches=5)
    train(mse_of, Dense(3, 1), data, setup(Descent(0.01), Dense(3, 1)), progress=True)
    text = stream.getvalue()
    assert text.startswith("\r[") and text.endswith("\n")
    last = text.rstrip("\n").split("\r")[-1]
    assert last.startswith("[" + "=" * 30 + "] 5/5 loss ")
    float(last.split("loss ")[1])


def test_progress_bar_for_unsized_data(monkeypatch):
    stream = _Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    model = Dense(3, 1)
    train(mse_of, model, iter(_regression(n_batches=3)), setup(Descent(0.01), model))
    assert stream.getvalue().rstrip("\n").split("\r")[-1].startswith("3 loss ")


def test_no_progress_bar_off_terminal_or_when_disabled(monkeypatch):
    data = _regression(n_batches=2)
    plain = io.StringIO()
    monkeypatch.setattr("sys.stderr", plain)
    model = Dense(3, 1)
    train(mse_of, model, data, setup(Descent(0.01), model))
    assert plain.getvalue() == ""
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    train(mse_of, model, data, setup(Descent(0.01), model), progress=False)
    assert terminal.getvalue() == ""


@pytest.mark.parametrize("rule", [Adam(0.1), OptimiserChain(ClipNorm(1.0), Adam(0.1))])
@pytest.mark.parametrize("compile", [False, True])
def test_a_part_thawed_after_setup_gets_optimiser_state(rule, compile):
    # Flux's freeze!/thaw! idiom: setup with a part frozen, thaw it, train everything
    x = mx.arange(6.0).reshape(3, 2)
    model, twin = Chain(Dense(2, 2), Dense(2, 1)), Chain(Dense(2, 2), Dense(2, 1))
    twin.update(model.parameters())
    model[1].freeze()
    opt_state, twin_state = setup(rule, model), setup(rule, twin)
    model.unfreeze()
    for _ in range(2):  # the second step reuses the compiled step of the first
        if compile:
            train(mse_of, model, [(x, x[:, :1])], opt_state, progress=False, compile=True)
            train(mse_of, twin, [(x, x[:, :1])], twin_state, progress=False, compile=True)
        else:
            update(opt_state, model, gradient(lambda m: mse_of(m, x, x[:, :1]), model)[0])
            update(twin_state, twin, gradient(lambda m: mse_of(m, x, x[:, :1]), twin)[0])
    # a fresh setup would have made the same state: same steps, same parameters
    assert leaves(opt_state.state).keys() == leaves(twin_state.state).keys()
    for k, v in leaves(model.parameters()).items():
        np.testing.assert_allclose(np.array(v), np.array(leaves(twin.parameters())[k]),
                                   rtol=1e-6, err_msg=k)


def test_an_eager_step_that_raises_leaves_the_optimiser_state():
    class Picky(optim.Adam):  # fails at its second parameter, traced or not
        def apply_single(self, gradient, parameter, state):
            if parameter.ndim == 1:
                raise ValueError("no biases here")
            return super().apply_single(gradient, parameter, state)

    model = Dense(2, 2)
    opt_state = setup(Picky(0.1), model)
    before = leaves(opt_state.state)
    grads = gradient(lambda m: m(mx.ones((1, 2))).sum(), model)[0]
    with pytest.raises(ValueError, match="no biases here"):
        update(opt_state, model, grads)
    after = leaves(opt_state.state)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)


class _Indexed(nn.Module):
    """A layer with an integer buffer (a permutation) next to its weight."""

    def __init__(self):
        super().__init__()
        self.weight = mx.array([1.0, 2.0, 3.0])
        self.order = mx.array([2, 0, 1])

    def __call__(self, x):
        return x * self.weight[self.order]


def test_integer_arrays_of_a_model_are_not_trained():
    model = _Indexed()
    (g,) = gradient(lambda m: m(mx.ones(3)).sum(), model)  # a gather's indices: no VJP
    assert set(g) == {"weight"}
    opt_state = setup(Adam(0.1), model)
    assert set(opt_state.state["optimizer"]) >= {"weight"}
    assert "order" not in opt_state.state["optimizer"]
    update(opt_state, model, g)
    assert model.order.dtype == mx.int32 and model.order.tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match=r"update: 'order' is a int32 array of the model: "
                                         r"integer and boolean arrays are not trained"):
        update(opt_state, model, {"weight": g["weight"], "order": mx.zeros(3, mx.int32)})


def test_a_model_argument_inside_another_is_refused():
    model = Chain(Dense(2, 2), Dense(2, 1))
    with pytest.raises(ValueError, match=r"gradient: model argument 2 is a part of model "
                                         r"argument 1; pass the whole model once"):
        gradient(lambda m, part: m(mx.ones((1, 2))).sum(), model, model[0])
    with pytest.raises(ValueError, match=r"argument 1 is a part of model argument 2"):
        withgradient(lambda part, m: m(mx.ones((1, 2))).sum(), model[1], model)
    weight = model[0].weight
    assert model[0].weight is weight  # nothing was touched


def test_loss_scale_scales_the_gradients_for_update():
    x = mx.arange(6.0).reshape(3, 2)
    model, twin = Dense(2, 1), Dense(2, 1)
    twin.update(model.parameters())
    loss, (g,) = withgradient(lambda m: mse_of(m, x, x[:, :1]), model, loss_scale=8.0)
    plain, (g1,) = withgradient(lambda m: mse_of(m, x, x[:, :1]), model)
    assert loss.item() == plain.item()  # the value is the unscaled loss
    np.testing.assert_allclose(np.array(g["weight"]), 8 * np.array(g1["weight"]), rtol=1e-6)
    # update with a loss scale in opt_state expects exactly those: as without a scale
    scaled, unscaled = setup(Descent(0.1), model, loss_scale=DynamicLossScale()), \
        setup(Descent(0.1), twin)
    (g,) = gradient(lambda m: mse_of(m, x, x[:, :1]), model, loss_scale=scaled.loss_scale)
    update(scaled, model, g)
    update(unscaled, twin, gradient(lambda m: mse_of(m, x, x[:, :1]), twin)[0])
    np.testing.assert_allclose(np.array(model.weight), np.array(twin.weight), rtol=1e-6)
    with pytest.raises(ValueError, match=r"gradient: loss_scale must be None, 'auto', a "
                                         r"positive number"):
        gradient(lambda m: mse_of(m, x, x[:, :1]), model, loss_scale="big")


@pytest.mark.parametrize("wrap", [list, tuple, lambda ms: {"a": ms[0], "b": ms[1]},
                                  lambda ms: [ms[0], (ms[1],)]])
def test_models_inside_a_container_argument_are_refused(wrap):
    # they would silently get no gradient
    a, b = Dense(2, 2), Dense(2, 1)
    x = mx.ones((3, 2))
    weight = a.weight
    with pytest.raises(TypeError, match=r"gradient: argument 2 is a \w+ holding a model, which "
                                        r"would get no gradient; pass models as separate "
                                        r"arguments"):
        gradient(lambda x, ms: x.sum(), x, wrap([a, b]))
    assert a.weight is weight
    # containers of arrays and other values are differentiated (their arrays), as in Zygote
    gx, gl = gradient(lambda x, xs: (x * xs[0]).sum(), x, [mx.ones(2), {"n": 1}])
    assert gx.shape == (3, 2) and gl[0].tolist() == [3.0, 3.0] and gl[1] == {"n": None}


def test_arrays_in_tuples_and_dicts_get_gradients_of_the_same_structure():
    # an LSTM's (h, c) state, a dict of inputs: as Zygote's gradient
    model = Dense(2, 1)
    state = (mx.array([1.0, 2.0]), mx.array([3.0, 4.0]))
    inputs = {"x": mx.array([[1.0, 1.0]]), "labels": mx.array([1]), "name": "batch"}

    def f(m, hc, d):
        h, c = hc
        return (m(d["x"]) * (h * c).sum()).sum()

    g_model, g_state, g_inputs = gradient(f, model, state, inputs)
    out = model(inputs["x"]).sum()
    assert isinstance(g_state, tuple) and len(g_state) == 2
    np.testing.assert_allclose(np.array(g_state[0]), np.array(state[1] * out), rtol=1e-6)
    np.testing.assert_allclose(np.array(g_state[1]), np.array(state[0] * out), rtol=1e-6)
    assert set(g_inputs) == {"x", "labels", "name"}
    assert g_inputs["labels"] is None and g_inputs["name"] is None
    np.testing.assert_allclose(np.array(g_inputs["x"]),
                               np.array(model.weight * (state[0] * state[1]).sum()), rtol=1e-6)
    assert set(g_model) == {"weight", "bias"}


def test_assigning_the_learning_rate_with_and_without_a_schedule():
    # what update's docstring says: an assignment takes effect at once, but a schedule
    # sets the learning rate again before every step
    for lr, expected in ((0.1, 0.5), (optim.step_decay(0.1, 1.0, 1000), 0.1)):
        model = Dense(1, 1, bias=False)
        model.weight = mx.array([[0.0]])
        opt_state = setup(Descent(lr), model)
        opt_state.optimizer.learning_rate = 0.5
        update(opt_state, model, {"weight": mx.array([[-1.0]])})
        assert model.weight.item() == pytest.approx(expected)


class _Checkpointed(nn.Module):
    """A block recomputed in the backward pass (mx.checkpoint), then a head."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.block = Chain(Dense(8, 8), BatchNorm(8))
        self.head = Dense(8, 1)
        self.checkpointed = checkpointed

    def __call__(self, x):
        block = nn.utils.checkpoint(self.block) if self.checkpointed else self.block
        return self.head(block(x))


@pytest.mark.parametrize("autocast", [None, mx.bfloat16])
def test_checkpointed_blocks_are_recomputed_in_train_mode_and_the_scope(autocast):
    # MLX runs a checkpointed block again while it builds the backward pass: in test mode
    # (BatchNorm's running statistics) or outside the scope, its gradient would be another's
    x = mx.array(np.random.default_rng(3).normal(2.0, 3.0, size=(16, 8)).astype(np.float32))
    results = []
    for checkpointed in (False, True):
        mx.random.seed(1)
        model = _Checkpointed(checkpointed)
        (g,) = gradient(lambda m: (m(x) ** 2).sum(), model, autocast=autocast)
        results.append((leaves(g), leaves(model.parameters())))
    (g_plain, p_plain), (g_ckpt, p_ckpt) = results
    for k in g_plain:
        np.testing.assert_allclose(np.array(g_ckpt[k]), np.array(g_plain[k]), rtol=1e-5,
                                   atol=1e-6, err_msg=k)
    for k in p_plain:  # running statistics updated once, as without the checkpoint
        np.testing.assert_array_equal(np.array(p_ckpt[k]), np.array(p_plain[k]), err_msg=k)


def test_errors_name_the_function_called():
    model = Dense(2, 1)
    for fn, name in ((gradient, "gradient"), (withgradient, "withgradient")):
        with pytest.raises(ValueError, match=rf"^{name}: autocast must be None"):
            fn(lambda m: m(mx.ones((1, 2))).sum(), model, autocast=mx.float32)


@pytest.mark.parametrize("make", [lambda: Chain(relu), lambda: Dense(2, 2).freeze()])
def test_a_model_with_nothing_to_train_gets_empty_gradients(make):
    model = make()
    loss, (g,) = withgradient(lambda m: m(mx.ones((1, 2))).sum(), model)
    assert tree_flatten(g) == [] and loss.shape == ()
    assert tree_flatten(g) == tree_flatten(_trainable_parameters(model)[0])


def test_train_says_how_it_calls_the_loss():
    model = Dense(2, 1)
    opt_state = setup(Descent(0.1), model)
    x, y = mx.ones((4, 2)), mx.ones((4, 1))
    with pytest.raises(TypeError, match=r"train: the loss is called as loss\(model, \*batch\), "
                                         r"here with a batch of 1 \(array\).*for one batch "
                                         r"\(x, y\) pass \[\(x, y\)\]"):
        train(mse_of, model, (x, y), opt_state, progress=False)
    with pytest.raises(TypeError, match=r"batch of 2 \(array, array\), and cannot take that"):
        train(lambda x, y: mse_of(model, x, y), model, [(x, y)], opt_state, progress=False)
    assert opt_state.state["optimizer"]["step"].item() == 0  # no step was taken


def test_update_with_another_models_opt_state():
    opt_state = setup(Adam(0.1), Dense(2, 1))
    other = Dense(3, 1)
    (g,) = gradient(lambda m: m(mx.ones((1, 3))).sum(), other)
    before = leaves(opt_state.state)
    with pytest.raises(ValueError, match=r"update: opt_state does not fit the model: its 'm' "
                                         r"for 'weight' has shape \(1, 2\), the parameter "
                                         r"\(1, 3\); setup\(\) the optimiser for this model"):
        update(opt_state, other, g)
    assert leaves(opt_state.state).keys() == before.keys()


def test_running_statistics_do_not_chain_across_steps():
    # a hand-written loop reading only the loss: BatchNorm's new statistics feed no loss, and
    # unevaluated they chained onto the last step's, so each gradient walked all earlier ones
    model = Chain(Dense(2, 4), BatchNorm(4), Dense(4, 1))
    opt_state = setup(Adam(0.01), model)
    x = mx.array(np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32))
    for _ in range(5):
        loss, (g,) = withgradient(lambda m: (m(x) ** 2).mean(), model)
        update(opt_state, model, g)
        loss.item()
    mx.synchronize()  # the statistics' evaluation was queued, not awaited
    dot = io.StringIO()
    mx.export_to_dot(dot, model[1].running_mean)
    assert dot.getvalue().count("->") == 0  # evaluated: no graph behind it


@pytest.mark.parametrize("compile", [False, True])
def test_a_failed_first_batch_after_a_thaw_leaves_training_possible(compile):
    # the thawed part's state, made by that batch's update, goes with the rollback; the next
    # update must make it again
    x, y = mx.ones((2, 3)), mx.zeros((2, 1))
    model = Chain(Dense(3, 4), Dense(4, 1))
    model[1].freeze()
    opt_state = setup(Adam(0.01), model)
    model.unfreeze()

    def nan_loss(m, x, y):  # (a new function: a compiled step bakes in what the loss reads)
        return mse_of(m, x, y) * math.nan

    with pytest.raises(FloatingPointError):
        train(nan_loss, model, [(x, y)], opt_state, progress=False, compile=compile)
    assert train(mse_of, model, [(x, y)], opt_state, progress=False, compile=compile) >= 0
    assert "m" in opt_state.state["optimizer"]["layers"][1]["weight"]


# ---------------------------------------------------------------- non-finite gradients


def _kinked(m, x):
    """A finite loss whose gradient is not finite where the weight is 0 (sqrt's slope)."""
    return mx.sqrt(mx.abs(m.weight)).sum() + (m(x) ** 2).mean()


def _snapshot(model, opt_state):
    mx.eval(model.parameters(), opt_state.state)
    return {**{f"p.{k}": v for k, v in tree_flatten(model.parameters())},
            **{f"s.{k}": v for k, v in tree_flatten(opt_state.state)}}


@pytest.mark.parametrize("autocast", [None, mx.bfloat16])
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("last", [False, True])
def test_non_finite_gradients_of_a_finite_loss_stop_train(autocast, compile, last):
    model = Dense(2, 2)
    model.weight = mx.array([[0.5, 1.0], [2.0, 3.0]])
    opt_state = setup(Adam(0.1), model)
    x = mx.ones((4, 2))
    train(_kinked, model, [x], opt_state, autocast=autocast, compile=compile, progress=False)
    poisoned = model.weight.at[0, 0].multiply(0.0)  # sqrt's slope at 0 is inf
    model.weight = poisoned
    before = _snapshot(model, opt_state)
    data = [x] if last else [x, x, x]
    with pytest.raises(FloatingPointError, match=r"^train: the gradients hold inf or nan at "
                       r"batch 0 \(counting from 0\), although the loss is finite \(.*\); the "
                       r"model and optimiser state are left as they were before that batch"):
        train(_kinked, model, data, opt_state, autocast=autocast, compile=compile,
              progress=False)
    after = _snapshot(model, opt_state)
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert mx.array_equal(after[k], v).item(), k  # bit for bit, and no nan anywhere


def test_non_finite_gradients_name_their_batch():
    model = Dense(2, 2)
    opt_state = setup(Descent(0.01), model)
    x = mx.ones((4, 2))

    def loss(m, x, c):  # finite for every c; the gradient is nan for c = 0 (0 * inf)
        return (m(x) ** 2).mean() + mx.sqrt(mx.abs(c * m.weight[0, 0]))

    batches = [(x, mx.array(1.0)), (x, mx.array(2.0)), (x, mx.array(0.0)), (x, mx.array(1.0))]
    with pytest.raises(FloatingPointError, match=r"gradients hold inf or nan at batch 2"):
        train(loss, model, batches, opt_state, progress=False)
    assert opt_state.optimizer.state["step"].item() == 2
    assert all(mx.all(mx.isfinite(v)).item() for v in leaves(model.parameters()).values())


def test_with_a_loss_scale_non_finite_gradients_are_a_skipped_step():
    model = Dense(2, 2)
    model.weight = mx.array([[0.0, 1.0], [2.0, 3.0]])
    opt_state = setup(Adam(0.1), model, loss_scale=DynamicLossScale(init_scale=8.0))
    before = _snapshot(model, opt_state)
    train(_kinked, model, [mx.ones((4, 2))], opt_state, progress=False)
    assert opt_state.loss_scale.loss_scale.item() == 4.0  # backed off, step skipped
    after = _snapshot(model, opt_state)
    for k in before:
        if not k.startswith("s.loss_scale"):
            assert mx.array_equal(after[k], before[k]).item(), k


@pytest.mark.parametrize("data", [None, 3, "xy"])
def test_data_must_be_batches(data):
    model = Dense(2, 1)
    with pytest.raises(TypeError, match=r"^train: data must be an iterable of batches \(a "
                       r"DataLoader, or a list of \(x, y\) tuples\), got .*; for one batch pass "
                       r"\[\(x, y\)\]"):
        train(mse_of, model, data, setup(Descent(0.1), model), progress=False)
