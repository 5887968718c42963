"""The decision point (fluxlike/precision/kernels.py: choose): each predicate on its own, with
the native companion in use (simulated where this machine lacks a piece of it) and without."""

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxlike import native
from fluxlike.modes import differentiating
from fluxlike.precision import kernels
from fluxlike.precision.kernels import EMULATED, MLX, NATIVE, choose
from fluxlike.precision.operands import half_on_cpu, one_dtype

F32, BF16, F16, F64 = mx.float32, mx.bfloat16, mx.float16, mx.float64
GEOMETRY = ((1, 1), (1, 1), (1, 1))  # stride, padding, dilation


needs_companion = pytest.mark.skipif(not native.available(), reason="the native companion is "
                                     "not in use: scale multiplies in MLX")


class Companion:
    """A stand-in for the companion's module: the routing only asks whether there is one."""


@pytest.fixture(params=["bf16 kernels", "float32 kernels"])
def in_use(request, monkeypatch):
    """The companion in use, with oneDNN's bfloat16 kernels or without them (float16 in its
    float32 kernels either way; ``f16_kernels`` has its float16 ones)."""
    monkeypatch.setattr(native.switch, "ext", native.switch.ext or Companion())
    monkeypatch.setattr(native.switch, "bf16", request.param == "bf16 kernels")
    monkeypatch.setattr(native.switch, "f16", False)
    return request.param == "bf16 kernels"


@pytest.fixture
def f16_kernels(monkeypatch):
    """The companion in use with oneDNN's float16 kernels (a CPU with AVX512-FP16)."""
    monkeypatch.setattr(native.switch, "ext", native.switch.ext or Companion())
    monkeypatch.setattr(native.switch, "f16", True)


@pytest.fixture
def not_in_use():
    with native.disabled():
        yield


def a(*shape, dtype=F32):
    return mx.zeros(shape, dtype)


class TestAnyOp:
    @pytest.mark.parametrize("op", ["linear", "matmul", "conv", "softmax", "max_pool"])
    def test_mixed_dtypes_and_float64_take_mlx(self, op, in_use):
        assert choose(op, None) == MLX
        assert choose(op, F64, a(1, 2, 2, 1), a(1, 1, 1, 1), GEOMETRY) == MLX

    @pytest.mark.parametrize("op", ["linear", "matmul", "conv", "conv_transpose"])
    def test_half_precision_without_the_companion_is_emulated(self, op, not_in_use):
        assert choose(op, BF16, a(2, 4, 4, 2), a(2, 3, 3, 2), GEOMETRY) == EMULATED
        assert choose(op, F16, a(2, 4, 4, 2), a(2, 3, 3, 2), GEOMETRY) == EMULATED

    @pytest.mark.parametrize("op", ["linear", "matmul", "conv", "softmax", "max_pool"])
    def test_float32_without_the_companion_takes_mlx(self, op, not_in_use):
        assert choose(op, F32, a(2, 4, 4, 2), a(2, 3, 3, 2), GEOMETRY) == MLX

    @pytest.mark.parametrize("op", ["linear", "conv"])
    def test_float16_linear_and_conv_are_native_upcast(self, op, in_use):
        """Native either way: in oneDNN's float16 kernels where the CPU has them, else in its
        float32 kernels, the primitive upcasting its float16 operands."""
        with differentiating():
            assert choose(op, F16, a(2, 4, 4, 2), a(2, 3, 3, 2), GEOMETRY) == NATIVE
        assert choose(op, F16, a(2, 4, 4, 2), a(2, 3, 3, 2), GEOMETRY) == NATIVE

    @pytest.mark.parametrize("op", ["matmul", "conv_transpose"])
    def test_float16_other_products_are_emulated(self, op, in_use):
        assert choose(op, F16, a(2, 4, 4, 2), a(2, 3, 3, 2), GEOMETRY) == EMULATED

    def test_float16_kernels_take_the_batched_products(self, f16_kernels):
        """Attention's products in oneDNN's float16 kernels; the transposed convolution (no
        native kernel) stays emulated, float32 products stay MLX's."""
        assert choose("matmul", F16, a(2, 4, 4, 2, dtype=F16), a(2, 4, 2, 3, dtype=F16)) == NATIVE
        assert choose("matmul", F16, a(3, dtype=F16), a(3, 4, dtype=F16)) == EMULATED
        assert choose("conv_transpose", F16, a(2, 4, 4, 2), a(2, 3, 3, 2), GEOMETRY) == EMULATED
        assert choose("matmul", F32, a(2, 3), a(3, 4)) == MLX
        assert choose("linear", F16) == NATIVE

    def test_the_gpu_takes_mlx(self, in_use, monkeypatch):
        class Gpu:
            type = mx.gpu

        monkeypatch.setattr(mx, "default_device", lambda: Gpu())
        for dtype in (F32, BF16, F16):
            assert choose("linear", dtype) == MLX


