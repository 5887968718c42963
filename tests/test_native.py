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

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
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
            if k not in ("FLUXLIKE_NATIVE", "FLUXLIKE_NATIVE_BF16", "ONEDNN_MAX_CPU_ISA")}
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
    failures: list[BaseException] = []

    def work(k: int) -> None:
        try:
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
        except BaseException as error:  # noqa: BLE001  (reported on the main thread)
            failures.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


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
    assert _ext.cache_size() == 3
    names = dict(_ext.cache_impls())
    assert sum(names.values()) == 3


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
        mx.eval(s)
        from fluxlike_native import _ext
        impls = [name for name, _ in _ext.cache_impls()]
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
