"""The native matmul/linear primitive (fluxlike/native/ops.py: linear and matmul,
native/src/matmul.cpp) against float64 numpy and MLX's own kernels: values, layouts,
gradients, mx.compile, threads, the cache, the ISA fallback.

Tolerances (the documented numerics of fluxlike.native):
- float32: float32 accumulation, so ``|y - exact| <= 1e-5 * (|x| @ |w|.T + |b|)`` elementwise
  (a bound on the accumulated rounding for inner sizes up to a few thousand; MLX's own
  ``mx.matmul`` meets the same bound).
- bfloat16 result: the float32-accumulated result rounded once to bfloat16, so within half a
  bfloat16 ulp (at most 2**-8 relative) of the float32 result, plus the float32 bound.
Inputs are rounded to the dtype first, so the float64 reference sees the same operands.

Without the extension these tests skip with the reason ``native_info()`` gives. To run them
as if it were absent: ``FLUXLIKE_NATIVE=0 python -m pytest -q tests/native``.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

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
    _subprocess,
    assert_close,
    executed_kernels,
    float16_in_float32_kernels,
    laid_out,
    needs_f16_kernels,
    needs_native,
    np64,
    rand,
    reference,
)

from fluxlike import native
from fluxlike.activations import relu


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead", [(), (1,), (7,), (2, 3)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", [None, "relu"])
def test_linear_against_float64(dtype, lead, bias, act):
    x = rand((*lead, 37), dtype)
    w = rand((19, 37), dtype)
    b = rand((19,), dtype) if bias else None
    y = native.linear(x, w, b, act)
    exact, scale = reference(x, w, b, act == "relu")
    assert_close(y, exact, scale, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_against_mlx(dtype):
    x, w, b = rand((33, 64), dtype), rand((48, 64), dtype), rand((48,), dtype)
    y = native.linear(x, w, b)
    theirs = mx.addmm(b, x, w.T)
    assert y.dtype == theirs.dtype == dtype
    exact, scale = reference(x, w, b)
    assert_close(theirs, exact, scale, dtype)  # MLX meets the same bound ...
    if dtype == mx.float32:
        np.testing.assert_allclose(np64(y), np64(theirs), rtol=0, atol=2e-5 * scale.max())
    else:  # ... and in bfloat16 the two differ by at most one rounding step
        diff = np.abs(np64(y) - np64(theirs))
        assert (diff <= 2 * BF16_HALF_ULP * np.abs(exact) + 1e-5 * scale).all()
    mine = native.linear(x, w, None, relu)
    np.testing.assert_array_equal(np64(mine), np64(mx.maximum(native.linear(x, w), 0)))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", [None, mx.float32], ids=["own", "f32"])
def test_the_fused_relu_keeps_nan_as_mlx_does(dtype, out_dtype):
    """relu(NaN) is NaN, as MLX's maximum and PyTorch's relu give it (oneDNN's ReLU post-op
    gives 0, which would hide a diverged layer from a non-finite check); inf - inf is NaN;
    -0 and negatives are 0, +inf stays."""
    inf, nan = float("inf"), float("nan")
    x = mx.array([[nan, 1, 2], [inf, -inf, 0], [-1, -1, -1], [inf, 0, 0], [-0.0, 0, 0]],
                 dtype)
    w = mx.array([[1, 1, 1], [2, 0, 0]], dtype)
    y = native.linear(x, w, None, "relu", out_dtype=out_dtype)
    expected = mx.maximum(x.astype(mx.float32) @ w.astype(mx.float32).T, 0)
    got, want = np64(y), np64(expected)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))
    assert not np.signbit(got[~np.isnan(got)]).any()


@needs_native
def test_bfloat16_is_the_rounded_float32_accumulation():
    """bf16 x bf16 -> bf16 equals the bf16 x bf16 -> f32 result rounded to nearest even."""
    x, w, b = rand((64, 96), mx.bfloat16), rand((80, 96), mx.bfloat16), rand((80,), mx.bfloat16)
    y16 = native.linear(x, w, b, "relu")
    y32 = native.linear(x, w, b, "relu", out_dtype=mx.float32)
    assert y32.dtype == mx.float32 and y16.dtype == mx.bfloat16
    np.testing.assert_array_equal(np64(y16), np64(y32.astype(mx.bfloat16)))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("ashape", "bshape", "ta", "tb"), [
    ((5, 7), (7, 3), False, False),
    ((7, 5), (7, 3), True, False),
    ((7, 5), (3, 7), True, True),
    ((2, 4, 5, 7), (7, 3), False, False),
    ((2, 4, 5, 7), (2, 4, 6, 7), False, True),   # attention scores: q @ k.T
    ((2, 4, 5, 6), (2, 4, 6, 7), False, False),  # attention output: p @ v
    ((2, 1, 5, 7), (1, 3, 7, 4), False, False),  # broadcast batch axes
    ((3, 7, 5), (3, 7, 4), True, False),
    ((5, 7), (2, 7, 3), False, False),           # a broadcast over b's batch
])
def test_matmul_against_mlx_and_float64(dtype, ashape, bshape, ta, tb):
    a, b = rand(ashape, dtype), rand(bshape, dtype)
    y = native.matmul(a, b, transpose_a=ta, transpose_b=tb)
    at = a.swapaxes(-1, -2) if ta else a
    bt = b.swapaxes(-1, -2) if tb else b
    theirs = at @ bt
    assert y.shape == theirs.shape and y.dtype == theirs.dtype == dtype
    a64, b64 = np64(at), np64(bt)
    exact, scale = a64 @ b64, np.abs(a64) @ np.abs(b64)
    assert_close(y, exact, scale, dtype)
    if dtype == mx.float32:
        np.testing.assert_allclose(np64(y), np64(theirs), rtol=0, atol=2e-5 * scale.max())


@needs_native
def test_matmul_float32_output_of_bfloat16():
    a, b = rand((2, 3, 8, 16), mx.bfloat16), rand((2, 3, 8, 16), mx.bfloat16)
    s = native.matmul(a, b, transpose_b=True, out_dtype=mx.float32)
    assert s.dtype == mx.float32
    a64, b64 = np64(a), np64(b).swapaxes(-1, -2)
    assert_close(s, a64 @ b64, np.abs(a64) @ np.abs(b64), mx.float32)


@needs_native
def test_empty_operands():
    for x in (mx.zeros((0, 5)), mx.zeros((3, 0))):
        w, b = mx.ones((4, x.shape[1])), mx.ones((4,))
        y = native.linear(x, w, b, "relu")
        assert y.shape == (x.shape[0], 4) and y.dtype == mx.float32
        np.testing.assert_array_equal(np.array(y), np.ones((x.shape[0], 4)))


@needs_native
def test_errors_name_the_function_and_the_fix():
    x, w = mx.ones((2, 3)), mx.ones((4, 3))
    with pytest.raises(ValueError, match=r"fluxlike\.native\.linear.*one dtype.*astype"):
        native.linear(x, w.astype(mx.bfloat16))
    with pytest.raises(ValueError, match=r"float32, bfloat16 or float16, got int32"):
        native.linear(x.astype(mx.int32), w.astype(mx.int32))
    with pytest.raises(ValueError, match=r"inner dimensions differ.*3.*5"):
        native.linear(x, mx.ones((4, 5)))
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        native.linear(x, w, mx.ones((3,)))
    with pytest.raises(TypeError, match=r"fluxlike\.native\.linear: expected x to be an "):
        native.linear(np.ones((2, 3)), w)
    with pytest.raises(ValueError, match=r"act must be"):
        native.linear(x, w, act="gelu")
    with pytest.raises(ValueError, match=r"batch axes.*do not broadcast"):
        native.matmul(mx.ones((2, 3, 4)), mx.ones((3, 4, 5)))


@needs_native
def test_other_activations_are_applied_after():
    x, w = rand((6, 8)), rand((5, 8))
    y = native.linear(x, w, act=nn.gelu)
    np.testing.assert_allclose(np.array(y), np.array(nn.gelu(native.linear(x, w))), rtol=1e-6)


@needs_native
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(1, 40), inner=st.integers(1, 70), out=st.integers(1, 40),
       lead=st.sampled_from([(), (2,), (2, 3)]), xl=st.sampled_from(LAYOUTS),
       wl=st.sampled_from(LAYOUTS), dtype=st.sampled_from(DTYPES), bias=st.booleans(),
       act=st.sampled_from([None, "relu"]), seed=st.integers(0, 2**16))
def test_linear_random_shapes_and_layouts(rows, inner, out, lead, xl, wl, dtype, bias, act,
                                          seed):
    mx.random.seed(seed)
    x = laid_out(rand((rows, inner), dtype), xl)
    w = laid_out(rand((out, inner), dtype), wl)
    b = rand((out,), dtype) if bias else None
    if lead:
        x = mx.broadcast_to(x, (*lead, rows, inner)) if xl == "broadcast" else mx.stack(
            [x] * int(np.prod(lead))).reshape(*lead, rows, inner)
    y = native.linear(x, w, b, act)
    exact, scale = reference(x, w, b, act == "relu")
    assert_close(y, exact, scale, dtype)
    if dtype == mx.float32:
        theirs = x @ w.T + (b if bias else 0)
        theirs = mx.maximum(theirs, 0) if act else theirs
        np.testing.assert_allclose(np64(y), np64(theirs), rtol=0, atol=2e-5 * scale.max())


@needs_native
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.sampled_from([(1,), (3,), (2, 2), (2, 1)]), m=st.integers(1, 20),
       k=st.integers(1, 20), n=st.integers(1, 20), ta=st.booleans(), tb=st.booleans(),
       dtype=st.sampled_from(DTYPES), sliced=st.booleans(), seed=st.integers(0, 2**16))
def test_batched_matmul_random(batch, m, k, n, ta, tb, dtype, sliced, seed):
    mx.random.seed(seed)
    a = rand((*batch, k, m) if ta else (*batch, m, k), dtype)
    b = rand((*batch, n, k) if tb else (*batch, k, n), dtype)
    if sliced:  # a non-contiguous view of the same values
        a = mx.concatenate([a, a], axis=-1)[..., : a.shape[-1]]
    y = native.matmul(a, b, transpose_a=ta, transpose_b=tb)
    at = np64(a).swapaxes(-1, -2) if ta else np64(a)
    bt = np64(b).swapaxes(-1, -2) if tb else np64(b)
    assert_close(y, at @ bt, np.abs(at) @ np.abs(bt), dtype)


def _mlx_linear(x, w, b=None, act=None):
    y = x @ w.T if b is None else x @ w.T + b
    return mx.maximum(y, 0) if act else y


@needs_native
@pytest.mark.parametrize("lead", [(), (6,), (2, 3)], ids=str)
@pytest.mark.parametrize("act", [None, "relu"])
def test_gradients_against_mlx(lead, act):
    x, w, b = rand((*lead, 9)), rand((5, 9)), rand((5,))
    c = rand((*lead, 5))

    def loss(f):
        return lambda x, w, b: (f(x, w, b, act) * c).sum()

    mine = mx.grad(loss(native.linear), argnums=(0, 1, 2))(x, w, b)
    theirs = mx.grad(loss(_mlx_linear), argnums=(0, 1, 2))(x, w, b)
    for g, h, p in zip(mine, theirs, (x, w, b), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
        np.testing.assert_allclose(np.array(g), np.array(h), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("act", [None, "relu"])
def test_gradients_by_finite_differences(act):
    """Directional derivatives (central differences) against <grad, direction>."""
    x, w, b = rand((4, 6)), rand((3, 6)), rand((3,))
    c = rand((4, 3))

    def f(x, w, b):
        return (native.linear(x, w, b, act) * c).sum()

    grads = mx.grad(f, argnums=(0, 1, 2))(x, w, b)
    for i, g in enumerate(grads):
        d = rand(g.shape)
        eps = 1e-2 if act is None else 1e-4  # small steps do not cross ReLU's kink
        args_up = [x, w, b]
        args_dn = [x, w, b]
        args_up[i] = args_up[i] + eps * d
        args_dn[i] = args_dn[i] - eps * d
        numeric = (f(*args_up).item() - f(*args_dn).item()) / (2 * eps)
        analytic = (g * d).sum().item()
        assert abs(numeric - analytic) <= 2e-2 * (1 + abs(analytic)), (i, numeric, analytic)


@needs_native
def test_bfloat16_gradients():
    """Gradients of bfloat16 operands come back bfloat16 (float32 through an astype) and
    agree with float32 gradients of the same rounded operands to bfloat16 accuracy."""
    x, w, b = rand((8, 16)), rand((4, 16)), rand((4,))

    def loss(x, w, b):
        y = native.linear(x.astype(mx.bfloat16), w.astype(mx.bfloat16),
                          b.astype(mx.bfloat16), "relu")
        return y.astype(mx.float32).sum()

    g = mx.grad(loss, argnums=(0, 1, 2))(x, w, b)
    assert all(gi.dtype == mx.float32 for gi in g)
    xb, wb, bb = (a.astype(mx.bfloat16).astype(mx.float32) for a in (x, w, b))
    h = mx.grad(lambda x, w, b: _mlx_linear(x, w, b, True).sum(), argnums=(0, 1, 2))(xb, wb, bb)
    for gi, hi in zip(g, h, strict=True):
        np.testing.assert_allclose(np.array(gi), np.array(hi), rtol=2e-2, atol=2e-2)
    inner = mx.grad(lambda w: native.linear(x.astype(mx.bfloat16), w).sum())(
        w.astype(mx.bfloat16))
    assert inner.dtype == mx.bfloat16


@needs_native
@pytest.mark.parametrize("half", [mx.bfloat16, mx.float16], ids=str)
def test_an_operand_narrowed_from_float32_gets_the_float32_product_as_its_gradient(half):
    """Autocast's float32 weights reach a half-precision product through a cast: in oneDNN's
    kernels for the half dtype the product's gradient for such an operand is the
    float32-accumulated product itself, passed through the cast's gradient unchanged (not
    rounded to the half dtype and widened again), for the weight, its bias and a float32 input
    alike; a half operand that is not a cast (a half model's weight) still gets a half
    gradient. In float32 kernels (no AVX512-BF16 / AVX512-FP16, or FLUXLIKE_NATIVE_BF16 /
    FLUXLIKE_NATIVE_F16=float32) the gradient stays the rounded one, and so it does through
    MLX's ``astype``, whose gradient takes only its output's dtype."""
    from fluxlike.precision.castcache import convert
    x, w, b, ct = rand((48, 96)), rand((40, 96)), rand((40,)), rand((48, 40))
    xb, wb, cb = (t.astype(half) for t in (x, w, ct))

    def f(x, w, b):
        return native.linear(*(convert(t, half) for t in (x, w, b)))

    _, (dx, dw, db) = mx.vjp(f, [x, w, b], [cb])
    exact_dw = np64(cb).T @ np64(xb)  # the float64 products of the operands the kernel read
    exact_dx = np64(cb) @ np64(wb)
    assert dx.dtype == dw.dtype == db.dtype == mx.float32
    info = native.native_info()
    in_half_kernels = (info.bfloat16 if half == mx.bfloat16 else info.float16) == "native"
    for got, exact in ((dw, exact_dw), (dx, exact_dx), (db, np64(cb).sum(axis=0))):
        rounded = np.array(got.astype(half).astype(mx.float32))
        if in_half_kernels:
            np.testing.assert_allclose(np.array(got), exact, rtol=1e-5, atol=1e-5)
            assert (np.array(got) != rounded).mean() > 0.9  # not half-precision values
        else:
            np.testing.assert_array_equal(np.array(got), rounded)
            np.testing.assert_allclose(np.array(got), exact, rtol=2 ** -8, atol=1e-2)
    _, (through_astype,) = mx.vjp(lambda w: native.linear(xb, w.astype(half)), [w], [cb])
    np.testing.assert_array_equal(  # astype's gradient: the half dtype, widened
        np.array(through_astype), np.array(through_astype.astype(half).astype(mx.float32)))
    # a half parameter's own gradient: the half dtype, rounded once
    _, (own,) = mx.vjp(lambda w: native.linear(xb, w), [wb], [cb])
    assert own.dtype == half
    np.testing.assert_allclose(np.array(own.astype(mx.float32)), exact_dw, rtol=2 ** -8,
                               atol=1e-2)


@needs_native
@pytest.mark.parametrize("gdtype", [*DTYPES, mx.float16], ids=str)
@pytest.mark.parametrize("ydtype", [*DTYPES, mx.float16], ids=str)
def test_relu_grad_is_where_positive(gdtype, ydtype):
    """The fused ReLU's backward pass (one pass over bit patterns) is ``where(y > 0, g, 0)``
    exactly, signed zeros, infinities and NaNs of ``y`` included; its own gradients too."""
    from fluxlike_native import _ext

    y, g = rand((37, 29), ydtype), rand((37, 29), gdtype)
    y[0, :6] = mx.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan]).astype(ydtype)
    y = y.T  # a transposed view: made contiguous first
    g = g.T
    mask = _ext.relu_grad(g, y)
    expected = mx.where(y > 0, g, mx.array(0.0, gdtype))
    assert mask.dtype == gdtype and mx.array_equal(mask, expected).item()
    c = rand(g.shape, gdtype)
    _, (dg, dy) = mx.vjp(lambda g, y: _ext.relu_grad(g, y), [g, y], [c])
    assert mx.array_equal(dg, mx.where(y > 0, c, mx.array(0.0, gdtype))).item()
    assert not dy.any().item()
    _, (jg,) = mx.jvp(lambda g: _ext.relu_grad(g, y), [g], [c])
    assert mx.array_equal(jg, dg).item()


@needs_native
def test_second_order_through_the_ordered_backward_pass():
    """The backward pass computes the weight and bias gradients before the input's (an
    ordering node with its own gradients): a gradient of a gradient still matches MLX's."""
    x, w, b = rand((6, 5)), rand((4, 5)), rand((4,))

    def inner(fn):
        return lambda x, w: mx.grad(lambda x, w: (fn(x, w, b) ** 2).sum(), argnums=(0, 1))(
            x, w)

    def outer(fn):
        return mx.grad(lambda x, w: sum((g**2).sum() for g in inner(fn)(x, w)),
                       argnums=(0, 1))(x, w)

    mine = outer(lambda x, w, b: native.linear(x, w, b))
    theirs = outer(lambda x, w, b: _mlx_linear(x, w, b, False))
    for m, t in zip(mine, theirs, strict=True):
        np.testing.assert_allclose(np.array(m), np.array(t), rtol=1e-4, atol=1e-4)