class TestLinear:
    def test_float32_is_native(self, in_use):
        assert choose("linear", F32) == NATIVE
        with differentiating():
            assert choose("linear", F32) == NATIVE

    def test_bfloat16_is_native_with_or_without_onednns_bfloat16_kernels(self, in_use):
        """Without them the primitive upcasts its bfloat16 operands while it runs, so a
        backward pass (a plain ``mx.grad`` included, which fluxlike cannot see) keeps them in
        bfloat16, as the emulation does (tests/precision/test_emulation.py)."""
        assert choose("linear", BF16) == NATIVE
        with differentiating():
            assert choose("linear", BF16) == NATIVE


class TestMatmul:
    def test_bfloat16_products_of_matrices_need_bfloat16_kernels(self, in_use):
        want = NATIVE if in_use else EMULATED
        assert choose("matmul", BF16, a(2, 3, dtype=BF16), a(3, 4, dtype=BF16)) == want
        assert choose("matmul", BF16, a(2, 2, 3, dtype=BF16), a(2, 3, 4, dtype=BF16)) == want

    def test_vectors_and_empty_operands_are_emulated(self, in_use):
        assert choose("matmul", BF16, a(3, dtype=BF16), a(3, 4, dtype=BF16)) == EMULATED
        assert choose("matmul", BF16, a(0, 3, dtype=BF16), a(3, 4, dtype=BF16)) == EMULATED

    def test_float32_takes_mlx(self, in_use):
        assert choose("matmul", F32, a(2, 3), a(3, 4)) == MLX


class TestConv:
    def test_float32_in_training_is_native_at_any_size(self, in_use):
        with differentiating():
            assert choose("conv", F32, a(1, 3, 3, 1), a(1, 3, 3, 1), GEOMETRY) == NATIVE

    def test_float32_inference_from_the_size_that_pays(self, in_use):
        small = choose("conv", F32, a(1, 8, 8, 2), a(4, 3, 3, 2), GEOMETRY)
        large = choose("conv", F32, a(8, 32, 32, 16), a(32, 3, 3, 16), GEOMETRY)
        assert (small, large) == (MLX, NATIVE)
        # (1 * 8 * 8) x (3 * 3 * 2) x 4 multiply-adds, against the threshold
        assert 64 * 18 * 4 < kernels.NATIVE_CONV_MIN_MACS <= 8 * 32 * 32 * 144 * 32

    def test_padding_as_low_high_pairs_counts_the_output(self, in_use):
        geometry = ((1, 1), ((0, 0), (0, 0)), (1, 1))
        assert choose("conv", F32, a(8, 32, 32, 16), a(32, 3, 3, 16), geometry) == NATIVE

    def test_bfloat16_is_native_at_any_size_and_in_training(self, in_use):
        """In oneDNN's bfloat16 kernels, or (without them) upcast inside the primitive, whose
        backward pass keeps bfloat16 operands as the emulation does."""
        x, w = a(1, 3, 3, 1, dtype=BF16), a(1, 3, 3, 1, dtype=BF16)
        assert choose("conv", BF16, x, w, GEOMETRY) == NATIVE
        with differentiating():
            assert choose("conv", BF16, x, w, GEOMETRY) == NATIVE

    def test_one_and_more_than_three_spatial_axes(self, in_use):
        with differentiating():
            assert choose("conv", F32, a(1, 5, 1), a(1, 3, 1), ((1,), (0,), (1,))) == NATIVE
            x, w = a(1, 2, 2, 2, 2, 1), a(1, 1, 1, 1, 1, 1)
            assert choose("conv", F32, x, w, ((1,) * 4, (0,) * 4, (1,) * 4)) == MLX

    def test_transposed_convolutions_are_never_native(self, in_use):
        assert choose("conv_transpose", F32, a(1, 4, 4, 1), a(1, 3, 3, 1), GEOMETRY) == MLX
        assert choose("conv_transpose", BF16, a(1, 4, 4, 1), a(1, 3, 3, 1),
                      GEOMETRY) == EMULATED


