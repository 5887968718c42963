"""The native log-sum-exp pass (native/src/softmax.cpp: log_sum_exp, log_sum_exp_grad) against
float64 numpy and MLX's own ``logsumexp``, and through fluxlike's losses and ``logsumexp``
(``fluxlike/precision/kernels.py``: logsumexp_shifted)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from native_helpers import needs_native, np64, rand

import fluxlike
from fluxlike import native
from fluxlike.losses import logitcrossentropy
from fluxlike.precision import kernels

pytestmark = needs_native


def ext():
    return native.switch.loaded


def top_of(x: mx.array) -> mx.array:
    return mx.stop_gradient(mx.max(x, axis=-1, keepdims=True))


def np_shifted_lse(x: np.ndarray, top: np.ndarray) -> np.ndarray:
    return np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 4, 3, 33), (1, 1), (4, 1000)])
@pytest.mark.parametrize("scale", [1.0, 30.0, 1e5])
def test_against_float64(shape, scale):
    x = rand(shape, scale=scale)
    top = top_of(x)
    out = ext().log_sum_exp(x, top)
    assert out.dtype == mx.float32 and out.shape == top.shape
    want = np_shifted_lse(np64(x), np64(top))
    np.testing.assert_allclose(np64(out), want, rtol=2e-6, atol=2e-7)
    strided = x.swapaxes(0, -1) if x.ndim > 1 else x[::2]  # made contiguous first
    np.testing.assert_allclose(np64(ext().log_sum_exp(strided, top_of(strided))),
                               np_shifted_lse(np64(strided), np64(top_of(strided))),
                               rtol=2e-6, atol=2e-7)


def test_special_values_taken_literally():
    inf, nan = float("inf"), float("nan")
    x = mx.array([[0.0, -inf], [-inf, -inf], [inf, 1.0], [nan, 1.0], [-inf, 88.0]])
    out = ext().log_sum_exp(x, mx.zeros((5, 1)))
    assert np64(out).ravel().tolist()[:3] == [0.0, -inf, inf]
    assert np.isnan(np64(out)[3, 0])
    assert np64(out)[4, 0] == pytest.approx(88.0)
    empty = ext().log_sum_exp(mx.zeros((3, 0)), mx.zeros((3, 1)))
    assert np64(empty).ravel().tolist() == [-inf] * 3  # log of an empty sum


def test_gradients_and_second_order_agree_with_mlxs():
    x = rand((6, 40), scale=4.0)
    weights = mx.arange(6, dtype=mx.float32).reshape(6, 1) - 2

    def native_lse(v):
        top = top_of(v)
        return ((ext().log_sum_exp(v, top) + top) * weights).sum()

    def mlx_lse(v):
        return (mx.logsumexp(v, axis=-1, keepdims=True) * weights).sum()

    grad, want = mx.grad(native_lse)(x), mx.grad(mlx_lse)(x)
    np.testing.assert_allclose(np64(grad), np64(want), rtol=1e-5, atol=1e-7)
    # (the second derivative: the gradient pass's own derivatives are MLX's ops)
    hvp = mx.grad(lambda v: (mx.grad(native_lse)(v) ** 2).sum())(x)
    want_hvp = mx.grad(lambda v: (mx.grad(mlx_lse)(v) ** 2).sum())(x)
    np.testing.assert_allclose(np64(hvp), np64(want_hvp), rtol=1e-4, atol=1e-6)
    # in top: -g (the caller stops it; the derivative is still the true one)
    top = mx.zeros((6, 1))
    dtop = mx.grad(lambda t: (ext().log_sum_exp(x, t) * weights).sum())(top)
    np.testing.assert_array_equal(np64(dtop), -np64(weights))


def test_jvp_vmap_and_shapeless_compile():
    x = rand((3, 5, 9))
    t = rand((3, 5, 9))

    def f(v):
        return ext().log_sum_exp(v, top_of(v))

    def g(v):
        return mx.logsumexp(v, axis=-1, keepdims=True) - top_of(v)

    (_, tangent), (_, want) = (mx.jvp(fn, [x], [t]) for fn in (f, g))
    np.testing.assert_allclose(np64(tangent[0]), np64(want[0]), rtol=1e-5, atol=1e-6)
    for axis in (0, 1, 2):
        mapped = mx.vmap(f, in_axes=axis)(x)
        want = mx.stack([f(mx.take(x, i, axis=axis)) for i in range(x.shape[axis])])
        np.testing.assert_allclose(np64(mapped), np64(want), rtol=1e-6, atol=1e-7)
    compiled = mx.compile(f, shapeless=True)
    for shape in ((2, 7), (4, 3, 11)):
        v = rand(shape)
        np.testing.assert_allclose(np64(compiled(v)), np64(f(v)), rtol=1e-6)


@pytest.mark.parametrize(("x", "top", "said"), [
    (mx.zeros((2, 3), mx.bfloat16), mx.zeros((2, 1)), "x to be a float32 array"),
    (mx.zeros((2, 3)), mx.zeros((2,)), "top to be float32 of shape (2, 1) (x's (2, 3) with"),
    (mx.zeros((2, 3)), mx.zeros((3, 1)), "got float32 (3, 1)"),
])
def test_refuses_other_operands(x, top, said):
    with pytest.raises(ValueError, match=r"log_sum_exp.*" + said.replace("(", r"\(").replace(
            ")", r"\)")):
        ext().log_sum_exp(x, top)


def test_fluxlikes_logsumexp_and_losses_take_it(monkeypatch):
    calls = []
    real = ext().log_sum_exp
    monkeypatch.setattr(ext(), "log_sum_exp", lambda *a: calls.append(1) or real(*a))
    x = rand((8, 50), scale=5.0)
    y = mx.random.randint(0, 50, (8,))
    got = fluxlike.logsumexp(x)
    np.testing.assert_allclose(np64(got), np64(mx.logsumexp(x, axis=-1)), rtol=1e-6)
    loss = logitcrossentropy(x, mx.eye(50)[y])
    np.testing.assert_allclose(np64(loss), np.mean(np64(mx.logsumexp(x, axis=-1)) - np64(
        mx.take_along_axis(x, y[:, None], -1))[:, 0]), rtol=1e-6)
    assert len(calls) == 2
    fluxlike.logsumexp(x, axis=0)  # not the last axis: the ops
    assert fluxlike.logsumexp(x[:0]).shape == (0,)  # no rows
    assert len(calls) == 3
    with native.disabled():
        fluxlike.logsumexp(x)
    assert len(calls) == 3
    assert kernels.choose("exp", mx.float32, x) == kernels.NATIVE