@needs_native
@pytest.mark.parametrize(("ta", "tb"), [(False, False), (True, False), (False, True),
                                        (True, True)])
@pytest.mark.parametrize("batched", [False, True])
def test_matmul_gradients_and_jvp(ta, tb, batched):
    lead = (2, 3) if batched else ()
    a = rand((*lead, 6, 4) if ta else (*lead, 4, 6))
    b = rand((1, 3, 5, 6) if tb else (1, 3, 6, 5)) if batched else rand((5, 6) if tb else (6, 5))
    c = rand((*lead, 4, 5))

    def mlx_mm(a, b):
        return (a.swapaxes(-1, -2) if ta else a) @ (b.swapaxes(-1, -2) if tb else b)

    def mine(a, b):
        return native.matmul(a, b, transpose_a=ta, transpose_b=tb)

    g = mx.grad(lambda a, b: (mine(a, b) * c).sum(), argnums=(0, 1))(a, b)
    h = mx.grad(lambda a, b: (mlx_mm(a, b) * c).sum(), argnums=(0, 1))(a, b)
    for gi, hi, p in zip(g, h, (a, b), strict=True):
        assert gi.shape == p.shape
        np.testing.assert_allclose(np.array(gi), np.array(hi), rtol=1e-5, atol=1e-5)
    ta_, tb_ = rand(a.shape), rand(b.shape)
    _, jm = mx.jvp(mine, (a, b), (ta_, tb_))
    _, jt = mx.jvp(mlx_mm, (a, b), (ta_, tb_))
    np.testing.assert_allclose(np.array(jm[0]), np.array(jt[0]), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_jvp(dtype):
    x, w, b = rand((5, 7), dtype), rand((3, 7), dtype), rand((3,), dtype)
    tx, tw, tb = rand(x.shape, dtype), rand(w.shape, dtype), rand(b.shape, dtype)
    _, (mine,) = mx.jvp(lambda x, w, b: native.linear(x, w, b, "relu"), (x, w, b), (tx, tw, tb))
    up = [a.astype(mx.float32) for a in (x, w, b, tx, tw, tb)]
    _, (theirs,) = mx.jvp(lambda x, w, b: _mlx_linear(x, w, b, True), up[:3], up[3:])
    assert mine.dtype == dtype
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np64(mine), np.array(theirs), rtol=tol, atol=tol * 10)


