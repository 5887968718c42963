import math
import re

import mlx.core as mx
import numpy as np
import pytest
from helpers import check_gradients, normal, np64

from fluxlike import (
    AdaptiveMeanPool,
    Chain,
    Conv,
    GlobalMaxPool,
    GlobalMeanPool,
    MaxPool,
    MeanPool,
    autocast,
    f16mix,
    flatten,
)
from fluxlike.precision.policy import policy_of

# --- numpy references ------------------------------------------------------------------------


def pool_reference(x, window, stride, pads, reduce, fill):
    """Loop over output positions; each takes ``reduce`` of its window of the padded input."""
    x = np.pad(x, [(0, 0), *pads, (0, 0)], constant_values=fill)
    out = [(n - w) // s + 1 for n, w, s in zip(x.shape[1:-1], window, stride, strict=True)]
    y = np.empty((x.shape[0], *out, x.shape[-1]))
    for i in np.ndindex(*out):
        box = tuple(slice(a * s, a * s + w) for a, s, w in zip(i, stride, window, strict=True))
        patch = x[(slice(None), *box)]
        y[(slice(None), *i)] = reduce(patch.reshape(x.shape[0], -1, x.shape[-1]), axis=1)
    return y


def adaptive_reference(x, out_size):
    """PyTorch's adaptive average pooling: box floor(i n / m) .. ceil((i + 1) n / m)."""
    spatial = x.shape[1:-1]
    y = np.empty((x.shape[0], *out_size, x.shape[-1]))
    for i in np.ndindex(*out_size):
        box = tuple(slice(math.floor(a * n / m), math.ceil((a + 1) * n / m))
                    for a, n, m in zip(i, spatial, out_size, strict=True))
        y[(slice(None), *i)] = x[(slice(None), *box)].reshape(x.shape[0], -1, x.shape[-1]).mean(1)
    return y


def distinct(*shape, seed=0):
    """float32 values without ties (a shuffled, spaced ramp), so a max has one winner."""
    rng = np.random.default_rng(seed)
    values = rng.permutation(math.prod(shape)) * 0.1 - 3.0
    return mx.array(values.reshape(shape).astype(np.float32))


def reference_of(pool):
    if isinstance(pool, MaxPool):
        return lambda x: pool_reference(x, pool.window, pool.stride, pool.padding, np.max,
                                        -np.inf)
    return lambda x: pool_reference(x, pool.window, pool.stride, pool.padding, np.mean, 0.0)


# (window, stride, padding) in 1-D, 2-D and 3-D: tiles, ragged tiles, overlapping and gapped
# windows, symmetric, asymmetric and "same" padding.
CASES = [
    ((2,), None, 0),
    ((3,), 1, 1),
    ((2,), 3, ((1, 0),)),
    ((3,), 2, "same"),
    ((2, 2), None, 0),
    ((3, 2), (2, 1), ((1, 2), (0, 1))),
    ((3, 3), 1, "same"),
    ((2, 3), (3, 2), (1, 0)),
    ((2, 2, 2), None, 0),
    ((3, 2, 2), (2, 1, 2), ((0, 2), 1, (1, 0))),
]


def case_id(case):
    return f"{len(case[0])}d-w{case[0]}-s{case[1]}-p{case[2]}"


def sample(case, seed=0):
    return distinct(2, *(7 - i for i in range(len(case[0]))), 3, seed=seed)


@pytest.mark.parametrize("cls", [MaxPool, MeanPool])
class TestWindowPools:
    def test_construction(self, cls):
        pool = cls((3, 2))
        assert pool.window == (3, 2) and pool.stride == (3, 2) and pool.padding == ((0, 0),) * 2
        pool = cls(window=(3,), stride=1, padding=1)
        assert pool.stride == (1,) and pool.padding == ((1, 1),)
        assert cls((3, 3), padding="same").padding == ((1, 1), (1, 1))
        assert cls((2,), padding="same").padding == ((1, 0),)
        assert pool.parameters() == {} and policy_of(pool) == "none"

    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_matches_numpy_reference(self, cls, case):
        window, stride, padding = case
        pool = cls(window, stride=stride, padding=padding)
        x = sample(case)
        y = pool(x)
        expected = reference_of(pool)(np64(x))
        assert y.shape == expected.shape and y.dtype == mx.float32
        np.testing.assert_allclose(np64(y), expected, rtol=1e-6, atol=1e-6)

    def test_non_contiguous_input(self, cls):
        pool = cls((3, 2), stride=(2, 1), padding=1)
        x = distinct(2, 4, 7, 6).transpose(0, 2, 3, 1)[:, ::-1]
        np.testing.assert_allclose(np64(pool(x)), reference_of(pool)(np64(x)), rtol=1e-6,
                                   atol=1e-6)

    @pytest.mark.parametrize("stride", [1, 2, 3])
    def test_same_padding_gives_ceil_of_input_over_stride(self, cls, stride):
        for window in (1, 2, 3, 4):
            pool = cls((window, window), stride=stride, padding="same")
            for n in (4, 5, 7):
                out = pool(mx.ones((1, n, n, 1))).shape
                assert out == (1, math.ceil(n / stride), math.ceil(n / stride), 1)

    @pytest.mark.parametrize("case", [CASES[1], CASES[5], CASES[9]], ids=case_id)
    def test_gradients_float64(self, cls, case):
        window, stride, padding = case
        pool = cls(window, stride=stride, padding=padding)
        x = sample(case).astype(mx.float64)
        with mx.stream(mx.cpu):
            r = mx.array(np.random.default_rng(1).normal(size=pool(x).shape), dtype=mx.float64)
        check_gradients(lambda v, r: mx.sum(pool(v) * r), x, r, samples=20)

    @pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float64])
    def test_runs_in_input_dtype(self, cls, dtype):
        pool = cls((2, 2), stride=1, padding=1)
        x = sample(((2, 2), 1, 1))
        with mx.stream(mx.cpu):
            y = pool(x.astype(dtype))
            assert y.dtype == dtype
            np.testing.assert_allclose(np64(y), np64(pool(x)), rtol=1e-2, atol=1e-2)

    def test_autocast_leaves_dtype_alone(self, cls):
        pool = cls((2, 2))
        with autocast(mx.bfloat16, device="cpu"):
            assert pool(mx.ones((1, 4, 4, 2))).dtype == mx.float32
            assert pool(mx.ones((1, 4, 4, 2), dtype=mx.float16)).dtype == mx.float16

    def test_repr(self, cls):
        name = cls.__name__
        assert repr(cls((2, 2))) == f"{name}((2, 2))"
        assert repr(cls((3,), stride=1, padding=1)) == f"{name}((3,), stride=1, pad=1)"
        assert repr(cls((3, 3), stride=(1, 2), padding="same")) == \
            f"{name}((3, 3), stride=(1, 2), pad='same')"
        assert repr(cls((2, 2), stride=2, padding=((1, 0), (0, 1)))) == \
            f"{name}((2, 2), pad=((1, 0), (0, 1)))"
        assert repr(Chain(cls((2, 2)))).splitlines()[1] == f"  {name}((2, 2)),"

    def test_bad_arguments(self, cls):
        name = cls.__name__
        with pytest.raises(TypeError, match=rf"\[{name}\] window must be a tuple.*write \(2,\)"):
            cls(2)
        with pytest.raises(ValueError, match=rf"\[{name}\] window must hold positive integers"):
            cls((2, 0))
        with pytest.raises(ValueError, match=rf"\[{name}\] stride must be an int or a tuple of 2"):
            cls((2, 2), stride=(1, 1, 1))
        with pytest.raises(ValueError, match=rf"\[{name}\] unknown padding 'valid'"):
            cls((2, 2), padding="valid")
        with pytest.raises(ValueError, match=rf"\[{name}\] padding \(\(2, 2\),\) must be smaller "
                                             r"than the window \(2,\)"):
            cls((2,), padding=2)

    def test_bad_input(self, cls):
        name = cls.__name__
        pool = cls((3, 3))
        with pytest.raises(ValueError, match=rf"\[{name}\] expected input of shape \(N, H, W, C\) "
                                             r"for a 2-D pool, got shape \(4, 4, 1\)"):
            pool(mx.ones((4, 4, 1)))
        with pytest.raises(ValueError, match=rf"\[{name}\] input of shape \(1, 2, 4, 1\) is too "
                                             r"small.*\(2, 4\).*window \(3, 3\)"):
            pool(mx.ones((1, 2, 4, 1)))
        with pytest.raises(TypeError, match=rf"\[{name}\] expected an mx.array input"):
            pool(np.ones((1, 4, 4, 1)))


