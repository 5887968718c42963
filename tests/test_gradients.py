"""Tests of fluxlike/gradients.py: gradient, withgradient."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import dense_of, leaves, mse_of

from fluxlike import (
    BatchNorm,
    Chain,
    Dense,
    Descent,
    Dropout,
    gradient,
    setup,
    train,
    trainmode,
    withgradient,
)
from fluxlike.modes import is_active

# ---------------------------------------------------------------- gradient / withgradient


def test_gradient_of_a_module_matches_numpy():
    w = np.array([[1.0, -2.0, 0.5], [0.0, 1.5, -1.0]], dtype=np.float32)
    b = np.array([0.1, -0.2], dtype=np.float32)
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(4, 2)).astype(np.float32)
    model = dense_of(w, b)
    (g,) = gradient(lambda m: mse_of(m, mx.array(x), mx.array(y)), model)
    err = x @ w.T + b - y
    np.testing.assert_allclose(np.array(g["weight"]), 2 * err.T @ x / err.size, rtol=1e-5)
    np.testing.assert_allclose(np.array(g["bias"]), 2 * err.sum(0) / err.size, rtol=1e-5)
    assert sorted(g) == sorted(model.trainable_parameters())


def test_gradient_of_arrays_and_other_arguments():
    model = Dense(3, 2)
    x = mx.array([[1.0, 2.0, 3.0]])
    labels = mx.array([1, 0])

    def f(m, x, scale, labels, name):
        assert name == "tag" and labels.dtype == mx.int32
        return (m(x) * scale).sum() + (x**2).sum()

    g_m, g_x, g_scale, g_labels, g_name = gradient(f, model, x, 2.0, labels, "tag")
    assert g_scale is None and g_labels is None and g_name is None
    expected_x = 2 * np.array(model.weight).sum(0) + 2 * np.array(x)
    np.testing.assert_allclose(np.array(g_x), expected_x, rtol=1e-5)
    np.testing.assert_allclose(np.array(g_m["weight"]), 2 * np.ones((2, 1)) * np.array(x))


def test_gradient_of_two_modules():
    a, b = Dense(2, 2), Dense(2, 1)
    x = mx.ones((3, 2))
    ga, gb = gradient(lambda a, b: b(a(x)).sum(), a, b)
    ref_a, ref_b = gradient(lambda m: m(x).sum(), Chain(a, b))[0]["layers"]
    for got, ref in ((ga, ref_a), (gb, ref_b)):
        for k in ("weight", "bias"):
            np.testing.assert_allclose(np.array(got[k]), np.array(ref[k]), rtol=1e-6)


def test_withgradient_value_and_aux():
    x = mx.array([1.0, 2.0])
    value, (g,) = withgradient(lambda x: (x**2).sum(), x)
    assert value.dtype == mx.float32 and value.item() == 5.0
    assert g.tolist() == [2.0, 4.0]
    (loss, aux), (g,) = withgradient(lambda x: ((x**2).sum(), x * 3), x)
    assert loss.item() == 5.0 and aux.tolist() == [3.0, 6.0] and g.tolist() == [2.0, 4.0]


def test_half_loss_is_returned_as_float32():
    x = mx.array([1.0, 2.0], dtype=mx.float16)
    value, (g,) = withgradient(lambda x: (x**2).sum(), x)
    assert value.dtype == mx.float32 and g.dtype == mx.float16


def test_model_keeps_its_arrays():
    model = Dense(3, 2)
    weight, bias = model.weight, model.bias
    gradient(lambda m: m(mx.ones((2, 3))).sum(), model)
    assert model.weight is weight and model.bias is bias


def test_dropout_is_active_only_inside_gradient():
    drop = Dropout(0.5)
    model = Chain(Dense(4, 64), drop)
    seen = []

    def f(m):
        seen.append(is_active(drop))
        out = m(mx.ones((8, 4)))
        seen.append((out == 0).sum().item())
        return out.sum()

    gradient(f, model)
    assert seen[0] is True and seen[1] > 0
    assert not is_active(drop)
    assert (model(mx.ones((8, 4))) == 0).sum().item() == 0


@pytest.mark.parametrize("container", [Chain, nn.Sequential])
def test_mlx_train_and_eval_fix_the_mode(container):
    # mlx.nn's idiom: model.train() + nn.value_and_grad, model.eval() for inference
    bn, drop = BatchNorm(4), Dropout(0.5)
    model = container(Dense(4, 4), bn, drop)
    x = mx.array(np.random.default_rng(1).normal(3.0, 2.0, size=(16, 4)).astype(np.float32))
    model.train()
    assert bn.active is True and drop.active is True
    nn.value_and_grad(model, lambda x: model(x).sum())(x)
    assert np.all(np.array(bn.running_mean) != 0)
    assert (model(x) == 0).sum().item() > 0  # dropping outside gradient too, as in mlx
    model.eval()
    assert bn.active is False and drop.active is False
    assert mx.array_equal(model(x), model(x))
    trainmode(model, "auto")
    assert bn.active is None and drop.active is None


def test_batchnorm_running_stats_persist_as_concrete_arrays():
    bn = BatchNorm(3, momentum=0.5)
    model = Chain(Dense(2, 3), bn)
    x = mx.array(np.random.default_rng(0).normal(size=(16, 2)).astype(np.float32))
    weight, bn_weight = model[0].weight, bn.weight
    h = np.array(model[0](x))
    gradient(lambda m: m(x).sum(), model)
    assert model[0].weight is weight and bn.weight is bn_weight
    np.testing.assert_allclose(np.array(bn.running_mean), 0.5 * h.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(bn.running_var), 0.5 + 0.5 * h.var(0, ddof=1), rtol=1e-5)
    assert "running_mean" not in leaves(model.trainable_parameters()).get("layers.1", {})
    # A second call starts from the stored statistics (they are ordinary arrays now).
    gradient(lambda m: m(x).sum(), model)
    np.testing.assert_allclose(np.array(bn.running_mean), 0.75 * h.mean(0), rtol=1e-5, atol=1e-6)


def test_batchnorm_stats_inside_compile():
    model = Chain(Dense(2, 3), BatchNorm(3))
    x = mx.ones((4, 2)) * mx.arange(4).reshape(4, 1)

    def step(x):
        return gradient(lambda m: m(x).sum(), model)[0]["layers"][0]["weight"]

    compiled = mx.compile(step, inputs=model.state, outputs=model.state)
    mx.eval(compiled(x))
    assert model[1].running_mean.sum().item() != 0.0


def test_gradient_errors_leave_model_unchanged():
    model = Chain(Dense(2, 3), BatchNorm(3))
    before = leaves(model.parameters())
    with pytest.raises(ValueError, match="floating scalar"):
        gradient(lambda m: m(mx.ones((4, 2))), model)
    with pytest.raises(TypeError, match="scalar mx.array"):
        gradient(lambda m: 1.0, model)

    def fails(m):
        m(mx.ones((4, 2)))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        gradient(fails, model)
    after = leaves(model.parameters())
    assert all(after[k] is v for k, v in before.items())


@pytest.mark.parametrize("bad", [mx.float32, mx.float64, "float16", 16])
def test_bad_autocast(bad):
    with pytest.raises(ValueError, match="autocast must be None, mx.float16 or mx.bfloat16"):
        gradient(lambda x: x.sum(), mx.ones(2), autocast=bad)
    with pytest.raises(ValueError, match="autocast must be"):
        train(mse_of, Dense(1, 1), [], setup(Descent(), Dense(1, 1)), autocast=bad)


def test_nothing_to_differentiate():
    value, grads = withgradient(lambda n, s: mx.array(2.0) * n, 3, "s")
    assert value.item() == 6.0 and grads == (None, None)
    assert gradient(lambda: mx.array(1.0)) == ()


def test_not_callable():
    with pytest.raises(TypeError, match="callable"):
        gradient(Dense(1, 1).weight, mx.ones(2))


def test_a_number_passed_is_named_when_the_loss_is_not_an_array():
    # (numbers and NumPy arrays are passed as they are, as constants: the loss then is one too)
    with pytest.raises(TypeError, match=r"gradient: the function must return a scalar mx.array "
                                        r"\(the loss\), got float \(argument 1 is a float, "
                                        r"passed as it is and not differentiated: wrap it in "
                                        r"mx.array\)"):
        gradient(lambda a: a**2, 3.0)
