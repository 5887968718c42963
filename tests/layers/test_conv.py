import math
import re

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_unchanged, normal, np64, snapshot
from mlx.utils import tree_flatten

from fluxlike import Chain, Conv, ConvTranspose, CrossCor, DepthwiseConv, autocast, policy_of, relu
from fluxlike.precision import kernels

# --- numpy references (NHWC, weight (out, *kernel, in // groups)) ----------------------------


def conv_reference(x, w, b, stride, pads, dilation, groups):
    """Direct convolution: for each kernel offset, a strided slice of the padded input times
    that offset's weight matrix, summed (cross-correlation, as Flux's and MLX's conv)."""
    x = np.pad(x, [(0, 0), *pads, (0, 0)])
    spatial, kernel = x.shape[1:-1], w.shape[1:-1]
    out = [(n - d * (k - 1) - 1) // s + 1
           for n, k, s, d in zip(spatial, kernel, stride, dilation, strict=True)]
    per_group_out, per_group_in = w.shape[0] // groups, w.shape[-1]
    y = np.zeros((x.shape[0], *out, w.shape[0]))
    for offset in np.ndindex(*kernel):
        taps = tuple(slice(k * d, k * d + (o - 1) * s + 1, s)
                     for k, d, o, s in zip(offset, dilation, out, stride, strict=True))
        patch = x[(slice(None), *taps)]
        for g in range(groups):
            outs = slice(g * per_group_out, (g + 1) * per_group_out)
            ins = slice(g * per_group_in, (g + 1) * per_group_in)
            y[..., outs] += patch[..., ins] @ w[(outs, *offset)].T
    return y if b is None else y + b


def conv_transpose_reference(x, w, b, stride, pads, dilation, output_padding, groups):
    """Scatter-add definition: input position i sends x[i] @ w[:, k].T to output position
    i * stride + k * dilation on the full grid, which is then extended by output_padding at
    the high end and cropped by (lo, hi)."""
    spatial, kernel = x.shape[1:-1], w.shape[1:-1]
    full = [(n - 1) * s + d * (k - 1) + 1 + op for n, s, d, k, op in
            zip(spatial, stride, dilation, kernel, output_padding, strict=True)]
    per_group_out, per_group_in = w.shape[0] // groups, w.shape[-1]
    y = np.zeros((x.shape[0], *full, w.shape[0]))
    for i in np.ndindex(*spatial):
        for offset in np.ndindex(*kernel):
            taps = zip(i, stride, offset, dilation, strict=True)
            at = tuple(a * s + k * d for a, s, k, d in taps)
            for g in range(groups):
                outs = slice(g * per_group_out, (g + 1) * per_group_out)
                ins = slice(g * per_group_in, (g + 1) * per_group_in)
                y[(slice(None), *at, outs)] += x[(slice(None), *i, ins)] @ w[(outs, *offset)].T
    y = y[(slice(None), *(slice(lo, f - hi) for (lo, hi), f in zip(pads, full, strict=True)))]
    return y if b is None else y + b


# --- helpers ---------------------------------------------------------------------------------


def with_random_bias(layer, seed=1):
    if layer.bias is not None:
        layer.bias = normal(*layer.bias.shape, seed=seed)
    return layer


def reference_of(layer):
    """The numpy reference of a Conv/ConvTranspose as a function of (x, weight, bias)."""
    if isinstance(layer, ConvTranspose):
        return lambda x, w, b: conv_transpose_reference(
            x, w, b, layer.stride, layer.padding, layer.dilation, layer.output_padding,
            layer.groups)
    return lambda x, w, b: conv_reference(x, w, b, layer.stride, layer.padding, layer.dilation,
                                          layer.groups)


def check_gradients_against_reference(layer, x, dtype=mx.float32, samples=6, seed=0):
    """MLX's gradients of sum(layer(x) * r) w.r.t. x, weight and bias (``layer`` and ``x`` in
    ``dtype``, on the CPU) against central differences of the float64 numpy reference: exact
    up to rounding, as the map is bilinear (so ``layer`` must have no activation).

    Why not check_layer_gradients: MLX's CPU convolution rounds float64 operands to float32
    precision (conv_general(1 + 1e-12, 1) == 1), so float64 finite differences through it
    carry errors of ~1e-7 / eps, and it has no float64 kernel at all for dilation, groups or
    the input gradient of a strided convolution."""
    rng = np.random.default_rng(seed)
    reference = reference_of(layer)
    args = [np64(x), np64(layer.weight), np64(layer.bias)]
    r = rng.normal(size=reference(*args).shape)
    with mx.stream(mx.cpu):
        x, w, b = (mx.array(a, dtype=dtype) for a in args)
        originals = (layer.weight, layer.bias)

        def loss(x, w, b):
            layer.update({"weight": w, "bias": b})
            return mx.sum(layer(x) * mx.array(r, dtype=dtype))

        try:
            grads = mx.grad(loss, argnums=(0, 1, 2))(x, w, b)
            assert all(g.dtype == dtype for g in grads)
            grads = [np64(g) for g in grads]
        finally:
            layer.update({"weight": originals[0], "bias": originals[1]})
    for k, (arg, grad) in enumerate(zip(args, grads, strict=True)):
        picks = rng.choice(arg.size, size=min(samples, arg.size), replace=False)
        numeric = []
        for i in picks:
            up, down = [a.copy() for a in args], [a.copy() for a in args]
            up[k].flat[i] += 0.5
            down[k].flat[i] -= 0.5
            numeric.append(np.sum((reference(*up) - reference(*down)) * r))
        np.testing.assert_allclose(grad.reshape(-1)[picks], numeric, rtol=1e-4, atol=1e-4,
                                   err_msg=f"gradient of argument {k}")