def test_maxpool_ignores_padding_even_for_negative_input():
    y = MaxPool((2,), stride=1, padding=1)(mx.array([[[-12.0], [-11.5], [-13.0]]]))
    assert y[0, :, 0].tolist() == [-12.0, -11.5, -11.5, -13.0]


def test_maxpool_integer_input():
    x = mx.array([[[3], [-7], [5]]], dtype=mx.int32)
    y = MaxPool((2,), stride=1, padding=1)(x)
    assert y.dtype == mx.int32 and y[0, :, 0].tolist() == [3, 3, 5, 5]


def test_meanpool_counts_padding_as_zero():
    y = MeanPool((3,), stride=1, padding=1)(mx.array([[[3.0], [6.0]]]))
    np.testing.assert_allclose(np64(y)[0, :, 0], [3.0, 3.0])


@pytest.mark.parametrize("cls, reduce", [(GlobalMaxPool, np.max), (GlobalMeanPool, np.mean)])
class TestGlobalPools:
    @pytest.mark.parametrize("shape", [(2, 5, 3), (2, 4, 5, 3), (2, 3, 4, 2, 3)])
    def test_matches_numpy_and_keeps_singleton_axes(self, cls, reduce, shape):
        x = distinct(*shape)
        y = cls()(x)
        axes = tuple(range(1, len(shape) - 1))
        assert y.shape == (2, *(1,) * len(axes), 3) and y.dtype == mx.float32
        np.testing.assert_allclose(np64(y), reduce(np64(x), axis=axes, keepdims=True), rtol=1e-6)

    def test_gradients_float64(self, cls, reduce):
        x = distinct(2, 3, 4, 2).astype(mx.float64)
        r = mx.array(np.random.default_rng(1).normal(size=(2, 1, 1, 2)), dtype=mx.float64)
        check_gradients(lambda v, r: mx.sum(cls()(v) * r), x, r, samples=20)

    def test_dtype_and_repr(self, cls, reduce):
        assert cls()(mx.ones((1, 2, 2, 3), dtype=mx.bfloat16)).dtype == mx.bfloat16
        assert repr(cls()) == f"{cls.__name__}()"
        assert cls().parameters() == {}

    def test_feeds_flatten(self, cls, reduce):
        model = Chain(Conv((3, 3), 1, 4, padding=1), cls(), flatten)
        assert model(mx.ones((2, 6, 6, 1))).shape == (2, 4)

    def test_bad_input(self, cls, reduce):
        name = cls.__name__
        with pytest.raises(ValueError, match=rf"\[{name}\] expected input of shape "
                                             r"\(N, \*spatial, C\).*got shape \(2, 3\)"):
            cls()(mx.ones((2, 3)))
        with pytest.raises(TypeError, match=rf"\[{name}\] expected an mx.array input"):
            cls()([1.0, 2.0])


