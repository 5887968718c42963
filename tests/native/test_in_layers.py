"""The native kernels as fluxlike's layers use them: switched off for a block
(fluxlike.native.disabled), in training, under mx.vmap, and in exported functions.

Without the extension these tests skip with the reason ``native_info()`` gives. To run them
as if it were absent: ``FLUXLIKE_NATIVE=0 python -m pytest -q tests/native``.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest
from native_helpers import (
    INFO,
    needs_f16_kernels,
    needs_native,
    np64,
)

from fluxlike import native
from fluxlike.activations import relu


def _cnn():
    import fluxlike as fl

    mx.random.seed(3)
    return fl.Chain(fl.Conv((3, 3), 1, 8, relu, padding=1), fl.MaxPool((2, 2)),
                    fl.Conv((3, 3), 8, 16, relu, padding=1), fl.MaxPool((2, 2)), fl.flatten,
                    fl.Dense(16 * 7 * 7, 3))


def test_disabled_switches_the_kernels_off_for_the_block_and_on_again():
    """native.disabled(): inside, nothing reports the kernels in use, and graphs built there
    take MLX's kernels, with MLX's results; nested blocks and an exception inside leave the
    kernels as they were; outside, the routing asks again."""
    from fluxlike import Dense

    layer, x = Dense(8, 4, relu), mx.random.normal((3, 8), key=mx.random.key(0))
    before = (native.available(), native.adam_kernel() is not None)
    with native.disabled():
        assert not native.available() and not native.bfloat16_native()
        assert native.adam_kernel() is None and native.switch.ext is None
        inside = layer(x)
        with pytest.raises(RuntimeError, match="boom"), native.disabled():
            raise RuntimeError("boom")
        assert not native.available()  # the inner block's exit does not switch them on
    assert (native.available(), native.adam_kernel() is not None) == before == (
        INFO.available, INFO.available)
    ref = mx.maximum(x @ layer.weight.T + layer.bias, 0)
    np.testing.assert_allclose(np64(inside), np64(ref), rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("ac", [None, mx.bfloat16], ids=["float32", "autocast"])
def test_cnn_layers_run_native_kernels_in_training(ac, monkeypatch):
    """Conv (with its ReLU fused) and MaxPool run the native kernels in a training step, in
    float32 and under autocast (bfloat16 convolutions, forward and backward); the loss and
    float32 gradients agree with MLX's kernels (FLUXLIKE_NATIVE=0's path)."""
    from fluxlike import withgradient
    from fluxlike.losses import logitcrossentropy

    model = _cnn()
    x = mx.random.normal((16, 28, 28, 1), key=mx.random.key(0))
    y = mx.eye(3)[mx.arange(16) % 3]

    def step():
        loss, (g,) = withgradient(lambda m: logitcrossentropy(m(x), y), model, autocast=ac)
        mx.eval(loss, g)
        return loss, g

    calls: dict[str, list] = {"conv": [], "max_pool": []}
    # (the layers' convolution: native.ops.conv's arguments spelled out, act the ninth)
    for name, entry in (("conv", "conv_spelled_out"), ("max_pool", "max_pool")):
        kernel = getattr(native.ops, entry)
        monkeypatch.setattr(native.ops, entry, lambda *a, _k=kernel, _n=name, **kw: (
            calls[_n].append((a[0].dtype, a[8] if len(a) > 8 else kw.get("act"))),
            _k(*a, **kw))[1])
    loss, g = step()
    monkeypatch.undo()
    want = mx.float32 if ac is None else mx.bfloat16
    # (bfloat16 training convolutions: in oneDNN's bfloat16 kernels, or upcast in its float32
    # ones inside the primitive)
    assert [d for d, _ in calls["conv"]] == [want, want]
    assert all(a is relu for _, a in calls["conv"])
    assert [d for d, _ in calls["max_pool"]] == [want, want]
    from mlx.utils import tree_flatten

    if ac is None:  # float32: MLX's kernels give the same step
        with native.disabled():
            loss0, g0 = step()
        assert loss.item() == pytest.approx(loss0.item(), rel=1e-5)
        for (name, a), (_, b) in zip(tree_flatten(g), tree_flatten(g0), strict=True):
            assert a.dtype == mx.float32 == b.dtype, name
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4,
                                       atol=1e-5 * float(mx.abs(b).max()), err_msg=name)
        return
    # bfloat16: as far from float32's step as the float32-kernel emulation is (bfloat16
    # activations both; the roundings fall elsewhere, and ties in a pool go to the first)
    with native.disabled():
        ac = None
        loss32, g32 = step()
        ac = mx.bfloat16
        loss_emu, g_emu = step()
    assert abs(loss.item() - loss32.item()) <= 2 * abs(loss_emu.item() - loss32.item()) + 1e-3
    for (name, a), (_, b), (_, r) in zip(tree_flatten(g), tree_flatten(g_emu),
                                         tree_flatten(g32), strict=True):
        assert a.dtype == mx.float32, name
        scale = float(mx.abs(r).max())
        mine, theirs = (float(mx.abs(v - r).max()) / scale for v in (a, b))
        assert mine <= 1.5 * theirs + 0.01, (name, mine, theirs)


def test_export_inside_disabled(tmp_path):
    """MLX cannot serialize the native primitives; inside native.disabled() a layer's graph
    takes MLX's kernels, and mx.export_function / import_function work (as the README says)."""
    from fluxlike import Dense

    layer, x = Dense(8, 4, relu), mx.random.normal((2, 8), key=mx.random.key(0))
    path = str(tmp_path / "dense.mlxfn")
    if INFO.available:
        with pytest.raises(ValueError, match="Unable to serialize primitive FluxlikeNative"):
            mx.export_function(str(tmp_path / "native.mlxfn"), lambda x: layer(x), x)
    with native.disabled():
        mx.export_function(path, lambda x: layer(x), x)
    (y,) = mx.import_function(path)(x)
    np.testing.assert_allclose(np64(y), np64(layer(x)), rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("ac", [None, mx.bfloat16], ids=["float32", "autocast"])
def test_vmap_over_a_cnn_and_per_sample_gradients(ac):
    """mx.vmap over a CNN's forward pass agrees with MLX's kernels (native.disabled()), and
    its per-sample gradients (mx.vmap of mx.grad: the native convolutions and max pooling
    folded over the mapped axis, the weight gradients once per member) with the gradients of
    each member taken one by one. (MLX's own convolution gradient has no vmap: AsStrided.)"""
    from mlx.utils import tree_flatten

    import fluxlike as fl
    from fluxlike.losses import logitcrossentropy

    if ac is not None and not native.bfloat16_native():
        pytest.skip("bfloat16 training without oneDNN's bfloat16 kernels runs the emulation, "
                    "which orders its backward pass with mx.depends: MLX has no vmap for it")
    mx.random.seed(3)
    model = fl.Chain(fl.Conv((3, 3), 1, 16, relu, padding=1), fl.MaxPool((2, 2)),
                     fl.Conv((3, 3), 16, 32, relu, padding=1), fl.MaxPool((2, 2)), fl.flatten,
                     fl.Dense(32 * 7 * 7, 3))
    xs = mx.random.normal((3, 2, 28, 28, 1), key=mx.random.key(1))  # 3 members of batch 2
    ys = mx.eye(3)[mx.arange(6).reshape(3, 2) % 3]
    params = model.trainable_parameters()

    def forward(x):
        with fl.autocast(ac) if ac else contextlib.nullcontext():
            return model(x).astype(mx.float32)

    def grads_of(x, y):
        def loss(p):
            model.update(p)
            return logitcrossentropy(forward(x), y)

        g = mx.grad(loss)(params)
        model.update(params)
        return g

    out = mx.vmap(forward)(xs)
    with native.disabled():
        out_ref = mx.vmap(forward)(xs)
    tol = 2e-2 if ac else 1e-4
    np.testing.assert_allclose(np64(out), np64(out_ref), rtol=tol, atol=tol)

    per_sample = dict(tree_flatten(mx.vmap(grads_of)(xs, ys)))
    one_by_one = [dict(tree_flatten(grads_of(xs[i], ys[i]))) for i in range(3)]
    assert per_sample.keys() == one_by_one[0].keys()
    for name, g in per_sample.items():
        assert g.shape[0] == 3, name
        for i in range(3):
            np.testing.assert_allclose(np64(g[i]), np64(one_by_one[i][name]), rtol=1e-4,
                                       atol=1e-5, err_msg=f"{name}, member {i}")


@needs_native
def test_vmap_of_an_input_gradient_that_does_not_depend_on_the_mapped_data():
    """The input gradient of a linear model does not depend on the mapped examples (only the
    weight gradient does): under mx.vmap it is still one per member, as with MLX's kernels."""
    from fluxlike import Dense

    layer = Dense(4, 3)
    xs = mx.random.normal((5, 2, 4), key=mx.random.key(0))

    def grads(x):
        def loss(p, x):
            layer.update(p)
            return layer(x).sum()

        return mx.grad(loss, argnums=(0, 1))(layer.trainable_parameters(), x)

    params = layer.trainable_parameters()
    (gp, gx) = mx.vmap(grads)(xs)
    layer.update(params)
    with native.disabled():
        (rp, rx) = mx.vmap(grads)(xs)
    layer.update(params)
    assert gx.shape == rx.shape == (5, 2, 4) and gp["weight"].shape == (5, 3, 4)
    np.testing.assert_allclose(np64(gx), np64(rx), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np64(gp["weight"]), np64(rp["weight"]), rtol=1e-5, atol=1e-6)


@needs_native
def test_per_example_gradients_of_a_small_cnn_with_fluxlike_gradient():
    """Per-example gradients (members of one example each) of a CNN whose float32
    convolution is too small to run natively in inference: fluxlike.gradient routes it to the
    native kernel (whose gradient MLX can vmap; MLX's own cannot), one gradient per example,
    equal to each example's own."""
    import fluxlike as fl
    from fluxlike.losses import logitcrossentropy

    mx.random.seed(3)
    model = fl.Chain(fl.Conv((3, 3), 1, 8, relu, padding=1), fl.MaxPool((2, 2)), fl.flatten,
                     fl.Dense(8 * 14 * 14, 3))
    xs = mx.random.normal((6, 1, 28, 28, 1), key=mx.random.key(0))
    ys = mx.eye(3)[mx.arange(6).reshape(6, 1) % 3]

    def per_example(x, y):
        return fl.gradient(lambda m: logitcrossentropy(m(x), y), model)[0]

    grads = mx.vmap(per_example)(xs, ys)
    for i in (0, 5):
        own = per_example(xs[i], ys[i])
        for layer in (0, 3):
            np.testing.assert_allclose(np64(grads["layers"][layer]["weight"][i]),
                                       np64(own["layers"][layer]["weight"]), rtol=1e-4,
                                       atol=1e-6)


@needs_native
@needs_f16_kernels
def test_a_float16_transformer_step_runs_on_onednns_float16_kernels():
    """Under ``autocast(mx.float16)`` with oneDNN's float16 kernels (AVX512-FP16) every
    product of a transformer block's training step - projections with their biases, attention's
    batched products, their gradients - runs on a brgemm kernel, never on oneDNN's reference
    implementation (a float16 bias once sent it there, ~1,000x slower), and the float32
    weights' gradients come back finite float32, as the emulation's do to float16's rounding."""
    from fluxlike_native import _ext

    import fluxlike as fl
    mx.random.seed(5)
    model = fl.Chain(fl.Dense(16, 32), fl.MultiHeadAttention(32, 4), fl.LayerNorm(32),
                     fl.Dense(32, 8, fl.gelu))
    x = mx.random.normal((3, 10, 16))

    def loss(m):
        return m(x).astype(mx.float32).square().mean()

    value, (grads,) = fl.withgradient(loss, model, autocast=mx.float16)
    mx.eval(value, grads)
    cached = dict(_ext.cache_impls())  # (the matmul primitives of the process so far)
    assert not [k for k in cached if k.startswith("ref")], cached
    assert cached.get("brg:avx512_core_fp16", 0) > 0, cached
    with native.disabled():
        e_value, (e_grads,) = fl.withgradient(loss, model, autocast=mx.float16)
    from mlx.utils import tree_flatten
    np.testing.assert_allclose(np64(value), np64(e_value), rtol=2**-8)
    for (name, g), (_, e) in zip(tree_flatten(grads), tree_flatten(e_grads), strict=True):
        assert g.dtype == mx.float32, name
        np.testing.assert_allclose(np64(g), np64(e), rtol=2**-6, atol=2**-9, err_msg=name)
