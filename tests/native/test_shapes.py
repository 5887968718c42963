"""Shapes that vary (issue 27): the matmul modes of native/src/matmul.h, and softmax on a
shape's first use.

- ``gemm``: unbatched float32 products on oneDNN's GEMM without a primitive: no primitive for
  any row count, bit for bit what the primitive computes where that primitive is the same
  GEMM (``gemm:jit:f32``, below AVX-512); elsewhere within float32's rounding.
- ``reused``: a shape's first uses on that GEMM, its primitive from the third here (the
  fourth by default).
- ``primitive``: a primitive per shape from its first use (the behaviour before).
- ``auto``: ``gemm`` where the primitive is the jit GEMM anyway, else ``reused``.
- softmax: up to 2**14 entries always plain loops, up to 2**16 a shape's first uses, its
  primitive from the third here (in mode ``primitive``: from the first); the backward pass always
  the loops where oneDNN's is its scalar reference implementation; convolution's
  forward pass and max pooling: a shape's first use without a primitive too.

Each test runs with two uses of a shape without its primitive (a shape's second use creates
it, as before 2026-12-05; the default, three, and the count itself are tested in
test_background.py). Calls fluxlike_native._ext directly; wall-clock time is measured in
bench/shapes.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest
from helpers import in_threads

if os.environ.get("FLUXLIKE_NATIVE", "").strip().lower() in {"0", "off", "no", "false", "none"}:
    pytest.skip("FLUXLIKE_NATIVE disables the native kernels", allow_module_level=True)
_ext = pytest.importorskip("fluxlike_native._ext")

MODES = ("auto", "primitive", "gemm", "reused")
# Where the primitive is not the jit GEMM (brgemm on AVX-512), the two kernels sum in another
# order: float32 rounding of a K-term sum, relative to the sum of |terms|.
RTOL = 1e-5
SHAPES = [(1, 1, 1), (1, 64, 128), (2, 64, 128), (3, 7, 5), (7, 128, 512), (64, 4096, 8),
          (4, 4096, 4), (33, 128, 512), (256, 512, 128), (1000, 128, 300), (5, 2048, 64)]


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    """Each test starts from an empty cache in mode ``auto``, primitives created on the
    evaluating thread (a shape's second use creates its primitive then; the worker thread's
    creations are tested in test_background.py), and leaves mode, capacity and that setting
    as it found them."""
    mode = _ext.set_matmul_mode("auto")
    capacity = _ext.set_cache_capacity(4096)
    background = _ext.set_background_creation(False)
    uses = _ext.set_uses_without_primitive(2)
    _ext.clear_cache()
    yield
    _ext.set_matmul_mode(mode)
    _ext.set_cache_capacity(capacity)
    _ext.set_background_creation(background)
    _ext.set_uses_without_primitive(uses)
    _ext.clear_cache()


def linear(x: mx.array, w: mx.array, b: mx.array | None = None, relu: bool = False) -> mx.array:
    return _ext.matmul(x, w, b, False, True, relu, None, False, False)


def results(mode: str, x: mx.array, w: mx.array, b: mx.array | None, relu: bool,
            g: mx.array) -> list[np.ndarray]:
    """The product, its two gradients (dx: rows again, dW: a product over the rows) and the
    product of a column-major x, computed in ``mode``."""
    _ext.set_matmul_mode(mode)

    def loss(x: mx.array, w: mx.array) -> mx.array:
        return (linear(x, w, b, relu) * g).sum()

    y = linear(x, w, b, relu)
    dx, dw = mx.grad(loss, argnums=(0, 1))(x, w)
    x_cols = mx.array(np.asfortranarray(np.array(x)))
    y_cols = linear(x_cols, w, b, relu)
    mx.eval(y, dx, dw, y_cols)
    return [np.array(t) for t in (y, dx, dw, y_cols)]


def same(got: np.ndarray, want: np.ndarray, scale: np.ndarray | float) -> None:
    """Bit for bit where the primitive is oneDNN's jit GEMM; else within :data:`RTOL`."""
    if _ext.primitive_is_jit_gemm():
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * np.max(scale) + 1e-30)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_computes_what_the_primitive_computes(shape):
    m, k, n = shape
    x, w = mx.random.normal((m, k)), mx.random.normal((n, k))
    b, g = mx.random.normal((n,)), mx.random.normal((m, n))
    for bias in (None, b):
        for relu in (False, True):
            want = results("primitive", x, w, bias, relu, g)
            got = results("gemm", x, w, bias, relu, g)
            scale = np.abs(np.array(x)) @ np.abs(np.array(w)).T  # sum of |terms| per output
            for name, p, q in zip(("y", "dx", "dw", "y_cols"), want, got, strict=True):
                if name == "y" or name == "y_cols":
                    same(q, p, scale)
                else:
                    np.testing.assert_allclose(q, p, rtol=RTOL, atol=RTOL * np.abs(p).max())
                    if _ext.primitive_is_jit_gemm():
                        np.testing.assert_array_equal(q, p, err_msg=name)


