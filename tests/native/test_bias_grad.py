"""The native bias gradient (native/src/bias.cpp: ``bias_grad``, the backward pass of every
native linear layer's and convolution's bias) against the MLX ops it replaces,
``astype(astype(sum(astype(g, float32), leading axes), round_dtype), bias_dtype)``: bit for bit
for row-major cotangents and 2-D views in every dtype and size, special values included; other
views of three or more axes (which MLX sums in memory order) to float32's rounding; one graph
node where MLX's make three or four; derivatives, vmap and ``mx.compile`` as the ops'.

Without the extension these tests skip with the reason ``native_info()`` gives.
"""

from __future__ import annotations

import io
import re

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_helpers import needs_native

FLOATS = [mx.float32, mx.bfloat16, mx.float16]


def _ext():
    from fluxlike_native import _ext
    return _ext


def _reference(g: mx.array, bias_dtype, round_dtype=mx.float32) -> mx.array:
    """The MLX ops: float32 sums down the columns, rounded, in the bias's dtype."""
    summed = g.astype(mx.float32).sum(axis=tuple(range(g.ndim - 1)))
    return summed.astype(round_dtype).astype(bias_dtype)


def _bits(x: mx.array) -> np.ndarray:
    """The stored bits (so that NaN payloads and signed zeros count)."""
    view = {mx.float32: mx.uint32, mx.bfloat16: mx.uint16, mx.float16: mx.uint16}[x.dtype]
    return np.array(x.view(view))


def _nodes(*outputs: mx.array) -> list[str]:
    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return re.findall(r'label ="([A-Za-z]+)"', buf.getvalue())


def _layout(x: mx.array, layout: str) -> mx.array:
    """``x`` (rows, cols) as a row-major array, a transpose's view or a slice's."""
    if layout == "transposed":
        return mx.contiguous(x.T).T
    if layout == "sliced":
        wide = mx.concatenate([x, x], axis=-1)
        return wide[..., : x.shape[-1]]
    return x


@needs_native
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.sampled_from([2, 3, 17, 256, 1031]), cols=st.sampled_from([2, 3, 8, 9, 130]),
       g_dtype=st.sampled_from(FLOATS), bias_dtype=st.sampled_from(FLOATS),
       round_dtype=st.sampled_from(FLOATS),
       layout=st.sampled_from(["row-major", "transposed", "sliced"]),
       seed=st.integers(0, 2**16))
def test_bit_for_bit_the_ops_it_replaces(rows, cols, g_dtype, bias_dtype, round_dtype, layout,
                                         seed):
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.integers(-3, 4)
    g = _layout(mx.array((rng.standard_normal((rows, cols)) * scale).astype(np.float32))
                .astype(g_dtype), layout)
    got = _ext().bias_grad(g, bias_dtype, round_dtype=round_dtype)
    want = _reference(g, bias_dtype, round_dtype)
    assert got.dtype == bias_dtype and got.shape == (cols,)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@needs_native
@pytest.mark.parametrize("shape", [(2, 3, 5), (4, 2, 3, 6)])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_every_leading_axis_is_summed(shape, dtype):
    g = mx.random.normal(shape).astype(dtype)
    got = _ext().bias_grad(g, mx.float32, round_dtype=dtype)
    np.testing.assert_array_equal(_bits(got), _bits(_reference(g, mx.float32, dtype)))


