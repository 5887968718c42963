"""The native softmax primitive (fluxlike/native/ops.py: softmax; native/src/softmax.cpp)
against float64 numpy and MLX's own softmax.

Without the extension these tests skip with the reason ``native_info()`` gives. To run them
as if it were absent: ``FLUXLIKE_NATIVE=0 python -m pytest -q tests/native``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from native_helpers import (
    needs_native,
    np64,
    rand,
)

from fluxlike import native


def _np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@needs_native
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 4, 16, 33), (1, 1, 1)])
def test_softmax_against_float64_and_mlx(shape):
    x = 4 * rand(shape)
    y = native.softmax(x)
    assert y.dtype == mx.float32 and y.shape == x.shape
    np.testing.assert_allclose(np64(y), _np_softmax(np64(x)), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np64(y), np64(mx.softmax(x, axis=-1, precise=True)), rtol=1e-6,
                               atol=1e-7)
    strided = x.swapaxes(0, -1) if x.ndim > 1 else x[::2]  # made contiguous first
    np.testing.assert_allclose(np64(native.softmax(strided)), _np_softmax(np64(strided)),
                               rtol=1e-6, atol=1e-7)


@needs_native
def test_softmax_masked_rows_as_mlx():
    low = mx.finfo(mx.float32).min
    x = mx.where(mx.arange(9) < 4, rand((3, 9)), low)  # attention's boolean/causal masking
    np.testing.assert_allclose(np64(native.softmax(x)), np64(mx.softmax(x, axis=-1)),
                               rtol=1e-6, atol=1e-7)
    assert native.softmax(mx.full((2, 5), low)).tolist() == mx.softmax(
        mx.full((2, 5), low), axis=-1).tolist()  # a fully masked row averages


@needs_native
def test_softmax_gradients_second_order_and_jvp():
    x, c = 3 * rand((2, 3, 11)), rand((2, 3, 11))

    def first(fn):
        return mx.grad(lambda a: (fn(a) * c).sum())

    def mlx_softmax(a):
        return mx.softmax(a, axis=-1, precise=True)

    np.testing.assert_allclose(np64(first(native.softmax)(x)), np64(first(mlx_softmax)(x)),
                               rtol=1e-5, atol=1e-6)
    second = [mx.grad(lambda a, fn=fn: (first(fn)(a) ** 2).sum())(x)
              for fn in (native.softmax, mlx_softmax)]
    np.testing.assert_allclose(np64(second[0]), np64(second[1]), rtol=1e-4, atol=1e-6)
    t = rand(x.shape)
    (mine,), (theirs,) = (mx.jvp(fn, [x], [t])[1] for fn in (native.softmax, mlx_softmax))
    np.testing.assert_allclose(np64(mine), np64(theirs), rtol=1e-5, atol=1e-6)
    # the backward primitive's own derivatives (second order through it, forward mode)
    g = mx.grad(lambda a: (native.softmax(a) * c).sum())
    (jg,), (jref,) = (mx.jvp(f, [x], [t])[1] for f in (g, first(mlx_softmax)))
    np.testing.assert_allclose(np64(jg), np64(jref), rtol=1e-4, atol=1e-6)


@needs_native
def test_softmax_inside_compile_and_errors():
    f = mx.compile(mx.grad(lambda a: (native.softmax(a) * a).sum()), shapeless=True)
    for rows in (3, 6):
        x = rand((rows, 9))
        expected = mx.grad(lambda a: (mx.softmax(a, axis=-1) * a).sum())(x)
        np.testing.assert_allclose(np64(f(x)), np64(expected), rtol=1e-5, atol=1e-6)
    assert native.softmax(mx.zeros((0, 4))).shape == (0, 4)
    for bad in (mx.ones((2, 3), mx.bfloat16), mx.array(1.0)):
        with pytest.raises(ValueError, match=r"fluxlike.native.softmax: expected a float32"):
            native.softmax(bad)
    with pytest.raises(TypeError, match=r"fluxlike.native.softmax: expected x"):
        native.softmax(np.ones(3))


@needs_native
def test_softmax_rows_with_nan_or_inf_are_nan_as_mlx():
    """A row holding NaN or +inf, or all -inf, is all NaN, as MLX's softmax gives it (oneDNN's
    alone leaves finite probabilities there); other rows are untouched."""
    inf, nan = float("inf"), float("nan")
    x = mx.array([[1, nan, 2, 0], [inf, 1, 2, 0], [-inf] * 4, [-inf, 0, 1, 2], [1, 2, 3, 4]])
    mine, theirs = np64(native.softmax(x)), np64(mx.softmax(x, axis=-1))
    np.testing.assert_array_equal(np.isnan(mine), np.isnan(theirs))
    np.testing.assert_allclose(np.nan_to_num(mine), np.nan_to_num(theirs), rtol=1e-6)
    assert np.isnan(mine[:3]).all() and not np.isnan(mine[3:]).any()


@needs_native
def test_softmax_under_vmap():
    x, c = rand((3, 4, 5)), rand((3, 4, 5))
    for axis in (0, 1, 2):
        xs = mx.moveaxis(x, 0, axis)
        np.testing.assert_allclose(np64(mx.vmap(native.softmax, in_axes=axis)(xs)),
                                   np64(mx.softmax(x, axis=-1)), rtol=1e-6, atol=1e-7)
    grads = mx.vmap(mx.grad(lambda a, c: (native.softmax(a) * c).sum()))(x, c)
    expected = mx.vmap(mx.grad(lambda a, c: (mx.softmax(a, axis=-1) * c).sum()))(x, c)
    np.testing.assert_allclose(np64(grads), np64(expected), rtol=1e-5, atol=1e-6)