class TestAdaptiveMeanPool:
    @pytest.mark.parametrize("shape, out_size", [
        ((2, 8, 3), (4,)),          # divisible
        ((2, 10, 3), (4,)),         # overlapping boxes
        ((2, 3, 3), (5,)),          # output larger than input
        ((2, 8, 6, 3), (4, 3)),
        ((2, 10, 7, 3), (4, 4)),
        ((2, 5, 6, 3), (5, 1)),
        ((1, 6, 5, 7, 2), (3, 2, 3)),
    ])
    def test_matches_numpy_reference(self, shape, out_size):
        x = normal(*shape)
        y = AdaptiveMeanPool(out_size)(x)
        assert y.shape == (shape[0], *out_size, shape[-1]) and y.dtype == mx.float32
        np.testing.assert_allclose(np64(y), adaptive_reference(np64(x), out_size), rtol=1e-5,
                                   atol=1e-6)

    def test_divisible_is_mean_pool(self):
        x = normal(2, 8, 12, 3)
        np.testing.assert_allclose(np64(AdaptiveMeanPool((4, 3))(x)),
                                   np64(MeanPool((2, 4))(x)), rtol=1e-6, atol=1e-7)

    def test_gradients_float64(self):
        pool = AdaptiveMeanPool((3, 2))
        x = normal(2, 7, 5, 2).astype(mx.float64)
        r = mx.array(np.random.default_rng(1).normal(size=(2, 3, 2, 2)), dtype=mx.float64)
        check_gradients(lambda v, r: mx.sum(pool(v) * r), x, r, samples=20)

    def test_dtype_repr_policy(self):
        pool = AdaptiveMeanPool((4, 4))
        assert repr(pool) == "AdaptiveMeanPool((4, 4))"
        assert pool(mx.ones((1, 9, 9, 2), dtype=mx.bfloat16)).dtype == mx.bfloat16
        assert policy_of(pool) == "none" and pool.parameters() == {}

    def test_bad_arguments_and_input(self):
        with pytest.raises(TypeError, match=r"\[AdaptiveMeanPool\] out_size must be a tuple"):
            AdaptiveMeanPool(4)
        with pytest.raises(ValueError, match=r"\[AdaptiveMeanPool\] out_size must hold positive"):
            AdaptiveMeanPool((4, 0))
        with pytest.raises(ValueError, match=r"\[AdaptiveMeanPool\] expected input of shape "
                                             r"\(N, H, W, C\) for a 2-D pool, got shape \(9, 9\)"):
            AdaptiveMeanPool((4, 4))(mx.ones((9, 9)))


