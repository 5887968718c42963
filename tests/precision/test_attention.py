"""The core of attention (fluxlike/precision/attention.py: attend) against float64 numpy and
MLX's fused ``scaled_dot_product_attention``: float32 (MLX's fused kernel) and bfloat16 on the
CPU (the scores, softmax and weighted sum through fluxlike's kernels: oneDNN's where the native
companion is in use), with causal, boolean and additive masks and grouped queries."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from native_helpers import DTYPES, np64, rand

from fluxlike.precision.attention import attend


def _attend(q, k, v, *, scale, mask=None):
    """``attend`` with grouped queries' keys and values repeated over each group's heads."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = mx.repeat(k, groups, axis=1), mx.repeat(v, groups, axis=1)
    return attend(q, k, v, scale, mask)[0]


ATTENTION_CASES = [  # q shape, kv heads, L_k, mask
    ((2, 4, 16, 8), 4, 16, None),
    ((2, 4, 16, 8), 4, 16, "causal"),
    ((1, 8, 5, 16), 2, 9, "causal"),   # grouped queries, L_q < L_k
    ((2, 2, 7, 8), 2, 7, "bool"),
    ((2, 2, 7, 8), 1, 11, "additive"),
]


def _attention_inputs(case, dtype):
    qs, hkv, lk, kind = case
    q = rand(qs, dtype)
    k = rand((qs[0], hkv, lk, qs[3]), dtype)
    v = rand((qs[0], hkv, lk, qs[3] + 2), dtype)
    mask = kind
    if kind == "bool":
        mask = mx.random.uniform(shape=(qs[2], lk)) > 0.3
        mask = mx.logical_or(mask, mx.arange(lk)[None] == 0)  # every row attends somewhere
    elif kind == "additive":
        mask = rand((qs[0], 1, qs[2], lk)).astype(dtype)
    return q, k, v, mask


def _np_attention(q, k, v, mask, scale):
    q64, k64, v64 = np64(q), np64(k), np64(v)
    groups = q64.shape[1] // k64.shape[1]
    k64, v64 = np.repeat(k64, groups, axis=1), np.repeat(v64, groups, axis=1)
    s = q64 @ k64.swapaxes(-1, -2) * scale
    lq, lk = s.shape[-2:]
    if isinstance(mask, str):
        s = np.where(np.arange(lk)[None] <= np.arange(lq)[:, None] + lk - lq, s, -np.inf)
    elif mask is not None:
        s = np.where(np.array(mask), s, -np.inf) if mask.dtype == mx.bool_ else s + np64(mask)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return p @ v64


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0]}/{c[1]}/{c[3]}")
def test_attention_against_float64_and_mlx(dtype, case):
    q, k, v, mask = _attention_inputs(case, dtype)
    scale = q.shape[-1] ** -0.5
    y = _attend(q, k, v, scale=scale, mask=mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    assert y.dtype == theirs.dtype == dtype and y.shape == theirs.shape
    exact = _np_attention(q, k, v, mask, scale)
    tol = 2e-5 if dtype == mx.float32 else 3e-2  # bf16: probabilities rounded, then product
    np.testing.assert_allclose(np64(y), exact, rtol=tol, atol=tol)
    np.testing.assert_allclose(np64(y), np64(theirs), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0]}/{c[1]}/{c[3]}")
def test_attention_gradients_against_mlx(case):
    q, k, v, mask = _attention_inputs(case, mx.float32)
    c = rand((*q.shape[:3], v.shape[-1]))

    def loss(f):
        return lambda q, k, v: (f(q, k, v, scale=0.3, mask=mask) * c).sum()

    mine = mx.grad(loss(_attend), argnums=(0, 1, 2))(q, k, v)
    theirs = mx.grad(loss(mx.fast.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for g, h, p in zip(mine, theirs, (q, k, v), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
        np.testing.assert_allclose(np.array(g), np.array(h), rtol=1e-4, atol=1e-4)


def test_attention_bfloat16_training_inside_compile():
    q, k, v, _ = _attention_inputs(ATTENTION_CASES[1], mx.bfloat16)

    def loss(q, k, v):
        return _attend(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal").astype(mx.float32).sum()

    g = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    h = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for gi, hi, p in zip(g, h, (q, k, v), strict=True):
        assert gi.dtype == mx.bfloat16 and gi.shape == p.shape
        np.testing.assert_allclose(np64(gi), np64(hi), rtol=1e-2, atol=1e-2)
