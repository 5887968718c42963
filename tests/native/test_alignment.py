"""Half-precision native outputs on a cache line's boundary where the CPU has AMX (common.h:
output_malloc), and AMX products of sources that are not (matmul.cpp: the aligned copy):
MLX's own CPU buffers are 8 bytes past a 16-byte boundary, which oneDNN's AMX kernels read
1.45x slower."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from native_helpers import needs_native

pytestmark = needs_native


def address(x: mx.array) -> int:
    """Where x's data starts (a view of its bytes, no copy)."""
    mx.eval(x)
    return np.asarray(x.view(mx.uint8) if x.dtype != mx.bool_ else x).ctypes.data


def ext():
    from fluxlike_native import _ext
    return _ext


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_half_native_outputs_start_on_a_cache_line_where_the_cpu_has_amx(dtype):
    e = ext()
    x = mx.random.normal((37, 24)).astype(dtype)
    w = mx.random.normal((19, 24)).astype(dtype)
    assert address(x) % 64 != 0  # (MLX's own: why the outputs below are made aligned)
    outs = {
        "matmul": e.matmul(x, w, None, False, True, False, None, False, False),
        "convert": e.convert(mx.random.normal((37, 24)), dtype),
        "conv": e.conv(x.reshape(1, 37, 24, 1), mx.ones((2, 3, 3, 1), dtype), None, [1, 1],
                       [1, 1], [1, 1], [1, 1], 1, False),
    }
    aligned = dtype != mx.float32 and "amx" in e.cpu_isa()
    for name, y in outs.items():
        assert (address(y) % 64 == 0) == aligned, name


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_native_outputs_hold_their_values_through_donation_and_go_back_to_mlxs_cache(dtype):
    e = ext()
    x, w = mx.random.normal((64, 32)).astype(dtype), mx.random.normal((48, 32)).astype(dtype)
    want = np.array((x @ w.T).astype(mx.float32))
    mx.eval(x, w)
    active = []
    for _ in range(4):
        y = e.matmul(x, w, None, False, True, False, None, False, False)
        z = mx.exp(y) * 2  # (MLX's elementwise ops may write over y's buffer: donation)
        got = np.array(mx.log(z / 2).astype(mx.float32))
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
        del y, z
        gc.collect()
        active.append(mx.get_active_memory())
    assert active[1:] == active[:-1]  # every buffer given back each time
    assert mx.get_cache_memory() > 0  # (to MLX's cache, not to the system)


def test_an_amx_product_of_a_misaligned_source_is_the_aligned_ones_bit_for_bit():
    e = ext()
    if not e.isa_has_bf16():
        pytest.skip("no bfloat16 kernels on this CPU")
    x0 = mx.random.normal((64, 96)).astype(mx.bfloat16)
    w = mx.random.normal((80, 96)).astype(mx.bfloat16)
    got = {}
    for k in range(64):  # x0's values at 2-byte offsets from a cache line
        x = mx.concatenate([mx.zeros((k,), mx.bfloat16), x0.reshape(-1)])[k:].reshape(64, 96)
        y = e.matmul(x, w, None, False, True, False, mx.float32, False, True)
        got[address(x) % 64] = np.array(y)
    assert 0 in got and len(got) >= 8
    for offset, y in got.items():
        np.testing.assert_array_equal(y, got[0], err_msg=f"a source {offset} bytes past a line")