# --- half precision: means accumulate in float32 ---------------------------------------------

# (pool, numpy reference of its float64 result): MeanPool tiles, overlapping windows with
# padding, GlobalMeanPool, and AdaptiveMeanPool's divisible and overlapping-box paths.
HALF_MEANS = {
    "MeanPool": (MeanPool((1000,)), lambda x: x.mean(1, keepdims=True)),
    "MeanPool-overlap": (MeanPool((900,), stride=50, padding=1),
                         lambda x: pool_reference(x, (900,), (50,), ((1, 1),), np.mean, 0.0)),
    "GlobalMeanPool": (GlobalMeanPool(), lambda x: x.mean(1, keepdims=True)),
    "AdaptiveMeanPool-tiles": (AdaptiveMeanPool((2,)), lambda x: adaptive_reference(x, (2,))),
    "AdaptiveMeanPool-boxes": (AdaptiveMeanPool((3,)), lambda x: adaptive_reference(x, (3,))),
}


@pytest.mark.parametrize("name", sorted(HALF_MEANS))
def test_float16_mean_does_not_overflow(name):
    # 1000 values near 300: any float16 sum of more than ~220 of them passes 65504.
    pool, reference = HALF_MEANS[name]
    x = (300 + 10 * normal(2, 1000, 3)).astype(mx.float16)
    y = pool(x)
    assert y.dtype == mx.float16
    expected = reference(np64(x))
    assert np.isfinite(np64(y)).all()
    np.testing.assert_allclose(np64(y), expected, rtol=2**-10)  # within float16 rounding
    np.testing.assert_allclose(np64(y), np64(pool(x.astype(mx.float32))), rtol=2**-10)
    # The float32 accumulation keeps the gradient: d sum(pool(x)) / dx in float16.
    grad = mx.grad(lambda v: mx.sum(pool(v).astype(mx.float32)))(x)
    assert grad.dtype == mx.float16
    with mx.stream(mx.cpu):
        ones = mx.ones(x.shape, dtype=mx.float64)
        grad64 = mx.grad(lambda v: mx.sum(pool(v)))(ones)
    np.testing.assert_allclose(np64(grad), np64(grad64), rtol=2**-10)


# (pool, input length) whose windows or boxes hold a count of ones (1500, 1501, 3000) that
# MLX's bfloat16 mean gets wrong: it rounds the sum to bfloat16 (3000 -> 3008) before dividing.
BFLOAT16_MEANS = {
    "MeanPool": (MeanPool((1500,)), 3000),
    "MeanPool-overlap": (MeanPool((1500,), stride=300), 3000),
    "GlobalMeanPool": (GlobalMeanPool(), 3000),
    "AdaptiveMeanPool-tiles": (AdaptiveMeanPool((2,)), 3000),
    "AdaptiveMeanPool-boxes": (AdaptiveMeanPool((2,)), 3001),
}


@pytest.mark.parametrize("name", sorted(BFLOAT16_MEANS))
def test_bfloat16_mean_is_correctly_rounded(name):
    pool, length = BFLOAT16_MEANS[name]
    y = pool(mx.ones((1, length, 2), dtype=mx.bfloat16))
    assert y.dtype == mx.bfloat16
    assert set(np64(y).reshape(-1).tolist()) == {1.0}  # not 1.0078125


def test_float16_global_mean_under_autocast_and_f16mix_is_finite():
    # The reviewer's case: a 56x56 feature map of 25s through a float16 Conv (sum 78400).
    eye = lambda shape: mx.eye(8).reshape(shape)  # noqa: E731
    model = Chain(Conv((1, 1), 8, 8, init=eye), GlobalMeanPool(), flatten)
    x = mx.full((2, 56, 56, 8), 25.0)
    with autocast(mx.float16, device="cpu"):
        y = model(x)
    assert y.dtype == mx.float16 and np64(y).tolist() == [[25.0] * 8] * 2
    y = f16mix(model)(x)
    assert y.dtype == mx.float16 and np64(y).tolist() == [[25.0] * 8] * 2


