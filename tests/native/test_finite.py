"""The native finiteness check (native/src/finite.*, ``fluxlike.native.finite_kernel``): one
primitive that says whether no element of several arrays is inf or nan, which the training
step's check of its gradients and ``fluxlike.all_finite`` use on the CPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_helpers import needs_native

import fluxlike as fl
from fluxlike import native

pytestmark = needs_native

DTYPES = [mx.float32, mx.bfloat16, mx.float16]
SPECIAL = [float("inf"), -float("inf"), float("nan")]


def kernel():
    k = native.finite_kernel()
    assert k is not None
    return k


def reference(arrays: list[mx.array]) -> bool:
    return all(np.isfinite(np.array(a.astype(mx.float32))).all() for a in arrays)


@settings(max_examples=200, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1,
                    max_size=4),
    dtype=st.sampled_from(DTYPES),
    spots=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6),
                             st.sampled_from(SPECIAL)), max_size=3),
)
def test_agrees_with_isfinite_for_every_dtype_shape_and_position(shapes, dtype, spots):
    arrays = [np.random.default_rng(len(s)).normal(size=s).astype(np.float32) for s in shapes]
    for which, position, value in spots:
        a = arrays[which % len(arrays)]
        if a.size:
            a.reshape(-1)[position % a.size] = value
    xs = [mx.array(a).astype(dtype) for a in arrays]
    assert kernel()(xs).item() is reference(xs)
    assert fl.all_finite(xs).item() is reference(xs)


def test_views_read_only_their_own_elements():
    """A slice, a transpose and a broadcast are checked as what they show: an inf just outside
    a slice is not in it."""
    x = mx.ones((4, 6))
    x[1, 2] = float("inf")
    k = kernel()
    assert k([x[::2]]).item() is True  # rows 0 and 2: the inf is in row 1
    assert k([x[:, 3:]]).item() is True
    assert k([x[1:2]]).item() is False
    assert k([x.T]).item() is False
    assert k([mx.broadcast_to(mx.array([1.0, 2.0]), (5, 2))]).item() is True
    assert k([mx.broadcast_to(mx.array([1.0, float("nan")]), (5, 2))]).item() is False


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", [0, 12345, -1])
def test_large_arrays_shared_out_over_threads_find_one_bad_element(dtype, where):
    """Arrays past the one-thread threshold are read in blocks on OpenMP's threads: one inf
    anywhere, the last block's end included, is found."""
    n = (1 << 21) + 17
    x = np.zeros(n, dtype=np.float32)
    x[where] = float("nan")
    k = kernel()
    assert k([mx.zeros(n, dtype=dtype)]).item() is True
    assert k([mx.ones(3), mx.array(x).astype(dtype)]).item() is False


def test_float16_and_bfloat16_extremes_are_finite():
    """The largest finite values and the denormals are finite in each dtype (the exponent
    mask is the dtype's own)."""
    k = kernel()
    assert k([mx.array([65504.0, -65504.0, 6e-8], dtype=mx.float16)]).item() is True
    assert k([mx.array([3.38e38, -3.38e38, 1e-40], dtype=mx.bfloat16)]).item() is True
    assert k([mx.array([3.4028235e38, 1e-45])]).item() is True
    assert k([mx.array([65504.0], dtype=mx.float32).astype(mx.float16) * 2]).item() is False


def test_transforms():
    """Inside mx.compile, under mx.vmap (per member) and with zero derivatives."""
    k = kernel()
    a = mx.array([[1.0, 2.0], [float("nan"), 1.0], [3.0, -float("inf")]])
    assert mx.vmap(lambda r: k([r]))(a).tolist() == [True, False, False]
    assert mx.vmap(lambda r, s: k([r, s]), in_axes=(0, None))(a, mx.ones(2)).tolist() == [
        True, False, False]
    assert mx.vmap(lambda r, s: k([r, s]), in_axes=(0, None))(
        a, mx.array([float("inf")])).tolist() == [False, False, False]
    assert mx.compile(lambda x: k([x, 2 * x]))(mx.ones(3)).item() is True
    grad = mx.grad(lambda x: (k([x]) * x).sum())(mx.ones(2))  # d(flag * x) = flag, flag's 0
    assert grad.tolist() == [1.0, 1.0]
    assert mx.jvp(lambda x: k([x]), [mx.ones(2)], [mx.ones(2)])[1][0].item() is False