class TestSoftmaxAndPooling:
    def test_softmax_of_float32_scores(self, in_use):
        assert choose("softmax", F32, a(2, 5)) == NATIVE
        assert choose("softmax", F32, a(0, 5)) == MLX
        assert choose("softmax", BF16, a(2, 5, dtype=BF16)) == MLX  # float32 scores only

    def test_max_pool_of_every_float_dtype(self, in_use):
        assert choose("max_pool", F32, a(1, 4, 4, 2)) == NATIVE
        assert choose("max_pool", BF16, a(1, 4, 4, 2, dtype=BF16)) == NATIVE
        assert choose("max_pool", F16, a(1, 4, 4, 2, dtype=F16)) == NATIVE  # float32 kernels
        assert choose("max_pool", F32, a(0, 4, 4, 2)) == MLX

    def test_quantized_products_are_emulated_in_half_precision(self, in_use):
        assert choose("quantized_linear", BF16) == EMULATED
        assert choose("quantized_linear", F32) == MLX


class TestScale:
    def test_float16_on_the_cpu_is_native_the_rest_mlx(self, in_use):
        assert choose("scale", F16, a(2, 3, dtype=F16)) == NATIVE
        assert choose("scale", BF16, a(2, 3, dtype=BF16)) == MLX
        assert choose("scale", F32, a(2, 3)) == MLX

    def test_without_the_companion_mlx_multiplies(self, not_in_use):
        assert choose("scale", F16, a(2, 3, dtype=F16)) == MLX


@needs_companion
@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.floats(width=16, allow_nan=True, allow_infinity=True), min_size=1,
                       max_size=40),
       factor=st.floats(-1e3, 1e3, allow_nan=False), dtype=st.sampled_from([F16, BF16, F32]))
def test_scale_is_mlxs_multiply_bit_for_bit(values, factor, dtype):
    """``kernels.scale(x, f)`` gives ``x * f``'s values (NaN where it has NaN) and gradient,
    whichever path computes it: float16 values of every kind (denormals, infinities, NaN),
    factors that round in float16, overflow to infinity."""
    x = mx.array(values, dtype=F16).astype(dtype)
    got, want = kernels.scale(x, factor), x * factor
    assert got.dtype == want.dtype == dtype
    assert mx.array_equal(got, want, equal_nan=True).item()
    c = mx.array(values[::-1], dtype=F16).astype(dtype)
    g = mx.grad(lambda x: (kernels.scale(x, factor) * c).astype(mx.float32).sum())(x)
    h = mx.grad(lambda x: ((x * factor) * c).astype(mx.float32).sum())(x)
    assert g.dtype == h.dtype == dtype
    assert mx.array_equal(g, h, equal_nan=True).item()


class TestOperandPredicates:
    def test_one_dtype(self):
        assert one_dtype(a(2), None, a(3)) == F32
        assert one_dtype(a(2), a(2, dtype=BF16)) is None

    def test_half_on_cpu(self):
        assert half_on_cpu(a(2, dtype=BF16), a(2, dtype=BF16), None)
        assert half_on_cpu(a(2, dtype=F16))
        assert not half_on_cpu(a(2), a(2))
        assert not half_on_cpu(a(2, dtype=BF16), a(2, dtype=F16))


def test_the_routing_follows_the_choice(monkeypatch):
    """A layer call computes with the backend ``choose`` names: forced to MLX's own kernels,
    a bfloat16 linear layer gives MLX's bfloat16 product."""
    x, w = mx.random.normal((3, 8)).astype(BF16), mx.random.normal((4, 8)).astype(BF16)
    monkeypatch.setattr(kernels, "choose", lambda *args: MLX)
    assert mx.array_equal(kernels.linear(x, w), x @ w.T).item()