# (kernel, stride, padding, dilation, groups): every option in 1-D, 2-D and 3-D, with odd
# input sizes so strides leave ragged ends.
CONV_CASES = [
    ((3,), 1, 0, 1, 1),
    ((3,), 2, 1, 1, 1),
    ((4,), 1, "same", 2, 2),
    ((3,), 3, ((2, 0),), 1, 4),
    ((2, 3), 1, 0, 1, 1),
    ((4, 3), 2, "same", 1, 1),
    ((3, 2), (2, 1), ((1, 0), (0, 2)), (1, 2), 2),
    ((3, 3), 1, (1, (0, 1)), 2, 4),
    ((2, 2, 2), 1, 0, 1, 1),
    ((3, 3, 3), 2, "same", 1, 2),
    ((3, 2, 3), (1, 2, 2), ((0, 1), (1, 1), (2, 0)), (2, 1, 1), 1),
]


def case_id(case):
    kernel, stride, padding, dilation, groups = case
    return f"{len(kernel)}d-k{kernel}-s{stride}-p{padding}-d{dilation}-g{groups}"


def make(cls, case, in_ch=4, out_ch=8, **extra):
    kernel, stride, padding, dilation, groups = case
    layer = cls(kernel, in_ch, out_ch, stride=stride, padding=padding, dilation=dilation,
                groups=groups, **extra)
    return with_random_bias(layer)


