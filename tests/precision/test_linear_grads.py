"""The float32/float64 linear kernels' backward pass under fluxlike's differentiation
(fluxlike/precision/kernels.py): the same gradients as MLX's own, with the weight gradient
in the parameter's (row-major) layout, which the optimiser's elementwise ops walk fastest."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import normal

from fluxlike import Dense, bf16mix, gradient
from fluxlike.modes import differentiating
from fluxlike.precision import emulation, kernels


def row_major(a: mx.array) -> bool:
    strides = memoryview(a).strides
    return list(strides) == sorted(strides, reverse=True)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float64])
@pytest.mark.parametrize("shape", [(4,), (5, 4), (2, 3, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_same_gradients_as_mlx_with_a_row_major_weight_gradient(dtype, shape, bias):
    x, weight = normal(*shape).astype(dtype), normal(3, 4, seed=1).astype(dtype)
    b = normal(3, seed=2).astype(dtype) if bias else None
    dy = normal(*shape[:-1], 3, seed=3).astype(dtype)

    def plain(x, w, *b):
        return (mx.addmm(b[0], x, w.T) if b else x @ w.T) * dy

    def routed(x, w, *b):
        with differentiating():
            return kernels.linear(x, w, *b) * dy

    args = (x, weight, b) if bias else (x, weight)
    argnums = tuple(range(len(args)))
    expected = mx.grad(lambda *a: plain(*a).sum(), argnums=argnums)(*args)
    grads = mx.grad(lambda *a: routed(*a).sum(), argnums=argnums)(*args)
    assert not row_major(expected[1])  # what MLX gives: the reason for the custom backward
    assert row_major(grads[1])
    for g, e in zip(grads, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(np.array(g), np.array(e), rtol=1e-5 if dtype == mx.float32
                                   else 1e-12)


def test_dense_gradient_is_row_major():
    layer, x = Dense(4, 3), normal(8, 4)
    (grads,) = gradient(lambda m: m(x).sum(), layer)
    assert row_major(grads["weight"])


@pytest.mark.parametrize("rows", [8, 3000])  # one block, and ops' row blocks
@pytest.mark.parametrize("mix", [False, True])
def test_cpu_half_weight_gradient_is_row_major(rows, mix, monkeypatch):
    monkeypatch.setattr(emulation, "CHUNK_BYTES", 4096)  # row blocks from small shapes
    layer, x = Dense(16, 8), normal(rows, 16)
    mx.eval(layer.parameters())
    if mix:
        (grads,) = gradient(lambda m: m(x).astype(mx.float32).sum(), bf16mix(layer))
    else:
        (grads,) = gradient(lambda m: m(x).astype(mx.float32).sum(), layer,
                            autocast=mx.bfloat16)
    assert grads["weight"].dtype == (mx.bfloat16 if mix else mx.float32)
    assert row_major(grads["weight"])
