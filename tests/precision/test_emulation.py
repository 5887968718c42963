"""Half precision on the CPU through float32 kernels (fluxlike/precision/emulation.py).

Each kernel is checked against MLX's own (slow) half-precision kernel on small shapes: the
dtype out, values within half-precision tolerance, gradients and their dtypes. The emulated
result must also be exactly the float32 kernel's result on the half-rounded operands,
rounded once to the half dtype (the numerics the module promises).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import np64

from fluxlike import Chain, Dense, autocast, native, relu
from fluxlike.precision import emulation, kernels, operands

HALVES = [mx.float16, mx.bfloat16]
TOL = {mx.float16: 4e-3, mx.bfloat16: 3e-2}  # max error relative to the largest magnitude

# (name, x shape, weight shape, stride, padding, dilation, groups)
CONVS = [
    ("1d", (2, 9, 4), (6, 3, 4), (1,), (1,), (1,), 1),
    ("1d stride dilation", (2, 11, 4), (6, 3, 4), (2,), (2,), (2,), 1),
    ("1d groups", (2, 9, 4), (6, 3, 2), (1,), (0,), (1,), 2),
    ("1d asymmetric padding", (2, 9, 4), (6, 3, 4), (1,), ((0,), (2,)), (1,), 1),
    ("2d", (2, 7, 6, 3), (5, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ("2d stride padding dilation", (2, 9, 8, 3), (4, 3, 2, 3), (2, 1), (1, 2), (1, 2), 1),
    ("2d groups", (2, 6, 6, 4), (6, 3, 3, 2), (1, 1), (1, 1), (1, 1), 2),
    ("3d", (1, 5, 6, 4, 2), (3, 3, 2, 3, 2), (1, 2, 1), (1, 0, 1), (1, 1, 1), 1),
    ("3d dilation", (1, 7, 6, 6, 2), (3, 2, 2, 2, 2), (1, 1, 2), (0, 1, 1), (2, 1, 2), 1),
]

# (name, x shape, weight shape, stride, padding, dilation, output_padding, groups)
CONV_TRANSPOSES = [
    ("1d", (2, 5, 4), (3, 3, 4), (1,), (0,), (1,), (0,), 1),
    ("1d stride output_padding", (2, 5, 4), (3, 3, 4), (2,), (1,), (1,), (1,), 1),
    ("1d groups dilation", (2, 5, 4), (6, 3, 2), (1,), (1,), (2,), (0,), 2),
    ("2d stride padding", (2, 4, 5, 3), (2, 3, 3, 3), (2, 2), (1, 0), (1, 1), (0, 1), 1),
    ("2d groups", (1, 4, 4, 4), (4, 2, 2, 2), (1, 1), (0, 0), (1, 1), (0, 0), 2),
    ("3d", (1, 3, 4, 3, 2), (2, 2, 3, 2, 2), (2, 1, 1), (0, 1, 0), (1, 1, 1), (1, 0, 0), 1),
]


def native_conv(x, w, stride, padding, dilation, groups):
    return mx.conv_general(
        x, w, stride=stride, padding=padding, kernel_dilation=dilation, groups=groups
    )


def native_conv_transpose(x, w, stride, padding, dilation, output_padding, groups):
    fn = {3: mx.conv_transpose1d, 4: mx.conv_transpose2d, 5: mx.conv_transpose3d}[x.ndim]
    one = (lambda t: t[0]) if x.ndim == 3 else (lambda t: t)
    return fn(x, w, stride=one(stride), padding=one(padding), dilation=one(dilation),
              output_padding=one(output_padding), groups=groups)


def close(actual: mx.array, expected: mx.array, dtype: mx.Dtype) -> None:
    """Equal within half-precision rounding, relative to the largest magnitude."""
    a, e = np64(actual), np64(expected)
    scale = max(np.abs(e).max(), 1e-3)
    assert np.abs(a - e).max() <= TOL[dtype] * scale, np.abs(a - e).max() / scale


def halves(*shapes: tuple[int, ...], dtype: mx.Dtype) -> list[mx.array]:
    return [mx.random.normal(s).astype(dtype) for s in shapes]


def check_kernel(emulated, native, operands: list[mx.array], dtype: mx.Dtype) -> None:
    """Forward and gradients of ``emulated`` against ``native`` (MLX's half kernel) and
    against the float32 kernel on the rounded operands."""
    out = emulated(*operands)
    assert out.dtype == dtype
    float32_out = native(*(a.astype(mx.float32) for a in operands))
    assert mx.array_equal(out, float32_out.astype(dtype)).item()  # one rounding, at the end
    close(out, native(*operands), dtype)

    weights = mx.random.normal(out.shape)  # a loss that weighs every output differently
    argnums = tuple(range(len(operands)))

    def loss(fn):
        return lambda *a: (fn(*a).astype(mx.float32) * weights).sum()

    grads = mx.grad(loss(emulated), argnums=argnums)(*operands)
    expected = mx.grad(loss(native), argnums=argnums)(*operands)
    for g, e, a in zip(grads, expected, operands, strict=True):
        assert g.dtype == a.dtype == dtype
        close(g, e, dtype)


def check_conv(kernel, native_kernel, case: tuple, bias: bool, dtype: mx.Dtype) -> None:
    """:func:`check_kernel` for a convolution ``case`` (name, input shape, weight shape,
    options) of ``kernel`` (a :mod:`fluxlike.precision.kernels` function) against MLX's
    ``native_kernel``, with a bias when ``bias``."""
    _, xs, ws, *options = case

    def emulated(x, w, *b):
        return kernel(x, w, *options, *b)

    def native(x, w, *b):
        y = native_kernel(x, w, *options)
        return y + b[0] if b else y

    shapes = (xs, ws, ws[:1]) if bias else (xs, ws)
    check_kernel(emulated, native, halves(*shapes, dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", HALVES)
class TestKernels:
    def test_linear_with_bias(self, dtype):
        ops_ = halves((3, 4, 6), (5, 6), (5,), dtype=dtype)
        check_kernel(kernels.linear, lambda x, w, b: mx.addmm(b, x, w.T), ops_, dtype)

    def test_linear_without_bias(self, dtype):
        check_kernel(kernels.linear, lambda x, w: x @ w.T, halves((7, 6), (5, 6), dtype=dtype),
                     dtype)

    def test_matmul_batched_broadcast(self, dtype):
        check_kernel(kernels.matmul, lambda a, b: a @ b,
                     halves((2, 3, 4, 5), (3, 5, 6), dtype=dtype), dtype)

    @pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
    @pytest.mark.parametrize("case", CONVS, ids=[c[0] for c in CONVS])
    def test_conv(self, dtype, case, bias):
        # A bias is added in float32 before the one rounding, as for a linear layer.
        check_conv(kernels.conv, native_conv, case, bias, dtype)

    @pytest.mark.parametrize("kind", ["linear", "conv"])
    def test_relu_folded_into_the_custom_gradient(self, dtype, kind):
        # Under differentiation a ReLU runs in float32 before the rounding; its output and
        # gradients are those of a ReLU on the rounded result (ReLU commutes with rounding).
        if kind == "linear":
            operands = halves((9, 6), (5, 6), (5,), dtype=dtype)
            kernel = kernels.linear

            def plain(x, w, b):
                return mx.addmm(b, x, w.T)
        else:
            _, xs, ws, *options = CONVS[4]
            operands = halves(xs, ws, ws[:1], dtype=dtype)

            def kernel(x, w, b, act=None):
                return kernels.conv(x, w, *options, b, act)

            def plain(x, w, b):
                return native_conv(x, w, *options) + b

        weights = mx.random.normal(plain(*operands).shape)
        argnums = tuple(range(3))
        folded = mx.vjp(lambda *a: kernel(*a, act=relu), operands, [weights.astype(dtype)])
        unfolded = mx.vjp(lambda *a: relu(kernel(*a)), operands, [weights.astype(dtype)])
        assert folded[0][0].dtype == dtype
        expected = relu(plain(*(a.astype(mx.float32) for a in operands))).astype(dtype)
        assert mx.array_equal(folded[0][0], expected).item()
        assert mx.array_equal(folded[0][0], unfolded[0][0]).item()
        for g, e, a in zip(folded[1], unfolded[1], operands, strict=True):
            assert g.dtype == a.dtype
            assert mx.array_equal(g, e).item()  # masking the cotangent is exact either way
        native = mx.grad(lambda *a: (relu(plain(*a)).astype(mx.float32) * weights).sum(),
                         argnums=argnums)(*operands)
        for g, e in zip(folded[1], native, strict=True):
            close(g, e, dtype)

    @pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
    @pytest.mark.parametrize("case", CONV_TRANSPOSES, ids=[c[0] for c in CONV_TRANSPOSES])
    def test_conv_transpose(self, dtype, case, bias):
        check_conv(kernels.conv_transpose, native_conv_transpose, case, bias, dtype)

    def test_compile_matches_eager(self, dtype):
        x, w, b = halves((4, 6), (5, 6), (5,), dtype=dtype)

        def step(x, w, b):
            return mx.value_and_grad(
                lambda x, w, b: kernels.linear(x, w, b).astype(mx.float32).square().sum(),
                argnums=(0, 1, 2),
            )(x, w, b)

        eager, compiled = step(x, w, b), mx.compile(step)(x, w, b)
        for e, c in zip([eager[0], *eager[1]], [compiled[0], *compiled[1]], strict=True):
            assert e.dtype == c.dtype
            np.testing.assert_allclose(np64(c), np64(e), rtol=1e-6, atol=1e-6)


class TestDispatch:
    def test_half_operands_on_the_cpu_are_emulated(self):
        a = mx.ones((2, 2), mx.bfloat16)
        assert operands.half_on_cpu(a, a) and operands.half_on_cpu(a, a, None)
        with mx.stream(mx.cpu):
            assert operands.half_on_cpu(a.astype(mx.float16), a.astype(mx.float16))

    @pytest.mark.parametrize("dtypes", [
        (mx.float32, mx.float32), (mx.float64, mx.float64), (mx.bfloat16, mx.float32),
        (mx.float16, mx.bfloat16),
    ])
    def test_other_dtypes_are_left_to_mlx(self, dtypes):
        a, b = (mx.ones((2, 2), dtype=d) for d in dtypes)
        assert not operands.half_on_cpu(a, b)

    def test_float32_results_unchanged(self):
        # MLX's own product where the native kernels are off; oneDNN's sums where they are on
        # (bit for bit MLX's on AVX2, their own order on AVX-512: float32 rounding)
        x, w, b = mx.random.normal((3, 4)), mx.random.normal((2, 4)), mx.random.normal((2,))
        with native.disabled():
            assert mx.array_equal(kernels.linear(x, w, b), mx.addmm(b, x, w.T)).item()
        np.testing.assert_allclose(np64(kernels.linear(x, w, b)), np64(mx.addmm(b, x, w.T)),
                                   rtol=1e-6, atol=1e-6)

    def test_gradients_reach_float32_master_weights_in_float32(self):
        layer = Dense(4, 3)
        x = mx.random.normal((5, 4))

        def loss(model, x):
            with autocast(mx.bfloat16):
                return model(x).astype(mx.float32).sum()

        grads = nn.value_and_grad(layer, loss)(layer, x)[1]
        assert grads["weight"].dtype == grads["bias"].dtype == mx.float32


def peak_of_training_step(
    model: nn.Module, x: mx.array, dtype: mx.Dtype | None, limit: int | None = 1
) -> int:
    """Peak memory of one forward and backward pass (fresh graph), in bytes.

    MLX's CPU encoder allocates each op's output when it schedules the op, up to about a
    hundred ops ahead of the worker, so the default peak mixes what the graph keeps alive
    with how far scheduling ran ahead. A tiny memory ``limit`` (the default here) makes the
    encoder wait for the worker after each op: the peak is then what the graph retains;
    ``limit=None`` measures under MLX's default scheduling.
    """
    def loss(m, x):
        if dtype is None:
            return m(x).astype(mx.float32).sum()
        with autocast(dtype):
            return m(x).astype(mx.float32).sum()

    step = nn.value_and_grad(model, loss)
    old = mx.set_memory_limit(limit) if limit is not None else None
    try:
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(step(model, x))
        return mx.get_peak_memory() - base
    finally:
        if old is not None:
            mx.set_memory_limit(old)


@pytest.fixture(scope="module")
def mlp():
    """An activation-dominated MLP (8 x Dense(512, 512, relu), batch 8192), its input and
    the float32 peak memory of a training step."""
    mx.random.seed(0)
    model = Chain(*[Dense(512, 512, relu) for _ in range(8)])
    x = mx.random.normal((8192, 512))
    mx.eval(model.parameters(), x)
    return model, x, float32_peak(model, x)


def float32_peak(model, x, limit=1):
    """The float32 step's peak on MLX's own kernels, the ones the half path emulates on (the
    native oneDNN kernels, where installed, keep less: fluxlike.native)."""
    with native.disabled():
        return peak_of_training_step(model, x, None, limit)


class TestSavedActivations:
    """The backward pass keeps half-precision activations, not their float32 upcasts."""

    @pytest.mark.parametrize("dtype", HALVES)
    def test_half_peak_is_under_0_7_of_float32(self, mlp, dtype):
        model, x, float32_peak = mlp
        assert peak_of_training_step(model, x, dtype) <= 0.7 * float32_peak

    @pytest.mark.parametrize("dtype", HALVES)
    def test_half_peak_is_under_0_7_of_float32_with_default_scheduling(self, mlp, dtype):
        """The figure a user sees: the float32 temporaries come in row blocks, so running
        ahead does not pile them up."""
        model, x, _ = mlp
        reference = float32_peak(model, x, limit=None)
        assert peak_of_training_step(model, x, dtype, limit=None) <= 0.7 * reference

    @pytest.mark.skipif(not native.available(),
                        reason="the native kernels are not in use here (FLUXLIKE_NATIVE=0, or "
                        "no companion built): no native path to compare with the emulation")
    def test_native_bfloat16_keeps_no_more_than_the_emulation(self, mlp, monkeypatch):
        """bfloat16 training runs on oneDNN (kernels.choose): in its bfloat16 kernels, or in
        its float32 ones upcasting inside the primitive. Either way its backward pass keeps
        the bfloat16 activations only, and computes each layer's weight gradient while that
        layer's cotangent is live (not every cotangent held to the end of the pass)."""
        model, x, _ = mlp
        on_native = peak_of_training_step(model, x, mx.bfloat16)
        with native.disabled():
            assert on_native <= peak_of_training_step(model, x, mx.bfloat16)

    def test_plain_upcasts_would_keep_float32_copies(self, mlp, monkeypatch):
        """The control: float32 upcasts without the custom backward pass are kept."""
        model, x, float32_peak = mlp

        def plain(x, w, b=None, act=None, layer=None):  # kernels.linear casts at the op
            x, w, b = (a.astype(mx.bfloat16) for a in (x, w, b))
            y = x.astype(mx.float32) @ w.astype(mx.float32).T + b.astype(mx.float32)
            return act(y.astype(x.dtype))

        monkeypatch.setattr(kernels, "linear", plain)
        assert peak_of_training_step(model, x, mx.bfloat16) > 0.8 * float32_peak


class TestRowBlocks:
    """Large emulated linear layers run in row blocks: same numbers, same gradients."""

    @pytest.mark.parametrize("bias", [True, False])
    @pytest.mark.parametrize("shape", [(200, 16), (3, 70, 16)])
    def test_blocks_match_one_piece(self, monkeypatch, bias, shape):
        x = mx.random.normal(shape).astype(mx.bfloat16)
        w = mx.random.normal((24, 16)).astype(mx.bfloat16)
        b = [mx.random.normal((24,)).astype(mx.bfloat16)] if bias else []

        def run():
            def loss(x, w, *b):
                return (kernels.linear(x, w, *b).astype(mx.float32) ** 2).sum()

            y = kernels.linear(x, w, *b)
            grads = mx.grad(loss, argnums=list(range(2 + len(b))))(x, w, *b)
            mx.eval(y, grads)
            return y, grads

        monkeypatch.setattr(emulation, "CHUNK_BYTES", 2**40)  # one piece
        with native.disabled():  # the emulation's blocks
            whole, whole_grads = run()
            monkeypatch.setattr(emulation, "CHUNK_BYTES", 4 * 24)  # 64-row blocks (the minimum)
            emulation._in_float32_rows.cache_clear()
            blocks, block_grads = run()
        assert blocks.dtype == mx.bfloat16 and blocks.shape == (*shape[:-1], 24)
        assert mx.array_equal(blocks, whole)
        for g, h, a in zip(block_grads, whole_grads, [x, w, *b], strict=True):
            assert g.dtype == a.dtype and g.shape == a.shape
            close(g, h, mx.bfloat16)
