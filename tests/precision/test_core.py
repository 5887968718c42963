"""The precision core's contract: a down
layer's forward runs on the layer itself, so its writes persist; concurrent scopes stay
apart; fp32 blocks compute in float32; quantized layers and tied heads compute in the compute
dtype; ``autocast(dtype, enabled=False)`` takes any dtype; the stable log-sum-exp numerics; a
half ``init`` gives a bias of the weight's dtype; losses refuse complex input."""

import asyncio
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import fluxlike as fl
from fluxlike import autocast, autocast_policy, gradient
from fluxlike.losses import logitbinarycrossentropy, logitcrossentropy, mse

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
HALVES = [F16, BF16]


@autocast_policy("down")
class Stateful(nn.Module):
    """A user's layer whose forward writes to itself: a counter, a list, an array."""

    def __init__(self):
        super().__init__()
        self.weight = mx.ones((3, 3))
        self.u = mx.zeros((3,))
        self.calls = 0
        self.seen = []

    def __call__(self, x):
        self.calls += 1
        self.seen.append(x.dtype)
        self.u = self.u + 1  # a running vector (spectral norm's u, a running average)
        return x @ self.weight


@autocast_policy("down")
class ThreadedStateful(Stateful):
    """Evaluates what it writes: an array made lazily on one thread's stream cannot be
    evaluated on another's (MLX), so state shared by threads must be concrete."""

    def __call__(self, x):
        y = super().__call__(x)
        mx.eval(self.u)
        return y


class CountingDense(fl.Dense):
    def __call__(self, x):
        self.count = getattr(self, "count", 0) + 1
        return super().__call__(x)


class TestWritesPersist:
    @pytest.mark.parametrize("dtype", HALVES)
    def test_a_users_down_layer_keeps_every_write(self, dtype):
        layer = Stateful()
        with autocast(dtype, device="cpu"):
            for _ in range(3):
                assert layer(mx.ones((2, 3))).dtype == dtype
        assert layer.calls == 3 and layer.seen == [dtype] * 3
        assert layer.u.tolist() == [3.0, 3.0, 3.0] and layer.u.dtype == F32
        assert layer.weight.dtype == F32

    def test_writes_persist_under_gradient_too(self):
        layer = Stateful()
        gradient(lambda m: m(mx.ones((2, 3))).sum(), layer, autocast=BF16)
        assert layer.calls == 1 and layer.weight.dtype == F32

    def test_a_subclass_of_dense_writing_state(self):
        layer = CountingDense(3, 2)
        with autocast(BF16, device="cpu"):
            for _ in range(3):
                assert layer(mx.ones((1, 3))).dtype == BF16
        assert layer.count == 3 and layer.weight.dtype == F32

    def test_a_forward_that_raises_leaves_the_parameters_float32(self):
        @autocast_policy("down")
        class Fails(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = mx.ones((2,))

            def __call__(self, x):
                raise RuntimeError("boom")

        layer = Fails()
        with autocast(F16, device="cpu"), pytest.raises(RuntimeError, match="boom"):
            layer(mx.ones(2))
        assert layer.weight.dtype == F32


def _layers():
    return {
        "users": ThreadedStateful(),
        "Dense": fl.Dense(3, 3),
        "nn.Linear": nn.Linear(3, 3),
    }


SCOPES = [F16, BF16, None]  # None: no scope at all


def _call(layer, dtype, x):
    if dtype is None:
        y = layer(x)
    else:
        with autocast(dtype, device="cpu"):
            y = layer(x)
    mx.eval(y)
    return y.dtype


@pytest.mark.parametrize("name", ["users", "Dense", "nn.Linear"])
def test_threads_call_one_layer_under_different_scopes(name):
    layer = _layers()[name]
    x = mx.ones((2, 3))
    mx.eval(layer.parameters(), x)  # a lazy array belongs to its thread's stream
    expected = {F16: F16, BF16: BF16, None: F32}
    errors, start = [], threading.Barrier(len(SCOPES))

    def worker(dtype):
        try:
            with mx.stream(mx.new_stream(mx.cpu)):
                start.wait()
                for _ in range(50):
                    got = _call(layer, dtype, x)
                    if got != expected[dtype]:
                        errors.append((dtype, got))
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(d,)) for d in SCOPES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(v.dtype == F32 for _, v in tree_flatten(layer.parameters()))
    if name == "users":  # and every call's write is there, from every thread and scope
        assert layer.calls == 50 * len(SCOPES) and layer.u.tolist() == [150.0] * 3


