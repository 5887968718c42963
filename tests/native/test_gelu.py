"""The native GELU (native/src/gelu.cpp; fluxlike.gelu through precision/kernels.py: gelu)
against float64 and MLX's own ``nn.gelu``: values in every dtype, special values, layouts,
gradients (first and second order), jvp, vmap, ``mx.compile``, and the routing.

Tolerances (the documented numerics): Φ by Abramowitz and Stegun 7.1.26, as MLX's ``erf``
(|error| <= 1.5e-7), evaluated in float32 and rounded once: ``|gelu - exact| <= 3e-7 |x|``
plus rounding; in half precision, half an ulp of the half dtype more.

Without the extension these tests skip with the reason ``native_info()`` gives.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_helpers import needs_native, np64

import fluxlike
from fluxlike import native
from fluxlike.precision import kernels

HALF_ULP = {mx.float32: 2.0**-24, mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11}  # relative


def _exact(x: np.ndarray) -> np.ndarray:
    return np.array([v * 0.5 * math.erfc(-v / math.sqrt(2)) for v in x.astype(np.float64)])


def _exact_grad(x: np.ndarray) -> np.ndarray:
    return np.array([0.5 * math.erfc(-v / math.sqrt(2))
                     + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi)
                     for v in x.astype(np.float64)])


def _ext():
    from fluxlike_native import _ext
    return _ext


def _assert_within(got: mx.array, exact: np.ndarray, x: np.ndarray, dtype) -> None:
    """|got - exact| <= 3e-7 |x| + 2 ulp of float32 + half an ulp of ``dtype`` (relative)."""
    bound = (3e-7 * np.abs(x) + 2 * np.spacing(np.abs(exact).astype(np.float32))
             + HALF_ULP[dtype] * np.abs(exact) + 1e-38)
    err = np.abs(np64(got) - exact)
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), (x[worst], np64(got)[worst], exact[worst])


@needs_native
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_values_against_float64_and_mlx(dtype):
    xs = np.concatenate([np.linspace(-12, 12, 20001), [0.0, 1e-30, -1e-30, 1e-8, -1e-8, 37.0]])
    x = mx.array(xs.astype(np.float32)).astype(dtype)
    y = _ext().gelu(x)
    assert y.dtype == dtype and y.shape == x.shape
    held = np64(x)  # the input as the dtype holds it
    _assert_within(y, _exact(held), held, dtype)
    # MLX's own: the same function to its accuracy (it loses negative inputs' relative
    # accuracy to 1 + erf's cancellation, which the native pass does not)
    np.testing.assert_allclose(np64(y), np64(nn.gelu(x)), rtol=0,
                               atol=5e-7 + 2 * HALF_ULP[dtype] * 12)


@needs_native
def test_negative_inputs_keep_their_relative_accuracy():
    """Where MLX's 1 + erf(x / √2) cancels (x < -4 gives 0 or a few bits), the native pass
    computes the tail Φ(x) itself: within 6% down to x = -12 (A&S's relative error in the
    far tail), every value nonzero and negative."""
    xs = np.linspace(-12, -4, 801).astype(np.float32)
    y = np64(_ext().gelu(mx.array(xs)))
    exact = _exact(xs)
    assert (y < 0).all()
    np.testing.assert_allclose(y, exact, rtol=0.06)


@needs_native
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_special_values_as_mlx(dtype):
    x = mx.array([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e30]).astype(dtype)
    mine, theirs = np64(_ext().gelu(x)), np64(nn.gelu(x))
    np.testing.assert_array_equal(np.isnan(mine), np.isnan(theirs))  # gelu(-inf): nan
    finite = ~np.isnan(theirs)
    np.testing.assert_array_equal(mine[finite], theirs[finite])
    np.testing.assert_array_equal(np.signbit(mine[3:5]), [False, True])  # -0 stays -0


@needs_native
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(shape=st.sampled_from([(1,), (7,), (3, 5), (2, 3, 17), (4, 1025)]),
       layout=st.sampled_from(["contiguous", "transposed", "strided"]),
       dtype=st.sampled_from([mx.float32, mx.bfloat16, mx.float16]), seed=st.integers(0, 999))
def test_layouts_and_sizes(shape, layout, dtype, seed):
    """Any layout (a view is copied first) and any size (the vectorised loop's tail, the
    half-precision chunks): the values of the contiguous input."""
    mx.random.seed(seed)
    base = (4 * mx.random.normal(shape)).astype(dtype)
    x = base.T if layout == "transposed" else base[..., ::2] if layout == "strided" else base
    np.testing.assert_array_equal(np64(_ext().gelu(x)), np64(_ext().gelu(mx.contiguous(x))))


@needs_native
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_gradient_against_float64_and_mlx(dtype):
    xs = np.linspace(-9, 9, 4001).astype(np.float32)
    x = mx.array(xs).astype(dtype)
    g = mx.grad(lambda v: _ext().gelu(v).astype(mx.float32).sum())(x)
    assert g.dtype == dtype
    held = np64(x)
    bound = 4e-7 + 2 * np.spacing(np.float32(1.0)) + HALF_ULP[dtype] * 1.2
    np.testing.assert_allclose(np64(g), _exact_grad(held), rtol=0, atol=bound)
    theirs = mx.grad(lambda v: nn.gelu(v).astype(mx.float32).sum())(x)
    np.testing.assert_allclose(np64(g), np64(theirs), rtol=0, atol=bound + HALF_ULP[dtype] * 4)


@needs_native
def test_second_order_jvp_and_vmap():
    """The backward pass's own derivatives (MLX's ops), jvp, vmap of each pass (the mapped
    axis anywhere, one operand unmapped), and inside mx.compile: as nn.gelu's."""
    ext = _ext()
    x = mx.linspace(-3, 3, 13)
    second = mx.grad(lambda v: mx.grad(lambda u: ext.gelu(u).sum())(v).sum())(x)
    theirs = mx.grad(lambda v: mx.grad(lambda u: nn.gelu(u).sum())(v).sum())(x)
    np.testing.assert_allclose(np64(second), np64(theirs), atol=2e-6)
    t = mx.linspace(1, 2, 13)
    np.testing.assert_allclose(np64(mx.jvp(ext.gelu, [x], [t])[1][0]),
                               np64(mx.jvp(nn.gelu, [x], [t])[1][0]), atol=1e-6)
    xs = mx.stack([x, 2 * x, -x], axis=1)  # (13, 3): map axis 1
    np.testing.assert_allclose(np64(mx.vmap(ext.gelu, in_axes=1, out_axes=1)(xs)),
                               np64(ext.gelu(xs)), atol=0)
    g = mx.ones((13,))
    mapped = mx.vmap(lambda v: mx.vjp(ext.gelu, [v], [g])[1][0], in_axes=1, out_axes=1)(xs)
    np.testing.assert_allclose(np64(mapped), np64(mx.vjp(ext.gelu, [xs], [mx.ones((13, 3))])[1][0]),
                               atol=0)
    both = mx.vmap(ext.gelu_grad, in_axes=(0, 1))(mx.ones((3, 13)), xs)
    np.testing.assert_allclose(np64(both), np64(ext.gelu_grad(mx.ones((13, 3)), xs).T), atol=0)
    compiled = mx.compile(lambda v: mx.grad(lambda u: ext.gelu(u).sum())(v))
    np.testing.assert_array_equal(np64(compiled(x)),
                                  np64(mx.grad(lambda u: ext.gelu(u).sum())(x)))