def test_gemm_creates_no_primitive_for_any_row_count():
    _ext.set_matmul_mode("gemm")
    w, b = mx.random.normal((48, 32)), mx.random.normal((48,))
    x = mx.random.normal((300, 32))
    for m in (1, 2, 5, 17, 64, 100, 255, 300):
        y = linear(x[:m], w, b, True)
        g = mx.grad(lambda x, w: linear(x, w, b, True).sum(), argnums=(0, 1))(x[:m], w)
        mx.eval(y, g)
        ref = np.maximum(np.array(x[:m]) @ np.array(w).T + np.array(b), 0)
        np.testing.assert_allclose(np.array(y), ref, rtol=1e-5, atol=1e-5)
    info = _ext.cache_info()["ops"]["matmul"]
    assert info["creations"] == 0 and info["size"] == 0 and info["misses"] == 0


def test_rows_agree_across_row_counts():
    """A row's result in a product of m rows against the same row in a product of 300: within
    float32's rounding (not bit for bit: oneDNN's jit GEMM computes the rows past the last
    full block of its kernel, 6 rows on AVX2, with a tail kernel; so did the primitive per
    shape before, bench/results/2026-12-04-shapes.md)."""
    w = mx.random.normal((96, 80))
    x = mx.random.normal((300, 80))
    for mode in ("gemm", "primitive"):
        _ext.set_matmul_mode(mode)
        full = np.array(linear(x, w))
        scale = np.abs(np.array(x)) @ np.abs(np.array(w)).T
        for m in (1, 2, 3, 7, 8, 31, 32, 128, 299):
            part = np.array(linear(x[:m], w))
            np.testing.assert_allclose(part, full[:m], rtol=0, atol=RTOL * scale[:m].max())


def test_reused_creates_a_primitive_from_a_shapes_second_use():
    _ext.set_matmul_mode("reused")
    assert _ext.matmul_mode() == "reused"
    x, w = mx.random.normal((9, 16)), mx.random.normal((8, 16))
    ys = [np.array(linear(x, w)) for _ in range(3)]
    info = _ext.cache_info()["ops"]["matmul"]
    # the first call missed and ran the GEMM; the second missed again and made the
    # primitive; the third found it
    assert (info["misses"], info["creations"], info["hits"], info["size"]) == (2, 1, 1, 1)
    scale = np.abs(np.array(x)) @ np.abs(np.array(w)).T
    same(ys[0], ys[1], scale)
    np.testing.assert_array_equal(ys[1], ys[2])
    for m in range(1, 9):  # each row count seen once: nothing made
        mx.eval(linear(x[:m], w))
    assert _ext.cache_info()["ops"]["matmul"]["creations"] == 1


def test_reused_under_a_tiny_cache_stays_right_and_bounded():
    _ext.set_matmul_mode("reused")
    _ext.set_cache_capacity(2)
    w = mx.random.normal((8, 16))
    x = mx.random.normal((40, 16))
    ref = np.array(x) @ np.array(w).T
    for _ in range(3):
        for m in range(1, 40, 3):
            np.testing.assert_allclose(np.array(linear(x[:m], w)), ref[:m], rtol=1e-5, atol=1e-5)
    info = _ext.cache_info()["ops"]["matmul"]
    assert info["size"] <= 2 and info["evictions"] == max(0, info["creations"] - 2)