@pytest.mark.parametrize("name", ["users", "Dense", "nn.Linear"])
def test_asyncio_tasks_call_one_layer_under_different_scopes(name):
    layer = _layers()[name]
    x = mx.ones((2, 3))

    async def task(dtype):
        got = []
        for _ in range(5):
            if dtype is None:
                got.append(layer(x).dtype)
            else:
                with autocast(dtype, device="cpu"):
                    await asyncio.sleep(0)  # the other tasks run inside this scope's lifetime
                    got.append(layer(x).dtype)
            await asyncio.sleep(0)
        return got

    async def main():
        return await asyncio.gather(*(task(d) for d in SCOPES))

    results = asyncio.run(main())
    assert results == [[F16] * 5, [BF16] * 5, [F32] * 5]
    assert all(v.dtype == F32 for _, v in tree_flatten(layer.parameters()))
    if name == "users":
        assert layer.calls == 15 and layer.u.tolist() == [15.0] * 3


class TestFp32Blocks:
    @pytest.mark.parametrize("dtype", HALVES)
    def test_a_block_computes_in_float32_with_autocast_off_inside(self, dtype):
        seen = []

        @autocast_policy("fp32")
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = fl.Chain(fl.Dense(4, 4), nn.Linear(4, 4))

            def __call__(self, x):
                seen.append((fl.autocast.is_enabled("cpu"), x.dtype))
                return self.inner(x)

        block, x = Block(), mx.ones((2, 4), dtype)
        with autocast(dtype, device="cpu"):
            out = block(x)
            assert fl.autocast.is_enabled("cpu")  # restored after the block
            after = fl.Dense(4, 4)(x)
        assert out.dtype == F32 and seen == [(False, F32)]
        assert after.dtype == dtype

    def test_a_half_result_of_an_fp32_block_is_returned_float32(self):
        @autocast_policy("fp32")
        class Half(nn.Module):
            def __call__(self, x):
                return x.astype(BF16), [x.astype(F16)]

        with autocast(BF16, device="cpu"):
            out, (other,) = Half()(mx.ones(2))
        assert out.dtype == F32 and other.dtype == F32


class TestQuantized:
    @pytest.mark.parametrize("dtype", HALVES)
    def test_quantized_linear_computes_in_the_compute_dtype(self, dtype):
        base = nn.Linear(64, 32)
        mx.eval(base.parameters())
        q = nn.QuantizedLinear.from_linear(base, group_size=32, bits=4)
        x = mx.random.normal((4, 64))
        plain = q(x)
        with autocast(dtype, device="cpu"):
            half = q(x)
        assert plain.dtype == F32 and half.dtype == dtype
        assert not mx.array_equal(half.astype(F32), plain).item()  # not a silent no-op
        np.testing.assert_allclose(np.array(half.astype(F32)), np.array(plain),
                                   atol=0.1, rtol=0.05)
        assert q.scales.dtype == F32  # master copies untouched

    def test_quantized_model_trains_differently_under_autocast(self):
        """A QLoRA-style input gradient through the quantized base: bfloat16 under autocast,
        not bitwise the float32 one."""
        base = nn.Linear(32, 8)
        mx.eval(base.parameters())
        q = nn.QuantizedLinear.from_linear(base, group_size=32, bits=8)
        x = mx.random.normal((4, 32))

        def loss(x):
            return q(x).astype(F32).sum()

        g32 = mx.grad(loss)(x)
        with autocast(BF16, device="cpu"):
            g16 = mx.grad(loss)(x)
        assert g32.dtype == g16.dtype == F32
        assert not mx.array_equal(g32, g16).item()
        np.testing.assert_allclose(np.array(g16), np.array(g32), atol=0.05, rtol=0.05)

    @pytest.mark.parametrize("dtype", HALVES)
    def test_quantized_embedding_head_and_lookup(self, dtype):
        emb = nn.Embedding(64, 32)
        mx.eval(emb.parameters())
        q = nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=4)
        h = mx.random.normal((2, 5, 32))
        with autocast(dtype, device="cpu"):
            assert q.as_linear(h).dtype == dtype  # the tied head in the compute dtype
            assert q(mx.array([[1, 2]])).dtype == F32  # the lookup, as Embedding
        assert q.as_linear(h).dtype == F32


