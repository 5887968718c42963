"""Training under autocast: float32 gradients and optimiser state, and float16 loss scaling."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from fluxlike import (
    Adam,
    BatchNorm,
    Chain,
    Conv,
    Dense,
    Descent,
    DynamicLossScale,
    LayerNorm,
    NoOpLossScale,
    flatten,
    gradient,
    relu,
    setup,
    train,
    withgradient,
)
from fluxlike.losses import mse

TOLERANCES = {mx.float16: 0.03, mx.bfloat16: 0.15}


def _model():
    mx.random.seed(0)
    return Chain(
        Dense(2, 4),
        Conv((3, 3), 4, 4, relu, stride=1, padding=1),
        BatchNorm(4),
        flatten,
        LayerNorm(6 * 6 * 4),
        Dense(6 * 6 * 4, 3),
    )


def _data(n=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6, 6, 2)).astype(np.float32)
    y = rng.normal(size=(n, 3)).astype(np.float32)
    return mx.array(x), mx.array(y)


def _loss(m, x, y):
    return mse(m(x), y)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_gradients_under_autocast_are_float32_and_close(dtype):
    x, y = _data()
    reference = dict(tree_flatten(gradient(_loss, _model(), x, y)[0]))
    model = _model()
    g_model, g_x, g_y = gradient(_loss, model, x, y, autocast=dtype)
    got = dict(tree_flatten(g_model))
    assert list(got) == list(reference)
    for k, g in got.items():
        assert g.dtype == mx.float32, k
        np.testing.assert_allclose(np.array(g), np.array(reference[k]), rtol=TOLERANCES[dtype],
                                   atol=0.05, err_msg=k)
        # Tighter, relative to the whole array: half precision's rounding and no more.
        diff = np.linalg.norm(np.array(g) - np.array(reference[k]))
        assert diff <= TOLERANCES[dtype] / 3 * np.linalg.norm(np.array(reference[k])), k
    # The model did compute in half precision (else this test could not tell).
    assert any(not mx.array_equal(g, reference[k]).item() for k, g in got.items())
    assert g_x.dtype == mx.float32 and g_y.dtype == mx.float32
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))


def test_value_under_autocast_is_float32():
    x, y = _data()
    value, _ = withgradient(_loss, _model(), x, y, autocast=mx.float16)
    assert value.dtype == mx.float32 and value.shape == ()


def _train_once(dtype):
    model = _model()
    opt_state = setup(Adam(1e-3), model)
    train(_loss, model, [_data(seed=s) for s in range(3)], opt_state, autocast=dtype,
          progress=False)
    return model, opt_state


def test_optimiser_state_and_master_weights_as_in_float32():
    model32, state32 = _train_once(None)
    reference = [(k, v.dtype, v.shape) for k, v in tree_flatten(state32.state["optimizer"])]
    for dtype in (mx.float16, mx.bfloat16):
        model, opt_state = _train_once(dtype)
        got = [(k, v.dtype, v.shape) for k, v in tree_flatten(opt_state.state["optimizer"])]
        assert got == reference
        assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))
        skipped = 0  # float16 steps skipped by the loss scale, each of which halved it
        if isinstance(opt_state.loss_scale, DynamicLossScale):
            skipped = round(np.log2(2.0**15 / opt_state.loss_scale.loss_scale.item()))
        assert opt_state.optimizer.step.item() + skipped == 3
    assert isinstance(_train_once(mx.float16)[1].loss_scale, DynamicLossScale)
    assert isinstance(_train_once(mx.bfloat16)[1].loss_scale, NoOpLossScale)


# ---------------------------------------------------------------- float16 underflow

TINY = 1e-7  # makes d(loss)/d(prediction) ~ 3e-9: below float16's smallest subnormal


def _tiny_problem():
    rng = np.random.default_rng(0)
    w = rng.uniform(-1, 1, size=(4, 1)).astype(np.float32)
    data = []
    for _ in range(4):
        x = rng.uniform(-1, 1, size=(64, 4)).astype(np.float32)
        data.append((mx.array(x), mx.array(x @ w + 0.3)))
    return data


def _tiny_loss(m, x, y):
    return TINY * mse(m(x), y)


def _fit(autocast, loss_scale, epochs=40):
    mx.random.seed(1)
    model = Dense(4, 1)
    opt_state = setup(Descent(0.1 / TINY), model)
    data = _tiny_problem()
    first = train(_tiny_loss, model, data, opt_state, autocast=autocast, loss_scale=loss_scale,
                  progress=False)
    for _ in range(epochs):
        last = train(_tiny_loss, model, data, opt_state, autocast=autocast,
                     loss_scale=loss_scale, progress=False)
    return model, opt_state, first / TINY, last / TINY


def test_float16_gradients_underflow_without_loss_scaling():
    x, y = _tiny_problem()[0]
    g16 = gradient(_tiny_loss, Dense(4, 1), x, y, autocast=mx.float16)[0]
    assert all(mx.all(v == 0).item() for _, v in tree_flatten(g16))
    g32 = gradient(_tiny_loss, Dense(4, 1), x, y)[0]
    assert all(mx.all(v != 0).item() for _, v in tree_flatten(g32))

    model, _, first, last = _fit(mx.float16, None, epochs=2)
    mx.random.seed(1)
    initial = Dense(4, 1)  # the model _fit started from: nothing was learnt
    assert mx.array_equal(model.weight, initial.weight).item()
    assert mx.array_equal(model.bias, initial.bias).item()


def test_float16_training_with_dynamic_loss_scaling_converges_like_float32():
    _, _, first32, last32 = _fit(None, "auto")
    model, opt_state, first16, last16 = _fit(mx.float16, "auto")
    assert isinstance(opt_state.loss_scale, DynamicLossScale)
    assert opt_state.loss_scale.loss_scale.item() == 2.0**15  # never overflowed here
    assert last32 < 1e-3 * first32
    assert last16 < 1e-3 * first16
    assert last16 == pytest.approx(last32, abs=1e-3 * first32)