def test_integer_arguments_of_any_type_and_no_bools():
    i64 = np.int64
    pool = MaxPool((i64(2), np.int32(2)), stride=i64(1), padding=(i64(1), (np.uint8(0), 1)))
    assert repr(pool) == "MaxPool((2, 2), stride=1, pad=((1, 1), (0, 1)))"
    assert all(type(v) is int for v in (*pool.window, *pool.stride, *sum(pool.padding, ())))
    assert repr(MeanPool((i64(3),), padding=i64(1))) == "MeanPool((3,), pad=1)"
    assert repr(AdaptiveMeanPool((i64(4), i64(2)))) == "AdaptiveMeanPool((4, 2))"
    assert type(AdaptiveMeanPool((i64(4),)).out_size[0]) is int
    with pytest.raises(TypeError, match=r"\[MeanPool\] window must be a tuple.*got 2; write "
                                        r"\(2,\) for 1-D"):
        MeanPool(i64(2))
    with pytest.raises(ValueError, match=r"\[MaxPool\] window must hold positive integers"):
        MaxPool((True, 2))
    with pytest.raises(ValueError, match=r"\[MaxPool\] stride must be an int"):
        MaxPool((2,), stride=np.bool_(True))
    with pytest.raises(ValueError, match=r"\[MeanPool\] padding must"):
        MeanPool((2,), padding=((True, 0),))
    with pytest.raises(ValueError, match=r"\[AdaptiveMeanPool\] out_size must hold positive"):
        AdaptiveMeanPool((2, False))


@pytest.mark.parametrize("pool", [GlobalMaxPool(), GlobalMeanPool(), AdaptiveMeanPool((2,)),
                                  MaxPool((2,), padding=1), MeanPool((2,), padding=1),
                                  MaxPool((1,))],
                         ids=["GlobalMaxPool", "GlobalMeanPool", "AdaptiveMeanPool", "MaxPool",
                              "MeanPool", "MaxPool-1"])
def test_empty_spatial_axis_is_a_clear_error(pool):
    name = type(pool).__name__
    with pytest.raises(ValueError, match=rf"^\[{name}\] expected non-empty spatial axes, "
                                         r"got shape \(2, 0, 3\)$"):
        pool(mx.ones((2, 0, 3)))
    # an empty batch is fine: nothing is pooled over nothing
    assert pool(mx.ones((0, 4, 3))).shape[0] == 0


@pytest.mark.parametrize("cls", [GlobalMaxPool, GlobalMeanPool])
def test_global_pools_take_any_number_of_spatial_axes(cls):
    x = normal(2, 2, 3, 2, 2, 3)  # four spatial axes
    reduce = np.max if cls is GlobalMaxPool else np.mean
    np.testing.assert_allclose(np64(cls()(x)), reduce(np64(x), axis=(1, 2, 3, 4), keepdims=True),
                               rtol=1e-6)
    with pytest.raises(ValueError, match=rf"\[{cls.__name__}\] expected input of shape "
                                         r"\(N, \*spatial, C\) with at least one spatial axis"):
        cls()(mx.ones((2, 3)))


@pytest.mark.parametrize("pool", [MaxPool((2, 2)), MeanPool((2, 2)), MaxPool((3,), stride=1)])
def test_channels_first_input_too_small_for_the_window_gets_the_transpose(pool):
    shape = (2, 1, 28, 28)[: len(pool.window) + 2]
    perm = "(0, 2, 3, 1)" if len(shape) == 4 else "(0, 2, 1)"
    with pytest.raises(ValueError, match=r"is too small: .*; if it is channels first: .*"
                                         + re.escape(f"x.transpose{perm}") + "$"):
        pool(mx.ones(shape))
    assert pool(mx.ones((2, *shape[2:], 1))).shape[-1] == 1


def test_transpose_hint_only_when_the_channels_first_reading_would_fit():
    with pytest.raises(ValueError, match=r"x\.transpose\(0, 2, 3, 1\)$"):
        MaxPool((2, 2))(mx.ones((2, 1, 2, 28)))
    with pytest.raises(ValueError, match=r"smaller than the window \(2, 2\)$"):
        MaxPool((2, 2))(mx.ones((2, 1, 1, 28)))