@needs_native
@pytest.mark.parametrize("shapeless", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inside_compile(shapeless, dtype):
    w1, b1, w2 = rand((16, 8), dtype), rand((16,), dtype), rand((4, 16), dtype)

    def loss(w1, b1, w2, x):
        h = native.linear(x, w1, b1, "relu")
        return native.linear(h, w2).astype(mx.float32).sum()

    step = mx.compile(mx.value_and_grad(loss, argnums=(0, 1, 2)), shapeless=shapeless)
    eager = mx.value_and_grad(loss, argnums=(0, 1, 2))
    for rows in (5, 3, 9):  # new batch sizes: a shapeless trace is replayed
        x = rand((rows, 8), dtype)
        (v, g), (v0, g0) = step(w1, b1, w2, x), eager(w1, b1, w2, x)
        assert v.item() == pytest.approx(v0.item(), rel=1e-5 if dtype == mx.float32 else 1e-2)
        for gi, hi in zip(g, g0, strict=True):
            assert gi.shape == hi.shape and gi.dtype == hi.dtype
            np.testing.assert_allclose(np64(gi), np64(hi), rtol=1e-5, atol=1e-5)


@needs_native
def test_from_several_threads():
    shapes = [(8, 16, 4), (32, 64, 48), (5, 7, 3), (64, 128, 32)]

    def work(k: int) -> None:
        rows, inner, out = shapes[k % len(shapes)]
        dtype = DTYPES[k % 2]
        for _ in range(5):
            x, w, b = rand((rows, inner), dtype), rand((out, inner), dtype), rand((out,),
                                                                                  dtype)
            y = native.linear(x, w, b, "relu")
            gw = mx.grad(lambda w, x=x, b=b: native.linear(x, w, b).astype(
                mx.float32).sum())(w)
            mx.eval(y, gw)
            exact, scale = reference(x, w, b, True)
            assert_close(y, exact, scale, dtype)
            expected = np.broadcast_to(np64(x).sum(0), (out, inner))
            np.testing.assert_allclose(np64(gw), expected, rtol=2e-2, atol=2e-2 * rows)

    in_threads(work, 6)


@needs_native
def test_primitives_are_cached_by_shape_dtype_and_layout():
    from fluxlike_native import _ext

    mode = _ext.set_matmul_mode("primitive")  # (not oneDNN's GEMM without one: AVX2)
    try:
        _primitives_are_cached_by_shape_dtype_and_layout(_ext)
    finally:
        _ext.set_matmul_mode(mode)


def _primitives_are_cached_by_shape_dtype_and_layout(_ext: Any) -> None:
    _ext.clear_cache()
    x, w = rand((11, 13)), rand((17, 13))
    mx.eval(native.linear(x, w))
    assert _ext.cache_size() == 1
    mx.eval(native.linear(rand((11, 13)), rand((17, 13))))  # same description: reused
    assert _ext.cache_size() == 1
    mx.eval(native.linear(mx.array(np.array(x).T.copy()).T, w))  # column-major x: a new one
    assert _ext.cache_size() == 2
    mx.eval(native.linear(x.astype(mx.bfloat16), w.astype(mx.bfloat16)))
    # a bfloat16 primitive of its own where oneDNN has bfloat16 kernels; without them
    # (ONEDNN_MAX_CPU_ISA=AVX2) bfloat16 runs upcast in the float32 one already made
    expected = 3 if native.native_info().bfloat16 == "native" else 2
    assert _ext.cache_size() == expected
    names = dict(_ext.cache_impls())
    assert sum(names.values()) == expected


@needs_native
def test_bfloat16_on_avx2_runs_in_float32_kernels():
    """ONEDNN_MAX_CPU_ISA=AVX2 (no AVX-512, no BF16): bfloat16 still works, in float32 kernels,
    with bfloat16 numerics and gradients; decided when the op is built."""
    result = _subprocess("""
        import mlx.core as mx, numpy as np
        from fluxlike import native
        info = native.native_info()
        assert info.available and info.isa == "avx2" and info.bfloat16 == "float32 kernels", info
        x, w, b = (mx.random.normal(s).astype(mx.bfloat16) for s in ((9, 40), (12, 40), (12,)))
        y = native.linear(x, w, b, "relu")
        up = [a.astype(mx.float32) for a in (x, w, b)]
        ref = mx.maximum(up[0] @ up[1].T + up[2], 0).astype(mx.bfloat16)
        assert y.dtype == mx.bfloat16
        np.testing.assert_allclose(np.array(y.astype(mx.float32)),
                                   np.array(ref.astype(mx.float32)), rtol=2**-8, atol=1e-5)
        g = mx.grad(lambda w: native.linear(x, w, b, "relu").astype(mx.float32).sum())(w)
        assert g.dtype == mx.bfloat16 and g.shape == w.shape
        f = mx.compile(lambda x: native.linear(x, w, b), shapeless=True)
        assert f(x[:4]).shape == (4, 12) and f(x).dtype == mx.bfloat16
        s = native.matmul(x[None], x[None], transpose_b=True, out_dtype=mx.float32)
        c = native.conv(x.reshape(1, 9, 40, 1), w.reshape(12, 1, 40, 1)[:2, :, :3], padding=1)
        assert c.dtype == mx.bfloat16 and c.shape == (1, 11, 40, 2)
        gc = mx.grad(lambda x: native.conv(x, w.reshape(12, 1, 40, 1)[:2, :, :3]).astype(
            mx.float32).sum())(x.reshape(1, 9, 40, 1))
        assert gc.dtype == mx.bfloat16
        mx.eval(c, gc)
        mx.eval(s)
        from fluxlike.precision.attention import attend
        q = x.reshape(1, 1, 9, 40)
        att, _ = attend(q, q, q, 40**-0.5, "causal")
        ct = native.conv_transpose(x.reshape(1, 9, 40, 1), w.reshape(12, 1, 40, 1)[:2, :, :3],
                                   stride=2)
        assert att.dtype == ct.dtype == mx.bfloat16 and ct.shape == (1, 17, 81, 2)
        mx.eval(att, ct)
        from fluxlike_native import _ext
        impls = [name for name, _ in _ext.cache_impls() + _ext.conv_cache_impls()]
        assert impls and not any("bf16" in name or "512" in name for name in impls), impls
        print("ok")
    """, ONEDNN_MAX_CPU_ISA="AVX2")
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


@needs_native
def test_forcing_bfloat16_into_float32_kernels():
    result = _subprocess("""
        import mlx.core as mx
        from fluxlike import native
        info = native.native_info()
        assert info.bfloat16 == "float32 kernels" and "FLUXLIKE_NATIVE_BF16" in info.reason
        y = native.linear(mx.ones((2, 3), mx.bfloat16), mx.ones((4, 3), mx.bfloat16))
        assert y.dtype == mx.bfloat16 and y.tolist() == [[3.0] * 4] * 2
        print("ok")
    """, FLUXLIKE_NATIVE_BF16="float32")
    assert result.returncode == 0, result.stderr


@needs_native
def test_the_plain_float32_entry_computes_or_declines():
    """The companion's ``plain_linear``: fluxlike's everyday float32 layer call, checked in
    C++; it gives ``native.linear``'s result or declines (``None``) whatever is not its to
    compute."""
    kernel = native.switch.loaded.plain_linear
    x, w, b = rand((6, 5), mx.float32), rand((4, 5), mx.float32), rand((4,), mx.float32)
    for bias in (b, None):
        for relu_ in (False, True):
            mine = kernel(x, w, bias, relu_)
            theirs = native.linear(x, w, bias, "relu" if relu_ else None)
            np.testing.assert_array_equal(np64(mine), np64(theirs))
    assert kernel(rand((2, 3, 5), mx.float32), w, b, False).shape == (2, 3, 4)
    declined = [
        (x.astype(mx.float64), w, b), (x.astype(mx.bfloat16), w, b), (mx.ones((6, 5), mx.int32),
        w, b), (x, w.astype(mx.bfloat16), b), (x, w, b.astype(mx.bfloat16)),
        (x, w, b.reshape(1, 4)), (x, w, mx.zeros((5,))), (x, w.reshape(1, 4, 5), b),
        (rand((6, 3), mx.float32), w, b), (mx.array(1.0), w, b),
    ]
    for args in declined:
        assert kernel(*args, False) is None, [a.shape for a in args]
    with pytest.raises(TypeError):
        kernel(np.ones((6, 5), np.float32), w, b, False)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_and_relu_grad_under_vmap(dtype):
    """mx.vmap over the native matmul (any operand mapped, any axis; per-sample gradients
    through a ReLU layer): MLX's matmul's results, in the operands' dtype."""
    V, tol = 3, (1e-5 if dtype == mx.float32 else 2e-2)
    x, w, b = rand((V, 4, 5), dtype), rand((6, 5), dtype), rand((6,), dtype)

    def ref(x, w, b):
        y = x.astype(mx.float32) @ w.astype(mx.float32).T + b.astype(mx.float32)
        return mx.maximum(y, 0)

    cases = [  # (in_axes, operands)
        ((0, None, None), (x, w, b)),
        ((1, None, None), (x.swapaxes(0, 1), w, b)),
        ((None, 0, None), (x[0], mx.stack([w] * V), b)),
        ((None, None, 0), (x[0], w, mx.stack([b, 2 * b, -b]))),
        ((0, 2, 0), (x, mx.stack([w] * V, axis=2), mx.stack([b] * V))),
    ]
    for in_axes, args in cases:
        mine = mx.vmap(lambda x, w, b: native.linear(x, w, b, "relu"), in_axes=in_axes)(*args)
        theirs = mx.vmap(ref, in_axes=in_axes)(*args)
        assert mine.dtype == dtype and mine.shape == theirs.shape, in_axes
        np.testing.assert_allclose(np64(mine), np64(theirs), rtol=tol, atol=tol)
    batched = mx.vmap(lambda a, c: native.matmul(a, c, transpose_b=True))(
        rand((V, 2, 4, 5), dtype), rand((V, 2, 3, 5), dtype))
    assert batched.shape == (V, 2, 4, 3)
    # per-sample gradients of a ReLU layer (vmap of grad: the ReLU's backward is vmapped too)
    xs = rand((V, 5), mx.float32)
    w32, b32 = w.astype(mx.float32), b.astype(mx.float32)
    per_sample = mx.vmap(mx.grad(lambda w, x: native.linear(x, w, b32, "relu").sum()),
                         in_axes=(None, 0))(w32, xs)
    expected = mx.vmap(mx.grad(lambda w, x: ref(x, w, b32).sum()), in_axes=(None, 0))(w32, xs)
    np.testing.assert_allclose(np64(per_sample), np64(expected), rtol=1e-5, atol=1e-5)


# ---- bfloat16 in float32 kernels: one primitive upcasting its operands while it runs -----------

def _upcast_reference(a, b, bias, ta, tb, act, out_dtype, batched):
    """What the upcasting primitive computes, spelled as the graph it replaces: exact float32
    upcasts (row-major, as the primitive lays its copies out: oneDNN's GEMM may sum in
    another order for a column-major operand), the float32 primitive, one rounding."""
    from fluxlike_native import _ext
    up = [None if t is None else mx.contiguous(t.astype(mx.float32)) for t in (a, b, bias)]
    y = _ext.matmul(up[0], up[1], up[2], ta, tb, act, mx.float32, batched, False)
    return y.astype(out_dtype)


@needs_native
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(1, 30), inner=st.integers(1, 50), out=st.integers(1, 30),
       lead=st.sampled_from([(), (3,)]), xl=st.sampled_from(LAYOUTS),
       wl=st.sampled_from(LAYOUTS), bias=st.sampled_from([None, mx.bfloat16, mx.float32]),
       relu_=st.booleans(), half=st.sampled_from([mx.bfloat16, mx.float16]),
       out_f32=st.booleans(), seed=st.integers(0, 2**16))
