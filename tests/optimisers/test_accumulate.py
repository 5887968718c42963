"""Tests of fluxlike/optimisers/accumulate.py: AccumGrad against the inner rule on the mean
gradients (float64 references from Optimisers.jl's formulas), its state, the loss scale's
skipped steps, thawed parameters, checkpoints, training under autocast."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_parameters, mse_of, reference_steps, rule_problem, run_rule
from mlx.utils import tree_flatten

from fluxlike import (
    AccumGrad,
    Adam,
    ClipNorm,
    Dense,
    Descent,
    DynamicLossScale,
    NoOpLossScale,
    OptimiserChain,
    WeightDecay,
    setup,
    train,
    update,
)
from fluxlike.optimisers.compiled import COMPILED


def _adam(lr, b1, b2, eps):
    def step(w, g, s, t):
        s["m"] = b1 * s.get("m", 0) + (1 - b1) * g
        s["v"] = b2 * s.get("v", 0) + (1 - b2) * g**2
        return w - lr * s["m"] / (1 - b1**t) / (np.sqrt(s["v"] / (1 - b2**t)) + eps)

    return step


def _means(grads, n):
    return [{k: np.mean([g[k].astype(np.float64) for g in grads[i:i + n]], axis=0)
             for k in grads[0]} for i in range(0, len(grads), n)]


def test_the_rule_steps_every_nth_update_with_the_mean_gradient():
    model, params, grads = rule_problem(steps=6)
    opt_state = setup(AccumGrad(3, Adam(0.01)), model)
    seen = []
    for g in grads:
        update(opt_state, model, {k: mx.array(v) for k, v in g.items()})
        seen.append(np.array(model.weight))
    np.testing.assert_array_equal(seen[0], params["weight"].astype(np.float32))
    np.testing.assert_array_equal(seen[1], seen[0])
    assert not np.array_equal(seen[2], seen[1])
    np.testing.assert_array_equal(seen[3], seen[2])
    np.testing.assert_array_equal(seen[4], seen[2])
    expected = reference_steps(_adam(0.01, 0.9, 0.999, 1e-8), params, _means(grads, 3))
    assert_parameters(model, expected)
    state = opt_state.state["optimizer"]
    assert state["step"].item() == 2  # the rule's steps: its bias correction counts these
    assert state["accumulated_steps"].item() == 0
    assert sorted(state["weight"]) == ["accumulated", "m", "v"]


def test_flux_docstring_example():
    # Optimisers.jl's jldoctest: OptimiserChain(AccumGrad(2), WeightDecay(0.01), Descent(0.1))
    model = Dense(1, 1)
    model.weight, model.bias = mx.array([[1.0]]), mx.array([2.0])
    opt_state = setup(AccumGrad(2, OptimiserChain(WeightDecay(0.01), Descent(0.1))), model)
    update(opt_state, model, {"weight": mx.array([[33.0]]), "bias": mx.array([0.0])})
    assert model.weight.item() == 1.0 and model.bias.item() == 2.0
    update(opt_state, model, {"weight": mx.array([[0.0]]), "bias": mx.array([444.0])})
    assert model.weight.item() == pytest.approx(-0.651, abs=1e-6)
    assert model.bias.item() == pytest.approx(-20.202002, abs=1e-5)


def test_transforms_in_the_rule_act_on_the_mean():
    model, params, grads = rule_problem(steps=4)
    run_rule(AccumGrad(2, OptimiserChain(ClipNorm(0.5), Descent(0.1))), model, grads)
    expected = dict(params)
    for g in _means(grads, 2):
        norm = np.sqrt(sum((v**2).sum() for v in g.values()))
        expected = {k: expected[k] - 0.1 * g[k] * min(1.0, 0.5 / (norm + 1e-6)) for k in g}
    assert_parameters(model, expected)


def test_accumulation_is_traced_once():
    model, _, grads = rule_problem(steps=5)
    opt_state = run_rule(AccumGrad(2, Adam()), model, grads)
    compiled = COMPILED[opt_state]
    assert compiled.eager is None and len(compiled.steps) == 1


def test_a_skipped_step_of_the_loss_scale_does_not_pollute_the_accumulation():
    model, params, grads = rule_problem(steps=4)
    scale = DynamicLossScale(init_scale=8.0)
    opt_state = setup(AccumGrad(2, Descent(0.1)), model, loss_scale=scale)
    inf = {"weight": np.full((2, 3), np.inf, np.float32), "bias": np.zeros(2, np.float32)}
    scales = []
    for g in [grads[0], inf, grads[1], grads[2], inf, grads[3]]:
        s = scale.loss_scale.item()
        scales.append(s)
        update(opt_state, model, {k: mx.array(v * s) for k, v in g.items()})
    assert scales == [8.0, 8.0, 4.0, 4.0, 4.0, 2.0]  # each overflow halved it
    expected = reference_steps(lambda w, g, s, t: w - 0.1 * g, params, _means(grads, 2))
    assert_parameters(model, expected)
    assert opt_state.state["optimizer"]["step"].item() == 2


def test_a_thawed_parameter_gets_an_accumulator():
    model = Dense(3, 2)
    model.freeze(keys=["bias"])
    opt_state = setup(AccumGrad(2, Adam()), model)
    assert "bias" not in opt_state.state["optimizer"]
    model.unfreeze(keys=["bias"])
    for _ in range(2):
        update(opt_state, model, {"weight": mx.ones((2, 3)), "bias": mx.ones(2)})
    assert sorted(opt_state.state["optimizer"]["bias"]) == ["accumulated", "m", "v"]
    assert opt_state.state["optimizer"]["step"].item() == 1


def test_state_round_trips_mid_accumulation():
    model, _, grads = rule_problem(steps=3)
    twin, _, _ = rule_problem(steps=3)
    first = run_rule(AccumGrad(3, Adam(0.01)), model, grads[:2])
    saved = dict(tree_flatten(first.state))
    second = setup(AccumGrad(3, Adam(0.01)), twin)
    twin.update(model.parameters())
    second.load_state(saved)
    assert second.state["optimizer"]["accumulated_steps"].item() == 2
    g = {k: mx.array(v) for k, v in grads[2].items()}
    update(first, model, g)
    update(second, twin, g)
    assert mx.array_equal(model.weight, twin.weight).item()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_training_under_autocast(dtype):
    # float16: train() makes a dynamic loss scale, whose skipped steps AccumGrad must survive
    mx.random.seed(1)
    x = mx.random.normal((32, 4))
    y = x @ mx.array([[1.0], [-2.0], [0.5], [3.0]])
    model = Dense(4, 1)
    opt_state = setup(AccumGrad(2, Adam(0.05)), model)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    first = train(mse_of, model, batches, opt_state, autocast=dtype, progress=False)
    for _ in range(5):
        last = train(mse_of, model, batches, opt_state, autocast=dtype, progress=False)
    assert model.weight.dtype == mx.float32 and last < first
    state = opt_state.state["optimizer"]
    assert state["weight"]["accumulated"].dtype == mx.float32
    assert (dtype == mx.float16) == (not isinstance(opt_state.loss_scale, NoOpLossScale))
    steps = state["step"].item() * 2 + state["accumulated_steps"].item()
    assert steps <= 24 and state["step"].item() >= 1


@pytest.mark.parametrize("make, error, message", [
    (lambda: AccumGrad(0, Adam()), ValueError, r"^\[AccumGrad\] n must be a positive int"),
    (lambda: AccumGrad(2.0, Adam()), ValueError, r"got 2\.0$"),
    (lambda: AccumGrad(2, ClipNorm(1.0)), TypeError,
     r"^\[AccumGrad\] rule must be a fluxlike rule.*put a gradient transform in "
     r"OptimiserChain"),
    (lambda: AccumGrad(2, AccumGrad(3, Descent())), ValueError,
     r"accumulate once: AccumGrad\(6, Descent\(lr=0\.1\)\)$"),
])
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_repr():
    assert repr(AccumGrad(4, Descent())) == "AccumGrad(n=4, rule=Descent(lr=0.1))"


def test_two_processes_accumulate_the_averaged_gradients(tmp_path):
    # data parallelism: update averages the gradients over the group before AccumGrad sees
    # them, so both ranks hold the same sums and step together; an overflow on one rank
    # skips the update on both, the sums untouched
    import json
    from pathlib import Path

    from test_distributed import launch

    done = launch(str(Path(__file__).with_name("accumulate_checks.py")), str(tmp_path))
    ranks = []
    for rank in range(2):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing: {done.stdout}\n{done.stderr}"
        ranks.append(json.loads(path.read_text()))
    assert done.returncode == 0, done.stderr
    for name in ("plain", "loss_scale"):
        r0, r1 = ranks[0][name], ranks[1][name]
        assert "exception" not in r0 and "exception" not in r1, (r0, r1)
        assert r0["params"] == r1["params"] and r0["opt"] == r1["opt"]
        assert r0["reference_steps"] == 2
        for key, value in r0["reference"].items():
            np.testing.assert_allclose(r0["params"][key], value, rtol=1e-5, atol=1e-6)
    assert ranks[0]["loss_scale"]["opt"]["loss_scale.loss_scale"] == 2.0  # backed off once
