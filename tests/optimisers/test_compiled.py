"""Tests of the compiled optimiser step behind fluxlike.update (fluxlike/optimisers/compiled.py).

The reference is MLX's own eager ``optimizer.update`` on a twin model. Floating results are
compared to within 4 ulp: on this CPU build the fused kernels give bit-identical results
(checked while writing these tests), but MLX builds its CPU kernels with ``g++ -O3`` and, on
AVX2 builds, ``-mfma``, so a contracted multiply-add may round differently by an ulp. Where
a step must leave state untouched (a skipped inf/nan step) the comparison is exact.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten, tree_map

from fluxlike import (
    Adam,
    AdamW,
    Chain,
    ClipNorm,
    ClipValue,
    Dense,
    Descent,
    DynamicLossScale,
    Lion,
    Momentum,
    Nesterov,
    OptimiserChain,
    OptState,
    RMSProp,
    gradient,
    relu,
    setup,
    update,
)
from fluxlike.optimisers import compiled


def _mlp(seed: int = 0) -> Chain:
    mx.random.seed(seed)
    return Chain(Dense(6, 9, relu), Dense(9, 4))


def _grads(model: Chain, seed: int, scale: float = 1.0) -> dict:
    """A real gradient (its weight entries are transposed views, as from any backward)."""
    rng = np.random.default_rng(seed)
    x = mx.array(rng.normal(size=(5, 6)).astype(np.float32))
    y = mx.array(rng.normal(size=(5, 4)).astype(np.float32))
    (g,) = gradient(lambda m: ((m(x) - y) ** 2).sum() * scale, model)
    return g


def _leaves(tree) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(tree)}


def _assert_close(a, b) -> None:
    a, b = _leaves(a), _leaves(b)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if np.issubdtype(a[k].dtype, np.floating):
            np.testing.assert_array_max_ulp(a[k], b[k], maxulp=4)
        else:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _assert_same(a, b) -> None:
    a, b = _leaves(a), _leaves(b)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _pair(rule, **setup_options) -> tuple:
    """``(model, twin, opt_state, reference)``: two equal MLPs, ``setup(rule, model)`` and
    the same rule as a plain mlx optimizer initialised on the twin."""
    model, twin = _mlp(), _mlp()
    opt_state = setup(rule, model, **setup_options)
    reference = rule.build()
    reference.init(twin.trainable_parameters())
    return model, twin, opt_state, reference


def _step_both(opt_state: OptState, model, reference, twin, g) -> None:
    """One step through fluxlike.update, and the same with the eager mlx optimiser."""
    update(opt_state, model, g)
    reference.update(twin, g)


def _assert_matches(model, twin, opt_state: OptState, reference) -> None:
    _assert_close(model.parameters(), twin.parameters())
    _assert_close(opt_state.optimizer.state, reference.state)


def _compiled(opt_state: OptState):
    return compiled.COMPILED[opt_state]


def _eager(opt_state: OptState) -> OptState:
    """``opt_state`` forced onto update's eager path (the implementation before compiling)."""
    compiled.COMPILED.setdefault(opt_state, compiled.Compiled()).fall_back("test")
    return opt_state


RULES = [
    Descent(0.1),
    Momentum(0.05),
    Nesterov(0.01),
    RMSProp(0.01),
    Adam(0.01),
    AdamW(0.01, weight_decay=0.1),
    Lion(0.01, weight_decay=0.05),
    OptimiserChain(ClipNorm(0.1), Adam(0.01)),
    OptimiserChain(ClipValue(1e-3), Descent(0.5)),
]


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_compiled_update_matches_mlx_eager(rule):
    model, twin, opt_state, reference = _pair(rule)
    for step in range(4):
        g = _grads(model, step)
        _step_both(opt_state, model, reference, twin, g)
        mx.eval(model.parameters(), opt_state.state, twin.parameters(), reference.state)
    _assert_matches(model, twin, opt_state, reference)
    compiled = _compiled(opt_state)
    assert compiled.eager is None and len(compiled.steps) == 1