def test_half_upcast_is_the_float32_product_rounded_once_bit_for_bit(
        rows, inner, out, lead, xl, wl, bias, relu_, half, out_f32, seed):
    """float16 in float32 kernels (as without AVX512-FP16), and bfloat16 with
    native_bf16=False: the result (and each gradient) is exactly that of astype, the float32
    primitive and astype, for any layout of the operands,
    a bias of either dtype, a fused ReLU and either output dtype (a float32 output's
    cotangent is rounded to the half dtype before the backward products, as in oneDNN's
    bfloat16 kernels: native/README.md)."""
    from fluxlike_native import _ext
    with float16_in_float32_kernels():
        mx.random.seed(seed)
        out_dtype = mx.float32 if out_f32 else half
        x = laid_out(rand((rows, inner), half), xl)
        if lead:
            x = mx.stack([x] * lead[0])
        w = laid_out(rand((out, inner), half), wl)
        b = None if bias is None else rand((out,), half if bias == mx.bfloat16 else bias)
        y = _ext.matmul(x, w, b, False, True, relu_, out_dtype, False, False)
        ref = _upcast_reference(x, w, b, False, True, relu_, out_dtype, False)
        assert y.dtype == ref.dtype == out_dtype
        np.testing.assert_array_equal(np64(y), np64(ref))

        def grads(fn):
            args = [x, w] + ([] if b is None else [b])
            return mx.grad(lambda *t: (fn(*t) * c).astype(mx.float32).sum(),
                           argnums=list(range(len(args))))(*args)

        # (a float32 cotangent is rounded to the half dtype before the products, as in oneDNN's
        # bfloat16 kernels: one that the half dtype holds exactly makes that rounding exact)
        c = rand(y.shape, half).astype(out_dtype)
        mine = grads(lambda x, w, b=None: _ext.matmul(x, w, b, False, True, relu_, out_dtype, False,
                                                     False))
        theirs = grads(lambda x, w, b=None: _upcast_reference(x, w, b, False, True, relu_,
                                                              out_dtype, False))
        for g, r in zip(mine, theirs, strict=True):
            assert g.dtype == r.dtype
            np.testing.assert_array_equal(np64(g), np64(r))