def test_auto_is_gemm_and_a_product_keeps_its_bits_from_call_to_call():
    # ('reused', the default on AVX-512 before, changed a shape's results in their last bits
    # from its third call on, where the brgemm primitive took over from the GEMM)
    assert _ext.matmul_mode() == "gemm" and _ext.direct_gemm()
    x, w, g = mx.random.normal((33, 128)), mx.random.normal((300, 128)), mx.random.normal((33, 300))
    calls = [results("auto", x, w, None, False, g) for _ in range(4)]
    for later in calls[1:]:
        for a, b in zip(calls[0], later, strict=True):
            np.testing.assert_array_equal(a, b)


def test_auto_runs_a_large_forward_product_on_its_primitive_where_that_is_brgemm():
    """From 2**29 multiply-adds a linear layer's forward product (x @ W^T) runs on its
    primitive where that is not the GEMM (brgemm, AVX-512: 0.77-0.91x the GEMM's time): the
    primitive's bits from the first call on; the backward layouts and smaller products on the
    GEMM (no primitive). Where the primitive is the jit GEMM: the GEMM for all."""
    x, w = mx.random.normal((128, 2048)), mx.random.normal((2048, 2048))
    g = mx.random.normal((128, 2048))
    mx.eval(x, w, g)
    _ext.set_matmul_mode("primitive")
    want = np.array(linear(x, w))
    _ext.clear_cache()
    _ext.set_matmul_mode("auto")
    calls = [np.array(linear(x, w)) for _ in range(3)]
    brgemm = not _ext.primitive_is_jit_gemm()
    assert _ext.cache_info()["ops"]["matmul"]["creations"] == (1 if brgemm else 0)
    for got in calls:
        if brgemm:
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, calls[0])
    # dx = g @ W, dW = g^T @ x, and a forward product one row short of 2**29: the GEMM
    mx.eval(_ext.matmul(g, w, None, False, False, False, None, False, False),
            _ext.matmul(g, x, None, True, False, False, None, False, False),
            linear(x[:127], w))
    assert _ext.cache_info()["ops"]["matmul"]["creations"] == (1 if brgemm else 0)


def test_set_matmul_mode_returns_the_old_and_names_the_choices():
    assert _ext.set_matmul_mode("gemm") == "auto"
    assert _ext.set_matmul_mode("primitive") == "gemm"
    with pytest.raises(ValueError, match="set_matmul_mode: mode must be 'auto', 'primitive', "
                       "'gemm' or 'reused', got 'fast'"):
        _ext.set_matmul_mode("fast")
    assert _ext.matmul_mode() == "primitive"


@pytest.mark.parametrize("mode", ["gemm", "reused"])
def test_threads_building_and_evaluating_at_once(mode):
    """Six threads, each its own row counts and one shared, started together: right results
    (the GEMM keeps no state between calls; reused mode races to create the shared one)."""
    _ext.set_matmul_mode(mode)
    _ext.set_cache_capacity(3)
    w = mx.random.normal((24, 40))
    x = mx.random.normal((64, 40))
    mx.eval(w, x)
    ref = np.array(x) @ np.array(w).T

    def work(k: int) -> None:
        for m in (64, 10 + k, 30 + k):
            y = np.array(linear(x[:m], w))
            np.testing.assert_allclose(y, ref[:m], rtol=1e-5, atol=1e-5)

    in_threads(work, 6, rounds=4)


def test_fluxlike_native_matmul_mode_sets_and_reads():
    from fluxlike import native

    assert native.matmul_mode() == _ext.matmul_mode()
    assert native.matmul_mode("primitive") == "primitive"
    assert native.matmul_mode() == "primitive"
    with pytest.raises(ValueError, match=r"matmul_mode: mode must be one of .*got 'fast'"):
        native.matmul_mode("fast")
    assert native.matmul_mode("auto") in ("gemm", "reused")


# ---------------------------------------------------------------- softmax: a shape's first use