def test_loss_scale_matches_eager_and_skips_non_finite_steps_exactly():
    model, twin, opt_state, reference = _pair(
        Adam(0.01), loss_scale=DynamicLossScale(2.0**8, growth_interval=2))
    for step, bad in enumerate([None, None, np.inf, None, np.nan, None]):
        g = _grads(model, step)
        # Scaled by the current scale, a power of two: the unscaled gradient is exactly g.
        scaled = tree_map(lambda v: v * opt_state.loss_scale.loss_scale, g)
        if bad is not None:
            scaled["layers"][1]["bias"] = scaled["layers"][1]["bias"] * bad
        before = (_leaves(model.parameters()), _leaves(opt_state.optimizer.state))
        scale_before = opt_state.loss_scale.loss_scale.item()
        update(opt_state, model, scaled)
        mx.eval(model.parameters(), opt_state.state)
        if bad is None:
            reference.update(twin, g)
            mx.eval(twin.parameters(), reference.state)
        else:
            _assert_same(model.parameters(), before[0])
            _assert_same(opt_state.optimizer.state, before[1])
            assert opt_state.loss_scale.loss_scale.item() == scale_before / 2
            assert opt_state.loss_scale.counter.item() == 0
        _assert_matches(model, twin, opt_state, reference)
    # finite, finite (grows: 256 -> 512), inf (256), finite, nan (128), finite
    assert opt_state.loss_scale.loss_scale.item() == 128.0
    assert len(_compiled(opt_state).steps) == 1


@pytest.mark.parametrize("rule", [Descent(0.1), OptimiserChain(ClipValue(1e3), Descent(0.1))],
                         ids=repr)
def test_learning_rate_change_takes_effect_without_retracing(rule):
    model = _mlp()
    opt_state = setup(rule, model)
    for lr in (0.05, 0.01, 0.002):
        opt_state.optimizer.learning_rate = lr
        g = _grads(model, 0)
        expected = {k: v - np.float32(lr) * _leaves(g)[k]
                    for k, v in _leaves(model.trainable_parameters()).items()}
        update(opt_state, model, g)
        got = _leaves(model.trainable_parameters())
        for k in expected:
            np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=1e-7)
    assert len(_compiled(opt_state).steps) == 1


def test_schedule_is_followed_step_by_step():
    schedule = optim.step_decay(1.0, 0.5, 1)  # 1, 0.5, 0.25, ... by the step count
    model, twin = _mlp(), _mlp()
    opt_state = setup(Descent(schedule), model)
    reference = Descent(schedule).build()
    for step in range(4):
        g = _grads(model, step)
        _step_both(opt_state, model, reference, twin, g)
        assert opt_state.optimizer.learning_rate.item() == 0.5**step
    _assert_close(model.parameters(), twin.parameters())
    assert len(_compiled(opt_state).steps) == 1


@pytest.mark.parametrize("how", ["assigned", "changed in place", "eps only",
                                 "an equal value", "an attribute added"])
def test_python_hyperparameter_change_retraces(how):
    """Each step checks the last trace's settings against the optimiser's attributes: any
    change retraces (a new value, a list changed in place, a new attribute), an equal value
    assigned does not."""
    model, twin, opt_state, reference = _pair(Adam(0.01))
    for step in range(5):
        if step == 2 and how == "assigned":
            opt_state.optimizer.betas = reference.betas = [0.5, 0.6]
            opt_state.optimizer.eps = reference.eps = 1e-3
        elif step == 2 and how == "changed in place":  # the list the trace read betas from
            opt_state.optimizer.betas[0] = 0.5
            reference.betas = list(opt_state.optimizer.betas)
        elif step == 2 and how == "eps only":
            opt_state.optimizer.eps = reference.eps = 1e-3
        elif step == 2 and how == "an equal value":
            opt_state.optimizer.eps = float(str(opt_state.optimizer.eps))  # another object
        elif step in (2, 4) and how == "an attribute added":  # an array (by identity, as
            # a trace bakes it in), then, after a step on the trace for it, another
            opt_state.optimizer.note = mx.ones(3)
        g = _grads(model, step)
        _step_both(opt_state, model, reference, twin, g)
    _assert_matches(model, twin, opt_state, reference)
    traces = {"an equal value": 1, "an attribute added": 3}.get(how, 2)
    assert len(_compiled(opt_state).steps) == traces


def test_changed_gradient_structure_and_dtype_retrace():
    model, twin, opt_state, reference = _pair(Adam(0.01))
    full = _grads(model, 0)
    partial = {"layers": [{"weight": full["layers"][0]["weight"]}]}
    half = tree_map(lambda v: v.astype(mx.bfloat16), full)
    for g in (partial, full, half, partial):
        _step_both(opt_state, model, reference, twin, g)
    _assert_matches(model, twin, opt_state, reference)
    assert len(_compiled(opt_state).steps) == 3


