import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import check_layer_gradients, np64, snapshot
from mlx.utils import tree_flatten

import fluxlike
import fluxlike.precision.attention
from fluxlike import Dense, MultiHeadAttention
from fluxlike.modes import differentiating
from fluxlike.precision import kernels, operands


def randomise_biases(mha: MultiHeadAttention) -> MultiHeadAttention:
    for proj in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
        if proj.bias is not None:
            proj.bias = 0.3 * mx.random.normal(proj.bias.shape)
    return mha


def np_softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_mha(mha, q, k, v, mask=None):
    """Project, split heads, scaled dot product with the mask, softmax, merge, out-project."""

    def proj(dense, x):
        bias = np64(dense.bias) if dense.bias is not None else 0.0
        return x @ np64(dense.weight).T + bias

    Q, K, V = proj(mha.q_proj, q), proj(mha.k_proj, k), proj(mha.v_proj, v)
    batch, lq, dims = Q.shape
    lk, H = K.shape[1], mha.nheads

    def split(X):
        return X.reshape(batch, -1, H, dims // H).transpose(0, 2, 1, 3)

    scores = split(Q) @ split(K).transpose(0, 1, 3, 2) / math.sqrt(dims // H)
    if isinstance(mask, str):  # causal, the last query aligned with the last key
        allowed = np.tril(np.ones((lq, lk), dtype=bool), k=lk - lq)
        scores = np.where(allowed, scores, -np.inf)
    elif mask is not None and mask.dtype == bool:
        scores = np.where(mask, scores, -np.inf)
    elif mask is not None:
        scores = scores + mask
    weights = np_softmax(scores)
    out = (weights @ split(V)).transpose(0, 2, 1, 3).reshape(batch, lq, dims)
    return proj(mha.out_proj, out), weights


def random_bool_mask(shape, seed=0):
    """A random boolean mask in which every query row attends at least one key."""
    mask = np.random.default_rng(seed).random(shape) < 0.6
    mask[..., 0] = True
    return mask


class Call(nn.Module):
    """check_layer_gradients calls ``layer(*arrays)``: this fixes the keyword arguments."""

    def __init__(self, layer, **kwargs):
        super().__init__()
        self.layer = layer
        self.fn = lambda m, *args: m(*args, **kwargs)  # a function, not a parameter

    def __call__(self, *args):
        return self.fn(self.layer, *args)


class TestMultiHeadAttention:
    def test_construction_positional_and_keyword(self):
        a = MultiHeadAttention(8, 2)
        b = MultiHeadAttention(dims=8, nheads=4, bias=True, dropout=0.1, kdims=3, vdims=5)
        assert a.nheads == 2 and b.nheads == 4 and b.dropout == 0.1 and a.active is None
        for mha in (a, b):
            assert all(isinstance(p, Dense) for p in (mha.q_proj, mha.k_proj, mha.v_proj,
                                                       mha.out_proj))
        assert a.q_proj.bias is None and b.q_proj.bias.shape == (8,)
        assert b.k_proj.weight.shape == (8, 3) and b.v_proj.weight.shape == (8, 5)
        assert b.out_proj.weight.shape == (8, 8)
        assert set(a.parameters()) == {"q_proj", "k_proj", "v_proj", "out_proj"}

    @pytest.mark.parametrize("mask", [None, "causal"])
    def test_self_attention_matches_numpy(self, mask):
        mha = randomise_biases(MultiHeadAttention(8, 2, bias=True))
        x = mx.random.normal((2, 5, 8))
        out = mha(x, mask=mask)
        expected, _ = np_mha(mha, np64(x), np64(x), np64(x), mask)
        assert out.shape == (2, 5, 8) and out.dtype == mx.float32
        np.testing.assert_allclose(np64(out), expected, rtol=1e-4, atol=1e-5)

    def test_causal_mask_blocks_the_future(self):
        mha = MultiHeadAttention(8, 2)
        x = mx.random.normal((1, 5, 8))
        changed = mx.concatenate([x[:, :3], mx.random.normal((1, 2, 8))], axis=1)
        a, b = mha(x, mask="causal"), mha(changed, mask="causal")
        np.testing.assert_allclose(np64(a[:, :3]), np64(b[:, :3]), rtol=1e-5, atol=1e-6)
        assert not np.allclose(np64(a[:, 3:]), np64(b[:, 3:]))

    def test_cross_attention_boolean_mask_matches_numpy(self):
        mha = randomise_biases(MultiHeadAttention(8, 4, bias=True, kdims=3, vdims=6))
        q, k = mx.random.normal((2, 4, 8)), mx.random.normal((2, 7, 3))
        v = mx.random.normal((2, 7, 6))
        mask = random_bool_mask((2, 1, 4, 7))
        out = mha(q, k, v, mask=mx.array(mask))
        expected, _ = np_mha(mha, np64(q), np64(k), np64(v), mask)
        assert out.shape == (2, 4, 8)
        np.testing.assert_allclose(np64(out), expected, rtol=1e-4, atol=1e-5)

    def test_additive_mask_and_value_defaults_to_key(self):
        mha = MultiHeadAttention(8, 2)
        q, k = mx.random.normal((2, 3, 8)), mx.random.normal((2, 6, 8))
        mask = np.random.default_rng(1).normal(size=(3, 6))
        out = mha(q, k, mask=mx.array(mask, dtype=mx.float32))
        expected, _ = np_mha(mha, np64(q), np64(k), np64(k), mask)
        np.testing.assert_allclose(np64(out), expected, rtol=1e-4, atol=1e-5)

    @pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
    def test_weights_path_matches_fused_and_numpy(self, mask):
        # Lq < Lk, so "causal" exercises the lower-right alignment in both paths.
        mha = MultiHeadAttention(8, 2)
        q, k = mx.random.normal((2, 3, 8)), mx.random.normal((2, 5, 8))
        if mask == "bool":
            mask = random_bool_mask((3, 5))
        elif mask == "additive":
            mask = np.random.default_rng(2).normal(size=(2, 1, 1, 5))
        given = mx.array(mask) if isinstance(mask, np.ndarray) else mask
        fused = mha(q, k, mask=given)
        out, weights = mha(q, k, mask=given, return_weights=True)
        expected, expected_weights = np_mha(mha, np64(q), np64(k), np64(k), mask)
        assert weights.shape == (2, 2, 3, 5)
        np.testing.assert_allclose(np64(out), np64(fused), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np64(out), expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np64(weights), expected_weights, rtol=1e-4, atol=1e-6)

    def test_dropout_only_when_active(self):
        mha = MultiHeadAttention(8, 2, dropout=0.5)
        x = mx.random.normal((2, 6, 8))
        plain = np64(mha(x))  # automatic mode, outside a gradient: inactive
        reference, _ = np_mha(mha, np64(x), np64(x), np64(x))
        np.testing.assert_allclose(plain, reference, rtol=1e-4, atol=1e-5)
        fluxlike.trainmode(mha)
        out, weights = mha(x, return_weights=True)
        w = np64(weights)
        kept = w[w != 0]
        assert 0 < kept.size < w.size  # some weights dropped, some kept
        # the kept weights are the softmax weights scaled by 1 / (1 - p)
        _, exact = np_mha(mha, np64(x), np64(x), np64(x))
        np.testing.assert_allclose(kept, 2 * exact[w != 0], rtol=1e-4)
        assert not np.allclose(np64(out), reference)
        fluxlike.testmode(mha)
        np.testing.assert_allclose(np64(mha(x)), reference, rtol=1e-4, atol=1e-5)
        fluxlike.trainmode(mha, "auto")
        with differentiating():
            assert not np.allclose(np64(mha(x)), reference)

    @pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
    def test_gradients_float64(self, mask):
        if mask == "bool":
            mask = mx.array(random_bool_mask((1, 4, 4)))
        elif mask == "additive":
            mask = mx.random.normal((4, 4))
        mha = randomise_biases(MultiHeadAttention(4, 2, bias=True))
        x = mx.random.normal((2, 4, 4))
        check_layer_gradients(Call(mha, mask=mask), x)

    def test_gradients_float64_cross_attention(self):
        mha = MultiHeadAttention(4, 2, kdims=3, vdims=2)
        q, k = mx.random.normal((2, 3, 4)), mx.random.normal((2, 5, 3))
        v = mx.random.normal((2, 5, 2))
        check_layer_gradients(Call(mha, mask="causal"), q, k, v)

    def test_repr(self):
        assert repr(MultiHeadAttention(64, 8)) == \
            "MultiHeadAttention(64, nheads=8)  # 16_384 parameters"
        assert repr(MultiHeadAttention(8, 2, bias=True, dropout=0.1, kdims=3, vdims=4)) == \
            "MultiHeadAttention(8, nheads=2, bias=True, dropout=0.1, kdims=3, vdims=4)" \
            "  # 216 parameters"

    @pytest.mark.parametrize("dtype", [None, mx.float16, mx.bfloat16])
    @pytest.mark.parametrize("block", [-1e9, -math.inf])
    def test_fully_blocked_row_averages_instead_of_nan(self, dtype, block):
        # a padded-away sample: every key blocked. -1e9 is -inf in float16 once autocast
        # casts the mask; a boolean mask averages such a row, the additive one must too
        mha = MultiHeadAttention(8, 2)
        q = mx.random.normal((2, 3, 8))
        keep = mx.array([[True, True, False], [False, False, False]])[:, None, None, :]
        additive = mx.where(keep, 0.0, block)
        with fluxlike.autocast(dtype, device="cpu", enabled=dtype is not None):
            out, by_bool = mha(q, mask=additive), mha(q, mask=keep)
            grads = mx.grad(lambda q: mha(q, mask=additive).astype(mx.float32).sum())(q)
        assert not mx.isnan(out).any() and not mx.isnan(grads).any()
        np.testing.assert_allclose(np64(out), np64(by_bool), atol=1e-2)

    @pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
    def test_autocast_bfloat16(self, mask):
        mha = MultiHeadAttention(8, 2, bias=True)
        x = mx.random.normal((2, 5, 8))
        if mask == "bool":
            mask = mx.array(random_bool_mask((5, 5)))
        elif mask == "additive":
            mask = mx.random.normal((5, 5))
        reference = mha(x, mask=mask)
        with fluxlike.autocast(mx.bfloat16, device="cpu"):
            out = mha(x, mask=mask)
            _, weights = mha(x, mask=mask, return_weights=True)
        assert out.dtype == weights.dtype == mx.bfloat16
        assert all(p.dtype == mx.float32 for _, p in tree_flatten(mha.parameters()))
        np.testing.assert_allclose(np64(out), np64(reference), atol=5e-2)

    @pytest.mark.parametrize("mask", [None, "causal", "additive"])
    def test_cpu_half_core_runs_float32_kernels_and_agrees_with_sdpa(self, mask, monkeypatch):
        # On the CPU, sdpa on half operands is MLX's scalar half GEMM; the core takes
        # kernels.matmul (float32 kernels, same roundings) instead, within bf16 rounding of sdpa.
        mha = MultiHeadAttention(8, 2)
        x = mx.random.normal((2, 5, 8))
        mask = mx.random.normal((5, 5)) if mask == "additive" else mask
        sdpa = mx.fast.scaled_dot_product_attention
        calls = []
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                            lambda *a, **k: calls.append(1) or sdpa(*a, **k))
        with fluxlike.autocast(mx.bfloat16, device="cpu"):
            routed = mha(x, mask=mask)
        assert calls == []

        # nothing counts as half precision on the CPU: sdpa on bfloat16
        monkeypatch.setattr(operands, "half_on_cpu", lambda *a: False)
        with fluxlike.autocast(mx.bfloat16, device="cpu"):
            native = mha(x, mask=mask)
        assert calls == [1]
        assert routed.dtype == native.dtype == mx.bfloat16
        np.testing.assert_allclose(np64(routed), np64(native), atol=3e-2)
        mha(x, mask=mask)  # float32: sdpa, unless the native softmax takes the scores
        native_scores = kernels.choose("softmax", mx.float32, x) == kernels.NATIVE
        assert calls == ([1] if native_scores else [1, 1])

    def test_autocast_gradients_are_float32(self):
        mha = MultiHeadAttention(8, 2)
        x = mx.random.normal((2, 5, 8))

        def loss(params):
            mha.update(params)
            return mha(x, mask="causal").astype(mx.float32).sum()

        with fluxlike.autocast(mx.bfloat16, device="cpu"):
            grads = mx.grad(loss)(mha.trainable_parameters())
        assert all(g.dtype == mx.float32 for _, g in tree_flatten(grads))

    def test_dims_not_divisible_by_nheads(self):
        with pytest.raises(ValueError, match=r"\[MultiHeadAttention\] dims=10 .* nheads=4"):
            MultiHeadAttention(10, 4)

    @pytest.mark.parametrize("kwargs", [{"dropout": 1.0}, {"dropout": -0.1}, {"kdims": 0}])
    def test_bad_construction(self, kwargs):
        with pytest.raises(ValueError, match=r"\[MultiHeadAttention\]"):
            MultiHeadAttention(8, 2, **kwargs)

    def test_bad_input_clear_errors_model_unchanged(self):
        mha = MultiHeadAttention(8, 2, kdims=3, vdims=6)
        before = snapshot(mha)
        q, k, v = mx.ones((2, 4, 8)), mx.ones((2, 5, 3)), mx.ones((2, 5, 6))
        cases = [
            ((mx.ones((2, 4, 7)), k, v), {}, ValueError,
             r"expected query of shape \(batch, length, 8\), got shape \(2, 4, 7\)"),
            ((q, mx.ones((2, 5, 8)), v), {}, ValueError, r"expected key of shape .*, 3\)"),
            ((q, k), {}, ValueError, r"expected value of shape \(batch, length, 6\), got .*3\)"),
            ((mx.ones((4, 8)), k, v), {}, ValueError, r"expected query of shape"),
            ((np.ones((2, 4, 8)), k, v), {}, TypeError, r"expected an mx.array query"),
            ((mx.ones((2, 4, 8), mx.int32), k, v), {}, TypeError,
             r"expected a floating-point query, got mlx.core.int32"),
            ((q, k, mx.ones((2, 5, 6), mx.bool_)), {}, TypeError,
             r"expected a floating-point value"),
            ((q, mx.ones((2, 0, 3)), mx.ones((2, 0, 6))), {}, ValueError,
             r"expected a key of length at least 1, got shape \(2, 0, 3\)"),
            ((mx.ones((2, 0, 8)), k, v), {}, ValueError,
             r"expected a query of length at least 1, got shape \(2, 0, 8\)"),
            ((q, mx.ones((3, 5, 3)), mx.ones((3, 5, 6))), {}, ValueError, r"one batch size"),
            ((q, k, mx.ones((2, 6, 6))), {}, ValueError, r"key and value must have one length"),
            ((q, k, v), {"mask": mx.ones((4, 4), dtype=mx.bool_)}, ValueError,
             r"mask of shape \(4, 4\) does not broadcast to \(batch, nheads, Lq, Lk\) = "
             r"\(2, 2, 4, 5\)"),
            ((q, k, v), {"mask": mx.ones((1, 1, 1, 1, 5))}, ValueError, r"does not broadcast"),
            ((q, k, v), {"mask": mx.ones((4, 5), dtype=mx.int32)}, TypeError,
             r"boolean .* or floating"),
            ((q, k, v), {"mask": "causl"}, ValueError, r"the only mask name is 'causal'"),
            ((q, k, v), {"mask": [[True]]}, TypeError,
             r"mask must be None, 'causal' or an mx.array"),
        ]
        for args, kwargs, error, message in cases:
            with pytest.raises(error, match=r"\[MultiHeadAttention\] (.* )?" + message):
                mha(*args, **kwargs)
        after = snapshot(mha)
        assert after.keys() == before.keys()
        for name in before:
            np.testing.assert_array_equal(after[name], before[name])


def test_numpy_numbers_are_stored_as_python_numbers():
    mha = MultiHeadAttention(np.int64(8), np.int32(2), dropout=np.float32(0.25),
                             kdims=np.int64(3), vdims=np.uint8(4))
    assert type(mha.nheads) is int and type(mha.dropout) is float
    assert repr(mha) == "MultiHeadAttention(8, nheads=2, dropout=0.25, kdims=3, vdims=4)" \
                        "  # 184 parameters"
    assert mha(mx.ones((1, 2, 8)), mx.ones((1, 3, 3)), mx.ones((1, 3, 4))).shape == (1, 2, 8)
    for bad in (True, np.bool_(True)):
        with pytest.raises(ValueError, match=r"\[MultiHeadAttention\] nheads must be a positive"):
            MultiHeadAttention(8, bad)
        with pytest.raises(ValueError, match=r"\[MultiHeadAttention\] dropout must be a "
                                             r"probability in \[0, 1\)"):
            MultiHeadAttention(8, 2, dropout=bad)


def test_bias_must_be_a_bool():
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match=rf"^\[MultiHeadAttention\] bias must be True or "
                                            rf"False, got {bad!r}$"):
            MultiHeadAttention(8, 2, bias=bad)
    assert MultiHeadAttention(8, 2, bias=np.bool_(True)).q_proj.bias is not None


