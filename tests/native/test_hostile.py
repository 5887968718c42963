"""Hostile inputs for the native companion (fluxlike/native/ops.py; native/src/): special values,
empty and size-1 axes, views, odd channel counts, groups and extreme geometry, through the
kernels, their gradients, ``mx.compile``, ``mx.vmap`` and threads, each compared with what
MLX's own op computes (bit for bit where MLX's op is exact: pooling, a maximum; to the
documented tolerance for sums), or checked to raise a clear Python error before anything runs.

The cases of the hostile pass of 2026-12-02 are pinned first, one test each; the properties
follow. Cases that once killed the interpreter run in a subprocess.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import in_threads
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from native_helpers import DTYPES, _subprocess, laid_out, needs_native, np64

import fluxlike
from fluxlike import autocast, native
from fluxlike.precision import attention, kernels

pytestmark = needs_native
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
# float16 too where the test compares with MLX's own op: its products and convolutions run in
# oneDNN's float16 kernels on a CPU with AVX512-FP16 (float32 kernels elsewhere).
HALVES_TOO = [*DTYPES, mx.float16]
LOWEST = {mx.float32: float(np.finfo(np.float32).min), mx.bfloat16: -3.3895313892515355e38}


def distinct(n: int, seed: int) -> np.ndarray:
    """``n`` distinct float32 values, each exact in bfloat16 (consecutive bfloat16 bit patterns
    from 1.0 up), shuffled: maxima without ties in either dtype."""
    bits = (0x3F80 + np.random.default_rng(seed).permutation(n)).astype(np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)


def same(a: mx.array, b: mx.array) -> None:
    """Equal values (NaN where the other has NaN), dtypes and shapes."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert mx.array_equal(a, b, equal_nan=True).item(), f"\n{a}\n!=\n{b}"


def close(a: mx.array, b: mx.array, rtol: float, atol: float = 0.0) -> None:
    """The same NaN and infinity positions (and signs), finite values within tolerance."""
    assert a.shape == b.shape and a.dtype == b.dtype
    x, y = np64(a), np64(b)
    assert np.array_equal(np.isnan(x), np.isnan(y)), f"NaN differ\n{x}\n{y}"
    assert np.array_equal(np.isposinf(x), np.isposinf(y))
    assert np.array_equal(np.isneginf(x), np.isneginf(y))
    fin = np.isfinite(x)
    np.testing.assert_allclose(x[fin], y[fin], rtol=rtol, atol=atol)


# --- The cases of the hostile pass ------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convolution_of_zero_channels_gives_zeros_not_a_crash(dtype):
    run = _subprocess(f"""
        import mlx.core as mx
        from fluxlike import native
        from fluxlike.precision import kernels
        dt = mx.{dtype}
        x, w, b = mx.zeros((2, 5, 5, 0), dt), mx.zeros((4, 3, 3, 0), dt), mx.ones(4, dt)
        y = native.conv(x, w, b, padding=1)
        assert y.shape == (2, 5, 5, 4) and y.dtype == dt and (y == 1).all().item()
        gx, gw = mx.grad(lambda x, w: native.conv(x, w).astype(mx.float32).sum(),
                         argnums=(0, 1))(x, w)
        assert gx.shape == x.shape and gw.shape == w.shape
        for on in (True, False):
            if not on:
                native.switch.ext = None
            y = kernels.conv(x, w, (1, 1), (0, 0), (1, 1), 1)
            assert y.shape == (2, 3, 3, 4) and (y == 0).all().item()
        print("ok")
    """)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [255, 256, 300])