def softmax_and_grad(x: mx.array, g: mx.array) -> tuple[np.ndarray, np.ndarray]:
    y, (dx,) = mx.vjp(lambda x: _ext.softmax(x), [x], [g])
    return np.array(y[0]), np.array(dx)


def softmax_counts() -> tuple[int, int, int]:
    info = _ext.cache_info()["ops"]["softmax"]
    return info["creations"], info["hits"], info["size"]


def softmax_reference(x: mx.array, g: mx.array) -> tuple[np.ndarray, np.ndarray]:
    y = np.array(mx.softmax(x, axis=-1, precise=True))
    return y, y * (np.array(g) - (np.array(g) * y).sum(-1, keepdims=True))


@pytest.mark.parametrize("shape", [(1, 4, 9, 9), (3, 4, 5, 17), (2, 64, 128), (1, 1, 3)])
def test_a_small_softmax_runs_loops_and_never_makes_a_primitive(shape):
    # up to 2**14 entries: generation's scores, a column longer per token, would make a
    # primitive (0.2 ms on AVX2) every step; the loops are as fast as the primitive there
    x, g = mx.random.normal(shape) * 4, mx.random.normal(shape)
    x = mx.where(mx.random.uniform(shape=shape) < 0.2, -mx.inf, x)  # masked entries: exactly 0
    x[..., 0] = 1.0  # (no row all -inf: that one is NaN, as MLX's)
    results = [softmax_and_grad(x, g) for _ in range(3)]
    assert softmax_counts() == (0, 0, 0)
    want_y, want_dx = softmax_reference(x, g)
    for y, dx in results:
        np.testing.assert_allclose(y, want_y, rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(y == 0, want_y == 0)
    np.testing.assert_array_equal(results[0][0], results[2][0])


def test_a_mid_sized_softmax_shape_runs_loops_on_its_first_use_then_makes_a_primitive():
    x, g = mx.random.normal((4, 8, 40, 40)) * 4, mx.random.normal((4, 8, 40, 40))  # 51,200
    first = softmax_and_grad(x, g)
    assert softmax_counts() == (0, 0, 0)  # forward and backward: the loops
    second, third = softmax_and_grad(x, g), softmax_and_grad(x, g)
    # (the backward pass runs its loops always where oneDNN's is its scalar reference one)
    made = 1 if _ext.softmax_backward_is_reference() else 2
    assert softmax_counts() == (made, made, made)
    want_y, want_dx = softmax_reference(x, g)
    for y, dx in (first, second):  # the loops and the primitive: float32's rounding apart
        np.testing.assert_allclose(y, want_y, rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(second[0], third[0])


def test_the_softmax_loops_give_nan_rows_as_the_primitive_does():
    inf, nan = float("inf"), float("nan")
    x = mx.array([[0.0, 1.0, 2.0], [nan, 0.0, 1.0], [inf, 0.0, 1.0], [-inf, -inf, -inf],
                  [-inf, 0.0, 0.0]])
    loops = np.array(_ext.softmax(x))
    assert softmax_counts()[0] == 0
    _ext.set_matmul_mode("primitive")
    primitive = np.array(_ext.softmax(x))
    assert softmax_counts()[0] == 1
    np.testing.assert_array_equal(np.isnan(loops), np.isnan(primitive))
    assert np.isnan(loops[1:4]).all() and not np.isnan(loops[[0, 4]]).any()
    np.testing.assert_allclose(loops[[0, 4]], primitive[[0, 4]], rtol=2e-6)


def test_a_large_softmax_shape_or_mode_primitive_makes_its_primitive_on_first_use():
    mx.eval(_ext.softmax(mx.random.normal((300, 300))))  # above 2**16 entries
    assert _ext.cache_info()["ops"]["softmax"]["creations"] == 1
    _ext.set_matmul_mode("primitive")
    mx.eval(_ext.softmax(mx.random.normal((2, 9))))
    assert _ext.cache_info()["ops"]["softmax"]["creations"] == 2


# ---------------------------------------------------------------- convolution: a first use

def conv(x: mx.array, w: mx.array, b: mx.array | None = None, relu: bool = False,
         padding: int = 1, groups: int = 1) -> mx.array:
    pad = [padding] * (x.ndim - 2)
    ones = [1] * (x.ndim - 2)
    return _ext.conv(x, w, b, ones, pad, pad, ones, groups, False, relu=relu)


def conv_counts() -> tuple[int, int, int]:
    info = _ext.cache_info()["ops"]["conv"]
    return info["misses"], info["creations"], info["hits"]


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_a_float32_convolution_runs_mlxs_kernel_on_a_shapes_first_use(relu, groups):
    # an image size seen once would pay a primitive's creation (0.2-0.5 ms on AVX2), more
    # than a small convolution costs
    x = mx.random.normal((2, 9, 11, 4))
    w, b = mx.random.normal((6, 3, 3, 4 // groups)), mx.random.normal((6,))
    first = np.array(conv(x, w, b, relu, groups=groups))
    assert conv_counts() == (1, 0, 0)
    second, third = np.array(conv(x, w, b, relu, groups=groups)), np.array(
        conv(x, w, b, relu, groups=groups))
    assert conv_counts() == (2, 1, 1)
    want = mx.conv_general(x, w, padding=1, groups=groups) + b  # what the kernels-off path does
    want = np.array(mx.maximum(want, 0) if relu else want)
    np.testing.assert_array_equal(first, want)  # MLX's own kernel: bit for bit
    np.testing.assert_allclose(second, want, rtol=1e-5, atol=1e-5)  # oneDNN's
    np.testing.assert_array_equal(second, third)


def test_the_gradient_through_a_first_use_is_the_convolutions_gradient():
    x, w = mx.random.normal((2, 7, 7, 3)), mx.random.normal((5, 3, 3, 3))
    g = mx.random.normal((2, 7, 7, 5))

    def grads(fn):
        return [np.array(a) for a in mx.vjp(fn, [x, w], [g])[1]]

    got = grads(lambda x, w: conv(x, w))  # the forward's first use: MLX's kernel
    want = grads(lambda x, w: mx.conv_general(x, w, padding=1))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_first_use_inside_mx_compile_and_mode_primitive():
    x, w = mx.random.normal((1, 6, 6, 2)), mx.random.normal((3, 3, 3, 2))
    f = mx.compile(lambda x: conv(x, w))
    ys = [np.array(f(x)) for _ in range(3)]  # traced once, evaluated three times
    assert conv_counts() == (2, 1, 1)  # decided at each evaluation, not baked into the trace
    np.testing.assert_allclose(ys[0], ys[2], rtol=1e-5, atol=1e-5)
    _ext.set_matmul_mode("primitive")
    mx.eval(conv(mx.random.normal((1, 5, 5, 2)), w))
    assert conv_counts()[1] == 2  # a new shape's primitive from its first use


# ---------------------------------------------------------------- max pooling: a first use

def pool_counts() -> tuple[int, int]:
    info = _ext.cache_info()["ops"]["max_pool"]
    return info["misses"], info["creations"]


POOLS = [  # (x shape, kernel, stride, pad_lo, pad_hi)
    ((2, 9, 11, 3), [2, 2], [2, 2], [0, 0], [0, 0]),
    ((2, 9, 11, 3), [3, 3], [1, 2], [1, 1], [1, 0]),  # overlapping, padded
    ((1, 13, 5), [4], [3], [2], [1]),
    ((1, 4, 5, 6, 2), [2, 3, 2], [1, 2, 2], [1, 0, 1], [0, 1, 1]),
]


@pytest.mark.parametrize("case", range(len(POOLS)))
@pytest.mark.parametrize("values", ["normal", "ties", "special"])
def test_a_max_pools_first_use_writes_what_its_primitive_writes(case, values):
    # the loops that spare a shape's first use its primitives: the output and the workspace
    # (where each maximum is: the gradient goes there) are the primitive's, bit for bit, and
    # so is the gradient where windows do not overlap (one cotangent per entry; where they do,
    # the same terms in another order than oneDNN's)
    shape, kernel, stride, lo, hi = POOLS[case]
    x = mx.random.normal(shape)
    if values == "ties":  # the first maximum of a window is the one the gradient reaches
        x = mx.round(x)
    elif values == "special":  # NaN, -inf windows, the lowest finite value
        flat = np.array(x).reshape(-1)
        flat[::5] = -np.inf
        flat[3::17] = np.nan
        flat[7::11] = np.finfo(np.float32).min
        x = mx.array(flat.reshape(shape))
    g = mx.random.normal(tuple(np.array(_ext.max_pool(x, kernel, stride, lo, hi, False)).shape))
    _ext.clear_cache()

    def run() -> list[np.ndarray]:
        y, (dx,) = mx.vjp(lambda x: _ext.max_pool(x, kernel, stride, lo, hi, False), [x], [g])
        return [np.array(y[0]), np.array(dx)]

    first = run()
    assert pool_counts() == (2, 0)  # the forward and the backward missed and ran the loops
    second = run()
    assert pool_counts() == (4, 2)  # their primitives, from the second use
    np.testing.assert_array_equal(first[0], second[0])
    if all(s >= q for s, q in zip(stride, kernel, strict=True)):
        np.testing.assert_array_equal(first[1], second[1])
    else:
        np.testing.assert_allclose(first[1], second[1], rtol=1e-6, atol=1e-6)


def test_a_bfloat16_or_mode_primitive_pooling_makes_its_primitive_on_first_use():
    _ext.set_matmul_mode("primitive")
    mx.eval(_ext.max_pool(mx.random.normal((1, 4, 4, 2)), [2, 2], [2, 2], [0, 0], [0, 0],
                          False))
    assert pool_counts() == (1, 1)


def test_threads_meeting_first_uses_of_convolutions_pools_and_softmaxes_at_once():
    """Six threads, each evaluating convolutions, poolings and softmaxes of image sizes some
    shared, some their own, under a tiny cache: first uses (MLX's convolution, the loops)
    and primitives interleave; every result is MLX's."""
    _ext.set_cache_capacity(4)
    w = mx.random.normal((6, 3, 3, 4))
    images = {n: mx.random.normal((2, n, n, 4)) for n in range(5, 17)}
    mx.eval(w, *images.values())
    want = {n: np.array(mx.conv_general(x, w, padding=1)) for n, x in images.items()}

    def work(k: int) -> None:
        for n in (5, 6 + k, 12 + k // 2):
            y = conv(images[n], w)
            pooled = _ext.max_pool(y, [2, 2], [2, 2], [0, 0], [0, 0], False)
            scores = _ext.softmax(y.reshape(2, n * n, 6))
            np.testing.assert_allclose(np.array(y), want[n], rtol=1e-5, atol=1e-4)
            ref_pool = mx.max(mx.array(want[n])[:, : n // 2 * 2, : n // 2 * 2]
                              .reshape(2, n // 2, 2, n // 2, 2, 6), axis=(2, 4))
            np.testing.assert_allclose(np.array(pooled), np.array(ref_pool), rtol=1e-5,
                                       atol=1e-4)
            ref_soft = mx.softmax(mx.array(want[n]).reshape(2, n * n, 6), axis=-1)
            np.testing.assert_allclose(np.array(scores), np.array(ref_soft), rtol=1e-4,
                                       atol=1e-5)

    in_threads(work, 6, rounds=3)


def test_first_uses_mlx_cannot_take_or_too_large_create_the_primitive():
    # a grouped 3-D convolution (MLX's conv_general takes groups in 1-2 axes only); a large
    # convolution or pooling (there MLX's kernel or the loops cost more than a creation)
    x3, w3 = mx.ones((1, 4, 4, 4, 4)), mx.ones((4, 3, 3, 3, 2))
    y = np.array(conv(x3, w3, groups=2))
    assert conv_counts()[1] == 1
    assert y.shape == (1, 4, 4, 4, 4) and y.max() == 54.0  # 27 taps x 2 channels, inside
    big, wb = mx.random.normal((2, 32, 32, 32)), mx.random.normal((32, 3, 3, 32))
    mx.eval(conv(big, wb))  # 2 x 32 x 32 x 32 outputs x 288: 2**23 multiply-adds
    assert conv_counts()[1] == 2
    mx.eval(_ext.max_pool(mx.random.normal((4, 64, 64, 32)), [2, 2], [2, 2], [0, 0], [0, 0],
                          False))
    assert pool_counts() == (1, 1)


def test_shapes_cycling_through_a_cache_smaller_than_them_still_get_primitives():
    _ext.set_cache_capacity(4)
    w = mx.random.normal((3, 3, 3, 2))
    images = [mx.random.normal((1, n, n, 2)) for n in range(5, 11)]  # 6 shapes, capacity 4
    for _ in range(4):
        for x in images:
            mx.eval(conv(x, w))
    assert conv_counts()[1] >= 6  # each made from its second use (then evicted and remade)


BACKWARDS = [  # (x shape, w shape, stride, pad_lo, pad_hi, dilation)
    ((2, 9, 11, 4), (6, 3, 3, 4), [1, 1], [1, 1], [1, 1], [1, 1]),
    ((2, 9, 11, 4), (6, 3, 3, 4), [2, 2], [0, 1], [1, 0], [1, 1]),
    ((2, 12, 10, 4), (6, 3, 2, 4), [1, 2], [2, 0], [1, 1], [2, 1]),
    ((3, 17, 5), (7, 5, 5), [2], [2], [2], [1]),
    ((2, 6, 7, 5, 3), (4, 3, 3, 2, 3), [1, 2, 1], [1, 0, 1], [1, 1, 0], [1, 1, 2]),
]


@pytest.mark.parametrize("case", range(len(BACKWARDS)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_convolutions_backward_passes_run_a_gemm_on_a_shapes_first_use(case, dtype):
    # the input and weight gradients without their primitives (two creations a new image
    # size would pay in training): oneDNN's GEMM over the input's patches; from the second
    # use the primitives. Both are the convolution's gradient to float32 rounding.
    xs, ws, stride, lo, hi, dilation = BACKWARDS[case]
    x, w = mx.random.normal(xs).astype(dtype), mx.random.normal(ws).astype(dtype)

    # (in float32 kernels: float32, a CPU without bfloat16 kernels, an odd channel count)
    upcast = dtype == mx.float32 or not _ext.isa_has_bf16() or ws[-1] % 2 == 1

    def f(x: mx.array, w: mx.array) -> mx.array:  # (bfloat16 kernels where the CPU has them)
        return _ext.conv(x, w, None, stride, lo, hi, dilation, 1, not upcast)

    g = mx.random.normal(f(x, w).shape).astype(dtype)
    _ext.clear_cache()

    def grads() -> list[np.ndarray]:
        return [np.array(a.astype(mx.float32)) for a in mx.vjp(f, [x, w], [g])[1]]

    first = grads()
    assert conv_counts() == ((2, 0, 0) if upcast else (2, 2, 0))  # (the forward: not traced)
    second = grads()
    assert conv_counts()[1] == 2
    want = mx.vjp(lambda x, w: mx.conv_general(x.astype(mx.float32), w.astype(mx.float32),
                                               stride, (lo, hi), dilation), [x, w],
                  [g.astype(mx.float32)])[1]
    tol = 2e-6 if dtype == mx.float32 else 1e-2  # (bfloat16: the result's one rounding)
    for a, b, c in zip(first, second, want, strict=True):
        c = np.array(c.astype(mx.float32))
        scale = np.abs(c).max()
        np.testing.assert_allclose(a, c, rtol=0, atol=tol * scale)
        np.testing.assert_allclose(b, c, rtol=0, atol=tol * scale)


def test_a_grouped_convolutions_backward_passes_make_their_primitives_on_first_use():
    x, w = mx.random.normal((2, 7, 7, 4)), mx.random.normal((6, 3, 3, 2))
    g = mx.random.normal((2, 5, 5, 6))
    dx, dw = mx.vjp(lambda x, w: _ext.conv(x, w, None, [1, 1], [0, 0], [0, 0], [1, 1], 2,
                                           False), [x, w], [g])[1]
    mx.eval(dx, dw)
    assert conv_counts()[1] == 2  # (the GEMM path takes one group)
    want = mx.vjp(lambda x, w: mx.conv_general(x, w, groups=2), [x, w], [g])[1]
    for a, b in zip((dx, dw), want, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