def test_init_errors_name_the_attention_layer():
    with pytest.raises(ValueError, match=r"^\[MultiHeadAttention\] init returned shape "
                                         r"\(1, 1\), expected \(8, 8\)$"):
        MultiHeadAttention(8, 2, init=lambda s: mx.ones((1, 1)))
    with pytest.raises(TypeError, match=r"\[MultiHeadAttention\] init must be a function"):
        MultiHeadAttention(8, 2, init="glorot")
    mha = MultiHeadAttention(4, 2, init=mx.ones)
    assert np64(mha.k_proj.weight).tolist() == [[1.0] * 4] * 4


def test_active_keyword_like_dropout():
    x = mx.random.normal((2, 6, 8))
    on = MultiHeadAttention(8, 2, dropout=0.5, active=True)
    assert on.active is True
    assert repr(on) == "MultiHeadAttention(8, nheads=2, dropout=0.5, active=True)" \
                       "  # 256 parameters"
    _, weights = on(x, return_weights=True)  # outside a gradient, but fixed active
    assert (np64(weights) == 0).any()
    off = MultiHeadAttention(8, 2, dropout=0.5, active=np.bool_(False))
    assert off.active is False and repr(off).split("  #")[0].endswith("active=False)")
    with differentiating():
        _, weights = off(x, return_weights=True)
    assert not (np64(weights) == 0).any()
    assert MultiHeadAttention(8, 2).active is None
    with pytest.raises(ValueError, match=r"\[MultiHeadAttention\] active must be True, False "
                                         r"or None, got 'yes'"):
        MultiHeadAttention(8, 2, active="yes")


@pytest.mark.parametrize("dtype", [None, mx.bfloat16])
def test_an_empty_batch_gives_an_empty_result(dtype):
    mha = MultiHeadAttention(8, 2)
    x = mx.ones((0, 5, 8))
    if dtype is None:
        out, weights = mha(x, return_weights=True)
        assert weights.shape == (0, 2, 5, 5)
    else:
        with fluxlike.autocast(dtype, device="cpu"):
            out = mha(x, mask="causal")
    assert out.shape == (0, 5, 8)