def test_max_pool_gradient_of_a_window_over_the_whole_axis(dtype, window):
    x = mx.array(distinct(window * 2, window).reshape(1, window, 2), mx.float32).astype(dtype)
    pool = nn.MaxPool1d(window)
    g = mx.grad(lambda x: native.max_pool(x, window).astype(mx.float32).sum())(x)
    same(g, mx.grad(lambda x: pool(x).astype(mx.float32).sum())(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_attention_with_more_queries_than_keys_is_mlx_s(dtype):
    mx.random.seed(3)
    q = mx.random.normal((2, 2, 6, 4)).astype(dtype)
    k, v = (mx.random.normal((2, 2, 3, 4)).astype(dtype) for _ in range(2))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal")
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    for weights in (False, True):
        got, _ = attention.attend(q, k, v, 0.5, "causal", return_weights=weights)
        close(got, want, rtol=tol, atol=tol)


def test_causal_attention_layers_under_autocast_with_more_queries_than_keys():
    mx.random.seed(4)
    q, kv = mx.random.normal((2, 6, 8)), mx.random.normal((2, 3, 8))
    for layer in (fluxlike.MultiHeadAttention(8, nheads=2), nn.MultiHeadAttention(8, 2)):
        def call(q, kv, layer=layer):
            if isinstance(layer, nn.MultiHeadAttention):
                return layer(q, kv, kv, mask="causal")
            return layer(q, kv, kv, mask="causal")[0]
        want = call(q, kv)  # float32, MLX's fused kernel
        with autocast(mx.bfloat16):
            got = call(q, kv)
        assert got.dtype == mx.bfloat16
        close(got.astype(mx.float32), want, rtol=5e-2, atol=5e-2)


DENORMAL = """
    import mlx.core as mx
    from fluxlike import native
    a = mx.array([[1e-39, 2e-39], [3e-39, -5e-40]], mx.bfloat16)
    b = mx.array([[1e30, 2.0], [1e30, 1.0]], mx.bfloat16)
    x, w = mx.array([[1e-20, 3e-20]], mx.bfloat16), mx.array([[1e-20, 1e-19]], mx.bfloat16)
    flush = lambda t: mx.where(mx.abs(t) < 2.0**-126, mx.zeros_like(t), t)
    pairs = [(native.matmul(a, b), mx.matmul(a, b), mx.matmul(flush(a), b)),
             (native.linear(x, w), x @ w.T, flush((x @ w.T).astype(mx.float32)).astype(x.dtype)),
             (native.max_pool(a[None, :, :], 2), a.max(0)[None, None], flush(a).max(0)[None, None])]
    kept = all(mx.array_equal(got, mlx).item() for got, mlx, _ in pairs)
    flushed = all(mx.array_equal(got, fl).item() for got, _, fl in pairs)
    assert all((mlx != 0).all().item() for _, mlx, _ in pairs)
    print(native.native_info().bfloat16, "kept" if kept else "flushed" if flushed else "neither")
    print(native.native_info().reason)
"""


def test_bfloat16_denormals_flush_in_native_kernels_and_the_switch_keeps_them():
    """The decision: oneDNN's bfloat16 kernels flush denormal operands and results (the
    AVX512-BF16 instructions do, whatever MXCSR says), and say so; FLUXLIKE_NATIVE_BF16=float32
    runs bfloat16 in float32 kernels, which give MLX's results bit for bit."""
    run = _subprocess(DENORMAL, FLUXLIKE_NATIVE_BF16="float32")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[0] == "float32 kernels kept"
    if native.bfloat16_native():
        run = _subprocess(DENORMAL)
        assert run.returncode == 0, run.stderr[-2000:]
        first, reason = run.stdout.split("\n")[:2]
        assert first == "native flushed"
        assert "denormals" in reason and "FLUXLIKE_NATIVE_BF16=float32" in reason


@pytest.mark.parametrize("dtype", HALVES_TOO, ids=str)
@pytest.mark.parametrize("k,groups,dilation", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 2, 1),
                                               (2, 1, 2), (3, 1, 1)])
