"""Where fluxlike's linear kernel takes the native oneDNN companion (fluxlike/precision/kernels.py,
fluxlike/native/): float32 layers forward and backward, and bfloat16 under autocast
(inference and training), of any size, where oneDNN has bfloat16 kernels; float16 and
(without the companion) everything stay on MLX's kernels, with the same results to float32
rounding. Attention's core under autocast(bfloat16) takes the native bfloat16 matmul
(kernels.matmul) with the emulation's numerics."""

import ast
import os
import re
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import np64
from mlx.utils import tree_flatten
from native_helpers import float16_in_float32_kernels, needs_f16_kernels

from fluxlike import Dense, MultiHeadAttention, autocast, gradient, native, relu, trainmode
from fluxlike import compile as fl_compile
from fluxlike.precision import kernels
from fluxlike.precision.attention import attend

pytestmark = pytest.mark.skipif(not native.available(), reason=native.native_info().reason)


class Counting:
    """The companion's module as the routing sees it (``native.switch.ext``), recording the
    compute dtype of each call of the entries ``names`` (the operands', or the
    ``compute_dtype`` of fused casts; ``plain_linear``: only the calls it computed, not those
    it declined)."""

    def __init__(self, ext, seen, names):
        self._ext, self._seen, self._names = ext, seen, names

    def __getattr__(self, name):
        entry = getattr(self._ext, name)
        if name not in self._names:
            return entry

        def counted(x, *args, **kwargs):
            y = entry(x, *args, **kwargs)
            if y is not None:
                self._seen.append(kwargs.get("compute_dtype") or x.dtype)
            return y

        return counted


@pytest.fixture
def calls(monkeypatch):
    """The dtypes of the linear products the native kernel computed (the companion's
    ``matmul``, the everyday float32 call's ``plain_linear`` entry, or inference's product of
    packed weights, ``packed_linear``)."""
    seen = []
    monkeypatch.setattr(native.switch, "ext", Counting(
        native.switch.ext, seen, ("matmul", "plain_linear", "packed_linear")))
    return seen


def _mlx(layer, x):
    """The layer's float32 result on MLX's own kernels."""
    return relu(mx.addmm(layer.bias, x, layer.weight.T))


