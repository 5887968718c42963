"""bfloat16 products for any row count (issue 27; native/src/matmul.cpp: any_rows).

Where oneDNN's matmul for a runtime row count is its brgemm kernel (AMX), a bfloat16 product
of 1 or at least ``any_rows_min()`` rows runs on one primitive per weight shape and thread
count, whatever its row count; 2 to 7 rows (where that kernel is up to 2.3x slower) keep a
primitive per shape. The kernel rounds like the per-shape primitive except in the last row
past a block (an ulp or so in float32); a given shape always runs on the same kernel, so a
product keeps its bits from call to call.

A batched bfloat16 product of at most 2**20 multiply-adds (attention's ``q @ k^T`` and
``p @ v`` at generation's sizes) runs on one primitive per batch shape and operand layout made
for any sizes of its last two axes (oneDNN's jit GEMM), larger ones on a primitive per shape.

Skipped where the runtime-row kernel is not brgemm (no AMX, or oneDNN capped below it):
bfloat16 products there keep a primitive per shape, as tests/native/test_shapes.py and
test_matmul.py check.
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
if not _ext.any_rows_kernel():
    pytest.skip("no brgemm kernel for a runtime row count here (AMX)", allow_module_level=True)

# float32 rounding of a K-term sum, relative to the sum of |terms|: the last row's tolerance.
RTOL = 2.0**-20


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    """An empty cache, mode ``auto`` and the default row floor, restored after the test."""
    mode = _ext.set_matmul_mode("auto")
    floor = _ext.set_any_rows_min(8)
    background = _ext.set_background_creation(False)
    _ext.clear_cache()
    yield
    _ext.set_matmul_mode(mode)
    _ext.set_any_rows_min(floor)
    _ext.set_background_creation(background)
    _ext.clear_cache()


def linear(x: mx.array, w: mx.array, b: mx.array | None = None, relu: bool = False,
           out: mx.Dtype | None = None) -> mx.array:
    return _ext.matmul(x, w, b, False, True, relu, out, False, True)


def operands(m: int, k: int, n: int, seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    keys = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((m, k), key=keys[0]).astype(mx.bfloat16)
    w = mx.random.normal((n, k), key=keys[1]).astype(mx.bfloat16)
    b = mx.random.normal((n,), key=keys[2]).astype(mx.bfloat16)
    return x, w, b


def made() -> tuple[int, int]:
    """(primitives created, entries held) for matmul."""
    info = _ext.cache_info()["ops"]["matmul"]
    return info["creations"], info["size"]


def per_shape(call) -> np.ndarray:  # type: ignore[no-untyped-def]
    """``call()`` evaluated on a primitive per shape (mode ``primitive``), in float32."""
    mode = _ext.set_matmul_mode("primitive")
    try:
        return np.array(call().astype(mx.float32))
    finally:
        _ext.set_matmul_mode(mode)


def test_a_layer_makes_one_primitive_for_every_row_count_it_sees():
    x, w, b = operands(600, 64, 96)
    rows = [1, 8, 9, 17, 33, 64, 65, 100, 128, 129, 255, 300, 511, 600]
    for m in rows:
        mx.eval(linear(x[:m], w, b, relu=True))
    assert made() == (1, 1)
    assert [impl for impl, _ in _ext.cache_impls()] == ["brg:avx512_core_amx"]
    for m in rows:  # seen again: nothing more
        mx.eval(linear(x[:m], w, b, relu=True))
    assert made() == (1, 1)


def test_two_to_seven_rows_keep_a_primitive_per_shape():
    x, w, _ = operands(8, 64, 96)
    for m in range(2, 8):
        mx.eval(linear(x[:m], w))
    assert made() == (6, 6)


def test_the_row_floor_is_settable_and_checked():
    x, w, _ = operands(64, 32, 16)
    assert _ext.set_any_rows_min(10**9) == 8
    assert _ext.any_rows_min() == 10**9
    for m in (8, 16, 64):
        mx.eval(linear(x[:m], w))
    assert made() == (3, 3)  # one per shape
    _ext.set_any_rows_min(2)
    for m in (2, 3, 5):
        mx.eval(linear(x[:m], w))
    assert made() == (4, 4)  # and one for them all
    with pytest.raises(ValueError, match=r"set_any_rows_min: rows must be at least 1, got 0"):
        _ext.set_any_rows_min(0)
    assert _ext.any_rows_min() == 2


def test_mode_primitive_turns_it_off():
    _ext.set_matmul_mode("primitive")
    assert not _ext.any_rows_kernel()
    x, w, _ = operands(64, 32, 16)
    for m in (8, 16, 64):
        mx.eval(linear(x[:m], w))
    assert made() == (3, 3)


@pytest.mark.parametrize("k, n", [(64, 96), (256, 512), (100, 36), (2048, 64)])
def test_results_are_the_shapes_own_but_in_a_last_row_past_a_block(k, n):
    """Every row but the last bit for bit as the per-shape primitive computes it, the last
    within float32's rounding; bias, ReLU and both result dtypes."""
    x, w, b = operands(1100, k, n)
    scale = np.abs(np.array(x.astype(mx.float32))) @ np.abs(np.array(w.astype(mx.float32))).T
    for m in (1, 8, 9, 16, 17, 33, 64, 65, 100, 129, 257, 1000, 1100):
        for bias, relu, out in ((None, False, mx.float32), (b, True, None), (b, False, mx.float32)):
            got = np.array(linear(x[:m], w, bias, relu, out).astype(mx.float32))
            want = per_shape(lambda m=m, bias=bias, relu=relu, out=out:
                             linear(x[:m], w, bias, relu, out))
            np.testing.assert_array_equal(got[:-1], want[:-1], err_msg=f"{m} rows")
            # (a bfloat16 result may round the last row's float32 difference to an ulp)
            ulp = np.abs(want[-1]) * 2.0**-8 if out is None else 0.0
            np.testing.assert_array_less(np.abs(got[-1] - want[-1]),
                                         RTOL * scale[m - 1].max() + ulp + 1e-30)