def test_checkpoint_load_then_update_continues():
    model = _mlp()
    opt_state = setup(Adam(0.01), model, loss_scale=DynamicLossScale(2.0**4, growth_interval=1))
    for step in range(2):
        update(opt_state, model, _grads(model, step))
    saved_model = tree_map(lambda x: x, model.parameters())
    saved = tree_map(lambda x: mx.array(np.array(x)), opt_state.state)  # fresh arrays
    for step in (2, 3):
        update(opt_state, model, _grads(model, step))
    first = (_leaves(model.parameters()), _leaves(opt_state.state))
    fresh = setup(Adam(0.01), _mlp(1), loss_scale=DynamicLossScale(growth_interval=1))
    for target in (opt_state, fresh):
        model.update(saved_model)
        target.load_state(saved)
        for step in (2, 3):
            update(target, model, _grads(model, step))
        _assert_same(model.parameters(), first[0])
        _assert_same(target.state, first[1])
    assert len(_compiled(opt_state).steps) == 1  # the captured dicts are the same objects


def test_bad_input_after_a_compiled_step_changes_nothing():
    model = _mlp()
    opt_state = setup(Adam(0.01), model, loss_scale=DynamicLossScale())
    update(opt_state, model, _grads(model, 0))
    params, state = dict(tree_flatten(model.parameters())), dict(tree_flatten(opt_state.state))
    good = _grads(model, 1)
    with pytest.raises(ValueError, match=r"'layers.0.weight' must be an array of shape \(9, 6\)"):
        update(opt_state, model, {"layers": [{"weight": mx.zeros((6, 9))}]})
    with pytest.raises(ValueError, match="no trainable parameter 'layers.1.kernel'"):
        update(opt_state, model, {"layers": [{}, {"kernel": mx.zeros(3)}]})
    with pytest.raises(TypeError, match=r"grads\[0\]"):
        update(opt_state, model, (good,))
    assert all(v is params[k] for k, v in tree_flatten(model.parameters()))
    assert all(v is state[k] for k, v in tree_flatten(opt_state.state))


def test_update_inside_mx_compile_matches_eager():
    def make():
        model = _mlp()
        scale = DynamicLossScale(2.0**8, growth_interval=2)
        return model, setup(Adam(0.01), model, loss_scale=scale)

    model, opt_state = make()
    twin, eager_state = make()
    _eager(eager_state)
    x = mx.array(np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32))
    captured = [model.state, opt_state.state]

    def step(x, factor):
        (g,) = gradient(lambda m: (m(x) ** 2).sum() * factor, model)
        update(opt_state, model, g)
        return g["layers"][0]["bias"]

    compiled_step = mx.compile(step, inputs=captured, outputs=captured)
    for factor in (256.0, np.inf, 256.0, 256.0):
        compiled_step(x, mx.array(factor))
        g, _ = gradient(lambda m, f: (m(x) ** 2).sum() * f, twin, mx.array(factor))
        update(eager_state, twin, g)
        mx.eval(captured, twin.parameters(), eager_state.state)
    step(x, mx.array(256.0))  # the step traced inside the outer trace, now called outside it
    g, _ = gradient(lambda m, f: (m(x) ** 2).sum() * f, twin, mx.array(256.0))
    update(eager_state, twin, g)
    _assert_close(model.parameters(), twin.parameters())
    _assert_close(opt_state.state, eager_state.state)


def test_untraceable_schedule_falls_back_to_eager():
    def schedule(step):  # reads the value: cannot be traced
        return mx.array(0.1 if step.item() < 1 else 0.05)

    model = _mlp()
    opt_state = setup(Descent(schedule), model)
    expected = _leaves(model.trainable_parameters())
    for step, lr in enumerate((0.1, 0.05, 0.05)):
        g = _grads(model, step)
        expected = {k: v - np.float32(lr) * _leaves(g)[k] for k, v in expected.items()}
        update(opt_state, model, g)
        got = _leaves(model.trainable_parameters())  # evaluates: no tracer was left behind
        for k in expected:
            np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=1e-7)
    assert opt_state.optimizer.step.item() == 3
    assert "tracing failed" in _compiled(opt_state).eager


class _CountingSGD(optim.SGD):
    """Keeps a Python counter that a replayed trace would not advance."""

    def __init__(self):
        super().__init__(1.0)
        self.calls = 0

    def apply_gradients(self, gradients, parameters):
        self.calls += 1
        return tree_map(lambda g, p: p - self.calls * g, gradients, parameters)


def test_optimizer_with_python_state_falls_back_to_eager():
    model = Dense(2, 1, bias=False)
    model.weight = mx.array([[10.0, 10.0]])
    opt_state = setup(_CountingSGD(), model)
    for _ in range(3):
        update(opt_state, model, {"weight": mx.ones((1, 2))})
    assert model.weight.tolist() == [[4.0, 4.0]]  # 10 - 1 - 2 - 3
    assert "Python attributes" in _compiled(opt_state).eager


