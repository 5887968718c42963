"""AMX products of sources that are not on a cache line's boundary (matmul.cpp: the aligned
copy): MLX's own CPU buffers are 8 bytes past a 16-byte boundary, which oneDNN's AMX kernels
read 1.45x slower; the product of a copy must be the product of the source."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from native_helpers import needs_native

pytestmark = needs_native


def address(x: mx.array) -> int:
    """Where x's data starts (a view of its bytes, no copy)."""
    mx.eval(x)
    return np.asarray(x.view(mx.uint8)).ctypes.data


def test_mlx_buffers_are_off_a_cache_line():
    # (why the copy exists; if MLX aligns its buffers one day, the copy is never made)
    x = mx.random.normal((37, 24)).astype(mx.bfloat16)
    assert address(x) % 16 == 8


def test_a_product_of_a_misaligned_source_is_the_aligned_ones_bit_for_bit():
    from fluxlike_native import _ext
    if not _ext.isa_has_bf16():
        pytest.skip("no bfloat16 kernels on this CPU")
    x0 = mx.random.normal((64, 96)).astype(mx.bfloat16)
    w = mx.random.normal((80, 96)).astype(mx.bfloat16)
    # 32 copies of x0 in one buffer, each one element past the last one's end: copy j starts
    # 2 * (6145 j + 1) bytes in, which is every even offset from a cache line once over j < 32
    # whatever the buffer's own address (one buffer: its address cannot move between copies)
    n = x0.size
    flat = mx.concatenate([mx.concatenate([mx.zeros((1,), mx.bfloat16), x0.reshape(-1)])] * 32)
    mx.eval(flat)
    got = {}
    for j in range(32):
        start = j * (n + 1) + 1
        x = flat[start : start + n].reshape(64, 96)
        y = _ext.matmul(x, w, None, False, True, False, mx.float32, False, True)
        got[address(x) % 64] = np.array(y)
    assert sorted(got) == list(range(0, 64, 2)), sorted(got)
    for offset, y in got.items():
        np.testing.assert_array_equal(y, got[0], err_msg=f"a source {offset} bytes past a line")


def test_native_outputs_start_on_a_cache_line_and_read_as_any_array():
    """A product's and a cast's output start on a cache line (64 bytes into a buffer 64 bytes
    larger), so that the next product reads it in place, not a copy; the data reads, slices
    and is taken over by the next op (donated) as any array's."""
    from fluxlike_native import _ext
    x = mx.random.normal((37, 24))
    w = mx.random.normal((16, 24))
    for dtype in (mx.float32, mx.bfloat16):
        xs, ws = x.astype(dtype), w.astype(dtype)

        def product(xs=xs, ws=ws):  # (a new array each call; float32 kernels without bf16's)
            return _ext.matmul(xs, ws, None, False, True, False, None, False,
                               _ext.isa_has_bf16())

        cast = _ext.convert(x, mx.bfloat16) if dtype == mx.bfloat16 else _ext.convert(
            x.astype(mx.bfloat16), mx.float32)
        y = product()
        assert address(y) % 64 == 0 and address(cast) % 64 == 0
        want = np.array(xs.astype(mx.float32)) @ np.array(ws.astype(mx.float32)).T
        got = np.array(y.astype(mx.float32))
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
        np.testing.assert_array_equal(np.array(y[3:7, ::2].astype(mx.float32)), got[3:7, ::2])
        np.testing.assert_array_equal(np.array(mx.negative(product()).astype(mx.float32)),
                                      -got)
