import itertools

import mlx.core as mx
import numpy as np
import pytest
from helpers import check_gradients, normal, np64

from fluxlike import Chain, Conv, PixelShuffle, Upsample, autocast, policy_of
from fluxlike.layers.upsample import pixel_shuffle

# --- numpy references ------------------------------------------------------------------------


def linear_reference(x, out_sizes, align_corners):
    """Separable linear interpolation of (N, *spatial, C): NNlib's source coordinate
    i * (n - 1) / (m - 1) with aligned corners, PyTorch's (i + 0.5) * n / m - 0.5 (clamped
    to the input) without."""
    for axis, m in enumerate(out_sizes, start=1):
        n = x.shape[axis]
        i = np.arange(m, dtype=np.float64)
        if align_corners:
            src = i * ((n - 1) / max(m - 1, 1))
        else:
            src = np.clip((i + 0.5) * n / m - 0.5, 0, n - 1)
        lo = np.floor(src).astype(int)
        hi = np.minimum(lo + 1, n - 1)
        w = (src - lo).reshape([-1 if a == axis else 1 for a in range(x.ndim)])
        x = np.take(x, lo, axis=axis) * (1 - w) + np.take(x, hi, axis=axis) * w
    return x


def pixel_shuffle_reference(x, r):
    """y[n, s1*r + o1, ..., c] = x[n, s1, ..., c * r**d + (o1, ..., od) row-major]."""
    n, *spatial, channels = x.shape
    d = len(spatial)
    out = np.zeros((n, *(s * r for s in spatial), channels // r**d), dtype=x.dtype)
    for s in np.ndindex(*spatial):
        for o in np.ndindex(*(r,) * d):
            offset = np.ravel_multi_index(o, (r,) * d)
            at = tuple(a * r + b for a, b in zip(s, o, strict=True))
            out[(slice(None), *at)] = x[(slice(None), *s)][..., offset::r**d]
    return out


def check_input_gradient(layer, x):
    """Finite differences in float64 of sum(layer(x) * r) with respect to x."""
    x = x.astype(mx.float64)
    with mx.stream(mx.cpu):
        r = mx.array(np.random.default_rng(0).normal(size=layer(x).shape))
        check_gradients(lambda a, b: mx.sum(layer(a) * r) + mx.sum(layer(b) * r), x, x + 0.25)


# --- Upsample --------------------------------------------------------------------------------


class TestUpsample:
    @pytest.mark.parametrize("scale, shape", [
        (2, (2, 3, 2)), (3, (1, 2, 3, 2)), ((2, 3), (2, 3, 2, 1)), ((1, 2, 2), (1, 2, 2, 3, 2)),
    ])
    def test_nearest_repeats_each_value(self, scale, shape):
        x = normal(*shape)
        n = len(shape) - 2
        factors = scale if isinstance(scale, tuple) else (scale,) * n
        expected = np64(x)
        for axis, f in enumerate(factors, start=1):
            expected = np.repeat(expected, f, axis=axis)
        y = Upsample(scale=scale)(x)
        assert y.dtype == mx.float32
        np.testing.assert_array_equal(np64(y), expected)
        np.testing.assert_array_equal(np64(Upsample(scale)(x)), expected)  # Flux's Upsample(2)

    def test_nearest_by_size_and_of_integers(self):
        x = mx.arange(6).reshape(1, 2, 3, 1)
        y = Upsample(size=(4, 6))(x)
        assert y.dtype == mx.int32
        np.testing.assert_array_equal(np.array(y), np.repeat(np.repeat(np.array(x), 2, 1), 2, 2))
        assert Upsample(size=4)(mx.ones((2, 2, 2, 3))).shape == (2, 4, 4, 3)

    @pytest.mark.parametrize("mode, shape, out", [
        ("bilinear", (2, 3, 4, 2), (6, 8)),
        ("bilinear", (1, 3, 2, 1), (7, 5)),  # sizes that are no multiple
        ("trilinear", (1, 2, 3, 2, 2), (4, 5, 4)),
        ("linear", (2, 4, 3), (9,)),
    ])
    @pytest.mark.parametrize("align_corners", [True, False])
    def test_linear_modes_match_the_reference(self, mode, shape, out, align_corners):
        x = normal(*shape)
        layer = Upsample(mode, size=out, align_corners=align_corners)
        y = layer(x)
        assert y.shape == (shape[0], *out, shape[-1]) and y.dtype == mx.float32
        np.testing.assert_allclose(np64(y), linear_reference(np64(x), out, align_corners),
                                   rtol=1e-5, atol=1e-5)

    def test_scale_and_size_agree(self):
        x = normal(2, 3, 4, 2)
        np.testing.assert_array_equal(np64(Upsample("bilinear", scale=2)(x)),
                                      np64(Upsample("bilinear", size=(6, 8))(x)))

    @pytest.mark.parametrize("layer, shape", [
        (Upsample("bilinear", scale=2), (2, 3, 3, 2)),
        (Upsample("bilinear", size=(5, 4), align_corners=False), (1, 3, 2, 2)),
        (Upsample(scale=(2, 1)), (2, 2, 3, 1)),
    ], ids=["bilinear-aligned", "bilinear-size", "nearest"])
    def test_gradients_float64(self, layer, shape):
        check_input_gradient(layer, normal(*shape))

    @pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
    @pytest.mark.parametrize("mode", ["nearest", "bilinear"])
    def test_runs_in_the_input_dtype_in_and_out_of_a_scope(self, dtype, mode):
        assert policy_of(Upsample) == "none"
        layer = Upsample(mode, scale=2)
        x = normal(2, 3, 3, 2)
        reference = np64(layer(x))
        with autocast(dtype, device="cpu"):
            half = layer(x.astype(dtype))
            assert layer(x).dtype == mx.float32  # "none": a float32 input stays float32
        assert half.dtype == dtype
        np.testing.assert_allclose(np64(half), reference, rtol=1e-2, atol=2e-2)

    def test_in_a_chain_under_autocast_gradients_come_back_float32(self):
        model = Chain(Conv((3, 3), 2, 4, padding=1), Upsample("bilinear", scale=2))
        x = normal(1, 4, 4, 2)

        def loss(params):
            model.update(params)
            with autocast(mx.bfloat16, device="cpu"):
                y = model(x)
            assert y.dtype == mx.bfloat16
            return mx.sum(y.astype(mx.float32))

        grads = mx.grad(loss)(model.trainable_parameters())
        assert grads["layers"][0]["weight"].dtype == mx.float32

    def test_repr(self):
        assert repr(Upsample(2)) == "Upsample('nearest', scale=2)"
        assert repr(Upsample(scale=(2, 3))) == "Upsample('nearest', scale=(2, 3))"
        assert repr(Upsample("bilinear", size=(4, 5))) == "Upsample('bilinear', size=(4, 5))"
        assert repr(Upsample("trilinear", scale=1.5, align_corners=False)) == \
            "Upsample('trilinear', scale=1.5, align_corners=False)"
        assert repr(Chain(Upsample(2))).splitlines()[1] == "  Upsample('nearest', scale=2),"

    @pytest.mark.parametrize("make, message", [
        (lambda: Upsample("cubic", scale=2), r"unknown mode 'cubic'; expected one of"),
        (lambda: Upsample(scale=2, size=3), r"give either scale or size .* got scale=2, size=3"),
        (lambda: Upsample(), r"give either scale or size"),
        (lambda: Upsample(scale=0), r"scale must be a positive number or a tuple of them, got 0"),
        (lambda: Upsample(scale=(2, "2")), r"scale must be a positive number"),
        (lambda: Upsample(size=(4, 0)), r"size must be a positive integer, got 0"),
        (lambda: Upsample("bilinear", scale=2, align_corners=1), r"align_corners must be True"),
    ])
    def test_bad_construction(self, make, message):
        with pytest.raises((ValueError, TypeError), match=r"\[Upsample\] " + message):
            make()

    @pytest.mark.parametrize("layer, x, error, message", [
        (Upsample("bilinear", scale=2), mx.ones((1, 4, 2)), ValueError,
         r"mode 'bilinear' takes input of shape \(N, H, W, C\), got shape \(1, 4, 2\); "
         r"mode='linear'"),
        (Upsample(scale=(2, 2)), mx.ones((1, 4, 4, 4, 2)), ValueError,
         r"scale=\(2, 2\) has 2 entries but the input has 3 spatial axes"),
        (Upsample("bilinear", scale=2), mx.ones((1, 2, 2, 1), dtype=mx.int32), TypeError,
         r"mode 'bilinear' interpolates: expected a floating input, got mlx.core.int32"),
        (Upsample(2), mx.ones((4, 3)), ValueError, r"expected input .* at least one spatial axis"),
        (Upsample(2), [1.0], TypeError, r"expected an mx.array input, got list"),
        (Upsample(scale=0.1), mx.ones((1, 4, 1)), ValueError, r"scale 0.1 leaves nothing"),
    ])
    def test_bad_input(self, layer, x, error, message):
        with pytest.raises(error, match=r"\[Upsample\] " + message):
            layer(x)


# --- PixelShuffle ----------------------------------------------------------------------------


class TestPixelShuffle:
    @pytest.mark.parametrize("r, shape", [(2, (2, 3, 3, 8)), (3, (1, 2, 2, 9)), (2, (2, 5, 6)),
                                          (2, (1, 2, 2, 3, 16))])
    def test_matches_the_reference(self, r, shape):
        x = normal(*shape)
        y = PixelShuffle(r)(x)
        expected = pixel_shuffle_reference(np64(x), r)
        assert y.shape == expected.shape
        np.testing.assert_array_equal(np64(y), expected)

    def test_pytorch_channel_order_in_2d(self):
        r, c = 2, 3
        x = np.arange(2 * 2 * 3 * c * r * r).reshape(2, 2, 3, c * r * r)
        y = np.array(pixel_shuffle(mx.array(x), r))
        for n, h, w, i, j, k in itertools.product(range(2), range(2), range(3), range(r),
                                                   range(r), range(c)):
            assert y[n, h * r + i, w * r + j, k] == x[n, h, w, k * r * r + i * r + j]

    def test_gradients_float64(self):
        check_input_gradient(PixelShuffle(2), normal(1, 2, 3, 8))

    @pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
    def test_keeps_the_input_dtype_under_autocast(self, dtype):
        assert policy_of(PixelShuffle) == "none"
        x = normal(1, 2, 2, 4)
        with autocast(dtype, device="cpu"):
            y = PixelShuffle(2)(x.astype(dtype))
            assert PixelShuffle(2)(x).dtype == mx.float32
        assert y.dtype == dtype
        np.testing.assert_array_equal(np64(y), np64(PixelShuffle(2)(x).astype(dtype)))

    def test_repr_and_parameters(self):
        assert repr(PixelShuffle(3)) == "PixelShuffle(3)"
        assert PixelShuffle(3).parameters() == {}

    def test_errors(self):
        with pytest.raises(ValueError, match=r"\[PixelShuffle\] r must be a positive integer"):
            PixelShuffle(0)
        with pytest.raises(ValueError, match=r"\[PixelShuffle\] the channels \(last axis\) must "
                                             r"be a multiple of r\^2 = 4 for 2 spatial axes, "
                                             r"got shape \(1, 8, 8, 6\)"):
            PixelShuffle(2)(mx.ones((1, 8, 8, 6)))
        with pytest.raises(ValueError, match=r"\[PixelShuffle\] expected input of shape"):
            PixelShuffle(2)(mx.ones((4, 8)))
