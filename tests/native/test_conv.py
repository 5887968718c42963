"""The native convolution primitives (fluxlike/native/ops.py: conv, conv_transpose;
native/src/conv.cpp) against float64 numpy and MLX's own kernels, with a fused ReLU.

Without the extension these tests skip with the reason ``native_info()`` gives. To run them
as if it were absent: ``FLUXLIKE_NATIVE=0 python -m pytest -q tests/native``.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import in_threads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_helpers import (
    DTYPES,
    LAYOUTS,
    assert_close,
    executed_kernels,
    float16_in_float32_kernels,
    needs_f16_kernels,
    needs_native,
    np64,
    rand,
)

from fluxlike import native
from fluxlike.activations import relu


def np_conv(x, w, stride, lo, hi, dil, groups):
    """float64 ``mx.conv_general`` (channels-last) and the scale ``|x| * |w|`` of its rounding."""
    import itertools

    x64 = np.pad(np64(x), [(0, 0), *zip(lo, hi, strict=True), (0, 0)])
    w64 = np64(w)
    k = x64.ndim - 2
    ig, og = w64.shape[-1], w64.shape[0] // groups
    kernel = w64.shape[1:-1]
    spatial = [(x64.shape[i + 1] - dil[i] * (kernel[i] - 1) - 1) // stride[i] + 1
               for i in range(k)]
    y = np.zeros((x64.shape[0], *spatial, w64.shape[0]))
    scale = np.zeros_like(y)
    for off in itertools.product(*(range(s) for s in kernel)):
        window = tuple(slice(off[i] * dil[i], off[i] * dil[i] + (spatial[i] - 1) * stride[i] + 1,
                             stride[i]) for i in range(k))
        patch = x64[(slice(None), *window, slice(None))]
        for g in range(groups):
            pg = patch[..., g * ig:(g + 1) * ig]
            wg = w64[(slice(g * og, (g + 1) * og), *off, slice(None))]
            y[..., g * og:(g + 1) * og] += pg @ wg.T
            scale[..., g * og:(g + 1) * og] += np.abs(pg) @ np.abs(wg).T
    return y, scale


CONV_CASES = [  # x shape, w shape, stride, (lo, hi), dilation, groups
    ((2, 9, 9, 4), (6, 3, 3, 4), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
    ((2, 9, 8, 4), (6, 3, 3, 2), (2, 1), ((0, 1), (1, 2)), (1, 2), 2),
    ((3, 11, 4), (8, 3, 1), (2,), ((1,), (0,)), (2,), 4),
    ((1, 5, 6, 7, 4), (3, 2, 3, 2, 4), (1, 2, 1), ((1, 0, 1), (0, 1, 1)), (1, 1, 2), 1),
    ((2, 7, 7, 3), (5, 1, 1, 3), (1, 1), ((0, 0), (0, 0)), (1, 1), 1),
    ((2, 10, 10, 8), (8, 3, 3, 1), (1, 1), ((1, 1), (1, 1)), (1, 1), 8),  # depthwise
]


def _mlx_conv(x, w, b, stride, pad, dil, groups):
    y = mx.conv_general(x, w, stride=list(stride), padding=(list(pad[0]), list(pad[1])),
                        kernel_dilation=list(dil), groups=groups)
    return y if b is None else y + b


def _native_conv(x, w, b, stride, pad, dil, groups):
    return native.conv(x, w, b, stride=stride, padding=pad, dilation=dil, groups=groups)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}*{c[1]}/g{c[5]}")
def test_conv_against_float64_and_mlx(dtype, case):
    xs, ws, stride, pad, dil, groups = case
    x, w, b = rand(xs, dtype), rand(ws, dtype), rand((ws[0],), dtype)
    y = _native_conv(x, w, b, stride, pad, dil, groups)
    exact, scale = np_conv(x, w, stride, *pad, dil, groups)
    exact, scale = exact + np64(b), scale + np.abs(np64(b))
    assert_close(y, exact, scale, dtype)
    theirs = _mlx_conv(x, w, b, stride, pad, dil, groups)
    assert theirs.dtype == y.dtype and theirs.shape == y.shape
    if dtype == mx.float32:
        np.testing.assert_allclose(np64(y), np64(theirs), rtol=0, atol=2e-5 * scale.max())


@needs_native
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}*{c[1]}/g{c[5]}")
def test_conv_gradients_and_jvp_against_mlx(case):
    xs, ws, stride, pad, dil, groups = case
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    c = rand(_mlx_conv(x, w, b, stride, pad, dil, groups).shape)

    def loss(f):
        return lambda x, w, b: (f(x, w, b, stride, pad, dil, groups) * c).sum()

    mine = mx.grad(loss(_native_conv), argnums=(0, 1, 2))(x, w, b)
    theirs = mx.grad(loss(_mlx_conv), argnums=(0, 1, 2))(x, w, b)
    for g, h, p in zip(mine, theirs, (x, w, b), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
        np.testing.assert_allclose(np.array(g), np.array(h), rtol=1e-4, atol=1e-4)
    tangents = (rand(xs), rand(ws), rand((ws[0],)))
    _, (jm,) = mx.jvp(lambda *a: _native_conv(*a, stride, pad, dil, groups), (x, w, b), tangents)
    tx, tw, tb = tangents  # MLX has no jvp for its convolution: the bilinear form by hand
    jt = (_mlx_conv(tx, w, None, stride, pad, dil, groups)
          + _mlx_conv(x, tw, None, stride, pad, dil, groups) + tb)
    np.testing.assert_allclose(np.array(jm), np.array(jt), rtol=1e-4, atol=1e-4)


@needs_native
def test_conv_gradients_by_finite_differences_and_second_order():
    xs, ws, stride, pad, dil, groups = CONV_CASES[1]
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    c = rand(_mlx_conv(x, w, b, stride, pad, dil, groups).shape)

    def f(x, w, b):
        return (_native_conv(x, w, b, stride, pad, dil, groups) * c).sum()

    for i, g in enumerate(mx.grad(f, argnums=(0, 1, 2))(x, w, b)):
        d = rand(g.shape)
        up, dn = [x, w, b], [x, w, b]
        up[i], dn[i] = up[i] + 1e-2 * d, dn[i] - 1e-2 * d
        numeric = (f(*up).item() - f(*dn).item()) / 2e-2
        analytic = (g * d).sum().item()
        assert abs(numeric - analytic) <= 2e-2 * (1 + abs(analytic)), (i, numeric, analytic)

    def second(conv):  # the backward primitives are differentiable too
        def inner(x, w):
            gx, gw = mx.grad(lambda x, w: (conv(x, w, None, stride, pad, dil, groups) * c).sum()
                             ** 2, argnums=(0, 1))(x, w)
            return (gx * gx).sum() + (gw * gw).sum()
        return mx.grad(inner, argnums=(0, 1))(x, w)

    for g, h in zip(second(_native_conv), second(_mlx_conv), strict=True):
        np.testing.assert_allclose(np.array(g), np.array(h), rtol=1e-3, atol=1e-2)


@needs_native
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(k=st.integers(1, 2), n=st.integers(1, 3), size=st.integers(3, 9),
       ksize=st.integers(1, 3), groups=st.sampled_from([1, 2, 3]), cig=st.integers(1, 3),
       cog=st.integers(1, 3), stride=st.integers(1, 3), lo=st.integers(0, 2),
       hi=st.integers(0, 2), dil=st.integers(1, 2), layout=st.sampled_from(LAYOUTS[:3]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_conv_random_shapes_and_layouts(k, n, size, ksize, groups, cig, cog, stride, lo, hi,
                                        dil, layout, dtype, seed):
    mx.random.seed(seed)
    if size + lo + hi - dil * (ksize - 1) - 1 < 0:
        return
    xs = (n, *([size] * k), groups * cig)
    x = rand(xs, dtype)
    if layout == "transposed":  # the same values through a transposed view
        x = rand(xs[::-1], dtype).transpose(*range(x.ndim - 1, -1, -1))
    elif layout == "sliced rows":
        x = rand((n, *([size] * k), groups * cig + 2), dtype)[..., 1:-1]
    w = rand((groups * cog, *([ksize] * k), cig), dtype)
    args = ((stride,) * k, ((lo,) * k, (hi,) * k), (dil,) * k, groups)
    y = _native_conv(x, w, None, *args)
    exact, scale = np_conv(x, w, args[0], *args[1], args[2], groups)
    assert_close(y, exact, scale, dtype)


@needs_native
@pytest.mark.parametrize("shapeless", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_inside_compile(shapeless, dtype):
    w, b = rand((4, 3, 3, 2), dtype), rand((4,), dtype)

    def loss(w, b, x):
        y = native.conv(x, w, b, padding=1, stride=(2, 1))
        return mx.maximum(y, 0).astype(mx.float32).sum()

    step = mx.compile(mx.value_and_grad(loss, argnums=(0, 1)), shapeless=shapeless)
    eager = mx.value_and_grad(loss, argnums=(0, 1))
    for batch in (2, 1, 3):
        x = rand((batch, 6, 5, 2), dtype)
        (v, g), (v0, g0) = step(w, b, x), eager(w, b, x)
        assert v.item() == pytest.approx(v0.item(), rel=1e-5 if dtype == mx.float32 else 1e-2)
        for gi, hi in zip(g, g0, strict=True):
            assert gi.shape == hi.shape and gi.dtype == hi.dtype
            np.testing.assert_allclose(np64(gi), np64(hi), rtol=1e-5, atol=1e-5)


@needs_native
def test_conv_from_several_threads_and_cache():
    from fluxlike_native import _ext

    def work(k: int) -> None:
        dtype = DTYPES[k % 2]
        for _ in range(4):
            x, w = rand((2, 8 + k, 8, 3), dtype), rand((5, 3, 3, 3), dtype)
            y = native.conv(x, w, padding=1)
            gw = mx.grad(lambda w, x=x: native.conv(x, w, padding=1).astype(
                mx.float32).sum())(w)
            mx.eval(y, gw)
            exact, scale = np_conv(x, w, (1, 1), (1, 1), (1, 1), (1, 1), 1)
            assert_close(y, exact, scale, dtype)
            assert gw.shape == w.shape and gw.dtype == dtype

    _ext.clear_cache()
    in_threads(work, 4)
    _ext.wait_for_creations()  # (from a shape's third use, made on the worker thread)
    assert _ext.conv_cache_size() == 4 * 2  # one forward and one weights-gradient per shape
    assert sum(count for _, count in _ext.conv_cache_impls()) == 8


@needs_native
def test_conv_errors_and_empty():
    x, w = mx.ones((1, 5, 5, 4)), mx.ones((6, 3, 3, 4))
    with pytest.raises(ValueError, match=r"fluxlike\.native\.conv.*channels do not match"):
        native.conv(x, mx.ones((6, 3, 3, 3)))
    with pytest.raises(ValueError, match=r"larger than the padded input"):
        native.conv(x, mx.ones((6, 7, 7, 4)))
    with pytest.raises(ValueError, match=r"stride must be an int or 2 ints"):
        native.conv(x, w, stride=(1, 2, 3))
    with pytest.raises(ValueError, match=r"must both be float32, both bfloat16 or both float16"):
        native.conv(x, w.astype(mx.bfloat16))
    empty = native.conv(mx.zeros((0, 5, 5, 4)), w, mx.ones((6,)))
    assert empty.shape == (0, 3, 3, 6)


TRANSPOSE_CASES = [  # x shape, w shape, stride, padding, dilation, output_padding, groups
    ((2, 5, 4), (3, 3, 4), 2, 0, 1, 0, 1),
    ((2, 5, 5, 4), (6, 3, 3, 2), 2, 1, 1, 1, 2),
    ((1, 4, 3, 5, 2), (3, 2, 3, 2, 2), (1, 2, 1), (0, 1, 0), (1, 1, 2), (0, 1, 0), 1),
    ((2, 6, 6, 4), (4, 3, 3, 4), 1, 1, 2, 0, 1),
]


def _mlx_conv_transpose(x, w, b, stride, padding, dilation, output_padding, groups):
    k = x.ndim - 2
    fn = {1: mx.conv_transpose1d, 2: mx.conv_transpose2d, 3: mx.conv_transpose3d}[k]

    def one(t):
        return t if k > 1 or isinstance(t, int) else t[0]

    y = fn(x, w, stride=one(stride), padding=one(padding), dilation=one(dilation),
           output_padding=one(output_padding), groups=groups)
    return y if b is None else y + b


def _native_conv_transpose(x, w, b, stride, padding, dilation, output_padding, groups):
    return native.conv_transpose(x, w, b, stride=stride, padding=padding, dilation=dilation,
                                 output_padding=output_padding, groups=groups)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=lambda c: f"{c[0]}*{c[1]}")
def test_conv_transpose_against_mlx_and_its_gradients(dtype, case):
    xs, ws, *options = case
    x, w, b = rand(xs, dtype), rand(ws, dtype), rand((ws[0],), dtype)
    y = _native_conv_transpose(x, w, b, *options)
    up = [a.astype(mx.float32) for a in (x, w, b)]
    theirs = _mlx_conv_transpose(*up, *options)
    assert y.dtype == dtype and y.shape == theirs.shape
    tol = 1e-5 if dtype == mx.float32 else 3e-2
    np.testing.assert_allclose(np64(y), np.array(theirs), rtol=tol, atol=tol * 10)
    c = rand(theirs.shape)
    mine = mx.grad(lambda *a: (_native_conv_transpose(*a, *options).astype(mx.float32) * c)
                   .sum(), argnums=(0, 1, 2))(x, w, b)
    ref = mx.grad(lambda *a: (_mlx_conv_transpose(*a, *options) * c).sum(),
                  argnums=(0, 1, 2))(*up)
    for g, h, p in zip(mine, ref, (x, w, b), strict=True):
        assert g.shape == p.shape and g.dtype == dtype
        np.testing.assert_allclose(np64(g), np.array(h), rtol=tol * 10, atol=tol * 30)


@needs_native
def test_conv_transpose_compiled_and_errors():
    w = rand((4, 3, 3, 2))
    f = mx.compile(mx.grad(lambda w, x: native.conv_transpose(x, w, stride=2).sum()),
                   shapeless=True)
    for batch in (1, 3):
        x = rand((batch, 4, 4, 2))
        expected = mx.grad(lambda w, x=x: _mlx_conv_transpose(x, w, None, 2, 0, 1, 0, 1).sum())(w)
        np.testing.assert_allclose(np.array(f(w, x)), np.array(expected), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"output_padding must be >= 0 and smaller than"):
        native.conv_transpose(rand((1, 4, 4, 2)), w, stride=2, output_padding=2)
    with pytest.raises(ValueError, match=r"conv_transpose: channels do not match"):
        native.conv_transpose(rand((1, 4, 4, 3)), w)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CONV_CASES[:4], ids=lambda c: f"{c[0]}*{c[1]}/g{c[5]}")
def test_conv_fused_relu(dtype, case):
    """act=relu is fused: max(conv + b, 0) as float64 gives it (one rounding), its
    gradients and jvp as MLX's conv followed by a ReLU, its output dtype the operands'."""
    xs, ws, stride, pad, dil, groups = case
    x, w, b = rand(xs, dtype), rand(ws, dtype), rand((ws[0],), dtype)

    def fused(x, w, b):
        return native.conv(x, w, b, stride=stride, padding=pad, dilation=dil, groups=groups,
                           act=relu)

    def plain(x, w, b):
        return nn.relu(_mlx_conv(x, w, b, stride, pad, dil, groups))

    y = fused(x, w, b)
    exact, scale = np_conv(x, w, stride, *pad, dil, groups)
    exact, scale = np.maximum(exact + np64(b), 0), scale + np.abs(np64(b))
    assert_close(y, exact, scale, dtype)
    if dtype != mx.float32:
        return
    c = rand(y.shape)
    mine = mx.grad(lambda *a: (fused(*a) * c).sum(), argnums=(0, 1, 2))(x, w, b)
    theirs = mx.grad(lambda *a: (plain(*a) * c).sum(), argnums=(0, 1, 2))(x, w, b)
    for g, h in zip(mine, theirs, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(h), rtol=1e-4, atol=1e-4)
    tangents = (rand(xs), rand(ws), rand((ws[0],)))
    _, (jm,) = mx.jvp(fused, (x, w, b), tangents)
    tx, tw, tb = tangents
    lin = (_mlx_conv(tx, w, None, stride, pad, dil, groups)
           + _mlx_conv(x, tw, None, stride, pad, dil, groups) + tb)
    np.testing.assert_allclose(np.array(jm), np.array(lin * (y > 0)), rtol=1e-4, atol=1e-4)
    other = native.conv(x, w, b, stride=stride, padding=pad, dilation=dil, groups=groups,
                        act=mx.tanh)  # any other function: applied to the result
    np.testing.assert_allclose(np.array(other), np.tanh(np.array(
        _mlx_conv(x, w, b, stride, pad, dil, groups))), rtol=1e-4, atol=1e-4)


@needs_native
@pytest.mark.parametrize("shapeless", [False, True])
def test_conv_fused_relu_inside_compile_bfloat16(shapeless):
    w, b = rand((4, 3, 3, 2), mx.bfloat16), rand((4,), mx.bfloat16)

    def loss(w, b, x):
        return native.conv(x, w, b, padding=1, act="relu").astype(mx.float32).sum()

    step = mx.compile(mx.value_and_grad(loss, argnums=(0, 1)), shapeless=shapeless)
    eager = mx.value_and_grad(loss, argnums=(0, 1))
    for batch in (2, 3):
        x = rand((batch, 6, 5, 2), mx.bfloat16)
        (v, g), (v0, g0) = step(w, b, x), eager(w, b, x)
        assert v.item() == pytest.approx(v0.item(), rel=1e-2)
        for gi, hi in zip(g, g0, strict=True):
            assert gi.dtype == mx.bfloat16 and gi.shape == hi.shape
            np.testing.assert_array_equal(np64(gi), np64(hi))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_convolutions_fused_relu_keeps_nan(dtype):
    """As the matmul's: relu(NaN) is NaN (oneDNN's ReLU post-op would give 0)."""
    x = mx.ones((1, 4, 4, 2), dtype)
    x[0, 1, 1, 0] = float("nan")
    w = mx.ones((3, 3, 3, 2), dtype)
    y = np64(native.conv(x, w, mx.zeros((3,), dtype), padding=1, act="relu"))
    reached = np.zeros((4, 4), bool)
    reached[0:3, 0:3] = True  # the outputs whose 3x3 window holds x[1, 1]
    assert np.isnan(y[0]).any(axis=-1).tolist() == reached.tolist()
    assert (y[0][~reached] > 0).all()


# ---- bfloat16 in float32 kernels: one primitive upcasting its operands while it runs -----------

def _upcast_conv(x, w, b, stride, pad, dil, groups, relu_=False, upcast=True):
    """The convolution with native_bf16=False (upcast: one node), or spelled as the graph it
    replaces (exact float32 upcasts, the float32 primitive, one rounding)."""
    from fluxlike_native import _ext
    args = (list(stride), list(pad[0]), list(pad[1]), list(dil), groups, False)
    if upcast:
        return _ext.conv(x, w, b, *args, relu=relu_)
    up = [None if t is None else t.astype(mx.float32) for t in (x, w, b)]
    return _ext.conv(*up, *args, relu=relu_).astype(x.dtype)


@needs_native
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}*{c[1]}/g{c[5]}")
@pytest.mark.parametrize("bias", [None, "half", mx.float32], ids=str)
@pytest.mark.parametrize("relu_", [False, True])
@pytest.mark.parametrize("half", [mx.bfloat16, mx.float16], ids=str)
def test_half_upcast_is_the_float32_convolution_rounded_once_bit_for_bit(case, bias, relu_,
                                                                          half):
    """float16, and bfloat16 with native_bf16=False: the result and each gradient (the
    input's, through the transposed convolution; the weight's; the bias's) are exactly those
    of astype, the float32 primitive and astype."""
    with float16_in_float32_kernels():
        xs, ws, stride, pad, dil, groups = case
        x, w = rand(xs, half), rand(ws, half)
        b = None if bias is None else rand((ws[0],), half if bias == "half" else bias)
        y = _upcast_conv(x, w, b, stride, pad, dil, groups, relu_)
        ref = _upcast_conv(x, w, b, stride, pad, dil, groups, relu_, upcast=False)
        assert y.dtype == ref.dtype == half
        np.testing.assert_array_equal(np64(y), np64(ref))
        c = rand(y.shape, half)
        args = [x, w] + ([] if b is None else [b])

        def grads(upcast):
            return mx.grad(lambda *t: (_upcast_conv(*t, *([None] if b is None else []), stride, pad,
                                                    dil, groups, relu_, upcast) * c)
                           .astype(mx.float32).sum(), argnums=list(range(len(args))))(*args)

        for g, r in zip(grads(True), grads(False), strict=True):
            assert g.dtype == r.dtype
            np.testing.assert_array_equal(np64(g), np64(r))


@needs_native
@pytest.mark.parametrize("case", CONV_CASES[:2], ids=lambda c: f"{c[0]}*{c[1]}/g{c[5]}")
@pytest.mark.parametrize("half", [mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("relu_", [False, True])
def test_half_upcast_convolution_jvp_sums_its_tangents_once(case, half, relu_):
    """The tangent of an upcast convolution with respect to several inputs: each part a
    float32 convolution of the exact upcasts, summed in float32 and rounded once, as the casts
    give it (not each part rounded first)."""
    with float16_in_float32_kernels():
        xs, ws, stride, pad, dil, groups = case
        x, w, b = rand(xs, half), rand(ws, half), rand((ws[0],), half)
        tangents = [rand(xs, half), rand(ws, half), rand((ws[0],), half)]
        _, (mine,) = mx.jvp(lambda *t: _upcast_conv(*t, stride, pad, dil, groups, relu_),
                            [x, w, b], tangents)
        _, (theirs,) = mx.jvp(lambda *t: _upcast_conv(*t, stride, pad, dil, groups, relu_,
                                                      upcast=False), [x, w, b], tangents)
        assert mine.dtype == theirs.dtype == half
        np.testing.assert_array_equal(np64(mine), np64(theirs))


@needs_native
def test_bfloat16_upcast_convolution_has_no_cast_nodes_and_runs_in_compile():
    from fluxlike_native import _ext
    x, w = rand((2, 6, 6, 4), mx.bfloat16), rand((3, 3, 3, 4), mx.bfloat16)
    mx.eval(x, w)
    args = ([1, 1], [1, 1], [1, 1], [1, 1], 1, False)
    y = _ext.conv(x, w, None, *args)
    path = Path(tempfile.mkdtemp()) / "graph.dot"
    mx.export_to_dot(str(path), y)
    nodes = re.findall(r'label ="?([A-Za-z]+)', path.read_text())
    assert nodes.count("FluxlikeNativeConv") == 1 and "AsType" not in nodes, nodes
    f = mx.compile(lambda x: _ext.conv(x, w, None, *args))
    np.testing.assert_array_equal(np64(f(x)), np64(y))
    dx = _ext.conv_backward_data(y, w, list(x.shape[1:]), [1, 1], [1, 1], [1, 1], [1, 1], 1,
                                 False)
    ref = _ext.conv_backward_data(y.astype(mx.float32), w.astype(mx.float32),
                                  list(x.shape[1:]), [1, 1], [1, 1], [1, 1], [1, 1], 1, False)
    np.testing.assert_array_equal(np64(dx), np64(ref.astype(mx.bfloat16)))


# ---- bfloat16 of an odd channel count: a zero channel more inside the primitive ---------------

@needs_native
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("case", [((2, 7, 7), (5, 3, 3), 1, 1), ((3, 9), (4, 4), 2, 2),
                                  ((2, 4, 5, 4), (3, 2, 3, 2), 1, 0)], ids=str)
def test_a_bfloat16_convolution_of_odd_channels_is_the_one_with_a_zero_channel_more(case,
                                                                                    channels):
    """x and w given a zero channel more (an even count, which oneDNN's bfloat16 kernels read in
    pairs) by the primitive itself: the output and both gradients are, bit for bit, those of
    the convolution of explicitly padded operands (without their last channel), from the same
    cached primitive - bfloat16 kernels, not float32 ones."""
    from fluxlike_native import _ext
    if not _ext.isa_has_bf16():
        pytest.skip("no bfloat16 kernels on this CPU: every bfloat16 convolution, odd channels "
                    "or not, runs in float32 kernels")
    xs, ws, stride, pad = case
    mx.random.seed(channels)
    x = mx.random.normal((*xs, channels)).astype(mx.bfloat16)
    w = mx.random.normal((*ws, channels)).astype(mx.bfloat16)
    g = mx.random.normal(native.conv(x, w, stride=stride, padding=pad).shape).astype(mx.bfloat16)

    def widened(t):
        return mx.concatenate([t, mx.zeros((*t.shape[:-1], 1), t.dtype)], axis=-1)

    def run(x, w):  # the output and its gradients with respect to x and w
        def f(x, w):
            return native.conv(x, w, stride=stride, padding=pad, act="relu")

        y, vjp = mx.vjp(f, [x, w], [g])
        return [y[0], *vjp]

    mx.eval(x, w, g, widened(x), widened(w))
    _ext.clear_cache()
    odd = run(x, w)
    mx.eval(odd)
    made = _ext.cache_info()["ops"]["conv"]["creations"]
    even = run(widened(x), widened(w))
    mx.eval(even)
    assert _ext.cache_info()["ops"]["conv"]["creations"] == made  # the same primitives
    np.testing.assert_array_equal(np64(odd[0]), np64(even[0]))
    for a, b in zip(odd[1:], even[1:], strict=True):
        assert a.shape[-1] == channels and a.dtype == mx.bfloat16
        np.testing.assert_array_equal(np64(a), np64(b[..., :channels]))


@needs_native
@needs_f16_kernels
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}*{c[1]}/g{c[5]}")
def test_float16_convolutions_in_float16_kernels(case):
    """With oneDNN's float16 kernels (AVX512-FP16) a float16 convolution and its data gradient
    run on them (the weight gradient in float32 kernels): the values the float32 kernels give
    to the order of the float32 sums, gradients too."""
    xs, ws, stride, pad, dil, groups = case
    x, w, b = rand(xs, mx.float16), rand(ws, mx.float16), rand((ws[0],), mx.float16)

    def f(x, w, b):
        return _upcast_conv(x, w, b, stride, pad, dil, groups, True)

    c = rand(f(x, w, b).shape, mx.float16)

    def run():
        grads = mx.grad(lambda *t: (f(*t) * c).astype(mx.float32).sum(), argnums=(0, 1, 2))(
            x, w, b)
        return [f(x, w, b), *grads]

    mine = run()
    with float16_in_float32_kernels():
        theirs = run()
    for got, want in zip(mine, theirs, strict=True):
        assert got.dtype == want.dtype == mx.float16
        np.testing.assert_allclose(np64(got), np64(want), rtol=2**-9, atol=2**-9)


@needs_native
@needs_f16_kernels
def test_float16_convolutions_never_run_onednns_reference_kernel():
    """oneDNN 3.2 gives a float16 weight gradient, and a grouped or 3-D float16 data gradient,
    only its reference implementation (~100x slower): those run in float32 kernels, the rest
    on its float16 ones (every convolution executed, as ONEDNN_VERBOSE lists it)."""
    code = f"""
        import mlx.core as mx
        from fluxlike_native import _ext
        for xs, ws, stride, pad, dil, groups in {CONV_CASES!r}:
            x, w = mx.random.normal(xs).astype(mx.float16), mx.random.normal(ws).astype(mx.float16)
            b = mx.random.normal((ws[0],)).astype(mx.float16)
            def f(x, w, b):
                return _ext.conv(x, w, b, list(stride), list(pad[0]), list(pad[1]), list(dil),
                                 groups, False)
            mx.eval(f(x, w, b), mx.grad(lambda *t: f(*t).astype(mx.float32).sum(),
                                        argnums=(0, 1, 2))(x, w, b))
    """
    executed = executed_kernels(code, "convolution")
    assert "brgconv:avx512_core_fp16" in executed
    assert not [impl for impl in executed if impl.startswith("ref")], executed
