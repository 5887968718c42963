"""MLX's stock layers under autocast (fluxlike/precision/stock.py).

Inside a scope ``nn.Linear`` and the convolutions run through fluxlike's kernels, so that CPU
half precision takes the float32 kernels: the result is the float32 computation on the
rounded operands, rounded once, within half-precision tolerance of MLX's native kernels,
and gradients reach the float32 weights. Outside a scope nothing changes.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import half_copy, normal, np64

from fluxlike import autocast, autocast_policy, bf16, bf16mix, f16, f16mix
from fluxlike.precision import castcache, kernels

TOL = {mx.float16: 4e-3, mx.bfloat16: 3e-2}

# (layer, input shape)
LAYERS = [
    ("Linear", lambda: nn.Linear(6, 5), (3, 4, 6)),
    ("Linear no bias", lambda: nn.Linear(6, 5, bias=False), (3, 6)),
    ("Conv1d", lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2), (2, 11, 4)),
    ("Conv1d groups", lambda: nn.Conv1d(4, 6, 3, groups=2, bias=False), (2, 9, 4)),
    ("Conv2d", lambda: nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 0)), (2, 7, 6, 3)),
    ("Conv3d", lambda: nn.Conv3d(2, 3, 2, padding=1), (1, 4, 5, 3, 2)),
    ("ConvTranspose1d", lambda: nn.ConvTranspose1d(4, 3, 3, stride=2, output_padding=1),
     (2, 5, 4)),
    ("ConvTranspose2d", lambda: nn.ConvTranspose2d(3, 2, 3, padding=1), (2, 4, 5, 3)),
    ("ConvTranspose3d", lambda: nn.ConvTranspose3d(2, 2, 2, stride=2), (1, 3, 2, 3, 2)),
]


@pytest.fixture(autouse=True)
def fresh_cache():
    castcache.clear_cast_cache()
    yield
    castcache.clear_cast_cache()


def close(actual, expected, dtype):
    a, e = np64(actual), np64(expected)
    scale = max(np.abs(e).max(), 1e-3)
    assert np.abs(a - e).max() <= TOL[dtype] * scale, np.abs(a - e).max() / scale


def native(layer, x, dtype):
    """The layer's own forward (MLX's half kernels) on a half view, no scope."""
    return type(layer).__call__.__fluxlike_plain__(half_copy(layer, dtype), x.astype(dtype))


def loss_of(layer, weights):
    return lambda x: (layer(x).astype(mx.float32) * weights).sum()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("name, make, shape", LAYERS, ids=[c[0] for c in LAYERS])
class TestRouted:
    def test_forward_is_float32_kernels_rounded_once(self, dtype, name, make, shape):
        layer, x = make(), normal(*shape)
        if "bias" in layer:  # not MLX's zeros: a bias added after a first rounding shows
            layer.bias = normal(*layer.bias.shape, seed=5)
        mx.eval(layer.parameters())
        with autocast(dtype, device="cpu"):
            y = layer(x)
        assert y.dtype == dtype
        rounded = half_copy(layer, dtype)
        for key, value in rounded.items():  # the float32 layer on the rounded operands
            if isinstance(value, mx.array):
                dict.__setitem__(rounded, key, value.astype(mx.float32))
        plain = type(layer).__call__.__fluxlike_plain__
        kernel = plain(rounded, x.astype(dtype).astype(mx.float32))
        assert mx.array_equal(y, kernel.astype(dtype)).item()  # bias and all, rounded once
        close(y, native(layer, x, dtype), dtype)

    def test_gradients_reach_the_float32_weights(self, dtype, name, make, shape):
        layer, x = make(), normal(*shape)
        mx.eval(layer.parameters())
        weights = normal(*native(layer, x, dtype).shape, seed=1)

        def loss(model, x):
            return (model(x).astype(mx.float32) * weights).sum()

        with autocast(dtype, device="cpu"):
            _, grads = nn.value_and_grad(layer, loss)(layer, x)
        view = half_copy(layer, dtype)
        _, expected = nn.value_and_grad(view, lambda m, x: loss(m, x))(
            view, x.astype(dtype)
        )
        for key, g in grads.items():
            assert g.dtype == mx.float32
            close(g, expected[key], dtype)

    def test_calls_go_through_ops(self, dtype, name, make, shape, monkeypatch):
        layer, x = make(), normal(*shape)
        kernel = "linear" if name.startswith("Linear") else (
            "conv_transpose" if "Transpose" in name else "conv"
        )
        calls = []
        original = getattr(kernels, kernel)
        monkeypatch.setattr(kernels, kernel, lambda *a: calls.append(1) or original(*a))
        layer(x)
        assert calls == []  # outside a scope: the layer's own forward
        with autocast(dtype, device="cpu"):
            layer(x)
        assert calls == [1]


def test_outside_a_scope_nothing_changes():
    layer, x = nn.Conv2d(3, 4, 3, padding=1), normal(2, 5, 5, 3)
    with autocast(mx.bfloat16):
        layer(x)
    plain = type(layer).__call__.__fluxlike_plain__
    assert mx.array_equal(layer(x), plain(layer, x)).item()


@pytest.mark.parametrize(("make", "shape"), [
    (lambda **k: nn.Conv1d(2, 3, 3, **k), (2, 9, 2)),
    (lambda **k: nn.Conv2d(2, 3, 3, **k), (2, 7, 7, 2)),
    (lambda **k: nn.ConvTranspose2d(2, 3, 3, **k), (2, 5, 5, 2)),
])
def test_numpy_integer_settings_as_outside_a_scope(make, shape):
    # MLX's layers keep stride=np.int64(2) as given, and their own forward accepts it
    layer = make(stride=np.int64(2), padding=np.int32(1), dilation=np.int8(1))
    x = normal(*shape)
    expected = layer(x)
    with autocast(mx.bfloat16, device="cpu"):
        y = layer(x)
    assert y.shape == expected.shape and y.dtype == mx.bfloat16
    close(y, expected, mx.bfloat16)


def test_subclass_with_its_own_forward_keeps_it():
    class Doubled(nn.Linear):
        def __call__(self, x):
            return 2 * super().__call__(x)

    layer, x = Doubled(3, 2), normal(4, 3)
    with autocast(mx.bfloat16):
        y = layer(x)
    assert y.dtype == mx.bfloat16
    with autocast(mx.bfloat16):
        single = nn.Linear.__call__(layer, x)
    close(y, 2 * single, mx.bfloat16)


@pytest.mark.parametrize("mask", [None, "causal", "additive"])
def test_multi_head_attention_core_takes_float32_kernels(mask, monkeypatch):
    layer, x = nn.MultiHeadAttention(8, 2), normal(2, 5, 8)
    mx.eval(layer.parameters())
    mask = normal(5, 5, seed=2) if mask == "additive" else mask
    reference = layer(x, x, x, mask)  # float32, MLX's own forward
    sdpa = mx.fast.scaled_dot_product_attention
    calls = []
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    with autocast(mx.bfloat16, device="cpu"):
        y = layer(x, x, x, mask)
    assert calls == [] and y.dtype == mx.bfloat16
    close(y, reference, mx.bfloat16)

    def loss(model, x):
        return model(x, x, x, mask).astype(mx.float32).sum()

    with autocast(mx.bfloat16, device="cpu"):
        _, grads = nn.value_and_grad(layer, loss)(layer, x)
    _, expected = nn.value_and_grad(layer, loss)(layer, x)
    for (_, g), (_, e) in zip(nn.utils.tree_flatten(grads), nn.utils.tree_flatten(expected),
                              strict=True):
        assert g.dtype == mx.float32
        close(g, e, mx.bfloat16)


# --- converted (half-precision) stock layers outside a scope ------------------------------


class TiedHead(nn.Module):
    """An embedding used as a tied output head (mlx-lm's Qwen2, Gemma, GPT-2, Mamba)."""

    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.embedding = embedding

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding.as_linear(x)


CONVERTED = [
    ("Linear", lambda: nn.Linear(6, 5), (3, 4, 6), "linear"),
    ("Conv1d", lambda: nn.Conv1d(4, 6, 3, padding=1), (2, 9, 4), "conv"),
    ("ConvTranspose2d", lambda: nn.ConvTranspose2d(3, 2, 3, padding=1), (2, 4, 5, 3),
     "conv_transpose"),
    ("QuantizedLinear", lambda: nn.QuantizedLinear(64, 32, group_size=32, bits=4), (3, 64),
     "quantized_linear"),
    ("Embedding.as_linear", lambda: TiedHead(nn.Embedding(10, 6)), (3, 6), "linear"),
    ("QuantizedEmbedding.as_linear", lambda: TiedHead(nn.QuantizedEmbedding(10, 64, 32, 4)),
     (3, 64), "quantized_linear"),
]


@pytest.mark.parametrize("convert", [bf16mix, f16], ids=["bf16mix", "f16"])
@pytest.mark.parametrize(("name", "make", "shape", "kernel"), CONVERTED,
                         ids=[c[0] for c in CONVERTED])
def test_converted_layer_takes_fluxlikes_kernels_outside_a_scope(name, make, shape, kernel,
                                                                 convert, monkeypatch):
    """A converted stock layer given its own half dtype on the CPU runs fluxlike's kernels
    (oneDNN's bfloat16, or float32 kernels with half numerics), not MLX's half ones (50x
    slower): the same numerics as its own forward, the same dtypes."""
    layer = make()
    mx.eval(layer.parameters())
    half = convert(layer)
    dtype = mx.bfloat16 if convert is bf16mix else mx.float16
    x = normal(*shape).astype(dtype)
    if isinstance(half, TiedHead):
        embedding = half.embedding
        plain = type(embedding).as_linear.__fluxlike_plain__
        expected = plain(embedding, x)  # MLX's own as_linear on the half embedding
    else:
        plain = type(half).__call__.__fluxlike_plain__
        expected = plain(half, x)  # MLX's own forward on the half layer
    calls = []
    original = getattr(kernels, kernel)
    monkeypatch.setattr(kernels, kernel, lambda *a, **k: calls.append(1) or original(*a, **k))
    with mx.stream(mx.cpu):
        y = half(x)
    assert calls == [1]
    assert y.dtype == dtype and y.shape == expected.shape
    close(y, expected, dtype)
    # a float32 input promotes as MLX promotes it (no conversion): MLX's own float32 forward
    with mx.stream(mx.cpu):
        assert half(x.astype(mx.float32)).dtype == mx.float32
    assert calls == [1]


def test_converted_linear_runs_the_native_bfloat16_kernel(monkeypatch):
    """Where the native companion has bfloat16 kernels, a bf16mix ``nn.Linear`` runs them,
    as ``autocast`` does (the 47x slowdown was MLX's own bfloat16 GEMM)."""
    from fluxlike import native as native_module

    if not native_module.bfloat16_native():
        pytest.skip("no native bfloat16 kernels here (./dev builds them on Linux x86-64)")
    calls = []
    ext = native_module.switch.ext

    class Counting:  # the companion as the routing sees it, counting its matmuls
        def __getattr__(self, name):
            return getattr(ext, name)

        def matmul(self, x, *args, **kwargs):
            calls.append(x.dtype)
            return ext.matmul(x, *args, **kwargs)

        def packed_linear(self, x, *args, **kwargs):  # (weights seen before, packed)
            calls.append(x.dtype)
            return ext.packed_linear(x, *args, **kwargs)

    monkeypatch.setattr(native_module.switch, "ext", Counting())
    half = bf16mix(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    x = normal(4, 16).astype(mx.bfloat16)
    for _ in range(2):
        mx.eval(half(x))
    assert calls == [mx.bfloat16] * 4


@pytest.mark.parametrize("convert", [bf16mix, f16mix, bf16])
def test_converted_attention_takes_a_float32_additive_mask(convert):
    """MLX refuses a float32 mask with half scores ("Mask type must promote to output
    type"): a converted ``nn.MultiHeadAttention`` casts it as autocast does, and keeps a
    boolean one."""
    layer, x = nn.MultiHeadAttention(8, 2, bias=True), normal(2, 5, 8)
    mx.eval(layer.parameters())
    keep = mx.array([True, True, True, False, False])
    additive = mx.where(keep, 0.0, -mx.inf)
    reference = layer(x, x, x, additive)
    half = convert(layer)
    dtype = half.query_proj.weight.dtype
    xh = x.astype(dtype)
    y = half(xh, xh, xh, additive)
    assert y.dtype == dtype
    close(y, reference, dtype)
    with autocast(dtype):
        scoped = layer(xh, xh, xh, additive)
    close(y, scoped, dtype)
    close(half(xh, xh, xh, keep), reference, dtype)
    assert half(x, x, x, additive).dtype == mx.float32  # float32 data: MLX's promotion


def test_unscoped_needs_a_forward_function():
    with pytest.raises(TypeError, match="unscoped"):
        autocast_policy("down", unscoped=lambda layer, x: True)
    with pytest.raises(TypeError, match="unscoped"):
        autocast_policy("down", forward=lambda layer, x: x, unscoped="yes")


CONVERTED_SCRIPT = '''
import mlx.core as mx, mlx.nn as nn
import fluxlike
from fluxlike.precision import kernels, policy
layer = nn.Linear(8, 8)
assert not policy.is_routing()
fluxlike.f32(layer)  # a float32 conversion needs no routing
assert not policy.is_routing()
half = fluxlike.bf16mix(layer)  # no autocast ever used: the converter starts the routing
assert policy.is_routing()
calls = []
original = kernels.linear
kernels.linear = lambda *a, **k: calls.append(1) or original(*a, **k)
with mx.stream(mx.cpu):
    y = half(mx.ones((2, 8), mx.bfloat16))
assert y.dtype == mx.bfloat16 and calls == [1], calls
print("converted ok")
'''


def test_a_converter_routes_stock_layers_in_a_fresh_interpreter():
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", CONVERTED_SCRIPT],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "converted ok"


# ---------------------------------------------------------------- mx.fast's attention

def _run(code, env=None):
    import os
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-2000:]


_MLX_FUNCTIONS = ("import mlx.core as mx, mlx.nn as nn, mlx.nn.losses as losses\n"
                  "mlx_sdpa, mlx_silu = mx.fast.scaled_dot_product_attention, nn.silu\n"
                  "mlx_loss = losses.cross_entropy\n"
                  "import fluxlike\n"
                  "from fluxlike.precision import stock\n"
                  "def mlxs():\n"
                  "    return (mx.fast.scaled_dot_product_attention is mlx_sdpa\n"
                  "            and nn.silu is mlx_silu and losses.cross_entropy is mlx_loss)\n"
                  "assert mlxs()\n")


@pytest.mark.parametrize("first", ["autocast", "gradient"])
def test_importing_fluxlike_leaves_mlxs_functions_until_its_first_use(first):
    use = {"autocast": "with fluxlike.autocast(mx.bfloat16): pass\n",
           "gradient": "fluxlike.gradient(lambda x: (x * x).sum(), mx.ones(2))\n"}[first]
    _run(_MLX_FUNCTIONS + use +
         "assert mx.fast.scaled_dot_product_attention is stock.scaled_dot_product_attention\n"
         "assert nn.silu is stock.silu and nn.gelu is stock.gelu\n"
         "assert nn.SiLU.__call__ is stock._silu_module\n"
         "assert nn.losses.cross_entropy is stock.cross_entropy\n"
         "assert stock._mlx_sdpa is mlx_sdpa and stock._mlx_activations['silu'] is mlx_silu\n"
         "assert stock._mlx_cross_entropy is mlx_loss\n")


def test_patch_variable_leaves_mlxs_functions():
    _run(_MLX_FUNCTIONS + "with fluxlike.autocast(mx.bfloat16): pass\n"
         "fluxlike.gradient(lambda x: (x * x).sum(), mx.ones(2))\n"
         "assert mlxs()\n"
         "from fluxlike.precision import policy\n"
         "assert policy.is_routing()  # (the stock layers' routing is not this switch's)\n",
         env={"FLUXLIKE_PATCH_MLX": "0"})


def test_first_use_hooks_run_once():
    from fluxlike.precision import state
    calls = []
    with autocast(mx.bfloat16):  # (fluxlike in use: a hook given now runs now, once)
        pass
    state.on_first_use(lambda: calls.append(1))
    try:
        state.first_use()
        assert calls == [1]
    finally:
        state._first_use_hooks.pop()


def _qkv(heads=4, kv_heads=2, lq=5, lk=5, seed=0):
    keys = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((2, heads, lq, 8), key=keys[0]),
            mx.random.normal((2, kv_heads, lk, 8), key=keys[1]),
            mx.random.normal((2, kv_heads, lk, 8), key=keys[2]))