def test_a_large_float32_layer_runs_native_forward_and_backward(calls):
    layer, x = Dense(512, 512, relu), mx.random.normal((64, 512))
    y = layer(x)
    assert calls == [mx.float32] and y.dtype == mx.float32
    np.testing.assert_allclose(np64(y), np64(_mlx(layer, x)), rtol=1e-4, atol=1e-4)
    calls.clear()
    (g,) = gradient(lambda m: (m(x) ** 2).sum(), layer)
    assert calls == [mx.float32]
    expected = mx.grad(lambda w: (relu(mx.addmm(layer.bias, x, w.T)) ** 2).sum())(layer.weight)
    np.testing.assert_allclose(np64(g["weight"]), np64(expected), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("rows, dims", [(1, 8), (4, 256), (128, 64)])
def test_float32_layers_of_every_size_run_native(calls, rows, dims):
    # oneDNN's float32 kernel beats MLX's (OpenBLAS) down to the smallest layers measured,
    # forward and backward (bench/README.md, "Figures quoted by the code"): there is no size
    # below which MLX takes over.
    layer, x = Dense(dims, dims, relu), mx.random.normal((rows, dims))
    y = layer(x)
    assert calls == [mx.float32] and y.dtype == mx.float32
    np.testing.assert_allclose(np64(y), np64(_mlx(layer, x)), rtol=1e-5, atol=1e-5)


def test_a_bias_the_kernel_does_not_take_falls_back_to_mlx(calls):
    layer, x = Dense(3, 2), mx.random.normal((4, 3))
    layer.bias = mx.array([[0.5, -1.0]])  # (1, 2): oneDNN wants (2,), MLX broadcasts it
    y = layer(x)
    assert calls == []  # declined, and computed by MLX instead
    np.testing.assert_allclose(np64(y), np64(x @ layer.weight.T + layer.bias), rtol=1e-6)
    with pytest.raises(ValueError, match=r"\[Dense\]"):  # a real shape error is still named
        layer(mx.ones((4, 5)))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_half_inference_runs_native_first_and_on_kept_weights(calls, dtype):
    layer, x = Dense(64, 32, relu), mx.random.normal((8, 64))
    with autocast(dtype, device="cpu"):
        first = layer(x)  # first sight: through the per-call casts
        again = layer(x)  # then on the kept half casts
    assert calls == [dtype, dtype] and again.dtype == dtype
    assert mx.array_equal(first, again).item()  # one rounding of the float32 accumulation


def test_half_precision_training_runs_native(calls):
    layer, x = Dense(512, 512), mx.random.normal((16, 512))
    with autocast(mx.float16, device="cpu"):
        layer(x)
        layer(x)  # kept weights: float16 in float32 kernels, upcast inside the primitive
    assert calls == [mx.float16, mx.float16]
    calls.clear()
    (g,) = gradient(lambda m: m(x).astype(mx.float32).sum(), layer, autocast=mx.float16)
    assert g["weight"].dtype == mx.float32 and calls == [mx.float16]
    calls.clear()
    (g,) = gradient(lambda m: m(x).astype(mx.float32).sum(), layer, autocast=mx.bfloat16)
    assert g["weight"].dtype == g["bias"].dtype == mx.float32
    # The native kernel (oneDNN's bfloat16 one, or its float32 one upcasting inside the
    # primitive): its backward pass keeps only bfloat16 activations (and no more than the
    # emulation: tests/precision/test_emulation.py).
    assert calls == [mx.bfloat16]
    # d/dw of sum(x @ w.T) is the column sums of x, rounded to bfloat16 (accumulated in float32)
    expected = x.astype(mx.bfloat16).astype(mx.float32).sum(axis=0).astype(mx.bfloat16)
    np.testing.assert_allclose(np64(g["weight"][0]), np64(expected), rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("dtype", [None, mx.bfloat16], ids=["float32", "autocast-bf16"])
def test_a_nan_input_gives_nan_outputs_through_a_relu_layer(calls, dtype):
    # A diverged batch must show in the loss (fluxlike.train stops on it), not be zeroed.
    layer = Dense(3, 4, relu)
    x = mx.array([[float("nan"), 1.0, 2.0], [1.0, 1.0, 1.0]])
    with autocast(dtype, enabled=dtype is not None, device="cpu"):
        y = layer(x)
    assert bool(calls)  # the kernel ran
    assert np.isnan(np64(y)[0]).all() and not np.isnan(np64(y)[1]).any()


def _cast_nodes(*arrays):
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fl-graph-{os.getpid()}.dot")
    mx.export_to_dot(path, *arrays)
    with open(path) as f:
        return len(re.findall(r'label ="?(?:AsType|FluxlikeNativeConvert)\b', f.read()))


@pytest.fixture
def f16_upcast():
    """float16 in oneDNN's float32 kernels, as without AVX512-FP16 (where fused casts apply)."""
    with float16_in_float32_kernels():
        yield


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("x_dtype", [mx.float32, "compute"])
def test_training_fuses_the_weights_casts_into_the_upcasting_product(
        calls, monkeypatch, dtype, x_dtype, f16_upcast):
    """Where the native product runs half precision in float32 kernels (float16 without
    AVX512-FP16; bfloat16 without AVX512-BF16), training gives it the float32 weights and bias with
    ``compute_dtype``: the same loss and gradients bit for bit as the casts it replaces, in
    float32, without a cast node per parameter forward or backward."""
    from fluxlike import Chain
    if dtype == mx.bfloat16 and native.switch.bf16:
        pytest.skip("oneDNN's bfloat16 kernels take bfloat16 operands: the casts are made")
    mx.random.seed(3)
    model = Chain(Dense(16, 32, relu), Dense(32, 32, mx.tanh), Dense(32, 4))
    x = mx.random.normal((8, 16)).astype(dtype if x_dtype == "compute" else mx.float32)

    def loss(m):
        return m(x).astype(mx.float32).square().mean()

    def run():
        from fluxlike import withgradient
        value, (grads,) = withgradient(loss, model, autocast=dtype)
        return [value] + [g for _, g in tree_flatten(grads)]

    mx.eval(x, model.parameters())
    fused = run()
    assert set(calls) == {dtype} and len(calls) == 3
    assert all(g.dtype == mx.float32 for g in fused)
    monkeypatch.setattr(kernels, "_with_fused_casts", lambda *args: None)
    cast = run()
    # the casts of the 6 parameters forward and of their 6 gradients back (a bias's gradient
    # is one node, fluxlike_native.bias_grad, rounding to the half dtype inside; the input is
    # cast, to be kept in half precision)
    assert _cast_nodes(*cast) - _cast_nodes(*fused) == 12
    for mine, theirs in zip(fused, cast, strict=True):
        np.testing.assert_array_equal(np64(mine), np64(theirs))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_a_weight_used_twice_sums_its_fused_gradients_in_float32(monkeypatch, dtype,
                                                                 f16_upcast):
    """A layer applied twice in a step (as a recurrent layer's weights are at every time
    step): with fused casts each use's gradient is the casts' (rounded to the half dtype),
    and they are summed in float32, as MLX sums a float32 array's gradients (the casts,
    shared by the uses, summed them in half precision)."""
    if dtype == mx.bfloat16 and native.switch.bf16:
        pytest.skip("oneDNN's bfloat16 kernels take bfloat16 operands: the casts are made")
    mx.random.seed(4)
    layer, x = Dense(16, 16, relu), mx.random.normal((8, 16))
    mx.eval(layer.parameters(), x)
    (fused,) = gradient(lambda m: m(m(x)).astype(mx.float32).sum(), layer, autocast=dtype)
    monkeypatch.setattr(kernels, "_with_fused_casts", lambda *args: None)
    twin = Dense(16, 16, relu)
    twin.update(layer.parameters())
    # the same weights, each use its own casts
    each = gradient(lambda a, b: b(a(x)).astype(mx.float32).sum(), layer, twin, autocast=dtype)
    for name in ("weight", "bias"):
        expected = each[0][name] + each[1][name]
        np.testing.assert_array_equal(np64(fused[name]), np64(expected))
        halves = each[0][name].astype(dtype).astype(mx.float32)
        np.testing.assert_array_equal(np64(each[0][name]), np64(halves))  # each use rounded


# ---- attention's core (fluxlike/precision/attention.py: attend, through kernels.matmul) ----------

BF16 = mx.bfloat16
SCALE = 0.3  # not a power of two: the scaled queries are rounded, as in the emulation


@pytest.fixture
def matmuls(monkeypatch):
    seen = []
    original = native.matmul

    def counting(*args, **kwargs):
        seen.append(args[0].dtype)
        return original(*args, **kwargs)

    monkeypatch.setattr(native.ops, "matmul", counting)
    return seen


@pytest.fixture
def needs_bf16_kernels():
    if not native.bfloat16_native():
        pytest.skip("bfloat16 runs in oneDNN's float32 kernels here: the emulation takes it")


def _emulated(monkeypatch, fn, *args):
    """``fn(*args)`` with kernels.matmul on the float32-kernel emulation, as without the native
    companion (or with FLUXLIKE_NATIVE=0)."""
    with monkeypatch.context() as m:
        m.setattr(kernels, "_TAKES", {**kernels._TAKES, "matmul": kernels._never})
        return fn(*args)


def _qkv(lq=5, lk=7, dtype=BF16, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((2, 3, lq, 8), (2, 3, lk, 8), (2, 3, lk, 6))
    return tuple(mx.array(rng.normal(size=s).astype(np.float32)).astype(dtype) for s in shapes)


def _mask(kind, lq=5, lk=7):
    rng = np.random.default_rng(1)
    if kind == "bool":
        keep = rng.random((lq, lk)) < 0.6
        keep[:, 0] = True
        return mx.array(keep)
    if kind == "additive":
        return mx.array(rng.normal(size=(2, 1, 1, lk)).astype(np.float32))
    return kind


def _np_attention(q, k, v, scale, mask):
    """Float64 attention on the (rounded) operands, and its weights."""
    q, k, v = np64(q), np64(k), np64(v)
    scores = scale * q @ k.swapaxes(-1, -2)
    lq, lk = scores.shape[-2:]
    if isinstance(mask, str):
        scores = np.where(np.tril(np.ones((lq, lk), bool), k=lk - lq), scores, -np.inf)
    elif mask is not None and mask.dtype == mx.bool_:
        scores = np.where(np.array(mask), scores, -np.inf)
    elif mask is not None:
        scores = scores + np64(mask)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = e / e.sum(axis=-1, keepdims=True)
    return weights @ v, weights


MASKS = [None, "causal", "bool", "additive"]


@pytest.mark.parametrize("mask", MASKS)
def test_bfloat16_attention_core_runs_native_with_the_emulations_numerics(
        mask, matmuls, needs_bf16_kernels, monkeypatch):
    q, k, v = _qkv()
    given = _mask(mask)
    out, weights = attend(q, k, v, SCALE, given, return_weights=True)
    assert matmuls == [BF16, BF16]  # the scores and the weighted sum
    assert out.dtype == weights.dtype == BF16 and out.shape == (2, 3, 5, 6)
    # The emulation's roundings (scaled queries, scores, weights and output in bfloat16,
    # float32 accumulation, float32 softmax): the same values, to accumulation order.
    e_out, e_weights = _emulated(
        monkeypatch, lambda: attend(q, k, v, SCALE, given, return_weights=True))
    assert len(matmuls) == 2
    np.testing.assert_allclose(np64(out), np64(e_out), rtol=2**-7, atol=1e-6)
    np.testing.assert_allclose(np64(weights), np64(e_weights), rtol=2**-7, atol=1e-6)
    exact, exact_weights = _np_attention(q, k, v, SCALE, given)
    np.testing.assert_allclose(np64(out), exact, atol=3e-2)
    np.testing.assert_allclose(np64(weights), exact_weights, atol=2e-2)
    # the fused path (no weights asked for) is the same computation
    assert mx.array_equal(attend(q, k, v, SCALE, given)[0], out).item()


@pytest.mark.parametrize("mask", MASKS)
def test_bfloat16_attention_core_gradients_match_the_emulation(
        mask, matmuls, needs_bf16_kernels, monkeypatch):
    q, k, v = _qkv()
    given = _mask(mask)
    cotangent = mx.array(np.random.default_rng(3).normal(size=(2, 3, 5, 6)).astype(np.float32))

    def loss(q, k, v):
        return (attend(q, k, v, SCALE, given)[0].astype(mx.float32) * cotangent).sum()

    grads = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert len(matmuls) == 2
    expected = _emulated(monkeypatch, mx.grad(loss, argnums=(0, 1, 2)), q, k, v)
    for g, e in zip(grads, expected, strict=True):
        assert g.dtype == e.dtype == BF16
        scale = max(np.abs(np64(e)).max(), 1e-3)
        assert np.abs(np64(g) - np64(e)).max() <= 2**-6 * scale


def test_stock_multi_head_attention_trains_native_in_bfloat16(matmuls, needs_bf16_kernels):
    layer, x = nn.MultiHeadAttention(8, 2), mx.random.normal((2, 5, 8))
    mx.eval(layer.parameters())
    mask = nn.MultiHeadAttention.create_additive_causal_mask(5)

    def loss(model, x):
        return model(x, x, x, mask).astype(mx.float32).sum()

    reference, expected = nn.value_and_grad(layer, loss)(layer, x)  # float32, MLX's own
    assert matmuls == []
    with autocast(mx.bfloat16, device="cpu"):
        value, grads = nn.value_and_grad(layer, loss)(layer, x)
    assert matmuls == [BF16, BF16]
    np.testing.assert_allclose(value.item(), reference.item(), rtol=5e-2, atol=5e-2)
    for (_, g), (_, e) in zip(tree_flatten(grads), tree_flatten(expected), strict=True):
        assert g.dtype == mx.float32  # the float32 master weights' gradients
        assert np.abs(np64(g) - np64(e)).max() <= 5e-2 * max(np.abs(np64(e)).max(), 1e-3)


def test_dropout_and_weights_paths_run_native(matmuls, needs_bf16_kernels, monkeypatch):
    mha = MultiHeadAttention(8, 2, dropout=0.5)
    trainmode(mha)
    x = mx.random.normal((2, 6, 8))

    def run():
        mx.random.seed(7)  # the same dropout mask both times
        with autocast(mx.bfloat16, device="cpu"):
            return mha(x, return_weights=True)

    out, weights = run()
    assert matmuls == [BF16, BF16] and out.dtype == weights.dtype == BF16
    w = np64(weights)
    assert 0 < np.count_nonzero(w) < w.size  # some weights dropped, some kept
    e_out, e_weights = _emulated(monkeypatch, run)
    np.testing.assert_allclose(w, np64(e_weights), rtol=2**-7, atol=1e-6)
    np.testing.assert_allclose(np64(out), np64(e_out), rtol=2**-6, atol=1e-2)


def test_float16_in_float32_kernels_and_float32_stay_off_the_native_matmul(matmuls):
    with float16_in_float32_kernels():
        q, k, v = _qkv(dtype=mx.float16)
        assert attend(q, k, v, SCALE, "causal")[0].dtype == mx.float16
    q, k, v = _qkv(dtype=mx.float32)
    attend(q, k, v, SCALE, "causal", return_weights=True)
    assert matmuls == []


@needs_f16_kernels
def test_float16_attention_in_float16_kernels(matmuls, monkeypatch):
    """With oneDNN's float16 kernels (AVX512-FP16) attention's two products are native
    float16 ones, the values the emulation gives to the order of the float32 sums, and the
    gradients too."""
    q, k, v = _qkv(dtype=mx.float16)

    def run(q, k, v):
        def f(q, k, v):
            out, weights = attend(q, k, v, SCALE, "causal", return_weights=True)
            return (out.astype(mx.float32) * 1.5).sum() + weights.astype(mx.float32).sum()
        return mx.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    (value, grads) = run(q, k, v)
    assert matmuls[:2] == [mx.float16, mx.float16] and all(g.dtype == mx.float16 for g in grads)
    e_value, e_grads = _emulated(monkeypatch, run, q, k, v)
    np.testing.assert_allclose(np64(value), np64(e_value), rtol=2**-9)
    for g, e in zip(grads, e_grads, strict=True):
        np.testing.assert_allclose(np64(g), np64(e), rtol=2**-8, atol=2**-9)


# fluxlike's MultiHeadAttention cannot be traced shapeless (its head split names the shapes),
# mlx.nn's can.
@pytest.mark.parametrize("kind, shapeless", [("fluxlike", False), ("mlx.nn", False),
                                             ("mlx.nn", True)])
def test_compiled_attention_under_autocast_runs_native(kind, shapeless, matmuls,
                                                       needs_bf16_kernels):
    mha = MultiHeadAttention(8, 2) if kind == "fluxlike" else nn.MultiHeadAttention(8, 2)
    mask = mx.random.normal((6, 6))
    mx.eval(mha.parameters(), mask)

    def call(m, x):
        return m(x, mask=mask) if kind == "fluxlike" else m(x, x, x, mask)

    def grads(x):
        return gradient(lambda m: call(m, x).astype(mx.float32).sum(), mha,
                        autocast=mx.bfloat16)[0]

    compiled = fl_compile(grads, inputs=mha.state, shapeless=shapeless)
    for batch in (2, 3) if shapeless else (2,):
        x = mx.random.normal((batch, 6, 8))
        fast, slow = compiled(x), grads(x)
        for (key, a), (_, b) in zip(tree_flatten(fast), tree_flatten(slow), strict=True):
            assert a.dtype == b.dtype == mx.float32
            np.testing.assert_allclose(np64(a), np64(b), rtol=1e-2, atol=1e-3, err_msg=key)
    assert BF16 in matmuls


def test_without_the_native_part_attention_takes_the_emulation():
    """FLUXLIKE_NATIVE=0: the same bfloat16 attention on the float32-kernel emulation."""
    code = textwrap.dedent("""
        import mlx.core as mx, numpy as np
        from fluxlike import native
        from fluxlike.precision.attention import attend
        assert not native.available()
        rng = np.random.default_rng(0)
        q, k, v = (mx.array(rng.normal(size=(2, 3, 5, 8)).astype(np.float32)).astype(
            mx.bfloat16) for _ in range(3))
        out = attend(q, k, v, 0.3, "causal")[0]
        assert out.dtype == mx.bfloat16
        print(out.astype(mx.float32).tolist())
    """)
    env = {key: value for key, value in os.environ.items() if key != "FLUXLIKE_NATIVE"}
    result = subprocess.run([sys.executable, "-c", code], env={**env, "FLUXLIKE_NATIVE": "0"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.normal(size=(2, 3, 5, 8)).astype(np.float32)).astype(BF16)
               for _ in range(3))
    here = attend(q, k, v, 0.3, "causal")[0]
    np.testing.assert_allclose(np.array(ast.literal_eval(result.stdout)), np64(here),
                               rtol=2**-7, atol=1e-6)


def test_half_attention_softmax_runs_native_in_float32(monkeypatch):
    seen = []
    monkeypatch.setattr(native.switch, "ext", Counting(native.switch.ext, seen, ("softmax",)))
    for dtype in (mx.float16, BF16):
        q, k, v = _qkv(dtype=dtype)
        out, weights = attend(q, k, v, SCALE, "causal", return_weights=True)
        assert out.dtype == weights.dtype == dtype
        exact, exact_weights = _np_attention(q, k, v, SCALE, "causal")
        np.testing.assert_allclose(np64(weights), exact_weights, atol=2e-2)
    assert seen == [mx.float32, mx.float32]  # the float32 scores of both half dtypes
    q, k, v = _qkv(dtype=mx.float32)
    out, _ = attend(q, k, v, SCALE, "causal")  # float32 scores: native too (MLX's exp is scalar)
    assert seen == [mx.float32] * 3
    exact, _ = _np_attention(q, k, v, SCALE, "causal")
    np.testing.assert_allclose(np64(out), exact, rtol=1e-5, atol=1e-6)


def test_a_float32_layer_under_vmap_and_per_sample_gradients(calls):
    layer, x = Dense(3, 4, relu), mx.random.normal((5, 2, 3))
    y = mx.vmap(layer)(x)
    assert calls and y.shape == (5, 2, 4)
    np.testing.assert_allclose(np64(y), np64(_mlx(layer, x)), rtol=1e-5, atol=1e-6)

    def loss(w, x):
        layer.weight = w
        return layer(x).sum()

    w = layer.weight
    per_sample = mx.vmap(mx.grad(loss), in_axes=(None, 0))(w, x)
    expected = mx.vmap(mx.grad(lambda w, x: relu(mx.addmm(layer.bias, x, w.T)).sum()),
                       in_axes=(None, 0))(w, x)
    layer.weight = w
    np.testing.assert_allclose(np64(per_sample), np64(expected), rtol=1e-5, atol=1e-6)