@needs_native
@pytest.mark.parametrize(("ashape", "bshape", "ta", "tb"), [
    ((2, 4, 5, 7), (2, 4, 6, 7), False, True),   # attention scores: q @ k.T
    ((2, 1, 5, 6), (1, 3, 6, 7), False, False),  # broadcast batch axes
    ((3, 7, 5), (3, 7, 4), True, False),
    ((7, 5), (3, 7), True, True),
])
@pytest.mark.parametrize("half", [mx.bfloat16, mx.float16], ids=str)
def test_half_upcast_batched_and_transposed_bit_for_bit(ashape, bshape, ta, tb, half):
    from fluxlike_native import _ext
    with float16_in_float32_kernels():
        a, b = rand(ashape, half), rand(bshape, half)
        batched = len(ashape) > 2
        for out_dtype in (half, mx.float32):
            y = _ext.matmul(a, b, None, ta, tb, False, out_dtype, batched, False)
            ref = _upcast_reference(a, b, None, ta, tb, False, out_dtype, batched)
            np.testing.assert_array_equal(np64(y), np64(ref))
        # the gradients too: an operand broadcast over batch axes gets its products summed in
        # float32 and rounded once
        c = rand(y.shape, half)

        def grads(fn):
            return mx.grad(lambda a, b: (fn(a, b) * c).astype(mx.float32).sum(),
                           argnums=(0, 1))(a, b)

        mine = grads(lambda a, b: _ext.matmul(a, b, None, ta, tb, False, None, batched, False))
        theirs = grads(lambda a, b: _upcast_reference(a, b, None, ta, tb, False, half, batched))
        for g, r in zip(mine, theirs, strict=True):
            assert g.dtype == r.dtype == half
            np.testing.assert_array_equal(np64(g), np64(r))