class TestTiedHeads:
    @pytest.mark.parametrize("dtype", HALVES)
    def test_embedding_as_linear_computes_in_the_compute_dtype(self, dtype):
        emb = nn.Embedding(50, 16)
        h = mx.random.normal((2, 3, 16))
        reference = emb.as_linear(h)
        with autocast(dtype, device="cpu"):
            logits = emb.as_linear(h)
            assert emb(mx.array([1, 2])).dtype == F32
        assert logits.dtype == dtype and logits.shape == (2, 3, 50)
        np.testing.assert_allclose(np.array(logits.astype(F32)), np.array(reference),
                                   atol=0.15, rtol=0.05)

    def test_tied_head_gradient_reaches_the_float32_table(self):
        class TiedLM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(20, 8)

            def __call__(self, tokens):
                return self.embed.as_linear(self.embed(tokens))

        model = TiedLM()
        tokens = mx.array([[1, 2, 3]])
        (g,) = gradient(lambda m: m(tokens).astype(F32).sum(), model, autocast=BF16)
        assert g["embed"]["weight"].dtype == F32
        assert model.embed.weight.dtype == F32

    def test_fluxlike_embedding_as_linear(self):
        emb = fl.Embedding(10, 4)
        h = mx.ones((3, 4))
        with autocast(BF16, device="cpu"):
            assert emb.as_linear(h).dtype == BF16
        assert emb.as_linear(h).dtype == F32
        np.testing.assert_allclose(np.array(emb.as_linear(h)), np.array(h @ emb.weight.T),
                                   rtol=1e-6)


class TestDisabledScopes:
    @pytest.mark.parametrize("dtype", [F32, mx.float64, F16, BF16, mx.int32])
    def test_enabled_false_takes_any_dtype(self, dtype):
        layer = fl.Dense(2, 2)
        with autocast(dtype, enabled=False):
            assert layer(mx.ones((1, 2))).dtype == F32
            assert not fl.autocast.is_enabled()

    def test_the_config_idiom(self):
        class Config:
            dtype, amp = F32, False

        cfg = Config()
        with autocast(cfg.dtype, enabled=cfg.amp):
            assert fl.Dense(2, 2)(mx.ones((1, 2))).dtype == F32

    def test_enabled_float32_names_the_dtypes_and_suggests_enabled_false(self):
        with pytest.raises(ValueError, match=r"mx\.float16 or mx\.bfloat16.*enabled=False"):
            autocast(F32)


def _lse64(x, axis=-1):
    x = np.asarray(x, np.float64)
    m = x.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def _rel(actual, expected):
    actual = np.asarray(actual, np.float64)
    return np.max(np.abs(actual - expected) / np.maximum(np.abs(expected), 1e-30))


MAGNITUDES = [1.0, 1e3, 1e4, 1e5]