def test_bad_input_is_refused_by_name():
    k = kernel()
    with pytest.raises(ValueError, match="all_finite: expected float32, bfloat16 or float16"):
        k([mx.ones(2), mx.array([1, 2])])
    with pytest.raises(ValueError, match="all_finite: expected at least one array"):
        k([])


def test_the_library_falls_back_to_mlx_ops_where_the_kernel_does_not_apply():
    """float64 leaves (no native check) and trees without floating arrays."""
    from fluxlike.precision.lossscale import sum_finite
    with mx.stream(mx.cpu):
        x64 = mx.array([1.0, float("inf")], dtype=mx.float64)
        assert fl.all_finite({"a": x64}).item() is False
        assert sum_finite({"a": x64, "b": mx.ones(2)}).item() is False
    assert fl.all_finite({"n": mx.array([1, 2])}).item() is True
    assert sum_finite({}).item() is True


# ---- the step's selection: keep_if (fluxlike.native.keep_kernel) ------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flag", [True, False])
def test_keep_if_is_mx_where_for_fresh_and_held_arrays(dtype, flag):
    keep = native.keep_kernel()
    assert keep is not None
    old = mx.random.normal((33, 7)).astype(dtype)
    held = mx.random.normal((33, 7)).astype(dtype)
    f = mx.array(flag)
    for taken in (held, held * 2, held.T.T, mx.broadcast_to(held[:1], (33, 7))):
        want = np.array(mx.where(f, taken, old).astype(mx.float32))
        # fresh: the result takes over the product's buffer, which nothing else holds
        got = keep(f, taken * 1, old)
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)),
                                      np.array(mx.where(f, taken * 1, old).astype(mx.float32)))
        got = keep(f, taken, old)  # held: copied, never written over
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
    assert np.array(held.astype(mx.float32)).tolist() == np.array(
        (held * 1).astype(mx.float32)).tolist()


def test_keep_if_derivatives_and_vmap_are_mx_wheres():
    keep = native.keep_kernel()
    a, b = mx.random.normal((4, 3)), mx.random.normal((4, 3))
    for flag in (True, False):
        f = mx.array(flag)
        g = mx.grad(lambda a, b, f=f: (keep(f, a * 1, b) * mx.arange(12).reshape(4, 3)).sum(),
                    argnums=(0, 1))(a, b)
        w = mx.grad(lambda a, b, f=f: (mx.where(f, a, b) * mx.arange(12).reshape(4, 3)).sum(),
                    argnums=(0, 1))(a, b)
        for x, y in zip(g, w, strict=True):
            np.testing.assert_array_equal(np.array(x), np.array(y))
        t = mx.jvp(lambda a, b, f=f: keep(f, a, b), [a, b],
                   [mx.ones_like(a), 2 * mx.ones_like(b)])[1]
        np.testing.assert_array_equal(np.array(t[0]), np.full((4, 3), 1.0 if flag else 2.0))
    flags = mx.array([True, False, True, False])
    got = mx.vmap(keep)(flags, a, b)
    np.testing.assert_array_equal(np.array(got), np.array(mx.where(flags[:, None], a, b)))
    got = mx.vmap(keep, in_axes=(None, 0, None))(mx.array(False), a, b[0])
    np.testing.assert_array_equal(np.array(got), np.array(mx.broadcast_to(b[0], (4, 3))))


def test_keep_if_refuses_what_mx_where_would_broadcast():
    keep = native.keep_kernel()
    with pytest.raises(ValueError, match="keep_if: flag must be a 0-d bool array, got shape "
                       r"\(2,\) and dtype bool"):
        keep(mx.array([True, False]), mx.ones(2), mx.zeros(2))
    with pytest.raises(ValueError, match="keep_if: taken and kept must have one shape and "
                       r"dtype, got \(2,\) float32 and \(3,\) float32; use mx.where"):
        keep(mx.array(True), mx.ones(2), mx.zeros(3))
    with pytest.raises(ValueError, match="one shape and dtype"):
        keep(mx.array(True), mx.ones(2), mx.zeros(2, mx.float16))