@needs_native
@needs_f16_kernels
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(1, 30), inner=st.integers(1, 50), out=st.integers(1, 30),
       lead=st.sampled_from([(), (3,)]), xl=st.sampled_from(LAYOUTS),
       wl=st.sampled_from(LAYOUTS), bias=st.sampled_from([None, mx.float16, mx.float32]),
       relu_=st.booleans(), out_f32=st.booleans(), seed=st.integers(0, 2**16))
def test_float16_kernels_round_the_float32_sum_once(rows, inner, out, lead, xl, wl, bias,
                                                    relu_, out_f32, seed):
    """oneDNN's float16 kernels (AVX512-FP16) give what the float32 kernels give to the order
    of the float32 sums, for any layout, a bias of either dtype, a fused ReLU and either
    output dtype; and so do the gradients (float16 in float16 kernels)."""
    from fluxlike_native import _ext
    mx.random.seed(seed)
    out_dtype = mx.float32 if out_f32 else mx.float16
    x = laid_out(rand((rows, inner), mx.float16), xl)
    if lead:
        x = mx.stack([x] * lead[0])
    w = laid_out(rand((out, inner), mx.float16), wl)
    b = None if bias is None else rand((out,), bias)
    c = rand((*x.shape[:-1], out), mx.float16).astype(out_dtype)

    def run():
        def fn(x, w, b=None):
            return _ext.matmul(x, w, b, False, True, relu_, out_dtype, False, False)
        args = [x, w] + ([] if b is None else [b])
        grads = mx.grad(lambda *t: (fn(*t) * c).astype(mx.float32).sum(),
                        argnums=list(range(len(args))))(*args)
        return [fn(*args), *grads]

    mine = run()
    with float16_in_float32_kernels():
        theirs = run()
    # each result within one float16 rounding (an ulp: either side may round a sum that the
    # other's order put across a rounding boundary) plus float32 accumulation's error
    x64, w64 = np.abs(np64(x)).reshape(-1, inner), np.abs(np64(w))
    c64 = np.abs(np64(c)).reshape(-1, out)
    scales = [x64 @ w64.T + (0 if b is None else np.abs(np64(b))), c64 @ w64, c64.T @ x64,
              c64.sum(0)]
    for got, want, scale in zip(mine, theirs, scales, strict=False):
        assert got.dtype == want.dtype
        g, r = np64(got).reshape(scale.shape), np64(want).reshape(scale.shape)
        ulp = 2.0**-10 * np.maximum(np.abs(r), 2.0**-14)
        bound = (ulp if got.dtype == mx.float16 else 0) + 2e-6 * inner * scale + 1e-30
        assert (np.abs(g - r) <= bound).all(), np.abs(g - r).max()


@needs_native
@needs_f16_kernels
def test_float16_kernels_keep_nan_and_zeros():
    """A NaN passes the fused ReLU in float16 kernels and a negative result becomes +0; an
    infinite operand over one entry gives inf times 0 = NaN where the float32 product does;
    float16 denormal operands and results are kept (not flushed); a float16 bias gives the
    float32 one's bits."""
    from fluxlike_native import _ext
    h = mx.float16
    x = mx.array([[float("nan"), 1.0], [1.0, 1.0], [-3.0, 1.0]]).astype(h)
    w = mx.array([[1.0, 0.0], [1.0, 1.0]]).astype(h)
    y = np.array(_ext.matmul(x, w, None, False, True, True, None, False, False).view(mx.uint16))
    assert ((y[0] & 0x7FFF) > 0x7C00).all()  # NaN
    assert y[1].tolist() == [0x3C00, 0x4000] and y[2].tolist() == [0, 0]  # 1, 2; +0, +0
    x = mx.array([[float("inf")], [1.0]]).astype(h)
    w = mx.array([[2.0], [0.0]]).astype(h)
    y = np64(_ext.matmul(x, w, None, False, True, False, None, False, False))
    assert y[0, 0] == np.inf and np.isnan(y[0, 1]) and y[1].tolist() == [2.0, 0.0]
    tiny = mx.array([[6e-8, 1e-6, 3e-5]]).astype(h)  # denormals in
    y = _ext.matmul(tiny, mx.ones((1, 3), h), None, False, True, False, None, False, False)
    want = (tiny.astype(mx.float32) @ mx.ones((3, 1))).astype(h)
    assert np.array_equal(np.array(y.view(mx.uint16)), np.array(want.view(mx.uint16)))
    y = _ext.matmul(mx.array([[1e-4]], h), mx.array([[1e-3]], h), None, False, True, False,
                    None, False, False)
    assert np.array(y.view(mx.uint16)).tolist() == [[2]]  # 1e-7: a denormal out
    x, w, b = rand((5, 7), h), rand((3, 7), h), rand((3,), h)
    wide = _ext.matmul(x, w, b.astype(mx.float32), False, True, False, None, False, False)
    narrow = _ext.matmul(x, w, b, False, True, False, None, False, False)
    assert np.array_equal(np.array(narrow.view(mx.uint16)), np.array(wide.view(mx.uint16)))