def test_a_product_keeps_its_bits_from_call_to_call():
    x, w, b = operands(300, 128, 64)
    for m in (1, 2, 7, 8, 9, 65, 257, 300):
        calls = [np.array(linear(x[:m], w, b, out=mx.float32)) for _ in range(3)]
        for c in calls[1:]:
            np.testing.assert_array_equal(c, calls[0], err_msg=f"{m} rows")


def test_leading_axes_flatten_into_rows():
    x, w, b = operands(4 * 37, 64, 48)
    x3 = x.reshape(4, 37, 64)
    y = linear(x3, w, b, out=mx.float32)
    assert y.shape == (4, 37, 48)
    np.testing.assert_array_equal(np.array(y).reshape(-1, 48),
                                  np.array(linear(x, w, b, out=mx.float32)))
    assert made() == (1, 1)


def test_input_gradients_run_on_it_and_match_the_per_shape_primitive():
    """dx (rows again) runs on the primitive for any row count; dW (a sum over the rows) keeps
    its shape's."""
    x, w, b = operands(300, 64, 96)
    g = mx.random.normal((300, 96)).astype(mx.bfloat16)

    def grads(m: int) -> tuple[mx.array, mx.array]:
        def loss(x: mx.array, w: mx.array) -> mx.array:
            return (linear(x, w, b, relu=True, out=mx.float32) * g[:m]).sum()
        return mx.grad(loss, argnums=(0, 1))(x[:m], w)

    for m in (16, 64, 128, 300):
        dx, dw = grads(m)
        mx.eval(dx, dw)
    # one primitive each for the product and dx, whatever the rows; dW: one per row count
    assert made() == (2 + 4, 2 + 4)
    for m in (16, 64, 128, 300):
        dx, dw = grads(m)
        mx.eval(dx, dw)
        want_dx = per_shape(lambda m=m: grads(m)[0])
        want_dw = per_shape(lambda m=m: grads(m)[1])
        np.testing.assert_array_equal(np.array(dx.astype(mx.float32))[:-1], want_dx[:-1])
        np.testing.assert_allclose(np.array(dx.astype(mx.float32)), want_dx, rtol=2**-7,
                                   atol=1e-3)
        np.testing.assert_array_equal(np.array(dw.astype(mx.float32)), want_dw)


def test_each_thread_count_gets_its_own_and_results_are_the_shapes():
    """Below and above the one-thread threshold (cpu.h): a primitive for each."""
    x, w, _ = operands(4096, 512, 512)
    for m in (64, 4096):  # 2**21 and 2**30 multiply-adds: one thread, then two
        got = np.array(linear(x[:m], w, out=mx.float32))
        want = per_shape(lambda m=m: linear(x[:m], w, out=mx.float32))
        np.testing.assert_array_equal(got[:-1], want[:-1])
    mx.eval(linear(x[:100], w, out=mx.float32), linear(x[:3000], w, out=mx.float32))
    assert made()[0] == 2 + 2  # (and the two per-shape references)


def test_packed_weights_run_on_it_too_and_match_the_plain_product():
    x, w, b = operands(700, 256, 128)
    packed = _ext.pack_weights(w)
    if packed is None:
        pytest.skip("no packed layout for these weights here")
    for m in (1, 3, 8, 33, 64, 100, 700):
        got = _ext.packed_linear(x[:m], w, b, packed, False, mx.float32)
        np.testing.assert_array_equal(np.array(got), np.array(linear(x[:m], w, b, out=mx.float32)),
                                      err_msg=f"{m} rows")
    impls = dict(_ext.cache_impls())
    # plain: one for any rows and one for 3 rows; packed: the same
    assert made()[0] == 4 and set(impls) == {"brg:avx512_core_amx"}


