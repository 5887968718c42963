"""The native max pooling primitive (fluxlike/native/ops.py: max_pool; native/src/pool.cpp)
against float64 numpy and MLX's own ops.

Without the extension these tests skip with the reason ``native_info()`` gives. To run them
as if it were absent: ``FLUXLIKE_NATIVE=0 python -m pytest -q tests/native``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import in_threads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_helpers import (
    BF16_HALF_ULP,
    DTYPES,
    LAYOUTS,
    needs_native,
    np64,
    rand,
)

from fluxlike import native


def np_max_pool(x, kernel, stride, lo, hi):
    """float64 max pooling (channels last, padding never the maximum) and, per input entry,
    how many outputs pick it as their window's first maximum (the gradient of a sum)."""
    import itertools

    x64 = np64(x)
    padded = np.pad(x64, [(0, 0), *zip(lo, hi, strict=True), (0, 0)], constant_values=-np.inf)
    k = x64.ndim - 2
    out = [(padded.shape[i + 1] - kernel[i]) // stride[i] + 1 for i in range(k)]
    y = np.full((x64.shape[0], *out, x64.shape[-1]), -np.inf)
    for off in itertools.product(*(range(s) for s in kernel)):
        window = tuple(slice(off[i], off[i] + (out[i] - 1) * stride[i] + 1, stride[i])
                       for i in range(k))
        y = np.maximum(y, padded[(slice(None), *window, slice(None))])
    return y


def _pool_grad_first_max(x, c, kernel, stride, lo, hi):
    """The gradient of ``sum(max_pool(x) * c)`` when each window's cotangent goes to its
    first maximum (in window order), in float64."""
    import itertools

    x64 = np64(x)
    padded = np.pad(x64, [(0, 0), *zip(lo, hi, strict=True), (0, 0)], constant_values=-np.inf)
    k = x64.ndim - 2
    c64 = np64(c)
    grad = np.zeros_like(padded)
    for n in range(x64.shape[0]):
        for o in itertools.product(*(range(s) for s in c64.shape[1:-1])):
            for ch in range(x64.shape[-1]):
                best, where = -np.inf, None
                for off in itertools.product(*(range(s) for s in kernel)):
                    pos = tuple(o[i] * stride[i] + off[i] for i in range(k))
                    v = padded[(n, *pos, ch)]
                    if v > best:
                        best, where = v, pos
                grad[(n, *where, ch)] += c64[(n, *o, ch)]
    crop = tuple(slice(lo[i], lo[i] + x64.shape[i + 1]) for i in range(k))
    return grad[(slice(None), *crop, slice(None))]


# A gradient entry is its windows' cotangents summed in float32 (rounded once to bfloat16).
POOL_GRAD_TOL = {mx.float32: {"rtol": 1e-5, "atol": 1e-6},
                 mx.bfloat16: {"rtol": BF16_HALF_ULP * 1.01, "atol": 1e-5},
                 mx.float16: {"rtol": 2.0**-11 * 1.01, "atol": 1e-5}}
# float16 runs through float32 kernels (exact casts around them): MLX's own float16 pooling is
# ten times slower
ALL_DTYPES = [*DTYPES, mx.float16]


POOL_CASES = [  # x shape, window, stride, (lo, hi)
    ((2, 8, 8, 3), (2, 2), (2, 2), ((0, 0), (0, 0))),
    ((2, 9, 7, 4), (3, 3), (2, 1), ((1, 0), (1, 2))),
    ((3, 11, 5), (3,), (2,), ((1,), (1,))),
    ((1, 5, 6, 7, 2), (2, 3, 2), (1, 2, 2), ((1, 0, 1), (0, 1, 0))),
    ((2, 7, 7, 16), (2, 2), (2, 2), ((0, 0), (0, 0))),  # ragged end: the last row dropped
]


def _mlx_pool(x, window, stride, pad):
    """MLX's (fluxlike's pure-MLX) max pooling on the same arguments."""
    from fluxlike.layers.pooling import sliding_windows

    padded = mx.pad(x, [(0, 0), *zip(*pad, strict=True), (0, 0)], constant_values=-np.inf)
    return mx.max(sliding_windows(padded, window, stride),
                  axis=tuple(range(-len(window) - 1, -1)))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_operands_of_any_strides_are_gathered_when_the_kernel_runs(dtype):
    """Reversed, strided, broadcast and transposed-batch operands (no Contiguous op in the
    graph: the primitive copies what oneDNN cannot read): the same values as MLX's."""
    a, b = rand((2, 6, 8), dtype), rand((2, 8, 5), dtype)
    operands = [
        (a[:, ::-1], b), (a[:, ::2], b), (a, b[:, :, ::-1]), (mx.broadcast_to(a[:1], a.shape), b),
        (a.swapaxes(0, 1).swapaxes(0, 1)[..., ::-1], b[:, ::-1]),
    ]
    for x, y in operands:
        mine = native.matmul(x, y, out_dtype=mx.float32)
        theirs = x.astype(mx.float32) @ y.astype(mx.float32)
        np.testing.assert_allclose(np64(mine), np64(theirs), rtol=1e-5, atol=1e-5)
    g, y = rand((8, 6), dtype), rand((6, 8), dtype)
    mask = np64(y.T) > 0
    got = native.switch.loaded.relu_grad(g[::-1], y.T)
    np.testing.assert_array_equal(np64(got), np.where(mask, np64(g[::-1]), 0))


@needs_native
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"{c[0]}/{c[1]}s{c[2]}")
def test_max_pool_against_float64_and_mlx(dtype, case):
    xs, window, stride, pad = case
    x = rand(xs, dtype)
    y = native.max_pool(x, window, stride=stride, padding=pad)
    assert y.dtype == dtype
    np.testing.assert_array_equal(np64(y), np_max_pool(x, window, stride, *pad))
    theirs = _mlx_pool(x, window, stride, pad)
    assert theirs.dtype == y.dtype and theirs.shape == y.shape
    np.testing.assert_array_equal(np64(y), np64(theirs))


