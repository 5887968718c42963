"""The native sigmoid, tanh and exp (native/src/logistic.cpp; fluxlike.sigmoid, tanh, swish,
the LSTM and GRU cells, and the exponentials of logsumexp, logsoftmax and the cross entropies
through precision/kernels.py) against float64 and MLX's own: values in every dtype, special
values, layouts, gradients (first and second order), jvp, vmap, ``mx.compile``, and the routing.

Tolerances (the documented numerics): within 3 ulp of the exact function in float32 (dense
sweeps: sigmoid 2.9, tanh 1.6, exp 1.0), computed in float32 and rounded once in half precision
(an ulp of the half dtype more: a tie rounded twice).

Without the extension these tests skip with the reason ``native_info()`` gives.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_helpers import needs_native, np64

import fluxlike
from fluxlike import native
from fluxlike.precision import kernels

HALF_ULP = {mx.float32: 0.0, mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11}  # relative
SUBNORMAL = {mx.float32: 0.0, mx.bfloat16: 2.0**-133, mx.float16: 2.0**-24}  # the smallest
KINDS = ["sigmoid", "tanh", "exp"]
MLX = {"sigmoid": mx.sigmoid, "tanh": mx.tanh, "exp": mx.exp}


def _exact(kind: str, x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    if kind == "tanh":
        return np.tanh(x)
    if kind == "exp":  # float32's overflow: inf from halfway past its largest value
        with np.errstate(over="ignore"):
            y = np.exp(x)
        return np.where(y >= float(np.finfo(np.float32).max) * (1 + 2.0**-25), np.inf, y)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _ext():
    from fluxlike_native import _ext
    return _ext


def _assert_within(got: mx.array, exact: np.ndarray, dtype) -> None:
    """|got - exact| <= 3 ulp of float32, and for a half ``dtype`` (``exact`` rounded to it)
    one ulp of it more (a tie rounded twice), or below float32's smallest normal (sigmoid
    below -87.3 is 0: documented)."""
    with np.errstate(over="ignore", invalid="ignore"):  # (inf - inf where both overflow)
        bound = (3 * np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
                 + 2 * HALF_ULP[dtype] * np.abs(exact) + SUBNORMAL[dtype]
                 + np.finfo(np.float32).tiny)
        err = np.where(np64(got) == exact, 0.0, np.abs(np64(got) - exact))
    if err.size == 0:
        return
    worst = int(np.argmax(err - bound))
    assert ((err <= bound) | (err == 0)).all(), (worst, np64(got)[worst], exact[worst])


@needs_native
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_values_against_float64(kind, dtype):
    xs = np.concatenate([np.linspace(-90, 90, 200001), np.linspace(-1, 1, 200001),
                         [0.625, -0.625, 0.62499994, 1e-30, -1e-30, 1e-8, -87.0, -87.3365,
                          88.72283, 88.7229, -103.97, -104.5, 11.089, 11.091]])
    x = mx.array(xs.astype(np.float32)).astype(dtype)
    y = getattr(_ext(), kind)(x)
    assert y.dtype == dtype and y.shape == x.shape
    exact = _exact(kind, np64(x))
    if dtype != mx.float32:  # computed in float32, rounded once to the half dtype
        exact = np64(mx.array(exact.astype(np.float32)).astype(dtype))
    _assert_within(y, exact, dtype)


@needs_native
def test_more_accurate_than_mlxs_sigmoid():
    # MLX's CPU sigmoid loses up to 63 ulp (for negative inputs)
    xs = np.linspace(-80, 0, 100001).astype(np.float32)
    exact = _exact("sigmoid", xs)
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    ours = np.abs(np64(_ext().sigmoid(mx.array(xs))) - exact) / ulp
    theirs = np.abs(np64(mx.sigmoid(mx.array(xs))) - exact) / ulp
    assert ours.max() <= 3 and theirs.max() > ours.max()


@needs_native
def test_exp_within_one_ulp_where_normal():
    xs = np.linspace(-87.33, 88.72, 1_000_001).astype(np.float32)
    exact = np.exp(xs.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(np64(_ext().exp(mx.array(xs))) - exact) / ulp).max() <= 1.0


@needs_native
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_special_values_as_mlx(kind, dtype):
    x = mx.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e4, -1e4]).astype(dtype)
    got, want = np64(getattr(_ext(), kind)(x)), np64(MLX[kind](x))
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[:2]).tolist() == np.signbit(want[:2]).tolist()  # tanh(-0) = -0


@needs_native
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
       layout=st.sampled_from(["row", "transposed", "broadcast", "strided"]),
       kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16))
def test_layouts_and_sizes(shape, layout, kind, seed):
    x = mx.random.normal(tuple(shape) or (), key=mx.random.key(seed)) * 4
    if layout == "transposed" and x.ndim >= 2:
        x = x.T
    elif layout == "broadcast":
        x = mx.broadcast_to(x.reshape(1, *x.shape), (3, *x.shape))
    elif layout == "strided" and x.ndim >= 1:
        x = x[::2]
    got = getattr(_ext(), kind)(x)
    assert got.shape == x.shape
    _assert_within(got, _exact(kind, np64(x)), mx.float32)


@needs_native
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_gradient_as_mlxs(kind, dtype):
    # MLX's vjp takes the derivative from the output: y (1 - y), 1 - y^2, times the cotangent
    x = (mx.random.normal((1000,), key=mx.random.key(1)) * 3).astype(dtype)
    g = mx.random.normal((1000,), key=mx.random.key(2)).astype(dtype)
    (got,) = mx.vjp(lambda v: getattr(_ext(), kind)(v), [x], [g])[1]
    y = np64(getattr(_ext(), kind)(x))
    want = np64(g) * {"sigmoid": y * (1 - y), "tanh": 1 - y * y, "exp": y}[kind]
    assert got.dtype == dtype
    tol = 1e-6 if dtype == mx.float32 else 1e-2
    np.testing.assert_allclose(np64(got), want, rtol=tol, atol=tol * np.abs(want).max())


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_second_order_jvp_vmap_and_compile(kind):
    f, ref = getattr(_ext(), kind), MLX[kind]
    x = mx.random.normal((4, 6), key=mx.random.key(3)) * 2

    def second(fn):  # d/dx of sum(d/dx sum(fn(x)))
        return mx.grad(lambda v: mx.grad(lambda u: fn(u).sum())(v).sum())(x)

    np.testing.assert_allclose(np64(second(f)), np64(second(ref)), rtol=1e-5, atol=1e-6)
    t = mx.random.normal((4, 6), key=mx.random.key(4))
    np.testing.assert_allclose(np64(mx.jvp(f, [x], [t])[1][0]), np64(mx.jvp(ref, [x], [t])[1][0]),
                               rtol=1e-5, atol=1e-6)
    per_row = mx.vmap(lambda v: mx.grad(lambda u: f(u).sum())(v), in_axes=1)(x)
    np.testing.assert_allclose(np64(per_row), np64(mx.grad(lambda u: f(u).sum())(x)).T,
                               rtol=1e-6, atol=1e-7)
    compiled = mx.compile(lambda v: f(v) * 2)
    np.testing.assert_allclose(np64(compiled(x)), np64(ref(x) * 2), rtol=1e-6, atol=1e-7)


@needs_native
def test_errors_name_the_function_and_the_fix():
    with pytest.raises(ValueError, match=r"x must be float32, bfloat16 or float16, got int32; "
                                         r"use mx.sigmoid, mx.tanh or mx.exp"):
        _ext().sigmoid(mx.array([1, 2]))


@needs_native
@pytest.mark.parametrize("fn", [fluxlike.sigmoid, fluxlike.tanh, fluxlike.swish],
                         ids=lambda f: f.__name__)
def test_fluxlike_activations_route_to_the_native_passes(fn, monkeypatch):
    x = mx.random.normal((64,), key=mx.random.key(5)) * 3
    calls = []
    for kind in KINDS:
        real = getattr(native.switch.loaded, kind)
        monkeypatch.setattr(native.switch.loaded, kind,
                            lambda v, _r=real, _k=kind: calls.append(_k) or _r(v))
    y = fn(x)
    assert calls and y.dtype == mx.float32
    with native.disabled():
        want = fn(x)  # MLX's
    assert len(calls) == 1
    np.testing.assert_allclose(np64(y), np64(want), rtol=1e-5, atol=1e-6)
    assert kernels.sigmoid(mx.array([0.0], mx.float64)).dtype == mx.float64  # float64: MLX's


@pytest.mark.parametrize("fn", [fluxlike.sigmoid, fluxlike.tanh, fluxlike.swish],
                         ids=lambda f: f.__name__)
def test_the_activations_take_python_scalars_as_mlx_does(fn):
    got = fn(0.5)
    assert isinstance(got, mx.array) and got.dtype == mx.float32
    want = {"sigmoid": 1 / (1 + np.exp(-0.5)), "tanh": np.tanh(0.5),
            "swish": 0.5 / (1 + np.exp(-0.5))}[fn.__name__]
    assert got.item() == pytest.approx(want, rel=1e-6)


@needs_native
@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_recurrent_layers_train_the_same_on_the_native_passes(cell):
    model = fluxlike.Chain(getattr(fluxlike, cell)(8, 16), fluxlike.Dense(16, 4))
    x = mx.random.normal((3, 7, 8), key=mx.random.key(6))

    def step():
        loss, (g,) = fluxlike.withgradient(lambda m: (m(x) ** 2).mean(), model)
        mx.eval(loss, g)
        return loss, g

    loss, g = step()
    with native.disabled():
        loss0, g0 = step()
    assert loss.item() == pytest.approx(loss0.item(), rel=1e-5)
    from mlx.utils import tree_flatten
    for (k, a), (_, b) in zip(tree_flatten(g), tree_flatten(g0), strict=True):
        np.testing.assert_allclose(np64(a), np64(b), rtol=1e-4, atol=1e-6, err_msg=k)


@needs_native
def test_the_cross_entropy_and_log_softmaxes_take_the_native_passes(monkeypatch):
    from fluxlike.losses import logitcrossentropy
    x = mx.random.normal((16, 50), key=mx.random.key(7)) * 5
    labels = mx.random.randint(0, 50, (16,), key=mx.random.key(8))
    onehot = mx.eye(50)[labels]

    def results():
        return [logitcrossentropy(x, labels), logitcrossentropy(x, onehot),
                fluxlike.logsumexp(x), fluxlike.logsoftmax(x), fluxlike.softmax(x),
                mx.grad(lambda v: logitcrossentropy(v, labels))(x),
                mx.grad(lambda v: fluxlike.logsumexp(v).sum())(x)]

    calls = []
    for name in ("exp", "log_sum_exp"):  # (the log-sum-exps: tests/native/test_logsumexp.py)
        real = getattr(native.switch.loaded, name)
        monkeypatch.setattr(native.switch.loaded, name,
                            lambda *a, real=real, name=name: calls.append(name) or real(*a))
    got = results()
    assert len(calls) >= 4 and "log_sum_exp" in calls, calls
    with native.disabled():
        want = results()  # MLX's exp and softmax
    for a, b in zip(got, want, strict=True):  # (sums of exponentials in another order)
        np.testing.assert_allclose(np64(a), np64(b), rtol=1e-6, atol=5e-7)
    # exact for large magnitudes, as before (the maximum subtracted first)
    assert fluxlike.logsoftmax(mx.array([-1e5, -1e5])).tolist() == [-0.6931471824645996] * 2