def test_multi_optimizer_falls_back_to_eager():
    def make():
        opt = optim.MultiOptimizer([optim.SGD(0.5), optim.SGD(0.1)],
                                   [lambda key, _: key.endswith("bias")])
        model = _mlp()
        return model, opt

    model, opt = make()
    twin, reference = make()
    opt_state = setup(opt, model)
    reference.init(twin.trainable_parameters())
    for step in range(2):
        g = _grads(model, step)
        _step_both(opt_state, model, reference, twin, g)
    _assert_close(model.parameters(), twin.parameters())
    assert "live" in _compiled(opt_state).eager


def test_lazily_initialised_optimizer_is_initialised_before_tracing():
    model, twin = _mlp(), _mlp()
    opt_state = OptState(Adam(0.01), optim.Adam(0.01, bias_correction=True))  # no init
    reference = optim.Adam(0.01, bias_correction=True)
    for step in range(3):
        g = _grads(model, step)
        _step_both(opt_state, model, reference, twin, g)
    _assert_matches(model, twin, opt_state, reference)
    assert len(_compiled(opt_state).steps) == 1


def test_update_under_disable_compile():
    model, twin, opt_state, reference = _pair(Lion(0.01))
    mx.disable_compile()
    try:
        for step in range(2):
            g = _grads(model, step)
            _step_both(opt_state, model, reference, twin, g)
    finally:
        mx.enable_compile()
    _assert_matches(model, twin, opt_state, reference)


@pytest.fixture
def cache_limit():
    """Sets MLX's CPU default buffer-cache limit for the test and restores the old one."""
    old = mx.set_cache_limit(compiled._CPU_CACHE_DEFAULT)
    saved = list(compiled._cache_limit_set)
    compiled._cache_limit_set.clear()
    yield
    mx.set_cache_limit(old)
    compiled._cache_limit_set[:] = saved


def _limit() -> int:
    current = mx.set_cache_limit(sys.maxsize)
    mx.set_cache_limit(current)
    return current


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU allocator's policy")
def test_cache_limit_raised_from_the_default_only(cache_limit):
    model = Dense(2048, 1024, bias=False)  # 8 MiB: parameters + gradients + Adam state 32 MiB
    opt_state = setup(Adam(), model)
    grads = {"weight": mx.zeros((1024, 2048))}
    update(opt_state, model, grads)
    footprint = 4 * model.weight.nbytes + sum(
        v.nbytes for k, v in tree_flatten(opt_state.optimizer.state) if "weight" not in k)
    assert _limit() == 2 * footprint
    update(setup(Descent(), Dense(2, 1)), Dense(2, 1), {"weight": mx.zeros((1, 2))})
    assert _limit() == 2 * footprint  # never lowered
    mx.set_cache_limit(40 << 20)  # the user's own choice is kept
    update(setup(Adam(), model), model, grads)
    assert _limit() == 40 << 20


@given(st.lists(st.sampled_from(["finite", "inf", "nan", "lr", "load"]), min_size=1,
                max_size=8))
@settings(max_examples=15, deadline=None)
def test_random_sequences_match_the_eager_path(ops):
    def make():
        model = _mlp()
        return model, setup(OptimiserChain(ClipNorm(1.0), AdamW(0.01)), model,
                            loss_scale=DynamicLossScale(2.0**6, growth_interval=2))

    model, opt_state = make()
    twin, eager_state = make()
    _eager(eager_state)
    checkpoint = None
    for i, op in enumerate(ops):
        if op == "lr":
            opt_state.optimizer.learning_rate = eager_state.optimizer.learning_rate = 0.001 * i
        elif op == "load":
            if checkpoint is None:
                checkpoint = tree_map(lambda x: x, (opt_state.state, eager_state.state))
            else:
                opt_state.load_state(checkpoint[0])
                eager_state.load_state(checkpoint[1])
        else:
            g = _grads(model, i, scale=2.0**6)
            if op != "finite":
                g["layers"][0]["weight"] = g["layers"][0]["weight"] * float(op)
            update(opt_state, model, g)
            update(eager_state, twin, g)
    _assert_close(model.parameters(), twin.parameters())
    _assert_close(opt_state.state, eager_state.state)


def test_a_chain_with_partial_list_gradients():
    # gradients for part of a list of layers, through OptimiserChain's inner optimiser
    model, twin, opt_state, reference = _pair(OptimiserChain(ClipNorm(10.0), Adam(0.01)))
    full = _grads(model, 0)
    partial = {"layers": [{"weight": full["layers"][0]["weight"]}]}
    for g in (partial, full, partial):
        _step_both(opt_state, model, reference, twin, g)
    _assert_matches(model, twin, opt_state, reference)