def test_threads_evaluating_many_row_counts_at_once():
    x, w, b = operands(512, 64, 64)
    want = {m: np.array(linear(x[:m], w, b, out=mx.float32)) for m in range(8, 512, 37)}
    _ext.clear_cache()

    def work(i: int) -> None:
        for m in sorted(want, key=lambda m: (m * (i + 1)) % 97):
            np.testing.assert_array_equal(np.array(linear(x[:m], w, b, out=mx.float32)),
                                          want[m])

    in_threads(work, 4)
    assert made()[1] == 1


def attention(q: mx.array, k: mx.array, out: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
    """``q @ k^T`` and ``(q @ k^T) @ k`` as batched products (attention's two)."""
    s = _ext.matmul(q, k, None, False, True, False, out, True, True)
    return s, _ext.matmul(s.astype(mx.bfloat16), k, None, False, False, False, out, True, True)


def test_small_batched_products_make_one_primitive_per_layout_for_any_length():
    """Attention at generation's sizes (1 x 4 heads x L x 32 up to 2**20 multiply-adds, L up
    to 90): one primitive for q @ k^T and one for p @ v, whatever L; larger, one per shape
    (bench/results/2026-12-05-any-rows.md)."""
    q, k, _ = operands(4 * 120 * 32, 1, 1)
    q, k = q.reshape(1, 4, 120, 32), q[::-1].reshape(1, 4, 120, 32)
    for length in range(2, 91):  # (one token: p @ v sums one entry, in float32 kernels)
        mx.eval(attention(q[:, :, :length], k[:, :, :length]))
    assert made() == (2, 2)
    assert {impl for impl, _ in _ext.cache_impls()} == {"gemm:jit:bf16"}
    for length in (91, 120):  # 4 * L * L * 32 > 2**20
        mx.eval(attention(q[:, :, :length], k[:, :, :length]))
    assert made() == (6, 6)


@pytest.mark.parametrize("out", [None, mx.float32], ids=["bf16", "f32"])
def test_small_batched_products_round_as_the_shapes_own_within_an_ulp(out):
    q, k, _ = operands(2 * 3 * 64 * 40, 1, 1, seed=3)
    q, k = q.reshape(2, 3, 64, 40), q[::-1].reshape(2, 3, 64, 40)
    for length in (1, 2, 7, 17, 33, 64):
        qs, ks = q[:, :, :length], k[:, :, :length]
        got = [np.array(t.astype(mx.float32)) for t in attention(qs, ks, out)]
        again = [np.array(t.astype(mx.float32)) for t in attention(qs, ks, out)]
        want = [per_shape(lambda i=i, qs=qs, ks=ks: attention(qs, ks, out)[i]) for i in range(2)]
        for g, a, w in zip(got, again, want, strict=True):
            np.testing.assert_array_equal(g, a)  # the same bits on every call
            tol = (np.abs(w) * 2.0**-8 if out is None else 0.0) + 2.0**-20 * np.abs(w).max()
            np.testing.assert_array_less(np.abs(g - w), tol + 1e-30)


def test_a_row_sliced_from_a_longer_array_is_one_row_like_any_other():
    """The last row of a (1, L, D) array (its row stride L * D, never stepped) runs on the
    primitive for any row count, as a fresh row does: one primitive for every L, the same bits
    as the 3-D form of the same row."""
    _, w, _ = operands(1, 256, 96)
    h = mx.random.normal((1, 40, 256)).astype(mx.bfloat16)
    for length in range(1, 41):
        got = linear(h[:, length - 1, :], w, out=mx.float32)
        np.testing.assert_array_equal(np.array(got),
                                      np.array(linear(h[:, length - 1:length, :], w,
                                                      out=mx.float32)[0]))
        np.testing.assert_array_equal(np.array(linear(h[:, :length, :][:, -1, :], w,
                                                      out=mx.float32)), np.array(got))
    assert made() == (1, 1)


@pytest.mark.parametrize("trans_b", [False, True])
def test_a_broadcast_operand_of_one_column_runs_as_its_copy(trans_b):
    """A batched product whose b is a broadcast (stride 0 on its axes of size 1) with one
    column: the strides given oneDNN at execution are ones it takes (a stride of 0 was
    refused), and the result is the product's."""
    x = mx.random.normal((2, 3, 4, 16)).astype(mx.bfloat16)
    v = mx.random.normal((16,)).astype(mx.bfloat16)
    b = mx.broadcast_to(v, (1, 1, 1, 16)) if trans_b else mx.broadcast_to(v[:, None],
                                                                           (1, 1, 16, 1))
    got = _ext.matmul(x, b, None, False, trans_b, False, mx.float32, True, True)
    want = _ext.matmul(x, mx.array(np.array(b.astype(mx.float32))).astype(mx.bfloat16), None,
                       False, trans_b, False, mx.float32, True, True)
    np.testing.assert_array_equal(np.array(got), np.array(want))
    assert got.shape == (2, 3, 4, 1)