@needs_native
def test_errors_name_the_function_and_the_fix():
    with pytest.raises(ValueError, match=r"fluxlike_native.gelu: x must be float32, bfloat16 or "
                       r"float16, got float64; use mlx.nn.gelu"):
        _ext().gelu(mx.ones(3, mx.float64))
    with pytest.raises(ValueError, match=r"gelu_grad: g and x must be float32, bfloat16 or "
                       r"float16, got int32 and float32"):
        _ext().gelu_grad(mx.ones(3, mx.int32), mx.ones(3))
    # operands of two shapes or float dtypes: MLX's ops, in float32
    g = _ext().gelu_grad(mx.ones((2, 3), mx.bfloat16), mx.zeros(3))
    assert g.dtype == mx.bfloat16 and g.shape == (2, 3) and (np64(g) == 0.5).all()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.float64], ids=str)
def test_fluxlike_gelu_routes_to_the_native_pass_where_it_can(dtype, monkeypatch):
    """fluxlike.gelu (and gelu_erf, and a Dense layer's gelu) take the native pass on the CPU
    with the companion in use, for every dtype it takes; float64, and without the companion,
    MLX's nn.gelu: the same values to the documented tolerance."""
    x = mx.linspace(-4, 4, 33).astype(dtype)
    calls = []
    if native.available():
        real = native.switch.ext

        class Counting:
            def __getattr__(self, name):
                entry = getattr(real, name)
                if name != "gelu":
                    return entry
                return lambda *a, **k: calls.append(name) or entry(*a, **k)

        monkeypatch.setattr(native.switch, "ext", Counting())
    y = fluxlike.gelu(x)
    layer = fluxlike.Dense(33, 2, fluxlike.gelu_erf)
    layer(x[None].astype(mx.float32))
    takes = native.available() and dtype != mx.float64
    assert len(calls) == (2 if takes else 1 if native.available() else 0)
    assert y.dtype == dtype
    np.testing.assert_allclose(np64(y), np64(nn.gelu(x)), atol=5e-7 + 4 * HALF_ULP.get(dtype, 0))
    assert kernels.choose("gelu", dtype, x) == ("native" if takes else "mlx")
