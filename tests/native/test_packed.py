"""Packed weights (native/src/packed.*): a linear layer's bfloat16 weights reordered once into
the layout oneDNN's kernel prefers, and the product that reads them, which autocast
inference takes for weights it has seen before (precision/kernels.py: _on_kept_casts)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import np64
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_helpers import needs_native

import fluxlike
from fluxlike import Dense, autocast
from fluxlike.precision import castcache

pytestmark = needs_native


def ext():
    from fluxlike_native import _ext
    return _ext


def packable() -> bool:
    try:
        e = ext()
    except ImportError:
        return False
    return e.isa_has_bf16() and e.pack_weights(mx.ones((8, 8), mx.bfloat16)) is not None


needs_packing = pytest.mark.skipif(not packable(), reason="no packed bfloat16 layout on this "
                                   "CPU (no bfloat16 kernel, or its layout is the plain one)")


@needs_packing
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(1, 40), inner=st.integers(1, 70), out=st.integers(1, 70),
       lead=st.sampled_from([(), (3,)]), bias=st.sampled_from([None, mx.bfloat16, mx.float32]),
       relu=st.booleans(), out_dtype=st.sampled_from([mx.bfloat16, mx.float32]),
       seed=st.integers(0, 2**16))
def test_the_packed_product_is_the_native_products_bits(rows, inner, out, lead, bias, relu,
                                                         out_dtype, seed):
    e = ext()
    mx.random.seed(seed)
    x = mx.random.normal((*lead, rows, inner)).astype(mx.bfloat16)
    w = mx.random.normal((out, inner)).astype(mx.bfloat16)
    b = None if bias is None else mx.random.normal((out,)).astype(bias)
    packed = e.pack_weights(w)
    got = e.packed_linear(x, w, b, packed, relu, out_dtype)
    want = e.matmul(x, w, b, False, True, relu, out_dtype, False, True)
    assert got.dtype == want.dtype == out_dtype and got.shape == want.shape
    np.testing.assert_array_equal(np64(got), np64(want))


def small_product():
    """Operands (x, w, b) of a small bfloat16 product, w's packing, and the two spellings of
    relu(x @ w.T + b) in float32: ``mine(x, w, b)`` packed, ``theirs(x, w, b)`` plain."""
    e = ext()
    x = mx.random.normal((5, 12)).astype(mx.bfloat16)
    w = mx.random.normal((7, 12)).astype(mx.bfloat16)
    b = mx.random.normal((7,)).astype(mx.bfloat16)
    packed = e.pack_weights(w)

    def mine(x, w, b):
        return e.packed_linear(x, w, b, packed, True, mx.float32)

    def theirs(x, w, b):
        return e.matmul(x, w, b, False, True, True, mx.float32, False, True)

    return (x, w, b), packed, mine, theirs


@needs_packing
def test_derivatives_are_the_plain_products():
    e = ext()
    (x, w, b), packed, mine, theirs = small_product()
    for a, r in zip(mx.grad(lambda *t: mine(*t).sum(), argnums=(0, 1, 2))(x, w, b),
                    mx.grad(lambda *t: theirs(*t).sum(), argnums=(0, 1, 2))(x, w, b),
                    strict=True):
        np.testing.assert_array_equal(np64(a), np64(r))
    g = mx.grad(lambda p: e.packed_linear(x, w, b, p, False, mx.float32).sum())(packed)
    assert g.dtype == mx.uint8 and not g.any().item()  # (a constant of w)
    t = [mx.ones_like(x), mx.ones_like(w), mx.ones_like(b)]
    np.testing.assert_array_equal(np64(mx.jvp(mine, [x, w, b], t)[1][0]),
                                  np64(mx.jvp(theirs, [x, w, b], t)[1][0]))


def test_bad_weights_and_packings_are_refused():
    e = ext()
    with pytest.raises(ValueError, match=r"pack_weights: expected a linear layer's 2-D bfloat16 "
                       r"weights \(out, in\), got shape \(2, 3, 4\) and dtype bfloat16"):
        e.pack_weights(mx.ones((2, 3, 4), mx.bfloat16))
    with pytest.raises(ValueError, match="got shape \\(4, 3\\) and dtype float32"):
        e.pack_weights(mx.ones((4, 3)))
    if not packable():
        return
    w = mx.ones((4, 8), mx.bfloat16)
    other = e.pack_weights(mx.ones((4, 64), mx.bfloat16))
    with pytest.raises(ValueError, match="packed_linear: packed must be "
                       "fluxlike_native.pack_weights\\(w\\)"):
        e.packed_linear(mx.ones((2, 8), mx.bfloat16), w, None, other, False, mx.bfloat16)
    with pytest.raises(ValueError, match="packed_linear: expected bfloat16 x"):
        e.packed_linear(mx.ones((2, 8)), w, None, e.pack_weights(w), False, mx.bfloat16)


@needs_packing
def test_autocast_inference_reads_packed_weights_from_the_second_call(monkeypatch):
    layer = Dense(24, 16, fluxlike.relu)
    x = mx.random.normal((9, 24))
    mx.eval(layer.parameters(), x)
    with fluxlike.native.disabled():  # (the reference: plain products throughout)
        with autocast(mx.bfloat16):
            want = np64(layer(x))
    fluxlike.clear_cast_cache()
    packings = []
    made = castcache.packed_weights
    monkeypatch.setattr(castcache, "packed_weights",
                        lambda s, h: packings.append(s) or made(s, h))
    with autocast(mx.bfloat16):
        first, second, third = (np64(layer(x)) for _ in range(3))
    assert len(packings) == 2 and packings[0] is layer.weight  # calls two and three
    for y in (first, second, third):
        np.testing.assert_allclose(y, want, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(second, first)  # the packed product: the plain one's bits
    layer.weight = layer.weight * 2  # a new array: packed afresh, never the old packing
    with autocast(mx.bfloat16):
        layer(x)
        doubled = np64(layer(x))
    assert packings[-1] is layer.weight
    want = (x.astype(mx.bfloat16) @ layer.weight.astype(mx.bfloat16).T
            + layer.bias.astype(mx.bfloat16))
    np.testing.assert_allclose(doubled, np64(fluxlike.relu(want)), rtol=2e-2, atol=2e-2)


def test_weights_too_large_for_an_mlx_shape_keep_the_plain_product():
    # (2**30 weights: the packing would pass 2**31 bytes; nothing is evaluated here)
    assert ext().pack_weights(mx.zeros((32768, 32832), mx.bfloat16)) is None


@needs_packing
def test_any_copy_of_a_packing_reads_the_same():
    e = ext()
    x = mx.random.normal((33, 70)).astype(mx.bfloat16)
    w = mx.random.normal((65, 70)).astype(mx.bfloat16)
    p = e.pack_weights(w)
    want = np64(e.packed_linear(x, w, None, p, False, mx.float32))
    copies = [p + 0, mx.array(np.array(p))]
    copies += [mx.concatenate([mx.zeros((k,), mx.uint8), p])[k:] for k in (1, 8, 24)]
    for c in copies:  # (at other addresses: the packed bytes' offset travels with them)
        np.testing.assert_array_equal(np64(e.packed_linear(x, w, None, c, False, mx.float32)),
                                      want)


@needs_packing
def test_vmap_over_any_operand_is_the_plain_products():
    (x, w, b), _, mine, theirs = small_product()
    cases = [((mx.stack([x, x * 2]), w, b), (0, None, None)),
             ((x.T, w, b), (1, None, None)),  # x mapped on its last axis
             ((x, mx.stack([w, w * 2]), b), (None, 0, None)),
             ((x, w, mx.stack([b, b * 2, -b])), (None, None, 0))]
    for args, axes in cases:
        np.testing.assert_array_equal(np64(mx.vmap(mine, in_axes=axes)(*args)),
                                      np64(mx.vmap(theirs, in_axes=axes)(*args)))


@needs_packing
def test_a_half_models_own_weights_are_never_packed(monkeypatch):
    # (they may be a transformation's tracers - vmap over an ensemble's weights - and a
    # packing would hold them twice)
    packings = []
    made = castcache.packed_weights
    monkeypatch.setattr(castcache, "packed_weights",
                        lambda s, h: packings.append(s) or made(s, h))
    layer = Dense(8, 4)
    layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((3, 8)).astype(mx.bfloat16)
    for _ in range(3):
        layer(x)
    stacked = {k: mx.stack([v, 2 * v]) for k, v in layer.parameters().items()}

    def f(params, x):
        layer.update(params)
        return layer(x)

    assert mx.vmap(f, in_axes=(0, None))(stacked, x).shape == (2, 3, 4)
    assert packings == []
