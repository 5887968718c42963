"""The optimiser state under faults and careless use: Ctrl-C inside ``update``,
another model's ``opt_state``, float64 gradients, corrupt optimiser values from a file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import interrupted_child
from mlx.utils import tree_flatten

from fluxlike import (
    Adam,
    Chain,
    Dense,
    Descent,
    gradient,
    loadcheckpoint,
    savemodel,
    setup,
    update,
)

ROOT = Path(__file__).resolve().parent.parent


def _leaves(tree) -> dict:
    return dict(tree_flatten(tree))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == b[k].dtype and mx.array_equal(x, b[k], equal_nan=True).item()
        for k, x in a.items())


# ---------------------------------------------------------------- Ctrl-C inside update

_CHILD = """
    import signal, sys
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from fluxlike import Chain, Dense, Descent, setup, update

    model = Chain(*[Dense(4, 4) for _ in range(150)])  # many small layers: a long model.update
    for layer in model.layers:
        layer.weight, layer.bias = mx.zeros((4, 4)), mx.zeros((4,))
    opt_state = setup(Descent(1.0), model)
    grads = {"layers": [{"weight": mx.ones((4, 4)), "bias": mx.ones((4,))}
                        for _ in model.layers]}
    mx.eval(model.parameters(), grads)
    update(opt_state, model, grads)  # traced: the steps below replay the compiled step
    armed = False

    def handler(signum, frame):  # Ctrl-C counts only inside update, not in the checks
        if armed:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    print("ready", flush=True)
    interrupts = torn = 0
    while interrupts < 60:
        try:
            armed = True
            update(opt_state, model, grads)
            armed = False
        except KeyboardInterrupt:
            armed = False
            interrupts += 1
        # every weight has taken exactly as many steps as the optimiser has counted
        step = opt_state.optimizer.state["step"].item()
        values = {-p.reshape(-1)[0].item() for _, p in tree_flatten(model.parameters())}
        torn += values != {float(step)}
    print("INTERRUPTED", interrupts, "TORN", torn, flush=True)