class TestConv:
    def test_construction_positional_and_keyword(self):
        a = Conv((3, 3), 2, 6, relu)
        b = Conv(kernel=(3, 3), in_channels=2, out_channels=6, act=relu, stride=2, padding=1,
                 dilation=1, groups=2, bias=False)
        assert a.weight.shape == (6, 3, 3, 2) and a.bias.shape == (6,)
        assert b.weight.shape == (6, 3, 3, 1) and b.bias is None
        assert "bias" not in b.parameters()
        assert a.weight.dtype == mx.float32 and a.act is relu
        assert Conv((5,), 1, 2).weight.shape == (2, 5, 1)
        assert Conv((1, 2, 3), 3, 2).weight.shape == (2, 1, 2, 3, 3)
        assert Conv((3,), 2, 2, init=lambda s: mx.ones(s)).weight.tolist() == [[[1, 1]] * 3] * 2

    def test_parameters_are_only_weight_and_bias(self):
        keys = [k for k, _ in tree_flatten(Conv((3, 3), 2, 4, stride=2).parameters())]
        assert keys == ["weight", "bias"]

    @pytest.mark.parametrize("case", CONV_CASES, ids=case_id)
    def test_matches_numpy_reference(self, case):
        layer = make(Conv, case)
        x = normal(2, *(7 - i for i in range(len(case[0]))), 4)
        y = layer(x)
        expected = conv_reference(np64(x), np64(layer.weight), np64(layer.bias), layer.stride,
                                  layer.padding, layer.dilation, layer.groups)
        assert y.shape == expected.shape and y.dtype == mx.float32
        np.testing.assert_allclose(np64(y), expected, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("kernel", [(1,), (2,), (3,), (4,), (5,)])
    @pytest.mark.parametrize("stride", [1, 2, 3])
    @pytest.mark.parametrize("dilation", [1, 2])
    def test_same_padding_gives_ceil_of_input_over_stride(self, kernel, stride, dilation):
        layer = Conv(kernel, 1, 1, stride=stride, padding="same", dilation=dilation)
        total = dilation * (kernel[0] - 1)
        assert layer.padding == ((total - total // 2, total // 2),)  # the odd row goes low
        for n in (5, 6, 9):
            assert layer(mx.ones((1, n, 1))).shape == (1, math.ceil(n / stride), 1)

    def test_activation_applied_after_bias(self):
        layer = with_random_bias(Conv((3, 3), 2, 3, relu, padding=1))
        x = normal(1, 5, 5, 2)
        plain = conv_reference(np64(x), np64(layer.weight), np64(layer.bias), (1, 1),
                               ((1, 1), (1, 1)), (1, 1), 1)
        np.testing.assert_allclose(np64(layer(x)), np.maximum(plain, 0), rtol=1e-5, atol=1e-5)

    def test_no_bias(self):
        layer = Conv((3,), 2, 3, bias=False)
        x = normal(2, 6, 2)
        expected = conv_reference(np64(x), np64(layer.weight), None, (1,), ((0, 0),), (1,), 1)
        np.testing.assert_allclose(np64(layer(x)), expected, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("kernel, padding", [
        ((3,), ((1, 0),)), ((2, 3), ((0, 1), (2, 1))), ((2, 2, 3), "same"),
    ])
    def test_gradients_float64(self, kernel, padding):
        # MLX's CPU convolution has float64 kernels for stride 1, no dilation, one group.
        layer = with_random_bias(Conv(kernel, 2, 3, padding=padding))
        x = normal(2, *(5 - i for i in range(len(kernel))), 2)
        check_gradients_against_reference(layer, x, mx.float64)

    @pytest.mark.parametrize("case", CONV_CASES, ids=case_id)
    def test_gradients_float32(self, case):
        layer = make(Conv, case)
        check_gradients_against_reference(layer, normal(2, *(7 - i for i in range(len(case[0]))),
                                                        4))

    def test_repr(self):
        assert repr(Conv((3, 3), 1, 8, relu, stride=2, padding=1)) == \
            "Conv((3, 3), 1 => 8, relu, stride=2, pad=1)  # 80 parameters"
        assert repr(Conv((3,), 4, 8, groups=2, bias=False)) == \
            "Conv((3,), 4 => 8, groups=2, bias=False)  # 48 parameters"
        assert repr(Conv((3, 3), 2, 2, stride=(1, 2), padding=(1, 0), dilation=2)) == \
            "Conv((3, 3), 2 => 2, stride=(1, 2), pad=(1, 0), dilation=2)  # 38 parameters"
        assert repr(Conv((2, 2), 1, 1, padding=((1, 0), (0, 1)))) == \
            "Conv((2, 2), 1 => 1, pad=((1, 0), (0, 1)))  # 5 parameters"
        assert repr(Conv((3,), 1, 1, padding="same")) == \
            "Conv((3,), 1 => 1, pad='same')  # 4 parameters"
        assert repr(Chain(Conv((3, 3), 1, 2), relu)).splitlines()[1] == \
            "  Conv((3, 3), 1 => 2),  # 20 parameters"

    def test_autocast_bfloat16_through_ops_conv(self, monkeypatch):
        layer = with_random_bias(Conv((3, 3), 2, 4, padding=1))
        calls = []
        kernel = kernels.conv
        monkeypatch.setattr(kernels, "conv", lambda *a: calls.append((a[0].dtype, a[1].dtype))
                            or kernel(*a))
        x = normal(2, 5, 5, 2)
        with autocast(mx.bfloat16, device="cpu"):
            out = layer(x)
        assert out.dtype == mx.bfloat16
        assert layer.weight.dtype == mx.float32 and layer.bias.dtype == mx.float32
        assert calls == [(mx.bfloat16, mx.bfloat16)]
        np.testing.assert_allclose(np64(out), np64(layer(x)), rtol=5e-2, atol=5e-2)

        def loss(w):
            layer.update({"weight": w})
            with autocast(mx.bfloat16, device="cpu"):
                return mx.sum(layer(x))

        assert mx.grad(loss)(layer.weight).dtype == mx.float32

    def test_bfloat16_model_takes_float32_input(self):
        layer = Conv((3,), 2, 2)
        layer.update({"weight": layer.weight.astype(mx.bfloat16),
                      "bias": layer.bias.astype(mx.bfloat16)})
        assert layer(mx.ones((1, 4, 2))).dtype == mx.bfloat16

    def test_unknown_padding_string(self):
        with pytest.raises(ValueError, match=r"\[Conv\] unknown padding 'xyz'; expected 'same', "
                                             r"an int or a tuple"):
            Conv((3, 3), 1, 1, padding="xyz")

    @pytest.mark.parametrize("padding", [-1, (1, 1, 1), ((1, 2, 3), 0), (1.5, 1), ((1, -1), 0)])
    def test_bad_padding(self, padding):
        with pytest.raises(ValueError, match=r"\[Conv\] padding must"):
            Conv((3, 3), 1, 1, padding=padding)

    def test_int_kernel_is_refused_with_the_fix(self):
        with pytest.raises(TypeError, match=r"\[Conv\] kernel must be a tuple.*write \(3,\) for "
                                            r"1-D or \(3, 3\) for 2-D"):
            Conv(3, 1, 1)

    @pytest.mark.parametrize("kernel", [(), (3, 3, 3, 3), (0, 3), (3, -1), (2.0,), "3"])
    def test_bad_kernel(self, kernel):
        with pytest.raises(ValueError, match=r"\[Conv\] kernel must"):
            Conv(kernel, 1, 1)

    @pytest.mark.parametrize("name", ["in_channels", "out_channels", "groups"])
    @pytest.mark.parametrize("bad", [0, -2, 1.5, True])
    def test_bad_sizes(self, name, bad):
        args = {"in_channels": 2, "out_channels": 2, "groups": 1, name: bad}
        with pytest.raises(ValueError, match=rf"\[Conv\] {name} must be a positive integer"):
            Conv((3,), **args)

    @pytest.mark.parametrize("name, bad", [("stride", 0), ("stride", (1, 2, 3)),
                                           ("dilation", (1, 0)), ("dilation", -1)])
    def test_bad_stride_or_dilation(self, name, bad):
        with pytest.raises(ValueError, match=rf"\[Conv\] {name} must be an int or a tuple of 2"):
            Conv((3, 3), 1, 1, **{name: bad})

    def test_groups_must_divide_channels(self):
        with pytest.raises(ValueError, match=r"\[Conv\] in_channels \(4\) and out_channels \(6\) "
                                             r"must both be divisible by groups \(4\)"):
            Conv((3,), 4, 6, groups=4)
        with pytest.raises(ValueError, match=r"divisible by groups \(2\)"):
            Conv((3,), 3, 4, groups=2)

    def test_bad_input_raises_and_leaves_model_unchanged(self):
        layer = with_random_bias(Conv((3, 3), 3, 2))
        before = snapshot(layer)
        with pytest.raises(ValueError, match=r"\[Conv\] expected input with 3 channels \(last "
                                             r"axis\), got shape \(1, 5, 5, 2\)"):
            layer(mx.ones((1, 5, 5, 2)))
        with pytest.raises(ValueError, match=r"\[Conv\] expected input of shape \(N, H, W, C\) "
                                             r"for a 2-D convolution, got shape \(5, 5, 3\)"):
            layer(mx.ones((5, 5, 3)))
        with pytest.raises(ValueError, match=r"\[Conv\] input of shape \(1, 2, 5, 3\) is too "
                                             r"small.*\(2, 5\).*\(3, 3\)"):
            layer(mx.ones((1, 2, 5, 3)))
        with pytest.raises(TypeError, match=r"\[Conv\] expected a floating-point input"):
            layer(mx.ones((1, 5, 5, 3), dtype=mx.int32))
        with pytest.raises(TypeError, match=r"\[Conv\] expected an mx.array input, got ndarray"):
            layer(np.ones((1, 5, 5, 3)))
        assert_unchanged(layer, before)

    def test_wrong_ndim_message_names_each_dimension(self):
        with pytest.raises(ValueError, match=r"\(N, L, C\) for a 1-D convolution"):
            Conv((3,), 1, 1)(mx.ones((4, 1)))
        with pytest.raises(ValueError, match=r"\(N, D, H, W, C\) for a 3-D convolution"):
            Conv((3, 3, 3), 1, 1)(mx.ones((1, 4, 4, 1)))


TRANSPOSE_CASES = [
    ((3,), 1, 0, 1, 1),
    ((3,), 2, 1, 1, 1),
    ((4,), 2, "same", 1, 2),
    ((2,), 3, ((0, 2),), 2, 4),
    ((3, 3), 1, 0, 1, 1),
    ((3, 3), 2, "same", 1, 1),
    ((4, 3), (2, 1), ((1, 0), (0, 2)), (1, 2), 2),
    ((3, 2), 2, 1, 1, 4),
    ((2, 2, 2), 1, 0, 1, 1),
    ((3, 3, 3), 2, "same", 1, 2),
    ((3, 2, 2), (1, 2, 3), ((0, 1), (1, 1), (2, 0)), (2, 1, 1), 1),
    # padding past dilation * (k - 1) with stride > 1: MLX alone shifts or refuses these
    ((1,), 2, 1, 1, 1),
    ((3,), 2, 3, 1, 1),
    ((2, 3), 2, ((2, 0), (3, 1)), 1, 2),
    ((1, 2, 3), 2, 1, 2, 1),
]


class TestConvTranspose:
    def test_construction_positional_and_keyword(self):
        a = ConvTranspose((3, 3), 8, 2, relu)
        b = ConvTranspose(kernel=(3, 3), in_channels=8, out_channels=2, act=relu, stride=2,
                          padding=1, dilation=1, output_padding=1, groups=2, bias=False)
        assert a.weight.shape == (2, 3, 3, 8) and a.bias.shape == (2,)
        assert b.weight.shape == (2, 3, 3, 4) and b.bias is None
        assert b.output_padding == (1, 1) and b.padding == ((1, 1), (1, 1))

    @pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=case_id)
    def test_matches_scatter_add_reference(self, case):
        layer = make(ConvTranspose, case)
        x = normal(2, *(4 - i for i in range(len(case[0]))), 4)
        y = layer(x)
        expected = conv_transpose_reference(
            np64(x), np64(layer.weight), np64(layer.bias), layer.stride, layer.padding,
            layer.dilation, layer.output_padding, layer.groups)
        assert y.shape == expected.shape and y.dtype == mx.float32
        assert y.shape[1:-1] == layer.output_size(x.shape[1:-1])
        np.testing.assert_allclose(np64(y), expected, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("output_padding", [1, (0, 2)])
    def test_output_padding(self, output_padding):
        layer = with_random_bias(ConvTranspose((3, 3), 2, 3, stride=3, padding=(1, 0),
                                               output_padding=output_padding))
        x = normal(1, 3, 4, 2)
        expected = conv_transpose_reference(np64(x), np64(layer.weight), np64(layer.bias),
                                            layer.stride, layer.padding, layer.dilation,
                                            layer.output_padding, 1)
        y = layer(x)
        assert y.shape == expected.shape
        np.testing.assert_allclose(np64(y), expected, rtol=1e-5, atol=1e-5)

    def test_is_the_adjoint_of_conv(self):
        # <conv(x), y> == <x, conv_transpose(y)> for the same weight: the defining property.
        conv = Conv((3, 2), 4, 6, stride=2, padding=((1, 0), (0, 1)), dilation=(1, 2), groups=2,
                    bias=False)
        tconv = ConvTranspose((3, 2), 6, 4, stride=2, padding=((1, 0), (0, 1)),
                              dilation=(1, 2), groups=2, output_padding=(1, 0), bias=False)
        # The transpose maps 6 -> 4 channels with weight (4, k, 3); conv's is (6, k, 2).
        w = np64(conv.weight).reshape(2, 3, 3, 2, 2).transpose(0, 4, 2, 3, 1).reshape(4, 3, 2, 3)
        tconv.weight = mx.array(w.astype(np.float32))
        x = normal(1, 7, 8, 4)
        y = normal(1, *conv(x).shape[1:-1], 6, seed=2)
        assert tconv(y).shape == x.shape
        np.testing.assert_allclose(mx.sum(conv(x) * y).item(), mx.sum(x * tconv(y)).item(),
                                   rtol=1e-4)

    @pytest.mark.parametrize("kernel", [(1,), (2,), (3,), (4,), (5,)])
    @pytest.mark.parametrize("stride", [1, 2, 3])
    @pytest.mark.parametrize("dilation", [1, 2])
    def test_same_padding_gives_input_times_stride(self, kernel, stride, dilation):
        layer = ConvTranspose(kernel, 1, 1, stride=stride, padding="same", dilation=dilation)
        crop = dilation * (kernel[0] - 1) + 1 - stride
        if crop >= 0:  # cropped as Conv pads: the odd row on the low side
            assert layer.padding == ((crop - crop // 2, crop // 2),)
            assert layer.output_padding == (0,)
        else:  # a kernel shorter than the stride: extended at the high end
            assert layer.padding == ((0, 0),) and layer.output_padding == (-crop,)
        for n in (1, 4, 5):
            assert layer(mx.ones((1, n, 1))).shape == (1, n * stride, 1)

    @pytest.mark.parametrize("kernel, padding", [
        ((3,), 1), ((2, 3), ((0, 1), (2, 1))), ((2, 2, 2), 0),
    ])
    def test_gradients_float64(self, kernel, padding):
        layer = with_random_bias(ConvTranspose(kernel, 2, 3, padding=padding))
        x = normal(2, *(4 - i for i in range(len(kernel))), 2)
        check_gradients_against_reference(layer, x, mx.float64)

    @pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=case_id)
    def test_gradients_float32(self, case):
        layer = make(ConvTranspose, case)
        check_gradients_against_reference(layer, normal(2, *(4 - i for i in range(len(case[0]))),
                                                        4))

    def test_repr(self):
        assert repr(ConvTranspose((3, 3), 8, 1)) == "ConvTranspose((3, 3), 8 => 1)  # 73 parameters"
        assert repr(ConvTranspose((4, 4), 4, 2, relu, stride=2, padding="same", groups=2)) == \
            "ConvTranspose((4, 4), 4 => 2, relu, stride=2, pad='same', groups=2)  # 66 parameters"
        assert repr(ConvTranspose((3,), 2, 2, stride=2, padding=1, output_padding=1,
                                  bias=False)) == \
            "ConvTranspose((3,), 2 => 2, stride=2, pad=1, outpad=1, bias=False)  # 12 parameters"

    def test_autocast_bfloat16_through_ops_conv_transpose(self, monkeypatch):
        layer = with_random_bias(ConvTranspose((3, 3), 2, 4, stride=2))
        calls = []
        kernel = kernels.conv_transpose
        monkeypatch.setattr(kernels, "conv_transpose",
                            lambda *a: calls.append((a[0].dtype, a[1].dtype)) or kernel(*a))
        x = normal(2, 3, 3, 2)
        with autocast(mx.bfloat16, device="cpu"):
            out = layer(x)
        assert out.dtype == mx.bfloat16 and layer.weight.dtype == mx.float32
        assert calls == [(mx.bfloat16, mx.bfloat16)]
        np.testing.assert_allclose(np64(out), np64(layer(x)), rtol=5e-2, atol=5e-2)

    def test_same_with_output_padding_is_refused(self):
        with pytest.raises(ValueError, match=r"\[ConvTranspose\] padding='same' picks the output "
                                             r"padding itself"):
            ConvTranspose((3,), 1, 1, stride=2, padding="same", output_padding=1)

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match=r"\[ConvTranspose\] unknown padding 'valid'"):
            ConvTranspose((3,), 1, 1, padding="valid")
        with pytest.raises(ValueError, match=r"\[ConvTranspose\] output_padding must be an int "
                                             r"or a tuple of 1 ints, each at least 0"):
            ConvTranspose((3,), 1, 1, output_padding=-1)
        with pytest.raises(ValueError, match=r"\[ConvTranspose\] output_padding must be smaller "
                                             r"than stride or dilation .* got output_padding=\(0, "
                                             r"2\), stride=\(1, 2\)"):
            ConvTranspose((3, 3), 1, 1, stride=(1, 2), output_padding=(0, 2))
        with pytest.raises(ValueError, match=r"\[ConvTranspose\] .*divisible by groups \(3\)"):
            ConvTranspose((3,), 3, 4, groups=3)
        with pytest.raises(TypeError, match=r"\[ConvTranspose\] kernel must be a tuple"):
            ConvTranspose(3, 1, 1)

    def test_bad_input_raises_and_leaves_model_unchanged(self):
        layer = with_random_bias(ConvTranspose((3, 3), 3, 2, padding=2))
        before = snapshot(layer)
        with pytest.raises(ValueError, match=r"\[ConvTranspose\] expected input with 3 channels "
                                             r"\(last axis\), got shape \(1, 5, 5, 4\)"):
            layer(mx.ones((1, 5, 5, 4)))
        with pytest.raises(ValueError, match=r"\[ConvTranspose\] expected input of shape "
                                             r"\(N, H, W, C\) for a 2-D transposed convolution"):
            layer(mx.ones((1, 5, 5, 5, 3)))
        with pytest.raises(ValueError, match=r"\[ConvTranspose\] padding .* crops the output .* "
                                             r"to nothing \(spatial size \(-1, 1\)\)"):
            layer(mx.ones((1, 1, 3, 3)))
        assert_unchanged(layer, before)


def test_integer_arguments_of_any_type_are_stored_as_ints_but_bools_refused():
    i64 = np.int64
    conv = Conv((i64(3), np.int32(3)), i64(4), i64(6), stride=i64(2), padding=(i64(1), (0, i64(2))),
                dilation=(1, np.uint8(2)), groups=i64(2))
    assert repr(conv) == ("Conv((3, 3), 4 => 6, stride=2, pad=((1, 1), (0, 2)), dilation=(1, 2), "
                          "groups=2)  # 114 parameters")
    values = (conv.in_channels, conv.groups, *conv.kernel, *conv.stride, *conv.dilation,
              *sum(conv.padding, ()), *conv.weight.shape)
    assert all(type(v) is int for v in values)
    assert conv(mx.ones((1, 7, 7, 4))).shape == (1, 4, 3, 6)
    convt = ConvTranspose((i64(3),), i64(2), i64(4), stride=i64(2), padding=((i64(1), 0),),
                          output_padding=i64(1))
    assert repr(convt) == "ConvTranspose((3,), 2 => 4, stride=2, pad=((1, 0),), outpad=1)  " \
                          "# 28 parameters"
    assert all(type(v) is int for v in (*convt.output_padding, *convt.padding[0]))
    with pytest.raises(TypeError, match=r"\[Conv\] kernel must be a tuple.*got 3; write \(3,\)"):
        Conv(i64(3), 1, 1)
    for bad in (True, np.bool_(True)):
        with pytest.raises(ValueError, match=r"\[Conv\] in_channels must be a positive integer"):
            Conv((3,), bad, 1)
        with pytest.raises(ValueError, match=r"\[Conv\] kernel must hold positive integers"):
            Conv((3, bad), 1, 1)
        with pytest.raises(ValueError, match=r"\[Conv\] stride must be an int"):
            Conv((3,), 1, 1, stride=bad)
        with pytest.raises(ValueError, match=r"\[Conv\] padding must"):
            Conv((3,), 1, 1, padding=(bad,))
        with pytest.raises(ValueError, match=r"\[ConvTranspose\] output_padding must be an int"):
            ConvTranspose((3,), 1, 1, stride=2, output_padding=bad)


@pytest.mark.parametrize("cls", [Conv, ConvTranspose])
def test_bias_must_be_a_bool(cls):
    name = cls.__name__
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match=rf"^\[{name}\] bias must be True or False, "
                                            rf"got {bad!r}$"):
            cls((3,), 2, 4, bias=bad)
    layer = cls((3,), 2, 4, bias=np.bool_(False))
    assert layer.bias is None and repr(layer).split("  #")[0].endswith("bias=False)")


@pytest.mark.parametrize("cls", [Conv, ConvTranspose])
def test_init_of_the_wrong_shape_is_refused(cls):
    name = cls.__name__
    with pytest.raises(ValueError, match=rf"^\[{name}\] init returned shape \(4, 3\), "
                                         rf"expected \(4, 3, 1\)$"):
        cls((3,), 2, 4, groups=2, init=lambda s: mx.ones((4, 3)))
    with pytest.raises(TypeError, match=rf"\[{name}\] init returned an array of dtype "
                                        r"mlx.core.uint8"):
        cls((3, 3), 2, 4, init=lambda s: mx.ones(s, mx.uint8))
    seen = []
    cls((np.int64(3),), np.int64(2), np.int32(4), init=lambda s: seen.append(s) or mx.ones(s))
    assert seen == [(4, 3, 2)] and all(type(n) is int for n in seen[0])


def test_docstrings_name_the_repr_keywords():
    assert "``pad=`` for ``padding``" in " ".join(Conv.__doc__.split())
    doc = " ".join(ConvTranspose.__doc__.split())
    assert "``pad=`` for ``padding``" in doc and "``outpad=`` for ``output_padding``" in doc


@pytest.mark.parametrize("cls", [Conv, ConvTranspose])
@pytest.mark.parametrize("kernel, shape, perm", [
    ((3,), (2, 3, 16), "(0, 2, 1)"),
    ((3, 3), (2, 3, 16, 16), "(0, 2, 3, 1)"),
    ((3, 3, 3), (2, 3, 8, 8, 8), "(0, 2, 3, 4, 1)"),
])
def test_channels_first_input_gets_the_transpose_that_fixes_it(cls, kernel, shape, perm):
    layer = cls(kernel, 3, 4)
    before = snapshot(layer)
    fix = re.escape(f"x.transpose{perm}")
    with pytest.raises(ValueError, match=rf"expected input with 3 channels .*channels last "
                                         rf"\(N.*C\) in MLX: {fix}$"):
        layer(mx.ones(shape))
    assert_unchanged(layer, before)
    channels_last = (shape[0], *shape[2:], 3)
    assert layer(mx.ones(channels_last)).shape[-1] == 4


def test_transpose_hint_only_for_input_that_looks_channels_first():
    layer = Conv((3, 3), 3, 4)
    with pytest.raises(ValueError, match=r"x\.transpose\(0, 2, 3, 1\)$"):
        layer(mx.ones((2, 3, 8, 5)))
    with pytest.raises(ValueError, match=r"got shape \(2, 8, 8, 5\)$"):
        layer(mx.ones((2, 8, 8, 5)))


@pytest.mark.parametrize("kernel, stride, padding, output_padding", [
    ((1,), 2, 0, 1),
    ((3,), 2, 0, 1),
    ((2, 3), 2, ((0, 0), (1, 0)), (1, 1)),
    ((1, 1), 2, "same", 0),  # "same" picks output_padding 1 itself
])
def test_output_padding_beyond_padding_gives_the_true_input_gradient(kernel, stride, padding,
                                                                     output_padding):
    # MLX's input gradient is short there, with no error, and flows on into earlier layers
    layer = ConvTranspose(kernel, 2, 3, stride=stride, padding=padding,
                          output_padding=output_padding)
    x = normal(1, *(3,) * len(kernel), 2)
    r = normal(*layer(x).shape, seed=3)
    dx = mx.grad(lambda v: (layer(v) * r).sum())(x)
    assert dx.shape == x.shape
    # the layer is affine in x: each entry of the gradient is a difference of two calls
    base = (layer(mx.zeros_like(x)) * r).sum()
    flat = np.zeros(x.size, dtype=np.float32)
    for i in range(x.size):
        e = np.zeros(x.size, dtype=np.float32)
        e[i] = 1
        flat[i] = ((layer(mx.array(e.reshape(x.shape))) * r).sum() - base).item()
    np.testing.assert_allclose(np64(dx).ravel(), flat, rtol=1e-4, atol=1e-4)


class TestCrossCor:
    """fluxlike's Conv is already a cross-correlation: CrossCor is Conv under Flux's name."""

    @pytest.mark.parametrize("case", CONV_CASES[:8], ids=case_id)
    def test_matches_the_cross_correlation_reference_and_conv(self, case):
        layer = make(CrossCor, case)
        x = normal(2, *(7 - i for i in range(len(case[0]))), 4)
        expected = conv_reference(np64(x), np64(layer.weight), np64(layer.bias), layer.stride,
                                  layer.padding, layer.dilation, layer.groups)
        np.testing.assert_allclose(np64(layer(x)), expected, rtol=1e-5, atol=1e-5)
        twin = make(Conv, case)
        twin.update(layer.parameters())
        np.testing.assert_array_equal(np64(twin(x)), np64(layer(x)))

    def test_does_not_flip_the_kernel(self):
        layer = CrossCor((3,), 1, 1, bias=False)
        layer.weight = mx.array([1.0, 2.0, 3.0]).reshape(1, 3, 1)
        x = mx.array([0.0, 0.0, 1.0, 0.0, 0.0]).reshape(1, 5, 1)
        # a unit impulse comes out as the kernel reversed (a true convolution gives it as is)
        assert layer(x).reshape(-1).tolist() == [3.0, 2.0, 1.0]

    def test_gradients_float64_and_float32(self):
        layer = with_random_bias(CrossCor((2, 3), 2, 3, padding=((0, 1), (2, 1))))
        check_gradients_against_reference(layer, normal(2, 5, 4, 2), mx.float64)
        check_gradients_against_reference(make(CrossCor, CONV_CASES[6]), normal(2, 7, 6, 4))

    def test_repr_and_policy(self):
        assert repr(CrossCor((3, 3), 1, 8, relu, stride=2, padding=1)) == \
            "CrossCor((3, 3), 1 => 8, relu, stride=2, pad=1)  # 80 parameters"
        assert repr(CrossCor((5,), 4, 4, padding="same", groups=2, bias=False)) == \
            "CrossCor((5,), 4 => 4, pad='same', groups=2, bias=False)  # 40 parameters"
        assert policy_of(CrossCor) == "down" and isinstance(CrossCor((3,), 1, 1), Conv)

    @pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
    def test_autocast_computes_in_the_scope_dtype(self, dtype):
        layer = with_random_bias(CrossCor((3, 3), 2, 4, relu, padding=1))
        x = normal(2, 5, 5, 2)
        with autocast(dtype, device="cpu"):
            out = layer(x)
        assert out.dtype == dtype and layer.weight.dtype == mx.float32
        np.testing.assert_allclose(np64(out), np64(layer(x)), rtol=5e-2, atol=5e-2)

        def loss(w):
            layer.update({"weight": w})
            with autocast(dtype, device="cpu"):
                return mx.sum(layer(x).astype(mx.float32))

        assert mx.grad(loss)(layer.weight).dtype == mx.float32

    def test_errors_name_crosscor(self):
        with pytest.raises(ValueError, match=r"\[CrossCor\] expected input with 2 channels"):
            CrossCor((3, 3), 2, 4)(mx.ones((1, 5, 5, 3)))
        with pytest.raises(ValueError, match=r"\[CrossCor\] input of shape .* is too small"):
            CrossCor((3, 3), 2, 4)(mx.ones((1, 2, 2, 2)))
        with pytest.raises(ValueError, match=r"\[CrossCor\] in_channels \(3\) and out_channels"):
            CrossCor((3,), 3, 4, groups=2)
        with pytest.raises(ValueError, match=r"\[CrossCor\] padding must be"):
            CrossCor((3,), 1, 1, padding=(1, 2, 3))


class TestDepthwiseConv:
    def test_is_a_conv_with_one_group_per_input_channel(self):
        layer = DepthwiseConv((3, 3), 4, 8, relu, stride=2, padding=1)
        assert type(layer) is Conv and layer.groups == 4
        assert layer.weight.shape == (8, 3, 3, 1) and layer.bias.shape == (8,)
        assert repr(layer) == \
            "Conv((3, 3), 4 => 8, relu, stride=2, pad=1, groups=4)  # 80 parameters"
        assert DepthwiseConv((3,), 2, 2, bias=False, init=lambda s: mx.ones(s)).weight.tolist() \
            == [[[1.0]] * 3] * 2

    @pytest.mark.parametrize("kernel", [(3,), (3, 2), (2, 2, 3)])
    def test_each_channel_is_convolved_with_its_own_kernels(self, kernel):
        layer = with_random_bias(DepthwiseConv(kernel, 3, 6, padding="same"))
        x = normal(2, *(5 for _ in kernel), 3)
        y = np64(layer(x))
        expected = conv_reference(np64(x), np64(layer.weight), np64(layer.bias), layer.stride,
                                  layer.padding, layer.dilation, 3)
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
        # output channels 2c and 2c + 1 see input channel c only
        w, xs = np64(layer.weight), np64(x)
        one = conv_reference(xs[..., 1:2], w[2:4], np64(layer.bias)[2:4], layer.stride,
                             layer.padding, layer.dilation, 1)
        np.testing.assert_allclose(y[..., 2:4], one, rtol=1e-5, atol=1e-5)

    def test_gradients_float32_against_float64_reference(self):
        check_gradients_against_reference(with_random_bias(DepthwiseConv((3, 3), 2, 4)),
                                          normal(2, 6, 5, 2))

    @pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
    def test_autocast(self, dtype):
        layer = with_random_bias(DepthwiseConv((3,), 4, 4))
        x = normal(2, 9, 4)
        with autocast(dtype, device="cpu"):
            out = layer(x)
        assert out.dtype == dtype
        np.testing.assert_allclose(np64(out), np64(layer(x)), rtol=5e-2, atol=5e-2)

    def test_out_channels_must_be_a_multiple(self):
        with pytest.raises(ValueError, match=r"\[DepthwiseConv\] out_channels must be a "
                                             r"multiple of in_channels .* in_channels=4, "
                                             r"out_channels=6; use Conv"):
            DepthwiseConv((3, 3), 4, 6)
        with pytest.raises(ValueError, match=r"\[DepthwiseConv\] in_channels must be a positive"):
            DepthwiseConv((3, 3), 0, 6)


# An empty input: MLX's convolution gradients fail on one (a reshape error; SIGFPE for the
# transposed one, which kills the process): run in a child, so that a regression fails one test.
_EMPTY_BATCH = """
import mlx.core as mx, fluxlike as fl
from mlx.utils import tree_flatten
layers = [fl.Conv((3, 3), 3, 4, padding=1), fl.ConvTranspose((3, 3), 3, 5, stride=2, padding=1),
          fl.Conv((3,), 3, 4), fl.ConvTranspose((2, 2, 2), 3, 2), fl.DepthwiseConv((3, 3), 3, 6)]
for layer in layers:
    x = mx.zeros((0,) + (5,) * (layer.weight.ndim - 2) + (3,))
    for dtype in (None, mx.bfloat16):
        grads = fl.gradient(lambda m: (m(x) ** 2).sum(), layer, autocast=dtype)[0]
        with fl.autocast(dtype, enabled=dtype is not None):
            y = layer(x)
        full = layer(mx.ones((1,) + x.shape[1:]))
        assert y.shape == (0,) + full.shape[1:], (y.shape, full.shape)
        for name, g in tree_flatten(grads):
            assert g.shape == dict(tree_flatten(layer.parameters()))[name].shape
            assert not g.any().item(), name
# an empty spatial axis that padding makes an output of: the bias alone, its gradient counted
layer = fl.Conv((3, 3), 2, 4, padding=2)
x = mx.zeros((2, 0, 5, 2))
y = layer(x)
assert y.shape == (2, 2, 7, 4) and mx.array_equal(y, mx.broadcast_to(layer.bias, y.shape)).item()
grads = fl.gradient(lambda m: m(x).sum(), layer)[0]
assert not grads["weight"].any().item() and (grads["bias"] == 2 * 2 * 7).all().item()
print("ok")
"""


def test_an_empty_input_has_zero_weight_gradients():
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", _EMPTY_BATCH], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