def test_convolution_of_non_finite_weights_at_the_padding_is_mlx_s(dtype, k, groups, dilation):
    mx.random.seed(k)
    x = mx.random.normal((2,) + (5,) * k + (2,)).astype(dtype)
    w = mx.random.normal((4,) + (3,) * k + (2 // groups,)).astype(dtype)
    w[(1,) + (0,) * k + (0,)] = mx.inf
    w[(2,) + (2,) * k + (0,)] = mx.nan
    x[(0,) + (2,) * k + (1,)] = -mx.inf
    for stride in (1, 2):
        got = native.conv(x, w, padding=1, stride=stride, groups=groups, dilation=dilation)
        want = mx.conv_general(x, w, padding=1, stride=stride, groups=groups,
                               kernel_dilation=dilation)
        close(got, want, rtol=1e-5 if dtype == mx.float32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("geometry", [  # x length, kernel, stride, (low, high) padding
    (1, 3, 2, (1, 1)), (1, 2, 2, (1, 0)), (1, 3, 2, (2, 0)), (1, 3, 1, (1, 1)), (2, 3, 2, (2, 2))])
@pytest.mark.parametrize("channels", [2, 4])
def test_a_bfloat16_weight_gradient_of_a_tap_meeting_only_padding_is_zero(geometry, channels):
    """A kernel tap that no output position puts on an input entry has a zero gradient (MLX's);
    oneDNN 3.2's bfloat16 kernels on AMX wrote garbage there (even NaN): float32 kernels
    compute such a weight gradient."""
    length, k, stride, pad = geometry
    mx.random.seed(channels + length)
    x = mx.random.normal((2, length, length, channels)).astype(mx.bfloat16)
    w = mx.random.normal((3, k, k, channels)).astype(mx.bfloat16)
    padding = ([pad[0]] * 2, [pad[1]] * 2)

    def grad(conv):  # type: ignore[no-untyped-def]
        return mx.grad(lambda w: conv(x, w).astype(mx.float32).sum())(w)

    mine = grad(lambda x, w: native.conv(x, w, stride=stride, padding=padding))
    theirs = grad(lambda x, w: mx.conv_general(x, w, stride=stride, padding=padding))
    assert np.isfinite(np64(mine)).all()
    close(mine, theirs, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("channels", [1, 3])
def test_a_bfloat16_convolution_of_odd_input_channels_is_mlx_s_beside_non_finite_inputs(
        channels):
    """An odd channel count (float32 kernels: oneDNN's bfloat16 ones read a pixel's last
    channel with its neighbour, whose non-finite value made NaN beside it): NaN and infinities
    where MLX's convolution has them, the rest and both gradients within bfloat16's rounding;
    inside mx.compile(shapeless=True) too, at two sizes."""
    mx.random.seed(channels)
    x = mx.random.normal((2, 6, 6, channels)).astype(mx.bfloat16)
    w = mx.random.normal((4, 3, 3, channels)).astype(mx.bfloat16)
    x[0, 2, 2, channels - 1] = -mx.inf
    x[1, 4, 0, 0] = mx.nan
    for relu in (False, True):
        got = native.conv(x, w, padding=1, act="relu" if relu else None)
        want = mx.conv_general(x, w, padding=1)
        close(got, mx.maximum(want, 0) if relu else want, rtol=1e-2, atol=1e-2)
    x = mx.random.normal((2, 6, 6, channels)).astype(mx.bfloat16)
    g = mx.random.normal((2, 6, 6, 4)).astype(mx.bfloat16)

    def grads(conv):  # type: ignore[no-untyped-def]
        return mx.grad(lambda x, w: (conv(x, w).astype(mx.float32) * g).sum(),
                       argnums=(0, 1))(x, w)

    mine = grads(lambda x, w: native.conv(x, w, padding=1))
    theirs = grads(lambda x, w: mx.conv_general(x, w, padding=1))
    for a, b in zip(mine, theirs, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        close(a, b, rtol=2e-2, atol=5e-2)
    compiled = mx.compile(lambda x: native.conv(x, w, padding=1, act="relu"), shapeless=True)
    for size in (6, 9):
        x = mx.random.normal((2, size, size, channels)).astype(mx.bfloat16)
        close(compiled(x), mx.maximum(mx.conv_general(x, w, padding=1), 0), rtol=1e-2,
              atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fill", [-np.inf, np.nan, "lowest"])
def test_max_pool_of_special_windows_is_mlx_s(dtype, fill):
    value = LOWEST[dtype] if fill == "lowest" else fill
    x = mx.array([[[value], [value], [1.0], [value], [value], [value]]], dtype)
    for window, padding in [(2, 0), (2, 1), (3, 1), (3, 2)]:
        pool = nn.MaxPool1d(window, stride=window, padding=padding)
        mine = lambda x, window=window, padding=padding: native.max_pool(  # noqa: E731
            x, window, padding=padding)
        same(mine(x), pool(x))
        same(mx.grad(lambda x: mine(x).astype(mx.float32).sum())(x),  # noqa: B023
             mx.grad(lambda x: pool(x).astype(mx.float32).sum())(x))  # noqa: B023
        t = mx.arange(6, dtype=dtype).reshape(x.shape) + 1
        same(mx.jvp(mine, [x], [t])[1][0], mx.jvp(pool, [x], [t])[1][0])


@pytest.mark.parametrize("fn,args", [
    (native.linear, ([[1.0]], mx.ones((1, 1)))), (native.linear, (mx.ones((1, 1)), None)),
    (native.linear, (mx.ones((1, 1)), mx.ones((1, 1)), [0.0])),
    (native.matmul, (mx.ones((1, 1)), 3)), (native.softmax, ([1.0],)),
    (native.conv, (np.ones((1, 3, 1)), mx.ones((1, 1, 1)))), (native.max_pool, ("x", 2)),
    (native.conv_transpose, (None, mx.ones((1, 1, 1)))),
])
def test_non_arrays_raise_a_type_error_naming_the_function(fn, args):
    with pytest.raises(TypeError, match=rf"fluxlike\.native\.{fn.__name__}: expected .* mx\.array"):
        fn(*args)


@pytest.mark.parametrize("bad", [2.0, True, (2, 2), "2"])
def test_geometry_that_is_not_whole_numbers_raises_a_value_error(bad):
    with pytest.raises(ValueError, match=r"fluxlike\.native\.max_pool: window must be an int"):
        native.max_pool(mx.ones((1, 4, 1)), bad)
    with pytest.raises(ValueError, match=r"fluxlike\.native\.conv: stride must be an int"):
        native.conv(mx.ones((1, 4, 1)), mx.ones((1, 2, 1)), stride=bad)


# --- Properties -------------------------------------------------------------------------------

SPECIALS = [np.nan, -np.inf, "lowest", "denormal"]


@st.composite
def pools(draw):
    k = draw(st.integers(1, 2))
    window = [draw(st.integers(1, 4)) for _ in range(k)]
    stride = [draw(st.integers(1, 4)) for _ in range(k)]
    lo = [draw(st.integers(0, w - 1)) for w in window]
    hi = [draw(st.integers(0, w - 1)) for w in window]
    spatial = [max(draw(st.integers(1, 6)), w - a - b) for w, a, b in
               zip(window, lo, hi, strict=True)]
    shape = (draw(st.integers(1, 2)), *spatial, draw(st.sampled_from([1, 3, 5])))
    dtype = draw(st.sampled_from(DTYPES))
    n = int(np.prod(shape))
    # Distinct finite values (ties among them go to the first maximum, as documented), and
    # special values, repeated: NaN, -inf, the lowest finite value, a denormal.
    values = distinct(n, draw(st.integers(0, 2**16)))
    for i in draw(st.lists(st.integers(0, n - 1), max_size=n)):
        special = draw(st.sampled_from(SPECIALS))
        if special == "denormal":  # distinct ones: equal ones would tie (float32 only: see
            values[i] = -1e-39 * (1 + i)  # test_bfloat16_denormals_flush_...)
        else:
            values[i] = LOWEST[dtype] if special == "lowest" else special
    if dtype == mx.bfloat16:
        values[np.abs(values) < 2.0**-126] = 0.0
        values[values == 0.0] = -7.0 - np.arange(np.count_nonzero(values == 0.0))
    x = mx.array(values.reshape(shape), mx.float32).astype(dtype)
    return x, window, stride, (lo, hi)


def mlx_pool(x, window, stride, padding):
    cls = nn.MaxPool1d if len(window) == 1 else nn.MaxPool2d
    lo, hi = padding
    if lo != hi:  # MLX's layer pads symmetrically: pad by hand with -inf
        x = mx.pad(x, [(0, 0), *zip(lo, hi, strict=True), (0, 0)],
                   constant_values=mx.array(-np.inf, x.dtype))
        return cls(tuple(window), tuple(stride), 0)(x)
    return cls(tuple(window), tuple(stride), tuple(lo))(x)


@given(pools())
@SETTINGS
def test_max_pool_forward_and_gradients_are_mlx_s(case):
    x, window, stride, padding = case
    mine = lambda x: native.max_pool(x, window, stride=stride, padding=padding)  # noqa: E731
    theirs = lambda x: mlx_pool(x, window, stride, padding)  # noqa: E731
    same(mine(x), theirs(x))
    same(mx.compile(mine)(x), theirs(x))
    g = mx.grad(lambda x: mine(x).astype(mx.float32).sum())(x)
    want = mx.grad(lambda x: theirs(x).astype(mx.float32).sum())(x)
    close(g, want, rtol=1e-2 if x.dtype == mx.bfloat16 else 1e-6)
    batched = mx.stack([x, -x])
    same(mx.vmap(mine)(batched), mx.stack([mine(x), mine(-x)]))


@given(k=st.integers(1, 2), c_in=st.integers(1, 4), c_out=st.integers(1, 5),
       kernel=st.integers(1, 3), stride=st.integers(1, 2), pad=st.integers(0, 1),
       size=st.integers(3, 7), special=st.sampled_from([np.nan, np.inf, -np.inf]),
       seed=st.integers(0, 2**16), data=st.data())
@SETTINGS
def test_convolution_gradients_beside_a_non_finite_cotangent_are_mlx_s(
        k, c_in, c_out, kernel, stride, pad, size, special, seed, data):
    """A bfloat16 convolution's data gradient sums over the output channels, which oneDNN's
    bfloat16 kernels read in pairs: for an odd count the pair's second entry is the next
    pixel's first channel, times a zero weight. A non-finite cotangent there must not make NaN
    where MLX's gradient is finite: the data gradient has NaN and infinities where MLX's has
    them, the rest within bfloat16's rounding (float32 too). (The weight gradient is left out:
    where a non-finite cotangent's window reaches into the padding, MLX's multiplies the
    padding by it, NaN, and oneDNN's bfloat16 kernel skips the padding, finite; either way
    the step's gradient is not finite.)"""
    key = mx.random.key(seed)
    x = mx.random.normal((2, *(size,) * k, c_in), key=key)
    w = mx.random.normal((c_out, *(kernel,) * k, c_in), key=mx.random.key(seed + 1))
    y_shape = mx.conv_general(x, w, stride=stride, padding=pad).shape
    ct = np.random.default_rng(seed).standard_normal(y_shape).astype(np.float32)
    ct.reshape(-1)[data.draw(st.integers(0, ct.size - 1))] = special
    for dtype in HALVES_TOO:
        xs, ws, cts = x.astype(dtype), w.astype(dtype), mx.array(ct).astype(dtype)

        def grads(conv):  # type: ignore[no-untyped-def]
            return mx.vjp(lambda x, w: conv(x, w), [xs, ws], [cts])[1]  # noqa: B023

        mine = grads(lambda x, w: native.conv(x, w, stride=stride, padding=pad))[0]
        theirs = grads(lambda x, w: mx.conv_general(x, w, stride=stride, padding=pad))[0]
        half = dtype != mx.float32
        close(mine, theirs, rtol=5e-2 if half else 1e-4, atol=5e-2 if half else 1e-4)


@st.composite
def convs(draw):
    k = draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    c_in = groups * draw(st.sampled_from([1, 3]))
    c_out = groups * draw(st.sampled_from([1, 2]))
    kernel = [draw(st.integers(1, 3)) for _ in range(k)]
    dilation = [draw(st.sampled_from([1, 1, 2, 3])) for _ in range(k)]
    stride = [draw(st.sampled_from([1, 2, 5])) for _ in range(k)]
    pad = [draw(st.integers(0, 3)) for _ in range(k)]
    spatial = [max(draw(st.integers(1, 7)), d * (q - 1) + 1 - 2 * p) for q, d, p in
               zip(kernel, dilation, pad, strict=True)]
    dtype = draw(st.sampled_from(HALVES_TOO))
    seed = draw(st.integers(0, 2**16))
    x = mx.random.normal((draw(st.integers(1, 2)), *spatial, c_in), key=mx.random.key(seed))
    w = mx.random.normal((c_out, *kernel, c_in // groups), key=mx.random.key(seed + 1))
    specials = draw(st.lists(st.tuples(st.booleans(), st.sampled_from([np.nan, np.inf, -np.inf])),
                             max_size=2))
    for in_x, value in specials:
        a = x if in_x else w
        flat = a.reshape(-1)
        flat[draw(st.integers(0, flat.size - 1))] = value
        if in_x:
            x = flat.reshape(x.shape)
        else:
            w = flat.reshape(w.shape)
    layout = draw(st.sampled_from(["contiguous", "strided"]))
    if layout == "strided":  # a view with a step on the channels
        x = mx.repeat(x, 2, axis=-1)[..., ::2]
    return x.astype(dtype), w.astype(dtype), stride, pad, dilation, groups


@given(convs())
@SETTINGS
def test_convolution_is_mlx_s_with_special_values_and_extreme_geometry(case):
    x, w, stride, pad, dilation, groups = case
    if groups > 1 and x.ndim > 4:
        return
    note(f"x {x.shape} {x.dtype} strides {stride} padding {pad} dilation {dilation} groups "
         f"{groups}\nx {np64(x).tolist()}\nw {np64(w).tolist()}")
    got = native.conv(x, w, stride=stride, padding=pad, dilation=dilation, groups=groups)
    want = mx.conv_general(x, w, stride=stride, padding=pad, kernel_dilation=dilation,
                           groups=groups)
    half = x.dtype != mx.float32
    # float32: accumulation order; half: one rounding of the float32 sum (MLX: the same)
    close(got, want, rtol=2e-2 if half else 1e-4, atol=2e-2 if half else 1e-4)
    if np.isfinite(np64(x)).all() and np.isfinite(np64(w)).all():
        def loss(conv):
            return lambda x, w: conv(x, w).astype(mx.float32).sum()
        mine = mx.grad(loss(lambda x, w: native.conv(x, w, stride=stride, padding=pad,
                                                      dilation=dilation, groups=groups)),
                       argnums=(0, 1))(x, w)
        theirs = mx.grad(loss(lambda x, w: mx.conv_general(
            x, w, stride=stride, padding=pad, kernel_dilation=dilation, groups=groups)),
            argnums=(0, 1))(x, w)
        for a, b, primal in zip(mine, theirs, (x, w), strict=True):
            assert a.shape == primal.shape and a.dtype == primal.dtype
            if b.shape != primal.shape:  # MLX 0.32.4: a grouped convolution's weight gradient
                continue  # can come back with C_in, not C_in / groups, as its last axis
            close(a, b, rtol=5e-2 if half else 1e-4, atol=5e-2 if half else 1e-4)


@st.composite
def products(draw):
    m, kk, n = (draw(st.sampled_from([0, 1, 3, 17])) for _ in range(3))
    dtype = draw(st.sampled_from(HALVES_TOO))
    seed = draw(st.integers(0, 2**16))
    a = mx.random.normal((m, kk), key=mx.random.key(seed))
    b = mx.random.normal((n, kk), key=mx.random.key(seed + 1))
    if a.size and draw(st.booleans()):
        a[draw(st.integers(0, m - 1)), draw(st.integers(0, kk - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf]))
    a, b = a.astype(dtype), b.astype(dtype)
    return (laid_out(a, draw(st.sampled_from(["contiguous", "transposed", "sliced rows",
                                             "broadcast"]))),
            laid_out(b, draw(st.sampled_from(["contiguous", "transposed", "sliced columns"]))))


@given(products())
@SETTINGS
def test_linear_and_matmul_are_mlx_s_on_views_empty_axes_and_special_values(case):
    x, w = case
    note(f"x {x.shape} {x.dtype} {np64(x).tolist()}\nw {w.shape} {np64(w).tolist()}")
    tol = 2e-2 if x.dtype != mx.float32 else 1e-5
    want = x @ w.T
    close(native.linear(x, w), want, rtol=tol, atol=tol)
    close(native.matmul(x, w, transpose_b=True), want, rtol=tol, atol=tol)
    close(mx.compile(lambda x, w: native.linear(x, w))(x, w), want, rtol=tol, atol=tol)
    if x.size and w.size and np.isfinite(np64(x)).all():
        mine = mx.grad(lambda x, w: native.linear(x, w).astype(mx.float32).sum(),
                       argnums=(0, 1))(x, w)
        theirs = mx.grad(lambda x, w: (x @ w.T).astype(mx.float32).sum(), argnums=(0, 1))(x, w)
        for a, b in zip(mine, theirs, strict=True):
            close(a, b, rtol=tol, atol=tol)


@given(st.lists(st.sampled_from([0.0, 1.0, -3.0, 80.0, np.nan, np.inf, -np.inf]), min_size=1,
                max_size=6), st.integers(1, 3))
@SETTINGS
def test_softmax_is_mlx_s_on_special_rows(row, rows):
    x = mx.array(np.tile(np.array(row, np.float32), (rows, 1)))
    close(native.softmax(x), mx.softmax(x, axis=-1, precise=True), rtol=1e-6, atol=1e-7)


@given(st.integers(1, 6), st.integers(1, 6), st.sampled_from(DTYPES),
       st.sampled_from([None, "causal", "bool"]))
@SETTINGS
def test_attention_core_is_sdpa_s(lq, lk, dtype, mask):
    mx.random.seed(lq * 7 + lk)
    q = mx.random.normal((1, 2, lq, 4)).astype(dtype)
    k, v = (mx.random.normal((1, 2, lk, 4)).astype(dtype) for _ in range(2))
    m = mx.random.bernoulli(0.7, (lq, lk)) if mask == "bool" else mask
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=m)
    got, _ = attention.attend(q, k, v, 0.5, m, return_weights=True)
    tol = 1e-5 if dtype == mx.float32 else 3e-2
    close(got, want, rtol=tol, atol=tol)


def test_kernels_in_threads_agree_with_mlx():
    x = mx.random.normal((2, 9, 9, 3))
    w = mx.random.normal((5, 3, 3, 3))
    x[0, 0, 0, 0] = mx.nan
    w[1, 0, 0, 0] = mx.inf
    want_conv = mx.conv_general(x, w, padding=1)
    want_pool = nn.MaxPool2d(3, 2, 1)(x)
    mx.eval(x, w, want_conv, want_pool)  # a graph belongs to the stream of its thread

    def work(i: int) -> None:
        for _ in range(3):
            close(native.conv(x, w, padding=1), want_conv, rtol=1e-4, atol=1e-4)
            same(native.max_pool(x, 3, stride=2, padding=1), want_pool)
            g = mx.grad(lambda x: native.max_pool(x, 3, stride=2, padding=1).sum())(x)
            mx.eval(g)

    in_threads(work, 4)


def test_native_conv_path_through_kernels_routes_specials_like_mlx():
    x = mx.random.normal((1, 6, 6, 2)).astype(mx.bfloat16)
    w = mx.random.normal((3, 3, 3, 2)).astype(mx.bfloat16)
    w[0, 0, 0, 0] = mx.inf
    got = kernels.conv(x, w, (1, 1), (1, 1), (1, 1), 1)
    close(got, mx.conv_general(x, w, padding=1), rtol=2e-2, atol=2e-2)


@needs_native
@pytest.mark.parametrize("c_out,groups", [(3, 1), (6, 2), (10, 2), (12, 4)])
def test_a_bfloat16_data_gradient_of_odd_channels_per_group_beside_nan_without_amx(c_out,
                                                                                   groups):
    """oneDNN's AVX512-BF16 data gradient (no AMX: an AMD EPYC's path, here through
    ONEDNN_MAX_CPU_ISA) sums a group's output channels in pairs: with an odd count per group
    the last one is paired with the next group's (or pixel's) first, and a NaN cotangent there
    spread into the neighbour's gradient. NaN only where MLX's gradient has it, at every
    position of the cotangent."""
    code = f"""
        import mlx.core as mx, numpy as np
        from fluxlike import native
        if native.native_info().bfloat16 != "native":
            print("skip")
            raise SystemExit
        x = mx.random.normal((1, 4, 4, {groups * 2}), key=mx.random.key(1)).astype(mx.bfloat16)
        w = mx.random.normal(({c_out}, 3, 3, 2), key=mx.random.key(2)).astype(mx.bfloat16)
        shape = mx.conv_general(x, w, padding=1, groups={groups}).shape
        bad = 0
        for i in range(int(np.prod(shape))):
            ct = np.random.default_rng(i).standard_normal(shape).astype(np.float32)
            ct.reshape(-1)[i] = np.nan
            ct = mx.array(ct).astype(mx.bfloat16)
            def grad(conv):
                return mx.vjp(lambda x: conv(x), [x], [ct])[1][0]
            mine = grad(lambda x: native.conv(x, w, padding=1, groups={groups}))
            theirs = grad(lambda x: mx.conv_general(x, w, padding=1, groups={groups}))
            bad += not np.array_equal(np.isnan(np.array(mine.astype(mx.float32))),
                                      np.isnan(np.array(theirs.astype(mx.float32))))
        print("bad", bad)
    """
    run = _subprocess(code, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] in ("skip", "0"), run.stdout