def _counting_attend(monkeypatch):
    """Counts the calls of attend from the routed mx.fast function (installed here: another
    test's monkeypatch of mx.fast may have put MLX's back, routing being on already)."""
    from fluxlike.precision import stock
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        stock.scaled_dot_product_attention)
    calls = []
    real = stock.attend
    monkeypatch.setattr(stock, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("mask", [None, "causal", "bool"])
@pytest.mark.parametrize(("heads", "kv_heads", "lq", "lk"), [(4, 4, 16, 16), (4, 2, 16, 16),
                                                             (4, 1, 16, 20), (2, 2, 17, 16)])
def test_upstream_attention_under_autocast_runs_fluxlikes_core(monkeypatch, mask, heads,
                                                               kv_heads, lq, lk):
    from fluxlike.precision import stock
    with autocast(mx.bfloat16):  # (routing on)
        pass
    q, k, v = _qkv(heads, kv_heads, lq, lk)
    if mask == "bool":
        mask = mx.random.uniform(shape=(lq, lk), key=mx.random.key(9)) < 0.7
    reference = stock._mlx_sdpa(q, k, v, scale=0.3, mask=mask)  # float32, MLX's
    calls = _counting_attend(monkeypatch)
    half = [a.astype(mx.bfloat16) for a in (q, k, v)]
    with mx.stream(mx.cpu), autocast(mx.bfloat16, device="cpu"):
        out = mx.fast.scaled_dot_product_attention(*half, scale=0.3, mask=mask)
    assert calls == [1] and out.dtype == mx.bfloat16 and out.shape == reference.shape
    np.testing.assert_allclose(np64(out), np64(reference), atol=5e-2)

    def loss(q, k, v, sdpa):
        return sdpa(q, k, v, scale=0.3, mask=mask).astype(mx.float32).sum()

    with mx.stream(mx.cpu), autocast(mx.bfloat16, device="cpu"):
        grads = mx.grad(lambda *a: loss(*a, mx.fast.scaled_dot_product_attention),
                        argnums=(0, 1, 2))(*half)
    want = mx.grad(lambda *a: loss(*a, stock._mlx_sdpa), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(np64(g), np64(w), atol=0.1 * float(mx.abs(w).max()) + 1e-2)


@pytest.mark.parametrize("case", ["additive mask", "5-D mask", "unknown mask", "few queries"])
def test_upstream_attention_left_to_mlx(monkeypatch, case):
    # what MLX takes or means otherwise (an additive mask's -inf rows are NaN there, its dtype
    # must promote to the output's; a 5-D mask, a string other than "causal" are refused), and
    # few queries against emulated half products (converting a long cache costs more)
    from fluxlike.precision import stock
    calls = _counting_attend(monkeypatch)
    q, k, v = (a.astype(mx.bfloat16) for a in _qkv(4, 4, 16, 16))
    mask = {"additive mask": mx.zeros((16, 16), mx.bfloat16), "5-D mask": mx.ones(
        (1, 1, 1, 16, 16), mx.bool_), "unknown mask": "Causal", "few queries": None}[case]
    if case == "few queries":
        q = q[:, :, :1]
        if kernels.choose("matmul", mx.bfloat16, q, k) == kernels.NATIVE:
            pytest.skip("oneDNN's bfloat16 products are native here: every length is routed")

    with mx.stream(mx.cpu), autocast(mx.bfloat16, device="cpu"):
        got = _outcome(mx.fast.scaled_dot_product_attention, q, k, v, scale=0.3, mask=mask)
    assert calls == []
    _same_outcome(got, _outcome(stock._mlx_sdpa, q, k, v, scale=0.3, mask=mask))


def _outcome(fn, *args, **kwargs):
    """fn's result as float64, or the message of the ValueError it raises."""
    try:
        return np64(fn(*args, **kwargs))
    except ValueError as e:
        return str(e)


def _same_outcome(got, want):
    if isinstance(want, str):
        assert got == want  # MLX's own error
    else:
        np.testing.assert_array_equal(got, want)


def test_float32_upstream_attention_is_routed_only_inside_fluxlikes_scopes(monkeypatch):
    import fluxlike
    from fluxlike.precision import stock
    with autocast(mx.bfloat16):
        pass
    q, k, v = _qkv()
    calls = _counting_attend(monkeypatch)
    with mx.stream(mx.cpu):
        outside = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
        assert calls == []  # plain MLX code keeps MLX's kernel
        value, grads = fluxlike.withgradient(
            lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3,
                                                           mask="causal").sum(), q)
    native_softmax = kernels.choose("softmax", mx.float32, q) == kernels.NATIVE
    assert calls == ([1] if native_softmax else [])
    want = mx.grad(lambda q: stock._mlx_sdpa(q, k, v, scale=0.3, mask="causal").sum())(q)
    np.testing.assert_allclose(np64(value), np64(outside.sum()), rtol=1e-5)
    np.testing.assert_allclose(np64(grads[0]), np64(want), rtol=1e-4, atol=1e-5)
    sinks = mx.zeros((4,))
    with mx.stream(mx.cpu), autocast(mx.bfloat16, device="cpu"):  # sinks: MLX's
        mx.fast.scaled_dot_product_attention(*(a.astype(mx.bfloat16) for a in (q, k, v)),
                                             scale=0.3, sinks=sinks.astype(mx.bfloat16))
    assert len(calls) == (1 if native_softmax else 0)


# ---------------------------------------------------------------- mlx.nn's activations

@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_approx"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_upstream_activations_run_native_and_agree_with_mlxs(monkeypatch, tmp_path, name,
                                                               dtype):
    import mlx.nn.layers.activations as activations

    from fluxlike import native
    from fluxlike.precision import stock
    with autocast(mx.bfloat16):  # (routing on)
        pass
    mlx_fn = stock._mlx_activations[name]
    # (installed here: another test's monkeypatch may have put MLX's back, routing being on)
    monkeypatch.setattr(nn, name, getattr(stock, name))
    monkeypatch.setattr(activations, name, getattr(stock, name))
    monkeypatch.setattr(nn.SiLU, "__call__", stock._silu_module)
    x = (mx.random.normal((3, 257), key=mx.random.key(4)) * 4).astype(dtype)
    swiglu = mx.compile(lambda g, u: getattr(nn, name)(g) * u, shapeless=True)  # (mlx-lm's)
    with mx.stream(mx.cpu):
        got, grad = getattr(nn, name)(x), mx.grad(lambda v: getattr(nn, name)(v).sum())(x)
        compiled = swiglu(x, x)
        want, want_grad = mlx_fn(x), mx.grad(lambda v: mlx_fn(v).sum())(x)
        nn_module = {"gelu": nn.GELU, "silu": nn.SiLU}.get(name, lambda: None)()
        nn_module = None if nn_module is None else nn_module(x)
    assert got.dtype == grad.dtype == compiled.dtype == dtype
    if dtype == mx.float32:  # MLX's own (mx.export_function cannot serialise fluxlike's)
        np.testing.assert_array_equal(np64(got), np64(want))
        with mx.stream(mx.cpu):
            mx.export_function(str(tmp_path / "f.mlxfn"), getattr(nn, name), x)
        return
    tol = {mx.bfloat16: 1e-2, mx.float16: 2e-3}[dtype]
    np.testing.assert_allclose(np64(got), np64(want), rtol=tol, atol=tol)
    np.testing.assert_allclose(np64(compiled), np64(want * x), rtol=4 * tol, atol=4 * tol)
    np.testing.assert_allclose(np64(grad), np64(want_grad), rtol=4 * tol, atol=4 * tol)
    if nn_module is not None:  # nn.GELU's forward calls gelu by name, nn.SiLU's is replaced
        np.testing.assert_allclose(np64(nn_module), np64(want), rtol=tol, atol=tol)
    calls = []
    ext = native.switch.loaded
    if ext is not None:
        op = {"silu": "sigmoid", "gelu": "gelu", "gelu_approx": "tanh"}[name]
        real = getattr(ext, op)
        monkeypatch.setattr(ext, op, lambda v: calls.append(1) or real(v))
        with mx.stream(mx.cpu):
            getattr(nn, name)(x)
            if name == "silu":  # the module too
                nn.SiLU()(x)
        assert calls == ([1, 1] if name == "silu" else [1])
        calls.clear()
        with native.disabled(), mx.stream(mx.cpu):  # without the companion: MLX's own
            np.testing.assert_array_equal(np64(getattr(nn, name)(x)), np64(mlx_fn(x)))
        assert calls == []