@needs_native
@needs_f16_kernels
def test_float16_products_never_run_onednns_reference_kernel():
    """oneDNN 3.2 gives a float16 product with a float16 bias only its reference
    implementation (~1,000x slower): the bias is widened to float32 for its float16 kernels.
    Every product of a linear layer (bias, ReLU, either output dtype), its gradients and a
    batched product runs on them (as ONEDNN_VERBOSE lists what it executed)."""
    code = """
        import mlx.core as mx
        from fluxlike_native import _ext
        h = mx.float16
        x, w, b = (mx.random.normal(s).astype(h) for s in ((9, 16), (12, 16), (12,)))
        for bias in (b, b.astype(mx.float32), None):
            for out in (None, mx.float32):
                f = lambda x, w: _ext.matmul(x, w, bias, False, True, True, out, False, False)
                mx.eval(f(x, w), mx.grad(lambda x, w: f(x, w).astype(mx.float32).sum(),
                                         argnums=(0, 1))(x, w))
        q, k = mx.random.normal((2, 3, 5, 8)).astype(h), mx.random.normal((2, 3, 7, 8)).astype(h)
        mx.eval(_ext.matmul(q, k, None, False, True, False, None, True, False))
    """
    executed = executed_kernels(code, "matmul")
    assert "brg:avx512_core_fp16" in executed
    assert not [impl for impl in executed if impl.startswith("ref")], executed


@needs_native
def test_float16_kernels_can_be_switched_off():
    """FLUXLIKE_NATIVE_F16=float32 holds float16 to the float32 kernels (native_info says
    which); by default a CPU with AVX512-FP16 runs its float16 kernels."""
    code = """
        from fluxlike import native
        from fluxlike_native import _ext
        info = native.native_info()
        print(info.float16, _ext.native_f16(), _ext.isa_has_fp16(), sep="|")
    """
    off = _subprocess(code, FLUXLIKE_NATIVE_F16="float32")
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip().split("|")[:2] == ["float32 kernels", "False"]
    on = _subprocess(code)
    assert on.returncode == 0, on.stderr
    how, native_f16, has = on.stdout.strip().split("|")
    assert [how, native_f16] == (["native", "True"] if has == "True"
                                 else ["float32 kernels", "False"])


@needs_native
def test_bfloat16_upcast_is_one_node_and_keeps_no_float32_copies():
    """The graph holds the bfloat16 operands and one product node (no casts), in and out of
    mx.compile, and a NaN still passes a fused ReLU."""
    from fluxlike_native import _ext
    x, w = rand((6, 9), mx.bfloat16), rand((4, 9), mx.bfloat16)
    x[0, 0] = float("nan")
    mx.eval(x, w)
    y = _ext.matmul(x, w, None, False, True, True, None, False, False)
    path = Path(tempfile.mkdtemp()) / "graph.dot"
    mx.export_to_dot(str(path), y)
    nodes = re.findall(r'label ="?([A-Za-z]+)', path.read_text())
    assert nodes == ["FluxlikeNativeMatmul"], nodes
    assert np.isnan(np64(y)[0]).all() and not np.isnan(np64(y)[1:]).any()
    f = mx.compile(lambda x: _ext.matmul(x, w, None, False, True, True, None, False, False))
    np.testing.assert_array_equal(np64(f(x)), np64(y))


@needs_native
def test_float16_results_round_to_nearest_even_overflow_and_underflow_as_astype():
    """The float32 result rounded to float16 as MLX's astype rounds it: ties to even, past
    65504 to inf, below the denormals to zero; NaN stays NaN."""
    from fluxlike_native import _ext
    values = [65504.0, 65519.0, 65520.0, 1e6, -1e6, 2.0**-24, 2.0**-25, 2.0**-25 * 1.5,
              1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, float("nan"), float("inf"), 1e-30]
    # each value as a product: x (float16) times one; the float32 value set through the bias
    x = mx.zeros((len(values), 1), mx.float16)
    bias = mx.array(values)
    y = _ext.matmul(x, mx.ones((len(values), 1), mx.float16), bias, False, True, False, None,
                    False, False)
    np.testing.assert_array_equal(np.diag(np64(y)), np64(bias.astype(mx.float16)))


# ---- fused casts: float32 operands read rounded to the compute dtype ----------------------------

def _fused_reference(ops, compute, ta, tb, act, out_dtype, rounded, batched):
    """The fused product spelled as the graph it replaces: each float32 operand (bias
    included) cast to ``compute``, the upcasting product, the result cast to the output."""
    from fluxlike_native import _ext
    a, b, bias = (None if t is None else t.astype(compute) for t in ops)
    inner = mx.float32 if out_dtype == mx.float32 and not rounded else compute
    y = _ext.matmul(a, b, bias, ta, tb, act, inner, batched, False)
    return y.astype(out_dtype)


def _assert_same(mine, theirs):
    for g, r in zip(mine, theirs, strict=True):
        assert g.dtype == r.dtype
        np.testing.assert_array_equal(np64(g), np64(r))


def _out_dtype(kind, half):
    return (half, False) if kind == "half" else (mx.float32, kind == "f32 rounded")


@needs_native
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(1, 30), inner=st.integers(1, 40), cols=st.integers(1, 30),
       lead=st.sampled_from([(), (3,)]), xl=st.sampled_from(LAYOUTS),
       wl=st.sampled_from(LAYOUTS), x32=st.booleans(), w32=st.booleans(),
       bias=st.sampled_from([None, "half", mx.float32]), relu_=st.booleans(),
       half=st.sampled_from([mx.bfloat16, mx.float16]),
       kind=st.sampled_from(["half", "f32", "f32 rounded"]), seed=st.integers(0, 2**16))
def test_fused_casts_are_the_casts_and_the_product_bit_for_bit(
        rows, inner, cols, lead, xl, wl, x32, w32, bias, relu_, half, kind, seed):
    """compute_dtype: each operand float32 or half, any layout, a bias of either dtype, a
    fused ReLU, each output: the result and every gradient (in its operand's dtype: a float32
    weight's gradient is float32 holding half values) are exactly those of the casts and the
    product they replace."""
    from fluxlike_native import _ext
    mx.random.seed(seed)
    out_dtype, rounded = _out_dtype(kind, half)
    x = laid_out(rand((rows, inner), mx.float32 if x32 else half), xl)
    if lead:
        x = mx.stack([x] * lead[0])
    w = laid_out(rand((cols, inner), mx.float32 if w32 else half), wl)
    b = None if bias is None else rand((cols,), half if bias == "half" else bias)

    # Every product on its primitive: in 'reused' mode (the default where the primitive is
    # brgemm, AVX-512) a shape's first two uses run oneDNN's GEMM, which sums in another
    # order, and the two spellings below reach a shape at different uses.
    mode = _ext.set_matmul_mode("primitive")
    try:
        _fused_casts_case(_ext, x, w, b, relu_, half, out_dtype, rounded)
    finally:
        _ext.set_matmul_mode(mode)