class TestStableLogSumExp:
    @pytest.mark.parametrize("scale", MAGNITUDES)
    @pytest.mark.parametrize("path", ["float32", "float16", "bfloat16", "autocast"])
    def test_logsoftmax_and_losses_within_1e6_of_float64(self, scale, path):
        # Rows whose results are of order one (a result made of one exp term is only as exact
        # as MLX's float32 exp, about 5e-7 relative, up to 4e-6), at +-scale: the error must
        # not grow with the logits' size.
        offsets = np.array([[0.0, 0.0], [0.0, 0.5], [0.0, -1.0], [1.0, 2.5]])
        base = np.concatenate([offsets + scale, offsets - scale])
        if path in ("float16", "bfloat16"):  # the inputs such a path can hold exactly
            dtype = getattr(mx, path)
            base = np.array(mx.array(base, F32).astype(dtype).astype(F32))
            if not np.all(np.isfinite(base)):
                pytest.skip(f"{scale:g} does not fit in {path}")
            x = mx.array(base, F32).astype(dtype)
        else:
            x = mx.array(base, F32)
            base = np.array(x).astype(np.float64)
        lse = _lse64(base)
        exact = base - lse[:, None]
        y = mx.array([0, 1, 0, 1, 1, 0, 1, 0])
        if path == "autocast":
            with autocast(BF16, device="cpu"):
                got = (fl.logsoftmax(x), logitcrossentropy(x, y, agg="none"),
                       fl.logsumexp(x))
        else:
            got = (fl.logsoftmax(x), logitcrossentropy(x, y, agg="none"), fl.logsumexp(x))
        expected_ce = -exact[np.arange(8), np.array(y)]
        # Computed in float32 in every path; outside a scope logsoftmax and logsumexp return
        # half input's dtype (their one rounding), the losses float32.
        # Half inputs round the offsets (1000 + 2.5 is 1004 in bfloat16): a row may then
        # hold a loss of one exp term, as exact as MLX's float32 exp (up to 4e-6).
        full = path in ("float32", "autocast")
        out = 1e-6 if full else float(mx.finfo(x.dtype).eps)
        assert _rel(np.array(got[0].astype(F32)), exact) <= out
        assert _rel(np.array(got[1]), expected_ce) <= (1e-6 if full else 4e-6)
        assert _rel(np.array(got[2].astype(F32)), lse) <= out

    @pytest.mark.parametrize("scale", MAGNITUDES)
    def test_logitcrossentropy_with_probabilities(self, scale):
        x = mx.array([[scale, scale], [-scale, -scale + 1.0]])
        p = mx.array([[0.5, 0.5], [0.25, 0.75]])
        base = np.array(x).astype(np.float64)
        expected = -(np.array(p) * (base - _lse64(base)[:, None])).sum(-1)
        assert _rel(np.array(logitcrossentropy(x, p, agg="none")), expected) <= 1e-6

    def test_large_equal_logits_give_log_2(self):
        assert fl.logsoftmax(mx.array([-1e5, -1e5])).tolist() == pytest.approx(
            [-0.6931472] * 2, rel=1e-6)
        assert logitcrossentropy(mx.array([[1e5, 1e5]]), mx.array([0])).item() == pytest.approx(
            0.6931472, rel=1e-6)

    @pytest.mark.parametrize("x", [-1e5, -30.0, -20.0, 0.0, 20.0, 1e5])
    @pytest.mark.parametrize("y", [0.0, 0.3, 1.0])
    def test_logitbinarycrossentropy(self, x, y):
        # (1 - y) * x + log(1 + exp(-x)) gave 0 for x = -20, y = 0 (exact: 2.1e-9). A loss
        # of one exp term is as exact as MLX's float32 exp (up to 4e-6 relative).
        exact = y * np.logaddexp(0, -x) + (1 - y) * np.logaddexp(0, x)
        got = logitbinarycrossentropy(mx.array([x]), mx.array([y])).item()
        assert abs(got - exact) <= 4e-6 * abs(exact) + 1e-30

    def test_gradient_at_zero_logits(self):
        g = mx.grad(lambda z: logitbinarycrossentropy(z, mx.array([1.0, 0.0]), agg="sum"))(
            mx.zeros(2))
        assert g.tolist() == pytest.approx([-0.5, 0.5])

    def test_a_row_of_minus_infinity_stays_finite_where_defined(self):
        x = mx.array([[-float("inf"), 0.0]])
        assert fl.logsoftmax(x).tolist() == [[-float("inf"), 0.0]]


class TestSmallOnes:
    @pytest.mark.parametrize("loss", [mse, fl.losses.mae, logitcrossentropy])
    def test_losses_refuse_complex_input(self, loss):
        z = mx.array([1 + 2j, 3 - 1j])
        with pytest.raises(TypeError, match="complex|real"):
            loss(z, mx.array([1.0, 2.0]))
        with pytest.raises(TypeError, match="complex|real"):
            loss(mx.array([1.0, 2.0]), z)

    @pytest.mark.parametrize("make", [
        lambda init: fl.Dense(3, 2, init=init),
        lambda init: fl.Bilinear(3, 3, 2, init=init),
        lambda init: fl.Conv((3,), 3, 2, init=init),
        lambda init: fl.ConvTranspose((3,), 3, 2, init=init),
        lambda init: fl.RNNCell(3, 2, init=init),
        lambda init: fl.LSTM(3, 2, init=init),
        lambda init: fl.Scale(3, init=init),
    ])
    @pytest.mark.parametrize("dtype", HALVES)
    def test_a_half_init_gives_a_bias_of_the_weights_dtype(self, make, dtype):
        layer = make(lambda shape: mx.random.normal(shape).astype(dtype))
        arrays = dict(tree_flatten(layer.parameters()))
        assert {a.dtype for a in arrays.values()} == {dtype}, arrays.keys()


def test_keep_float32_on_a_subclass_with_its_own_forward_keeps_it_cast_around():
    """keep_float32 alone does not make a Dense subclass's own raw forward 'cast at the ops'."""

    @fl.keep_float32
    class Raw(fl.Dense):
        def __call__(self, x):
            return x @ self.weight.T  # raw MLX: needs its parameters swapped to the half casts

    layer = Raw(3, 2)
    with autocast(BF16, device="cpu"):
        assert layer(mx.ones((1, 3))).dtype == BF16
    assert fl.f16mix(layer).weight.dtype == F32