# ---------------------------------------------------------------- mlx.nn's cross entropy

def _counting_loss(monkeypatch):
    """Counts the routed cross entropy's native logsumexp (installed here, as above)."""
    import mlx.nn.losses as losses

    from fluxlike.precision import stock
    monkeypatch.setattr(losses, "cross_entropy", stock.cross_entropy)
    calls = []
    real = kernels.logsumexp_shifted
    monkeypatch.setattr(kernels, "logsumexp_shifted",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


CROSS_ENTROPY = {
    "indices": {},
    "mean": {"reduction": "mean"},
    "sum, weights": {"reduction": "sum", "weights": "w"},
    "smoothing": {"label_smoothing": 0.1, "reduction": "mean"},
    "probabilities": {"targets": "p"},
    "weights not summing to 1": {"targets": "u"},  # (multi-label, padding rows of zeros)
    "last axis by number": {"axis": 2},
}


@pytest.mark.parametrize("case", list(CROSS_ENTROPY))
def test_upstream_cross_entropy_in_a_gradient_is_native_and_agrees_with_mlxs(monkeypatch, case):
    import fluxlike
    from fluxlike.precision import stock
    with autocast(mx.bfloat16):  # (fluxlike in use)
        pass
    keys = mx.random.split(mx.random.key(3), 3)
    logits = mx.random.normal((3, 5, 33), key=keys[0]) * 6
    kwargs = dict(CROSS_ENTROPY[case])
    targets = mx.random.randint(0, 33, (3, 5), key=keys[1])
    kind = kwargs.pop("targets", None)
    if kind == "p":
        targets = mx.softmax(mx.random.normal((3, 5, 33), key=keys[2]), axis=-1)
    elif kind == "u":
        targets = mx.random.uniform(shape=(3, 5, 33), key=keys[2]) * (mx.arange(5) > 0)[:, None]
    if kwargs.get("weights") == "w":
        kwargs["weights"] = mx.arange(15, dtype=mx.float32).reshape(3, 5) / 15
    calls = _counting_loss(monkeypatch)

    def loss(fn):
        return lambda v: fn(v, targets, **kwargs).sum()

    with mx.stream(mx.cpu):
        outside = nn.losses.cross_entropy(logits, targets, **kwargs)
        assert calls == []  # plain MLX code keeps MLX's
        value, (grad,) = fluxlike.withgradient(loss(nn.losses.cross_entropy), logits)
        want_value, want_grad = mx.value_and_grad(loss(stock._mlx_cross_entropy))(logits)
    assert calls == ([1] if kernels.choose("exp", mx.float32, logits) == kernels.NATIVE
                     else [])
    np.testing.assert_array_equal(np64(outside), np64(stock._mlx_cross_entropy(
        logits, targets, **kwargs)))
    np.testing.assert_allclose(np64(value), np64(want_value), rtol=2e-6)
    np.testing.assert_allclose(np64(grad), np64(want_grad), rtol=1e-5, atol=1e-6)
    if kind is not None:  # the gradient in the probabilities too
        with mx.stream(mx.cpu):
            _, (in_targets,) = fluxlike.withgradient(
                lambda t: nn.losses.cross_entropy(logits, t, **kwargs).sum(), targets)
        want = mx.grad(lambda t: stock._mlx_cross_entropy(logits, t, **kwargs).sum())(targets)
        np.testing.assert_allclose(np64(in_targets), np64(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_upstream_cross_entropy_on_half_logits_is_computed_in_float32(monkeypatch, dtype):
    from fluxlike.precision import stock
    with autocast(mx.bfloat16):
        pass
    calls = _counting_loss(monkeypatch)
    logits = (mx.random.normal((64, 1000), key=mx.random.key(5)) * 4).astype(dtype)
    targets = mx.random.randint(0, 1000, (64,), key=mx.random.key(6))
    with mx.stream(mx.cpu):
        got = nn.losses.cross_entropy(logits, targets)
        grad = mx.grad(lambda v: nn.losses.cross_entropy(v, targets).sum())(logits)
        exact = stock._mlx_cross_entropy(logits.astype(mx.float32), targets)
        mlxs = stock._mlx_cross_entropy(logits, targets)
    if kernels.choose("exp", mx.float32, logits) != kernels.NATIVE:
        pytest.skip("no native companion: the routed loss is MLX's own, nothing to check")
    assert calls == [1, 1] and got.dtype == grad.dtype == dtype
    error = np.abs(np64(got) - np64(exact)).max()
    assert error <= np.abs(np64(exact)).max() * {mx.bfloat16: 2 ** -8, mx.float16: 2 ** -11}[dtype]
    assert error <= np.abs(np64(mlxs) - np64(exact)).max()  # (MLX's sums in half precision)


@pytest.mark.parametrize("case", ["smoothing 1", "targets' shape", "weights' shape",
                                  "reduction", "first axis", "integer logits", "no logits"])
def test_upstream_cross_entropy_left_to_mlx(monkeypatch, case):
    import fluxlike
    from fluxlike.precision import stock
    with autocast(mx.bfloat16):
        pass
    calls = _counting_loss(monkeypatch)
    logits, targets = mx.random.normal((4, 7), key=mx.random.key(1)), mx.array([0, 1, 2, 3])
    kwargs = {"smoothing 1": {"label_smoothing": 1.0}, "targets' shape": {},
              "weights' shape": {"weights": mx.ones((3,))}, "reduction": {"reduction": "avg"},
              "first axis": {"axis": 0}, "integer logits": {}, "no logits": {}}[case]
    if case == "targets' shape":
        targets = targets[:3]
    elif case == "first axis":
        targets = mx.arange(7) % 4
    elif case == "integer logits":
        logits = mx.arange(28).reshape(4, 7)
    elif case == "no logits":  # (MLX's logsumexp refuses an empty array)
        logits, targets, kwargs = logits[:0], targets[:0], {"reduction": "mean"}

    with mx.stream(mx.cpu), fluxlike.modes.differentiating():
        got = _outcome(nn.losses.cross_entropy, logits, targets, **kwargs)
    assert calls == []
    _same_outcome(got, _outcome(stock._mlx_cross_entropy, logits, targets, **kwargs))


def test_upstream_cross_entropy_of_an_infinite_logit_is_infinite():
    # (MLX's is NaN, inf - inf; both gradients are NaN: a diverged step is skipped either way)
    import fluxlike
    from fluxlike.precision import stock
    with autocast(mx.bfloat16):
        pass
    logits = mx.array([[0.0, float("inf"), 1.0], [0.0, 1.0, 2.0]])
    targets = mx.array([0, 2])
    if kernels.choose("exp", mx.float32, logits) != kernels.NATIVE:
        pytest.skip("no native companion: the routed loss is MLX's own, nothing to check")
    with mx.stream(mx.cpu), fluxlike.modes.differentiating():
        value = stock.cross_entropy(logits, targets)
        grad = mx.grad(lambda v: stock.cross_entropy(v, targets).sum())(logits)
    assert np64(value)[0] == float("inf") and np.isnan(np64(grad)[0]).any()
    np.testing.assert_allclose(np64(value)[1], np64(stock._mlx_cross_entropy(logits, targets))[1],
                               rtol=1e-6)


def test_a_users_own_replacement_stays():
    _run("import mlx.core as mx, mlx.nn as nn, fluxlike\n"
         "from fluxlike.precision import stock\n"
         "mine = lambda *a, **k: 'mine'\n"
         "nn.losses.cross_entropy = mine\n"
         "fluxlike.gradient(lambda x: (x * x).sum(), mx.ones(2))\n"
         "assert nn.losses.cross_entropy is mine\n"
         "assert mx.fast.scaled_dot_product_attention is stock.scaled_dot_product_attention\n")


def test_a_first_use_hook_that_raises_is_tried_again(monkeypatch):
    from fluxlike.precision import state
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("flaky")
        state.first_use()  # (a hook using fluxlike itself: not run again)

    monkeypatch.setattr(state.routing, "used", False)
    monkeypatch.setattr(state, "_first_use_hooks", [flaky])
    with pytest.raises(RuntimeError, match="flaky"):
        state.first_use()
    assert not state.routing.used
    state.first_use()
    assert state.routing.used and calls == [1, 1]
    state.first_use()
    assert calls == [1, 1]


def test_half_precision_upstream_calls_export_inside_native_disabled(tmp_path):
    # (fluxlike's primitives cannot be serialised: native.disabled() gives MLX's own)
    from fluxlike import native
    with autocast(mx.bfloat16):  # (fluxlike in use)
        pass
    q = mx.ones((1, 2, 16, 8), mx.bfloat16)

    def upstream(q):
        out = mx.fast.scaled_dot_product_attention(q, q, q, scale=0.3, mask="causal")
        logits = nn.silu(out).reshape(-1, 8)
        return nn.losses.cross_entropy(logits, mx.zeros((32,), mx.int32))

    if native.switch.loaded is None:
        pytest.skip("no native companion: half-precision attention is emulated, not exportable")
    with mx.stream(mx.cpu), native.disabled():
        mx.export_function(str(tmp_path / "upstream.mlxfn"), upstream, q)
        want = upstream(q)
    imported = mx.import_function(str(tmp_path / "upstream.mlxfn"))
    with mx.stream(mx.cpu):
        np.testing.assert_array_equal(np64(imported(q)[0]), np64(want))