"""


def test_ctrl_c_inside_a_compiled_update_takes_all_of_the_step_or_none():
    out, err = interrupted_child(textwrap.dedent(_CHILD), ROOT)
    assert "INTERRUPTED 60 TORN 0" in out, (out, err[-2000:])


def test_a_ctrl_c_arriving_as_the_guard_installs_itself_reaches_the_users_handler(monkeypatch):
    # CI once saw the race: the guard installed its handler, a Ctrl-C came before it had
    # recorded the handler to chain to, and every later Ctrl-C went to the one before that
    import signal

    from fluxlike.optimisers import compiled

    guard, seen = compiled._Interrupts(), []
    real = signal.signal

    def install_then_interrupt(signum, handler):
        earlier = real(signum, handler)
        handler(signum, None)  # the signal lands right after the installation
        return earlier

    monkeypatch.setattr(compiled.signal, "signal", install_then_interrupt)
    saved = real(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        assert guard.enter()
        guard.exit()
    finally:
        real(signal.SIGINT, saved)
    assert seen == [signal.SIGINT]  # delivered to the user's handler, once, not dropped


def test_an_interrupted_eager_update_restores_the_model_too(monkeypatch):
    # the eager path (an optimiser whose step cannot be traced) rolled back the optimiser
    # state but not the parameters already written
    model = Chain(Dense(2, 2), Dense(2, 2))
    opt_state = setup(Descent(0.5), model)
    (grads,) = gradient(lambda m: m(mx.ones((1, 2))).sum(), model)
    from fluxlike.optimisers.compiled import COMPILED
    update(opt_state, model, grads)
    COMPILED[opt_state].fall_back("test: eager")
    mx.eval(model.parameters(), opt_state.state)
    before_p, before_s = _leaves(model.parameters()), _leaves(opt_state.state)
    calls = []
    original = type(model).update

    def interrupted(self, params, *args, **kwargs):  # Ctrl-C half-way through writing
        calls.append(1)
        if len(calls) == 1:
            original(self.layers[0], params["layers"][0])
            raise KeyboardInterrupt
        return original(self, params, *args, **kwargs)

    monkeypatch.setattr(type(model), "update", interrupted)
    with pytest.raises(KeyboardInterrupt):
        update(opt_state, model, grads)
    monkeypatch.undo()
    assert _same(_leaves(model.parameters()), before_p)
    assert _same(_leaves(opt_state.state), before_s)


# ---------------------------------------------------------------- another model's state


def test_another_models_opt_state_is_refused_changing_nothing():
    # a larger model: the state would grow its entries and share the step count
    opt_state = setup(Adam(0.1), Chain(Dense(2, 2)))
    other = Chain(Dense(2, 2), Dense(2, 1))
    (g,) = gradient(lambda m: m(mx.ones((1, 2))).sum(), other)
    before = _leaves(opt_state.state)
    with pytest.raises(ValueError, match=r"^update: opt_state was set up for another model: "
                       r"this model's parameter 'layers.1.weight' \(shape \(1, 2\)\) does not "
                       r"fit it \(the model given to setup\(\) had no such parameter\); call "
                       r"setup\(rule, model\) for this model"):
        update(opt_state, other, g)
    assert _same(_leaves(opt_state.state), before)
    # a stateless rule: no moment tells the shapes apart
    plain = setup(Descent(0.1), Dense(2, 1))
    with pytest.raises(ValueError, match=r"parameter 'weight' \(shape \(1, 3\)\) does not fit "
                       r"it \(the model given to setup\(\) had it of shape \(1, 2\)\)"):
        update(plain, Dense(3, 1), {"weight": mx.ones((1, 3)), "bias": mx.ones((1,))})


def test_the_same_structure_resumes_and_thawed_parameters_still_train():
    model = Chain(Dense(2, 2), Dense(2, 1))
    model.layers[0].freeze()
    opt_state = setup(Adam(0.1), model)
    model.layers[0].unfreeze()  # thawed after setup: state is made for it at the first step
    (g,) = gradient(lambda m: m(mx.ones((1, 2))).sum(), model)
    update(opt_state, model, g)
    resumed = Chain(Dense(2, 2), Dense(2, 1))  # another object of the same shape: resuming
    update(opt_state, resumed, g)
    assert opt_state.optimizer.state["step"].item() == 2


# ---------------------------------------------------------------- float64 gradients


def test_float64_gradients_keep_float32_parameters_and_moments(tmp_path):
    model = Dense(2, 1)
    opt_state = setup(Adam(0.1), model)
    g64 = {"weight": mx.ones((1, 2), dtype=mx.float64), "bias": mx.ones((1,), mx.float64)}
    g32 = {k: v.astype(mx.float32) for k, v in g64.items()}
    twin, twin_state = Dense(2, 1), setup(Adam(0.1), Dense(2, 1))
    twin.update(model.parameters())
    update(opt_state, model, g64)
    update(twin_state, twin, g32)
    for k, v in _leaves(model.parameters()).items():
        assert v.dtype == mx.float32, k
    for k, v in _leaves(opt_state.optimizer.state).items():
        assert v.dtype != mx.float64, k
    assert _same(_leaves(model.parameters()), _leaves(twin.parameters()))
    savemodel(tmp_path / "m.safetensors", model, opt_state)  # (failed on float64 arrays)


# ---------------------------------------------------------------- corrupt optimiser values


@pytest.mark.parametrize(("entry", "value", "message"), [
    ("learning_rate", mx.array(float("nan")), "'optimizer.learning_rate' holds inf or nan"),
    ("learning_rate", mx.array(-1e-3), "'optimizer.learning_rate' is negative"),
    ("step", mx.array(2**62, mx.uint64), "'optimizer.step' is a step count past any real run"),
    ("m", mx.array([[0.0, float("inf")]]), "'optimizer.weight.m' holds inf or nan"),
])
def test_corrupt_optimiser_values_are_refused_changing_nothing(tmp_path, entry, value,
                                                              message):
    model = Dense(2, 1)
    source = setup(Adam(0.1), model)
    update(source, model, {"weight": mx.ones((1, 2)), "bias": mx.ones((1,))})
    tree = source.state
    if entry == "m":
        tree["optimizer"]["weight"]["m"] = value
    else:
        tree["optimizer"][entry] = value
    path = tmp_path / "bad.safetensors"
    savemodel(path, model, source)
    target_model, target = Dense(2, 1), setup(Adam(0.1), Dense(2, 1))
    before_p, before_s = _leaves(target_model.parameters()), _leaves(target.state)
    with pytest.raises(ValueError, match=rf"^\[loadcheckpoint\] optimiser state in "
                       rf"'.*bad.safetensors': OptState.load_state: entry {message}"):
        loadcheckpoint(path, target_model, target)
    assert _same(_leaves(target_model.parameters()), before_p)
    assert _same(_leaves(target.state), before_s)


def test_a_zero_learning_rate_loads():  # a warm-up schedule starts there
    model = Dense(2, 1)
    opt_state = setup(Adam(0.1), model)
    saved = opt_state.state
    saved["optimizer"]["learning_rate"] = mx.array(0.0)
    setup(Adam(0.1), model).load_state(saved)
    assert np.isfinite(np.array(opt_state.optimizer.state["learning_rate"]))