@needs_native
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"{c[0]}/{c[1]}s{c[2]}")
def test_max_pool_gradient(dtype, case):
    """The gradient goes to each window's first maximum (exactly, in the input's dtype); on
    inputs without ties it equals MLX's."""
    xs, window, stride, pad = case
    x = rand(xs, dtype)
    c = rand(native.max_pool(x, window, stride=stride, padding=pad).shape, dtype)
    g = mx.grad(lambda v: (native.max_pool(v, window, stride=stride, padding=pad) * c)
                .astype(mx.float32).sum())(x)
    assert g.dtype == dtype and g.shape == x.shape
    np.testing.assert_allclose(np64(g), _pool_grad_first_max(x, c, window, stride, *pad),
                               **POOL_GRAD_TOL[dtype])
    x32 = rand(xs)  # float32 normals: no ties
    c32 = rand(c.shape)
    mine = mx.vjp(lambda v: native.max_pool(v, window, stride=stride, padding=pad), [x32],
                  [c32])[1][0]
    theirs = mx.vjp(lambda v: _mlx_pool(v, window, stride, pad), [x32], [c32])[1][0]
    # (overlapping windows add their cotangents in another order: float32 rounding apart)
    np.testing.assert_allclose(np.array(mine), np.array(theirs), rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"{c[0]}/{c[1]}s{c[2]}")
def test_max_pool_jvp_and_second_order_against_mlx(case):
    """The forward-mode derivative (the tangent at each window's maximum) and the gradient's
    own gradients equal MLX's on inputs without ties."""
    xs, window, stride, pad = case
    x, t = rand(xs), rand(xs)

    def pool(v):
        return native.max_pool(v, window, stride=stride, padding=pad)

    def theirs(v):
        return _mlx_pool(v, window, stride, pad)

    _, (jm,) = mx.jvp(pool, [x], [t])
    _, (jt,) = mx.jvp(theirs, [x], [t])
    np.testing.assert_array_equal(np.array(jm), np.array(jt))
    c = rand(pool(x).shape)

    def second(f):  # d/dc and d/dx of |grad_x sum(f(x * x) * c)|^2
        def inner(v, c):
            g = mx.grad(lambda u: (f(u * u) * c).sum())(v)
            return (g * g).sum()
        return mx.grad(inner, argnums=(0, 1))(x, c)

    for g, h in zip(second(pool), second(theirs), strict=True):
        np.testing.assert_allclose(np.array(g), np.array(h), rtol=1e-5, atol=1e-5)
    _, (jb,) = mx.jvp(lambda d: mx.vjp(pool, [x], [d])[1][0], [c], [c])
    np.testing.assert_allclose(np.array(jb), np.array(mx.vjp(theirs, [x], [c])[1][0]),
                               rtol=1e-6, atol=1e-6)


