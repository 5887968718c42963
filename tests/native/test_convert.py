"""The native cast (native/src/cast.cpp: ``convert``; ``fluxlike.precision.operands.convert``,
which autocast's half-precision casts call) against ``mx.astype``: bit for bit over every half
bit pattern and a million float32 ones, in every layout; the same derivatives, vmap and
``mx.compile`` results; and where the routing takes it.

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

from fluxlike import native
from fluxlike.precision.operands import convert

FLOATS = [mx.float32, mx.bfloat16, mx.float16]
BITS = {mx.float32: mx.uint32, mx.bfloat16: mx.uint16, mx.float16: mx.uint16}


def _ext():
    from fluxlike_native import _ext
    return _ext


def _bits(x: mx.array) -> np.ndarray:
    return np.array(mx.contiguous(x).view(BITS[x.dtype]))


def _nodes(*outputs: mx.array) -> list[str]:
    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return re.findall(r'label ="([A-Za-z]+)"', buf.getvalue())


def _every(dtype) -> mx.array:
    """Every value of a half dtype (all 65,536 bit patterns: NaNs, infinities, subnormals)."""
    return mx.arange(0, 65536, dtype=mx.uint32).astype(mx.uint16).view(dtype)


@needs_native
@pytest.mark.parametrize(("source", "target"), [
    (s, t) for s in (mx.bfloat16, mx.float16) for t in FLOATS if t != s], ids=str)
def test_every_half_value_as_astype(source, target):
    x = _every(source)
    np.testing.assert_array_equal(_bits(_ext().convert(x, target)), _bits(x.astype(target)))


@needs_native
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_a_bfloat16_cast_past_the_caches_is_astype_s(offset):
    """From 2**20 elements bfloat16 widens with non-temporal stores (a vector loop between
    scalar ends, shared out over threads): every bit pattern, at any offset from a 16-byte
    boundary (a slice of a larger buffer) and with a ragged end, as astype gives them."""
    n = (1 << 20) + 37
    every = _every(mx.bfloat16)
    x = mx.concatenate([every] * (n // 65536 + 2))[offset : offset + n]
    mx.eval(x)
    np.testing.assert_array_equal(_bits(_ext().convert(x, mx.float32)),
                                  _bits(x.astype(mx.float32)))


@needs_native
@pytest.mark.parametrize("target", [mx.bfloat16, mx.float16], ids=str)
def test_float32_bit_patterns_as_astype(target):
    """A million random float32 patterns (NaNs of every payload and sign among them), halves'
    rounding boundaries, overflow and underflow."""
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([65504.0, 65519.996, 65520.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001,
                      3.3895e38, 3.4e38, -0.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-9],
                     dtype=np.float32).view(np.uint32)
    x = mx.array(np.concatenate([patterns, edges])).view(mx.float32)
    np.testing.assert_array_equal(_bits(_ext().convert(x, target)), _bits(x.astype(target)))


@needs_native
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(shape=st.sampled_from([(0,), (1,), (7,), (3, 5), (2, 3, 17), (4, 1025)]),
       layout=st.sampled_from(["row-major", "transposed", "sliced", "broadcast"]),
       source=st.sampled_from(FLOATS), target=st.sampled_from(FLOATS),
       seed=st.integers(0, 2**16))
def test_layouts_and_sizes(shape, layout, source, target, seed):
    x = mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 300)
    x = x.astype(source)
    if layout == "transposed":
        x = mx.contiguous(x.T).T
    elif layout == "sliced" and x.ndim:
        x = mx.concatenate([x, x], axis=-1)[..., : shape[-1]]
    elif layout == "broadcast":
        x = mx.broadcast_to(x[None], (2, *shape))
    got = _ext().convert(x, target)
    assert got.dtype == target and got.shape == x.shape
    np.testing.assert_array_equal(_bits(got), _bits(x.astype(target)))


@needs_native
def test_derivatives_vmap_and_compile_as_astypes():
    mx.random.seed(0)
    x = mx.random.normal((4, 6))
    w = mx.random.normal((4, 6))

    def native_fn(x):
        return (_ext().convert(_ext().convert(x, mx.float16), mx.float32) * w).sum()

    def ops_fn(x):
        return (x.astype(mx.float16).astype(mx.float32) * w).sum()

    np.testing.assert_array_equal(np.array(mx.grad(native_fn)(x)), np.array(mx.grad(ops_fn)(x)))
    t = mx.random.normal(x.shape)
    np.testing.assert_array_equal(np.array(mx.jvp(native_fn, [x], [t])[1][0]),
                                  np.array(mx.jvp(ops_fn, [x], [t])[1][0]))
    mapped = mx.vmap(lambda r: _ext().convert(r, mx.float16), in_axes=1)(x)
    np.testing.assert_array_equal(_bits(mapped), _bits(x.T.astype(mx.float16)))
    assert mx.compile(native_fn)(x).item() == ops_fn(x).item()
    shapeless = mx.compile(lambda x: _ext().convert(x, mx.float16), shapeless=True)
    for n in (3, 5):
        y = mx.random.normal((n, 2))
        np.testing.assert_array_equal(_bits(shapeless(y)), _bits(y.astype(mx.float16)))


@needs_native
def test_the_routing_takes_half_precision_casts_on_the_cpu():
    x = mx.ones((4, 4))
    mx.eval(x)
    assert _nodes(convert(x, mx.float16)) == ["FluxlikeNativeConvert"]
    assert _nodes(convert(x.astype(mx.float16), mx.float32))[-1] == "FluxlikeNativeConvert"
    assert _nodes(convert(x, mx.bfloat16)) == ["FluxlikeNativeConvert"]
    assert _nodes(convert(x, mx.int32)) == _nodes(convert(x, mx.float64)) == ["AsType"]
    assert convert(x, mx.float32) is x
    with native.disabled():
        assert _nodes(convert(x, mx.float16)) == ["AsType"]


@needs_native
def test_a_broadcast_converts_its_data_not_its_view():
    """A contiguous broadcast (``mx.full``, a ``.sum()``'s cotangent) converts its
    ``data_size()`` values and keeps its strides, as MLX's casts do: no copy the size of the
    view."""
    b = mx.broadcast_to(mx.array(1.5, mx.float16), (1 << 22,))
    mx.eval(b)
    mx.reset_peak_memory()
    y = _ext().convert(b, mx.float32)
    mx.eval(y)
    assert mx.get_peak_memory() < 1 << 20
    assert y.shape == b.shape and (y == 1.5).all().item()


@needs_native
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), pair=st.sampled_from([(s, t) for s in FLOATS for t in FLOATS if s != t]))
def test_any_strided_view_is_read_in_row_major_order(data, pair):
    """A view of any strides (axes permuted, sliced with steps, reversed, of size 1 or 0,
    broadcast) is gathered element for element as MLX reads it (common.h: gather, which
    copies whole runs of the innermost merged axes; 2- and 4-byte elements: a cast to the
    same dtype is astype's own, not gathered)."""
    source, target = pair
    shape = data.draw(st.lists(st.integers(0, 5), min_size=0, max_size=5), label="shape")
    x = mx.arange(int(np.prod(shape)), dtype=mx.float32).reshape(shape).astype(source)
    if x.ndim:
        x = x.transpose(data.draw(st.permutations(range(x.ndim)), label="axes"))
        index = []
        for size in x.shape:
            step = data.draw(st.sampled_from([1, 1, 2, -1, -2]), label="step")
            start = data.draw(st.integers(0, max(size - 1, 0)), label="start") if size else 0
            index.append(slice(start if step > 0 else size - 1 - start, None, step))
        x = x[tuple(index)]
        if data.draw(st.booleans(), label="broadcast"):
            axis = data.draw(st.integers(0, x.ndim), label="axis")
            x = mx.broadcast_to(mx.expand_dims(x, axis), (*x.shape[:axis], 3, *x.shape[axis:]))
    got = _ext().convert(x, target)
    assert got.shape == x.shape
    np.testing.assert_array_equal(_bits(got), _bits(x.astype(target)))