def _fused_casts_case(_ext: Any, x: mx.array, w: mx.array, b: mx.array | None, relu_: bool,
                      half: mx.Dtype, out_dtype: mx.Dtype, rounded: bool) -> None:
    args = [x, w] + ([] if b is None else [b])

    def mine(x, w, b=None):
        return _ext.matmul(x, w, b, False, True, relu_, out_dtype, False, False,
                           compute_dtype=half, rounded=rounded)

    def theirs(x, w, b=None):
        return _fused_reference((x, w, b), half, False, True, relu_, out_dtype, rounded, False)

    y, ref = mine(*args), theirs(*args)
    assert y.dtype == ref.dtype == out_dtype
    np.testing.assert_array_equal(np64(y), np64(ref))
    c = rand(y.shape, out_dtype)  # (a float32 one not rounded to the half dtype)

    def grads(fn):
        return mx.grad(lambda *t: (fn(*t) * c).astype(mx.float32).sum(),
                       argnums=list(range(len(args))))(*args)

    got = grads(mine)
    assert [g.dtype for g in got] == [t.dtype for t in args]
    _assert_same(got, grads(theirs))
    # tangents, and the first operand mapped by vmap (the kernel itself) or every one
    tangents = [rand(t.shape, t.dtype) for t in args]
    _assert_same(mx.jvp(mine, args, tangents)[1], mx.jvp(theirs, args, tangents)[1])
    for axes in [(0, None) + (None,) * (len(args) - 2), (0,) * len(args)]:
        stacked = [mx.stack([t, t * 0.5]) if ax == 0 else t
                   for t, ax in zip(args, axes, strict=True)]
        _assert_same([mx.vmap(mine, in_axes=axes)(*stacked)],
                     [mx.vmap(theirs, in_axes=axes)(*stacked)])


@needs_native
@pytest.mark.parametrize(("ashape", "bshape", "ta", "tb"), [
    ((2, 1, 5, 6), (1, 3, 6, 7), False, False),  # broadcast batch axes
    ((3, 7, 5), (3, 7, 4), True, False),
    ((7, 5), (3, 7), True, True),
    ((0, 5), (5, 3), False, False),  # empty
])
@pytest.mark.parametrize("half", [mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("kind", ["half", "f32", "f32 rounded"])
def test_fused_casts_batched_transposed_and_empty(ashape, bshape, ta, tb, half, kind):
    from fluxlike_native import _ext
    with float16_in_float32_kernels():
        out_dtype, rounded = _out_dtype(kind, half)
        a, b = rand(ashape, mx.float32), rand(bshape, half)
        batched = len(ashape) > 2

        def mine(a, b):
            return _ext.matmul(a, b, None, ta, tb, False, out_dtype, batched, True,
                               compute_dtype=half, rounded=rounded)

        def theirs(a, b):
            return _fused_reference((a, b, None), half, ta, tb, False, out_dtype, rounded, batched)

        _assert_same([mine(a, b)], [theirs(a, b)])
        c = rand(mine(a, b).shape, half)

        def grads(fn):
            return mx.grad(lambda a, b: (fn(a, b) * c).astype(mx.float32).sum(),
                           argnums=(0, 1))(a, b)

        got = grads(mine)
        assert [g.dtype for g in got] == [mx.float32, half]
        _assert_same(got, grads(theirs))


@needs_native
def test_fused_casts_are_one_node_and_name_their_errors():
    """A float32 weight and input with compute_dtype: one product node, no cast, in and out of
    mx.compile; operands of another dtype, a float32 compute dtype: a clear error."""
    from fluxlike_native import _ext
    x, w, b = rand((6, 9), mx.float32), rand((4, 9), mx.float32), rand((4,), mx.float32)
    mx.eval(x, w, b)
    y = _ext.matmul(x, w, b, False, True, True, None, False, False, compute_dtype=mx.bfloat16)
    assert y.dtype == mx.bfloat16
    path = Path(tempfile.mkdtemp()) / "graph.dot"
    mx.export_to_dot(str(path), y)
    nodes = re.findall(r'label ="?([A-Za-z]+)', path.read_text())
    assert nodes == ["FluxlikeNativeMatmul"], nodes
    f = mx.compile(lambda x, w, b: _ext.matmul(x, w, b, False, True, True, None, False, False,
                                               compute_dtype=mx.bfloat16))
    np.testing.assert_array_equal(np64(f(x, w, b)), np64(y))
    with pytest.raises(ValueError, match=r"matmul: with compute_dtype bfloat16 each operand "
                       r"must be float32 or bfloat16, got float16; cast it with astype"):
        _ext.matmul(x, w.astype(mx.float16), compute_dtype=mx.bfloat16)
    with pytest.raises(ValueError, match=r"compute_dtype must be bfloat16 or float16, got "
                       r"float32"):
        _ext.matmul(x, w, compute_dtype=mx.float32)
    with pytest.raises(ValueError, match=r"a and b must have one dtype, got float32 and "
                       r"bfloat16; cast one with astype, or pass the half dtype as compute_dtype"):
        _ext.matmul(x, w.astype(mx.bfloat16), trans_b=True)
    with pytest.raises(ValueError, match=r"got float32 and float64; cast one with astype$"):
        _ext.matmul(x, w.astype(mx.float64), trans_b=True)
    with pytest.raises(ValueError, match=r"out_dtype must be float32 or the compute dtype "
                       r"bfloat16, got float16"):
        _ext.matmul(x, w, trans_b=True, out_dtype=mx.float16, compute_dtype=mx.bfloat16)


@needs_native
@pytest.mark.parametrize("half", [mx.bfloat16, mx.float16], ids=str)
def test_nan_bits_are_astypes_in_results_and_fused_operands(half):
    """In float32 kernels, a NaN result rounded to the half dtype, and a float32 NaN operand
    read rounded to it, have the bits MLX's astype gives (float16: the sign and the payload
    0x7D00 whatever the NaN; bfloat16: 0x7FC0), eight lanes at a time and in the tail.
    (oneDNN's float16 kernels keep a NaN's payload: test_float16_kernels_keep_nan_and_zeros.)"""
    from fluxlike_native import _ext
    with float16_in_float32_kernels():
        nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0xFFFFFFFF] * 3,
                        dtype=np.uint32).view(np.float32)
        bias = mx.array(nans)  # each NaN as a product's result: zero times one, plus it
        x = mx.zeros((1, 1), half)
        y = _ext.matmul(x, mx.ones((nans.size, 1), half), bias, False, True, False, None, False,
                        False)
        want = bias.astype(half)
        assert np.array_equal(np.array(y[0].view(mx.uint16)), np.array(want.view(mx.uint16)))
        # a float32 NaN weight read rounded: the float32 result (rounded, stored as float32)
        w = mx.array(nans.reshape(-1, 1))
        got = _ext.matmul(mx.ones((1, 1)), w, None, False, True, False, mx.float32, False, False,
                          compute_dtype=half, rounded=True)
        ref = _fused_reference((mx.ones((1, 1)), w, None), half, False, True, False, mx.float32,
                               True, False)
        assert np.array_equal(np.array(got.view(mx.uint32)), np.array(ref.view(mx.uint32)))
