"""The native companion (fluxlike-native, oneDNN): its matmul/linear primitive against float64
numpy and against MLX's own kernels, its gradients, layouts, mx.compile, threads, the ISA
fallback, and fluxlike without it.

Tolerances (the documented numerics of fluxlike.native):
- float32: float32 accumulation, so ``|y - exact| <= 1e-5 * (|x| @ |w|.T + |b|)`` elementwise
  (a bound on the accumulated rounding for inner sizes up to a few thousand; MLX's own
  ``mx.matmul`` meets the same bound).
- bfloat16 result: the float32-accumulated result rounded once to bfloat16, so within half a
  bfloat16 ulp (at most 2**-8 relative) of the float32 result, plus the float32 bound.
Inputs are rounded to the dtype first, so the float64 reference sees the same operands.

Without the extension, every test here skips with the reason ``native_info()`` gives, except
``test_fluxlike_works_without_native`` and ``test_mismatched_build_is_reported``. To run the
suite as if it were absent: ``FLUXLIKE_NATIVE=0 python -m pytest -q tests/test_native.py``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import in_threads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fluxlike import native
from fluxlike.activations import relu

INFO = native.native_info()
needs_native = pytest.mark.skipif(not INFO.available,
                                  reason=f"fluxlike-native not in use: {INFO.reason}")
ROOT = Path(__file__).resolve().parent.parent
DTYPES = [mx.float32, mx.bfloat16]
BF16_HALF_ULP = 2.0**-8  # half a bfloat16 ulp, relative to the value (8-bit significand)


def np64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def rand(shape, dtype=mx.float32, scale=1.0):
    return (scale * mx.random.normal(shape)).astype(dtype)


def reference(x, w, b=None, act=False):
    """float64 ``act(x @ w.T + b)`` and the scale ``|x| @ |w|.T + |b|`` of its rounding."""
    x64, w64 = np64(x), np64(w)
    y = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    if b is not None:
        y = y + np64(b)
        scale = scale + np.abs(np64(b))
    return (np.maximum(y, 0) if act else y), scale


def assert_close(y: mx.array, exact: np.ndarray, scale: np.ndarray, dtype) -> None:
    """``y`` within the module's documented tolerance of ``exact``."""
    assert y.dtype == dtype
    got = np64(y)
    assert got.shape == exact.shape
    bound = 1e-5 * scale + 1e-30
    if dtype == mx.bfloat16:
        bound = bound + BF16_HALF_ULP * np.abs(exact) * (1 + 1e-3)
    excess = np.abs(got - exact) - bound
    assert excess.max(initial=-1) <= 0, f"max error over bound {excess.max()}"


def _subprocess(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if k not in ("FLUXLIKE_NATIVE", "FLUXLIKE_NATIVE_BF16", "ONEDNN_MAX_CPU_ISA",
                         "OMP_WAIT_POLICY")}
    full.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=300)


# ---- without the extension ------------------------------------------------------------

def test_fluxlike_works_without_native():
    """With fluxlike_native unimportable, fluxlike imports and trains, native_info() says why,
    and the native functions raise a clear NativeUnavailable."""
    result = _subprocess("""
        import sys
        sys.modules["fluxlike_native"] = None          # as if it were not installed
        import mlx.core as mx
        import fluxlike
        from fluxlike import Dense, native
        info = native.native_info()
        assert not info.available, info
        assert "not installed" in info.reason and "./dev setup" in info.reason, info.reason
        assert not native.pays(512, 2048, 2048, mx.float32)
        y = Dense(3, 2)(mx.ones((4, 3)))
        mx.eval(y)
        assert y.shape == (4, 2)
        from fluxlike import Chain, Conv, MaxPool, gradient, relu
        cnn = Chain(Conv((3, 3), 1, 2, relu, padding=1), MaxPool((2, 2)))
        for ac in (None, mx.bfloat16):
            g, = gradient(lambda m: m(mx.ones((2, 8, 8, 1))).sum(), cnn, autocast=ac)
            assert g["layers"][0]["weight"].dtype == mx.float32
        try:
            native.linear(mx.ones((2, 3)), mx.ones((4, 3)))
        except native.NativeUnavailable as error:
            assert "fluxlike.native.linear" in str(error) and "not installed" in str(error)
        else:
            raise AssertionError("no error")
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_mismatched_build_is_reported(tmp_path):
    """A companion built for another MLX is not imported; native_info() names both versions."""
    fake = tmp_path / "fluxlike_native"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "_build.py").write_text('MLX_VERSION = "0.0.1"\n')
    (fake / "_ext.py").write_text('raise AssertionError("a mismatched _ext was imported")\n')
    result = _subprocess(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import mlx.core as mx
        from fluxlike import native
        info = native.native_info()
        assert not info.available and info.built_for == "0.0.1", info
        assert "built for MLX 0.0.1" in info.reason and mx.__version__ in info.reason, info
        print("ok")
    """)
    assert result.returncode == 0, result.stderr


