"""fluxlike/init.py: each initialiser's distribution, shapes, dtype and checked arguments."""

import math
from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from helpers import np64

import fluxlike
from fluxlike import Conv, Dense, init

SHAPED = [init.glorot_uniform, init.glorot_normal, init.kaiming_uniform, init.kaiming_normal,
          init.truncated_normal, init.orthogonal, init.identity_init, init.ones32, init.zeros32]


@pytest.mark.parametrize("fn", SHAPED, ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(6, 4), (5, 3, 3, 2), (4, 2, 3)])
def test_shape_and_float32(fn, shape):
    w = fn(shape)
    assert w.shape == shape and w.dtype == mx.float32


@pytest.mark.parametrize("fn", SHAPED, ids=lambda f: f.__name__)
def test_layers_take_them(fn):
    assert Dense(4, 3, init=fn).weight.shape == (3, 4)
    assert Conv((3, 3), 2, 4, init=fn).weight.shape == (4, 3, 3, 2)


def test_public_names():
    for name in ("glorot_uniform", "glorot_normal", "kaiming_uniform", "kaiming_normal",
                 "truncated_normal", "orthogonal", "sparse_init", "identity_init", "ones32",
                 "zeros32"):
        assert getattr(fluxlike, name) is getattr(init, name)


@pytest.mark.parametrize("fn, std", [
    (init.glorot_normal, math.sqrt(2 / (200 + 300))),
    (init.kaiming_normal, math.sqrt(2) / math.sqrt(300)),
    (partial(init.kaiming_normal, gain=1.0), 1 / math.sqrt(300)),
    (partial(init.glorot_normal, gain=3.0), 3 * math.sqrt(2 / (200 + 300))),
])
def test_normal_standard_deviations(fn, std):
    w = np64(fn((200, 300)))
    assert abs(w.mean()) < 0.05 * std and abs(w.std() / std - 1) < 0.02


@pytest.mark.parametrize("fn, limit", [
    (init.glorot_uniform, math.sqrt(6 / (200 + 300))),
    (init.kaiming_uniform, math.sqrt(2) * math.sqrt(3 / 300)),
])
def test_uniform_limits(fn, limit):
    w = np64(fn((200, 300)))
    assert np.abs(w).max() <= limit and np.abs(w).max() > 0.99 * limit
    assert abs(w.std() / (limit / math.sqrt(3)) - 1) < 0.02


def test_fans_of_a_convolution_kernel_in_mlx_layout():
    # (out, kh, kw, in): fan_in = kh * kw * in, fan_out = out * kh * kw
    w = np64(init.glorot_normal((64, 3, 3, 32)))
    expected = math.sqrt(2 / (3 * 3 * 32 + 64 * 3 * 3))
    assert abs(w.std() / expected - 1) < 0.03


def test_vectors_use_their_length_as_both_fans():
    assert init.glorot_uniform((5,)).shape == (5,)
    assert init.kaiming_normal(5).shape == (5,)


def test_truncated_normal_bounds_mean_and_std():
    w = np64(init.truncated_normal((100_000,), mean=1.0, std=2.0, lo=-1.0, hi=3.0))
    assert w.min() >= -1.0 and w.max() <= 3.0
    # truncation at ±1 sigma around the mean: mean kept, std 2 * 0.5379
    assert abs(w.mean() - 1.0) < 0.02
    assert abs(w.std() - 2 * 0.5379) < 0.01
    w = np64(init.truncated_normal((100_000,)))
    assert w.min() >= -2 and w.max() <= 2 and abs(w.std() - 0.8796) < 0.01


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4), (6, 3, 3, 2), (2, 3, 3, 6)])
def test_orthogonal_rows_or_columns_are_orthonormal(shape):
    w = np64(init.orthogonal(shape, gain=2.0)).reshape(shape[0], -1)
    rows, cols = w.shape
    gram = w @ w.T if rows <= cols else w.T @ w
    np.testing.assert_allclose(gram, 4 * np.eye(min(rows, cols)), atol=1e-5)


def test_orthogonal_is_not_always_the_same_matrix_and_has_both_signs():
    a, b = np64(init.orthogonal((8, 8))), np64(init.orthogonal((8, 8)))
    assert not np.allclose(a, b)
    corners = np.array([np64(init.orthogonal((2, 2)))[0, 0] for _ in range(40)])
    assert (corners > 0).any() and (corners < 0).any()


def test_sparse_init_zeroes_a_fraction_of_each_column():
    w = np64(init.sparse_init((10, 7), sparsity=0.25, std=0.5))
    assert ((w == 0).sum(axis=0) == math.ceil(0.25 * 10)).all()
    nonzero = np64(init.sparse_init((400, 300), sparsity=0.1, std=0.5))
    nonzero = nonzero[nonzero != 0]
    assert abs(nonzero.std() / 0.5 - 1) < 0.02
    assert (np64(init.sparse_init((3, 3), sparsity=1.0)) == 0).all()


def test_identity_init_makes_dense_and_conv_the_identity():
    x = mx.random.normal((2, 5))
    np.testing.assert_array_equal(np64(Dense(5, 5, init=init.identity_init)(x)), np64(x))
    assert init.identity_init((4,)).tolist() == [0.0] * 4
    np.testing.assert_array_equal(np64(init.identity_init((3, 2), gain=2.0)),
                                  [[2, 0], [0, 2], [0, 0]])
    for kernel in [(3,), (2,), (4, 3), (2, 2, 3)]:
        x = mx.random.normal((1, *(5 for _ in kernel), 3))
        layer = Conv(kernel, 3, 3, padding="same", init=init.identity_init)
        np.testing.assert_array_equal(np64(layer(x)), np64(x), err_msg=str(kernel))


@pytest.mark.parametrize("call, message", [
    (lambda: init.glorot_uniform((3, 0)), r"\[glorot_uniform\] shape must be a tuple of "
                                          r"positive integers, got \(3, 0\)"),
    (lambda: init.orthogonal((3,)), r"\[orthogonal\] needs a shape of at least 2 dimensions, "
                                    r"got \(3,\)"),
    (lambda: init.sparse_init((3, 3, 3), sparsity=0.5), r"\[sparse_init\] takes 2-D shapes"),
    (lambda: init.sparse_init((3, 3), sparsity=1.5), r"\[sparse_init\] sparsity must be in "
                                                     r"\[0, 1\], got 1.5"),
    (lambda: init.truncated_normal((3,), lo=1.0, hi=0.0), r"\[truncated_normal\] needs lo < hi"),
    (lambda: init.truncated_normal((3,), std=0), r"\[truncated_normal\] std must be a positive"),
    (lambda: init.zeros32("3"), r"\[zeros32\] shape must be"),
])
def test_bad_arguments_name_the_initialiser(call, message):
    with pytest.raises(ValueError, match=message):
        call()