@needs_native
def test_max_pool_gradient_by_finite_differences():
    xs, window, stride, pad = POOL_CASES[1]
    # distinct values 1 apart: a step of 1e-2 never changes which entry is a window's maximum
    x = mx.array(np.random.default_rng(0).permutation(int(np.prod(xs))).reshape(xs) * 1.0,
                 dtype=mx.float32)
    c = rand(native.max_pool(x, window, stride=stride, padding=pad).shape)

    def f(v):
        return (native.max_pool(v, window, stride=stride, padding=pad) * c).sum()

    def f64(v):  # the pooling is exact: sum in float64, so only the step is rounded
        return float((np64(native.max_pool(v, window, stride=stride, padding=pad))
                      * np64(c)).sum())

    g = mx.grad(f)(x)
    for seed in range(3):
        d = mx.random.normal(xs, key=mx.random.key(seed))
        numeric = (f64(x + 1e-2 * d) - f64(x - 1e-2 * d)) / 2e-2
        analytic = (g * d).sum().item()
        assert abs(numeric - analytic) <= 1e-2 * (1 + abs(analytic)), (numeric, analytic)


@needs_native
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(k=st.integers(1, 3), n=st.integers(1, 3), size=st.integers(1, 9),
       window=st.integers(1, 3), stride=st.integers(1, 3), lo=st.integers(0, 2),
       hi=st.integers(0, 2), channels=st.integers(1, 5), layout=st.sampled_from(LAYOUTS[:3]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_max_pool_random_shapes_and_layouts(k, n, size, window, stride, lo, hi, channels,
                                            layout, dtype, seed):
    mx.random.seed(seed)
    if lo >= window or hi >= window or size + lo + hi < window:
        return
    xs = (n, *([size] * k), channels)
    x = rand(xs, dtype)
    if layout == "transposed":  # the same values through a transposed view
        x = rand(xs[::-1], dtype).transpose(*range(x.ndim - 1, -1, -1))
    elif layout == "sliced rows":
        x = rand((n, *([size] * k), channels + 2), dtype)[..., 1:-1]
    args = ((window,) * k, (stride,) * k, ((lo,) * k, (hi,) * k))
    y = native.max_pool(x, args[0], stride=args[1], padding=args[2])
    np.testing.assert_array_equal(np64(y), np_max_pool(x, *args[:2], *args[2]))
    c = rand(y.shape, dtype)
    g = mx.vjp(lambda v: native.max_pool(v, args[0], stride=args[1], padding=args[2]), [x],
               [c])[1][0]
    np.testing.assert_allclose(np64(g), _pool_grad_first_max(x, c, *args[:2], *args[2]),
                               **POOL_GRAD_TOL[dtype])


@needs_native
@pytest.mark.parametrize("shapeless", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_pool_inside_compile(shapeless, dtype):
    def loss(x, c):
        return (native.max_pool(x, 2) * c).astype(mx.float32).sum()

    step = mx.compile(mx.value_and_grad(loss), shapeless=shapeless)
    eager = mx.value_and_grad(loss)
    # (a shapeless trace replays at other batch sizes; the gradient's spatial size is fixed,
    # as the convolution's is)
    for batch, size in ((2, 8), (3, 8), (1, 8)):
        x = rand((batch, size, size, 3), dtype)
        c = rand((batch, size // 2, size // 2, 3), dtype)
        (v, g), (v0, g0) = step(x, c), eager(x, c)
        assert v.item() == pytest.approx(v0.item(), rel=1e-6)
        assert g.dtype == dtype and g.shape == x.shape
        np.testing.assert_array_equal(np64(g), np64(g0))


@needs_native
def test_max_pool_from_several_threads_and_cache():
    from fluxlike_native import _ext

    def work(k: int) -> None:
        dtype = DTYPES[k % 2]
        for _ in range(4):
            x = rand((2, 8 + 2 * k, 8, 3), dtype)
            y = native.max_pool(x, 2)
            g = mx.grad(lambda v: native.max_pool(v, 2).astype(mx.float32).sum())(x)
            mx.eval(y, g)
            np.testing.assert_array_equal(np64(y), np_max_pool(x, (2, 2), (2, 2),
                                                               (0, 0), (0, 0)))
            assert g.dtype == dtype and float(g.astype(mx.float32).sum()) == y.size

    _ext.clear_cache()
    in_threads(work, 4)
    _ext.wait_for_creations()  # (from a shape's third use, made on the worker thread)
    assert _ext.pool_cache_size() == 4 * 2  # one forward and one backward per shape
    assert sum(count for _, count in _ext.pool_cache_impls()) == 8


@needs_native
def test_max_pool_errors():
    x = mx.ones((1, 5, 5, 4))
    with pytest.raises(ValueError, match=r"fluxlike\.native\.max_pool.*bfloat16 or float16"):
        native.max_pool(x.astype(mx.int32), 2)
    with pytest.raises(ValueError, match=r"larger than the padded input"):
        native.max_pool(x, 7)
    with pytest.raises(ValueError, match=r"smaller than the kernel"):
        native.max_pool(x, 2, padding=2)
    with pytest.raises(ValueError, match=r"window must be an int or 2 ints"):
        native.max_pool(x, (2, 2, 2))
    with pytest.raises(ValueError, match=r"1-3 spatial axes"):
        native.max_pool(mx.ones((2, 3)), 2)
    with pytest.raises(ValueError, match=r"empty input"):
        native.max_pool(mx.ones((0, 4, 4, 1)), 2)


@needs_native
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_max_pool_keeps_nan_as_mlx_does(dtype):
    """A window holding NaN has a NaN maximum, as MLX's max and PyTorch's pooling give it
    (oneDNN's pooling alone drops it): overlapping windows, padding, 1-3 spatial axes."""
    for shape, window, stride, padding in [((1, 4, 4, 2), 2, 2, 0), ((2, 5, 5, 3), 3, 1, 1),
                                           ((1, 7, 2), 3, 2, 1), ((1, 3, 4, 4, 1), 2, 1, 0)]:
        x = np.ones(shape, np.float32)
        x.reshape(-1)[[1, x.size // 2, x.size - 1]] = np.nan
        xm = mx.array(x).astype(dtype)
        mine = np64(native.max_pool(xm, window, stride=stride, padding=padding))
        k = len(shape) - 2
        # reference: -inf padding, then MLX's max over the strided windows (NaN-propagating)
        pad = [(0, 0)] + [(padding, padding)] * k + [(0, 0)]
        xp = mx.array(np.pad(x, pad, constant_values=-np.inf)).astype(dtype)
        theirs = np64(getattr(nn, f"MaxPool{k}d")(window, stride)(xp))
        np.testing.assert_array_equal(np.isnan(mine), np.isnan(theirs))
        np.testing.assert_array_equal(np.nan_to_num(mine), np.nan_to_num(theirs))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_pool_of_minus_inf_windows_is_minus_inf(dtype):
    """A window of -inf has maximum -inf, as MLX's max gives it (oneDNN starts from the
    lowest finite value); a real lowest finite value stays."""
    inf, low = float("inf"), float(mx.finfo(dtype).min)
    x = mx.array([[-inf, -inf], [1, 2], [-inf, -inf], [low, -inf], [-inf, 5]], dtype)
    y = native.max_pool(x.reshape(1, 10, 1), 2)
    assert np64(y).reshape(-1).tolist() == [-inf, 2, -inf, low, 5]
    z = native.max_pool(mx.full((1, 3, 3, 1), -inf, dtype), 3, stride=1, padding=1)
    assert (np64(z) == -inf).all()


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_vmap_over_max_pool_jvp_and_second_order(dtype):
    """mx.vmap over the forward-mode derivative and the second derivative of the native max
    pooling (padded, overlapping windows): the same as member by member."""
    def pool(x):
        return native.max_pool(x, (3, 3), stride=(2, 2), padding=1)

    xs = mx.random.normal((3, 2, 9, 8, 4), key=mx.random.key(0)).astype(dtype)
    ts = mx.random.normal((3, 2, 9, 8, 4), key=mx.random.key(1)).astype(dtype)

    def jvp(x, t):
        return mx.jvp(pool, [x], [t])[1][0]

    def second(x):
        inner = mx.grad(lambda y: (pool(y).astype(mx.float32) ** 2).sum())
        return mx.grad(lambda y: (inner(y).astype(mx.float32) ** 2).sum())(x)

    for fn, args in ((jvp, (xs, ts)), (second, (xs,))):
        batched = mx.vmap(fn)(*args)
        for i in range(3):
            one = fn(*(a[i] for a in args))
            np.testing.assert_array_equal(np64(batched[i]), np64(one), err_msg=fn.__name__)