@needs_native
def test_native_info_in_use():
    assert INFO.available and INFO.isa and INFO.onednn
    assert INFO.built_for == mx.__version__ == INFO.mlx
    assert INFO.bfloat16 in ("native", "float32 kernels")
    assert "oneDNN" in INFO.reason and INFO.isa in INFO.reason


# ---- values -----------------------------------------------------------------------------

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
    with pytest.raises(ValueError, match=r"float32 or bfloat16, got float16"):
        native.linear(x.astype(mx.float16), w.astype(mx.float16))
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


# ---- layouts and random shapes --------------------------------------------------------------

def _laid_out(a: mx.array, layout: str) -> mx.array:
    """``a``'s values as a transposed, sliced or broadcast view (2-D ``a``)."""
    if layout == "transposed":  # stored (in, rows), read through .T: column-major
        stored = mx.array(np.ascontiguousarray(np64(a).T), dtype=mx.float32).astype(a.dtype)
        mx.eval(stored)
        return stored.T
    if layout == "sliced rows":
        big = mx.zeros((2 * a.shape[0], a.shape[1]), a.dtype)
        big[::2] = a
        return big[::2]
    if layout == "sliced columns":
        big = mx.zeros((a.shape[0], a.shape[1] + 3), a.dtype)
        big[:, 1:-2] = a
        return big[:, 1:-2]
    if layout == "broadcast" and a.shape[0] > 0:
        return mx.broadcast_to(a[:1], a.shape)
    return a


LAYOUTS = ["contiguous", "transposed", "sliced rows", "sliced columns", "broadcast"]


@needs_native
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(1, 40), inner=st.integers(1, 70), out=st.integers(1, 40),
       lead=st.sampled_from([(), (2,), (2, 3)]), xl=st.sampled_from(LAYOUTS),
       wl=st.sampled_from(LAYOUTS), dtype=st.sampled_from(DTYPES), bias=st.booleans(),
       act=st.sampled_from([None, "relu"]), seed=st.integers(0, 2**16))
def test_linear_random_shapes_and_layouts(rows, inner, out, lead, xl, wl, dtype, bias, act,
                                          seed):
    mx.random.seed(seed)
    x = _laid_out(rand((rows, inner), dtype), xl)
    w = _laid_out(rand((out, inner), dtype), wl)
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


# ---- gradients ------------------------------------------------------------------------------

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
@pytest.mark.parametrize("gdtype", DTYPES, ids=str)
@pytest.mark.parametrize("ydtype", DTYPES, ids=str)
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


# ---- mx.compile, threads, the cache -----------------------------------------------------------

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


# ---- the ISA fallback -----------------------------------------------------------------------

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
        q = x.reshape(1, 1, 9, 40)
        att = native.attention(q, q, q, mask="causal")
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


# ---- convolution ------------------------------------------------------------------------------

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
    with pytest.raises(ValueError, match=r"must both be float32 or both bfloat16"):
        native.conv(x, w.astype(mx.bfloat16))
    empty = native.conv(mx.zeros((0, 5, 5, 4)), w, mx.ones((6,)))
    assert empty.shape == (0, 3, 3, 6)