@needs_native
@pytest.mark.parametrize("view", ["transposed axes", "reversed"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_other_views_of_three_axes_to_float32s_rounding(view, dtype):
    """A view that is not row-major with three or more axes (a transposed convolution output's
    cotangent): summed in row order, where MLX's sum goes in memory order: the same sum to
    float32's rounding, not always the same bits."""
    x = mx.random.normal((6, 300, 5)) * 100
    g = (mx.contiguous(x.transpose(1, 0, 2)).transpose(1, 0, 2) if view == "transposed axes"
         else x[::-1, ::-1]).astype(dtype)
    got = np.array(_ext().bias_grad(g, mx.float32))
    want = np.array(_reference(g, mx.float32))
    scale = np.abs(np.array(g.astype(mx.float32))).sum(axis=(0, 1))
    assert (np.abs(got - want) <= 1e-6 * scale).all()


@needs_native
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_special_values_as_mlx(dtype):
    """NaN, infinities of both signs (their sum NaN), -0.0 (0 + -0.0 is +0.0, as MLX's sum
    starts from 0), sums past the half dtype's range, and NaN rounded to half precision as
    MLX's casts round it. (One NaN per column: where NaNs of both signs meet, which one's
    sign the sum keeps is the compiler's choice of operand order, in MLX's sum as here.)"""
    big = 60000.0 if dtype == mx.float16 else 3e38
    cols = [[np.nan, 1.0], [np.inf, 1.0], [-np.inf, np.inf], [-0.0, -0.0], [big, big],
            [-np.nan, 2.0]]
    g = mx.array(np.array(cols, dtype=np.float32).T.copy()).astype(dtype)
    for bias_dtype in FLOATS:
        for round_dtype in FLOATS:
            got = _ext().bias_grad(g, bias_dtype, round_dtype=round_dtype)
            np.testing.assert_array_equal(_bits(got), _bits(_reference(g, bias_dtype,
                                                                        round_dtype)))


@needs_native
def test_one_node_where_mlx_makes_several_and_mlx_ops_where_it_orders_otherwise():
    g = mx.random.normal((8, 4)).astype(mx.bfloat16)
    mx.eval(g)
    assert _nodes(_ext().bias_grad(g, mx.float32, round_dtype=mx.bfloat16)) == [
        "FluxlikeNativeBiasGrad"]
    assert _nodes(_ext().bias_grad(g, mx.bfloat16)) == ["FluxlikeNativeBiasGrad"]
    # one column (MLX sums it with eight partial sums), one row, one axis: MLX's ops
    for shape in [(8, 1), (1, 8), (8,)]:
        g = mx.random.normal(shape)
        mx.eval(g)
        out = _ext().bias_grad(g, mx.float32)
        assert "FluxlikeNativeBiasGrad" not in _nodes(out)
        np.testing.assert_array_equal(_bits(out), _bits(_reference(g, mx.float32)))


@needs_native
@pytest.mark.parametrize("round_dtype", [mx.float32, mx.bfloat16], ids=str)
def test_derivatives_vmap_and_compile_are_the_ops(round_dtype):
    mx.random.seed(0)
    g = mx.random.normal((6, 5))
    w = mx.random.normal((5,))

    def native_fn(g):
        return (_ext().bias_grad(g, mx.float32, round_dtype=round_dtype) * w).sum()

    def ops_fn(g):
        return (_reference(g, mx.float32, round_dtype) * w).sum()

    np.testing.assert_array_equal(np.array(mx.grad(native_fn)(g)), np.array(mx.grad(ops_fn)(g)))
    tangent = mx.random.normal(g.shape)
    np.testing.assert_array_equal(np.array(mx.jvp(native_fn, [g], [tangent])[1][0]),
                                  np.array(mx.jvp(ops_fn, [g], [tangent])[1][0]))
    batch = mx.random.normal((3, 6, 5))
    for axis in (0, 1, 2):
        moved = mx.moveaxis(batch, 0, axis)
        mapped = mx.vmap(lambda g: _ext().bias_grad(g, mx.float32, round_dtype=round_dtype),
                         in_axes=axis)(moved)
        for i in range(3):
            np.testing.assert_allclose(np.array(mapped[i]),
                                       np.array(_reference(batch[i], mx.float32, round_dtype)),
                                       rtol=1e-6)
    compiled = mx.compile(native_fn)
    assert compiled(g).item() == native_fn(g).item()


@needs_native
def test_errors_name_the_function_and_the_fix():
    with pytest.raises(ValueError, match="bias_grad: expected float32, bfloat16 or float16"):
        _ext().bias_grad(mx.ones((3, 4), dtype=mx.int32), mx.float32)
    with pytest.raises(ValueError, match="bias_grad: expected a cotangent with at least one"):
        _ext().bias_grad(mx.array(1.0), mx.float32)