# ---- attention --------------------------------------------------------------------------------

ATTENTION_CASES = [  # q shape, kv heads, L_k, mask
    ((2, 4, 16, 8), 4, 16, None),
    ((2, 4, 16, 8), 4, 16, "causal"),
    ((1, 8, 5, 16), 2, 9, "causal"),   # grouped queries, L_q < L_k
    ((2, 2, 7, 8), 2, 7, "bool"),
    ((2, 2, 7, 8), 1, 11, "additive"),
]


def _attention_inputs(case, dtype):
    qs, hkv, lk, kind = case
    q = rand(qs, dtype)
    k = rand((qs[0], hkv, lk, qs[3]), dtype)
    v = rand((qs[0], hkv, lk, qs[3] + 2), dtype)
    mask = kind
    if kind == "bool":
        mask = mx.random.uniform(shape=(qs[2], lk)) > 0.3
        mask = mx.logical_or(mask, mx.arange(lk)[None] == 0)  # every row attends somewhere
    elif kind == "additive":
        mask = rand((qs[0], 1, qs[2], lk)).astype(dtype)
    return q, k, v, mask


def _np_attention(q, k, v, mask, scale):
    q64, k64, v64 = np64(q), np64(k), np64(v)
    groups = q64.shape[1] // k64.shape[1]
    k64, v64 = np.repeat(k64, groups, axis=1), np.repeat(v64, groups, axis=1)
    s = q64 @ k64.swapaxes(-1, -2) * scale
    lq, lk = s.shape[-2:]
    if isinstance(mask, str):
        s = np.where(np.arange(lk)[None] <= np.arange(lq)[:, None] + lk - lq, s, -np.inf)
    elif mask is not None:
        s = np.where(np.array(mask), s, -np.inf) if mask.dtype == mx.bool_ else s + np64(mask)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return p @ v64


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0]}/{c[1]}/{c[3]}")
def test_attention_against_float64_and_mlx(dtype, case):
    q, k, v, mask = _attention_inputs(case, dtype)
    scale = q.shape[-1] ** -0.5
    y = native.attention(q, k, v, scale=scale, mask=mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    assert y.dtype == theirs.dtype == dtype and y.shape == theirs.shape
    exact = _np_attention(q, k, v, mask, scale)
    tol = 2e-5 if dtype == mx.float32 else 3e-2  # bf16: probabilities rounded, then product
    np.testing.assert_allclose(np64(y), exact, rtol=tol, atol=tol)
    np.testing.assert_allclose(np64(y), np64(theirs), rtol=tol, atol=tol)


@needs_native
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0]}/{c[1]}/{c[3]}")
def test_attention_gradients_against_mlx(case):
    q, k, v, mask = _attention_inputs(case, mx.float32)
    c = rand((*q.shape[:3], v.shape[-1]))

    def loss(f):
        return lambda q, k, v: (f(q, k, v, scale=0.3, mask=mask) * c).sum()

    mine = mx.grad(loss(native.attention), argnums=(0, 1, 2))(q, k, v)
    theirs = mx.grad(loss(mx.fast.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for g, h, p in zip(mine, theirs, (q, k, v), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
        np.testing.assert_allclose(np.array(g), np.array(h), rtol=1e-4, atol=1e-4)


@needs_native
def test_attention_bfloat16_training_inside_compile():
    q, k, v, _ = _attention_inputs(ATTENTION_CASES[1], mx.bfloat16)

    def loss(q, k, v):
        return native.attention(q, k, v, mask="causal").astype(mx.float32).sum()

    g = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    h = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for gi, hi, p in zip(g, h, (q, k, v), strict=True):
        assert gi.dtype == mx.bfloat16 and gi.shape == p.shape
        np.testing.assert_allclose(np64(gi), np64(hi), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match=r"fluxlike\.native\.attention: expected q"):
        native.attention(q, k[:, :3], v)


# ---- transposed convolution ---------------------------------------------------------------------

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
def test_the_plain_float32_entry_computes_or_declines():
    """``plain_linear_kernel()``: fluxlike's everyday float32 layer call, checked in C++; it
    gives ``native.linear``'s result or declines (``None``) whatever is not its to compute."""
    kernel = native.plain_linear_kernel()
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


# ---- convolution with a fused ReLU -------------------------------------------------------------

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


# ---- max pooling ------------------------------------------------------------------------------

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
                 mx.bfloat16: {"rtol": BF16_HALF_ULP * 1.01, "atol": 1e-5}}

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
    got = native._require("relu_grad").relu_grad(g[::-1], y.T)
    np.testing.assert_array_equal(np64(got), np.where(mask, np64(g[::-1]), 0))


# ---- softmax ------------------------------------------------------------------------------------

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
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
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
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
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
    assert _ext.pool_cache_size() == 4 * 2  # one forward and one backward per shape
    assert sum(count for _, count in _ext.pool_cache_impls()) == 8


@needs_native
def test_max_pool_errors():
    x = mx.ones((1, 5, 5, 4))
    with pytest.raises(ValueError, match=r"fluxlike\.native\.max_pool.*float32 or bfloat16"):
        native.max_pool(x.astype(mx.float16), 2)
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


# ---- the layers' routing -------------------------------------------------------------------------

def _cnn():
    import fluxlike as fl

    mx.random.seed(3)
    return fl.Chain(fl.Conv((3, 3), 1, 8, relu, padding=1), fl.MaxPool((2, 2)),
                    fl.Conv((3, 3), 8, 16, relu, padding=1), fl.MaxPool((2, 2)), fl.flatten,
                    fl.Dense(16 * 7 * 7, 3))


def test_disabled_switches_the_kernels_off_for_the_block_and_on_again():
    """native.disabled(): inside, nothing reports the kernels in use, and graphs built there
    take MLX's kernels, with MLX's results; nested blocks and an exception inside leave the
    kernels as they were; outside, the routing asks again."""
    from fluxlike import Dense
    from fluxlike.precision import ops

    layer, x = Dense(8, 4, relu), mx.random.normal((3, 8), key=mx.random.key(0))
    before = (native.available(), ops.adam_kernel() is not None)
    with native.disabled():
        assert not native.available() and not native.bfloat16_native()
        assert native.adam_kernel() is None and ops.adam_kernel() is None
        inside = layer(x)
        with pytest.raises(RuntimeError, match="boom"), native.disabled():
            raise RuntimeError("boom")
        assert not native.available()  # the inner block's exit does not switch them on
    assert (native.available(), ops.adam_kernel() is not None) == before == (
        INFO.available, INFO.available)
    ref = mx.maximum(x @ layer.weight.T + layer.bias, 0)
    np.testing.assert_allclose(np64(inside), np64(ref), rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("ac", [None, mx.bfloat16], ids=["float32", "autocast"])
def test_cnn_layers_run_native_kernels_in_training(ac, monkeypatch):
    """Conv (with its ReLU fused) and MaxPool run the native kernels in a training step, in
    float32 and under autocast (bfloat16 convolutions, forward and backward); the loss and
    float32 gradients agree with MLX's kernels (FLUXLIKE_NATIVE=0's path)."""
    from fluxlike import withgradient
    from fluxlike.losses import logitcrossentropy

    model = _cnn()
    x = mx.random.normal((16, 28, 28, 1), key=mx.random.key(0))
    y = mx.eye(3)[mx.arange(16) % 3]

    def step():
        loss, (g,) = withgradient(lambda m: logitcrossentropy(m(x), y), model, autocast=ac)
        mx.eval(loss, g)
        return loss, g

    calls: dict[str, list] = {"conv": [], "max_pool": []}
    for name in calls:
        kernel = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _k=kernel, _n=name, **kw: (
            calls[_n].append((a[0].dtype, kw.get("act"))), _k(*a, **kw))[1])
    loss, g = step()
    monkeypatch.undo()
    want = mx.float32 if ac is None else mx.bfloat16
    # (bfloat16 training convolutions need oneDNN's bfloat16 kernels, else the emulation)
    convs = [want, want] if ac is None or native.bfloat16_native() else []
    assert [d for d, _ in calls["conv"]] == convs and all(a is relu for _, a in calls["conv"])
    assert [d for d, _ in calls["max_pool"]] == [want, want]
    from mlx.utils import tree_flatten

    if ac is None:  # float32: MLX's kernels give the same step
        with native.disabled():
            loss0, g0 = step()
        assert loss.item() == pytest.approx(loss0.item(), rel=1e-5)
        for (name, a), (_, b) in zip(tree_flatten(g), tree_flatten(g0), strict=True):
            assert a.dtype == mx.float32 == b.dtype, name
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4,
                                       atol=1e-5 * float(mx.abs(b).max()), err_msg=name)
        return
    # bfloat16: as far from float32's step as the float32-kernel emulation is (bfloat16
    # activations both; the roundings fall elsewhere, and ties in a pool go to the first)
    with native.disabled():
        ac = None
        loss32, g32 = step()
        ac = mx.bfloat16
        loss_emu, g_emu = step()
    assert abs(loss.item() - loss32.item()) <= 2 * abs(loss_emu.item() - loss32.item()) + 1e-3
    for (name, a), (_, b), (_, r) in zip(tree_flatten(g), tree_flatten(g_emu),
                                         tree_flatten(g32), strict=True):
        assert a.dtype == mx.float32, name
        scale = float(mx.abs(r).max())
        mine, theirs = (float(mx.abs(v - r).max()) / scale for v in (a, b))
        assert mine <= 1.5 * theirs + 0.01, (name, mine, theirs)


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


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
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


def test_export_inside_disabled(tmp_path):
    """MLX cannot serialize the native primitives; inside native.disabled() a layer's graph
    takes MLX's kernels, and mx.export_function / import_function work (as the README says)."""
    from fluxlike import Dense

    layer, x = Dense(8, 4, relu), mx.random.normal((2, 8), key=mx.random.key(0))
    path = str(tmp_path / "dense.mlxfn")
    if INFO.available:
        with pytest.raises(ValueError, match="Unable to serialize primitive FluxlikeNative"):
            mx.export_function(str(tmp_path / "native.mlxfn"), lambda x: layer(x), x)
    with native.disabled():
        mx.export_function(path, lambda x: layer(x), x)
    (y,) = mx.import_function(path)(x)
    np.testing.assert_allclose(np64(y), np64(layer(x)), rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("ac", [None, mx.bfloat16], ids=["float32", "autocast"])
def test_vmap_over_a_cnn_and_per_sample_gradients(ac):
    """mx.vmap over a CNN's forward pass agrees with MLX's kernels (native.disabled()), and
    its per-sample gradients (mx.vmap of mx.grad: the native convolutions and max pooling
    folded over the mapped axis, the weight gradients once per member) with the gradients of
    each member taken one by one. (MLX's own convolution gradient has no vmap: AsStrided.)"""
    from mlx.utils import tree_flatten

    import fluxlike as fl
    from fluxlike.losses import logitcrossentropy

    if ac is not None and not native.bfloat16_native():
        pytest.skip("bfloat16 training without oneDNN's bfloat16 kernels runs the emulation, "
                    "which orders its backward pass with mx.depends: MLX has no vmap for it")
    mx.random.seed(3)
    model = fl.Chain(fl.Conv((3, 3), 1, 16, relu, padding=1), fl.MaxPool((2, 2)),
                     fl.Conv((3, 3), 16, 32, relu, padding=1), fl.MaxPool((2, 2)), fl.flatten,
                     fl.Dense(32 * 7 * 7, 3))
    xs = mx.random.normal((3, 2, 28, 28, 1), key=mx.random.key(1))  # 3 members of batch 2
    ys = mx.eye(3)[mx.arange(6).reshape(3, 2) % 3]
    params = model.trainable_parameters()

    def forward(x):
        with fl.autocast(ac) if ac else contextlib.nullcontext():
            return model(x).astype(mx.float32)

    def grads_of(x, y):
        def loss(p):
            model.update(p)
            return logitcrossentropy(forward(x), y)

        g = mx.grad(loss)(params)
        model.update(params)
        return g

    out = mx.vmap(forward)(xs)
    with native.disabled():
        out_ref = mx.vmap(forward)(xs)
    tol = 2e-2 if ac else 1e-4
    np.testing.assert_allclose(np64(out), np64(out_ref), rtol=tol, atol=tol)

    per_sample = dict(tree_flatten(mx.vmap(grads_of)(xs, ys)))
    one_by_one = [dict(tree_flatten(grads_of(xs[i], ys[i]))) for i in range(3)]
    assert per_sample.keys() == one_by_one[0].keys()
    for name, g in per_sample.items():
        assert g.shape[0] == 3, name
        for i in range(3):
            np.testing.assert_allclose(np64(g[i]), np64(one_by_one[i][name]), rtol=1e-4,
                                       atol=1e-5, err_msg=f"{name}, member {i}")


@needs_native
def test_vmap_of_an_input_gradient_that_does_not_depend_on_the_mapped_data():
    """The input gradient of a linear model does not depend on the mapped examples (only the
    weight gradient does): under mx.vmap it is still one per member, as with MLX's kernels."""
    from fluxlike import Dense

    layer = Dense(4, 3)
    xs = mx.random.normal((5, 2, 4), key=mx.random.key(0))

    def grads(x):
        def loss(p, x):
            layer.update(p)
            return layer(x).sum()

        return mx.grad(loss, argnums=(0, 1))(layer.trainable_parameters(), x)

    params = layer.trainable_parameters()
    (gp, gx) = mx.vmap(grads)(xs)
    layer.update(params)
    with native.disabled():
        (rp, rx) = mx.vmap(grads)(xs)
    layer.update(params)
    assert gx.shape == rx.shape == (5, 2, 4) and gp["weight"].shape == (5, 3, 4)
    np.testing.assert_allclose(np64(gx), np64(rx), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np64(gp["weight"]), np64(rp["weight"]), rtol=1e-5, atol=1e-6)


def test_disabled_survives_a_raising_callback(monkeypatch):
    """A callback registered with native.on_switch that raises: the error reaches the caller,
    and the kernels are as they were afterwards (the block is left switched on again)."""
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("callback failed")

    monkeypatch.setattr(native, "_on_switch", [*native._on_switch, boom])
    with pytest.raises(RuntimeError, match="callback failed"), native.disabled():
        pass
    assert native.available() == INFO.available and len(calls) == 2


@needs_native
def test_per_example_gradients_of_a_small_cnn_with_fluxlike_gradient():
    """Per-example gradients (members of one example each) of a CNN whose float32
    convolution is too small to run natively in inference: fluxlike.gradient routes it to the
    native kernel (whose gradient MLX can vmap; MLX's own cannot), one gradient per example,
    equal to each example's own."""
    import fluxlike as fl
    from fluxlike.losses import logitcrossentropy

    mx.random.seed(3)
    model = fl.Chain(fl.Conv((3, 3), 1, 8, relu, padding=1), fl.MaxPool((2, 2)), fl.flatten,
                     fl.Dense(8 * 14 * 14, 3))
    xs = mx.random.normal((6, 1, 28, 28, 1), key=mx.random.key(0))
    ys = mx.eye(3)[mx.arange(6).reshape(6, 1) % 3]

    def per_example(x, y):
        return fl.gradient(lambda m: logitcrossentropy(m(x), y), model)[0]

    grads = mx.vmap(per_example)(xs, ys)
    for i in (0, 5):
        own = per_example(xs[i], ys[i])
        for layer in (0, 3):
            np.testing.assert_allclose(np64(grads["layers"][layer]["weight"][i]),
                                       np64(own["layers"][layer]["weight"]), rtol=1e-4,
                                       atol=1e-6)


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
